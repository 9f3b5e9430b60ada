// common/internode_route.hpp - the high-throughput route across nodes
// (docs/internode_ht.md) as arithmetic on the count exchange's numbers:
// which rank forwards a source's tokens into a node, how many rows cross the
// network, and where in each receiver's output a forwarded row lands. The
// internode kernels and the host logic take their offsets from here; the CPU
// tests replay the whole two-level route with it and compare the result with
// the reference model.
#pragma once

#include <vector>

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

 private:
  int at(int s, int d) const { return c_.tokens_to_rank[static_cast<std::size_t>(s) * R_ + d]; }
  InternodeCounts c_;
  int R_ = 1, N_ = 1;
  std::vector<int> recv_offset_;  ///< [R][R]: [d][s]
  std::vector<int> recv_rows_;    ///< [R]
};

}  // namespace epx::plan
