// transport/proxy/coalesce.hpp - fewer engine calls for a channel's puts.
//
// The puts a channel takes for one peer between two of that peer's signals
// may land in any order: a signal is what tells the receiver they landed, and
// it is issued after them (the device concept orders puts only by signals,
// fence and quiet). So they are queued per peer, sorted by destination, and
// runs of them become one engine call: neighbours in both regions one
// contiguous copy, equal rows at equal pitches one strided copy. A low-latency
// dispatch sends one row per (token, remote rank) from slot [me][t] to slot
// [me][t]: hundreds of puts that this makes a few copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "transport/proxy/engine.hpp"

namespace epx::proxy {

class Coalescer {
 public:
  /// `max_queued`: a peer's queue is issued when it reaches this many puts.
  Coalescer(Engine& engine, int channel, int num_ranks, std::size_t max_queued = 1024);

  /// Checks a put (Engine::check_put: throws epx::Error naming it) and queues it.
  void put(int peer, int region, uint64_t dst_off, uint64_t src_off, uint64_t bytes);
  /// Issues `peer`'s queued puts (before a signal to it).
  void flush(int peer);
  /// Issues every queued put (before a mark, a fence, or when the ring is idle).
  void flush_all();
  /// Puts queued and not issued yet.
  std::size_t queued() const { return queued_; }
  /// Engine calls (put or put_strided) issued so far: what a NIC would see.
  uint64_t engine_puts() const { return engine_puts_; }

 private:
  struct Put {
    int region;
    uint64_t dst, src, bytes;
  };
  void issue(int peer, std::vector<Put>& puts);

  Engine& engine_;
  const int channel_;
  const std::size_t max_queued_;
  std::vector<std::vector<Put>> queues_;  ///< per peer
  std::vector<int> busy_;                 ///< peers with a non-empty queue
  std::size_t queued_ = 0;
  uint64_t engine_puts_ = 0;
};

}  // namespace epx::proxy
