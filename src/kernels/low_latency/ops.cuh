// kernels/low_latency/ops.cuh - the two low-latency kernels, ll::dispatch and ll::combine: one
// kernel per op, whose launch runs its send phase, its receive phase or both.
//
// One kernel per op, as DeepEP's: with a receive hook the op's two launches
// are the same kernel, so a profile (torch.profiler, nsys) shows one
// "dispatch" and one "combine" row per op, which is how DeepEP's tests and
// its users time these ops (tests/test_low_latency.py's bench_kineto).
// Without a hook both phases run in one launch.
#pragma once

#include "kernels/low_latency/combine_recv.cuh"

namespace epx::kernels {
namespace {

namespace ll {

/// kLlBothPhases: a cooperative launch; blocks [0, send_blocks) send, the
/// others receive (dispatch_both_phases). kLlSendPhase: every block sends
/// (`rp` unused). kLlRecvPhase: hook mode's receive (`sp` unused).
template <bool kArrival, class T>
__global__ void __launch_bounds__(kThreads, 2)
    dispatch(LlDispatchSendParams<T> sp, LlDispatchRecvParams<T> rp, int send_blocks, int phases) {
  if (phases == kLlBothPhases)
    dispatch_both_phases<kArrival>(sp, rp, send_blocks);
  else if (phases == kLlSendPhase)
    dispatch_send_phase(sp);
  else
    dispatch_recv_phase<kArrival>(rp);
}

/// kLlBothPhases: a cooperative launch; every block sends its items, then
/// receives its (token, chunk) items once every source's flag is in (the
/// sends of all blocks of all ranks are resident: no block waits for one that
/// cannot run). kLlSendPhase: hook mode's send (cooperative too: a send waits
/// for weights the other ranks' sends write). kLlRecvPhase: the hook's
/// receive, with the epoch and op count the send stored in the op's state.
template <bool kLogFmt, bool kWaitStats, class T>
__global__ void __launch_bounds__(kThreads, 1)
    combine(LlCombineSendParams<T> sp, LlCombineRecvParams<T> rp, int phases) {
  if (phases & kLlSendPhase) {
    uint32_t epoch = 0;
    uint64_t seq = 0;
    combine_send_phase<kLogFmt, kWaitStats>(sp, epoch, seq);
    if (phases & kLlRecvPhase) combine_recv_phase<kLogFmt>(rp, epoch, seq);
    return;
  }
  const uint32_t epoch = static_cast<uint32_t>(rp.state[0]);
  uint64_t seq = 0;
  if constexpr (kNet<T>) seq = reinterpret_cast<const uint64_t*>(rp.state)[1];
  combine_recv_phase<kLogFmt>(rp, epoch, seq);
}

}  // namespace ll
}  // namespace
}  // namespace epx::kernels
