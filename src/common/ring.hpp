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
/// The slot of the index-th element.
EPX_HD inline uint32_t slot(uint32_t index, uint32_t capacity) {
  return index % capacity;
}
/// How many of `n` elements from `index` on lie contiguously before the
/// ring's end (what one put can carry).
EPX_HD inline uint32_t contiguous(uint32_t index, uint32_t n, uint32_t capacity) {
  const uint32_t left = capacity - slot(index, capacity);
  return n < left ? n : left;
}

}  // namespace epx::ring
