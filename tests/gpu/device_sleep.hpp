// gpu/device_sleep.hpp - a stream that is late on the GPU, not only on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epx::test {

/// Enqueues on `stream` one single-thread kernel that spins on the GPU's
/// global timer for `ns` nanoseconds, so work queued after it starts at least
/// that long after the kernel began. Returns the launch's error (no sync).
cudaError_t launch_device_sleep(uint64_t ns, cudaStream_t stream);

/// A stream held on the GPU until open(): a single-thread kernel that spins
/// on a word of mapped host memory (or until `timeout_s`, then held_too_long()).
/// Unlike a host function (StreamGate), it does not occupy CUDA's callback
/// thread, which every in-process rank shares: gates of several ranks hold
/// and open independently.
class DeviceGate {
 public:
  DeviceGate(cudaStream_t stream, double timeout_s);
  ~DeviceGate();  ///< opens it (the kernel may still be queued)
  DeviceGate(const DeviceGate&) = delete;
  DeviceGate& operator=(const DeviceGate&) = delete;
  void open();
  /// True when the hold ran out before open() (read after the stream ran past it).
  bool held_too_long() const;

 private:
  cudaStream_t stream_;
  uint32_t* words_ = nullptr;  ///< [0] open, [1] ran out (pinned, mapped)
};

}  // namespace epx::test
