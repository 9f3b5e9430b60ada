// Fuzzed argument validation (see test_validate_fuzz.cpp for what and how): the
// low-latency dispatch and combine, the size hints, the shrink mask, the host top-k
// values, Config and set_num_sms. The harness: validate_fuzz_util.hpp.
#include <gtest/gtest.h>

#include "validate_fuzz_util.hpp"

namespace epx {
namespace {

using namespace vfuzz;

TEST(ValidateFuzz, LowLatencyDispatch) {
  Gen g(seed() ^ 4);
  Tally t;
  for (int i = 0; i < scaled(kLowLatencyDispatchSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    LowLatencyDispatchArgs a;
    a.num_max_dispatch_tokens_per_rank =
        static_cast<int>(good_or_wild(g, p, g.pick<int64_t>({1, 32, 128, 256, 1024})));
    const int64_t maxT = std::max(a.num_max_dispatch_tokens_per_rank, 1);
    const int64_t T = g.between(0, std::min<int64_t>(maxT, 300));
    const int64_t H = g.chance(p) ? g.wild() : 128 * g.between(1, 128);
    a.num_experts = static_cast<int>(good_or_wild(g, p, R * g.between(1, 1024 / R)));
    a.x = gen_tensor(g, DType::kBF16, {T, H}, dev, p);
    a.topk_idx = gen_tensor(g, DType::kI64, {T, g.between(1, 16)}, dev, p);
    a.use_fp8 = g.chance(0.7);
    a.round_scale = a.use_fp8 ? g.chance(0.5) : g.chance(p);
    a.use_ue8m0 = a.round_scale ? g.chance(0.5) : g.chance(p);
    const int64_t local = a.num_experts > 0 ? a.num_experts / R : 1;
    if (g.chance(0.3))
      a.cumulative_local_expert_recv_stats = gen_tensor(g, DType::kI32, {local}, dev, p);
    if (g.chance(0.3)) a.dispatch_wait_recv_cost_stats = gen_tensor(g, DType::kI64, {R}, dev, p);
    judge(
        t, low_latency_dispatch_rules(a, R, dev),
        [&] { validate::low_latency_dispatch(a, R, dev); },
        [&] {
          return "R=" + std::to_string(R) +
                 " maxT=" + std::to_string(a.num_max_dispatch_tokens_per_rank) +
                 " E=" + std::to_string(a.num_experts) + " x=" + show(a.x) +
                 " topk_idx=" + show(a.topk_idx) + " fp8/round/ue8m0=" + std::to_string(a.use_fp8) +
                 std::to_string(a.round_scale) + std::to_string(a.use_ue8m0) +
                 " stats=" + show(a.cumulative_local_expert_recv_stats) +
                 " wait=" + show(a.dispatch_wait_recv_cost_stats);
        });
  }
  expect_coverage(
      "low_latency_dispatch", t,
      {"num_max_dispatch_tokens_per_rank", "x", "hidden", "num_experts", "topk_idx", "use_fp8",
       "use_ue8m0", "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats"});
}

TEST(ValidateFuzz, LowLatencyCombine) {
  Gen g(seed() ^ 5);
  Tally t;
  for (int i = 0; i < scaled(kLowLatencyCombineSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    auto h = std::make_shared<LowLatencyHandle>();
    h->num_ranks = g.chance(p) ? gen_ranks(g) : R;
    h->num_experts = static_cast<int>(R * g.between(1, 32));
    h->num_max_dispatch_tokens_per_rank = static_cast<int>(g.pick<int64_t>({1, 8, 32, 128}));
    h->hidden = static_cast<int>(128 * g.between(1, 16));
    h->num_tokens = static_cast<int>(g.between(0, h->num_max_dispatch_tokens_per_rank));
    h->num_topk = static_cast<int>(g.between(1, 16));
    LowLatencyCombineArgs a;
    if (!g.chance(p / 3)) a.handle = h;
    const int64_t rows = static_cast<int64_t>(R) * h->num_max_dispatch_tokens_per_rank;
    a.x = gen_tensor(g, DType::kBF16, {h->num_experts / R, rows, h->hidden}, dev, p);
    a.topk_idx = gen_tensor(g, DType::kI64, {h->num_tokens, h->num_topk}, dev, p);
    a.topk_weights = gen_tensor(g, DType::kF32, {h->num_tokens, h->num_topk}, dev, p);
    if (g.chance(0.3)) a.out = gen_tensor(g, DType::kBF16, {h->num_tokens, h->hidden}, dev, p);
    if (g.chance(0.3)) a.combine_wait_recv_cost_stats = gen_tensor(g, DType::kI64, {R}, dev, p);
    judge(
        t, low_latency_combine_rules(a, R, dev), [&] { validate::low_latency_combine(a, R, dev); },
        [&] {
          return "R=" + std::to_string(R) + " x=" + show(a.x) + " topk_idx=" + show(a.topk_idx) +
                 " topk_weights=" + show(a.topk_weights) + " out=" + show(a.out) +
                 " stats=" + show(a.combine_wait_recv_cost_stats) +
                 (a.handle ? " handle R=" + std::to_string(h->num_ranks) : " no handle");
        });
  }
  expect_coverage(
      "low_latency_combine", t,
      {"handle", "x", "topk_idx", "topk_weights", "out", "combine_wait_recv_cost_stats"});
}

TEST(ValidateFuzz, LowLatencySizesAndSizeHint) {
  // clean_low_latency_buffer's and get_low_latency_rdma_size_hint's arguments
  Gen g(seed() ^ 6);
  Tally t;
  for (int i = 0; i < scaled(kSizeHintSets); ++i) {
    const double p = gen_badness(g);
    // Low-latency ops run across nodes: up to epx::kMaxRanks (160) ranks.
    const int R = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, -1, 3, 16, 160, 161, 1000})
                                               : gen_ranks(g));
    const int maxT = static_cast<int>(good_or_wild(g, p, g.pick<int64_t>({1, 64, 128, 1024})));
    const int H = static_cast<int>(good_or_wild(g, p, 128 * g.between(1, 128)));
    const int E = static_cast<int>(good_or_wild(g, p, std::max(R, 1) * g.between(1, 1024 / 8)));
    Verdict v;
    v.flag(R < 1 || R > 160, "num_ranks");
    if (R >= 1) low_latency_size_rules(v, maxT, H, E, R);
    std::size_t bytes = 0;
    judge(
        t, v, [&] { bytes = Buffer::get_low_latency_rdma_size_hint(maxT, H, R, E); },
        [&] {
          return "maxT=" + std::to_string(maxT) + " H=" + std::to_string(H) +
                 " R=" + std::to_string(R) + " E=" + std::to_string(E);
        });
    if (v.broken.empty()) {  // at least its two zero-copy inputs [E/R, R*maxT, H] bf16
      const std::size_t zero_copy = 2ull * (E / R) * R * maxT * H;
      EXPECT_GE(bytes, 2 * zero_copy) << maxT << " " << H << " " << R << " " << E;
    }
  }
  expect_coverage("get_low_latency_rdma_size_hint", t,
                  {"num_ranks", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"});
}

TEST(ValidateFuzz, InternodeSizeHint) {
  // get_internode_nvl_size_hint: the whole-call worst case of the
  // high-throughput ops across nodes (docs/api.md): tokens >= 0; hidden > 0,
  // a multiple of 8 (16-byte BF16 rows); 1 to 160 ranks; 1 to 8 ranks per
  // node, dividing the ranks; top-k 0 to 16.
  Gen g(seed() ^ 11);
  Tally t;
  for (int i = 0; i < scaled(kInternodeHintSets); ++i) {
    const double p = gen_badness(g);
    const int R = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, -1, 3, 6, 160, 161, 1000})
                                               : g.pick<int>({2, 4, 8, 16, 32, 64}));
    const int L = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, -1, 3, 5, 9, 16})
                                               : g.pick<int>({1, 2, 4, 8}));
    const int T = static_cast<int>(good_or_wild(g, p, g.between(0, 4096)));
    const int H = static_cast<int>(good_or_wild(g, p, 8 * g.between(1, 1024)));
    const int K = static_cast<int>(good_or_wild(g, p, g.between(0, 16)));
    Verdict v;
    v.flag(T < 0, "num_max_tokens");
    v.flag(H <= 0 || H % 8 != 0, "hidden");
    v.flag(R < 1 || R > 160, "num_ranks");
    v.flag(R >= 1 && R <= 160 && (L < 1 || L > 8 || R % L != 0), "ranks_per_node");
    v.flag(K < 0 || K > 16, "num_topk");
    std::size_t bytes = 0;
    judge(
        t, v, [&] { bytes = Buffer::get_internode_nvl_size_hint(T, H, R, L, K); },
        [&] {
          return "T=" + std::to_string(T) + " H=" + std::to_string(H) + " R=" + std::to_string(R) +
                 " L=" + std::to_string(L) + " K=" + std::to_string(K);
        });
    if (v.broken.empty() && R / L > 1) {
      // At least the other nodes' rows of one token-sized record each, and
      // growing with the tokens.
      EXPECT_GE(bytes, static_cast<std::size_t>(T) * 2u * H)
          << T << " " << H << " " << R << " " << L;
      EXPECT_GE(Buffer::get_internode_nvl_size_hint(T + 1, H, R, L, K), bytes);
    }
  }
  expect_coverage("get_internode_nvl_size_hint", t,
                  {"num_max_tokens", "hidden", "num_ranks", "ranks_per_node", "num_topk"});
}

TEST(ValidateFuzz, ShrinkMaskArguments) {
  // low_latency_update_mask_buffer's rank and low_latency_query_mask_buffer's tensor
  Gen g(seed() ^ 7);
  Tally t;
  for (int i = 0; i < scaled(kMaskSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    const int rank = static_cast<int>(good_or_wild(g, p, g.between(0, R - 1)));
    const TensorView status = gen_tensor(g, DType::kI32, {R}, dev, p);
    Verdict v;
    v.flag(rank < 0 || rank >= R, "rank_to_mask");
    v.flag(!tensor_ok(status, DType::kI32, {R}, dev), "mask_status");
    judge(
        t, v,
        [&] {
          validate::rank_in_group("low_latency_update_mask_buffer", "rank_to_mask", rank, R);
          validate::tensor("low_latency_query_mask_buffer", "mask_status", status, DType::kI32, {R},
                           dev);
        },
        [&] {
          return "R=" + std::to_string(R) + " rank=" + std::to_string(rank) + " " + show(status);
        });
  }
  expect_coverage("shrink masks", t, {"rank_to_mask", "mask_status"});
}

TEST(ValidateFuzz, HostTopkValues) {
  // topk_idx values, checked on the host for host tensors: -1 or an expert id
  Gen g(seed() ^ 8);
  Tally t;
  for (int i = 0; i < scaled(kHostTopkSets); ++i) {
    const double p = gen_badness(g);
    const int E = static_cast<int>(g.between(1, 512));
    std::vector<int64_t> ids(static_cast<size_t>(g.between(0, 64)));
    for (auto& id : ids)
      id = g.chance(p) ? g.pick<int64_t>({-2, -100, E, E + 1, g.between(-600, 600)})
                       : g.between(-1, E - 1);
    const TensorView v8 =
        TensorView::contiguous(ids.data(), DType::kI64, {static_cast<int64_t>(ids.size())}, kCpu);
    Verdict v;
    for (int64_t id : ids) v.flag(id != -1 && (id < 0 || id >= E), "topk_idx");
    judge(
        t, v, [&] { validate::topk_idx_values("get_dispatch_layout", v8, E); },
        [&] { return "E=" + std::to_string(E) + " n=" + std::to_string(ids.size()); });
  }
  expect_coverage("topk_idx values", t, {"topk_idx"});
}

TEST(ValidateFuzz, Config) {
  Gen g(seed() ^ 9);
  Tally t;
  for (int i = 0; i < scaled(kConfigSets); ++i) {
    const double p = gen_badness(g);
    Config c;
    c.num_sms = static_cast<int>(good_or_wild(g, p, 2 * g.between(1, 33)));
    c.num_send_sms = static_cast<int>(g.chance(p) ? g.wild() : g.pick<int64_t>({0, 0, 1, 4}));
    c.num_max_send_tokens = static_cast<int>(good_or_wild(g, p, g.between(1, 64)));
    c.num_max_recv_tokens =
        static_cast<int>(good_or_wild(g, p, c.num_max_send_tokens * g.between(1, 64)));
    c.pull_dispatch = g.chance(0.3);
    const int R = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, -1, 9, 16}) : gen_ranks(g));
    const int sms = static_cast<int>(g.pick<int64_t>({0, 132, 66, 33, 16}));
    judge(
        t, config_rules(c, R, sms), [&] { c.validate(R, sms); },
        [&] {
          return "num_sms=" + std::to_string(c.num_sms) +
                 " send_sms=" + std::to_string(c.num_send_sms) +
                 " send_tokens=" + std::to_string(c.num_max_send_tokens) +
                 " recv_tokens=" + std::to_string(c.num_max_recv_tokens) +
                 " pull=" + std::to_string(c.pull_dispatch) + " R=" + std::to_string(R) +
                 " device_sms=" + std::to_string(sms);
        });
  }
  expect_coverage("Config::validate", t,
                  {"config.num_sms", "config.num_send_sms", "config.num_max_send_tokens",
                   "config.num_max_recv_tokens", "num_ranks"});
}

TEST(ValidateFuzz, SetNumSms) {
  const int saved = Buffer::num_sms();
  Gen g(seed() ^ 10);
  Tally t;
  for (int i = 0; i < scaled(kNumSmsSets); ++i) {
    const int n = static_cast<int>(good_or_wild(g, 0.5, 2 * g.between(1, 66)));
    Verdict v;
    v.flag(n < 2 || n % 2 != 0, "num_sms");  // an even number of SMs, at least 2
    judge(
        t, v, [&] { Buffer::set_num_sms(n); }, [&] { return "n=" + std::to_string(n); });
    if (v.broken.empty()) EXPECT_EQ(Buffer::num_sms(), n);
  }
  Buffer::set_num_sms(saved);
  expect_coverage("set_num_sms", t, {"num_sms"});
}

}  // namespace
}  // namespace epx
