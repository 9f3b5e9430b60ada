// gpu/ll_cases.hpp - the low-latency GPU tests' cases, inputs, buffer sizes,
// waits and their run-and-check loop, shared by test_low_latency.cpp and
// test_low_latency_faults.cpp. The combine tolerance is explained at the top
// of test_low_latency.cpp.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "common/env.hpp"
#include "epx/reference.hpp"
#include "gpu/checksum.hpp"
#include "gpu/device_sleep.hpp"
#include "gpu/harness.hpp"

namespace epx::test::ll {

struct LlCase {
  int max_tokens = 64;
  int hidden = 2048;
  int num_topk = 8;
  int num_experts = 64;
  bool fp8 = false, round_scale = false, ue8m0 = false;
  double masked = 0.0;
  bool empty_token = false;      ///< token 0 of every rank picks nothing (all -1)
  bool rank1_no_tokens = false;  ///< rank 1 sends no token at all
  bool duplicate_picks = false;  ///< token 1 of every rank picks one expert twice
  bool hook = false, async = false, logfmt = false, zero_copy = false, use_out = false;
  bool stats = false;
  /// The ops on cudaStreamLegacy (where PyTorch's current stream sends them
  /// by default) instead of the test's stream; a process per rank only.
  bool legacy_stream = false;
  /// The last rank starts each op this many ms after the others, and the ops
  /// get dispatch/combine_wait_recv_cost_stats (checked by check_waits).
  int late_ms = 0;
  /// Tokens of rank r: tokens_base + tokens_step * r (at most max_tokens);
  /// 0: max_tokens - r % 3.
  int tokens_base = 0, tokens_step = 0;
  /// Shrink mode: this rank makes no call (the others mask it, or find it
  /// gone at their deadline); the reference is the ops without it.
  int dead_rank = -1;
  /// ... except that it runs the dispatch and stops before the combine: the
  /// dispatch is the full one, the combine the one without its experts.
  bool dead_after_dispatch = false;
  /// ... except that it dies in the middle of the dispatch: its send stores
  /// its token masks and the rows of its first this many tokens only (the
  /// buffer was made under EPX_DEBUG_LL_DISPATCH_STOP), then it runs no hook
  /// and no combine. The others' rows of its later tokens are zero; their
  /// combine is the one without its experts. -1: off.
  int dead_mid_dispatch = -1;
  std::string name() const {
    std::string n = "maxT" + std::to_string(max_tokens) + "_H" + std::to_string(hidden) + "_K" +
                    std::to_string(num_topk) + "_E" + std::to_string(num_experts);
    n += fp8 ? (ue8m0 ? "_fp8ue8m0" : round_scale ? "_fp8round" : "_fp8") : "_bf16";
    if (masked > 0) n += "_masked";
    if (hook) n += "_hook";
    if (async) n += "_async";
    if (logfmt) n += "_logfmt";
    if (zero_copy) n += "_zerocopy";
    if (use_out) n += "_out";
    if (late_ms) n += "_late" + std::to_string(late_ms) + "ms";
    if (dead_rank >= 0) n += "_dead" + std::to_string(dead_rank);
    if (dead_after_dispatch) n += "_after_dispatch";
    if (dead_mid_dispatch >= 0) n += "_dies_after_rows" + std::to_string(dead_mid_dispatch);
    return n;
  }
  /// name() and what else shapes the inputs: equal keys, equal reference data.
  std::string key() const {
    return name() + "_m" + std::to_string(masked) + (empty_token ? "_empty" : "") +
           (rank1_no_tokens ? "_rank1none" : "") + (duplicate_picks ? "_dup" : "") + "_T" +
           std::to_string(tokens_base) + "+" + std::to_string(tokens_step);
  }
};

struct LlInputs {
  std::vector<int> num_tokens;
  std::vector<std::vector<uint16_t>> x;     ///< [T_r, H]
  std::vector<std::vector<int64_t>> topk;   ///< [T_r, K]
  std::vector<std::vector<float>> weights;  ///< [T_r, K]
};

inline LlInputs make_inputs(const LlCase& c, int R, uint64_t seed) {
  LlInputs in;
  in.num_tokens.resize(R);
  in.x.resize(R);
  in.topk.resize(R);
  in.weights.resize(R);
  for_each_rank(R, [&](int r) {
    int T = c.tokens_base > 0 ? std::min(c.tokens_base + c.tokens_step * r, c.max_tokens)
                              : c.max_tokens - (r % 3);  // ranks differ in token count
    if (T < 1) T = c.max_tokens;
    if (c.rank1_no_tokens && r == 1) T = 0;
    in.num_tokens[r] = T;
    const uint64_t s = seed * 1000003 + r * 7919;
    in.topk[r] = random_topk(T, c.num_topk, c.num_experts, c.masked, s);
    if (c.empty_token && T > 0)
      for (int k = 0; k < c.num_topk; ++k) in.topk[r][k] = -1;
    if (c.duplicate_picks && T > 1 && c.num_topk > 1) {
      in.topk[r][c.num_topk + 1] = in.topk[r][c.num_topk];
      if (in.topk[r][c.num_topk] < 0) in.topk[r][c.num_topk] = in.topk[r][c.num_topk + 1] = 0;
    }
    in.x[r] = random_bf16(static_cast<std::size_t>(T) * c.hidden, s + 1);
    in.weights[r] = random_f32(static_cast<std::size_t>(T) * c.num_topk, s + 2);
  });
  return in;
}

/// The inputs as the live ranks see them when `dead` is left out: it has no
/// tokens, and every pick of one of its experts is -1.
inline LlInputs without_rank(const LlInputs& in, int dead, int E_local) {
  LlInputs out = in;
  if (dead < 0) return out;
  out.num_tokens[dead] = 0;
  out.x[dead].clear();
  out.topk[dead].clear();
  out.weights[dead].clear();
  for (auto& topk : out.topk)
    for (auto& e : topk)
      if (e >= 0 && e / E_local == dead) e = -1;
  return out;
}

/// The inputs with weight 0 on every pick of one of `dead`'s experts: the
/// combine without that rank's experts, over the full dispatch's placement.
inline LlInputs without_experts_of(const LlInputs& in, int dead, int E_local) {
  LlInputs out = in;
  for (std::size_t r = 0; r < out.topk.size(); ++r)
    for (std::size_t i = 0; i < out.topk[r].size(); ++i)
      if (out.topk[r][i] >= 0 && out.topk[r][i] / E_local == dead) out.weights[r][i] = 0.0f;
  return out;
}

/// The reference's dispatch output for this rank as it is when source `src`
/// sent the rows of its tokens [0, first) only: every later row of `src`
/// zero, its scales too (the receiver's copy of a row that never came).
inline void zero_rows_from(ref::LlDispatchOutput& ro, int src, int first, int E_local, int RT,
                           int H, bool fp8) {
  const int G = H / 128;
  for (int le = 0; le < E_local; ++le)
    for (int j = 0; j < ro.recv_count[le]; ++j) {
      const std::size_t i = static_cast<std::size_t>(le) * RT + j;
      if (ro.recv_src_rank[i] != src || ro.src_info[i] < first) continue;
      if (!fp8) {
        std::fill_n(ro.recv_x_bf16.begin() + i * H, H, uint16_t{0});
        continue;
      }
      std::fill_n(ro.recv_x_fp8.begin() + i * H, H, uint8_t{0});
      std::fill_n(ro.recv_x_scales.begin() + i * G, G, 0.0f);
    }
}

inline std::size_t ll_buffer_bytes() {
  return world().buffer->local_buffer(true).nbytes();
}

/// The expert output of rank r's local expert le for token t of source s:
/// random, but a function of those (not of the row it sits in), so that any
/// packing order gets the same values.
inline std::vector<uint16_t> expert_row(const LlCase& c, uint64_t seed, int r, int le, int s,
                                        int t) {
  return random_bf16(static_cast<std::size_t>(c.hidden),
                     seed * 131 + ((static_cast<uint64_t>(r) * 1024 + le) * 8 + s) * 4096 + t);
}

/// Expert outputs of every rank in the reference's packing: expert_row where
/// the reference placed a token, zero elsewhere.
inline std::vector<std::vector<uint16_t>> make_expert_out(
    const LlCase& c, int R, const std::vector<ref::LlDispatchOutput>& ro, uint64_t seed) {
  const int E_local = c.num_experts / R, RT = R * c.max_tokens, H = c.hidden;
  std::vector<std::vector<uint16_t>> eo(R);
  for_each_rank(R, [&](int r) {
    eo[r].assign(static_cast<std::size_t>(E_local) * RT * H, 0);
    for (int le = 0; le < E_local; ++le)
      for (int j = 0; j < ro[r].recv_count[le]; ++j) {
        const std::size_t i = static_cast<std::size_t>(le) * RT + j;
        const auto row = expert_row(c, seed, r, le, ro[r].recv_src_rank[i], ro[r].src_info[i]);
        std::memcpy(&eo[r][i * H], row.data(), row.size() * 2);
      }
  });
  return eo;
}

/// This rank's expert outputs in the packing its dispatch returned (the
/// reference's, unless EPX_LL_ARRIVAL_ORDER=1): rows by the handle's
/// layout_range (source) and src_info (token).
inline std::vector<uint16_t> expert_out_as_dispatched(const LlCase& c, uint64_t seed,
                                                      const LowLatencyDispatchResult& res) {
  const int R = world().num_ranks, me = world().rank;
  const int E_local = c.num_experts / R, RT = R * c.max_tokens, H = c.hidden;
  const auto range = to_host<int64_t>(res.handle->layout_range);
  const auto src = to_host<int>(res.handle->src_info);
  std::vector<uint16_t> out(static_cast<std::size_t>(E_local) * RT * H, 0);
  for (int le = 0; le < E_local; ++le)
    for (int s = 0; s < R; ++s) {
      const int64_t v = range[static_cast<std::size_t>(le) * R + s];
      for (int64_t j = v >> 32; j < (v >> 32) + (v & 0xffffffff) && j < RT; ++j) {
        const std::size_t i = static_cast<std::size_t>(le) * RT + j;
        const auto row = expert_row(c, seed, me, le, s, src[i]);
        std::memcpy(&out[i * H], row.data(), row.size() * 2);
      }
    }
  return out;
}

inline float bf(uint16_t v) {
  return ref::bf16_to_float(v);
}

/// Checks this rank's dispatch outputs against the reference.
/// EPX_LL_ARRIVAL_ORDER=1: each local expert's rows come by source in the order
/// the sources were reserved, not in rank order (LlDispatchRecvParams).
inline bool arrival_order() {
  return env::ll_arrival_order();
}

/// Where each packed row of the reference sits in EPX's output: map[le * RT + j]
/// = the reference's row of EPX's row j (identity in rank order). In arrival
/// order every source's rows must be one block of the reference's length, in
/// token order, and the blocks must tile [0, count).
inline std::vector<int> reference_rows(const LlCase& c, const std::vector<int64_t>& range,
                                       const ref::LlDispatchOutput& ro) {
  const int R = world().num_ranks, E_local = c.num_experts / R, RT = R * c.max_tokens;
  std::vector<int> map(static_cast<std::size_t>(E_local) * RT);
  for (std::size_t i = 0; i < map.size(); ++i) map[i] = static_cast<int>(i % RT);
  if (!arrival_order()) {
    EXPECT_EQ(range, ro.layout_range) << c.name() << ": layout_range";
    return map;
  }
  for (int le = 0; le < E_local; ++le) {
    std::vector<std::pair<int64_t, int64_t>> blocks;  // (begin, count) of the sources
    for (int s = 0; s < R; ++s) {
      const int64_t got = range[static_cast<std::size_t>(le) * R + s];
      const int64_t want = ro.layout_range[static_cast<std::size_t>(le) * R + s];
      const int64_t n = got & 0xffffffff, rb = want >> 32;
      EXPECT_EQ(n, want & 0xffffffff) << c.name() << ": rows of source " << s << " at le " << le;
      blocks.emplace_back(got >> 32, n);
      for (int64_t i = 0; i < n && (got >> 32) + i < RT; ++i)
        map[static_cast<std::size_t>(le) * RT + (got >> 32) + i] = static_cast<int>(rb + i);
    }
    std::sort(blocks.begin(), blocks.end());
    int64_t next = 0;
    for (const auto& [b, n] : blocks) {
      if (n == 0) continue;
      EXPECT_EQ(b, next) << c.name() << ": the sources' blocks of le " << le << " must tile";
      next = b + n;
    }
    EXPECT_EQ(next, ro.recv_count[le]) << c.name() << ": blocks of le " << le;
  }
  return map;
}

inline void check_dispatch(const LlCase& c, const LlInputs& in, const LowLatencyDispatchResult& res,
                           const ref::LlDispatchOutput& ro) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  const int E_local = c.num_experts / R, RT = R * c.max_tokens, H = c.hidden, G = H / 128;
  const auto& h = *res.handle;
  ASSERT_EQ(res.recv_x.view.ndim, 3);
  ASSERT_EQ(res.recv_x.size(0), E_local);
  ASSERT_EQ(res.recv_x.size(1), RT);
  ASSERT_EQ(res.recv_x.size(2), H);
  auto count = to_host<int>(res.recv_count);
  ASSERT_EQ(count, ro.recv_count) << c.name() << ": recv_count";
  const auto map = reference_rows(c, to_host<int64_t>(h.layout_range), ro);
  ASSERT_FALSE(rank_failed()) << c.name() << ": layout_range";
  {
    const auto src = to_host<int>(h.src_info);
    for (std::size_t i = 0; i < src.size(); ++i)
      ASSERT_EQ(src[i], ro.src_info[i / RT * RT + map[i]]) << c.name() << ": src_info row " << i;
  }
  if (in.num_tokens[me] > 0)
    ASSERT_EQ(to_host<int64_t>(h.topk_idx), in.topk[me]) << c.name() << ": handle topk";
  // Row j of local expert le (bytes `row` each) against the reference's row map[j].
  auto same_rows = [&](const auto& got, const auto& want, std::size_t row, const char* what) {
    for (int le = 0; le < E_local; ++le)
      for (int j = 0; j < count[le]; ++j) {
        const std::size_t at = static_cast<std::size_t>(le) * RT;
        ASSERT_EQ(std::memcmp(got.data() + (at + j) * row, want.data() + (at + map[at + j]) * row,
                              row * sizeof(got[0])),
                  0)
            << c.name() << ": " << what << " of local expert " << le << " row " << j;
      }
  };
  if (!c.fp8) {
    ASSERT_EQ(res.recv_x.view.dtype, DType::kBF16);
    same_rows(to_host<uint16_t>(res.recv_x), ro.recv_x_bf16, H, "recv_x");
    EXPECT_FALSE(res.recv_x_scales.has_value());
    return;
  }
  ASSERT_EQ(res.recv_x.view.dtype, DType::kFP8E4M3);
  same_rows(to_host<uint8_t>(res.recv_x), ro.recv_x_fp8, H, "recv_x (fp8)");
  ASSERT_TRUE(res.recv_x_scales.has_value());
  const auto& sv = res.recv_x_scales->view;
  const int cols = c.ue8m0 ? (G + 3) / 4 : G;
  ASSERT_EQ(sv.ndim, 3);
  ASSERT_EQ(sv.shape[0], E_local);
  ASSERT_EQ(sv.shape[1], RT);
  ASSERT_EQ(sv.shape[2], cols);
  ASSERT_EQ(sv.strides[0], static_cast<int64_t>(RT) * cols);
  ASSERT_EQ(sv.strides[1], 1);
  ASSERT_EQ(sv.strides[2], RT);
  if (!c.ue8m0) {
    ASSERT_EQ(sv.dtype, DType::kF32);
    auto sc = to_host<float>(*res.recv_x_scales);  // memory order [E_local, G, RT]
    for (int le = 0; le < E_local; ++le)
      for (int j = 0; j < count[le]; ++j)
        for (int g = 0; g < G; ++g) {
          const float a = sc[(static_cast<std::size_t>(le) * G + g) * RT + j];
          const float b =
              ro.recv_x_scales[(static_cast<std::size_t>(le) * RT + map[le * RT + j]) * G + g];
          ASSERT_EQ(std::memcmp(&a, &b, 4), 0) << c.name() << ": scale le " << le << " row " << j
                                               << " group " << g << ": " << a << " vs " << b;
        }
  } else {
    ASSERT_EQ(sv.dtype, DType::kI32);
    auto sc = to_host<int32_t>(*res.recv_x_scales);  // memory order [E_local, G/4, RT]
    for (int le = 0; le < E_local; ++le)
      for (int j = 0; j < count[le]; ++j)
        for (int g = 0; g < G; ++g) {
          const uint32_t packed =
              static_cast<uint32_t>(sc[(static_cast<std::size_t>(le) * cols + g / 4) * RT + j]);
          const uint8_t got_e = static_cast<uint8_t>(packed >> (8 * (g % 4)));
          const uint8_t want = ref::scale_to_ue8m0(
              ro.recv_x_scales[(static_cast<std::size_t>(le) * RT + map[le * RT + j]) * G + g]);
          ASSERT_EQ(got_e, want) << c.name() << ": ue8m0 le " << le << " row " << j << " group "
                                 << g;
        }
  }
}

/// |combined - ref| <= 1e-2 |ref| + 1e-2 + slack * sum_k |w_k x_k| for every value.
inline void check_combine(const LlCase& c, const LlInputs& in,
                          const std::vector<ref::LlDispatchOutput>& ro,
                          const std::vector<std::vector<uint16_t>>& eo,
                          const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  const int E = c.num_experts, E_local = E / R, RT = R * c.max_tokens, H = c.hidden, K = c.num_topk;
  const int T = in.num_tokens[me];
  ASSERT_EQ(got.size(), static_cast<std::size_t>(T) * H);
  ASSERT_EQ(want.size(), got.size());
  // Where the reference put each of my (token, expert) pairs.
  std::vector<int> row_of(static_cast<std::size_t>(T) * E, -1);
  for (int r = 0; r < R; ++r)
    for (int le = 0; le < E_local; ++le)
      for (int j = 0; j < ro[r].recv_count[le]; ++j) {
        const std::size_t i = static_cast<std::size_t>(le) * RT + j;
        if (ro[r].recv_src_rank[i] == me)
          row_of[static_cast<std::size_t>(ro[r].src_info[i]) * E + r * E_local + le] = j;
      }
  const double slack = 0x1p-8;
  std::size_t bad = 0;
  std::vector<int> bad_tokens;
  std::vector<double> mag(H);
  for (int t = 0; t < T; ++t) {
    std::fill(mag.begin(), mag.end(), 0.0);
    for (int k = 0; k < K; ++k) {
      const int64_t e = in.topk[me][static_cast<std::size_t>(t) * K + k];
      if (e < 0) continue;
      const int j = row_of[static_cast<std::size_t>(t) * E + e];
      ASSERT_GE(j, 0) << "reference placement missing";
      const float wk = std::fabs(in.weights[me][static_cast<std::size_t>(t) * K + k]);
      const uint16_t* row = &eo[e / E_local][(static_cast<std::size_t>(e % E_local) * RT + j) * H];
      for (int hh = 0; hh < H; ++hh) mag[hh] += wk * std::fabs(bf(row[hh]));
    }
    for (int hh = 0; hh < H; ++hh) {
      const std::size_t i = static_cast<std::size_t>(t) * H + hh;
      const double g = bf(got[i]), r = bf(want[i]);
      const double tol = 1e-2 * std::fabs(r) + 1e-2 + slack * mag[hh];
      if (!(std::fabs(g - r) <= tol)) {
        if (bad < 5) {
          std::string picks;  // the ranks the token's picks name (which rows the sum read)
          for (int k = 0; k < K; ++k) {
            const int64_t e = in.topk[me][static_cast<std::size_t>(t) * K + k];
            picks += " " + (e < 0 ? std::string("-") : std::to_string(e / E_local));
          }
          ADD_FAILURE() << c.name() << ": combined_x[" << t << ", " << hh << "] = " << g
                        << ", reference " << r << ", tolerance " << tol
                        << "; the token's picks are on ranks" << picks;
        }
        ++bad;
        if (bad_tokens.empty() || bad_tokens.back() != t) bad_tokens.push_back(t);
      }
    }
  }
  std::string tokens;
  for (std::size_t i = 0; i < bad_tokens.size() && i < 16; ++i)
    tokens += " " + std::to_string(bad_tokens[i]);
  if (!bad_tokens.empty()) {
    // Per rank: how many bad and how many good tokens have a pick there (a
    // rank whose rows are wrong is named by every bad token and no good one).
    std::vector<int> on_bad(R, 0), on_good(R, 0);
    std::vector<char> is_bad(T, 0);
    for (int t : bad_tokens) is_bad[t] = 1;
    for (int t = 0; t < T; ++t) {
      std::vector<char> named(R, 0);
      for (int k = 0; k < K; ++k) {
        const int64_t e = in.topk[me][static_cast<std::size_t>(t) * K + k];
        if (e >= 0) named[e / E_local] = 1;
      }
      for (int r = 0; r < R; ++r)
        if (named[r]) ++(is_bad[t] ? on_bad : on_good)[r];
    }
    tokens += "; per rank, bad/good tokens with a pick there:";
    for (int r = 0; r < R; ++r)
      tokens += " " + std::to_string(r) + ":" + std::to_string(on_bad[r]) + "/" +
                std::to_string(on_good[r]);
  }
  EXPECT_EQ(bad, 0u) << c.name() << ": combined_x differs from the reference in " << bad
                     << " values of " << bad_tokens.size() << " tokens:" << tokens;
}

inline cudaStream_t case_stream(const LlCase& c) {
  return c.legacy_stream ? cudaStreamLegacy : world().stream;
}

inline LowLatencyDispatchArgs dispatch_args(const LlCase& c, void* x, void* topk, int T) {
  LowLatencyDispatchArgs a;
  a.x = view(x, DType::kBF16, {T, c.hidden});
  a.topk_idx = view(topk, DType::kI64, {T, c.num_topk});
  a.num_max_dispatch_tokens_per_rank = c.max_tokens;
  a.num_experts = c.num_experts;
  a.use_fp8 = c.fp8;
  a.round_scale = c.round_scale;
  a.use_ue8m0 = c.ue8m0;
  a.async_finish = c.async;
  a.return_recv_hook = c.hook;
  a.stream = case_stream(c);
  return a;
}

inline void finish(const std::optional<Event>& ev, cudaStream_t stream = world().stream) {
  if (ev) ev->synchronize();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
}

/// Wait statistics of one op, [R] i64 on the device, starting non-zero (they
/// are added to).
struct WaitStats {
  std::vector<int64_t> base;
  DeviceArray<int64_t> d;
  explicit WaitStats(int R) : base(R) {
    for (int s = 0; s < R; ++s) base[s] = 1000 + s;
    d = to_device(base);
  }
  TensorView view() const { return epx::test::view(d.get(), DType::kI64, {int64_t(base.size())}); }
};

/// How late the late rank of the late cases is, in ms: EPX_TEST_LATE_MS
/// (default 50). Their wait check (check_waits) needs the lateness to exceed
/// the op's own waits several times over; a transport whose ops take longer
/// than about 10 ms at these sizes (libfabric over tcp with 16 in-process
/// ranks: about 250 ms) needs more. A bad value fails the test naming it.
inline int test_late_ms() {
  const char* v = std::getenv("EPX_TEST_LATE_MS");
  if (v == nullptr) return 50;
  char* end = nullptr;
  const long ms = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || ms < 1 || ms > 60'000) {
    ADD_FAILURE() << "EPX_TEST_LATE_MS must be an integer of 1 to 60000 (ms), got '" << v << "'";
    return 50;
  }
  return static_cast<int>(ms);
}

/// Every rank lines up before an op: with c.late_ms (then the last one sleeps
/// before its op), and with a dead rank (shrink cases; the dead one joins the
/// line-ups of the ops it skips): the ranks' host-side reference work differs
/// by seconds at 16 in-process ranks, more than the shrink deadline, and a
/// live rank that starts an op that late is rightly masked by the others.
/// The late rank is late on the GPU as well (`op_follows`: its op is queued
/// next): it sleeps c.late_ms on the host, then queues a kernel that spins
/// c.late_ms before its op. The host sleep alone does not make the GPU see a
/// late rank when the GPU starts the others' kernels late (with the proxy in
/// a CUDA context of its own the GPU time-slices the two, and a kernel may
/// start tens of ms after its launch); the spin does, as the others' kernels
/// were queued c.late_ms before it.
inline void line_up(const LlCase& c, bool op_follows = true) {
  if (c.late_ms == 0 && c.dead_rank < 0) return;
  ASSERT_TRUE(all_ranks(true));
  if (world().rank != world().num_ranks - 1 || c.late_ms == 0) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(c.late_ms));
  if (op_follows)
    ASSERT_EQ(launch_device_sleep(uint64_t(c.late_ms) * 1'000'000, case_stream(c)), cudaSuccess);
}

/// After an op whose last rank started c.late_ms late: every other rank puts
/// at least a fifth of that on it (per wait: the dispatch sums `waits`, one per
/// local expert) and less than half of it on any other source; the late rank
/// itself waits less than that for anyone. Where the proxy's copies run in a
/// CUDA context of their own (the engine says so), the GPU time-slices it
/// with the kernels' (tens of ms to a source at 4x4): there the late source's
/// wait must exceed every other source's and a fifth of the lateness once,
/// not once per wait.
inline void check_waits(const LlCase& c, const char* op, const WaitStats& st, int64_t waits) {
  const int R = world().num_ranks, me = world().rank, late = R - 1;
  std::vector<int64_t> got(R);
  ASSERT_EQ(cudaMemcpy(got.data(), st.d.get(), R * sizeof(int64_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  std::string all;
  for (int s = 0; s < R; ++s) {
    got[s] -= st.base[s];
    all += " " + std::to_string(got[s]);
    EXPECT_GE(got[s], 0) << op << " source " << s;
  }
  if (me == 0) std::printf("[ waits    ] rank 0, %s, ns per source:%s\n", op, all.c_str());
  // What the proxy's engine reports (Buffer::network_engine), so that
  // EPX_PROXY_CUMEM and BufferOptions::proxy_cumem count too.
  const bool own_context =
      world().buffer->network_engine().find("own CUDA context") != std::string::npos;
  const int64_t least = waits * c.late_ms * 1'000'000 / 5;
  const int64_t least_seen = own_context ? c.late_ms * 1'000'000 / 5 : least;
  const int64_t margin = own_context ? 1 : 2;
  if (me != late) {
    EXPECT_GE(got[late], least_seen) << op << " waits (ns):" << all;
    for (int s = 0; s < R; ++s)
      if (s != late) EXPECT_LT(margin * got[s], got[late]) << op << " source " << s << ":" << all;
  } else {
    for (int s = 0; s < R; ++s)
      EXPECT_LT(got[s], least) << op << " late rank, source " << s << ":" << all;
  }
}

/// After an op has finished: a wait of its kernels that gave up (recorded,
/// otherwise raised only by the buffer's next call) fails the test here,
/// naming the op, the rank, the peer and what was awaited, before the
/// outputs are compared: an op that left its outputs unwritten must not look
/// like one that computed them wrongly, nor pass unreported when it is the
/// buffer's last.
inline void expect_op_reported_nothing(Buffer& buf, const LlCase& c, const char* op) {
  try {
    buf.check();
  } catch (const Error& e) {
    ADD_FAILURE() << c.name() << ": " << op << " raised: " << e.what();
  }
}

/// Options of a Buffer of the LL size hint for `c`, with this deadline and allocator.
inline BufferOptions hint_sized_options(const LlCase& c, int R, double timeout_s, Allocator alloc) {
  BufferOptions o;
  o.num_rdma_bytes = static_cast<int64_t>(
      Buffer::get_low_latency_rdma_size_hint(c.max_tokens, c.hidden, R, c.num_experts));
  o.timeout_s = timeout_s;
  o.allocator = std::move(alloc);
  return o;
}

inline void run_case(const LlCase& c, uint64_t seed, bool with_combine = true,
                     Buffer* buffer = nullptr) {
  auto& w = world();
  Buffer* const buf = buffer ? buffer : w.buffer.get();
  const int R = w.num_ranks, me = w.rank;
  if (c.num_experts % R) GTEST_SKIP() << "experts not divisible by ranks";
  if (c.rank1_no_tokens && R < 2) GTEST_SKIP();
  const std::size_t need =
      c.zero_copy ? Buffer::get_low_latency_rdma_size_hint(c.max_tokens, c.hidden, R, c.num_experts)
                  : 0;
  if (need > ll_buffer_bytes()) GTEST_SKIP() << "zero-copy needs " << need << " bytes";
  const int E_local = c.num_experts / R, RT = R * c.max_tokens, H = c.hidden, K = c.num_topk;
  const bool dies_mid = c.dead_mid_dispatch >= 0;
  const bool dispatched = c.dead_after_dispatch || dies_mid;  // the dead rank's tokens went out
  if (me == c.dead_rank && !dispatched) {  // no call; the test's collectives only
    line_up(c, false);
    ASSERT_TRUE(all_ranks(true));
    if (with_combine) {
      line_up(c, false);
      ASSERT_TRUE(all_ranks(true));
    }
    return;
  }

  auto in = make_inputs(c, R, seed);
  const int T = in.num_tokens[me];
  // What the reference sees: without the dead rank (the inputs themselves otherwise).
  const LlInputs ref_in = dispatched ? in : without_rank(in, c.dead_rank, E_local);
  const LlInputs comb_in = dispatched ? without_experts_of(in, c.dead_rank, E_local) : ref_in;
  // Every rank's reference outputs, shared by in-process ranks (harness).
  const std::string key = c.key() + "_seed" + std::to_string(seed);
  const auto ro_shared =
      shared_reference<std::vector<ref::LlDispatchOutput>>("ll_dispatch " + key, [&] {
        return ref::ll_dispatch(ref_in.x, ref_in.topk, ref_in.num_tokens, H, K, c.num_experts,
                                c.max_tokens, c.fp8, c.round_scale);
      });
  const auto& ro = *ro_shared;
  auto d_x = to_device(in.x[me]);
  auto d_topk = to_device(in.topk[me]);
  auto d_w = to_device(in.weights[me]);
  DeviceArray<int> d_stats;
  std::vector<int> stats0;
  auto a = dispatch_args(c, d_x.get(), d_topk.get(), T);
  if (c.stats) {
    stats0.assign(E_local, 0);
    for (int i = 0; i < E_local; ++i) stats0[i] = 1000 * i + 7;
    d_stats = to_device(stats0);
    a.cumulative_local_expert_recv_stats = view(d_stats.get(), DType::kI32, {E_local});
  }
  WaitStats dwait(R), cwait(R);
  if (c.late_ms) a.dispatch_wait_recv_cost_stats = dwait.view();
  line_up(c);
  auto res = buf->low_latency_dispatch(a);
  EXPECT_EQ(static_cast<bool>(res.hook), c.hook);
  EXPECT_EQ(res.event.has_value(), c.async);
  if (dies_mid && me == c.dead_rank) {  // no hook, no check, no combine; the collectives only
    finish(res.event, case_stream(c));
    ASSERT_TRUE(all_ranks(true));
    if (with_combine) {
      line_up(c, false);
      ASSERT_TRUE(all_ranks(true));
    }
    return;
  }
  if (res.hook) res.hook();
  finish(res.event, case_stream(c));
  expect_op_reported_nothing(*buf, c, "low_latency_dispatch");
  if (dies_mid && same_node(me, c.dead_rank)) {
    auto want = ro[me];
    zero_rows_from(want, c.dead_rank, c.dead_mid_dispatch, E_local, RT, H, c.fp8);
    check_dispatch(c, in, res, want);
  } else if (dies_mid) {
    // Across nodes a source's rows count only with its dispatch signal, which
    // a rank that dies mid-dispatch never sends: as if it sent no token.
    const auto ro_wo = shared_reference<std::vector<ref::LlDispatchOutput>>(
        "ll_dispatch without the dead rank " + key, [&] {
          const auto wo = without_rank(in, c.dead_rank, E_local);
          return ref::ll_dispatch(wo.x, wo.topk, wo.num_tokens, H, K, c.num_experts, c.max_tokens,
                                  c.fp8, c.round_scale);
        });
    check_dispatch(c, in, res, (*ro_wo)[me]);
  } else {
    check_dispatch(c, in, res, ro[me]);
  }
  if (c.late_ms) check_waits(c, c.hook ? "dispatch (hook)" : "dispatch", dwait, E_local);
  if (c.stats) {
    std::vector<int> got(E_local);
    ASSERT_EQ(cudaMemcpy(got.data(), d_stats.get(), E_local * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int le = 0; le < E_local; ++le)
      EXPECT_EQ(got[le], stats0[le] + ro[me].recv_count[le]) << "stats " << le;
  }
  ASSERT_TRUE(all_ranks(!rank_failed())) << "another rank failed " << c.name();
  if (!with_combine) return;
  if (me == c.dead_rank) {  // dead_after_dispatch: stops here
    line_up(c, false);
    ASSERT_TRUE(all_ranks(true));
    return;
  }

  const auto eo_shared = shared_reference<std::vector<std::vector<uint16_t>>>(
      "expert_out " + key, [&] { return make_expert_out(c, R, ro, seed); });
  const auto& eo = *eo_shared;
  const auto mine = expert_out_as_dispatched(c, seed, res);  // eo[me] in the dispatch's packing
  DeviceArray<uint16_t> d_eo;
  TensorView xv;
  if (c.zero_copy) {
    xv = buf->get_next_low_latency_combine_buffer(*res.handle);
    ASSERT_EQ(xv.shape[0], E_local);
    ASSERT_EQ(xv.shape[1], RT);
    ASSERT_EQ(xv.shape[2], H);
    ASSERT_EQ(cudaMemcpy(xv.data, mine.data(), mine.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
  } else {
    d_eo = to_device(mine);
    xv = view(d_eo.get(), DType::kBF16, {E_local, RT, H});
  }
  DeviceArray<uint16_t> d_out;
  if (c.use_out) d_out = to_device(std::vector<uint16_t>(static_cast<std::size_t>(T) * H, 0xffff));
  LowLatencyCombineArgs ca;
  ca.x = xv;
  ca.topk_idx = view(d_topk.get(), DType::kI64, {T, K});
  ca.topk_weights = view(d_w.get(), DType::kF32, {T, K});
  ca.handle = res.handle;
  ca.use_logfmt = c.logfmt;
  ca.zero_copy = c.zero_copy;
  ca.async_finish = c.async;
  ca.return_recv_hook = c.hook;
  if (c.use_out) ca.out = view(d_out.get(), DType::kBF16, {T, H});
  ca.stream = case_stream(c);
  if (c.late_ms) ca.combine_wait_recv_cost_stats = cwait.view();
  line_up(c);
  auto cres = buf->low_latency_combine(ca);
  EXPECT_EQ(static_cast<bool>(cres.hook), c.hook);
  if (cres.hook) cres.hook();
  finish(cres.event, case_stream(c));
  expect_op_reported_nothing(*buf, c, "low_latency_combine");
  if (c.late_ms) check_waits(c, c.hook ? "combine (hook)" : "combine", cwait, 1);
  if (c.use_out) EXPECT_EQ(cres.combined_x.view.data, static_cast<void*>(d_out.get()));
  const auto rc = shared_reference<std::vector<std::vector<uint16_t>>>("ll_combine " + key, [&] {
    return ref::ll_combine(eo, comb_in.topk, comb_in.weights, comb_in.num_tokens, H, K,
                           c.num_experts, c.max_tokens, c.logfmt);
  });
  check_combine(c, comb_in, ro, eo, to_host<uint16_t>(cres.combined_x), (*rc)[me]);
  if (c.empty_token && T > 0) {
    auto got = to_host<uint16_t>(cres.combined_x);
    for (int hh = 0; hh < H; ++hh) ASSERT_EQ(got[hh], 0) << "token with no picks must combine to 0";
  }
  ASSERT_TRUE(all_ranks(!rank_failed())) << "another rank failed " << c.name();
}

}  // namespace epx::test::ll
