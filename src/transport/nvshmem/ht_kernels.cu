// transport/nvshmem/ht_kernels.cu - the high-throughput kernels across nodes
// instantiated for NvshmemTransport in the NVSHMEM module's relocatable code
// (as ll_kernels.cu does for the low-latency ones); the core reaches them
// through the module's launcher table.
#include "kernels/internode/kernels.cuh"
#include "transport/nvshmem/device.cuh"
#include "transport/nvshmem/module.hpp"

namespace epx::nvshmem_module {

namespace {
using T = dev::NvshmemTransport;

}  // namespace

int ht_net_dispatch(const dev::NetworkTransportBase& t, const kernels::HtNetDispatchArgs& a,
                    cudaStream_t s, char* err, std::size_t n) {
  return guarded(err, n,
                 [&] { kernels::launch_ht_net_dispatch_for(dev::nvshmem_device_of(t), a, s); });
}

int ht_net_combine(const dev::NetworkTransportBase& t, const kernels::HtNetCombineArgs& a,
                   cudaStream_t s, char* err, std::size_t n) {
  return guarded(err, n,
                 [&] { kernels::launch_ht_net_combine_for(dev::nvshmem_device_of(t), a, s); });
}

int preload_ht_net_kernels(char* err, std::size_t n) {
  return guarded(err, n, [] { kernels::preload_ht_net_kernels_of<T>(); });
}

}  // namespace epx::nvshmem_module
