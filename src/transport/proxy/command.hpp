// transport/proxy/command.hpp - the contract between GPU threads that post
// commands and the CPU proxy threads that carry them out: the command word
// layout, the ring of one channel, and the counters each side publishes.
// Host and device code both include it (the encoders are constexpr).
//
// One channel = one ring of `capacity` 64-byte commands in pinned host memory
// (mapped into the GPU's address space), served by one proxy thread.
//   GPU (any thread):  slot = atomicAdd(&dev->reserved, 1)
//                      wait until slot < host->consumed + capacity   (free slot)
//                      write words 1..7 of ring[slot % capacity]
//                      release-store header = make_header(slot + 1, op, region)
//   proxy thread:      wait until ring[tail % capacity].header has seq == tail + 1
//                      read the command, hand it to the engine, tail += 1,
//                      store host->consumed = tail (the slot is free again)
//                      once the engine reports commands [0, n) complete, store
//                      host->completed = n
// Commands of one channel are taken in slot order. Puts to one peer between
// two of its signals may be merged and reordered (coalesce.hpp); a signal
// posted after a put on the same channel to the same peer lands after the
// put's bytes, and a fence keeps the puts before it ahead of those after it
// (per peer: the engine orders each (channel, peer) endpoint on its own).
#pragma once

#include <cstdint>

namespace epx::proxy {

enum class Op : uint32_t {
  kNone = 0,
  kPut = 1,        ///< bytes from this rank's region at src_off to `peer`'s region at dst_off
  kPutSignal = 2,  ///< kPut, then `add` into the u64 at sig_off in `peer`'s region
  kSignal = 3,     ///< `add` into the u64 at sig_off in `peer`'s region
  kFence = 4,      ///< the channel's earlier puts to a peer land before its later ones
};

/// One command. `header` is written last (release) and read first (acquire).
struct alignas(64) Command {
  uint64_t header;   ///< make_header(seq, op, region); seq = slot + 1 (0: never written)
  uint64_t dst_off;  ///< kPut / kPutSignal: destination offset in the peer's region
  uint64_t src_off;  ///< kPut / kPutSignal: source offset in this rank's region
  uint64_t bytes;    ///< kPut / kPutSignal: bytes to copy (> 0)
  uint64_t sig_off;  ///< kPutSignal / kSignal: offset of the 8-byte signal word at the peer
  uint64_t add;      ///< kPutSignal / kSignal: value added to the signal word
  uint32_t peer;     ///< destination rank
  uint32_t reserved0;
  uint64_t reserved1;
};
static_assert(sizeof(Command) == 64);

inline constexpr int kMaxRegions = 16;  ///< region ids 0..15 (4 bits of the header)
inline constexpr uint64_t kMaxSeq = (uint64_t{1} << 56) - 1;

constexpr uint64_t make_header(uint64_t seq, Op op, int region) {
  return (seq << 8) | (static_cast<uint64_t>(op) << 4) | static_cast<uint64_t>(region & 15);
}
constexpr uint64_t seq_of(uint64_t header) {
  return header >> 8;
}
constexpr Op op_of(uint64_t header) {
  return static_cast<Op>((header >> 4) & 15u);
}
constexpr int region_of(uint64_t header) {
  return static_cast<int>(header & 15u);
}

/// Per channel, written by the proxy thread and read by the GPU (pinned host
/// memory, mapped). Each counter on its own 128-byte line.
struct alignas(128) ChannelHost {
  uint64_t consumed;  ///< commands taken out of the ring: slots [0, consumed) are free again
  uint64_t pad0[15];
  uint64_t completed;  ///< commands whose effects are complete: all of [0, completed)
  uint64_t pad1[15];
  /// 0 while the proxy thread serves the channel; 1 once it stopped or died
  /// (the GPU's waits give up at once instead of at their deadline).
  uint32_t stopped;
  uint32_t pad2[31];
};
static_assert(sizeof(ChannelHost) == 384);

/// Per channel, written by the GPU (device memory; host memory in CPU tests).
/// The GPU's waits read the *_seen copies (device memory) and take turns
/// reading the host counters (waiters): a GPU whose threads all poll pinned
/// host memory keeps the PCIe reads busy that its own front end needs to
/// fetch the proxy's copies, which then start milliseconds late.
struct alignas(128) ChannelDevice {
  unsigned long long reserved;        ///< slots taken so far (atomicAdd)
  unsigned long long consumed_seen;   ///< largest ChannelHost::consumed read
  unsigned long long completed_seen;  ///< largest ChannelHost::completed read
  unsigned int waiters;               ///< GPU threads waiting on a host counter now
  unsigned int pad0;
  unsigned long long pad[12];
};
static_assert(sizeof(ChannelDevice) == 128);

/// What a GPU poster needs of one channel (all pointers valid in device code).
struct ChannelView {
  Command* ring = nullptr;
  ChannelHost* host = nullptr;
  ChannelDevice* dev = nullptr;
  uint32_t capacity = 0;  ///< commands in the ring (a power of two)
};

}  // namespace epx::proxy
