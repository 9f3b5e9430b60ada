// kernels/low_latency/combine_send.cuh - the combine's send phase: weight words, the combine
// plan's rows and combine_send_phase.
#pragma once

#include "kernels/low_latency/dispatch_kernels.cuh"

namespace epx::kernels {
namespace {

/// The packed row of token t at local expert le from the combine plan entry
/// `ent` = {mask, first row} of t's 32-token word, or -1 when t did not pick le
/// (LowLatencyHandle::combine_plan).
__device__ __forceinline__ int plan_row(int2 ent, int le, int t, int rows_per_expert) {
  const uint32_t mask = static_cast<uint32_t>(ent.x), bit = static_cast<uint32_t>(t % 32);
  if (!((mask >> bit) & 1u)) return -1;
  return le * rows_per_expert + ent.y + __popc(mask & ((1u << bit) - 1u));
}

/// Offset of combine weight word [s][t][j] (source s, its token t, entry j)
/// in the weights area that starts at `weights` (this op's half).
__device__ __forceinline__ std::size_t weight_word(const LlOffsets& o, std::size_t weights, int s,
                                                   int t, int j) {
  return weights + static_cast<std::size_t>(s) * o.weights_stride +
         (static_cast<std::size_t>(t) * plan::kLlMaxTopK + j) * 8u;
}

/// Network transports: every block counts itself once its weights are in the
/// send area; the last one puts, to each rank of another node, this rank's
/// weight words for it ([me][t][j] for every token t, one message on context
/// 0) with an add of 1 to that rank's weights signal of this rank, and adds 1
/// on the other contexts (a receiver waits for every context's word). Not
/// when a block's part of the op failed (net_failed_word).
template <class T>
__device__ __forceinline__ void net_send_weights(const LlCombineSendParams<T>& p,
                                                 std::size_t net_weights, std::size_t weights,
                                                 bool failed) {
  uint32_t* fail = net_failed_word(p.t, p.off, kNetFailedCombine);
  if (failed && threadIdx.x == 0) atomicOr(fail, 1u);  // before the count's release
  if (!dev::block_counted_last(reinterpret_cast<uint32_t*>(p.t.local_ptr(p.off.net_done)))) return;
  if (*static_cast<volatile uint32_t*>(fail) != 0u) return;  // a block's part failed
  const int R = p.t.num_ranks, me = p.t.rank;
  const std::size_t bytes = 8u * plan::kLlMaxTopK * static_cast<std::size_t>(p.num_tokens);
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    if (p.t.same_node(r) || p.t.masked(r)) continue;
    if (bytes > 0)
      p.t.template put_signal<dev::Thread>(0, r, weight_word(p.off, weights, me, 0, 0),
                                           weight_word(p.off, net_weights, r, 0, 0), bytes,
                                           ll_sig_weights(R, me), 1);
    else
      p.t.template signal_add<dev::Thread>(0, r, ll_sig_weights(R, me), 1);
    signal_contexts(p.t, r, ll_sig_weights(R, me), /*first=*/1);  // context 0 signalled above
  }
}

/// combine_wait_recv_cost_stats: when source s began its combine, as seen
/// here. Every source writes its weight words before it waits for anything,
/// so a warp of block 0 times the wait for s's first word here (entry 0 of
/// the first token of s with an expert here) and stores it + 1 in
/// p.wait_first[s] (left 0 when s sent no token here). The receive's wait for
/// s's flag would also blame a source whose own send a late rank held up.
template <class T>
__device__ __forceinline__ void time_first_weight(const LlCombineSendParams<T>& p,
                                                  std::size_t weights, uint32_t epoch, int s) {
  const int lane = threadIdx.x % 32;
  const int E_local = p.num_experts / p.t.num_ranks, W = ceil_div(p.max_tokens, 32);
  if (p.t.masked(s)) return;  // shrink: no weights come from s
  const uint64_t t0 = dev::globaltimer_ns();
  int first = -1;
#pragma unroll 1
  for (int w = 0; w < W && first < 0; ++w) {
    uint32_t any = 0;
#pragma unroll 1
    for (int g = lane; g < E_local; g += 32)
      any |= static_cast<uint32_t>(
          __ldcg(p.combine_plan + static_cast<std::size_t>(s * W + w) * E_local + g).x);
    any = __reduce_or_sync(kFull, any);
    if (any != 0u) first = 32 * w + __ffs(static_cast<int>(any)) - 1;
  }
  uint32_t unused = 0;
  if (first >= 0 && lane == 0 &&
      p.t.wait_tagged(weight_word(p.off, weights, s, first, 0), epoch, unused, p.timeout_ns, p.diag,
                      OpId::kLowLatencyCombineSend, s, first))
    p.wait_first[s] = dev::globaltimer_ns() - t0 + 1u;
}

/// A combine row's bytes in the receive and send areas: BF16, or LogFMT's
/// wire form packed row after row (so the puts of consecutive rows stay
/// contiguous and a proxy can coalesce them).
template <bool kLogFmt>
__device__ __forceinline__ std::size_t combine_row_bytes(int hidden) {
  return kLogFmt ? logfmt_wire_bytes(hidden) : 2u * static_cast<std::size_t>(hidden);
}

// ============================================================================
// combine: send. The first warps send this rank's weights (one tagged word per
// (token, distinct expert) to the expert's rank); then each warp takes
// (source, token, chunk) items of the tokens it received (kLlCombineSendChunk
// columns, kLlCombineSendChunkLogFmt with LogFMT). An item
// with several local experts loads their rows before it waits for their
// weights, and sums them in ascending expert id. With LogFMT what crosses is
// coded (logfmt.cuh's wire form, 168 bytes per 128 values instead of 256): a
// raw row, or the float32 sum (coded once, not rounded to BF16 first).
// The kernel (low_latency/combine.cuh) runs this phase, the receive phase
// after it, or both; `epoch` and `seq` get this op's epoch and op count.
// ============================================================================
template <bool kLogFmt, bool kWaitStats, class T>
__device__ __forceinline__ void combine_send_phase(const LlCombineSendParams<T>& p, uint32_t& epoch,
                                                   uint64_t& seq) {
  __shared__ int s_tokens[T::kCaps.max_ranks + 1];  // [kMaxRanks]: the largest
  __shared__ int s_rows[kWarps][plan::kLlMaxTopK];  // per warp: rows of the item's experts
  tl_mark(kTlCombine, kTlSendStart);
  tl_mark(kTlCombine, kTlSendStartMax);
  const int R = p.t.num_ranks, me = p.t.rank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  epoch = plan::next_epoch(*p.op_counter);
  seq = next_seq<T>(p.seq + 1);
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  const std::size_t weights = p.off.weights + (epoch & 1u) * p.off.weights_half_bytes;
  const int H = p.hidden, K = p.num_topk, E = p.num_experts, maxT = p.max_tokens;
  const int H8 = H / 8, E_local = E / R;
  constexpr int kCombineChunk = kLogFmt ? kLlCombineSendChunkLogFmt : kLlCombineSendChunk;
  constexpr int kCombineSteps = kCombineChunk / 256;
  static_assert(!kLogFmt || kCombineChunk == 256, "LogFMT: one 128-column group per half-warp");
  const std::size_t row_bytes = combine_row_bytes<kLogFmt>(H);
  constexpr int kRowsAtOnce = kLlCombineSendRowsAtOnce;
  bool send_ok = true;  // false: this block must not touch its send areas
  if constexpr (kNet<T>) send_ok = quiet_send_areas(p.t);
  // Network transports: this rank's send areas of the op's half.
  [[maybe_unused]] const std::size_t net_weights =
      p.off.net_weights + (epoch & 1u) * p.off.weights_half_bytes;
  [[maybe_unused]] const std::size_t net_rows =
      p.off.net_comb + (epoch & 1u) * p.off.net_comb_half_bytes;

  // Shrink: a masked source gets nothing back (and sends no weights here).
  uint32_t live = 0;  // network transports ask per rank
  if constexpr (!kNet<T>) live = p.t.live_ranks();
  int n_src = 0;
  if constexpr (!kNet<T>) {
    n_src = static_cast<int>(threadIdx.x) < R && ((live >> threadIdx.x) & 1u)
                ? p.disp_state[8 + threadIdx.x]
                : 0;
  } else {
    n_src = static_cast<int>(threadIdx.x) < R && !p.t.masked(threadIdx.x)
                ? p.disp_state[8 + threadIdx.x]
                : 0;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.state[0] = static_cast<int32_t>(epoch);
    if constexpr (kNet<T>) reinterpret_cast<uint64_t*>(p.state)[1] = seq;
  }

  // Weights: warp gw takes tokens gw, gw + all warps, ... For each distinct
  // expert of token t (the sum of the weights of the picks naming it, in k
  // order), entry [me][t][j] at the expert's rank, j = the expert's place in
  // ascending id among t's experts on that rank (the receiver's order).
  // Branch-free around the shuffles: every lane loads (a clamped pick) and
  // every lane takes every step, so the warp never splits around them.
  for (int t = blockIdx.x * kWarps + warp; send_ok && t < p.num_tokens; t += gridDim.x * kWarps) {
    const int kk = min(lane, K - 1);
    const int64_t e64 = p.topk_idx[static_cast<int64_t>(t) * K + kk];
    const float w = p.topk_weights[static_cast<int64_t>(t) * K + kk];
    const int e = lane < K && e64 >= 0 && e64 < E ? static_cast<int>(e64) : -1;
    const int r = e >= 0 ? e / E_local : -1;
    float wsum = 0.0f;    // weights of the picks naming e, in k order
    bool first = e >= 0;  // no earlier pick names e
    for (int k = 0; k < K; ++k) {
      const int ek = __shfl_sync(kFull, e, k);
      const float wk = __shfl_sync(kFull, w, k);
      wsum += ek == e ? wk : 0.0f;
      first = first && !(ek == e && k < lane);
    }
    int j = 0;  // distinct experts of t on rank r with a smaller id
    for (int k = 0; k < K; ++k) {
      const int ek = __shfl_sync(kFull, e, k);
      const bool first_k = __shfl_sync(kFull, first ? 1 : 0, k) != 0;  // implies ek >= 0
      j += first_k && ek / E_local == r && ek < e ? 1 : 0;
    }
    if constexpr (!kNet<T>) {
      if (first && ((live >> r) & 1u))
        p.t.lsa_tagged(r, weight_word(p.off, weights, me, t, j), __float_as_uint(wsum), epoch);
    } else if (first && !p.t.masked(r)) {
      if (p.t.same_node(r))
        p.t.lsa_tagged(r, weight_word(p.off, weights, me, t, j), __float_as_uint(wsum), epoch);
      else  // into the send area [r][t][j]; put below once every block wrote its tokens'
        dev::st_relaxed_sys_u64(
            reinterpret_cast<uint64_t*>(p.t.local_ptr(weight_word(p.off, net_weights, r, t, j))),
            (static_cast<uint64_t>(epoch) << 32) | __float_as_uint(wsum));
    }
  }
  if constexpr (kNet<T>) net_send_weights(p, net_weights, weights, !send_ok);
  if (static_cast<int>(threadIdx.x) < R) s_tokens[threadIdx.x] = min(max(n_src, 0), maxT);
  __syncthreads();
  if (threadIdx.x == 0) {
    int t_max = 0;
    for (int s = 0; s < R; ++s) t_max = max(t_max, s_tokens[s]);
    s_tokens[T::kCaps.max_ranks] = t_max;
  }
  __syncthreads();

  // Its own instance: the loop below keeps its registers (no spill).
  if constexpr (kWaitStats) {
    if constexpr (kNet<T>) {
      if (blockIdx.x == 0)
        for (int s = warp; s < R; s += kWarps) time_first_weight(p, weights, epoch, s);
    } else if (blockIdx.x == 0 && warp < R) {
      time_first_weight(p, weights, epoch, /*s=*/warp);
    }
  }

  // Items token-major, the sources rotated from me + 1: at any moment every
  // rank's warps write to all sources at once, each from a different start,
  // instead of every rank writing to source 0 first (one hot ingress).
  const int C = ceil_div(H, kCombineChunk);
  const int items = send_ok ? R * s_tokens[T::kCaps.max_ranks] * C : 0;
  bool failed = !send_ok;  // a wait of this warp failed: the op must not be signalled
  const int W = ceil_div(maxT, 32), RT = R * maxT;
  for (int item = blockIdx.x * kWarps + warp; item < items; item += gridDim.x * kWarps) {
    const int pair = item / C, c = item % C;
    const int s = (me + 1 + pair % R) % R, t = pair / R;
    if (t >= s_tokens[s]) continue;
    const int2* plan_w = p.combine_plan + static_cast<std::size_t>(s * W + t / 32) * E_local;
    // The packed rows of the local experts token t of s picked, in ascending
    // id, to s_rows[warp][0, n).
    int n = 0;
#pragma unroll 2
    for (int g = 0; g < E_local; g += 32) {
      const int2 ent = g + lane < E_local ? __ldcg(plan_w + g + lane) : make_int2(0, 0);
      const int row = plan_row(ent, g + lane, t, RT);
      const uint32_t picks = __ballot_sync(kFull, row >= 0);
      const int j = n + __popc(picks & ((1u << lane) - 1u));
      if (row >= 0 && j < plan::kLlMaxTopK) s_rows[warp][j] = row;
      n += __popc(picks);
    }
    if (n == 0) continue;
    n = min(n, plan::kLlMaxTopK);  // at most K distinct experts
    __syncwarp();
    const int my_row = lane < n ? s_rows[warp][lane] : -1;
    __syncwarp();  // read before the next item writes
    // The row's place at s; for a source in another node (network
    // transports) it is written to the send area [s][t] first, and the warp
    // that writes its last chunk puts it to s.
    const std::size_t at_s =
        half + p.off.comb_rows + (static_cast<std::size_t>(me) * maxT + t) * row_bytes;
    bool remote_s = false;
    if constexpr (kNet<T>) remote_s = !p.t.same_node(s);
    [[maybe_unused]] const std::size_t here =
        net_rows + (static_cast<std::size_t>(s) * maxT + t) * row_bytes;
    int4* dst = reinterpret_cast<int4*>(remote_s ? p.t.local_ptr(here) : p.t.lsa_ptr(s, at_s));
    // Every chunk of (s, t) counts in row_done, also one skipped because s
    // was masked meanwhile (`send` false): the count must reach C and reset.
    auto chunk_written = [&](bool send) {
      if constexpr (kNet<T>) {
        uint32_t* done = reinterpret_cast<uint32_t*>(p.t.local_ptr(p.off.row_done)) +
                         static_cast<std::size_t>(s) * plan::kLlMaxTokens + t;
        if (remote_s && last_part(done, C) && send && !__any_sync(kFull, p.t.masked(s)))
          p.t.template put<dev::Warp>(put_context(p.ctx_tokens, t, p.t.num_contexts), s, at_s, here,
                                      row_bytes);
      }
    };
    const int col0 = c * (kCombineChunk / 8) + lane;

    // LogFMT: this lane's group on the wire (lanes 0-15 and 16-31 code one
    // 128-column group each of the item's 256 columns).
    [[maybe_unused]] uint8_t* group =
        reinterpret_cast<uint8_t*>(dst) +
        static_cast<std::size_t>(2 * c + lane / 16) * kLogFmtGroupBytes;

    if (n == 1) {
      // One expert here: its raw row; the source weights it.
      const int4* src = reinterpret_cast<const int4*>(
          p.x + static_cast<int64_t>(__shfl_sync(kFull, my_row, 0)) * H);
      int4 v[kCombineSteps];
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
        v[st] = col0 + 32 * st < H8 ? dev::ld_nc(src + col0 + 32 * st) : make_int4(0, 0, 0, 0);
      if constexpr (kLogFmt) {
        float f[8];
        unpack_bf16x8(v[0], f);
        logfmt_store(f, group, lane % 16, col0 < H8);
      } else {
#pragma unroll
        for (int st = 0; st < kCombineSteps; ++st)
          if (col0 + 32 * st < H8) dev::st_na(dst + col0 + 32 * st, v[st]);
      }
      chunk_written(true);
      continue;
    }

    // Several experts here: sum_j weight_j * row_j, rows kRowsAtOnce at a time;
    // the first rows are in flight while the weights are awaited.
    float acc[kCombineSteps][8];
#pragma unroll
    for (int st = 0; st < kCombineSteps; ++st)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[st][i] = 0.0f;
    uint32_t w_bits = 0;
    bool ok = true;
    for (int j0 = 0; j0 < n; j0 += kRowsAtOnce) {
      // Every load unconditional (rows past n repeat row n - 1 and are not
      // summed; columns past the row repeat its last vector and are not
      // stored): a load that may be skipped lands in a temporary that must be
      // moved out before the next load can reuse it, which held all but two
      // loads of a batch back behind the first ones' latency.
      int4 v[kRowsAtOnce][kCombineSteps];
#pragma unroll
      for (int jj = 0; jj < kRowsAtOnce; ++jj) {
        const int rj = __shfl_sync(kFull, my_row, min(j0 + jj, n - 1));
        const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(rj) * H);
#pragma unroll
        for (int st = 0; st < kCombineSteps; ++st)
          v[jj][st] = dev::ld_nc(src + min(col0 + 32 * st, H8 - 1));
      }
      if (j0 == 0) {
        if (lane < n) {
          if constexpr (kNet<T>)  // a source in another node: its weights land before its signal
            if (remote_s)
              ok = p.t.wait_signal(ll_sig_weights(R, s), seq, OpId::kLowLatencyCombineSend, s);
          if (ok)
            ok = p.t.wait_tagged(weight_word(p.off, weights, s, t, lane), epoch, w_bits,
                                 p.timeout_ns, p.diag, OpId::kLowLatencyCombineSend, s, t);
        }
        if (!__all_sync(kFull, ok)) break;  // reported, or s masked (shrink): see below
      }
#pragma unroll
      for (int jj = 0; jj < kRowsAtOnce; ++jj) {
        if (j0 + jj >= n) break;  // warp-uniform
        const float wj = __uint_as_float(__shfl_sync(kFull, w_bits, j0 + jj));
#pragma unroll
        for (int st = 0; st < kCombineSteps; ++st) {
          float f[8];
          unpack_bf16x8(v[jj][st], f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[st][i] = fmaf(wj, f[i], acc[st][i]);
        }
      }
    }
    if (!__all_sync(kFull, ok)) {
      if (__any_sync(kFull, p.t.masked(s))) {  // s masked meanwhile (shrink)
        chunk_written(false);
        continue;
      }
      failed = true;
      break;
    }
    if constexpr (kLogFmt) {
      logfmt_store(acc[0], group, lane % 16, col0 < H8);  // the float32 sum, coded once
    } else {
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
        if (col0 + 32 * st < H8) dev::st_na(dst + col0 + 32 * st, pack_bf16x8(acc[st]));
    }
    chunk_written(true);
  }
  finish_combine_send(p.t, p.off, half, p.op_counter, epoch, p.seq + 1, seq, failed);
}

}  // namespace
}  // namespace epx::kernels
