// kernels/internode/launch.cuh - launch_ring_kernel, combine_for, and the launchers and
// preload for a transport type T (launch_ht_net_*_for, preload_ht_net_kernels_of).
#pragma once

#include "kernels/internode/ring_combine.cuh"

namespace epx::kernels::internode {

/// A cooperative launch of 3 channels blocks (every block resident, or the
/// launch fails naming the SM count: roles wait on each other across ranks).
template <class P>
void launch_ring_kernel(void (*kernel)(P), const P& p, int channels, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(3 * channels));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  EPX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

template <class T>
void combine_for(const T& t, const HtNetCombineArgs& a, cudaStream_t stream) {
  CombineParams<T> p{};
  static_cast<HtNetCombineArgs&>(p) = a;
  p.t = t;
  launch_barrier(t, a.off, HtNetOp::kCombine,
                 {static_cast<int>(HtNetOp::kCombine), a.hidden, a.num_topk, 0, a.num_worst, 1, 0,
                  a.use_rings ? a.ring.layout_word() : 0},
                 nullptr, stream);
  if (a.use_rings) {
    launch_ring_kernel(ring_combine_kernel<T>, p, a.ring.geometry.channels, stream);
    return;
  }
  combine_return_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
  combine_node_sum_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
  if (a.split_puts)
    launch_node_put(t, a.off,
                    a.table + HtNetTable::make(a.off.num_nodes, a.off.ranks_per_node).fwd_rows,
                    HtNetSignal::kCombineNet, a.num_blocks, stream);
  combine_finish_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::kernels::internode

namespace epx::kernels {

/// The barrier, then send, forward and receive, for transport type T.
template <class T>
void launch_ht_net_dispatch_for(const T& t, const HtNetDispatchArgs& a, cudaStream_t stream) {
  internode::dispatch_for(t, a, stream);
}
/// The barrier, then return, node sum and finish.
template <class T>
void launch_ht_net_combine_for(const T& t, const HtNetCombineArgs& a, cudaStream_t stream) {
  internode::combine_for(t, a, stream);
}
/// Loads the kernels of transport type T now (cudaFuncGetAttributes).
template <class T>
void preload_ht_net_kernels_of() {
  using namespace internode;
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, barrier_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, exchange_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_send_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_forward_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_recv_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ring_dispatch_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ring_combine_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_return_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_node_sum_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_finish_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, node_put_kernel<T>));
}

}  // namespace epx::kernels
