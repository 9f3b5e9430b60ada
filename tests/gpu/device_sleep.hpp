// gpu/device_sleep.hpp - a stream that is late on the GPU, not only on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epx::test {

/// Enqueues on `stream` one single-thread kernel that spins on the GPU's
/// global timer for `ns` nanoseconds, so work queued after it starts at least
/// that long after the kernel began. Returns the launch's error (no sync).
cudaError_t launch_device_sleep(uint64_t ns, cudaStream_t stream);

/// Words of mapped host memory for DeviceGates, allocated up front: a
/// cudaHostAlloc or cudaFreeHost may wait for the whole device, so one made
/// while another in-process rank's gate is shut waits for that gate.
class GateWords {
 public:
  explicit GateWords(int gates);
  ~GateWords();
  GateWords(const GateWords&) = delete;
  GateWords& operator=(const GateWords&) = delete;
  /// Gate i's two words ([0] open, [1] ran out), zeroed.
  uint32_t* gate(int i);

 private:
  uint32_t* words_ = nullptr;
  int gates_ = 0;
};

/// A stream held on the GPU until open(): a single-thread kernel that spins
/// on a word of mapped host memory (or until `timeout_s`, then held_too_long()).
/// Unlike a host function (StreamGate), it does not occupy CUDA's callback
/// thread, which every in-process rank shares: gates of several ranks hold
/// and open independently.
class DeviceGate {
 public:
  /// `words`: GateWords::gate(i), unused by any other gate.
  DeviceGate(cudaStream_t stream, double timeout_s, uint32_t* words);
  ~DeviceGate();  ///< opens it and waits for the stream
  DeviceGate(const DeviceGate&) = delete;
  DeviceGate& operator=(const DeviceGate&) = delete;
  void open();
  /// True when the hold ran out before open() (read after the stream ran past it).
  bool held_too_long() const;

 private:
  cudaStream_t stream_;
  uint32_t* words_;
};

}  // namespace epx::test
