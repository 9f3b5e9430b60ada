// The ring dispatch's channels (common/internode_channels.hpp) against a
// replay of the routing, token by token: for each source, its tokens in
// token order, each token's index in the source's stream to each node it
// reaches (send_pos) and its row among the source's rows at each rank it
// reaches (rank_pos), as the handle numbers them today. A channel's records
// must be exactly the contiguous index range ChannelRoute gives, and every
// ring's record count what the replay counts. No GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/internode_channels.hpp"
#include "common/internode_route.hpp"
#include "epx/error.hpp"

namespace {

using epx::Topology;
using epx::plan::ChannelCounts;
using epx::plan::ChannelRoute;
using epx::plan::ChannelSplit;
using epx::plan::InternodeCounts;
using epx::plan::InternodeRoute;

std::size_t at3(int a, int B, int b, int C, int c) {
  return (static_cast<std::size_t>(a) * B + b) * C + c;
}

/// Each source's tokens as masks of the ranks they reach: random, with some
/// tokens reaching nothing and, with `empty_source`, rank 1 sending none.
std::vector<std::vector<uint64_t>> random_routing(const Topology& t, const std::vector<int>& T,
                                                  double reach, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<std::vector<uint64_t>> masks(t.num_ranks);
  for (int s = 0; s < t.num_ranks; ++s)
    for (int tok = 0; tok < T[s]; ++tok) {
      uint64_t m = 0;
      for (int d = 0; d < t.num_ranks; ++d)
        if (u(rng) < reach) m |= uint64_t{1} << d;
      masks[s].push_back(m);
    }
  return masks;
}

struct Built {
  InternodeCounts whole;
  ChannelCounts channels;
};

Built counts_of(const Topology& t, const std::vector<std::vector<uint64_t>>& masks, int C) {
  const int R = t.num_ranks, N = t.num_nodes(), L = t.ranks_per_node;
  Built b;
  b.whole.topology = t;
  b.whole.tokens_to_rank.assign(static_cast<std::size_t>(R) * R, 0);
  b.whole.tokens_to_node.assign(static_cast<std::size_t>(R) * N, 0);
  b.channels.channels = C;
  for (int s = 0; s < R; ++s) {
    for (uint64_t m : masks[s]) {
      for (int d = 0; d < R; ++d)
        b.whole.tokens_to_rank[static_cast<std::size_t>(s) * R + d] += (m >> d) & 1u;
      for (int n = 0; n < N; ++n)
        b.whole.tokens_to_node[static_cast<std::size_t>(s) * N + n] +=
            ((m >> (n * L)) & ((uint64_t{1} << L) - 1u)) != 0;
    }
    epx::plan::append_channel_counts(t, masks[s], b.channels);
  }
  return b;
}

/// Checks every ring of `route` against the token-by-token replay.
void check_against_replay(const Topology& t, const std::vector<std::vector<uint64_t>>& masks,
                          const ChannelRoute& route, const std::string& what) {
  const int R = t.num_ranks, N = t.num_nodes(), L = t.ranks_per_node, C = route.channels();
  // Replayed per (s, c, m): the send_pos values seen; per (s, c, d): rank_pos.
  std::vector<std::vector<int>> send_seen(static_cast<std::size_t>(R) * C * N);
  std::vector<std::vector<int>> rank_seen(static_cast<std::size_t>(R) * C * R);
  for (int s = 0; s < R; ++s) {
    const ChannelSplit split{static_cast<int>(masks[s].size()), C};
    std::vector<int> send_pos(N, 0), rank_pos(R, 0);
    for (int tok = 0; tok < split.tokens; ++tok) {
      const int c = split.channel_of(tok);
      ASSERT_GE(tok, split.first(c)) << what;
      ASSERT_LT(tok, split.end(c)) << what;
      const uint64_t m = masks[s][tok];
      for (int n = 0; n < N; ++n)
        if (((m >> (n * L)) & ((uint64_t{1} << L) - 1u)) != 0)
          send_seen[at3(s, C, c, N, n)].push_back(send_pos[n]++);
      for (int d = 0; d < R; ++d)
        if ((m >> d) & 1u) rank_seen[at3(s, C, c, R, d)].push_back(rank_pos[d]++);
    }
  }
  // The replayed indexes of one ring must be exactly [first, first + count).
  auto expect_range = [](const std::vector<int>& seen, int count, int first,
                         const std::string& where) {
    ASSERT_EQ(count, static_cast<int>(seen.size())) << where;
    for (std::size_t i = 0; i < seen.size(); ++i)
      ASSERT_EQ(seen[i], first + static_cast<int>(i)) << where;
  };
  int most_net = 0, most_fwd = 0;
  for (int s = 0; s < R; ++s)
    for (int c = 0; c < C; ++c) {
      const std::string at =
          what + ": source " + std::to_string(s) + " channel " + std::to_string(c);
      for (int n = 0; n < N; ++n) {
        const auto& seen = send_seen[at3(s, C, c, N, n)];
        const std::string where = at + " node " + std::to_string(n);
        expect_range(seen, route.node_records(s, c, n), route.node_first(s, c, n), where);
        const int net = route.network_records(s, c, n);
        EXPECT_EQ(net, n == t.node_of(s) ? 0 : static_cast<int>(seen.size())) << where;
        most_net = std::max(most_net, net);
      }
      for (int d = 0; d < R; ++d)
        expect_range(rank_seen[at3(s, C, c, R, d)], route.rank_rows(s, c, d),
                     route.rank_first(s, c, d), at + " rank " + std::to_string(d));
    }
  // Forwarder f's NVLink ring (c, f) at local rank d: the rows for d of
  // channel c of every source with f's local index.
  for (int f = 0; f < R; ++f)
    for (int c = 0; c < C; ++c)
      for (int dl = 0; dl < L; ++dl) {
        const int d = t.node_of(f) * L + dl;
        int want = 0;
        for (int s = t.local_of(f); s < R; s += L)
          want += static_cast<int>(rank_seen[at3(s, C, c, R, d)].size());
        EXPECT_EQ(route.forwarded_records(f, c, dl), want)
            << what << ": forwarder " << f << " channel " << c << " local rank " << dl;
        most_fwd = std::max(most_fwd, want);
      }
  EXPECT_EQ(route.max_network_records(), most_net) << what;
  EXPECT_EQ(route.max_forwarded_records(), most_fwd) << what;
}

TEST(InternodeChannels, SplitIsContiguousAndCoversEveryToken) {
  for (int T : {0, 1, 5, 23, 64, 4096})
    for (int C : {1, 2, 3, 7, 24, 100}) {
      const ChannelSplit s{T, C};
      int expect_first = 0;
      for (int c = 0; c < C; ++c) {
        ASSERT_EQ(s.first(c), expect_first) << "T " << T << " C " << C << " c " << c;
        ASSERT_GE(s.end(c), s.first(c));
        for (int t = s.first(c); t < s.end(c); ++t) ASSERT_EQ(s.channel_of(t), c);
        expect_first = s.end(c);
      }
      EXPECT_EQ(expect_first, T) << "T " << T << " C " << C;
    }
}

TEST(InternodeChannels, RingsMatchTheTokenReplay) {
  struct Shape {
    int R, L, C;
    double reach;
  };
  for (const Shape& sh :
       {Shape{4, 2, 1, 0.3}, Shape{4, 2, 3, 0.3}, Shape{8, 4, 5, 0.2}, Shape{8, 2, 24, 0.5},
        Shape{16, 4, 7, 0.1}, Shape{16, 8, 2, 0.05}, Shape{64, 8, 24, 0.04}}) {
    const Topology t{sh.R, sh.L};
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      std::vector<int> T(sh.R);
      std::mt19937_64 rng(seed * 7919 + sh.R);
      for (int s = 0; s < sh.R; ++s) T[s] = static_cast<int>(rng() % 300);
      T[sh.R - 1] = 0;  // a source with no tokens
      if (sh.R > 2) T[1] = 1;
      const auto masks = random_routing(t, T, sh.reach, seed);
      const Built b = counts_of(t, masks, sh.C);
      const InternodeRoute whole(b.whole);
      const ChannelRoute route(whole, b.channels);
      check_against_replay(t, masks, route,
                           "R" + std::to_string(sh.R) + " L" + std::to_string(sh.L) + " C" +
                               std::to_string(sh.C) + " seed " + std::to_string(seed));
    }
  }
}

TEST(InternodeChannels, CountsThatDoNotFitAreNamed) {
  const Topology t{4, 2};
  const auto masks = random_routing(t, {40, 30, 20, 10}, 0.4, 5);
  const Built good = counts_of(t, masks, 3);
  const InternodeRoute whole(good.whole);
  auto expect_named = [&](ChannelCounts c, const std::string& field, const std::string& part) {
    try {
      ChannelRoute r(whole, std::move(c));
      ADD_FAILURE() << "no error for " << field;
    } catch (const epx::Error& e) {
      EXPECT_EQ(e.code(), epx::ErrorCode::kInvalidArgument);
      const std::string m = e.what();
      EXPECT_NE(m.find(field), std::string::npos) << m;
      EXPECT_NE(m.find(part), std::string::npos) << m;
    }
  };
  {
    ChannelCounts c = good.channels;
    c.channels = 0;
    expect_named(c, "channels", ">= 1");
  }
  {
    ChannelCounts c = good.channels;
    c.to_rank.pop_back();
    expect_named(c, "to_rank", "[R][C][R]");
  }
  {
    ChannelCounts c = good.channels;
    c.to_node.push_back(0);
    expect_named(c, "to_node", "[R][C][N]");
  }
  {
    // Source 0's token 0 (channel 0) goes to rank 2, token 1 (channel 1) to
    // rank 3: node 1 gets one record per channel. Both counted in channel 0
    // keeps the sums, and channel 0's node count exceeds its ranks' sum.
    const std::vector<std::vector<uint64_t>> two = {
        {uint64_t{1} << 2, uint64_t{1} << 3}, {}, {}, {}};
    const Built b2 = counts_of(t, two, 2);
    const InternodeRoute whole2(b2.whole);
    ChannelCounts c = b2.channels;
    const int N = t.num_nodes();
    ASSERT_EQ(c.to_node[at3(0, 2, 0, N, 1)], 1);
    ASSERT_EQ(c.to_node[at3(0, 2, 1, N, 1)], 1);
    c.to_node[at3(0, 2, 0, N, 1)] = 2;
    c.to_node[at3(0, 2, 1, N, 1)] = 0;
    try {
      ChannelRoute r(whole2, c);
      ADD_FAILURE() << "no error for a channel's node count above its ranks'";
    } catch (const epx::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("to_node"), std::string::npos) << m;
      EXPECT_NE(m.find("channel 0"), std::string::npos) << m;
    }
  }
  {
    // A channel count that the whole-call count does not add up to.
    ChannelCounts c = good.channels;
    c.to_rank[at3(2, 3, 2, 4, 3)] += 1;
    c.to_node[at3(2, 3, 2, t.num_nodes(), 1)] += 1;  // still fits the channel's rank counts
    expect_named(c, "to_", "whole-call count");
  }
  {
    ChannelCounts c = good.channels;
    c.to_rank[0] = -1;
    expect_named(c, "to_", "");
  }
}

}  // namespace
