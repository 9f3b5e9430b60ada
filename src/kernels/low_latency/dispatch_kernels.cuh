// kernels/low_latency/dispatch_kernels.cuh - the dispatch's receive phase alone (hook mode) and
// its send and receive phases in one launch (no hook); low_latency/ops.cuh's kernel runs them.
#pragma once

#include "kernels/low_latency/dispatch_recv_arrival.cuh"

namespace epx::kernels {
namespace {

/// Unit `unit` of the receive phase (kArrival: LlDispatchRecvParams::arrival_order;
/// a template parameter, so the rank-order kernels stay as they were).
template <bool kArrival, class T>
__device__ __forceinline__ bool dispatch_recv_any(const LlDispatchRecvParams<T>& p, uint32_t epoch,
                                                  uint64_t seq, int unit, int* s_list) {
  if constexpr (kArrival)
    return dispatch_recv_unit_arrival(p, epoch, unit, s_list);
  else if constexpr (kNet<T>)
    return dispatch_recv_unit_net(p, epoch, seq, unit, s_list);
  else
    return dispatch_recv_unit(p, epoch, unit, s_list);
}

/// Hook mode: the receive phase alone (epoch from the handle state).
template <bool kArrival, class T>
__device__ __forceinline__ void dispatch_recv_phase(const LlDispatchRecvParams<T>& p) {
  extern __shared__ int s_list[];  // [R * maxT]: (source << 16) | token of packed row j
  tl_mark(kTlDispatch, kTlRecvStart);
  tl_mark(kTlDispatch, kTlRecvGo);
  const uint32_t epoch = static_cast<uint32_t>(p.state[0]);
  uint64_t seq = 0;
  if constexpr (kNet<T>) seq = *reinterpret_cast<const uint64_t*>(p.state + 2);
  const int units = p.num_experts / p.t.num_ranks * p.parts;
  snapshot_mask(p.t);
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    if (!dispatch_recv_any<kArrival>(p, epoch, seq, unit, s_list)) break;
    __syncthreads();  // s_list and the scan storage are reused
  }
  tl_finish(kTlDispatch, p.t.rank);
}

/// Without a hook: send and receive in one cooperative launch (every block
/// resident). Blocks [0, send_blocks) send; the others receive from the
/// start, so no receiving block waits for its own stores to drain, and rows
/// are copied while later ones are still crossing.
template <bool kArrival, class T>
__device__ __forceinline__ void dispatch_both_phases(const LlDispatchSendParams<T>& sp,
                                                     const LlDispatchRecvParams<T>& rp,
                                                     int send_blocks) {
  extern __shared__ int s_list[];
  tl_mark(kTlDispatch, kTlSendStart);
  tl_mark(kTlDispatch, kTlSendStartMax);
  const int b = static_cast<int>(blockIdx.x);
  const uint64_t seq = next_seq<T>(sp.seq);
  bool send_ok = true;
  const uint32_t epoch = dispatch_begin(sp, seq, /*sends=*/b < send_blocks, send_ok);
  if (b < send_blocks && send_ok)
    dispatch_send_items(sp, epoch, b * kWarps + threadIdx.x / 32, send_blocks * kWarps);
  dispatch_count_done(sp, epoch, seq, !send_ok);
  if (b < send_blocks) {
    tl_finish(kTlDispatch, rp.t.rank);  // (timeline builds count every block)
    return;
  }
  tl_mark(kTlDispatch, kTlRecvStart);
  tl_mark(kTlDispatch, kTlRecvGo);
  const int units = rp.num_experts / rp.t.num_ranks * rp.parts;
  snapshot_mask(rp.t);
  for (int unit = b - send_blocks; unit < units; unit += gridDim.x - send_blocks) {
    __syncthreads();  // s_list and the scan storage are reused
    if (!dispatch_recv_any<kArrival>(rp, epoch, seq, unit, s_list)) break;
  }
  if constexpr (EPX_LL_TIMELINE != 0) {
    __syncthreads();
    if (threadIdx.x == 0 && b - send_blocks < units) {  // blocks that had a unit
      const unsigned long long t = dev::globaltimer_ns();
      tl_mark(kTlDispatch, kTlRecvEndMin);
      // After the first send block's start (set long before): no overflow.
      atomicAdd(&g_timeline.recv_end_sum, t - ~g_timeline.m[kTlDispatch][kTlSendStart]);
      atomicAdd(&g_timeline.recv_end_n, 1ull);
    }
  }
  tl_finish(kTlDispatch, rp.t.rank);
}

}  // namespace
}  // namespace epx::kernels
