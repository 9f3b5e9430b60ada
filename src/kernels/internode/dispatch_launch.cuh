// kernels/internode/dispatch_launch.cuh - dispatch_for: the barrier, then the whole-call or the
// ring dispatch kernels.
#pragma once

#include "kernels/internode/ring_dispatch.cuh"

namespace epx::kernels::internode {

template <class T>
void dispatch_for(const T& t, const HtNetDispatchArgs& a, cudaStream_t stream) {
  DispatchParams<T> p{};
  static_cast<HtNetDispatchArgs&>(p) = a;
  p.t = t;
  launch_barrier(t, a.off, HtNetOp::kDispatch,
                 {static_cast<int>(HtNetOp::kDispatch), a.hidden_bytes, a.num_scales, a.num_topk,
                  a.num_worst, 1, 0, a.use_rings ? a.ring.layout_word() : 0},
                 a.route_counts ? a.route_counts + t.num_ranks : nullptr, stream);
  if (a.route_counts) {
    exchange_kernel<T><<<1, kThreads, 0, stream>>>(p);
    EPX_CUDA_CHECK(cudaGetLastError());
  }
  if (a.use_rings) {
    launch_ring_kernel(ring_dispatch_kernel<T>, p, a.ring.geometry.channels, stream);
    return;
  }
  dispatch_send_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
  if (a.split_puts)
    launch_node_put(t, a.off,
                    a.table + HtNetTable::make(a.off.num_nodes, a.off.ranks_per_node).node_rows,
                    HtNetSignal::kDispatchNet, a.num_blocks, stream);
  dispatch_forward_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
  dispatch_recv_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::kernels::internode
