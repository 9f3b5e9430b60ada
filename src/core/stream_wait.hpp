// core/stream_wait.hpp - a host wait for a stream's work, with a deadline.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>

#include "common/host_group.hpp"  // kMaxWaitSeconds, capped_wait_seconds

namespace epx::detail {

/// Polls `stream` (cudaStreamQuery, yielding the CPU between polls) until its
/// work is done: true; or until `timeout_s` seconds have passed: false, with
/// the work still queued or running. `poll` runs between polls, e.g. to check
/// a library's asynchronous error and throw. A CUDA error other than "not
/// ready" throws epx::Error.
bool wait_stream_for(cudaStream_t stream, double timeout_s, const std::function<void()>& poll = {});

}  // namespace epx::detail
