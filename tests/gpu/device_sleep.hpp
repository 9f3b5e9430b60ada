// gpu/device_sleep.hpp - a stream that is late on the GPU, not only on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epx::test {

/// Enqueues on `stream` one single-thread kernel that spins on the GPU's
/// global timer for `ns` nanoseconds, so work queued after it starts at least
/// that long after the kernel began. Returns the launch's error (no sync).
cudaError_t launch_device_sleep(uint64_t ns, cudaStream_t stream);

}  // namespace epx::test
