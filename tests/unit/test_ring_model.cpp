// A host model of the protocol the high-throughput rings across nodes need
// (docs/internode_ht.md, "Rings"), before any kernel has it: every rank runs
// a sender, a forwarder and a receiver at once (threads here, blocks of one
// kernel on the GPU). Sender s puts each token's record, once per node it
// reaches, into its ring to that node's rank with s's local index (the
// forwarder); the forwarder passes each record on to the ring of every local
// rank the token reaches (the receiver); every ring has credits (a producer
// waits for room, the consumer frees slots), with common/ring.hpp's
// arithmetic, and rings far smaller than the traffic so that they lap.
// Senders put chunks of records (a chunk waits for room for all of it and
// is written in pieces that do not wrap, as puts would be). Checked: every
// receiver gets exactly the (source, token) pairs routed to it, each
// source's in token order, and no role waits past a deadline.
// The rule the model shows: a forwarder must serve whichever input ring has
// a record (round robin); draining its inputs one after another deadlocks
// (two forwarders each waiting for the sender the other holds up).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/ring.hpp"
#include "unit/ring_model.hpp"

namespace {

using epx::test_ring::clock_type;

struct Record {
  int src = -1, token = -1;
  uint32_t mask = 0;  ///< local ranks of the ring's node that the token reaches
  bool end = false;   ///< the producer's last record
};

using Ring = epx::test_ring::Ring<Record>;

enum class Policy { kRoundRobin, kInOrder };

struct Model : epx::test_ring::Deadline {
  int N, L, R, T;
  std::vector<std::vector<uint32_t>> route;  ///< [rank][token]: bit r = rank r gets it
  std::vector<std::unique_ptr<Ring>> net;    ///< [s * N + m]: sender s to node m's forwarder
  std::vector<std::unique_ptr<Ring>> nvl;    ///< [f * L + d]: forwarder f to local rank d
  std::vector<std::vector<Record>> got;      ///< per receiver, in arrival order
  Policy policy = Policy::kRoundRobin;
  std::size_t chunk = 1;  ///< records per sender put
  /// kInOrder: forwarder f drains its inputs in this order of source nodes.
  std::vector<std::vector<int>> order;

  Model(int n, int l, int t, uint32_t cap_net, uint32_t cap_nvl)
      : N(n), L(l), R(n * l), T(t), route(R), got(R) {
    for (int i = 0; i < R * N; ++i) net.push_back(std::make_unique<Ring>(cap_net));
    for (int i = 0; i < R * L; ++i) nvl.push_back(std::make_unique<Ring>(cap_nvl));
  }

  bool push(Ring& q, const Record& r) { return push_chunk(q, {r}); }
  static bool try_pop(Ring& q, Record& r) {
    const uint32_t h = q.head.load(std::memory_order_relaxed);
    if (epx::ring::used(q.tail.load(std::memory_order_acquire), h) == 0) return false;
    r = q.slots[epx::ring::slot(h, q.cap)];
    q.head.store(h + 1, std::memory_order_release);
    return true;
  }

  /// Records go out in chunks of up to `chunk` per node (at most the
  /// ring's size), the last chunk carrying the end mark.
  void sender(int s) {
    std::vector<std::vector<Record>> out(N);
    const std::size_t most = std::min<std::size_t>(chunk, net[0]->cap);
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < N; ++m) {
        const uint32_t mask = (route[s][t] >> (m * L)) & ((1u << L) - 1u);
        if (mask == 0) continue;
        out[m].push_back({s, t, mask, false});
        if (out[m].size() == most) {
          if (!push_chunk(*net[s * N + m], out[m])) return;
          out[m].clear();
        }
      }
    for (int m = 0; m < N; ++m) {
      if (out[m].size() == most && !push_chunk(*net[s * N + m], out[m])) return;
      if (out[m].size() == most) out[m].clear();
      out[m].push_back({s, -1, 0, true});
      if (!push_chunk(*net[s * N + m], out[m])) return;
    }
  }

  bool forward(int f, const Record& r) {
    for (int d = 0; d < L; ++d)
      if (((r.mask >> d) & 1u) && !push(*nvl[f * L + d], r)) return false;
    return true;
  }
  void forwarder(int f) {
    const int m = f / L, l = f % L;
    auto input = [&](int src_node) -> Ring& { return *net[(src_node * L + l) * N + m]; };
    if (policy == Policy::kInOrder) {
      for (int src_node : order[f]) {
        Record r;
        for (bool ended = false; !ended;) {
          if (!wait([&] { return try_pop(input(src_node), r); })) return;
          ended = r.end;
          if (!ended && !forward(f, r)) return;
        }
      }
    } else {
      std::vector<bool> ended(N, false);
      for (int left = N; left > 0;) {
        bool any = false;
        for (int src_node = 0; src_node < N; ++src_node) {
          Record r;
          if (ended[src_node] || !try_pop(input(src_node), r)) continue;
          any = true;
          if (r.end) {
            ended[src_node] = true;
            --left;
          } else if (!forward(f, r)) {
            return;
          }
        }
        if (!any && !idle()) return;
      }
    }
    for (int d = 0; d < L; ++d)
      if (!push(*nvl[f * L + d], {-1, -1, 0, true})) return;
  }

  /// Serves every local forwarder's ring as records come.
  void receiver(int r) {
    const int m = r / L, d = r % L;
    std::vector<bool> ended(L, false);
    for (int left = L; left > 0;) {
      bool any = false;
      for (int l = 0; l < L; ++l) {
        Record rec;
        if (ended[l] || !try_pop(*nvl[(m * L + l) * L + d], rec)) continue;
        any = true;
        if (rec.end) {
          ended[l] = true;
          --left;
        } else {
          got[r].push_back(rec);
        }
      }
      if (!any && !idle()) return;
    }
  }

  /// Runs every role of every rank at once; false when the model got stuck.
  bool run(std::chrono::milliseconds limit) {
    deadline = clock_type::now() + limit;
    std::vector<std::thread> th;
    for (int r = 0; r < R; ++r) {
      th.emplace_back([this, r] { sender(r); });
      th.emplace_back([this, r] { forwarder(r); });
      th.emplace_back([this, r] { receiver(r); });
    }
    for (auto& t : th) t.join();
    return !stuck.load();
  }
};

/// Every receiver got exactly its (source, token) pairs, each source's in order.
void check_delivery(const Model& md) {
  for (int r = 0; r < md.R; ++r) {
    std::vector<std::vector<int>> per_src(md.R);
    for (const Record& rec : md.got[r]) per_src[rec.src].push_back(rec.token);
    for (int s = 0; s < md.R; ++s) {
      std::vector<int> want;
      for (int t = 0; t < md.T; ++t)
        if ((md.route[s][t] >> r) & 1u) want.push_back(t);
      EXPECT_EQ(per_src[s], want) << "receiver " << r << ", source " << s;
    }
  }
}

TEST(RingModel, RoundRobinForwardersDeliverEverythingThroughLappingRings) {
  struct Case {
    int N, L, T;
    uint32_t cap_net, cap_nvl;
    std::size_t chunk;
  };
  for (const Case& c :
       {Case{2, 1, 200, 1, 1, 1}, Case{2, 2, 150, 2, 1, 2}, Case{4, 2, 100, 3, 2, 2},
        Case{2, 4, 100, 4, 1, 3}, Case{3, 2, 120, 5, 3, 4}}) {
    SCOPED_TRACE("N=" + std::to_string(c.N) + " L=" + std::to_string(c.L) +
                 " chunk=" + std::to_string(c.chunk));
    Model md(c.N, c.L, c.T, c.cap_net, c.cap_nvl);
    md.chunk = c.chunk;
    std::mt19937 rng(static_cast<uint32_t>(c.N * 100 + c.L));
    for (int s = 0; s < md.R; ++s) {
      md.route[s].resize(c.T);
      for (int t = 0; t < c.T; ++t) {
        uint32_t m = 0;  // 0 to 4 ranks; some tokens go nowhere
        for (int k = static_cast<int>(rng() % 5); k > 0; --k) m |= 1u << (rng() % md.R);
        md.route[s][t] = m;
      }
    }
    ASSERT_TRUE(md.run(std::chrono::seconds(20))) << "a role waited past the deadline";
    check_delivery(md);
  }
}

TEST(RingModel, ForwardersDrainingInputsInTurnDeadlock) {
  // 2 nodes of 1; every token goes to both ranks; rings of one slot. The
  // forwarder of node 0 drains node 1's sender first, node 1's forwarder node
  // 0's: each sender fills its ring to the forwarder that is not reading it
  // and waits there, so neither forwarder's chosen input ever ends.
  Model md(2, 1, 4, 1, 1);
  for (int s = 0; s < 2; ++s) md.route[s].assign(4, 0b11u);
  md.policy = Policy::kInOrder;
  md.order = {{1, 0}, {0, 1}};
  EXPECT_FALSE(md.run(std::chrono::milliseconds(500)));
  // The same routing with round-robin forwarders goes through.
  Model ok(2, 1, 4, 1, 1);
  for (int s = 0; s < 2; ++s) ok.route[s].assign(4, 0b11u);
  ASSERT_TRUE(ok.run(std::chrono::seconds(20)));
  check_delivery(ok);
}

TEST(RingModel, Arithmetic) {
  namespace r = epx::ring;
  EXPECT_EQ(r::used(5, 3), 2u);
  EXPECT_EQ(r::used(2, 0xFFFFFFFEu), 4u);  // across the wrap
  EXPECT_TRUE(r::room_for(3, 0, 1, 4));
  EXPECT_FALSE(r::room_for(4, 0, 1, 4));
  EXPECT_TRUE(r::room_for(1, 0xFFFFFFFEu, 1, 4));   // 3 used
  EXPECT_FALSE(r::room_for(2, 0xFFFFFFFEu, 1, 4));  // 4 used
  EXPECT_FALSE(r::room_for(9, 0, 1, 4));            // over-full: no room, no wrap
  EXPECT_EQ(r::slot(7, 4), 3u);
  EXPECT_EQ(r::contiguous(6, 5, 4), 2u);  // slots 2 and 3, then the ring's end
  EXPECT_EQ(r::contiguous(4, 3, 4), 3u);
}

}  // namespace
