// common/internode_rings.hpp - the ring dispatch's region and signals across
// nodes (docs/internode_ht.md, "The rings, concretely"): fixed-size rings
// per channel, so that any token count fits one buffer. The offsets are
// host and device code (the ring kernel reads them from here); the CPU tests
// check that the areas do not overlap, that every signal id is distinct and
// inside the pool a backend is made with, and that bad geometry is named.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/device.cuh"
#include "common/internode_route.hpp"
#include "common/topology.hpp"

namespace epx::plan {

/// Channels the signal ids make room for (a third of 192 SMs).
inline constexpr int kMaxRingChannels = 64;

/// The rings' shape, from Config's four DeepEP fields and the SM count:
/// `channels` contiguous token ranges per source (three blocks each: send,
/// forward, receive), `net_slots` records per network ring
/// (num_max_rdma_chunked_recv_tokens), at most `net_chunk` per put
/// (num_max_rdma_chunked_send_tokens), `nvl_slots` per NVLink ring
/// (num_max_nvl_chunked_recv_tokens) and a tail store once `nvl_chunk`
/// records are stored (num_max_nvl_chunked_send_tokens; the forwarder
/// stores a batch of up to one record per warp at once, so stores may lie
/// further apart) and whenever an input has nothing more waiting.
struct HtRingGeometry {
  int channels = 1;
  // 48 records per put where the record size is not known (of()'s
  // record_bytes 0); otherwise about kDefaultPutBytes per put.
  int net_slots = 256, net_chunk = 48;
  int nvl_slots = 256, nvl_chunk = 8;

  /// The bytes a default put carries (of()): a ring op's time grows with
  /// its number of puts, not their bytes, on the one-host engines (4
  /// in-process ranks as 2x2 on an H100, 24 SMs: 6 records per put 298 ms,
  /// 48: 32 ms, 96: 13 ms; docs/internode_ht.md), and a NIC moves 1 MiB
  /// writes at line rate. Records of any size then make puts of about the
  /// same bytes, so FP8's half-size records need half the puts.
  static constexpr std::size_t kDefaultPutBytes = std::size_t{1} << 20;

  /// The channels `num_sms` SMs give (a third each role, at least 1).
  static int channels_for_sms(int num_sms) {
    const int c = num_sms / 3;
    return c < 1 ? 1 : (c > kMaxRingChannels ? kMaxRingChannels : c);
  }
  /// Throws epx::Error(kInvalidArgument) naming the Config field whose value
  /// is out of range: 1 <= channels <= kMaxRingChannels; slots >= 1;
  /// 1 <= chunk <= slots.
  void validate() const;
  /// The geometry of an op: a channel per three of `blocks` SMs; EPX_HT_RINGS
  /// = `ht_rings` 1 keeps the default sizes, N >= 2 rings of N records (and
  /// chunks cut to N); then the config's num_max_rdma_recv_tokens /
  /// _send_tokens (`rdma_recv` / `rdma_send`), where not 0, the network
  /// ring's records and the records per put. Without rdma_send (and without
  /// rings of N) a put carries kDefaultPutBytes of `record_bytes`-byte records,
  /// at most half the network ring (two puts in flight) and at least one;
  /// record_bytes 0: 48 records, cut to the ring. Not validated (validate()
  /// names what is out of range).
  static HtRingGeometry of(int ht_rings, int blocks, int rdma_send, int rdma_recv,
                           std::size_t record_bytes = 0);
};

/// Signals of the rings, after every other id (kSignalKindsAll per rank):
/// per (kind, channel, peer), channels strided by kMaxRingChannels so that an
/// id does not depend on an op's channel count (the counts run over the
/// buffer's life). kNetTail: at a forwarder, the records channel
/// c of source `peer` has put into its ring here; kNetCredit: at a source,
/// the records forwarder `peer` has taken from channel c's ring there. (The
/// headers need none: their words carry the op count, as tagged words do.)
enum class HtRingSignal : int { kNetTail = 0, kNetCredit, kKinds };
EPX_HD constexpr int ht_ring_signal(int num_ranks, HtRingSignal kind, int channel, int peer) {
  return (kSignalKindsAll + static_cast<int>(kind) * kMaxRingChannels + channel) * num_ranks + peer;
}
/// Signal ids a backend's pool must hold for the rings too.
constexpr int ht_ring_signal_count(int num_ranks) {
  return (kSignalKindsAll + static_cast<int>(HtRingSignal::kKinds) * kMaxRingChannels) * num_ranks;
}

/// Local running totals of the rings (u64 each, never reset while the
/// buffer lives; an op's targets are base + its records), per (kind,
/// channel, index): kNetSent (sender, index = node; its credits are the
/// kNetCredit signal itself), kNetTaken (forwarder: records
/// taken from source node's ring), kNvlSent (forwarder, index = local
/// receiver), kNvlTaken (receiver, index = local forwarder), kOps (the ring
/// ops so far, index = role: 0 send, 1 forward, 2 receive; the headers' tag).
enum class HtRingBase : int { kNetSent = 0, kNetTaken, kNvlSent, kNvlTaken, kOps, kKinds };

/// The dispatch rings of one rank's region (the buffer's num_nvl_bytes).
/// The rings' slots are an op's own and lie after the whole-call header,
/// where the whole-call combine's areas also lie; the words that run over
/// the buffer's life lie in a state block at the region's end, which the
/// whole-call ops then leave alone (their capacity is the region less it):
///   [header: the whole-call region's (HtNetRegion::body)]
///   [net rings [C][N] x net_slots records]  ring (c, m): from the source of
///                           this rank's local index in node m (its own
///                           node's: its own sender c, through LSA stores)
///   [net send rings [C][N] x net_slots records]  what channel c's puts to
///                           node m read
///   [nvl rings [C][L] x nvl_slots records]  ring (c, l): from forwarder l
///   ... free ...
///   [state, sized for kMaxRingChannels channels, so its offsets do not move
///    with an op's channel count:
///    ring signals u64 [ids past the whole-call ones][kMaxContexts];
///    bases u64 [HtRingBase::kKinds][kMaxRingChannels][max(N, L, 3)], local;
///    nvl tails u64 [C][L]  at a receiver, ring (c, l)'s records, stored by
///                          forwarder l of its node;
///    nvl heads u64 [C][L]  at a forwarder, the records receiver d took from
///                          ring (c, this forwarder), stored by d;
///    net headers u64 [C][N][net_header_words()]  at a forwarder, from the
///                          source of its local index in node m: the op's
///                          record count, then its rows per local rank, each
///                          {value, op count << 32} (a put), then a pad word
///                          where 1 + L is odd;
///    nvl headers u64 [C][L]  at a receiver, forwarder l's record total for
///                          it in channel c, tagged with the op count;
///    header sends u64 [C][N][net_header_words()]  what sender c's header
///                          puts read;
///    count rows i32 [R + 1][HtNetRegion::count_row_ints]  a num_worst_tokens
///                          dispatch's count exchange (the whole-call region
///                          puts them after its stage, inside the ring area,
///                          where a peer that finished its exchange may
///                          already put records while this rank still reads
///                          them);
///    the combine's return rings' words, u64 [kMaxRingChannels][L][N] each
///    (ret_word): ret tails  at a forwarder, (c, d, m): the rows local rank
///                          d stored in return ring (c, d, m) here;
///    ret heads  at a returner, (c, l, m): the rows forwarder l took from
///               this rank's return ring (c, this rank, m) there;
///    ret sent / ret taken  the local running totals of both]
///
/// The combine rings (make_combine) lie in the same places with combine
/// records (a BF16 row and its weights): network ring (c, m) at a source
/// from the forwarder of its local index in node m, its send copy at that
/// forwarder; and in the NVLink area, a return ring per (channel, returning
/// local rank d, source node m) at each forwarder, of ret_slots() records
/// (the NVLink ring's records shared among the source nodes, so that each
/// node's rows flow on their own: a forwarder never waits on one node's
/// rows behind another's). The network words (signals, kNetSent /
/// kNetTaken) are the dispatch's: the same (rank, peer) pairs, running on.
struct HtRingRegion {
  int num_ranks = 1, ranks_per_node = 1;
  HtRingGeometry geometry;
  std::size_t record_bytes = 0;
  /// The ring kernel's transport signal base: ring id `i`'s words lie at
  /// signals + 8 (i kMaxContexts + ctx), inside the state block (ids below
  /// kSignalKindsAll R, the other families', are never used there).
  std::size_t signals = 0, ring_signals = 0;
  std::size_t bases = 0, nvl_tails = 0, nvl_heads = 0;
  std::size_t net_headers = 0, nvl_headers = 0, header_send = 0, count_rows = 0;
  std::size_t net_rings = 0, net_send = 0, nvl_rings = 0, rings_end = 0, state = 0, total = 0;
  /// The combine's rings (make_combine), and their words in the state block.
  bool combine = false;
  std::size_t ret_tails = 0, ret_heads = 0, ret_sent = 0, ret_taken = 0;

  /// Bytes of the state block for a topology (what the whole-call ops leave
  /// at the region's end while the rings are on).
  static std::size_t state_bytes(const Topology& topology);
  /// The rings of `geometry` in a region of `region_bytes` whose whole-call
  /// header takes `header_bytes`. Throws epx::Error naming the field for bad
  /// geometry or record size, kBufferTooSmall naming num_nvl_bytes when the
  /// rings and the state do not fit.
  static HtRingRegion make(const Topology& topology, const HtRingGeometry& geometry,
                           std::size_t record_bytes, std::size_t header_bytes,
                           std::size_t region_bytes);
  /// The combine's rings (records of ht_combine_row_bytes), errors as make's
  /// naming the combine.
  static HtRingRegion make_combine(const Topology& topology, const HtRingGeometry& geometry,
                                   std::size_t record_bytes, std::size_t header_bytes,
                                   std::size_t region_bytes);
  /// `geometry` with its default-sized rings halved until they and the state
  /// fit `region_bytes` (make's other arguments): the network rings unless
  /// `keep_net_slots` (a config's num_max_rdma_recv_tokens), the NVLink rings
  /// always, neither below kMinFitSlots records nor below a put's chunk; where
  /// `chunk_by_bytes` (no num_max_rdma_send_tokens) a put stays at most half
  /// the network ring. So more channels, nodes or wider records than the
  /// default rings fit get smaller rings instead of kBufferTooSmall; what
  /// still does not fit at the floor is make's error. EPX_HT_RINGS=N rings
  /// are not fitted (the caller does not call this).
  static HtRingGeometry fit(const Topology& topology, HtRingGeometry geometry,
                            std::size_t record_bytes, std::size_t header_bytes,
                            std::size_t region_bytes, bool combine, bool keep_net_slots,
                            bool chunk_by_bytes);
  static constexpr int kMinFitSlots = 16;

  /// What the ranks' rings must agree on to meet: the geometry, the record
  /// size and where the areas lie (which the region's size moves), folded
  /// into a positive int, never 0 (0: no rings). The dispatch barrier
  /// compares it (kernels::HtNetShape's last field), so ranks whose channel
  /// counts, EPX_HT_RINGS or num_nvl_bytes differ are refused by name
  /// before anything moves, instead of storing into each other's wrong rows.
  /// (Inline: the NVSHMEM module's kernels use it without this file's .cpp.)
  int layout_word() const {
    const uint64_t v[] = {static_cast<uint64_t>(geometry.channels),
                          static_cast<uint64_t>(geometry.net_slots),
                          static_cast<uint64_t>(geometry.net_chunk),
                          static_cast<uint64_t>(geometry.nvl_slots),
                          static_cast<uint64_t>(geometry.nvl_chunk),
                          record_bytes,
                          static_cast<uint64_t>(combine),
                          nvl_rings,
                          state,
                          total};
    uint32_t h = 2166136261u;  // FNV-1a over the values' bytes
    for (uint64_t x : v)
      for (int b = 0; b < 8; ++b) {
        h ^= static_cast<uint32_t>((x >> (8 * b)) & 0xff);
        h *= 16777619u;
      }
    return static_cast<int>((h & 0x7fffffffu) | 1u);
  }

  EPX_HD int num_nodes() const { return num_ranks / ranks_per_node; }
  EPX_HD int width() const {  ///< of the bases: nodes, local ranks, or kOps's 3 roles
    const int w = num_nodes() > ranks_per_node ? num_nodes() : ranks_per_node;
    return w > 3 ? w : 3;
  }
  /// Offsets of a ring's slot / counter words.
  EPX_HD std::size_t base_word(HtRingBase kind, int channel, int index) const {
    return bases + 8u * ((static_cast<std::size_t>(kind) * kMaxRingChannels + channel) *
                             static_cast<std::size_t>(width()) +
                         index);
  }
  EPX_HD std::size_t nvl_tail(int channel, int forwarder_local) const {
    return nvl_tails + 8u * (static_cast<std::size_t>(channel) * ranks_per_node + forwarder_local);
  }
  EPX_HD std::size_t nvl_head(int channel, int receiver_local) const {
    return nvl_heads + 8u * (static_cast<std::size_t>(channel) * ranks_per_node + receiver_local);
  }
  /// Words of one network header: 1 + L rounded up to even, so that each
  /// header and the put that carries it (net_header_bytes) are whole 16-byte
  /// units. A put between same-node ranks (a sender's to its own node) is a
  /// 16-byte vector copy (lsa_copy): with 1 + L words (24 B at L = 2) every
  /// other header started 8 B off 16 and the copy dropped the last word.
  EPX_HD int net_header_words() const { return (ranks_per_node + 2) & ~1; }
  EPX_HD std::size_t net_header_bytes() const {
    return 8u * static_cast<std::size_t>(net_header_words());
  }
  /// Word i (0: the record count, 1 + d: rows for local rank d) of the
  /// header from node `node`'s source, channel c; and of sender c's copy of
  /// its header for node `node` (what the put reads).
  EPX_HD std::size_t net_header(int channel, int node, int word) const {
    return net_headers +
           (static_cast<std::size_t>(channel) * num_nodes() + node) * net_header_bytes() +
           8u * static_cast<std::size_t>(word);
  }
  EPX_HD std::size_t header_send_word(int channel, int node, int word) const {
    return net_header(channel, node, word) - net_headers + header_send;
  }
  EPX_HD std::size_t nvl_header(int channel, int forwarder_local) const {
    return nvl_headers +
           8u * (static_cast<std::size_t>(channel) * ranks_per_node + forwarder_local);
  }
  EPX_HD std::size_t net_slot(int channel, int node, uint64_t index) const {
    const std::size_t ring = static_cast<std::size_t>(channel) * num_nodes() + node;
    const std::size_t slots = static_cast<std::size_t>(geometry.net_slots);
    return net_rings + (ring * slots + index % slots) * record_bytes;
  }
  EPX_HD std::size_t net_send_slot(int channel, int node, uint64_t index) const {
    return net_slot(channel, node, index) - net_rings + net_send;
  }
  /// Records of a combine return ring: the NVLink ring's records shared
  /// among the source nodes (at least 1).
  EPX_HD int ret_slots() const {
    const int s = geometry.nvl_slots / num_nodes();
    return s < 1 ? 1 : s;
  }
  /// Word (c, local rank, node) of a return-ring word array (ret_tails,
  /// ret_heads, ret_sent, ret_taken).
  EPX_HD std::size_t ret_word(std::size_t area, int channel, int local, int node) const {
    return area + 8u * ((static_cast<std::size_t>(channel) * ranks_per_node + local) *
                            static_cast<std::size_t>(num_nodes()) +
                        node);
  }
  /// Slot of return ring (c, returning local rank d, source node m) at a forwarder.
  EPX_HD std::size_t ret_slot(int channel, int local, int node, uint64_t index) const {
    const std::size_t ring =
        (static_cast<std::size_t>(channel) * ranks_per_node + local) * num_nodes() + node;
    const std::size_t slots = static_cast<std::size_t>(ret_slots());
    return nvl_rings + (ring * slots + index % slots) * record_bytes;
  }
  EPX_HD std::size_t nvl_slot(int channel, int forwarder_local, uint64_t index) const {
    const std::size_t ring = static_cast<std::size_t>(channel) * ranks_per_node + forwarder_local;
    const std::size_t slots = static_cast<std::size_t>(geometry.nvl_slots);
    return nvl_rings + (ring * slots + index % slots) * record_bytes;
  }

 private:
  /// The state block's offsets from `start` (placed by make and state_bytes alike).
  void place_state(std::size_t start);
  static HtRingRegion build(const Topology& topology, const HtRingGeometry& geometry,
                            std::size_t record_bytes, std::size_t header_bytes,
                            std::size_t region_bytes, bool combine);
  /// The rings' offsets (net_rings .. rings_end) of r's geometry and records
  /// after a header of `header_bytes`; no check.
  static void place_rings(HtRingRegion& r, std::size_t header_bytes);
  /// A region of these rings with their offsets placed (no state, no check).
  static HtRingRegion laid_out(const Topology& topology, const HtRingGeometry& geometry,
                               std::size_t record_bytes, std::size_t header_bytes, bool combine);
  /// Whether r's rings and a state block of `state` bytes fit `region_bytes`.
  static bool room_for(const HtRingRegion& r, std::size_t state, std::size_t region_bytes);
};

}  // namespace epx::plan
