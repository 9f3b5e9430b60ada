// kernels/low_latency/dispatch_recv_arrival.cuh - the dispatch's receive phase in arrival order
// (experimental, LlDispatchRecvParams::arrival_order).
#pragma once

#include "kernels/low_latency/dispatch_recv.cuh"

namespace epx::kernels {
namespace {

// ============================================================================
// dispatch: receive in arrival order (experimental, LlDispatchRecvParams::
// arrival_order). Unit = local expert le, one block; its warps form R groups
// (warp % R == s for source s) that do not wait for each other: the first
// warp of group s waits for s's token masks for le, reserves s's rows with a
// shared-memory atomic (so the sources' blocks of rows come in the order their
// masks did), records the combine plan, layout_range[le][s] and src_info of
// those rows, and the group copies them. recv_count after all groups.
// ============================================================================
template <class T>
__device__ __forceinline__ bool dispatch_recv_unit_arrival(const LlDispatchRecvParams<T>& p,
                                                           uint32_t epoch, int le, int* s_list) {
  __shared__ int s_rows;                       // rows reserved so far
  __shared__ int s_begin[T::kCaps.max_ranks];  // first row of each source's block
  __shared__ int s_total[T::kCaps.max_ranks];  // rows of each source
  __shared__ int s_failed;
  const int R = p.t.num_ranks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int E_local = p.num_experts / R, RT = R * p.max_tokens;
  const std::size_t tags = tags_of(p.off, epoch);
  const int W = ceil_div(p.max_tokens, 32);
  static_assert(plan::kLlMaxMaskWords <= 32 && T::kCaps.max_ranks <= kWarps &&
                T::kCaps.max_ranks < 16);  // named barriers 1..R
  if (threadIdx.x == 0) {
    s_rows = 0;
    s_failed = 0;
  }
  __syncthreads();
  const int s = warp % R;  // this warp's source
  const int group_warps = (kWarps - s + R - 1) / R;
  int* const list = s_list + s * p.max_tokens;  // tokens of s's rows, in order
  if (warp == s) {                              // the group's first warp
    const uint64_t t0 = p.wait_stats != nullptr ? dev::globaltimer_ns() : 0;
    uint32_t word = 0;
    bool ok = true;
    if (lane < W) ok = recv_mask_word(p, epoch, 0, tags, s, lane, le, E_local, word);
    const bool words_ok = __all_sync(kFull, ok);
    const int n = __popc(word);
    int incl = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(kFull, incl, d);
      if (lane >= d) incl += v;
    }
    const int total = words_ok ? __shfl_sync(kFull, incl, 31) : 0;
    int begin = 0;
    if (lane == 0) begin = total > 0 ? atomicAdd(&s_rows, total) : 0;
    begin = __shfl_sync(kFull, begin, 0);
    const int prefix = incl - n;
    for (uint32_t m = word, i = prefix; m != 0u; m &= m - 1u, ++i)
      list[i] = 32 * lane + __ffs(m) - 1;
    if (lane < W)
      p.combine_plan[static_cast<std::size_t>(s * W + lane) * E_local + le] =
          make_int2(static_cast<int>(word), begin + prefix);
    if (lane == 0) {
      s_begin[s] = begin;
      s_total[s] = total;
      if (!words_ok) s_failed = 1;
      p.layout_range[static_cast<int64_t>(le) * R + s] =
          (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(total);
      if (p.wait_stats != nullptr)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + s),
                  static_cast<unsigned long long>(dev::globaltimer_ns() - t0));
      if (le == 0 && !recv_token_count(p, epoch, 0, tags, s, le)) s_failed = 1;
    }
  }
  // The group waits for its first warp only (named barrier s + 1).
  asm volatile("bar.sync %0, %1;" ::"r"(s + 1), "r"(group_warps * 32) : "memory");
  const int begin = s_begin[s], rows = s_total[s];
  for (int i = warp / R * 32 + lane; i < rows; i += group_warps * 32)
    p.src_info[static_cast<int64_t>(le) * RT + begin + i] = list[i];
  const bool copied = copy_rows(
      p, epoch, le, rows, [&](int i) { return make_int3(begin + i, s, list[i]); }, warp / R,
      group_warps);
  if (__syncthreads_or((copied && s_failed == 0) ? 0 : 1) != 0) return false;
  const int count = s_rows;
  if (threadIdx.x == 0) {
    p.recv_count[le] = count;
    if (p.stats) p.stats[le] += count;
  }
  for (int j = count + static_cast<int>(threadIdx.x); j < RT; j += kThreads)
    p.src_info[static_cast<int64_t>(le) * RT + j] = -1;
  return true;
}

}  // namespace
}  // namespace epx::kernels
