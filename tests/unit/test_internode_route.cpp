// The high-throughput route across nodes (common/internode_route.hpp), replayed
// on the CPU: every source's tokens go to the forwarder with its local index
// in each destination node (itself for its own node), which places each row
// in each receiver's output at route.recv_offset + its running index. The
// result must be the reference dispatch's rows in its order, and the
// combine summed back along the same route (each node's rows in float32,
// rounded to BF16, then the nodes in order) the reference combine across
// nodes, bit for bit. No GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/diag.hpp"
#include "common/internode_route.hpp"
#include "epx/buffer.hpp"
#include "epx/error.hpp"
#include "epx/reference.hpp"

namespace {

namespace ref = epx::ref;
using epx::plan::InternodeCounts;
using epx::plan::InternodeRoute;

std::size_t sz(int a, int b) {
  return static_cast<std::size_t>(a) * static_cast<std::size_t>(b);
}

struct Case {
  int R, L, H, K, E;
  std::vector<int> T;  ///< tokens per rank
  double masked;
};

struct Routed {
  std::vector<ref::HtInput> in;
  std::vector<ref::Layout> layout;
  InternodeCounts counts;
};

/// The layouts of r.in's routing and the counts the exchange would give.
void route_counts(const Case& c, Routed& r) {
  const int N = c.R / c.L;
  r.layout.clear();
  r.counts.topology = epx::Topology{c.R, c.L};
  r.counts.tokens_to_rank.assign(sz(c.R, c.R), 0);
  r.counts.tokens_to_node.assign(sz(c.R, N), 0);
  for (int s = 0; s < c.R; ++s) {
    r.layout.push_back(ref::get_dispatch_layout(r.in[s].topk_idx, c.T[s], c.K, c.E, c.R, c.L));
    for (int d = 0; d < c.R; ++d)
      r.counts.tokens_to_rank[sz(s, c.R) + d] = r.layout[s].num_tokens_per_rank[d];
    for (int m = 0; m < N; ++m)
      r.counts.tokens_to_node[sz(s, N) + m] = r.layout[s].num_tokens_per_node[m];
  }
}

Routed make(const Case& c, uint64_t seed) {
  Routed r;
  r.in.resize(c.R);
  for (int s = 0; s < c.R; ++s) {
    ref::HtInput& x = r.in[s];
    x.num_tokens = c.T[s];
    x.topk_idx = ref::random_topk(c.T[s], c.K, c.E, c.masked, seed * 131 + s);
    x.x_bf16 = ref::random_bf16(sz(c.T[s], c.H), seed * 137 + s);
  }
  route_counts(c, r);
  return r;
}

/// The two-level dispatch along the route: placed[d][row] = {source, token}.
std::vector<std::vector<std::pair<int, int>>> replay_dispatch(const Case& c, const Routed& r,
                                                              const InternodeRoute& route) {
  const int N = c.R / c.L;
  std::vector<std::vector<std::pair<int, int>>> placed(c.R);
  for (int d = 0; d < c.R; ++d) placed[d].assign(route.recv_rows(d), {-1, -1});
  for (int s = 0; s < c.R; ++s)
    for (int m = 0; m < N; ++m) {
      const int f = route.forwarder(s, m);
      EXPECT_EQ(f / c.L, m);
      EXPECT_EQ(f % c.L, s % c.L);
      std::vector<int> running(c.R, 0);
      int stream = 0;  // rows of s that f takes in, in token order
      for (int t = 0; t < c.T[s]; ++t) {
        bool in_node = false;
        for (int d = m * c.L; d < (m + 1) * c.L; ++d) {
          if (!r.layout[s].is_token_in_rank[sz(t, c.R) + d]) continue;
          in_node = true;
          const int pos = route.recv_offset(d, s) + running[d]++;
          EXPECT_LT(running[d] - 1, r.counts.tokens_to_rank[sz(s, c.R) + d]);
          EXPECT_EQ(placed[d].at(pos).first, -1) << "two rows for one slot";
          placed[d].at(pos) = {s, t};
        }
        stream += in_node ? 1 : 0;
      }
      EXPECT_EQ(stream, route.forwarded_rows(f, s)) << "s=" << s << " m=" << m;
      EXPECT_EQ(m == s / c.L ? 0 : stream, route.network_rows(s, m)) << "s=" << s << " m=" << m;
    }
  return placed;
}

void check_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE("R=" + std::to_string(c.R) + " L=" + std::to_string(c.L) + " seed " +
               std::to_string(seed));
  const Routed r = make(c, seed);
  const InternodeRoute route(r.counts);
  const auto placed = replay_dispatch(c, r, route);
  const auto want = ref::ht_dispatch(r.in, c.H, c.K, c.E, 1);
  for (int d = 0; d < c.R; ++d) {
    ASSERT_EQ(route.recv_rows(d), want[d].num_recv_tokens) << "d=" << d;
    for (int row = 0; row < route.recv_rows(d); ++row) {
      const auto [s, t] = placed[d][row];
      ASSERT_EQ(s, want[d].recv_src_rank[row]) << "d=" << d << " row=" << row;
      ASSERT_EQ(t, want[d].recv_src_idx[row]) << "d=" << d << " row=" << row;
      for (int h = 0; h < c.H; ++h)
        ASSERT_EQ(r.in[s].x_bf16[sz(t, c.H) + h], want[d].recv_x_bf16[sz(row, c.H) + h]);
    }
  }
  // Every row put over the network is taken in by exactly one forwarder.
  long sent = 0, received = 0;
  for (int s = 0; s < c.R; ++s) sent += route.network_rows_sent(s);
  for (int f = 0; f < c.R; ++f) received += route.network_rows_received(f);
  EXPECT_EQ(sent, received);
  if (c.L == c.R) EXPECT_EQ(sent, 0) << "one node: nothing crosses a network";

  // The combine back along the same route, against the reference's.
  const int N = c.R / c.L;
  std::vector<ref::HtCombineInput> ci(c.R);
  std::vector<std::vector<int>> row_of(c.R);  // [d][s * maxT + t] -> row
  int max_t = 1;
  for (int t : c.T) max_t = t > max_t ? t : max_t;
  for (int d = 0; d < c.R; ++d) {
    ci[d].x = ref::random_bf16(sz(route.recv_rows(d), c.H), seed * 139 + d);
    ci[d].bias_0 = ref::random_bf16(sz(c.T[d], c.H), seed * 149 + d);
    row_of[d].assign(sz(c.R, max_t), -1);
    for (int row = 0; row < route.recv_rows(d); ++row)
      row_of[d][sz(placed[d][row].first, max_t) + placed[d][row].second] = row;
  }
  const auto out = ref::ht_combine(r.in, ci, c.H, c.K, c.E, c.L);
  for (int s = 0; s < c.R; ++s)
    for (int t = 0; t < c.T[s]; ++t)
      for (int h = 0; h < c.H; ++h) {
        float total = 0.0f;
        for (int m = 0; m < N; ++m) {
          // The forwarder sums its node's rows in ascending rank order and
          // sends one BF16 row (none when the token reaches no rank there).
          float node = 0.0f;
          bool any = false;
          for (int d = m * c.L; d < (m + 1) * c.L; ++d) {
            const int row = row_of[d][sz(s, max_t) + t];
            if (row < 0) continue;
            node += ref::bf16_to_float(ci[d].x[sz(row, c.H) + h]);
            any = true;
          }
          if (any) total += N > 1 ? ref::bf16_to_float(ref::float_to_bf16(node)) : node;
        }
        total += ref::bf16_to_float(ci[s].bias_0[sz(t, c.H) + h]);
        ASSERT_EQ(out[s].combined_x[sz(t, c.H) + h], ref::float_to_bf16(total))
            << "s=" << s << " t=" << t << " h=" << h;
      }
}

TEST(InternodeRoute, ReplaysTheReferenceDispatchAndCombine) {
  const std::vector<Case> cases = {
      {4, 2, 16, 4, 64, {37, 0, 64, 5}, 0.1},                // 2x2, a rank with no token
      {16, 4, 8, 8, 128, std::vector<int>(16, 24), 0.1},     // 4x4
      {8, 2, 8, 8, 256, {40, 1, 0, 33, 17, 9, 64, 2}, 0.2},  // 4x2, 0 and 1 tokens
      {8, 8, 8, 4, 64, {5, 6, 7, 8, 9, 10, 11, 12}, 0.0},    // one node
      {6, 1, 8, 3, 12, {11, 12, 13, 0, 2, 30}, 0.1},         // every rank its own node
      {4, 2, 8, 4, 64, {20, 20, 20, 20}, 1.0},               // every slot -1: nothing moves
  };
  for (uint64_t seed = 1; seed <= 3; ++seed)
    for (const Case& c : cases) check_case(c, seed);
}

// A node that receives nothing: no source sends it a row, its forwarders take
// in nothing, its ranks receive nothing.
TEST(InternodeRoute, ANodeThatReceivesNothing) {
  const Case c{4, 2, 8, 2, 8, {10, 10, 10, 10}, 0.0};
  Routed r = make(c, 7);
  // Route every pick to experts 0..3 (ranks 0 and 1, node 0).
  for (auto& x : r.in)
    for (std::size_t i = 0; i < x.topk_idx.size(); ++i) x.topk_idx[i] = static_cast<int64_t>(i % 2);
  route_counts(c, r);
  const InternodeRoute route(r.counts);
  for (int s = 0; s < c.R; ++s) EXPECT_EQ(route.network_rows(s, 1), 0);
  EXPECT_EQ(route.recv_rows(2), 0);
  EXPECT_EQ(route.recv_rows(3), 0);
  EXPECT_EQ(route.network_rows_received(2) + route.network_rows_received(3), 0);
  const auto placed = replay_dispatch(c, r, route);
  EXPECT_EQ(placed[0].size() + placed[1].size(), static_cast<std::size_t>(4 * 10 * 1));
}

TEST(InternodeRoute, BadCountsAreNamed) {
  auto message = [](InternodeCounts c) {
    try {
      InternodeRoute route(std::move(c));
    } catch (const epx::Error& e) {
      EXPECT_EQ(e.code(), epx::ErrorCode::kInvalidArgument);
      return std::string(e.what());
    }
    return std::string();
  };
  InternodeCounts ok{epx::Topology{4, 2}, std::vector<int>(16, 1), std::vector<int>(8, 1)};
  EXPECT_EQ(message(ok), "");
  InternodeCounts c = ok;
  c.tokens_to_rank.pop_back();
  EXPECT_NE(message(c).find("tokens_to_rank"), std::string::npos);
  c = ok;
  c.tokens_to_node.push_back(0);
  EXPECT_NE(message(c).find("tokens_to_node"), std::string::npos);
  c = ok;
  c.tokens_to_rank[3] = -1;
  EXPECT_NE(message(c).find("tokens_to_rank"), std::string::npos);
  c = ok;
  c.tokens_to_node[0] = 3;  // more than the sum over the node's two ranks
  EXPECT_NE(message(c).find("tokens_to_node"), std::string::npos);
  c = ok;
  c.tokens_to_node[1] = 0;  // fewer than one of the node's ranks receives
  EXPECT_NE(message(c).find("tokens_to_node"), std::string::npos);
  c = ok;
  c.topology = epx::Topology{4, 3};
  EXPECT_NE(message(c).find("topology"), std::string::npos);
}

}  // namespace

// The whole-call areas of the internode kernels: after the header and the
// signal words, aligned, disjoint, each as large as the route needs (a
// node's slot holds the most rows any source has for one node, the stage the
// most rows any rank receives), and the same on every rank (they depend on
// the exchanged counts only).
TEST(InternodeRoute, WholeCallRegionsHoldTheRoute) {
  using epx::plan::HtNetRegion;
  const Case c{8, 2, 8, 8, 256, {40, 1, 0, 33, 17, 9, 64, 2}, 0.2};
  Routed r = make(c, 5);
  route_counts(c, r);
  const InternodeRoute route(r.counts);
  const int N = 4;
  int most_node = 0, most_recv = 0;
  for (int s = 0; s < c.R; ++s)
    for (int m = 0; m < N; ++m) most_node = std::max(most_node, route.tokens_to_node(s, m));
  for (int d = 0; d < c.R; ++d) most_recv = std::max(most_recv, route.recv_rows(d));
  EXPECT_EQ(route.max_node_rows(), most_node);
  EXPECT_EQ(route.max_recv_rows(), most_recv);

  const std::size_t rec = epx::plan::ht_net_record_bytes(7168, 56, 8, c.L);
  EXPECT_EQ(rec % 16, 0u);
  EXPECT_GE(rec, 7168u + 4 * 56 + 8 * 8 + 16 + 4 * c.L);
  const HtNetRegion d = HtNetRegion::dispatch(route, rec);
  const std::size_t body = HtNetRegion::body(c.R);
  EXPECT_GE(body, HtNetRegion::kSignals + HtNetRegion::signals_bytes(c.R));
  // The shapes the barrier exchanges: [2][R] from the sources, [2] its own.
  EXPECT_EQ(HtNetRegion::shapes(c.R), HtNetRegion::kSignals + HtNetRegion::signals_bytes(c.R));
  EXPECT_GE(body, HtNetRegion::shapes(c.R) + HtNetRegion::kShapeBytes * (2u * c.R + 2u));
  EXPECT_GE(HtNetRegion::kSignals, HtNetRegion::kDone + 4u * HtNetRegion::kDoneWords);
  EXPECT_EQ(d.slot_rows, most_node);
  EXPECT_EQ(d.recv, body);
  EXPECT_GE(d.send, d.recv + N * d.slot_bytes());
  EXPECT_GE(d.stage, d.send + N * d.slot_bytes());
  EXPECT_GE(d.total, d.stage + rec * most_recv);
  for (std::size_t off : {d.recv, d.send, d.stage, d.total}) EXPECT_EQ(off % 128, 0u);

  const std::size_t row = epx::plan::ht_combine_row_bytes(7168, 8);
  const HtNetRegion k = HtNetRegion::combine(route, row);
  EXPECT_EQ(k.stage, body);
  EXPECT_GE(k.send, k.stage + static_cast<std::size_t>(c.L) * N * k.slot_bytes());
  EXPECT_GE(k.recv, k.send + N * k.slot_bytes());
  EXPECT_GE(k.total, k.recv + N * k.slot_bytes());
  // Equal counts, equal regions: what every rank computes.
  const InternodeRoute again(r.counts);
  EXPECT_EQ(HtNetRegion::dispatch(again, rec).total, d.total);
  EXPECT_EQ(HtNetRegion::combine(again, row).total, k.total);
}

// Buffer::get_internode_nvl_size_hint: bad arguments named before any
// arithmetic, and a hint that holds the worst-case regions of both ops.
TEST(InternodeRoute, SizeHintNamesBadArgumentsAndHoldsTheWorstCase) {
  auto code_and_text = [](auto fn) -> std::pair<epx::ErrorCode, std::string> {
    try {
      fn();
    } catch (const epx::Error& e) {
      return {e.code(), e.what()};
    }
    return {epx::ErrorCode::kInternal, ""};
  };
  const struct {
    int tokens, hidden, ranks, rpn, topk;
    const char* names;
  } bad[] = {{-1, 7168, 4, 2, 8, "num_max_tokens"},
             {128, 7, 4, 2, 8, "hidden"},
             {128, 0, 4, 2, 8, "hidden"},
             {128, 7168, 0, 1, 8, "num_ranks"},
             {128, 7168, 4, 3, 8, "ranks_per_node"},
             {128, 7168, 18, 9, 8, "ranks_per_node"},
             {128, 7168, 4, 2, 17, "num_topk"}};
  for (const auto& b : bad) {
    const auto [code, text] = code_and_text([&] {
      epx::Buffer::get_internode_nvl_size_hint(b.tokens, b.hidden, b.ranks, b.rpn, b.topk);
    });
    EXPECT_EQ(code, epx::ErrorCode::kInvalidArgument) << b.names << ": " << text;
    EXPECT_NE(text.find(b.names), std::string::npos) << text;
  }
  const std::size_t hint = epx::Buffer::get_internode_nvl_size_hint(4096, 7168, 16, 4, 8);
  epx::plan::InternodeCounts all{epx::Topology{16, 4}, std::vector<int>(16 * 16, 4096),
                                 std::vector<int>(16 * 4, 4096)};
  const InternodeRoute route(all);
  EXPECT_GE(hint, epx::plan::HtNetRegion::dispatch(
                      route, epx::plan::ht_net_record_bytes(2 * 7168, 0, 8, 4))
                      .total);
  EXPECT_GE(hint,
            epx::plan::HtNetRegion::combine(route, epx::plan::ht_combine_row_bytes(7168, 8)).total);
  // FP8 rows with per-128 scales are smaller than the BF16 ones the hint sizes for.
  EXPECT_LT(epx::plan::ht_net_record_bytes(7168, 56, 8, 4),
            epx::plan::ht_net_record_bytes(2 * 7168, 0, 8, 4));
  EXPECT_LT(epx::Buffer::get_internode_nvl_size_hint(1024, 7168, 16, 4, 8), hint);
}

// The barrier's report of a differing shape names the op, the argument, both
// ranks and both values (channel = kInternodeShapeFields * op + field, kernels::HtNetShape).
TEST(InternodeShape, MismatchMessageNamesArgumentAndRanks) {
  constexpr int F = epx::kInternodeShapeFields;
  auto has = [](const std::string& m, std::initializer_list<const char*> parts) {
    for (const char* p : parts) EXPECT_NE(m.find(p), std::string::npos) << p << " in: " << m;
  };
  has(epx::internode_shape_message(F + 1, 0, 3, 14336, 7168),
      {"dispatch", "x (hidden bytes)", "rank 3 passed 7168", "rank 0 14336"});
  has(epx::internode_shape_message(F + 2, 2, 1, 56, 0),
      {"dispatch", "x_scales", "rank 1 passed 0", "rank 2 56"});
  has(epx::internode_shape_message(F + 3, 1, 0, 0, 8), {"dispatch", "topk_idx"});
  has(epx::internode_shape_message(2 * F + 1, 0, 1, 7168, 4096), {"combine", "x (hidden)"});
  has(epx::internode_shape_message(2 * F + 2, 0, 1, 8, 0),
      {"combine", "topk_weights (top-k)", "rank 1 passed 0", "rank 0 8"});
  has(epx::internode_shape_message(F + 0, 0, 5, 1, 2),
      {"rank 0 called dispatch", "rank 5 called combine", "same op"});
  has(epx::internode_shape_message(F + 4, 0, 1, 4096, 2048),
      {"num_worst_tokens", "rank 1 passed 2048", "rank 0 4096"});
  has(epx::internode_shape_message(F + 5, 2, 2, 1, 0), {"num_nvl_bytes", "rank 2", "slot"});
  has(epx::internode_shape_message(F + 5, 0, 3, 1, 0), {"num_nvl_bytes", "rank 3"});
  has(epx::internode_shape_message(F + 6, 0, 3, 0, 1),
      {"num_tokens_per_rank", "rank 3", "is_token_in_rank"});
  has(epx::internode_shape_message(F + 7, 0, 2, 12345, 678),
      {"dispatch", "EPX_HT_RINGS", "rank 2", "rank 0", "config.num_sms", "num_nvl_bytes"});
}

// num_worst_tokens: the areas are fixed by the buffer. The slots take the
// most rows that let both the dispatch (stage of `worst` rows, the count
// rows after it) and its combine fit; every area in bounds and aligned; a
// buffer too small for one row per slot gives 0 rows (the host refuses it).
TEST(InternodeRoute, FixedRegionsFitTheBuffer) {
  using epx::plan::HtNetRegion;
  struct Case {
    int R, L, worst, hidden, topk;
    std::size_t capacity;
  };
  for (const Case c : {Case{4, 2, 512, 512, 4, std::size_t{8} << 20},
                       Case{16, 4, 4096, 7168, 8, std::size_t{1} << 30},
                       Case{8, 8, 1024, 2048, 8, std::size_t{64} << 20},
                       Case{32, 8, 128 * 32, 7168, 8, std::size_t{2} << 30}}) {
    const epx::Topology t{c.R, c.L};
    const int N = c.R / c.L;
    const std::size_t rec = epx::plan::ht_net_record_bytes(2u * c.hidden, 0, c.topk, c.L);
    const std::size_t row = epx::plan::ht_combine_row_bytes(c.hidden, c.topk);
    const int S = HtNetRegion::fixed_slot_rows(t, c.worst, rec, row, c.capacity);
    ASSERT_GT(S, 0) << c.R << "x" << c.L;
    const HtNetRegion d = HtNetRegion::fixed_dispatch(t, c.worst, rec, S);
    const HtNetRegion k = HtNetRegion::fixed_combine(t, S, row);
    EXPECT_LE(d.total, c.capacity);
    EXPECT_LE(k.total, c.capacity);
    EXPECT_EQ(d.slot_rows, S);
    EXPECT_EQ(d.stage_rows, c.worst);
    EXPECT_EQ(d.recv, HtNetRegion::body(c.R));
    EXPECT_GE(d.send, d.recv + static_cast<std::size_t>(N) * d.slot_bytes());
    EXPECT_GE(d.stage, d.send + static_cast<std::size_t>(N) * d.slot_bytes());
    EXPECT_GE(d.count_rows, d.stage + rec * c.worst);
    EXPECT_EQ(d.count_ints, HtNetRegion::count_row_ints(c.R, N));
    EXPECT_GE(d.total, d.count_rows + 4u * d.count_ints * (c.R + 1u));
    for (std::size_t off :
         {d.recv, d.send, d.stage, d.count_rows, d.total, k.stage, k.send, k.recv, k.total})
      EXPECT_EQ(off % 128, 0u);
    // One more row per slot would not fit one of the two.
    const HtNetRegion d1 = HtNetRegion::fixed_dispatch(t, c.worst, rec, S + 1);
    const HtNetRegion k1 = HtNetRegion::fixed_combine(t, S + 1, row);
    EXPECT_TRUE(d1.total + 4 * 128 > c.capacity || k1.total + 4 * 128 > c.capacity)
        << "slots could hold more rows: " << S;
    // A cached dispatch with smaller rows keeps the slots and fits too.
    const std::size_t small = epx::plan::ht_net_record_bytes(2u * c.hidden, 0, 0, c.L);
    EXPECT_LE(HtNetRegion::fixed_dispatch(t, c.worst, small, S).total, c.capacity);
  }
  const epx::Topology t{4, 2};
  const std::size_t rec = epx::plan::ht_net_record_bytes(14336, 0, 8, 2);
  EXPECT_EQ(HtNetRegion::fixed_slot_rows(t, 4096, rec, epx::plan::ht_combine_row_bytes(7168, 8),
                                         std::size_t{1} << 20),
            0)
      << "a stage of 4096 rows of 14 KB does not fit 1 MiB";
}
