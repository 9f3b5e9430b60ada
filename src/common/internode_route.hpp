// common/internode_route.hpp - the high-throughput route across nodes
// (docs/internode_ht.md) as arithmetic on the count exchange's numbers:
// which rank forwards a source's tokens into a node, how many rows cross the
// network, and where in each receiver's output a forwarded row lands. The
// internode kernels and the host logic take their offsets from here; the CPU
// tests replay the whole two-level route with it and compare the result with
// the reference model.
#pragma once

#include <cstddef>
#include <vector>

#include "common/plan.hpp"
#include "common/topology.hpp"

namespace epx::plan {

/// What the count exchange gives every rank: each source's tokens per
/// destination rank and per destination node (a token counts once per node).
struct InternodeCounts {
  Topology topology;
  std::vector<int> tokens_to_rank;  ///< [R][R]: [s][d] = tokens of s with an expert on d
  std::vector<int> tokens_to_node;  ///< [R][N]: [s][m] = tokens of s with an expert in node m
};

class InternodeRoute {
 public:
  /// Throws epx::Error(kInvalidArgument) naming the field when the counts
  /// do not fit the topology (sizes, negative counts, a node count below one
  /// of its ranks' or above the sum of them).
  explicit InternodeRoute(InternodeCounts counts);

  const Topology& topology() const { return c_.topology; }
  /// The rank that forwards source s's tokens into node m: the one with s's
  /// local index there (s itself for its own node).
  int forwarder(int s, int m) const {
    return m * c_.topology.ranks_per_node + c_.topology.local_of(s);
  }
  /// Rows s puts over the network to forwarder(s, m): its tokens with an
  /// expert in node m, once each; 0 for its own node (NVLink only).
  int network_rows(int s, int m) const;
  /// Rows forwarder f takes in from source s (over the network, or s's own
  /// tokens when f == s) and stages for the ranks of its node.
  int forwarded_rows(int f, int s) const;
  /// Rows rank d receives in all, and where source s's rows start in its
  /// output: grouped by global source rank in rank order (the intranode
  /// order), each source's tokens in token order.
  int recv_rows(int d) const;
  int recv_offset(int d, int s) const;
  /// Rows source s's network puts carry to all other nodes (its send area).
  int network_rows_sent(int s) const;
  /// Rows rank f receives over the network (all sources of other nodes).
  int network_rows_received(int f) const;
  /// The count exchange's numbers.
  int tokens_to_rank(int s, int d) const { return at(s, d); }
  int tokens_to_node(int s, int m) const {
    return c_.tokens_to_node[static_cast<std::size_t>(s) * N_ + m];
  }
  /// The most rows any source has for one node (its own included): the rows
  /// of one node's slot in the whole-call areas (HtNetRegion).
  int max_node_rows() const;
  /// The most rows any rank receives.
  int max_recv_rows() const;

 private:
  int at(int s, int d) const { return c_.tokens_to_rank[static_cast<std::size_t>(s) * R_ + d]; }
  InternodeCounts c_;
  int R_ = 1, N_ = 1;
  std::vector<int> recv_offset_;  ///< [R][R]: [d][s]
  std::vector<int> recv_rows_;    ///< [R]
};

/// Signals of the internode high-throughput ops, one id per (kind, source
/// rank): a source's barrier arrival, its network rows (dispatch), a
/// forwarder's staged rows (dispatch), a receiver's returned rows (combine),
/// a forwarder's node sums (combine), its count row (the exchange of a
/// num_worst_tokens dispatch). Their ids come after the low-latency
/// ops' (LlRegion::kNetSignalKinds per rank): a backend whose signals are one
/// pool per communicator, not words of each region (NCCL GIN), keeps the two
/// families apart, and resets the low-latency ones alone when that region is
/// cleared.
enum class HtNetSignal : int {
  kBarrier = 0,
  kDispatchNet,
  kDispatchNvl,
  kCombineReturn,
  kCombineNet,
  kCounts,  ///< a source's count row (num_worst_tokens dispatch: the exchange on the GPU)
  kKinds
};
inline constexpr int kHtNetFirstSignalKind = LlRegion::kNetSignalKinds;
constexpr int ht_net_signal(int num_ranks, HtNetSignal kind, int src) {
  return (kHtNetFirstSignalKind + static_cast<int>(kind)) * num_ranks + src;
}
/// Signal ids per rank count of both families (what a pool must hold).
inline constexpr int kSignalKindsAll =
    kHtNetFirstSignalKind + static_cast<int>(HtNetSignal::kKinds);

/// One dispatch record, as sent over the network and staged over NVLink:
/// payload, scales (4-byte words), top-k expert ids (global, i32) and
/// weights (f32), then the source token index, the mask of the destination
/// node's local ranks it reaches, its index in the source's stream to that
/// node, the source rank, and for each of the node's `ranks_per_node` ranks
/// its row among the source's rows there (-1 where it does not go).
constexpr std::size_t ht_net_record_bytes(std::size_t hidden_bytes, int num_scales, int num_topk,
                                          int ranks_per_node) {
  return align_up(hidden_bytes + 4u * num_scales + 8u * num_topk + 16u + 4u * ranks_per_node, 16);
}

/// The internode high-throughput region (the buffer's num_nvl_bytes region):
/// a fixed header, then one op's areas, sized for the whole call from the
/// count exchange (docs/internode_ht.md, "A first version"). Every rank
/// computes the same offsets from the same exchanged counts.
///
///   [op counts u64[4], local: ops, dispatches, combines, count exchanges]
///   [finished-block counters u32[16], local]
///   [signals u64 [kSignalKindsAll * R][kMaxContexts]] (ht_net_signal's ids)
///   [shapes: 16 B [2][R] from each source, by op parity; 16 B [2] this
///    rank's own, the source of its puts] (the barrier's shape check)
///   body, dispatch: [recv: N slots][send: N slots][stage: rows]
///                   a slot holds `slot_rows` records; recv slot m: the rows
///                   from node m's source of this rank's local index; send
///                   slot m: this rank's rows for node m (its own node's
///                   slot: the rows it forwards itself, never sent)
///   body, combine:  [stage: L x N slots][send: N slots][recv: N slots] of
///                   combine rows; stage slot (d, m): local rank d's rows for
///                   the records that came from node m; send slot m: node
///                   sums for node m's source; recv slot m: node m's sums
struct HtNetRegion {
  static constexpr std::size_t kCounts = 0;
  static constexpr std::size_t kDone = 64;
  static constexpr int kDoneWords = 16;
  static constexpr std::size_t kSignals = 256;
  static constexpr std::size_t signals_bytes(int num_ranks) {
    return 8u * kSignalKindsAll * num_ranks * kMaxContexts;
  }
  /// Each op's row shape (HtNetShape), exchanged by the barrier.
  static constexpr std::size_t kShapeBytes = 32;
  static constexpr std::size_t shapes(int num_ranks) { return kSignals + signals_bytes(num_ranks); }
  static constexpr std::size_t body(int num_ranks) {
    return align_up(shapes(num_ranks) + kShapeBytes * (2u * num_ranks + 2u), kAlign);
  }

  std::size_t row_bytes = 0;  ///< a record (dispatch) or combine row
  int slot_rows = 0;          ///< rows per slot (InternodeRoute::max_node_rows)
  int num_nodes = 1, ranks_per_node = 1;
  std::size_t recv = 0, send = 0, stage = 0, total = 0;
  int stage_rows = 0;          ///< dispatch: the rows a rank's stage holds
  std::size_t count_rows = 0;  ///< num_worst_tokens dispatch: the count exchange's rows
  int count_ints = 0;          ///< ints per count row (count_row_ints)

  std::size_t slot_bytes() const { return row_bytes * static_cast<std::size_t>(slot_rows); }
  /// A dispatch's areas: stage holds the most rows any rank receives.
  static HtNetRegion dispatch(const InternodeRoute& route, std::size_t record_bytes);
  /// A combine's areas.
  static HtNetRegion combine(const InternodeRoute& route, std::size_t row_bytes);
  /// The most bytes dispatch and combine can need with at most `tokens`
  /// tokens per rank: every token to every node and rank.
  static std::size_t worst_case(const Topology& topology, int tokens, std::size_t record_bytes,
                                std::size_t combine_row_bytes);

  /// With num_worst_tokens (no host count exchange) the areas cannot follow
  /// the counts: they are fixed by the buffer. A stage of `worst` rows, the
  /// count exchange's rows, and slots of the most rows that let both this
  /// dispatch and a combine of `combine_row_bytes` rows fit `capacity` bytes
  /// (0 when not even one row does). Every rank computes the same from the
  /// same buffer and shapes; a rank with more tokens for one node than a
  /// slot holds is refused by the barrier.
  static int fixed_slot_rows(const Topology& topology, int worst, std::size_t record_bytes,
                             std::size_t combine_row_bytes, std::size_t capacity);
  /// Such a dispatch's areas with `slot_rows` (a cached dispatch keeps its
  /// handle's).
  static HtNetRegion fixed_dispatch(const Topology& topology, int worst, std::size_t record_bytes,
                                    int slot_rows);
  /// The combine of such a dispatch: the same slots, of combine rows.
  static HtNetRegion fixed_combine(const Topology& topology, int slot_rows, std::size_t row_bytes);
  /// Ints of one count row: the token count, whether the caller's
  /// num_tokens_per_rank disagrees with its routing, then per rank, then per
  /// node.
  static constexpr int count_row_ints(int num_ranks, int num_nodes) {
    return 2 + num_ranks + num_nodes;
  }

 private:
  /// The shape both ops share: rows of `row_bytes`, slots of the route's
  /// most rows for one node; no area placed yet.
  static HtNetRegion slots_of(const InternodeRoute& route, std::size_t row_bytes);
  /// The areas of a dispatch / combine with the shape already set.
  static void place_dispatch(HtNetRegion& r, int num_ranks);
  static void place_combine(HtNetRegion& r, int num_ranks);
};

}  // namespace epx::plan
