// unit/proxy_test_util.hpp - what the proxy's test files share: deadlines,
// simulated ranks over one HostFabric, and command builders.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.hpp"
#include "transport/proxy/command.hpp"
#include "transport/proxy/host_engine.hpp"

namespace epx::proxy::ptest {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

/// Polls `done` until it holds (true) or `timeout_s` passes (false).
inline bool wait_until(const std::function<bool()>& done, double timeout_s = 10.0) {
  const auto start = Clock::now();
  while (!done()) {
    if (seconds_since(start) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

/// Runs `f`, expects an epx::Error with `code`, returns its message.
inline std::string error_of(const std::function<void()>& f, ErrorCode code) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected an epx::Error";
  return {};
}

template <class T>
inline T load(T& x) {
  return std::atomic_ref<T>(x).load(std::memory_order_acquire);
}

/// Runs f(r) on one thread per rank (the engines' collectives need all of
/// them); rethrows the first exception.
inline void on_every_rank(int num_ranks, const std::function<void(int)>& f) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(num_ranks));
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < num_ranks; ++r)
      threads.emplace_back([&, r] {
        try {
          f(r);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

/// Simulated ranks over one HostFabric, each with region 0 registered.
struct Ranks {
  std::shared_ptr<HostFabric> fabric;
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<std::vector<uint64_t>> memory;  ///< region 0 of each rank (8-byte aligned)

  Ranks(int num_ranks, int num_channels, std::size_t bytes)
      : fabric(std::make_shared<HostFabric>(num_ranks, 10.0)) {
    for (int r = 0; r < num_ranks; ++r) {
      engines.push_back(make_host_engine(fabric, r, num_ranks, num_channels));
      memory.emplace_back(bytes / 8, 0);
    }
    on_every_rank(num_ranks, [&](int r) { engines[r]->register_region(0, base(r), bytes); });
  }
  char* base(int r) { return reinterpret_cast<char*>(memory[r].data()); }
  uint64_t& word(int r, uint64_t off) { return memory[r][off / 8]; }
};

inline Command put_cmd(uint32_t peer, uint64_t dst_off, uint64_t src_off, uint64_t bytes) {
  Command c{};
  c.peer = peer;
  c.dst_off = dst_off;
  c.src_off = src_off;
  c.bytes = bytes;
  return c;
}
inline Command signal_cmd(uint32_t peer, uint64_t sig_off, uint64_t add) {
  Command c{};
  c.peer = peer;
  c.sig_off = sig_off;
  c.add = add;
  return c;
}

}  // namespace epx::proxy::ptest
