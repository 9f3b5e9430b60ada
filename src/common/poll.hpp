// common/poll.hpp - host waits with a deadline, without CUDA: a poll loop
// (what every EPX host wait for GPU work runs, with cudaStreamQuery or
// cudaEventQuery as its query) and a watchdog for the calls that offer no way
// to bound them. Header-only: libepx, the NVSHMEM module and the loopback GIN
// plugin each build it into their own code, and the CPU tests drive it with
// fake queries.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/host_group.hpp"  // capped_wait_seconds

namespace epx::detail {

/// Calls `ready()` until it returns true (then true), or until `timeout_s`
/// seconds have passed (then false; a deadline of 0 still polls once).
/// Between polls it calls `tick()` (a library's asynchronous error check,
/// which may throw) and waits: a few polls back to back (most waits end
/// within microseconds), then sleeps growing from 20 us to 1 ms, so a long
/// wait costs little CPU and a short one little latency. Whatever `ready` or
/// `tick` throws passes through.
template <class Ready, class Tick>
bool poll_until(Ready&& ready, double timeout_s, Tick&& tick) {
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(
                         std::chrono::duration<double>(capped_wait_seconds(timeout_s)));
  auto sleep = std::chrono::microseconds(20);
  for (int polls = 0;; ++polls) {
    if (ready()) return true;
    tick();
    if (clock::now() >= deadline) return false;
    if (polls < 64) continue;
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
  }
}

template <class Ready>
bool poll_until(Ready&& ready, double timeout_s) {
  return poll_until(std::forward<Ready>(ready), timeout_s, [] {});
}

/// For a call that cannot be bounded or interrupted (nvshmem_barrier_all, a
/// device-wide synchronize): while it runs, a thread writes `message` and the
/// seconds so far to stderr once `every_s` seconds have passed, and again
/// each `every_s` after, so that a hang is never silent. The call itself is
/// not stopped. `message` says which call, which rank, and why it has no
/// deadline.
class Watchdog {
 public:
  Watchdog(std::string message, double every_s)
      : message_(std::move(message)), t0_(std::chrono::steady_clock::now()) {
    const auto every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(capped_wait_seconds(every_s)));
    thread_ = std::thread([this, every] {
      std::unique_lock<std::mutex> lock(m_);
      while (!cv_.wait_for(lock, every, [this] { return done_; })) {
        ++reports_;
        std::fprintf(stderr, "epx: %s (%.0f s so far)\n", message_.c_str(), seconds());
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(m_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Seconds since the watchdog started.
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  /// How many times it has written its message so far.
  int reports() const {
    std::lock_guard<std::mutex> lock(m_);
    return reports_;
  }

 private:
  const std::string message_;
  const std::chrono::steady_clock::time_point t0_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  int reports_ = 0;
  std::thread thread_;
};

}  // namespace epx::detail
