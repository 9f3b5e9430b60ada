// transport/nvshmem/ll_kernels.cu - the low-latency kernels instantiated for
// NvshmemTransport, in the NVSHMEM module's own relocatable translation unit
// (docs/nvshmem.md), and the module's launcher table (kernels::ModuleKernels)
// that the core calls through dev::ModuleTransport. libepx itself has no
// relocatable code and no NVSHMEM symbol.
#include <cstdio>
#include <exception>

#include "epx/error.hpp"
#include "kernels/low_latency/kernels.cuh"
#include "transport/nvshmem/device.cuh"
#include "transport/nvshmem/module.hpp"

namespace epx::nvshmem_module {

// ht_kernels.cu
int ht_net_dispatch(const dev::NetworkTransportBase& t, const kernels::HtNetDispatchArgs& a,
                    cudaStream_t s, char* err, std::size_t n);
int ht_net_combine(const dev::NetworkTransportBase& t, const kernels::HtNetCombineArgs& a,
                   cudaStream_t s, char* err, std::size_t n);

namespace {

using T = dev::NvshmemTransport;
using kernels::LlCombineRecvArgs;
using kernels::LlCombineSendArgs;
using kernels::LlDispatchRecvArgs;
using kernels::LlDispatchSendArgs;

/// The module's device struct from the transport data the core filled.

int dispatch(const dev::NetworkTransportBase& t, const LlDispatchSendArgs& sa,
             const LlDispatchRecvArgs& ra, int blocks, int send_blocks, int phases, cudaStream_t s,
             char* err, std::size_t n) {
  return guarded(err, n, [&] {
    kernels::launch_ll_dispatch_for(dev::nvshmem_device_of(t), sa, ra, blocks, send_blocks, phases,
                                    s);
  });
}
int combine(const dev::NetworkTransportBase& t, const LlCombineSendArgs& sa,
            const LlCombineRecvArgs& ra, int blocks, int phases, cudaStream_t s, char* err,
            std::size_t n) {
  return guarded(err, n, [&] {
    kernels::launch_ll_combine_for(dev::nvshmem_device_of(t), sa, ra, blocks, phases, s);
  });
}

constexpr kernels::ModuleKernels kTable{dispatch, combine, ht_net_dispatch, ht_net_combine};

}  // namespace

const kernels::ModuleKernels* ll_kernels() {
  return &kTable;
}

int preload_ll_kernels(char* err, std::size_t n) {
  return guarded(err, n, [] { kernels::preload_ll_kernels_of<T>(); });
}

}  // namespace epx::nvshmem_module
