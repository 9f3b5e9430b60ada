// kernels/low_latency/launch.cuh - launch_ex, the launch helpers per op for a transport
// type T (launch_ll_*_for) and preload_ll_kernels_of.
#pragma once

#include "kernels/low_latency/ops.cuh"

namespace epx::kernels {
namespace {

enum class Launch { kPlain, kCooperative };

/// cudaLaunchKernelEx with at most one attribute: kCooperative = every block
/// resident at once or the launch fails.
template <class... Params, class... Args>
void launch_ex(void (*kernel)(Params...), int blocks, int threads, std::size_t smem,
               cudaStream_t stream, Launch how, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  if (how == Launch::kCooperative) {
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
  }
  cfg.attrs = &attr;
  cfg.numAttrs = how == Launch::kPlain ? 0u : 1u;
  EPX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

std::size_t dispatch_recv_smem(int num_ranks, int max_tokens) {
  return sizeof(int) * static_cast<std::size_t>(num_ranks) * max_tokens;
}
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t smem) {
  if (smem > 48 * 1024)
    EPX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
}
/// The params struct of transport type T: the call's arguments and the transport.
template <template <class> class Params, class T, class Args>
Params<T> params_of(const T& t, const Args& a) {
  Params<T> p{};
  static_cast<Args&>(p) = a;
  p.t = t;
  return p;
}
/// Arrival order is a load/store protocol: network transports pack in rank order.
template <class T>
constexpr bool kArrivalCapable = !T::kCaps.network;

/// ll::dispatch for `arrival` order where T can (kArrivalCapable), else rank order.
template <class T>
auto* dispatch_kernel(bool arrival) {
  return arrival && kArrivalCapable<T> ? ll::dispatch<kArrivalCapable<T>, T>
                                       : ll::dispatch<false, T>;
}
template <class T>
auto* combine_kernel(bool logfmt, bool stats) {
  return logfmt ? (stats ? ll::combine<true, true, T> : ll::combine<true, false, T>)
                : (stats ? ll::combine<false, true, T> : ll::combine<false, false, T>);
}

/// ll::dispatch: hook mode's send (kLlSendPhase, every block sends), the
/// hook's receive (kLlRecvPhase), both plain launches, or both phases
/// (kLlBothPhases) in one cooperative launch whose first `send_blocks` blocks
/// send. ra.arrival_order picks the instantiation, the same for a hook's two
/// launches; a launch reads only the args of the phases it runs.
template <class T>
void launch_ll_dispatch_for(const T& tt, const LlDispatchSendArgs& sa, const LlDispatchRecvArgs& ra,
                            int num_blocks, int send_blocks, int phases, cudaStream_t stream) {
  const bool recv = (phases & kLlRecvPhase) != 0;
  const std::size_t smem = recv ? dispatch_recv_smem(tt.num_ranks, ra.max_tokens) : 0;
  auto* kernel = dispatch_kernel<T>(ra.arrival_order);
  if (recv) allow_smem(kernel, smem);
  launch_ex(kernel, num_blocks, kThreads, smem, stream,
            phases == kLlBothPhases ? Launch::kCooperative : Launch::kPlain,
            (phases & kLlSendPhase) != 0 ? params_of<LlDispatchSendParams>(tt, sa)
                                         : LlDispatchSendParams<T>{},
            recv ? params_of<LlDispatchRecvParams>(tt, ra) : LlDispatchRecvParams<T>{}, send_blocks,
            phases);
}

/// The receive's transport: `tt` with the receive's deadline (a source's
/// flag can come one send deadline late and still be alive).
template <class T>
LlCombineRecvParams<T> recv_params_of(const T& tt, const LlCombineRecvArgs& a) {
  LlCombineRecvParams<T> p = params_of<LlCombineRecvParams>(tt, a);
  p.t.timeout_ns = a.timeout_ns;
  return p;
}

/// ll::combine: hook mode's send (kLlSendPhase), the hook's receive
/// (kLlRecvPhase, a plain launch), or both phases (kLlBothPhases). A launch
/// with the send is cooperative: every block is resident at once or the
/// launch fails. Items of one rank's send wait for weight words that blocks
/// of the other ranks' sends produce; with part of a grid kept off the SMs
/// (by other work) until the rest ends, ranks could wait on each other until
/// the deadline. sa.wait_first and ra.send_wait_first are both set or both
/// null (combine_wait_recv_cost_stats), and pick the instantiation with
/// sa.logfmt / ra.logfmt.
template <class T>
void launch_ll_combine_for(const T& tt, const LlCombineSendArgs& sa, const LlCombineRecvArgs& ra,
                           int num_blocks, int phases, cudaStream_t stream) {
  const bool send = (phases & kLlSendPhase) != 0;
  const bool logfmt = send ? sa.logfmt : ra.logfmt;
  const bool stats = send ? sa.wait_first != nullptr : ra.send_wait_first != nullptr;
  launch_ex(combine_kernel<T>(logfmt, stats), num_blocks, kThreads, 0, stream,
            send ? Launch::kCooperative : Launch::kPlain,
            send ? params_of<LlCombineSendParams>(tt, sa) : LlCombineSendParams<T>{},
            (phases & kLlRecvPhase) != 0 ? recv_params_of(tt, ra) : LlCombineRecvParams<T>{},
            phases);
}

/// Loads every kernel of transport T (cudaFuncGetAttributes), so that none is
/// loaded lazily while other ranks' kernels wait.
template <class T>
void preload_ll_kernels_of() {
  cudaFuncAttributes a{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll::dispatch<false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll::dispatch<kArrivalCapable<T>, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll::combine<false, false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll::combine<true, false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll::combine<false, true, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll::combine<true, true, T>));
}

}  // namespace
}  // namespace epx::kernels
