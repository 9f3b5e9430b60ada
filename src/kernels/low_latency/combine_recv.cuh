// kernels/low_latency/combine_recv.cuh - the combine's receive phase: a lane's row parts and
// combine_recv_phase.
#pragma once

#include "kernels/low_latency/combine_send.cuh"

namespace epx::kernels {
namespace {

/// A lane's part of one rank's row in a combine-receive item: kSteps BF16
/// vectors, or with LogFMT its codes of one 128-value group (kSteps == 1).
template <bool kLogFmt, int kSteps>
struct RowPart {
  int4 v[kSteps];
};
template <int kSteps>
struct RowPart<true, kSteps> {
  static_assert(kSteps == 1, "a LogFMT item is 256 columns: one group per half-warp");
  LogFmtLane w;
};

/// Loads lane `lane`'s part of item chunk `c` of the row at `row` (a
/// source's row of 2H bytes); `use` false (or columns past the row) gives a
/// part of zeros.
template <bool kLogFmt, int kSteps>
__device__ __forceinline__ RowPart<kLogFmt, kSteps> load_row_part(const uint8_t* row, int c,
                                                                  int lane, int H8, bool use) {
  RowPart<kLogFmt, kSteps> part;
  const int col0 = c * (kSteps * 256 / 8) + lane;
  if constexpr (kLogFmt) {
    if (use && col0 < H8) {
      part.w = logfmt_load(row + static_cast<std::size_t>(2 * c + lane / 16) * kLogFmtGroupBytes,
                           lane % 16);
    } else {
      part.w = LogFmtLane{0u, 0u, 0.0f, 0.0f};
    }
  } else {
#pragma unroll
    for (int st = 0; st < kSteps; ++st)
      part.v[st] = use && col0 + 32 * st < H8
                       ? __ldcg(reinterpret_cast<const int4*>(row) + col0 + 32 * st)
                       : make_int4(0, 0, 0, 0);
  }
  return part;
}

/// Adds one rank's row of a combine-receive item (`part`) to `acc`: a raw
/// row (the rank hosts a single expert of the token), weighted here by each
/// of the picks naming it (`picks`: their lanes, `w` the lane's weight), in
/// lane order; or a sum the rank already weighted (several experts there),
/// as it is. LogFMT rows are decoded first.
template <bool kLogFmt, int kSteps>
__device__ __forceinline__ void add_rank_row(float (&acc)[kSteps][8],
                                             const RowPart<kLogFmt, kSteps>& part, uint32_t picks,
                                             bool raw, float w) {
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    float f[8];
    if constexpr (kLogFmt)
      logfmt_decode(part.w, f);
    else
      unpack_bf16x8(part.v[st], f);
    if (raw) {
      for (uint32_t m = picks; m != 0u; m &= m - 1u) {
        const float wk = __shfl_sync(kFull, w, __ffs(m) - 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[st][i] = fmaf(wk, f[i], acc[st][i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[st][i] += f[i];
    }
  }
}

// ============================================================================
// combine: receive. Each warp takes (token, 256-column chunk) items and sums
// the rows of the ranks the token reached, in rank order; a rank that hosts one
// of the token's experts sent its raw row, weighted here. The rows of up to
// kRanksAtOnce ranks load together, before the token's routing is known (most
// (token, rank) pairs carry a row), and the first item's routing loads
// before the wait for the sources' flags (it is input, not the sends' output).
// `epoch` and `seq`: this op's, from the send phase (low_latency/combine.cuh).
// ============================================================================
template <bool kLogFmt, class T>
__device__ __forceinline__ void combine_recv_phase(const LlCombineRecvParams<T>& p, uint32_t epoch,
                                                   uint64_t seq) {
  const int R = p.t.num_ranks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int H = p.hidden, K = p.num_topk, E = p.num_experts, E_local = E / R;
  const int H8 = H / 8;
  constexpr int kCombineChunk = kLlCombineRecvChunk, kCombineSteps = kCombineChunk / 256;
  constexpr int kRanksAtOnce = kLogFmt ? 2 : kLlCombineRecvRanksAtOnce;  // LogFMT: registers
  const std::size_t row_bytes = combine_row_bytes<kLogFmt>(H);
  const int C = ceil_div(H, kCombineChunk);
  const int items = p.num_tokens * C;
  int item = blockIdx.x * kWarps + warp;
  auto pick_of = [&](int it, int64_t& e, float& w) {
    const int64_t at = static_cast<int64_t>(it / C) * K + min(lane, K - 1);
    e = lane < K ? p.topk_idx[at] : -1;
    w = lane < K ? p.topk_weights[at] : 0.0f;
  };
  int64_t e = -1;
  float w = 0.0f;
  if (item < items) pick_of(item, e, w);

  tl_mark(kTlCombine, kTlRecvStart);
  tl_mark(kTlCombine, kTlRecvGo);
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;

  uint32_t live = 0;  // shrink: the ranks whose rows count
  if (!wait_combine_flags(p.t, p.off, half, epoch, seq, p.timeout_ns, p.diag, p.wait_stats,
                          p.send_wait_first, live)) {
    tl_finish(kTlCombine, p.t.rank);
    return;
  }
  tl_mark(kTlCombine, kTlRecvFlags);

  if constexpr (kNet<T>) {
    // Up to T::kCaps.max_ranks ranks: only the (at most K) ranks the token's
    // picks name are read, in ascending rank order, kRanksAtOnce rows at a time.
    for (bool first_item = true; item < items; item += gridDim.x * kWarps, first_item = false) {
      const int t = item / C, c = item % C;
      const int col0 = c * (kCombineChunk / 8) + lane;
      const uint8_t* rows = reinterpret_cast<const uint8_t*>(
          p.t.local_ptr(half + p.off.comb_rows + static_cast<std::size_t>(t) * row_bytes));
      const std::size_t rank_stride = static_cast<std::size_t>(p.max_tokens) * row_bytes;
      if (!first_item) pick_of(item, e, w);
      int rank_of = (e >= 0 && e < E) ? static_cast<int>(e / E_local) : -1;
      if (rank_of >= 0 && p.t.masked(rank_of)) rank_of = -1;  // a masked rank's pick
      const bool first = lane == __ffs(__match_any_sync(kFull, e)) - 1;
      // One lane per distinct rank; lane i of `sorted` holds the i-th smallest.
      const uint32_t same_rank = __match_any_sync(kFull, rank_of);  // every lane
      const bool rank_lead = rank_of >= 0 && lane == __ffs(same_rank) - 1;
      const uint32_t leads = __ballot_sync(kFull, rank_lead);
      const int n_ranks = __popc(leads);
      int sorted = -1;
      for (uint32_t m = leads; m != 0u; m &= m - 1u) {
        const int r = __shfl_sync(kFull, rank_of, __ffs(m) - 1);
        const int below = __popc(__ballot_sync(kFull, rank_lead && rank_of < r));
        if (lane == below) sorted = r;
      }
      float acc[kCombineSteps][8];
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[st][i] = 0.0f;
      for (int i0 = 0; i0 < n_ranks; i0 += kRanksAtOnce) {
        RowPart<kLogFmt, kCombineSteps> v[kRanksAtOnce];
#pragma unroll
        for (int rr = 0; rr < kRanksAtOnce; ++rr) {
          const int r = __shfl_sync(kFull, sorted, min(i0 + rr, n_ranks - 1));
          v[rr] = load_row_part<kLogFmt, kCombineSteps>(rows + r * rank_stride, c, lane, H8, true);
        }
#pragma unroll
        for (int rr = 0; rr < kRanksAtOnce; ++rr) {
          if (i0 + rr >= n_ranks) break;  // warp-uniform
          const int r = __shfl_sync(kFull, sorted, i0 + rr);
          const uint32_t picks = __ballot_sync(kFull, rank_of == r);
          add_rank_row<kLogFmt>(acc, v[rr], picks,
                                __popc(__ballot_sync(kFull, rank_of == r && first)) == 1, w);
        }
      }
      int4* out = reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * H);
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
        if (col0 + 32 * st < H8) out[col0 + 32 * st] = pack_bf16x8(acc[st]);
    }
  } else {
    for (bool first_item = true; item < items; item += gridDim.x * kWarps, first_item = false) {
      const int t = item / C, c = item % C;
      const int col0 = c * (kCombineChunk / 8) + lane;
      const uint8_t* rows = reinterpret_cast<const uint8_t*>(
          p.t.local_ptr(half + p.off.comb_rows + static_cast<std::size_t>(t) * row_bytes));
      const std::size_t rank_stride = static_cast<std::size_t>(p.max_tokens) * row_bytes;
      float acc[kCombineSteps][8];
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[st][i] = 0.0f;
      RowPart<kLogFmt, kCombineSteps> v[kRanksAtOnce];
      auto load_rows = [&](int r0) {
#pragma unroll
        for (int rr = 0; rr < kRanksAtOnce; ++rr)
          v[rr] = load_row_part<kLogFmt, kCombineSteps>(rows + (r0 + rr) * rank_stride, c, lane, H8,
                                                        r0 + rr < R);
      };
      load_rows(0);  // before the routing: one memory latency, not two
      if (!first_item) pick_of(item, e, w);
      int rank_of = (e >= 0 && e < E) ? static_cast<int>(e / E_local) : -1;
      if (rank_of >= 0 && !((live >> rank_of) & 1u)) rank_of = -1;  // a masked rank's pick
      // First pick of each distinct expert (a repeated expert id counts once).
      const bool first = lane == __ffs(__match_any_sync(kFull, e)) - 1;
      for (int r0 = 0; r0 < R; r0 += kRanksAtOnce) {
        if (r0 > 0) load_rows(r0);
#pragma unroll
        for (int rr = 0; rr < kRanksAtOnce; ++rr) {
          const int r = r0 + rr;
          const uint32_t picks = __ballot_sync(kFull, rank_of == r);  // none when r >= R
          if (picks == 0u) continue;
          add_rank_row<kLogFmt>(acc, v[rr], picks,
                                __popc(__ballot_sync(kFull, rank_of == r && first)) == 1, w);
        }
      }
      int4* out = reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * H);
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
        if (col0 + 32 * st < H8) out[col0 + 32 * st] = pack_bf16x8(acc[st]);
    }
  }
  tl_finish(kTlCombine, p.t.rank);
}

}  // namespace
}  // namespace epx::kernels
