// kernels/low_latency/dispatch_recv.cuh - the dispatch's receive phase in rank order: one unit
// per (local expert, part), NVLink and network transports.
#pragma once

#include "kernels/low_latency/dispatch_send.cuh"

namespace epx::kernels {
namespace {

// ============================================================================
// dispatch: receive. Unit (le, part): waits for the token masks of every
// source for local expert le (tagged words, one per thread) and for the token
// counts, takes one block-wide scan of the masks (the canonical packed order,
// the same in each of le's `parts` units), then moves the rows j with
// j % parts == part, 2 KiB segments at a time, each after the arrival flags of
// its chunks: rows are copied as they arrive, not after the slowest sender.
// Returns false when a wait failed (reported).
// ============================================================================
/// Network transports, shrink: the sources that were masked when this block
/// began receiving (bit r of word r / 32). A block takes its units one after
/// another, so a source masked meanwhile (its deadline passed in an earlier
/// unit) would otherwise count for some local experts and not for others,
/// depending on the grid; with the snapshot, words that came are counted
/// in every unit alike. (The NVLink path reads the mask live, as before.)
__shared__ uint32_t s_masked_at_start[(plan::kLlMaxRanks + 31) / 32];

/// Every thread of a receiving block, before its first unit.
template <class T>
__device__ __forceinline__ void snapshot_mask(const T& t) {
  if constexpr (kNet<T>) {
    constexpr int kWords = (plan::kLlMaxRanks + 31) / 32;
    for (int w = threadIdx.x; w < kWords; w += blockDim.x) s_masked_at_start[w] = 0u;
    __syncthreads();
    for (int r = threadIdx.x; r < t.num_ranks; r += blockDim.x)
      if (t.masked(r)) atomicOr(&s_masked_at_start[r / 32], 1u << (r % 32));
    __syncthreads();
  }
}

/// Whether source s counts as masked from the start of this receive.
template <class T>
__device__ __forceinline__ bool masked_at_start(const T& t, int s) {
  if constexpr (kNet<T>)
    return ((s_masked_at_start[s / 32] >> (s % 32)) & 1u) != 0u;
  else
    return t.masked(s);
}

/// Word w of source s's token mask for local expert le, into `word`. Shrink:
/// the mask is read beside the wait, not before it (no added latency); a
/// masked source counts as sending nothing, whether its word came or not (a
/// wait for it returns at once, or when it gets masked). False: the wait failed.
template <class T>
__device__ __forceinline__ bool recv_mask_word(const LlDispatchRecvParams<T>& p, uint32_t epoch,
                                               uint64_t seq, std::size_t tags, int s, int w, int le,
                                               int E_local, uint32_t& word) {
  const bool was_masked = masked_at_start(p.t, s);
  bool ok = true;
  if constexpr (kNet<T>)  // a source in another node: its words land before its signal
    if (!was_masked && !p.t.same_node(s))
      ok =
          p.t.wait_signal(ll_sig_dispatch(p.t.num_ranks, s), seq, OpId::kLowLatencyDispatchRecv, s);
  if (ok)
    ok = p.t.wait_tagged(mask_word_offset(p.off, tags, s, w, le, E_local), epoch, word,
                         p.timeout_ns, p.diag, OpId::kLowLatencyDispatchRecv, s, le);
  if (was_masked || (!ok && p.t.masked(s))) {
    word = 0;
    return true;
  }
  return ok;
}

/// Source s's token count into the handle state (the combine reads it there);
/// 0 for a masked source. False: the wait failed, or the sender's shapes differ
/// (its rows sit elsewhere; kBadConfig is reported and ends every wait).
template <class T>
__device__ __forceinline__ bool recv_token_count(const LlDispatchRecvParams<T>& p, uint32_t epoch,
                                                 uint64_t seq, std::size_t tags, int s, int le) {
  uint32_t n = 0;
  const bool was_masked = masked_at_start(p.t, s);  // as in recv_mask_word
  bool came = true;
  if constexpr (kNet<T>)
    if (!was_masked && !p.t.same_node(s))
      came =
          p.t.wait_signal(ll_sig_dispatch(p.t.num_ranks, s), seq, OpId::kLowLatencyDispatchRecv, s);
  if (came)
    came = p.t.wait_tagged(tags + 8u * s, epoch, n, p.timeout_ns, p.diag,
                           OpId::kLowLatencyDispatchRecv, s, le);
  if (was_masked || (!came && p.t.masked(s))) {
    p.state[8 + s] = 0;
    return true;
  }
  if (!came) return false;
  if (plan::ll_shape_of(n) != p.off.shape_fp) {
    dev::report(p.diag, DiagCode::kBadConfig, OpId::kLowLatencyDispatchRecv, p.t.rank, s, -1,
                p.off.shape_fp, plan::ll_shape_of(n));
    return false;
  }
  p.state[8 + s] = min(plan::ll_count_of(n), p.max_tokens);
  return true;
}

template <class T>
__device__ __forceinline__ bool dispatch_recv_unit(const LlDispatchRecvParams<T>& p, uint32_t epoch,
                                                   int unit, int* s_list) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int s_begin[T::kCaps.max_ranks + 1];
  const int R = p.t.num_ranks;
  const int E_local = p.num_experts / R, RT = R * p.max_tokens;
  const int le = unit / p.parts, part = unit % p.parts;
  const std::size_t tags = tags_of(p.off, epoch);

  // Packed order: by source rank, then token; a token counts once however
  // often it picks le. Thread (s, w) waits for word w of source s's mask for
  // le; one scan over all R * W words gives each word its first packed row.
  const int W = ceil_div(p.max_tokens, 32);
  static_assert(T::kCaps.max_ranks * plan::kLlMaxMaskWords <= kThreads);
  const int pos = threadIdx.x, s = pos / W, w = pos % W;
  // wait_stats: the unit's wait for source s = its last mask word's arrival
  // after the unit's start (the block's clock, read once, kept in shared).
  __shared__ uint64_t s_t0;
  __shared__ unsigned long long s_wait[T::kCaps.max_ranks];
  if (p.wait_stats != nullptr) {
    if (threadIdx.x == 0) s_t0 = dev::globaltimer_ns();
    if (static_cast<int>(threadIdx.x) < R) s_wait[threadIdx.x] = 0ull;
  }
  uint32_t word = 0;
  bool ok = true;
  if (pos < R * W) ok = recv_mask_word(p, epoch, 0, tags, s, w, le, E_local, word);
  const uint64_t arrived = p.wait_stats != nullptr ? dev::globaltimer_ns() : 0;
  if (unit == 0 && static_cast<int>(threadIdx.x) < R &&
      !recv_token_count(p, epoch, 0, tags, threadIdx.x, le))
    ok = false;
  if (__syncthreads_or(ok ? 0 : 1) != 0) return false;
  tl_mark(kTlDispatch, kTlRecvFlags);
  if (p.wait_stats != nullptr && pos < R * W)
    atomicMax(&s_wait[s], static_cast<unsigned long long>(arrived > s_t0 ? arrived - s_t0 : 0));
  {
    int prefix = 0, total = 0;
    Scan(scan_tmp).ExclusiveSum(__popc(word), prefix, total);
    for (uint32_t m = word, i = prefix; m != 0u; m &= m - 1u, ++i)
      s_list[i] = (s << 16) | (32 * w + __ffs(m) - 1);
    if (pos < R * W && w == 0) s_begin[s] = prefix;
    if (pos == 0) s_begin[R] = total;
    // The combine's plan: {mask, first packed row} of (s, w, le).
    if (part == 0 && pos < R * W)
      p.combine_plan[static_cast<std::size_t>(pos) * E_local + le] =
          make_int2(static_cast<int>(word), prefix);
  }
  __syncthreads();
  tl_mark(kTlDispatch, kTlRecvMid);
  const int count = s_begin[R];

  if (part == 0) {
    if (threadIdx.x == 0) {
      p.recv_count[le] = count;
      if (p.stats) p.stats[le] += count;
    }
    if (p.wait_stats != nullptr && static_cast<int>(threadIdx.x) < R)
      atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + threadIdx.x),
                s_wait[threadIdx.x]);
    if (static_cast<int>(threadIdx.x) < R) {
      const int s = threadIdx.x;
      p.layout_range[static_cast<int64_t>(le) * R + s] =
          (static_cast<int64_t>(s_begin[s]) << 32) |
          static_cast<int64_t>(s_begin[s + 1] - s_begin[s]);
    }
  }
  // src_info of my rows (-1 past the count).
  for (int j = part + p.parts * static_cast<int>(threadIdx.x); j < RT; j += p.parts * kThreads)
    p.src_info[static_cast<int64_t>(le) * RT + j] = j < count ? (s_list[j] & 0xffff) : -1;

  const int my_rows = count > part ? ceil_div(count - part, p.parts) : 0;
  const bool all_ok = copy_rows(p, epoch, le, my_rows, [&](int i) {
    const int j = part + i * p.parts;
    const int v = s_list[j];
    return make_int3(j, v >> 16, v & 0xffff);
  });
  return __syncthreads_and(all_ok ? 1 : 0) != 0;
}

/// Network transports: dispatch_recv_unit for up to T::kCaps.max_ranks
/// ranks: each thread waits for ceil(R * W / threads) consecutive mask words
/// (a source in another node: after its dispatch signal), and one block scan
/// of the per-thread counts gives every word its first packed row.
template <class T>
__device__ __forceinline__ bool dispatch_recv_unit_net(const LlDispatchRecvParams<T>& p,
                                                       uint32_t epoch, uint64_t seq, int unit,
                                                       int* s_list) {
  using Scan = cub::BlockScan<int, kThreads>;
  constexpr int kMaxPerThread =
      (T::kCaps.max_ranks * plan::kLlMaxMaskWords + kThreads - 1) / kThreads;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int s_begin[T::kCaps.max_ranks + 1];
  __shared__ uint64_t s_t0;
  __shared__ unsigned long long s_wait[T::kCaps.max_ranks];
  const int R = p.t.num_ranks;
  const int E_local = p.num_experts / R, RT = R * p.max_tokens;
  const int le = unit / p.parts, part = unit % p.parts;
  const std::size_t tags = tags_of(p.off, epoch);
  const int W = ceil_div(p.max_tokens, 32), words = R * W;
  const int per = ceil_div(words, kThreads), first = static_cast<int>(threadIdx.x) * per;
  if (p.wait_stats != nullptr) {
    if (threadIdx.x == 0) s_t0 = dev::globaltimer_ns();
    for (int i = threadIdx.x; i < R; i += kThreads) s_wait[i] = 0ull;
  }
  uint32_t word[kMaxPerThread];
  uint64_t arrived[kMaxPerThread];
  bool ok = true;
  int count_mine = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerThread; ++i) {
    word[i] = 0;
    arrived[i] = 0;
    const int pos = first + i;
    if (i < per && pos < words) {
      ok = recv_mask_word(p, epoch, seq, tags, pos / W, pos % W, le, E_local, word[i]) && ok;
      if (p.wait_stats != nullptr) arrived[i] = dev::globaltimer_ns();
      count_mine += __popc(word[i]);
    }
  }
  if (unit == 0)
    for (int s = threadIdx.x; s < R; s += kThreads)
      ok = recv_token_count(p, epoch, seq, tags, s, le) && ok;
  if (__syncthreads_or(ok ? 0 : 1) != 0) return false;
  tl_mark(kTlDispatch, kTlRecvFlags);
  int prefix = 0, total = 0;
  Scan(scan_tmp).ExclusiveSum(count_mine, prefix, total);
#pragma unroll
  for (int i = 0; i < kMaxPerThread; ++i) {
    const int pos = first + i;
    if (i >= per || pos >= words) continue;
    const int s = pos / W, w = pos % W;
    if (p.wait_stats != nullptr)
      atomicMax(&s_wait[s],
                static_cast<unsigned long long>(arrived[i] > s_t0 ? arrived[i] - s_t0 : 0));
    for (uint32_t m = word[i], j = prefix; m != 0u; m &= m - 1u, ++j)
      s_list[j] = (s << 16) | (32 * w + __ffs(m) - 1);
    if (w == 0) s_begin[s] = prefix;
    if (part == 0)
      p.combine_plan[static_cast<std::size_t>(pos) * E_local + le] =
          make_int2(static_cast<int>(word[i]), prefix);
    prefix += __popc(word[i]);
  }
  if (threadIdx.x == 0) s_begin[R] = total;
  __syncthreads();
  tl_mark(kTlDispatch, kTlRecvMid);
  const int count = s_begin[R];
  if (part == 0) {
    if (threadIdx.x == 0) {
      p.recv_count[le] = count;
      if (p.stats) p.stats[le] += count;
    }
    for (int s = threadIdx.x; s < R; s += kThreads) {
      if (p.wait_stats != nullptr)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + s), s_wait[s]);
      p.layout_range[static_cast<int64_t>(le) * R + s] =
          (static_cast<int64_t>(s_begin[s]) << 32) |
          static_cast<int64_t>(s_begin[s + 1] - s_begin[s]);
    }
  }
  for (int j = part + p.parts * static_cast<int>(threadIdx.x); j < RT; j += p.parts * kThreads)
    p.src_info[static_cast<int64_t>(le) * RT + j] = j < count ? (s_list[j] & 0xffff) : -1;
  const int my_rows = count > part ? ceil_div(count - part, p.parts) : 0;
  const bool all_ok = copy_rows(p, epoch, le, my_rows, [&](int i) {
    const int j = part + i * p.parts;
    const int v = s_list[j];
    return make_int3(j, v >> 16, v & 0xffff);
  });
  return __syncthreads_and(all_ok ? 1 : 0) != 0;
}

}  // namespace
}  // namespace epx::kernels
