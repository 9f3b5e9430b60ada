// What the host models of the rings across nodes share
// (test_ring_model.cpp, test_ring_channels_model.cpp): a ring of records
// between one producer and one consumer with common/ring.hpp's arithmetic,
// the deadline every role's waits share, and the producer's chunked publish.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "common/ring.hpp"

namespace epx::test_ring {

using clock_type = std::chrono::steady_clock;

/// One producer, one consumer. `head` is what the consumer freed (the
/// producer's credits); a consumer that reads ahead of what it frees keeps
/// its own place in `read`.
template <class Record>
struct Ring {
  explicit Ring(uint32_t c) : slots(c), cap(c) {}
  std::vector<Record> slots;
  uint32_t cap;
  std::atomic<uint32_t> tail{0}, head{0};
  uint32_t read = 0;  ///< consumer-private
};

/// The deadline of a model's run, shared by all its roles.
struct Deadline {
  std::atomic<bool> stuck{false};
  clock_type::time_point deadline;

  /// One idle pass of a role: false once the model is stuck or past the
  /// deadline (which marks it stuck), else a yield.
  bool idle() {
    if (stuck.load()) return false;
    if (clock_type::now() > deadline) {
      stuck = true;
      return false;
    }
    std::this_thread::yield();
    return true;
  }
  /// Spins until `ready`, or false at the deadline.
  template <class Ready>
  bool wait(Ready ready) {
    while (!ready())
      if (!idle()) return false;
    return true;
  }
  /// A producer's chunk: all of `rs` published at once, as one put with its
  /// tail signal would, written in pieces that do not wrap past the ring's
  /// end (one put each); it waits for room for the whole chunk.
  template <class Record>
  bool push_chunk(Ring<Record>& q, const std::vector<Record>& rs) {
    const uint32_t t = q.tail.load(std::memory_order_relaxed), n = static_cast<uint32_t>(rs.size());
    if (n == 0) return true;
    if (!wait([&] {
          return epx::ring::room_for(t, q.head.load(std::memory_order_acquire), n, q.cap);
        }))
      return false;
    for (uint32_t done = 0; done < n;) {
      const uint32_t piece = epx::ring::contiguous(t + done, n - done, q.cap);
      for (uint32_t i = 0; i < piece; ++i)
        q.slots[epx::ring::slot(t + done, q.cap) + i] = rs[done + i];
      done += piece;
    }
    q.tail.store(t + n, std::memory_order_release);
    return true;
  }
};

}  // namespace epx::test_ring
