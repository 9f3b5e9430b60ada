#include "common/internode_channels.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "epx/error.hpp"

namespace epx::plan {

void append_channel_counts(const Topology& topology, const std::vector<uint64_t>& rank_masks,
                           ChannelCounts& out) {
  const int R = topology.num_ranks, N = topology.num_nodes(), L = topology.ranks_per_node;
  const int C = out.channels;
  require(C >= 1, "channels", "must be >= 1, got " + std::to_string(C));
  require(R >= 1 && R <= 64, "topology", "rank masks hold at most 64 ranks");
  const ChannelSplit split{static_cast<int>(rank_masks.size()), C};
  const std::size_t rank0 = out.to_rank.size(), node0 = out.to_node.size();
  out.to_rank.resize(rank0 + static_cast<std::size_t>(C) * R, 0);
  out.to_node.resize(node0 + static_cast<std::size_t>(C) * N, 0);
  for (int t = 0; t < split.tokens; ++t) {
    const int c = split.channel_of(t);
    const uint64_t mask = rank_masks[t];
    for (int d = 0; d < R; ++d)
      out.to_rank[rank0 + static_cast<std::size_t>(c) * R + d] +=
          static_cast<int>((mask >> d) & 1u);
    for (int m = 0; m < N; ++m) {
      const uint64_t node_bits = L >= 64 ? mask : (mask >> (m * L)) & ((uint64_t{1} << L) - 1u);
      out.to_node[node0 + static_cast<std::size_t>(c) * N + m] += node_bits != 0 ? 1 : 0;
    }
  }
}

ChannelRoute::ChannelRoute(const InternodeRoute& route, ChannelCounts counts)
    : topology_(route.topology()), c_(std::move(counts)) {
  R_ = topology_.num_ranks;
  N_ = topology_.num_nodes();
  C_ = c_.channels;
  require(C_ >= 1, "channels", "must be >= 1, got " + std::to_string(C_));
  require(c_.to_rank.size() == static_cast<std::size_t>(R_) * C_ * R_, "to_rank",
          "must be [R][C][R] = " + std::to_string(static_cast<std::size_t>(R_) * C_ * R_) +
              " counts, got " + std::to_string(c_.to_rank.size()));
  require(c_.to_node.size() == static_cast<std::size_t>(R_) * C_ * N_, "to_node",
          "must be [R][C][N] = " + std::to_string(static_cast<std::size_t>(R_) * C_ * N_) +
              " counts, got " + std::to_string(c_.to_node.size()));
  node_first_.assign(c_.to_node.size(), 0);
  rank_first_.assign(c_.to_rank.size(), 0);
  // Running starts: channel c's first index is what channels 0..c-1 hold; the
  // channels must add up to the whole-call count.
  auto starts = [&](const char* field, const char* what, int s, int target, int width,
                    const std::vector<int>& counts, std::vector<int>& firsts, int whole) {
    int at = 0;
    for (int c = 0; c < C_; ++c) {
      const std::size_t i = (static_cast<std::size_t>(s) * C_ + c) * width + target;
      require(counts[i] >= 0, field, "counts must be >= 0");
      firsts[i] = at;
      at += counts[i];
    }
    require(at == whole, field,
            "rank " + std::to_string(s) + "'s channels hold " + std::to_string(at) +
                " tokens for " + what + " " + std::to_string(target) +
                ", its whole-call count is " + std::to_string(whole));
  };
  const int L = topology_.ranks_per_node;
  for (int s = 0; s < R_; ++s) {
    for (int m = 0; m < N_; ++m)
      starts("to_node", "node", s, m, N_, c_.to_node, node_first_, route.tokens_to_node(s, m));
    // Per channel, as InternodeRoute checks the whole call: a token with an
    // expert in node m reaches at least one and at most all of its ranks.
    for (int c = 0; c < C_; ++c)
      for (int m = 0; m < N_; ++m) {
        int most = 0, sum = 0;
        for (int l = 0; l < L; ++l) {
          most = std::max(most, rank(s, c, m * L + l));
          sum += rank(s, c, m * L + l);
        }
        require(node(s, c, m) >= most && node(s, c, m) <= sum, "to_node",
                "rank " + std::to_string(s) + "'s channel " + std::to_string(c) +
                    " count for node " + std::to_string(m) + " (" + std::to_string(node(s, c, m)) +
                    ") must lie between its largest count for one rank of that node (" +
                    std::to_string(most) + ") and their sum (" + std::to_string(sum) + ")");
      }
    for (int d = 0; d < R_; ++d)
      starts("to_rank", "rank", s, d, R_, c_.to_rank, rank_first_, route.tokens_to_rank(s, d));
  }
}

int ChannelRoute::network_records(int s, int c, int m) const {
  return m == topology_.node_of(s) ? 0 : node(s, c, m);
}

int ChannelRoute::forwarded_records(int f, int c, int d_local) const {
  const int L = topology_.ranks_per_node, d = topology_.node_of(f) * L + d_local;
  int records = 0;
  for (int n = 0; n < N_; ++n) records += rank(n * L + topology_.local_of(f), c, d);
  return records;
}

int ChannelRoute::max_network_records() const {
  int most = 0;
  for (int s = 0; s < R_; ++s)
    for (int c = 0; c < C_; ++c)
      for (int m = 0; m < N_; ++m) most = std::max(most, network_records(s, c, m));
  return most;
}

int ChannelRoute::max_forwarded_records() const {
  int most = 0;
  for (int f = 0; f < R_; ++f)
    for (int c = 0; c < C_; ++c)
      for (int d = 0; d < topology_.ranks_per_node; ++d)
        most = std::max(most, forwarded_records(f, c, d));
  return most;
}

}  // namespace epx::plan
