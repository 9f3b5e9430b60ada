// gpu/ht_cases.hpp - the high-throughput GPU tests' cases, inputs, Buffer
// options and their run-and-check loop, shared by test_high_throughput.cpp
// (one node) and test_internode.cpp (across virtual nodes).
#pragma once

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

namespace epx::test::ht {

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
inline std::vector<ref::HtInput> make_inputs(const HtCase& c, int R, uint64_t seed) {
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

inline float bf(uint16_t v) {
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
inline Config shared_gpu_config(int rows = 0) {
  Config cfg = get_dispatch_config(world().num_ranks);
  cfg.num_sms = std::min(cfg.num_sms, sm_budget());
  if (rows > 0) cfg.num_max_recv_tokens = rows;
  return cfg;
}

/// Options of a Buffer of the HT size hint for `c` (BF16 rows), with this
/// deadline and allocator.
inline BufferOptions hint_sized_options(const HtCase& c, int R, double timeout_s, Allocator alloc) {
  BufferOptions o;
  o.num_nvl_bytes = static_cast<int64_t>(
      get_dispatch_config(R).get_nvl_buffer_size_hint(2u * c.hidden, R, c.num_topk));
  o.timeout_s = timeout_s;
  o.allocator = std::move(alloc);
  return o;
}

/// `ring_calls`, where given, counts the dispatches whose handle says they
/// took the rings across nodes (DispatchHandle::took_rings).
inline void run_case(const HtCase& c, int iters, uint64_t seed0,
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

/// 200 back-to-back dispatch+combine pairs on fixed inputs without
/// reallocating; each result is checked (catches races between calls).
inline void stress_calls(int calls, const std::optional<Config>& config) {
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

/// Seeded random valid sets, run for real against the reference (the CPU fuzz
/// feeds the validation 10,000+ sets a run, valid and not; these are a share
/// of the valid kind on a GPU): 0, 1 or up to 256 tokens, hidden any multiple
/// of 8 up to 4096 (FP8: of 128), 1-8 experts per rank, top-1 to top-9, -1
/// slots, weights or not, expert alignment 1-128, and three times in four a
/// random Config that Config::validate accepts (within a node: SMs, ring rows
/// and chunks, sender SMs, the pull dispatch; across nodes only the SMs count).
inline void fuzzed_valid_sets(int sets, uint64_t seed, bool across) {
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

}  // namespace epx::test::ht
