// kernels/low_latency/launch.cuh - launch_ex, the launch helpers per op for a transport
// type T (launch_ll_*_for) and preload_ll_kernels_of.
#pragma once

#include "kernels/low_latency/combine_recv.cuh"

namespace epx::kernels {
namespace {

enum class Launch { kPlain, kDependent, kCooperative };

/// cudaLaunchKernelEx with at most one attribute: kDependent = programmatic
/// stream serialization (the previous kernel in the stream is this op's send
/// kernel), kCooperative = every block resident at once or the launch fails.
template <class... Params, class... Args>
void launch_ex(void (*kernel)(Params...), int blocks, int threads, std::size_t smem,
               cudaStream_t stream, Launch how, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  if (how == Launch::kDependent) {
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
  } else if (how == Launch::kCooperative) {
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

template <class T>
void launch_ll_dispatch_send_for(const T& tt, const LlDispatchSendArgs& a, int num_blocks,
                                 cudaStream_t stream) {
  ll_dispatch_send<T><<<num_blocks, kThreads, 0, stream>>>(params_of<LlDispatchSendParams>(tt, a));
  EPX_LAUNCH_CHECK();
}

template <class T>
void launch_ll_dispatch_recv_for(const T& tt, const LlDispatchRecvArgs& a, int num_blocks,
                                 cudaStream_t stream) {
  const std::size_t smem = dispatch_recv_smem(tt.num_ranks, a.max_tokens);
  auto* kernel = a.arrival_order && kArrivalCapable<T> ? ll_dispatch_recv<kArrivalCapable<T>, T>
                                                       : ll_dispatch_recv<false, T>;
  allow_smem(kernel, smem);
  launch_ex(kernel, num_blocks, kThreads, smem, stream, Launch::kPlain,
            params_of<LlDispatchRecvParams>(tt, a));
}

template <class T>
void launch_ll_dispatch_fused_for(const T& tt, const LlDispatchSendArgs& sa,
                                  const LlDispatchRecvArgs& ra, int num_blocks, int send_blocks,
                                  cudaStream_t stream) {
  const std::size_t smem = dispatch_recv_smem(tt.num_ranks, ra.max_tokens);
  auto* kernel = ra.arrival_order && kArrivalCapable<T> ? ll_dispatch_fused<kArrivalCapable<T>, T>
                                                        : ll_dispatch_fused<false, T>;
  allow_smem(kernel, smem);
  launch_ex(kernel, num_blocks, kThreads, smem, stream, Launch::kCooperative,
            params_of<LlDispatchSendParams>(tt, sa), params_of<LlDispatchRecvParams>(tt, ra),
            send_blocks);
}

/// A cooperative launch: every block is resident at once or the launch fails.
/// Items of one rank's combine send wait for weight words that blocks of the
/// other ranks' sends produce; with part of a grid kept off the SMs (by other
/// work) until the rest ends, ranks could wait on each other until the
/// deadline.
template <class T>
void launch_ll_combine_send_for(const T& tt, const LlCombineSendArgs& a, int num_blocks,
                                cudaStream_t stream) {
  const bool stats = a.wait_first != nullptr;
  auto* kernel = a.logfmt
                     ? (stats ? ll_combine_send<true, true, T> : ll_combine_send<true, false, T>)
                     : (stats ? ll_combine_send<false, true, T> : ll_combine_send<false, false, T>);
  launch_ex(kernel, num_blocks, kThreads, 0, stream, Launch::kCooperative,
            params_of<LlCombineSendParams>(tt, a));
}

template <class T>
void launch_ll_combine_recv_for(const T& tt, const LlCombineRecvArgs& a, int num_blocks,
                                cudaStream_t stream, bool dependent) {
  launch_ex(a.logfmt ? ll_combine_recv<true, T> : ll_combine_recv<false, T>, num_blocks, kThreads,
            0, stream, dependent ? Launch::kDependent : Launch::kPlain,
            params_of<LlCombineRecvParams>(tt, a));
}

/// Loads every kernel of transport T (cudaFuncGetAttributes), so that none is
/// loaded lazily while other ranks' kernels wait.
template <class T>
void preload_ll_kernels_of() {
  cudaFuncAttributes a{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_send<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_recv<false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_recv<kArrivalCapable<T>, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_fused<false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_fused<kArrivalCapable<T>, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_send<false, false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_send<true, false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_send<false, true, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_send<true, true, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_recv<false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_recv<true, T>));
}

}  // namespace
}  // namespace epx::kernels
