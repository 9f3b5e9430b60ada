// common/host_group.hpp - the host collectives of ranks that are threads of
// one process (Communicator::create_in_process, the proxy's host-memory
// fabric): a barrier with a deadline and an all-gather through shared host
// memory. No CUDA here, so the CPU tests cover it.
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace epx::detail {

/// Longest host or device deadline, seconds (about 31 years): a longer one,
/// infinity included, waits this long (a std::chrono or nanosecond count of
/// more would overflow).
constexpr double kMaxWaitSeconds = 1e9;

/// `timeout_s` capped at kMaxWaitSeconds.
inline double capped_wait_seconds(double timeout_s) {
  return timeout_s < kMaxWaitSeconds ? timeout_s : kMaxWaitSeconds;
}

class InProcessGroup {
 public:
  /// `timeout_s`: how long a rank waits in a barrier for the others; `what`
  /// names the barrier in its errors.
  InProcessGroup(int num_ranks, double timeout_s, std::string what = "in-process barrier");

  int num_ranks() const { return num_ranks_; }

  /// Returns once every rank has entered this barrier. Throws kTimeout naming
  /// the ranks that did not arrive; after a timeout every later call throws
  /// at once (the ranks no longer agree on which barrier is which).
  void barrier(int rank);

  /// `bytes` from every rank, in rank order. Every rank passes the same size.
  std::vector<uint8_t> allgather(int rank, const void* data, std::size_t bytes);

 private:
  void check_rank(int rank) const;

  const int num_ranks_;
  const double timeout_s_;
  const std::string what_;
  std::mutex m_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  std::vector<char> arrived_;  ///< who has entered the current barrier
  /// The thread each rank entered it from, and its call stack then (both
  /// named when a rank enters twice: which code holds the rank's place).
  std::vector<std::thread::id> arrived_from_;
  static constexpr int kFrames = 24;
  std::vector<std::array<void*, kFrames>> arrived_stack_;
  std::vector<int> arrived_depth_;
  int num_arrived_ = 0;
  bool broken_ = false;
  std::vector<std::vector<uint8_t>> slots_;
};

}  // namespace epx::detail
