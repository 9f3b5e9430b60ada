// common/internode_channels.hpp - the ring dispatch's channels across nodes
// (docs/internode_ht.md, "The rings, concretely"): each source's tokens split
// into C contiguous ranges, and from per-channel counts (what the count
// exchange will carry, one more row per source) how many records each ring
// of an op carries and where a channel's records start in the whole-call
// numbering that InternodeRoute's handle state uses (a record's index in its
// source's stream to a node, its row among its source's rows at a rank). With
// these every role of the ring kernel knows how much it produces or
// consumes, so no ring needs an end mark. ChannelSplit is host and device
// code (the ring kernel's senders take their ranges from it); the rest is
// host arithmetic the CPU tests check the protocol with.
#pragma once

#include <cstdint>
#include <vector>

#include "common/device.cuh"
#include "common/internode_route.hpp"

namespace epx::plan {

/// A source's `tokens` tokens as `channels` contiguous ranges: channel c
/// holds [c q, min(T, (c + 1) q)) with q = ceil(T / C) (the last ones may be
/// empty). DeepEP's channels split the same way.
struct ChannelSplit {
  int tokens = 0, channels = 1;

  EPX_HD int per_channel() const { return channels > 0 ? (tokens + channels - 1) / channels : 0; }
  EPX_HD int first(int c) const { return clamp_token(c * per_channel()); }
  EPX_HD int end(int c) const { return clamp_token((c + 1) * per_channel()); }
  /// The channel of token t (0 <= t < tokens).
  EPX_HD int channel_of(int t) const { return per_channel() > 0 ? t / per_channel() : 0; }

 private:
  EPX_HD int clamp_token(int t) const { return t < tokens ? t : tokens; }
};

/// Each source's tokens per channel: [R][C][R] with an expert on each rank,
/// [R][C][N] with an expert in each node (a token counts once per node).
struct ChannelCounts {
  int channels = 1;
  std::vector<int> to_rank;  ///< [s][c][d]
  std::vector<int> to_node;  ///< [s][c][m]
};

/// Per-channel counts of one source's routing: for each of its `num_tokens`
/// tokens the mask of ranks it reaches (bit d: rank d; at most 64 ranks), as
/// the routing the layout kernel sees. Appends the source's [C][R] and
/// [C][N] rows to `out` (what the exchange would carry for it). The CPU
/// tests' model of the counts the GPU will compute.
void append_channel_counts(const Topology& topology, const std::vector<uint64_t>& rank_masks,
                           ChannelCounts& out);

class ChannelRoute {
 public:
  /// Throws epx::Error(kInvalidArgument) naming the field when the counts do
  /// not fit: sizes, channels below 1, negative counts, or a source whose
  /// channels do not add up to the route's whole-call counts.
  ChannelRoute(const InternodeRoute& route, ChannelCounts counts);

  int channels() const { return C_; }
  /// Records of channel c of source s for node m (s's own node included:
  /// those it forwards itself), and the first one's index in s's stream to
  /// m (InternodeRoute's send_pos): channel c's records to m are
  /// [node_first, node_first + node_records).
  int node_records(int s, int c, int m) const { return node(s, c, m); }
  int node_first(int s, int c, int m) const {
    return node_first_[(static_cast<std::size_t>(s) * C_ + c) * N_ + m];
  }
  /// Records channel c of source s puts over the network to forwarder(s, m):
  /// node_records, 0 for its own node.
  int network_records(int s, int c, int m) const;
  /// Rows of channel c of source s at rank d, and the first one's row among
  /// s's rows at d (InternodeRoute's rank_pos): [rank_first, + rank_rows).
  int rank_rows(int s, int c, int d) const { return rank(s, c, d); }
  int rank_first(int s, int c, int d) const {
    return rank_first_[(static_cast<std::size_t>(s) * C_ + c) * R_ + d];
  }
  /// Records forwarder f's channel c hands to local rank d of its node: the
  /// rows for d of channel c of every source f forwards (s with f's local
  /// index, f itself included). What the NVLink ring (c, f) at d carries.
  int forwarded_records(int f, int c, int d_local) const;
  /// The most records of one network ring / one NVLink ring in this op.
  int max_network_records() const;
  int max_forwarded_records() const;

 private:
  int node(int s, int c, int m) const {
    return c_.to_node[(static_cast<std::size_t>(s) * C_ + c) * N_ + m];
  }
  int rank(int s, int c, int d) const {
    return c_.to_rank[(static_cast<std::size_t>(s) * C_ + c) * R_ + d];
  }
  Topology topology_;
  ChannelCounts c_;
  int R_ = 1, N_ = 1, C_ = 1;
  std::vector<int> node_first_;  ///< [s][c][m]
  std::vector<int> rank_first_;  ///< [s][c][d]
};

}  // namespace epx::plan
