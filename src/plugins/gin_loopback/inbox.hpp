// plugins/gin_loopback/inbox.hpp - the single-producer / single-consumer ring
// that carries signals from one source rank to one target rank of a collComm.
// It lives in the target's shared memory (a memfd every rank maps): the
// source's plugin is its only producer, the target's own progress call its
// only consumer, which applies each entry to its local signal buffer (that
// buffer cannot be mapped by other processes, docs/nccl_gin.md).
//
// Layout (all 64-bit words, head and tail on their own cache lines):
//   [0]    head: entries pushed so far (written by the producer, release)
//   [64]   tail: entries applied so far (written by the consumer, release)
//   [128]  capacity entries of 32 bytes, entry i at slot i % capacity
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace epx::gin_loop {

struct SignalEntry {
  uint64_t reg_id;  ///< the registration (collective id) of the target's signal buffer
  uint64_t offset;  ///< byte offset of the 8-byte word in it
  uint64_t add;     ///< value to add
  uint64_t pad;
};
static_assert(sizeof(SignalEntry) == 32);

class SignalRing {
 public:
  static constexpr std::size_t kHeaderBytes = 128;
  static constexpr std::size_t bytes_for(uint64_t capacity) {
    return kHeaderBytes + capacity * sizeof(SignalEntry);
  }

  SignalRing() = default;
  /// A view of the ring at `base` (bytes_for(capacity) bytes, zeroed before first use).
  SignalRing(void* base, uint64_t capacity) : base_(static_cast<char*>(base)), cap_(capacity) {}

  bool valid() const { return base_ != nullptr; }
  uint64_t capacity() const { return cap_; }

  /// Producer: appends `e` unless the ring is full (false: retry later).
  bool push(const SignalEntry& e) {
    const uint64_t head = ref(0).load(std::memory_order_relaxed);
    if (head - ref(8).load(std::memory_order_acquire) >= cap_) return false;
    entries()[head % cap_] = e;
    ref(0).store(head + 1, std::memory_order_release);
    return true;
  }
  /// Producer: entries pushed but not yet applied.
  uint64_t in_flight() const {
    return ref(0).load(std::memory_order_relaxed) - ref(8).load(std::memory_order_acquire);
  }

  /// Consumer: calls `apply(entry)` on each pending entry in order; stops early
  /// (leaving the entry) when apply returns false. Returns the entries applied.
  template <class F>
  uint64_t drain(F&& apply) {
    const uint64_t head = ref(0).load(std::memory_order_acquire);
    uint64_t tail = ref(8).load(std::memory_order_relaxed);
    const uint64_t first = tail;
    while (tail != head) {
      if (!apply(entries()[tail % cap_])) break;
      ++tail;
      ref(8).store(tail, std::memory_order_release);  // frees the slot for the producer
    }
    return tail - first;
  }

 private:
  std::atomic_ref<uint64_t> ref(std::size_t word) const {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base_ + word * 8));
  }
  SignalEntry* entries() const { return reinterpret_cast<SignalEntry*>(base_ + kHeaderBytes); }

  char* base_ = nullptr;
  uint64_t cap_ = 0;
};

}  // namespace epx::gin_loop
