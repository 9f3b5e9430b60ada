// common/ring.hpp - the arithmetic of a ring with credits between one
// producer and one consumer: `capacity` slots, two 32-bit rolling counters,
// the tail (slots the producer published) and the head (slots the consumer
// freed). Host and device code (the high-throughput rings across nodes, and
// tests/unit/test_ring_model.cpp's host model of their protocol).
#pragma once

#include <cstdint>

#include "common/device.cuh"

namespace epx::ring {

/// Slots published and not yet freed (counters roll over 32 bits).
EPX_HD inline uint32_t used(uint32_t tail, uint32_t head) {
  return tail - head;
}
/// Whether `n` more slots fit.
EPX_HD inline bool room_for(uint32_t tail, uint32_t head, uint32_t n, uint32_t capacity) {
  return used(tail, head) <= capacity && n <= capacity - used(tail, head);
}
/// The slot of the index-th element. A 32-bit index is continuous across
/// its wrap only for a power-of-two capacity (2^32 % capacity == 0);
/// a ring's counter that runs over a buffer's life passes 2^32 records
/// in half a day to a few days of training (10^4 to 10^5 records a second), so
/// those take slot64 / contiguous64.
EPX_HD inline uint32_t slot(uint32_t index, uint32_t capacity) {
  return index % capacity;
}
EPX_HD inline uint32_t slot64(uint64_t index, uint32_t capacity) {
  return static_cast<uint32_t>(index % capacity);
}
/// How many of `n` elements from `index` on lie contiguously before the
/// ring's end (what one put can carry).
EPX_HD inline uint32_t contiguous(uint32_t index, uint32_t n, uint32_t capacity) {
  const uint32_t left = capacity - slot(index, capacity);
  return n < left ? n : left;
}
EPX_HD inline uint32_t contiguous64(uint64_t index, uint32_t n, uint32_t capacity) {
  const uint32_t left = capacity - slot64(index, capacity);
  return n < left ? n : left;
}

}  // namespace epx::ring
