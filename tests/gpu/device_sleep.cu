// gpu/device_sleep.cu - the device side of gpu/device_sleep.hpp.
#include "gpu/device_sleep.hpp"

#include <stdexcept>
#include <string>

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

__global__ void device_gate(const volatile uint32_t* open, uint32_t* ran_out,
                            unsigned long long timeout_ns) {
  const unsigned long long start = global_ns();
  while (*open == 0) {
    if (global_ns() - start > timeout_ns) {
      *ran_out = 1;
      break;
    }
    __nanosleep(2000);
  }
}

}  // namespace

GateWords::GateWords(int gates) : gates_(gates) {
  const std::size_t bytes = 2 * sizeof(uint32_t) * static_cast<std::size_t>(gates);
  if (cudaHostAlloc(&words_, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess)
    throw std::runtime_error("GateWords: cudaHostAlloc failed");
  for (std::size_t i = 0; i < 2 * static_cast<std::size_t>(gates); ++i) words_[i] = 0;
}

GateWords::~GateWords() {
  cudaFreeHost(words_);
}

uint32_t* GateWords::gate(int i) {
  if (i < 0 || i >= gates_) throw std::runtime_error("GateWords: no gate " + std::to_string(i));
  return words_ + 2 * i;
}

DeviceGate::DeviceGate(cudaStream_t stream, double timeout_s, uint32_t* words)
    : stream_(stream), words_(words) {
  words_[0] = words_[1] = 0;
  uint32_t* dev = nullptr;
  if (cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), words_, 0) != cudaSuccess)
    throw std::runtime_error("DeviceGate: words not mapped");
  device_gate<<<1, 1, 0, stream>>>(dev, dev + 1, static_cast<unsigned long long>(timeout_s * 1e9));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("DeviceGate: launch: ") + cudaGetErrorString(e));
}

DeviceGate::~DeviceGate() {
  open();
  // The kernel reads the words until it sees them open.
  cudaStreamSynchronize(stream_);
}

void DeviceGate::open() {
  __atomic_store_n(&words_[0], 1u, __ATOMIC_RELEASE);
}

bool DeviceGate::held_too_long() const {
  return __atomic_load_n(&words_[1], __ATOMIC_ACQUIRE) != 0;
}

cudaError_t launch_device_sleep(uint64_t ns, cudaStream_t stream) {
  device_sleep<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

}  // namespace epx::test
