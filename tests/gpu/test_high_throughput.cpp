// High-throughput dispatch/combine on all local GPUs vs the CPU reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/internode_rings.hpp"
#include "common/internode_route.hpp"
#include "epx/reference.hpp"
#include "gpu/harness.hpp"

namespace epx::test {
namespace {

struct HtCase {
  int num_tokens;
  int hidden;
  int num_topk;
  int num_experts;
  bool fp8;
  double masked;  ///< fraction of -1 top-k slots
  bool with_weights;
  int expert_alignment;
  bool starve_rank1;  ///< no token routes to rank 1 (a rank that receives nothing)
  /// Of every 64 tokens, 8..23 are padding (top-k all -1) and 32..47 go only
  /// to their own rank: whole pull batches that no peer takes.
  bool peerless_runs = false;
  /// Across nodes: no token routes to node 1 (a node that receives nothing).
  bool starve_node1 = false;
  std::string name() const {
    return "T" + std::to_string(num_tokens) + "_H" + std::to_string(hidden) +
           (fp8 ? "_fp8" : "_bf16") + "_K" + std::to_string(num_topk) + "_E" +
           std::to_string(num_experts) + (starve_rank1 ? "_starve" : "") + "_a" +
           std::to_string(expert_alignment);
  }
};

/// Every rank builds every rank's input from the seed, so the reference needs
/// no communication.
std::vector<ref::HtInput> make_inputs(const HtCase& c, int R, uint64_t seed) {
  std::vector<ref::HtInput> in(R);
  const int epr = c.num_experts / R;
  for_each_rank(R, [&](int r) {
    auto& x = in[r];
    x.num_tokens = c.num_tokens + (r % 2);  // ranks differ in token count
    if (c.num_tokens == 0) x.num_tokens = 0;
    const uint64_t s = seed * 1000003 + r * 7919;
    x.topk_idx = random_topk(x.num_tokens, c.num_topk, c.num_experts, c.masked, s);
    if (c.starve_rank1 && R > 1)
      for (auto& e : x.topk_idx)
        if (e >= epr && e < 2 * epr) e = -1;
    if (c.starve_node1) {
      const int rpn = world().buffer->num_nvl_ranks();
      for (auto& e : x.topk_idx)
        if (e >= rpn * epr && e < 2 * rpn * epr) e = -1;
    }
    if (c.peerless_runs)
      for (int t = 0; t < x.num_tokens; ++t) {
        const int i = t % 64;
        if (i < 8 || (i >= 24 && i < 32) || i >= 48) continue;
        for (int k = 0; k < c.num_topk; ++k)
          x.topk_idx[static_cast<std::size_t>(t) * c.num_topk + k] =
              i < 24 || k >= epr ? -1 : r * epr + k;
      }
    const std::size_t n = static_cast<std::size_t>(x.num_tokens) * c.hidden;
    auto xb = random_bf16(n, s + 1);
    if (c.fp8) {
      x.fp8 = true;
      x.x_fp8.resize(n);
      x.x_scales.resize(static_cast<std::size_t>(x.num_tokens) * (c.hidden / 128));
      std::vector<float> row(c.hidden);
      for (int t = 0; t < x.num_tokens; ++t) {
        for (int h = 0; h < c.hidden; ++h)
          row[h] = ref::bf16_to_float(xb[static_cast<std::size_t>(t) * c.hidden + h]);
        ref::quantize_row_fp8(row.data(), c.hidden, false,
                              x.x_fp8.data() + static_cast<std::size_t>(t) * c.hidden,
                              x.x_scales.data() + static_cast<std::size_t>(t) * (c.hidden / 128));
      }
    } else {
      x.x_bf16 = std::move(xb);
    }
    if (c.with_weights)
      x.topk_weights = random_f32(static_cast<std::size_t>(x.num_tokens) * c.num_topk, s + 2);
  });
  return in;
}

float bf(uint16_t v) {
  return ref::bf16_to_float(v);
}

/// One rank's BF16 dispatch input on the device (rows, top-k ids, weights),
/// its layout from `buf`, and DispatchArgs over them (x, top-k, weights, the
/// layout, the streams); the arrays and the layout live as long as it does.
struct DeviceInput {
  int T;
  DeviceArray<int64_t> topk;
  DeviceArray<uint16_t> x;
  DeviceArray<float> w;
  Layout layout;
  DispatchArgs a;
  DeviceInput(Buffer& buf, const ref::HtInput& in, int hidden, int num_topk, int num_experts,
              const StreamArgs& s)
      : T(in.num_tokens),
        topk(to_device(in.topk_idx)),
        x(to_device(in.x_bf16)),
        w(to_device(in.topk_weights)),
        layout(
            buf.get_dispatch_layout(view(topk.get(), DType::kI64, {T, num_topk}), num_experts, s)) {
    a.x = view(x.get(), DType::kBF16, {T, hidden});
    a.topk_idx = view(topk.get(), DType::kI64, {T, num_topk});
    a.topk_weights = view(w.get(), DType::kF32, {T, num_topk});
    a.set_layout(layout);
    a.streams = s;
  }
};

/// The default dispatch config within this rank's SM share (in-process ranks
/// split a GPU), with `rows` ring rows per peer (0: the default).
Config shared_gpu_config(int rows = 0) {
  Config cfg = get_dispatch_config(world().num_ranks);
  cfg.num_sms = std::min(cfg.num_sms, sm_budget());
  if (rows > 0) cfg.num_max_recv_tokens = rows;
  return cfg;
}

/// Options of a Buffer of the HT size hint for `c` (BF16 rows), with this
/// deadline and allocator.
BufferOptions hint_sized_options(const HtCase& c, int R, double timeout_s, Allocator alloc) {
  BufferOptions o;
  o.num_nvl_bytes = static_cast<int64_t>(
      get_dispatch_config(R).get_nvl_buffer_size_hint(2u * c.hidden, R, c.num_topk));
  o.timeout_s = timeout_s;
  o.allocator = std::move(alloc);
  return o;
}

/// `ring_calls`, where given, counts the dispatches whose handle says they
/// took the rings across nodes (DispatchHandle::took_rings).
void run_case(const HtCase& c, int iters, uint64_t seed0,
              const std::optional<Config>& config = std::nullopt, Buffer* buffer = nullptr,
              int* ring_calls = nullptr) {
  auto& w = world();
  Buffer* const buf = buffer ? buffer : w.buffer.get();
  const int R = w.num_ranks, me = w.rank;
  if (c.num_experts % R) GTEST_SKIP() << "experts not divisible by ranks";
  StreamArgs s;
  s.stream = w.stream;
  for (int it = 0; it < iters; ++it) {
    const uint64_t seed = seed0 + it;
    auto in = make_inputs(c, R, seed);
    const auto& mine = in[me];
    const int T = mine.num_tokens, H = c.hidden, K = c.num_topk;

    auto d_topk = to_device(mine.topk_idx);
    auto layout =
        buf->get_dispatch_layout(view(d_topk.get(), DType::kI64, {T, K}), c.num_experts, s);
    cudaStreamSynchronize(w.stream);
    auto rl = ref::get_dispatch_layout(mine.topk_idx, T, K, c.num_experts, R);
    ASSERT_EQ(to_host<int>(layout.num_tokens_per_rank), rl.num_tokens_per_rank) << c.name();
    ASSERT_EQ(to_host<int>(layout.num_tokens_per_expert), rl.num_tokens_per_expert) << c.name();
    {
      auto got = to_host<uint8_t>(layout.is_token_in_rank);
      ASSERT_EQ(got, rl.is_token_in_rank) << c.name();
    }
    const int rpn = buf->num_nvl_ranks();
    const bool across = rpn < R;
    ASSERT_EQ(layout.num_tokens_per_rdma_rank.defined(), across)
        << "one node: DeepEP returns None; across nodes the tokens per node";

    DeviceArray<uint8_t> d_x =
        c.fp8 ? to_device(mine.x_fp8) : to_device_bytes(mine.x_bf16.data(), mine.x_bf16.size() * 2);
    auto d_scales = to_device(mine.x_scales);
    auto d_w = to_device(mine.topk_weights);
    DispatchArgs a;
    a.x = view(d_x.get(), c.fp8 ? DType::kFP8E4M3 : DType::kBF16, {T, H});
    if (c.fp8) a.x_scales = view(d_scales.get(), DType::kF32, {T, H / 128});
    a.topk_idx = view(d_topk.get(), DType::kI64, {T, K});
    if (c.with_weights) a.topk_weights = view(d_w.get(), DType::kF32, {T, K});
    a.set_layout(layout);
    a.expert_alignment = c.expert_alignment;
    a.streams = s;
    a.config = config;
    auto res = buf->dispatch(a);
    cudaStreamSynchronize(w.stream);
    if (ring_calls && res.handle->took_rings()) ++*ring_calls;

    auto ref_out = ref::ht_dispatch(in, H, K, c.num_experts, c.expert_alignment);
    const auto& ro = ref_out[me];
    const int N = ro.num_recv_tokens;
    ASSERT_EQ(res.recv_x.size(0), N) << c.name();
    ASSERT_EQ(res.num_recv_tokens_per_expert, ro.num_recv_tokens_per_expert) << c.name();
    if (c.fp8) {
      ASSERT_EQ(to_host<uint8_t>(res.recv_x), ro.recv_x_fp8) << c.name();
      auto sc = to_host<float>(*res.recv_x_scales);
      ASSERT_EQ(std::memcmp(sc.data(), ro.recv_x_scales.data(), sc.size() * 4), 0) << c.name();
    } else {
      ASSERT_EQ(to_host<uint16_t>(res.recv_x), ro.recv_x_bf16) << c.name();
    }
    ASSERT_EQ(to_host<int64_t>(*res.recv_topk_idx), ro.recv_topk_idx) << c.name();
    if (c.with_weights)
      ASSERT_EQ(to_host<float>(*res.recv_topk_weights), ro.recv_topk_weights) << c.name();
    ASSERT_EQ(to_host<int>(res.handle->recv_src_idx), ro.recv_src_idx) << c.name();
    ASSERT_EQ(to_host<int>(res.handle->rank_prefix_matrix), ro.rank_prefix_matrix) << c.name();
    ASSERT_EQ(to_host<int>(res.handle->source_num_tokens), ro.source_num_tokens) << c.name();

    // Cached dispatch reuses the layout and must reproduce recv_x.
    DispatchArgs cached;
    cached.x = a.x;
    cached.x_scales = a.x_scales;
    cached.handle = res.handle;
    cached.streams = s;
    cached.config = config;
    auto res2 = buf->dispatch(cached);
    cudaStreamSynchronize(w.stream);
    if (c.fp8) {
      ASSERT_EQ(to_host<uint8_t>(res2.recv_x), ro.recv_x_fp8) << c.name() << " (cached)";
    } else {
      ASSERT_EQ(to_host<uint16_t>(res2.recv_x), ro.recv_x_bf16) << c.name() << " (cached)";
    }

    // Combine: expert outputs are fresh random rows; bias on odd iterations.
    std::vector<std::vector<uint16_t>> outs(R);
    std::vector<ref::HtCombineInput> cin(R);
    for_each_rank(R, [&](int r) {
      cin[r].x =
          random_bf16(static_cast<std::size_t>(ref_out[r].num_recv_tokens) * H, seed * 31 + r);
      if (c.with_weights) cin[r].topk_weights = ref_out[r].recv_topk_weights;
      if (it % 2 == 1) {
        cin[r].bias_0 = random_bf16(static_cast<std::size_t>(in[r].num_tokens) * H, seed * 37 + r);
        cin[r].bias_1 = random_bf16(static_cast<std::size_t>(in[r].num_tokens) * H, seed * 41 + r);
      }
    });
    auto d_cx = to_device(cin[me].x);
    auto d_cw = to_device(cin[me].topk_weights);
    auto d_b0 = to_device(cin[me].bias_0);
    auto d_b1 = to_device(cin[me].bias_1);
    CombineArgs ca;
    ca.x = view(d_cx.get(), DType::kBF16, {N, H});
    ca.handle = res.handle;
    if (c.with_weights) ca.topk_weights = view(d_cw.get(), DType::kF32, {N, K});
    if (it % 2 == 1) {
      ca.bias_0 = view(d_b0.get(), DType::kBF16, {T, H});
      ca.bias_1 = view(d_b1.get(), DType::kBF16, {T, H});
    }
    ca.streams = s;
    ca.config = config;
    auto cres = buf->combine(ca);
    cudaStreamSynchronize(w.stream);
    // Across nodes each node's sum crosses the network as BF16 (the
    // reference's ranks_per_node), added in the reference's order: bit-exact.
    auto rc = ref::ht_combine(in, cin, H, K, c.num_experts, across ? rpn : 0);
    auto got = to_host<uint16_t>(cres.combined_x);
    ASSERT_EQ(got.size(), rc[me].combined_x.size());
    if (across) EXPECT_EQ(got, rc[me].combined_x) << c.name() << ": combined_x not bit-exact";
    std::size_t bad = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const float g = bf(got[i]), r = bf(rc[me].combined_x[i]);
      if (!(std::fabs(g - r) <= 1e-2f * std::fabs(r) + 1e-2f)) ++bad;
    }
    EXPECT_EQ(bad, 0u) << c.name() << ": combined_x differs from the reference in " << bad
                       << " values";
    if (c.with_weights) {
      auto gw = to_host<float>(*cres.combined_topk_weights);
      ASSERT_EQ(gw.size(), rc[me].combined_topk_weights.size());
      for (std::size_t i = 0; i < gw.size(); ++i)
        ASSERT_NEAR(gw[i], rc[me].combined_topk_weights[i], 1e-5f) << c.name() << " weight " << i;
    }
    ASSERT_TRUE(all_ranks(!rank_failed())) << "another rank failed " << c.name();
  }
}

/// Across (virtual) nodes: get_dispatch_layout also counts, per node, the
/// tokens with an expert there (DeepEP's num_tokens_per_rdma_rank), with top-k
/// picks of one node's ranks counted once, -1 slots and empty tokens; the
/// per-rank outputs as within a node.
EPX_GPU_TEST(Network, DispatchLayoutPerNode) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  const int rpn = R / w.buffer->num_rdma_ranks();
  if (w.buffer->num_rdma_ranks() < 2) GTEST_SKIP() << "needs ranks in several nodes";
  StreamArgs s;
  s.stream = w.stream;
  for (const auto& [T, K, E] :
       {std::tuple{300, 8, 16 * R}, {1, 4, 4 * R}, {0, 2, 2 * R}, {700, 16, 64 * R}}) {
    HtCase c{T, 128, K, E, false, 0.2, false, 1, false};
    auto in = make_inputs(c, R, 4242 + T);
    const auto& mine = in[me];
    auto d_topk = to_device(mine.topk_idx);
    auto layout =
        w.buffer->get_dispatch_layout(view(d_topk.get(), DType::kI64, {mine.num_tokens, K}), E, s);
    ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    auto rl = ref::get_dispatch_layout(mine.topk_idx, mine.num_tokens, K, E, R, rpn);
    ASSERT_TRUE(layout.num_tokens_per_rdma_rank.defined());
    ASSERT_EQ(to_host<int>(layout.num_tokens_per_rdma_rank), rl.num_tokens_per_node)
        << "T=" << T << " K=" << K;
    ASSERT_EQ(to_host<int>(layout.num_tokens_per_rank), rl.num_tokens_per_rank);
    ASSERT_EQ(to_host<int>(layout.num_tokens_per_expert), rl.num_tokens_per_expert);
    ASSERT_EQ(to_host<uint8_t>(layout.is_token_in_rank), rl.is_token_in_rank);
  }
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

EPX_GPU_TEST(HighThroughput, Bf16Hidden7168) {
  run_case({512, 7168, 8, 256, false, 0.1, true, 1, false}, 2, 11);
}
EPX_GPU_TEST(HighThroughput, Fp8Hidden7168) {
  run_case({512, 7168, 8, 256, true, 0.1, true, 1, false}, 2, 12);
}
EPX_GPU_TEST(HighThroughput, HiddenSizes) {
  for (int h : {256, 1024, 2048, 2880, 4096, 8192})
    run_case({300, h, 8, 64, false, 0.05, true, 1, false}, 1, 100 + h);
  for (int h : {2048, 4096, 8192})
    run_case({300, h, 8, 64, true, 0.05, false, 1, false}, 1, 200 + h);
}
/// The Python suite's HT case: a fresh buffer of the size hint, hidden 256.
EPX_GPU_TEST(HighThroughput, FreshHintSizedBuffer) {
  const int R = world().num_ranks;
  const HtCase c{64, 256, 4, 8 * R, false, 0.1, true, 1, false};
  BufferOptions o;
  o.num_nvl_bytes =
      static_cast<int64_t>(get_dispatch_config(R).get_nvl_buffer_size_hint(2u * c.hidden, R));
  o.timeout_s = 20;
  o.allocator = poisoning_allocator();
  Buffer b(world().comm, o);
  run_case(c, 3, 31, std::nullopt, &b);
  b.destroy();
}
/// An allocator that aligns int32 outputs to 4 bytes only: the handle's parts
/// (carved from one int32 allocation) and the int32 outputs still work.
EPX_GPU_TEST(HighThroughput, Int32AlignedAllocator) {
  const int R = world().num_ranks;
  const HtCase c{64, 1024, 4, 8 * R, true, 0.1, true, 1, false};
  Buffer b(world().comm, hint_sized_options(c, R, 20, int32_unaligned_allocator()));
  run_case(c, 2, 91, std::nullopt, &b);
  b.destroy();
}
/// Buffers whose sizes differ between ranks are refused on every rank (no
/// rank waits for the others), and a buffer of equal sizes works after that.
EPX_GPU_TEST(HighThroughput, UnequalBufferSizesAreRefused) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  if (R < 2) GTEST_SKIP() << "needs a peer";
  for (const char* field : {"num_nvl_bytes", "num_rdma_bytes"}) {
    BufferOptions o;
    o.num_nvl_bytes = 1 << 22;
    o.num_rdma_bytes = 1 << 22;
    (std::string(field) == "num_nvl_bytes" ? o.num_nvl_bytes : o.num_rdma_bytes) +=
        me == R - 1 ? 4096 : 0;
    o.timeout_s = 20;
    expect_error(std::string(field) + " unequal",
                 [&] {
                   Buffer b(w.comm, o);
                   b.destroy();
                 },
                 {field, "same on every rank"});
  }
  EXPECT_TRUE(all_ranks(!rank_failed()));
  const HtCase c{64, 256, 4, 8 * R, false, 0.1, true, 1, false};
  BufferOptions o;
  o.num_nvl_bytes =
      static_cast<int64_t>(get_dispatch_config(R).get_nvl_buffer_size_hint(2u * c.hidden, R));
  o.timeout_s = 20;
  Buffer b(w.comm, o);
  run_case(c, 1, 41, std::nullopt, &b);
  b.destroy();
}
EPX_GPU_TEST(HighThroughput, RankReceivesNothing) {
  run_case({256, 2048, 4, 32, false, 0.0, true, 1, true}, 1, 13);
}
EPX_GPU_TEST(HighThroughput, OneAndZeroTokens) {
  run_case({1, 2048, 8, 64, false, 0.0, true, 1, false}, 1, 14);
  run_case({0, 2048, 8, 64, false, 0.0, true, 1, false}, 1, 15);
}
EPX_GPU_TEST(HighThroughput, ExpertAlignmentAndMaskedRows) {
  run_case({333, 4096, 6, 48, false, 0.5, true, 128, false}, 1, 16);
}
/// Chunks of 1 row, of more rows than a warp batches at once (32), and of an
/// odd size; few and many send SMs.
EPX_GPU_TEST(HighThroughput, ChunkSizesAndSmSplits) {
  struct Split {
    int chunk, sms, send;
  };
  for (const Split sp : {Split{1, 3, 1}, Split{48, 6, 2}, Split{37, 24, 20}, Split{8, 40, 8}}) {
    Config cfg = get_dispatch_config(world().num_ranks);
    cfg.num_max_send_tokens = sp.chunk;
    cfg.num_sms = std::min(sp.sms, sm_budget());  // in-process ranks split a GPU
    cfg.num_send_sms = std::min(sp.send, cfg.num_sms - 1);
    run_case({700, 4096, 8, 64, false, 0.1, true, 1, false}, 1, 300 + sp.chunk, cfg);
    run_case({300, 2048, 8, 64, true, 0.1, true, 1, false}, 1, 400 + sp.chunk, cfg);
  }
}
/// Rings smaller than a pair's rows: every pair laps, senders wait for the
/// receivers' credits (one slot: every chunk after the first waits), in
/// dispatch, cached dispatch and combine, BF16 and FP8, with chunks that do
/// and do not divide the ring.
EPX_GPU_TEST(HighThroughput, RingsLap) {
  struct Ring {
    int rows, chunk;
  };
  for (const Ring rg : {Ring{64, 8}, Ring{20, 8}, Ring{8, 8}, Ring{5, 1}}) {
    Config cfg = shared_gpu_config(rg.rows);
    cfg.num_max_send_tokens = rg.chunk;
    run_case({900, 2048, 8, 64, false, 0.1, true, 1, false}, 1, 500 + rg.rows, cfg);
    run_case({300, 4096, 8, 64, true, 0.1, true, 1, false}, 1, 600 + rg.rows, cfg);
  }
  // The standard call through a ring of a quarter of its rows.
  Config cfg = shared_gpu_config(1024);
  run_case({4095, 7168, 8, 256, false, 0.0, true, 1, false}, 1, 700, cfg);
}
/// The pull dispatch (Config::pull_dispatch: receivers read the rows from the
/// sender's export ring): BF16 and FP8, cached, few and many send SMs, export
/// rings that do not lap and that lap (64 and 8 rows per peer; 5 rows at EP2:
/// a ring of one 5-token batch, so every batch waits for its readers'
/// credits), with runs of tokens no peer takes, then the 4096-token workload
/// with the default pull config.
EPX_GPU_TEST(HighThroughput, PullDispatch) {
  struct Ring {
    int rows, send;
  };
  for (const Ring rg : {Ring{4096, 0}, Ring{64, 1}, Ring{8, 2}, Ring{5, 1}}) {
    Config cfg = shared_gpu_config(rg.rows);
    cfg.pull_dispatch = true;
    cfg.num_max_send_tokens = std::min(cfg.num_max_send_tokens, rg.rows);
    cfg.num_send_sms = std::min(rg.send, cfg.num_sms - 1);
    run_case({900, 2048, 8, 64, false, 0.1, true, 1, false}, 1, 800 + rg.rows, cfg);
    run_case({300, 4096, 8, 64, true, 0.1, true, 1, false}, 1, 900 + rg.rows, cfg);
    // Batches no peer takes, in rings that lap: a slot's next writer must
    // still wait for the readers of its earlier batches.
    run_case({1000, 2048, 8, 64, false, 0.0, true, 1, false, true}, 1, 1100 + rg.rows, cfg);
  }
  Config cfg = shared_gpu_config();
  cfg.pull_dispatch = true;
  run_case({4095, 7168, 8, 256, false, 0.0, true, 1, false}, 1, 1000, cfg);
}
EPX_GPU_TEST(HighThroughput, FullWorkload4096) {
  run_case({4095, 7168, 8, 256, false, 0.0, true, 1, false}, 1, 17);
}  // ranks hold 4095 or 4096 tokens

/// 200 back-to-back dispatch+combine pairs on fixed inputs without
/// reallocating; each result is checked (catches races between calls).
void stress_calls(int calls, const std::optional<Config>& config) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, T = 256, H = 2048, K = 8, E = 64;
  HtCase c{T, H, K, E, false, 0.1, true, 1, false};
  auto in = make_inputs(c, R, 99);
  auto ro = ref::ht_dispatch(in, H, K, E, 1);
  const auto& mine = in[me];
  StreamArgs s;
  s.stream = w.stream;
  DeviceInput d(*w.buffer, mine, H, K, E, s);
  d.a.config = config;
  const auto rl = ref::get_dispatch_layout(mine.topk_idx, mine.num_tokens, K, E, R);
  int bad_calls = 0;
  for (int i = 0; i < calls; ++i) {
    auto res = w.buffer->dispatch(d.a);
    CombineArgs ca;
    ca.x = res.recv_x.view;
    ca.handle = res.handle;
    ca.streams = s;
    ca.config = config;
    auto cres = w.buffer->combine(ca);
    cudaStreamSynchronize(w.stream);
    if (to_host<uint16_t>(res.recv_x) != ro[me].recv_x_bf16) ++bad_calls;
    // combine(dispatch(x)) = x times the number of ranks the token reached
    auto got = to_host<uint16_t>(cres.combined_x);
    for (int t = 0; t < mine.num_tokens && bad_calls == 0; ++t) {
      int n = 0;
      for (int r = 0; r < R; ++r) n += rl.is_token_in_rank[static_cast<std::size_t>(t) * R + r];
      for (int h = 0; h < H; ++h) {
        const float want = n * bf(mine.x_bf16[static_cast<std::size_t>(t) * H + h]);
        const float g = bf(got[static_cast<std::size_t>(t) * H + h]);
        if (!(std::fabs(g - want) <= 1e-2f * std::fabs(want) + 1e-6f)) {
          ++bad_calls;
          break;
        }
      }
    }
  }
  EXPECT_EQ(bad_calls, 0);
  EXPECT_TRUE(all_ranks(bad_calls == 0));
}
EPX_GPU_TEST(HighThroughput, Stress200Calls) {
  stress_calls(200, std::nullopt);
}
/// The same through rings of 16 rows (chunks of 4): every call laps.
EPX_GPU_TEST(HighThroughput, Stress200CallsLapping) {
  Config cfg = shared_gpu_config(16);
  cfg.num_max_send_tokens = 4;
  stress_calls(200, cfg);
}

/// Seeded random valid sets, run for real against the reference (the CPU fuzz
/// feeds the validation 10,000+ sets a run, valid and not; these are a share
/// of the valid kind on a GPU): 0, 1 or up to 256 tokens, hidden any multiple
/// of 8 up to 4096 (FP8: of 128), 1-8 experts per rank, top-1 to top-9, -1
/// slots, weights or not, expert alignment 1-128, and three times in four a
/// random Config that Config::validate accepts (within a node: SMs, ring rows
/// and chunks, sender SMs, the pull dispatch; across nodes only the SMs count).
void fuzzed_valid_sets(int sets, uint64_t seed, bool across) {
  auto& w = world();
  const int R = w.num_ranks;
  Draws d(seed);
  for (int i = 0; i < sets; ++i) {
    HtCase c{};
    c.fp8 = d.chance(0.3);
    c.hidden = c.fp8 ? 128 * d.between(1, 32) : 8 * d.between(1, 512);
    c.num_experts = R * d.between(1, 8);
    c.num_topk = d.between(1, std::min(9, c.num_experts));
    c.num_tokens = d.chance(0.2) ? d.between(0, 1) : d.between(2, 256);
    c.masked = d.chance(0.5) ? 0.0 : 0.3;
    c.with_weights = d.chance(0.5);
    c.expert_alignment = 1 << (d.between(0, 3) * 7 / 3);  // 1, 4, 16 or 128
    std::optional<Config> cfg;
    if (d.chance(0.75)) {
      Config k = shared_gpu_config();
      k.num_sms = 2 * d.between(1, std::max(1, sm_budget() / 2));
      if (!across) {
        k.num_max_recv_tokens = d.between(1, 512);
        k.num_max_send_tokens = d.between(1, 64);
        k.num_send_sms = d.chance(0.5) ? 0 : d.between(1, k.num_sms);
        k.pull_dispatch = d.chance(0.2);
      }
      try {
        k.validate(R, sm_budget());
        cfg = k;
      } catch (const Error&) {  // an invalid draw: the default config instead
      }
    }
    SCOPED_TRACE("set " + std::to_string(i) + ": " + c.name() + (c.with_weights ? "_weights" : "") +
                 "_masked" + std::to_string(c.masked) +
                 (cfg ? " config(" + std::to_string(cfg->num_sms) + ", " +
                            std::to_string(cfg->num_max_send_tokens) + ", " +
                            std::to_string(cfg->num_max_recv_tokens) + ", " +
                            std::to_string(cfg->num_send_sms) +
                            (cfg->pull_dispatch ? ", pull)" : ")")
                      : " default config"));
    run_case(c, 1, seed + 100 + i, cfg);
    if (rank_failed()) return;
  }
}
EPX_GPU_TEST(HighThroughput, FuzzedValidSets) {
  fuzzed_valid_sets(16, 20261127, false);
}

/// num_worst_tokens: no host sync; outputs sized to the worst case, then
/// captured in a CUDA graph and replayed with the routing unchanged.
// The num_worst_tokens tests: 200 tokens (201 on odd ranks), hidden 2048,
// top-8 of 64 experts, bf16 with weights; DispatchArgs with the layout and
// `worst` output rows, on the world's stream.
constexpr int kWorstTokens = 200, kWorstHidden = 2048, kWorstTopK = 8, kWorstExperts = 64;
struct WorstTokenSetup {
  std::vector<ref::HtInput> in;           ///< every rank's inputs
  std::vector<ref::HtDispatchOutput> ro;  ///< the reference dispatch, every rank
  DeviceInput dev;                        ///< this rank's, with `worst` output rows
};

WorstTokenSetup worst_token_setup(uint64_t seed, int worst) {
  auto& w = world();
  const int R = w.num_ranks, H = kWorstHidden, K = kWorstTopK, E = kWorstExperts;
  HtCase c{kWorstTokens, H, K, E, false, 0.1, true, 1, false};
  auto in = make_inputs(c, R, seed);
  StreamArgs s;
  s.stream = w.stream;
  DeviceInput dev(*w.buffer, in[w.rank], H, K, E, s);
  dev.a.num_worst_tokens = worst;
  auto ro = ref::ht_dispatch(in, H, K, E, 1);
  return WorstTokenSetup{std::move(in), std::move(ro), std::move(dev)};
}

EPX_GPU_TEST(HighThroughput, WorstTokensAndGraphReplay) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, H = kWorstHidden, K = kWorstTopK;
  const int worst = (kWorstTokens + 1) * R;
  auto st = worst_token_setup(77, worst);
  const auto& ro = st.ro;
  const auto& a = st.dev.a;
  const StreamArgs& s = st.dev.a.streams;
  auto res = w.buffer->dispatch(a);
  cudaStreamSynchronize(w.stream);
  ASSERT_EQ(res.recv_x.size(0), worst);
  const int N = ro[me].num_recv_tokens;
  auto gx = to_host<uint16_t>(res.recv_x);
  gx.resize(static_cast<std::size_t>(N) * H);
  ASSERT_EQ(gx, ro[me].recv_x_bf16);
  auto gi = to_host<int64_t>(*res.recv_topk_idx);
  for (std::size_t i = static_cast<std::size_t>(N) * K; i < gi.size(); ++i)
    ASSERT_EQ(gi[i], -1) << "tail row " << i / K;

  // Graph capture of dispatch (worst-token mode) + combine, then replays.
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  Tensor gx_out, gc_out;
  {
    auto r1 = w.buffer->dispatch(a);
    CombineArgs ca;
    ca.x = r1.recv_x.view;
    ca.handle = r1.handle;
    ca.streams = s;
    auto r2 = w.buffer->combine(ca);
    gx_out = r1.recv_x;
    gc_out = r2.combined_x;
  }
  ASSERT_EQ(cudaStreamEndCapture(w.stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_TRUE(instantiate_on_every_rank(graph, &exec, w.stream));
  for (int i = 0; i < 20; ++i) {
    // Graph-owned outputs exist once the graph has run: poison them between
    // replays (the addresses stay fixed across launches).
    if (i > 0)
      ASSERT_EQ(cudaMemsetAsync(gx_out.view.data, 0xff, gx_out.view.nbytes(), w.stream),
                cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, w.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    auto g = to_host<uint16_t>(gx_out);
    g.resize(static_cast<std::size_t>(N) * H);
    ASSERT_EQ(g, ro[me].recv_x_bf16) << "replay " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

// num_worst_tokens smaller than what arrives: rows past it are dropped and
// reported at the next call. Under graph replay nothing checks in between, so
// the combine captured with the dispatch must stay inside x (rows the routing
// names past it count as zero) and still write every output row.
EPX_GPU_TEST(HighThroughput, TruncatedWorstTokensStayInBounds) {
  auto& w = world();
  const int me = w.rank, K = kWorstTopK, E = kWorstExperts, worst = 16;
  auto st = worst_token_setup(91, worst);
  ASSERT_GT(st.ro[me].num_recv_tokens, worst);
  const int T = st.dev.T;
  const auto& a = st.dev.a;
  const StreamArgs& s = st.dev.a.streams;
  const DeviceArray<int64_t>& d_topk = st.dev.topk;

  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  Tensor combined, combined_w;
  {
    auto r1 = w.buffer->dispatch(a);
    CombineArgs ca;
    ca.x = r1.recv_x.view;
    ca.topk_weights = r1.recv_topk_weights->view;
    ca.handle = r1.handle;
    ca.streams = s;
    auto r2 = w.buffer->combine(ca);
    combined = r2.combined_x;
    combined_w = *r2.combined_topk_weights;
  }
  ASSERT_EQ(cudaStreamEndCapture(w.stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_TRUE(instantiate_on_every_rank(graph, &exec, w.stream));
  ASSERT_EQ(cudaGraphLaunch(exec, w.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  // Outputs are poisoned (NaN) when allocated. The combine gets x = recv_x,
  // the first `worst` rows each rank received: rows the dispatch dropped
  // contribute nothing (neither their row nor their weights), so the
  // reference is the combine of the reference rows with those rows zeroed.
  const int R = w.num_ranks, H = kWorstHidden;
  std::vector<ref::HtCombineInput> cin(R);
  for (int r = 0; r < R; ++r) {
    const std::size_t kept = std::min(worst, st.ro[r].num_recv_tokens);
    cin[r].x = st.ro[r].recv_x_bf16;
    std::fill(cin[r].x.begin() + kept * H, cin[r].x.end(), uint16_t{0});
    cin[r].topk_weights = st.ro[r].recv_topk_weights;
    std::fill(cin[r].topk_weights.begin() + kept * K, cin[r].topk_weights.end(), 0.0f);
  }
  const auto rc = ref::ht_combine(st.in, cin, H, K, E);
  const auto got = to_host<uint16_t>(combined);
  const auto got_w = to_host<float>(combined_w);
  ASSERT_EQ(got.size(), rc[me].combined_x.size());
  ASSERT_EQ(got_w.size(), rc[me].combined_topk_weights.size());
  std::size_t bad = 0, bad_w = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float g = bf(got[i]), r = bf(rc[me].combined_x[i]);
    if (!(std::fabs(g - r) <= 1e-2f * std::fabs(r) + 1e-2f)) ++bad;
  }
  for (std::size_t i = 0; i < got_w.size(); ++i)
    if (!(std::fabs(got_w[i] - rc[me].combined_topk_weights[i]) <= 1e-5f)) ++bad_w;
  EXPECT_EQ(bad, 0u) << "combined_x differs from the truncated reference in " << bad << " values";
  EXPECT_EQ(bad_w, 0u) << "combined_topk_weights differ in " << bad_w << " values";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  // The truncation is reported by the next call on this buffer.
  try {
    w.buffer->get_dispatch_layout(view(d_topk.get(), DType::kI64, {T, K}), E, s);
    ADD_FAILURE() << "the truncated dispatch was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_worst_tokens"), std::string::npos) << e.what();
  }
  cudaStreamSynchronize(w.stream);
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

EPX_GPU_TEST(HighThroughput, BadInputsThrowBeforeAnyKernel) {
  auto& w = world();
  StreamArgs s;
  s.stream = w.stream;
  auto d = to_device(std::vector<int64_t>(64, 0));
  if (w.num_ranks > 1)  // 4R+1 experts cannot be spread evenly
    EXPECT_THROW(
        w.buffer->get_dispatch_layout(view(d.get(), DType::kI64, {8, 8}), 4 * w.num_ranks + 1, s),
        Error);
  EXPECT_THROW(w.buffer->get_dispatch_layout(view(d.get(), DType::kI32, {8, 8}), 64, s), Error);
  if (w.comm->ranks_on_device() > 1) {  // in-process ranks: the shared legacy stream is refused
    expect_error(
        "legacy default stream",
        [&] {
          w.buffer->get_dispatch_layout(view(d.get(), DType::kI64, {8, 8}), 64, StreamArgs{});
        },
        {"streams.stream"});
  }
  EXPECT_THROW(w.buffer->get_dispatch_layout(view(d.get(), DType::kI64, {8, 32}), 64, s), Error);
  // Out-of-range expert ids are caught by the layout kernel and raised.
  std::vector<int64_t> bad(64, 1);
  bad[13] = 999;
  auto db = to_device(bad);
  w.buffer->get_dispatch_layout(view(db.get(), DType::kI64, {8, 8}), 64, s);
  cudaStreamSynchronize(w.stream);
  try {
    w.buffer->get_dispatch_layout(view(d.get(), DType::kI64, {8, 8}), 64, s);
    ADD_FAILURE() << "expected an error for expert 999";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx"), std::string::npos) << e.what();
  }
  cudaStreamSynchronize(w.stream);
}

/// Rank `me`'s BF16 inputs of case c on the device, a layout from `buf` and
/// dispatch arguments made from them.
struct Bf16Dispatch {
  DeviceArray<int64_t> topk;
  DeviceArray<uint8_t> x;
  Layout layout;
  DispatchArgs args;
};
Bf16Dispatch bf16_dispatch(Buffer& buf, const HtCase& c, const ref::HtInput& mine,
                           const StreamArgs& s) {
  const int T = mine.num_tokens, H = c.hidden, K = c.num_topk;
  Bf16Dispatch d{to_device(mine.topk_idx),
                 to_device_bytes(mine.x_bf16.data(), mine.x_bf16.size() * 2),
                 {},
                 {}};
  d.layout = buf.get_dispatch_layout(view(d.topk.get(), DType::kI64, {T, K}), c.num_experts, s);
  d.args.x = view(d.x.get(), DType::kBF16, {T, H});
  d.args.topk_idx = view(d.topk.get(), DType::kI64, {T, K});
  d.args.set_layout(d.layout);
  d.args.streams = s;
  return d;
}

/// Only rank 0 combines. The combine kernel is its own barrier: its senders
/// wait for the peers to reach the op and its receivers for their rows; all
/// of them give up at the deadline, and the next call raises kTimeout naming
/// the op and the silent peer. (Afterwards the ranks' epochs differ: the
/// buffer is destroyed, as the docs say.) Every rank reaches every collective
/// step whatever fails on rank 0, so a failure cannot hang the suite.
EPX_GPU_TEST(HighThroughput, TimeoutIsReported) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  if (R < 2) GTEST_SKIP() << "needs a peer that stays silent";
  const HtCase c{64, 1024, 4, 8 * R, false, 0.0, false, 1, false};
  Buffer b(w.comm, hint_sized_options(c, R, 1.0, poisoning_allocator()));
  StreamArgs s;
  s.stream = w.stream;
  auto in = make_inputs(c, R, 5);
  auto d = bf16_dispatch(b, c, in[me], s);
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  all_ranks(true);                // line up: the 1 s deadline also covers this dispatch
  auto res = b.dispatch(d.args);  // every rank: the handle
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  if (all_ranks(!rank_failed()) && me == 0) {
    CombineArgs ca;
    ca.x = res.recv_x.view;
    ca.handle = res.handle;
    ca.streams = s;
    expect_error(
        "combine without peers",
        [&] {
          b.combine(ca);  // no peer takes part: every wait runs into the deadline
          EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
          b.combine(ca);
        },
        {"combine", "rank 0 waited"}, ErrorCode::kTimeout);
  }
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// Layout tensors that disagree (num_tokens_per_rank not the count of
/// is_token_in_rank) are refused with an error naming the argument before any
/// row moves; with every rank's layout off, every rank refuses, and the buffer
/// keeps working.
EPX_GPU_TEST(HighThroughput, MismatchedLayoutIsRefused) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  const HtCase c{96, 1024, 4, 8 * R, false, 0.0, false, 1, false};
  StreamArgs s;
  s.stream = w.stream;
  auto in = make_inputs(c, R, 9);
  auto d = bf16_dispatch(*w.buffer, c, in[me], s);
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  auto counts = to_host<int>(d.layout.num_tokens_per_rank);
  for (auto& v : counts) v += 1;  // one token too many for every rank
  auto d_counts = to_device(counts);
  d.args.num_tokens_per_rank = view(d_counts.get(), DType::kI32, {R});
  expect_error("mismatched layout", [&] { w.buffer->dispatch(d.args); }, {"num_tokens_per_rank"});
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  // The same buffer still dispatches and combines correctly.
  run_case({128, 1024, 4, 8 * R, false, 0.1, true, 1, false}, 1, 21);
}

/// Rank 0 passes a config with another ring size. Every rank must refuse the
/// op (each compares its peers' config fingerprints before sending): the
/// dispatch with a layout raises at once (its count exchange sees the
/// fingerprints), a cached dispatch or a combine at the next call. No rank
/// hangs, and the buffer works afterwards.
EPX_GPU_TEST(HighThroughput, MismatchedConfigIsRefused) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  if (R < 2) GTEST_SKIP() << "needs a peer";
  const HtCase c{96, 1024, 4, 8 * R, false, 0.0, false, 1, false};
  StreamArgs s;
  s.stream = w.stream;
  auto in = make_inputs(c, R, 19);
  auto d = bf16_dispatch(*w.buffer, c, in[me], s);
  auto res = w.buffer->dispatch(d.args);  // same config everywhere: the handle
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  Config odd = shared_gpu_config();
  if (me == 0) odd.num_max_recv_tokens = 2048;
  auto expect_refused = [&](const char* what, const std::function<void()>& call) {
    expect_error(what, call, {"different configs"});
    EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  };
  // With a layout: the dispatch itself raises.
  DispatchArgs a = d.args;
  a.config = odd;
  expect_refused("dispatch", [&] { w.buffer->dispatch(a); });
  // Cached dispatch and combine: the kernel refuses, the next call raises.
  DispatchArgs cached;
  cached.x = d.args.x;
  cached.handle = res.handle;
  cached.streams = s;
  cached.config = odd;
  auto then_next_call = [&](const std::function<void()>& op) {
    return [&, op] {
      op();
      EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      w.buffer->get_dispatch_layout(d.args.topk_idx.value(), c.num_experts, s);
    };
  };
  expect_refused("cached dispatch", then_next_call([&] { w.buffer->dispatch(cached); }));
  CombineArgs ca;
  ca.x = res.recv_x.view;
  ca.handle = res.handle;
  ca.streams = s;
  ca.config = odd;
  expect_refused("combine", then_next_call([&] { w.buffer->combine(ca); }));
  EXPECT_TRUE(all_ranks(!rank_failed()));
  // The same buffer still dispatches and combines correctly.
  run_case({128, 1024, 4, 8 * R, false, 0.1, true, 1, false}, 1, 22);
}

// ---- across (virtual) nodes: the two-level dispatch and combine ----------------
// The same cases through the network and NVLink forwarding, against the same
// reference; the combine must match the reference's node-grouped sums bit
// for bit (run_case).

EPX_GPU_TEST(Internode, Bf16Hidden7168) {
  run_case({512, 7168, 8, 256, false, 0.1, true, 1, false}, 2, 311);
}
EPX_GPU_TEST(Internode, Fp8Hidden7168) {
  run_case({512, 7168, 8, 256, true, 0.1, true, 1, false}, 2, 312);
}
EPX_GPU_TEST(Internode, HiddenSizesNoWeights) {
  for (int h : {256, 2880}) run_case({300, h, 8, 64, false, 0.05, false, 1, false}, 1, 313 + h);
}
EPX_GPU_TEST(Internode, NodeReceivesNothing) {
  HtCase c{256, 2048, 4, 64, false, 0.0, true, 1, false};
  c.starve_node1 = true;
  run_case(c, 1, 314);
}
EPX_GPU_TEST(Internode, RankReceivesNothing) {
  run_case({256, 2048, 4, 64, false, 0.0, true, 1, true}, 1, 315);
}
EPX_GPU_TEST(Internode, OneAndZeroTokens) {
  run_case({1, 2048, 8, 64, false, 0.0, true, 1, false}, 1, 316);
  run_case({0, 2048, 8, 64, false, 0.0, true, 1, false}, 1, 317);
}
EPX_GPU_TEST(Internode, ExpertAlignmentAndMaskedRows) {
  run_case({333, 4096, 6, 48, false, 0.5, true, 128, false}, 1, 318);
}
EPX_GPU_TEST(Internode, Stress200Calls) {
  stress_calls(200, std::nullopt);
}
/// The fuzzed valid sets across nodes (fuzzed_valid_sets).
EPX_GPU_TEST(Internode, FuzzedValidSets) {
  fuzzed_valid_sets(12, 20261128, true);
}
/// DeepEP users' calls as the Python suite makes them, with no host wait
/// between the ops (run_case waits after each): dispatch, cached dispatch,
/// then three combines of the dispatched rows (identity experts) on the same
/// handle: with weights and two biases, plain, with weights only; every
/// output against the reference, for three fresh sets of routing and rows.
/// With a process per rank the three sets run again on the legacy default
/// stream, which is where PyTorch's current stream sends them. The Python
/// suite's 4 processes as 2x2 got a plain combine after a weighted one wrong
/// on one pair of ranks (4x H200, proxy).
EPX_GPU_TEST(Internode, OpSequenceWithoutHostWaits) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, rpn = w.buffer->num_nvl_ranks();
  if (rpn == R) GTEST_SKIP() << "needs ranks in several nodes";
  const int H = 512, K = 4, E = 8 * R;
  // (in-process ranks may not share the legacy stream: Buffer refuses it)
  const int sets = in_process_worlds().empty() ? 6 : 3;
  for (int rep = 0; rep < sets; ++rep) {
    StreamArgs s;
    s.stream = rep < 3 ? w.stream : cudaStreamLegacy;
    const HtCase c{80 + 13 * (rep % 3), H, K, E, false, 0.1, true, 1, false};
    const auto in = make_inputs(c, R, 400 + rep % 3);
    const auto ro = ref::ht_dispatch(in, H, K, E, 1);
    DeviceInput d(*w.buffer, in[me], H, K, E, s);
    const int T = d.T;
    auto res = w.buffer->dispatch(d.a);
    DispatchArgs cached;
    cached.x = d.a.x;
    cached.handle = res.handle;
    cached.streams = s;
    auto again = w.buffer->dispatch(cached);

    // The combines' inputs on every rank: [0] weights and biases, [1] plain, [2] weights.
    std::vector<ref::HtCombineInput> cin[3];
    for (auto& v : cin) v.resize(R);
    for_each_rank(R, [&](int r) {
      for (auto& v : cin) v[r].x = ro[r].recv_x_bf16;
      cin[0][r].topk_weights = cin[2][r].topk_weights = ro[r].recv_topk_weights;
      const auto n = static_cast<std::size_t>(in[r].num_tokens) * H;
      cin[0][r].bias_0 = random_bf16(n, 500 + rep * 16 + r);
      cin[0][r].bias_1 = random_bf16(n, 600 + rep * 16 + r);
    });
    auto d_b0 = to_device(cin[0][me].bias_0);
    auto d_b1 = to_device(cin[0][me].bias_1);
    std::vector<CombineResult> out;
    for (int k = 0; k < 3; ++k) {
      CombineArgs ca;
      ca.x = res.recv_x.view;
      ca.handle = res.handle;
      if (k != 1) ca.topk_weights = res.recv_topk_weights->view;
      if (k == 0) {
        ca.bias_0 = view(d_b0.get(), DType::kBF16, {T, H});
        ca.bias_1 = view(d_b1.get(), DType::kBF16, {T, H});
      }
      ca.streams = s;
      out.push_back(w.buffer->combine(ca));
    }
    ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
    const std::string at = "set " + std::to_string(rep % 3) +
                           (rep < 3 ? " on the test's stream" : " on the legacy default stream");
    EXPECT_EQ(to_host<uint16_t>(res.recv_x), ro[me].recv_x_bf16) << at << ": dispatch";
    EXPECT_EQ(to_host<uint16_t>(again.recv_x), ro[me].recv_x_bf16) << at << ": cached dispatch";
    static constexpr const char* kNames[] = {"weights and biases", "plain", "weights"};
    for (int k = 0; k < 3; ++k) {
      const auto want = ref::ht_combine(in, cin[k], H, K, E, rpn)[me];
      EXPECT_EQ(to_host<uint16_t>(out[k].combined_x), want.combined_x)
          << at << ": combine with " << kNames[k] << " (combined_x not bit-exact)";
      if (k == 1) continue;
      const auto gw = to_host<float>(*out[k].combined_topk_weights);
      ASSERT_EQ(gw.size(), want.combined_topk_weights.size());
      for (std::size_t i = 0; i < gw.size(); ++i)
        ASSERT_NEAR(gw[i], want.combined_topk_weights[i], 1e-5f) << at << " weight " << i;
    }
    ASSERT_TRUE(all_ranks(!rank_failed())) << "another rank failed, " << at;
  }
}
/// The combine's inputs with identity experts: each rank's x is the rows it
/// received.
std::vector<ref::HtCombineInput> received_rows_as_x(const std::vector<ref::HtDispatchOutput>& ro) {
  std::vector<ref::HtCombineInput> cin(ro.size());
  for (std::size_t r = 0; r < ro.size(); ++r) cin[r].x = ro[r].recv_x_bf16;
  return cin;
}

/// A buffer for num_worst_tokens across nodes, whose areas the buffer fixes:
/// slots with room for every token of a rank, a 20 s deadline, outputs
/// poisoned.
BufferOptions worst_tokens_options(const HtCase& c) {
  const auto& w = world();
  BufferOptions o;
  o.num_nvl_bytes = static_cast<int64_t>(Buffer::get_internode_nvl_size_hint(
      c.num_tokens + 16, c.hidden, w.num_ranks, w.buffer->num_nvl_ranks(), c.num_topk));
  o.timeout_s = 20.0;
  o.allocator = poisoning_allocator(w.comm->in_process());
  return o;
}

/// EPX_HT_RINGS as the buffers read it: -1 unset (the rings where a call
/// does not fit), 0 never the rings, N >= 1 always.
int ht_rings_mode() {
  const char* rings = std::getenv("EPX_HT_RINGS");
  return rings != nullptr ? std::atoi(rings) : -1;
}

/// Whether every high-throughput op across nodes takes the rings.
bool through_rings() {
  return ht_rings_mode() > 0;
}

/// A call whose whole-call areas do not fit num_nvl_bytes raises
/// kBufferTooSmall naming it on every rank, before any kernel; so does one
/// with num_worst_tokens whose stage does not fit (or, through the rings,
/// whose rings do not); the buffer
/// works afterwards.
EPX_GPU_TEST(Internode, RefusedCallsAreNamed) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  BufferOptions o;
  o.num_nvl_bytes = 1 << 20;
  o.timeout_s = 20;
  o.allocator = poisoning_allocator(w.comm->in_process());
  Buffer b(w.comm, o);
  StreamArgs s;
  s.stream = w.stream;
  const HtCase c{256, 7168, 8, 64, false, 0.0, false, 1, false};
  auto in = make_inputs(c, R, 319);
  const auto& mine = in[me];
  auto d_topk = to_device(mine.topk_idx);
  auto d_x = to_device(mine.x_bf16);
  auto layout = b.get_dispatch_layout(view(d_topk.get(), DType::kI64, {mine.num_tokens, 8}), 64, s);
  DispatchArgs a;
  a.x = view(d_x.get(), DType::kBF16, {mine.num_tokens, c.hidden});
  a.topk_idx = view(d_topk.get(), DType::kI64, {mine.num_tokens, 8});
  a.set_layout(layout);
  a.streams = s;
  Config cfg = shared_gpu_config();
  // Network rings of 64 records (only the rings read it): never within the
  // buffer's 1.5 MB here, as rings of 4 (EPX_HT_RINGS=4) of 2 channels at
  // 4x4 are (1.4 MB), which rightly take the call instead of refusing it.
  cfg.num_max_rdma_recv_tokens = 64;
  a.config = cfg;
  expect_error(
      "whole call in 1 MiB", [&] { b.dispatch(a); }, {"num_nvl_bytes", "bytes"},
      ErrorCode::kBufferTooSmall);
  a.num_worst_tokens = 4096;  // a stage of 4096 rows does not fit 1 MiB either
  // Through the rings (EPX_HT_RINGS) the rings themselves do not fit first,
  // and the error names them instead of num_worst_tokens.
  expect_error(
      "num_worst_tokens in 1 MiB", [&] { b.dispatch(a); },
      {"num_nvl_bytes", through_rings() ? "rings" : "num_worst_tokens"},
      ErrorCode::kBufferTooSmall);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
  run_case({64, 256, 4, 8 * R, false, 0.1, true, 1, false}, 1, 320);
}

/// By default (EPX_HT_RINGS unset) a dispatch whose whole-call areas, or
/// its combine's, do not fit num_nvl_bytes takes the rings instead: on a
/// buffer just large enough for the rings (6 SMs: 2 channels; network rings
/// of 64 records) and their state block, 64 tokens per rank take the
/// whole-call kernels and 4096 the rings (dispatch, cached dispatch and
/// combine against the reference each time). With EPX_HT_RINGS = 0 the 4096
/// raise kBufferTooSmall naming num_nvl_bytes; with it forced on both take
/// the rings.
EPX_GPU_TEST(Internode, CallsThatDoNotFitTakeTheRings) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, L = w.buffer->num_nvl_ranks();
  const int mode = ht_rings_mode();
  const HtCase few{64, 512, 4, 8 * R, false, 0.1, true, 1, false};
  HtCase many = few;
  many.num_tokens = 4096;
  Config cfg = shared_gpu_config();
  cfg.num_sms = 6;
  cfg.num_max_rdma_recv_tokens = 64;
  cfg.num_max_rdma_send_tokens = 16;
  const plan::HtRingGeometry g = plan::HtRingGeometry::of(
      std::max(mode, 1), cfg.num_sms, cfg.num_max_rdma_send_tokens, cfg.num_max_rdma_recv_tokens);
  const Topology topo{R, L};
  const std::size_t record = plan::ht_net_record_bytes(2 * few.hidden, 0, few.num_topk, L);
  const std::size_t row = plan::ht_combine_row_bytes(few.hidden, few.num_topk);
  const std::size_t head = plan::HtNetRegion::body(R), huge = std::size_t{1} << 46;
  const std::size_t rings_end =
      std::max(plan::HtRingRegion::make(topo, g, record, head, huge).rings_end,
               plan::HtRingRegion::make_combine(topo, g, row, head, huge).rings_end);
  BufferOptions o;
  o.num_nvl_bytes = static_cast<int64_t>(plan::align_up(
      rings_end + plan::HtRingRegion::state_bytes(topo) + plan::kAlign, plan::kAlign));
  o.timeout_s = 30;
  o.allocator = poisoning_allocator(w.comm->in_process());
  Buffer b(w.comm, o);
  int rings = 0;
  run_case(few, 1, 907, cfg, &b, &rings);
  EXPECT_EQ(rings, mode > 0 ? 1 : 0) << "64 tokens, EPX_HT_RINGS mode " << mode;
  if (mode == 0) {
    StreamArgs s;
    s.stream = w.stream;
    const auto in = make_inputs(many, R, 908);
    DeviceInput d(b, in[me], many.hidden, many.num_topk, many.num_experts, s);
    d.a.config = cfg;
    expect_error(
        "4096 tokens without the rings", [&] { b.dispatch(d.a); }, {"num_nvl_bytes"},
        ErrorCode::kBufferTooSmall);
    EXPECT_TRUE(all_ranks(!rank_failed()));
    return;
  }
  rings = 0;
  run_case(many, 2, 909, cfg, &b, &rings);
  EXPECT_EQ(rings, 2) << "4096 tokens";
}

/// num_worst_tokens across nodes: no host wait (the counts are exchanged on
/// the GPU), outputs of num_worst_tokens rows whose tail names no expert.
/// Then dispatch + combine captured in a CUDA graph and replayed with other
/// routing and rows copied into the captured inputs: each replay matches the
/// reference of its own inputs, the combine bit for bit (the count exchange
/// and the route run on the GPU at every replay).
EPX_GPU_TEST(Internode, WorstTokensAndGraphReplay) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, L = w.buffer->num_nvl_ranks();
  const HtCase c{96, 512, 4, 8 * R, false, 0.1, true, 1, false};
  const int H = c.hidden, K = c.num_topk, E = c.num_experts;
  const int worst = (c.num_tokens + 1) * R;
  constexpr int kSets = 3;
  std::vector<std::vector<ref::HtInput>> ins;
  std::vector<std::vector<ref::HtDispatchOutput>> ros;
  std::vector<std::vector<ref::HtCombineInput>> cins;
  for (int i = 0; i < kSets; ++i) {
    ins.push_back(make_inputs(c, R, 400 + i));
    ros.push_back(ref::ht_dispatch(ins[i], H, K, E, 1));
    cins.push_back(received_rows_as_x(ros[i]));
  }
  const int T = ins[0][me].num_tokens;
  // The areas are fixed by the buffer: a stage of `worst` rows, and slots
  // with room for every token of a rank.
  Buffer b(w.comm, worst_tokens_options(c));
  StreamArgs s;
  s.stream = w.stream;
  DeviceInput d(b, ins[0][me], H, K, E, s);
  DispatchArgs& a = d.a;
  a.num_worst_tokens = worst;
  a.config = shared_gpu_config();
  // Checks set i's outputs: the first N rows (and the tail's top-k), the combine.
  auto check = [&](int i, const Tensor& recv_x, const Tensor& recv_idx, const Tensor& combined,
                   const char* what) {
    const auto& ro = ros[i][me];
    const int N = ro.num_recv_tokens;
    ASSERT_EQ(recv_x.size(0), worst) << what;
    auto gx = to_host<uint16_t>(recv_x);
    gx.resize(static_cast<std::size_t>(N) * H);
    ASSERT_EQ(gx, ro.recv_x_bf16) << what << ": set " << i;
    auto gi = to_host<int64_t>(recv_idx);
    std::vector<int64_t> head(gi.begin(), gi.begin() + static_cast<std::ptrdiff_t>(N) * K);
    ASSERT_EQ(head, ro.recv_topk_idx) << what << ": set " << i;
    for (std::size_t j = static_cast<std::size_t>(N) * K; j < gi.size(); ++j)
      ASSERT_EQ(gi[j], -1) << what << ": tail row " << j / K;
    const auto rc = ref::ht_combine(ins[i], cins[i], H, K, E, L);
    ASSERT_EQ(to_host<uint16_t>(combined), rc[me].combined_x) << what << ": set " << i;
  };
  auto pair = [&](Tensor& rx, Tensor& ri, Tensor& cx) {
    auto r1 = b.dispatch(a);
    CombineArgs ca;
    ca.x = r1.recv_x.view;  // identity experts: the received rows, the tail unused
    ca.handle = r1.handle;
    ca.streams = s;
    ca.config = a.config;
    auto r2 = b.combine(ca);
    rx = r1.recv_x;
    ri = *r1.recv_topk_idx;
    cx = r2.combined_x;
    EXPECT_TRUE(r1.num_recv_tokens_per_expert.empty()) << "no host counts without a host wait";
  };
  Tensor ex, ei, ec;  // the eager pair's outputs (freed after the capture, not during it)
  pair(ex, ei, ec);
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  b.check();
  check(0, ex, ei, ec, "eager");

  Tensor rx, ri, cx;
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  pair(rx, ri, cx);
  ASSERT_EQ(cudaStreamEndCapture(w.stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_TRUE(instantiate_on_every_rank(graph, &exec, w.stream));
  for (int rep = 0; rep < 6; ++rep) {
    const int i = (rep + 1) % kSets;
    // New inputs into the captured ones: rows, routing, and its layout.
    const auto& mine = ins[i][me];
    auto cp = [&](void* dst, const void* src, std::size_t bytes) {
      ASSERT_EQ(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, w.stream), cudaSuccess);
    };
    cp(d.x.get(), mine.x_bf16.data(), mine.x_bf16.size() * 2);
    cp(d.topk.get(), mine.topk_idx.data(), mine.topk_idx.size() * 8);
    cp(d.w.get(), mine.topk_weights.data(), mine.topk_weights.size() * 4);
    auto rl = ref::get_dispatch_layout(mine.topk_idx, T, K, E, R);
    cp(d.layout.num_tokens_per_rank.view.data, rl.num_tokens_per_rank.data(), R * 4);
    cp(d.layout.num_tokens_per_expert.view.data, rl.num_tokens_per_expert.data(), E * 4);
    cp(d.layout.is_token_in_rank.view.data, rl.is_token_in_rank.data(), rl.is_token_in_rank.size());
    // Poison the graph's outputs (fixed addresses across launches; graph-owned
    // memory exists once the graph has run, and the allocator poisoned it then).
    if (rep > 0)
      for (const Tensor* t : {&rx, &ri, &cx})
        ASSERT_EQ(cudaMemsetAsync(t->view.data, 0xff, t->view.nbytes(), w.stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, w.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    b.check();
    check(i, rx, ri, cx, "replay");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// num_worst_tokens below what a rank receives: the rows past it are dropped
/// and reported (Buffer::check names num_worst_tokens), the combine after it
/// still finishes, through the rings too (their combine must not wait for the
/// dropped rows' returns), and the buffer's next pair with a large enough
/// num_worst_tokens matches the reference bit for bit (the rings' running
/// counts stayed in step).
EPX_GPU_TEST(Internode, WorstTokensOverflowIsNamedAndCombineFinishes) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, L = w.buffer->num_nvl_ranks();
  const HtCase c{96, 512, 4, 8 * R, false, 0.1, true, 1, false};
  const int H = c.hidden, K = c.num_topk, E = c.num_experts;
  const auto in = make_inputs(c, R, 333);
  const auto ro = ref::ht_dispatch(in, H, K, E, 1);
  const auto rc = ref::ht_combine(in, received_rows_as_x(ro), H, K, E, L);
  Buffer b(w.comm, worst_tokens_options(c));
  StreamArgs s;
  s.stream = w.stream;
  DeviceInput d(b, in[me], H, K, E, s);
  d.a.config = shared_gpu_config();
  // The pair is enqueued behind a gate that every rank opens only when all
  // have enqueued it: otherwise a rank whose host sees the dispatch's
  // overflow before it calls combine raises it there ("previous op", as the
  // API says), skips the combine, and its peers' combine times out (4
  // in-process ranks on one GPU did, at f3bfc92). The gate makes every rank
  // reach the case this test is about: a combine enqueued behind an
  // overflowed dispatch.
  auto pair = [&](int worst) {
    StreamGate gate(w.stream);
    d.a.num_worst_tokens = worst;
    auto r1 = b.dispatch(d.a);
    CombineArgs ca;
    ca.x = r1.recv_x.view;
    ca.handle = r1.handle;
    ca.streams = s;
    ca.config = d.a.config;
    auto r2 = b.combine(ca);
    EXPECT_TRUE(all_ranks(true));
    gate.open();
    EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    EXPECT_FALSE(gate.held_too_long()) << "the ranks took more than 60 s to enqueue the pair";
    return r2.combined_x;
  };
  const int small = 4;  // every rank receives far more rows than this
  ASSERT_GT(ro[me].num_recv_tokens, small);
  pair(small);
  expect_error(
      "check after num_worst_tokens overflowed", [&] { b.check(); }, {"num_worst_tokens"},
      ErrorCode::kInvalidArgument);
  ASSERT_TRUE(all_ranks(!rank_failed())) << "the overflow was not reported on every rank";
  const Tensor combined = pair((c.num_tokens + 1) * R);
  b.check();
  EXPECT_EQ(to_host<uint16_t>(combined), rc[me].combined_x)
      << "the pair after the overflow differs from the reference";
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

/// A buffer across nodes for case c (its deadline `timeout_s`), this rank's
/// inputs on the device, and a first dispatch with weights, synchronized.
struct NetFirstDispatch {
  std::unique_ptr<Buffer> b;
  std::optional<DeviceInput> in;  ///< this rank's input and DispatchArgs over it
  DispatchResult res;
  NetFirstDispatch(const HtCase& c, double timeout_s, uint64_t seed) {
    auto& w_ = world();
    const int R = w_.num_ranks;
    const auto all = make_inputs(c, R, seed);
    int most = 0;  // every rank sizes its buffer alike
    for (const auto& r : all) most = std::max(most, r.num_tokens);
    BufferOptions o;
    o.num_nvl_bytes = static_cast<int64_t>(Buffer::get_internode_nvl_size_hint(
        most, c.hidden, R, w_.buffer->num_nvl_ranks(), c.num_topk));
    o.timeout_s = timeout_s;
    o.allocator = poisoning_allocator(w_.comm->in_process());
    b = std::make_unique<Buffer>(w_.comm, o);
    StreamArgs s;
    s.stream = w_.stream;
    in.emplace(*b, all[w_.rank], c.hidden, c.num_topk, c.num_experts, s);
    in->a.config = shared_gpu_config();
    res = b->dispatch(in->a);
    EXPECT_EQ(cudaStreamSynchronize(w_.stream), cudaSuccess);
  }
  /// A cached dispatch of `x` (the first dispatch's rows by default).
  DispatchResult cached(std::optional<TensorView> rows = std::nullopt) {
    DispatchArgs d;
    d.x = rows.value_or(in->a.x);
    d.handle = res.handle;
    d.streams = in->a.streams;
    d.config = in->a.config;
    return b->dispatch(d);
  }
  /// A combine of the received rows, with their weights or without.
  CombineResult combine(bool weights) {
    CombineArgs ca;
    ca.x = res.recv_x.view;
    ca.handle = res.handle;
    if (weights) ca.topk_weights = res.recv_topk_weights->view;
    ca.streams = in->a.streams;
    ca.config = in->a.config;
    return b->combine(ca);
  }
};

/// A rank that does not come to an op is named by the others within the
/// deadline, never a hang: rank 0 alone makes a cached dispatch; its barrier
/// waits for every other rank and reports one of them.
EPX_GPU_TEST(Internode, SilentPeerIsNamed) {
  auto& w = world();
  const HtCase c{64, 256, 4, 8 * w.num_ranks, false, 0.1, true, 1, false};
  NetFirstDispatch f(c, 1.0, 321);
  if (w.rank == 0) {
    try {
      f.cached();
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      f.b->check();
      ADD_FAILURE() << "expected a timeout";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      const std::string m = e.what();
      bool named = false;
      for (int r = 1; r < w.num_ranks; ++r)
        named |= m.find("for rank " + std::to_string(r)) != std::string::npos;
      EXPECT_TRUE(named) << m;
      EXPECT_NE(m.find("arrival at the op"), std::string::npos) << m;
    }
  }
  EXPECT_TRUE(all_ranks(!rank_failed()));
  f.b->destroy();
}

/// Ranks whose rows differ in shape are refused by name on every rank, and
/// nothing moves: the barrier compares each op's shape. A cached dispatch
/// (no count exchange) where the last rank passes half the hidden size, then
/// (on a fresh buffer: a refused op leaves the first one unusable, as a
/// timeout does) a combine where the last rank passes no topk_weights.
EPX_GPU_TEST(Internode, ShapeMismatchIsNamed) {
  auto& w = world();
  const int me = w.rank, odd = w.num_ranks - 1;
  const HtCase c{64, 256, 4, 8 * w.num_ranks, false, 0.1, true, 1, false};
  for (const bool combine : {false, true}) {
    NetFirstDispatch f(c, 5.0, 322);
    auto half =
        to_device(std::vector<uint16_t>(static_cast<std::size_t>(f.in->T) * c.hidden / 2, 0));
    const char* field = combine ? "topk_weights (top-k)" : "x (hidden bytes)";
    try {
      if (combine)
        f.combine(me != odd);
      else  // rows half as wide on the last rank
        f.cached(me == odd ? view(half.get(), DType::kBF16, {f.in->T, c.hidden / 2}) : f.in->a.x);
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      f.b->check();
      ADD_FAILURE() << field << ": expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      const std::string m = e.what();
      EXPECT_NE(m.find(field), std::string::npos) << m;
      // The others name the last rank; it names whichever of them it saw first.
      bool named = false;
      for (int r = 0; r < w.num_ranks; ++r)
        if ((me == odd) != (r == odd))
          named |= m.find("rank " + std::to_string(r) + " passed") != std::string::npos;
      EXPECT_TRUE(named) << m;
    }
    EXPECT_TRUE(all_ranks(!rank_failed()));
    f.b->destroy();
  }
}

/// Runs a killed-process test (EPX_TEST_KILL_RANK=r, one process per rank;
/// run on its own by the device script): a dispatch and a combine across
/// nodes, then rank r SIGKILLs itself and every other rank runs `after` (ops
/// that need the dead rank), which must raise a timeout within 30 s, naming
/// it where `names_rank` (a collective of the communicator cannot tell who
/// did not come). The survivors print "KILL-TEST rank N: PASS ..." and leave
/// at once (their collectives would wait for the dead rank), so the device
/// script reads the lines.
void killed_rank_test(const std::function<void(NetFirstDispatch&)>& after, bool names_rank) {
  auto& w = world();
  const char* kill = std::getenv("EPX_TEST_KILL_RANK");
  if (kill == nullptr || w.comm->in_process())
    GTEST_SKIP() << "set EPX_TEST_KILL_RANK, one process per rank (it ends the run)";
  const int victim = std::atoi(kill);
  const HtCase c{128, 1024, 4, 8 * w.num_ranks, false, 0.1, true, 1, false};
  NetFirstDispatch f(c, 3.0, 323);
  f.combine(true);
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  f.b->check();
  ASSERT_TRUE(all_ranks(true));
  if (w.rank == victim) ::raise(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg = "no error";
  ErrorCode code = ErrorCode::kInternal;
  try {
    after(f);
    cudaStreamSynchronize(w.stream);
    f.b->check();
  } catch (const Error& e) {
    msg = e.what();
    code = e.code();
  }
  kill_test_verdict(victim, names_rank, msg, code,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

/// After the kill, a cached dispatch and a combine (the kernels' waits).
EPX_GPU_TEST(Internode, KilledRankIsNamed) {
  killed_rank_test(
      [](NetFirstDispatch& f) {
        f.cached();
        f.combine(true);
      },
      true);
}

/// After the kill, a dispatch with its host count exchange: the
/// communicator's allgather must give up at its deadline (EPX_TIMEOUT_S;
/// with NCCL it aborts the communicator), which cannot say who is missing.
EPX_GPU_TEST(Internode, KilledRankInCountExchange) {
  killed_rank_test([](NetFirstDispatch& f) { f.b->dispatch(f.in->a); }, false);
}

/// A network that stops completing puts (the loopback GIN plugin's
/// EPX_GIN_LOOP_STALL_AFTER_S, nccl backend, one process per rank; run on its
/// own by the device script): ops go on until the stall, then the next op's
/// quiet must raise within its deadline naming the stalled context, where
/// NCCL's flush would hang. Prints "STALL-TEST rank N: PASS|FAIL ..." and
/// leaves at once (tearing down waits for the network too).
EPX_GPU_TEST(Internode, StalledNetworkIsNamed) {
  auto& w = world();
  const auto stall = stall_after_s();
  if (!stall) GTEST_SKIP() << kStallTestSkip;
  const HtCase c{64, 256, 4, 8 * w.num_ranks, false, 0.1, true, 1, false};
  NetFirstDispatch f(c, 3.0, 324);
  run_stall_test(*stall,
                 [&](ErrorCode& code) -> std::string {
                   try {
                     f.cached();
                     f.combine(true);
                     cudaStreamSynchronize(w.stream);
                     f.b->check();
                     return "";
                   } catch (const Error& e) {
                     code = e.code();
                     return e.what();
                   }
                 },
                 {{"network quiet", "its quiet"}, {"for rank ", "a wait"}});
}

}  // namespace
}  // namespace epx::test
