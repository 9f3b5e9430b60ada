// transport/nvshmem/ll_kernels.cu - the low-latency kernels instantiated for
// NvshmemTransport, in the NVSHMEM module's own relocatable translation unit
// (docs/nvshmem.md): the launch helpers of kernels/low_latency_kernels.cuh
// with that transport type, under names the module's launcher table will
// hold. Built (and device-linked with libnvshmem_device.a) when CMake finds
// NVSHMEM; libepx itself has no relocatable code and no NVSHMEM symbol.
// Nothing loads it yet: the backend's host half and its loading are the next
// step, and nothing of it has run on a GPU.
#include "kernels/low_latency_kernels.cuh"
#include "transport/nvshmem/device.cuh"

namespace epx::kernels::nvshmem {

using T = dev::NvshmemTransport;

void launch_ll_dispatch_send(const T& t, const LlDispatchSendArgs& a, int num_blocks,
                             cudaStream_t stream) {
  launch_ll_dispatch_send_for(t, a, num_blocks, stream);
}
void launch_ll_dispatch_recv(const T& t, const LlDispatchRecvArgs& a, int num_blocks,
                             cudaStream_t stream) {
  launch_ll_dispatch_recv_for(t, a, num_blocks, stream);
}
void launch_ll_dispatch_fused(const T& t, const LlDispatchSendArgs& sa,
                              const LlDispatchRecvArgs& ra, int num_blocks, int send_blocks,
                              cudaStream_t stream) {
  launch_ll_dispatch_fused_for(t, sa, ra, num_blocks, send_blocks, stream);
}
void launch_ll_combine_send(const T& t, const LlCombineSendArgs& a, int num_blocks,
                            cudaStream_t stream) {
  launch_ll_combine_send_for(t, a, num_blocks, stream);
}
void launch_ll_combine_recv(const T& t, const LlCombineRecvArgs& a, int num_blocks,
                            cudaStream_t stream, bool dependent) {
  launch_ll_combine_recv_for(t, a, num_blocks, stream, dependent);
}
void preload_ll_kernels() {
  preload_ll_kernels_of<T>();
}

}  // namespace epx::kernels::nvshmem
