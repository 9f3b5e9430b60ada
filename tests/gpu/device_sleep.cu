// gpu/device_sleep.cu - the device side of gpu/device_sleep.hpp.
#include "gpu/device_sleep.hpp"

namespace epx::test {
namespace {

__device__ inline unsigned long long global_ns() {
  unsigned long long t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void device_sleep(unsigned long long ns) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < ns) __nanosleep(1000);
}

}  // namespace

cudaError_t launch_device_sleep(uint64_t ns, cudaStream_t stream) {
  device_sleep<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

}  // namespace epx::test
