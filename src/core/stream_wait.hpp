// core/stream_wait.hpp - a host wait for a stream's work, with a deadline.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>

namespace epx::detail {

/// Longest host or device deadline, seconds (about 31 years): a longer one,
/// infinity included, waits this long (a std::chrono or nanosecond count of
/// more would overflow).
constexpr double kMaxWaitSeconds = 1e9;

/// `timeout_s` capped at kMaxWaitSeconds.
inline double capped_wait_seconds(double timeout_s) {
  return timeout_s < kMaxWaitSeconds ? timeout_s : kMaxWaitSeconds;
}

/// Polls `stream` (cudaStreamQuery, yielding the CPU between polls) until its
/// work is done: true; or until `timeout_s` seconds have passed: false, with
/// the work still queued or running. `poll` runs between polls, e.g. to check
/// a library's asynchronous error and throw. A CUDA error other than "not
/// ready" throws epx::Error.
bool wait_stream_for(cudaStream_t stream, double timeout_s, const std::function<void()>& poll = {});

}  // namespace epx::detail
