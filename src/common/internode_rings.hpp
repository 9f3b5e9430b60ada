// common/internode_rings.hpp - the ring dispatch's region and signals across
// nodes (docs/internode_ht.md, "The rings, concretely"): fixed-size rings
// per channel, so that any token count fits one buffer. Host arithmetic
// only (no kernel uses it yet); the CPU tests check that the areas do not
// overlap, that every signal id is distinct and inside the pool a backend
// is made with, and that bad geometry is named.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/internode_route.hpp"
#include "common/topology.hpp"

namespace epx::plan {

/// The rings' shape, from Config's four DeepEP fields and the SM count:
/// `channels` contiguous token ranges per source (three blocks each: send,
/// forward, receive), `net_slots` records per network ring
/// (num_max_rdma_chunked_recv_tokens), at most `net_chunk` per put
/// (num_max_rdma_chunked_send_tokens), `nvl_slots` per NVLink ring
/// (num_max_nvl_chunked_recv_tokens) and `nvl_chunk` records between two
/// tail stores (num_max_nvl_chunked_send_tokens).
struct HtRingGeometry {
  int channels = 1;
  int net_slots = 256, net_chunk = 6;
  int nvl_slots = 256, nvl_chunk = 8;

  /// The channels `num_sms` SMs give (a third each role, at least 1).
  static int channels_for_sms(int num_sms) { return num_sms / 3 >= 1 ? num_sms / 3 : 1; }
  /// Throws epx::Error(kInvalidArgument) naming the Config field whose value
  /// is out of range: channels >= 1; slots >= 1; 1 <= chunk <= slots.
  void validate() const;
};

/// Signals of the rings, after every other id (kSignalKindsAll per rank):
/// per (kind, channel, peer). kNetTail: at a forwarder, the records channel
/// c of source `peer` has put into its ring here; kNetCredit: at a source,
/// the records forwarder `peer` has taken from channel c's ring there;
/// kHeader: at a forwarder, the ops whose header channel c of source `peer`
/// has put here (its record counts, before any record).
enum class HtRingSignal : int { kNetTail = 0, kNetCredit, kHeader, kKinds };
constexpr int ht_ring_signal(int num_ranks, int channels, HtRingSignal kind, int channel,
                             int peer) {
  return (kSignalKindsAll + static_cast<int>(kind) * channels + channel) * num_ranks + peer;
}
/// Signal ids a backend's pool must hold with rings of `channels` channels.
constexpr int ht_ring_signal_count(int num_ranks, int channels) {
  return (kSignalKindsAll + static_cast<int>(HtRingSignal::kKinds) * channels) * num_ranks;
}

/// Local running totals of the rings (u64 each, never reset while the
/// buffer lives; an op's targets are base + its records), per (kind,
/// channel, index): kNetSent (sender, index = node), kNetCredited (sender:
/// credits seen from the node's forwarder), kNetTaken (forwarder: records
/// taken from source node's ring), kNvlSent (forwarder, index = local
/// receiver), kNvlTaken (receiver, index = local forwarder).
enum class HtRingBase : int { kNetSent = 0, kNetCredited, kNetTaken, kNvlSent, kNvlTaken, kKinds };

/// The dispatch rings of one rank's region (the buffer's num_nvl_bytes):
///   [header: HtNetRegion's op counts and done words; signals u64
///    [ht_ring_signal_count][kMaxContexts]; shapes as HtNetRegion]
///   [bases u64 [HtRingBase::kKinds][C][max(N, L)]]      local
///   [nvl tails u64 [C][L]]  at a receiver, ring (c, l)'s records, stored by
///                           forwarder l of its node
///   [nvl heads u64 [C][L]]  at a forwarder, the records receiver d took
///                           from ring (c, this forwarder), stored by d
///   [net headers u64 [C][N][1 + L]]  at a forwarder, from the source of its
///                           local index in node m: the op's record count,
///                           then its rows per local rank (a put with kHeader)
///   [nvl headers u64 [C][L]]  at a receiver, forwarder l's record total for
///                           it in channel c, tagged with the op count
///   [header sends u64 [C][N][1 + L]]  what sender c's header puts read
///   [net rings [C][N] x net_slots records]  ring (c, m): from the source
///                           of this rank's local index in node m (its own
///                           node's: this rank's own sender c, by stores)
///   [net send rings [C][N] x net_slots records]  what channel c's puts to
///                           node m read (its own node's unused)
///   [nvl rings [C][L] x nvl_slots records]  ring (c, l): from forwarder l
struct HtRingRegion {
  Topology topology;
  HtRingGeometry geometry;
  std::size_t record_bytes = 0;
  std::size_t signals = 0, shapes = 0;
  std::size_t bases = 0, nvl_tails = 0, nvl_heads = 0;
  std::size_t net_headers = 0, nvl_headers = 0, header_send = 0;
  std::size_t net_rings = 0, net_send = 0, nvl_rings = 0, total = 0;

  /// Throws epx::Error naming the field for bad geometry or record size.
  static HtRingRegion make(const Topology& topology, const HtRingGeometry& geometry,
                           std::size_t record_bytes);

  /// Offsets of a ring's slot / counter words.
  std::size_t base_word(HtRingBase kind, int channel, int index) const;
  std::size_t nvl_tail(int channel, int forwarder_local) const;
  std::size_t nvl_head(int channel, int receiver_local) const;
  /// Word i (0: the record count, 1 + d: rows for local rank d) of the
  /// header from node `node`'s source, channel c; and of sender c's copy of
  /// its header for node `node` (what the put reads).
  std::size_t net_header(int channel, int node, int word) const;
  std::size_t header_send_word(int channel, int node, int word) const;
  std::size_t nvl_header(int channel, int forwarder_local) const;
  std::size_t net_slot(int channel, int node, uint64_t index) const;
  std::size_t net_send_slot(int channel, int node, uint64_t index) const;
  std::size_t nvl_slot(int channel, int forwarder_local, uint64_t index) const;

 private:
  int width() const {
    const int n = topology.num_nodes();
    return n > topology.ranks_per_node ? n : topology.ranks_per_node;
  }
};

}  // namespace epx::plan
