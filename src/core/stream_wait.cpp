#include "core/stream_wait.hpp"

#include <chrono>
#include <thread>

#include "common/check.hpp"

namespace epx::detail {

bool wait_stream_for(cudaStream_t stream, double timeout_s, const std::function<void()>& poll) {
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(
                         std::chrono::duration<double>(capped_wait_seconds(timeout_s)));
  for (int polls = 0;; ++polls) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) EPX_CUDA_CHECK(e);
    if (poll) poll();
    if (clock::now() >= deadline) return false;
    // Spin briefly (a barrier usually ends within microseconds), then yield.
    if (polls >= 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace epx::detail
