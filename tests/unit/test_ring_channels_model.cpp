// A host model of the ring protocol docs/internode_ht.md plans in "The
// rings, concretely", one step past test_ring_model.cpp:
// - channels: each source's tokens split into C contiguous ranges, each
//   with its own rings end to end (no ring has two producers);
// - counts instead of end marks: every role knows how many records it
//   produces or consumes per ring in an op (plan::ChannelRoute, from the
//   per-channel counts the exchange will hand it), and stops there;
// - counters that run on across ops: several ops back to back on the same
//   rings, never reset, each rank's roles in step per op (one kernel launch
//   per op in stream order) while other ranks may be an op ahead;
// - credits returned in batches: the forwarder frees network slots when a
//   batch is full or when nothing more is waiting in that ring.
// The batched mode follows the ring kernel as built (internode/ring_dispatch.cuh):
// a sender serves the nodes in turns, each turn one put of `chunk` records
// (or the node's rest) written in batches of up to `batch` (one per warp),
// and passes over a node whose ring lacks room for a whole put; a forwarder takes batches of up to
// `batch` records from an input, waits once per local ring for the batch's records there
// (publishing that ring's tail first), publishes a ring's tail every
// `nvl_chunk` records, and frees credits every `chunk` records and after
// each pass over an input.
// Every role is a thread (a block of the cooperative kernel on the GPU) and
// every wait has a deadline. Checked: each receiver gets exactly the
// (source, token) pairs routed to it in each op, each (channel, source)'s in
// token order; and that freeing credits only in full batches deadlocks when
// the batch exceeds what the ring can hold.
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

#include "common/internode_channels.hpp"
#include "common/internode_route.hpp"
#include "common/ring.hpp"
#include "unit/ring_model.hpp"

namespace {

using epx::test_ring::clock_type;

struct Record {
  int op = -1, src = -1, token = -1;
  uint32_t mask = 0;  ///< local ranks of the ring's node that the token reaches
};

/// The forwarders read ahead of what they free (Ring::read, then head).
using Ring = epx::test_ring::Ring<Record>;

struct ChannelModel : epx::test_ring::Deadline {
  int N, L, R, C, ops;
  uint32_t chunk = 1;          ///< records per sender put (at most the ring's size)
  uint32_t credit_batch = 1;   ///< slots a forwarder frees at once
  bool free_when_idle = true;  ///< also free a partial batch when the ring has nothing waiting
  bool batched = false;        ///< the ring kernel's batches (sender_batched, forwarder_batched)
  uint32_t batch = 16;         ///< batched: records per batch at most (a warp each)
  uint32_t nvl_chunk = 8;      ///< batched: records between a forwarder's tail stores
  /// batched: a forwarder's pause before each batch, so that senders find
  /// their rings full (the waits the kernel's flush-then-wait rule is for)
  std::chrono::microseconds forwarder_pause{0};
  /// [op][rank]: the bits of the ranks each token reaches (bit r: rank r).
  std::vector<std::vector<std::vector<uint32_t>>> route;
  std::vector<std::unique_ptr<Ring>> net;  ///< [(c * R + s) * N + m]: channel c of s to node m
  std::vector<std::unique_ptr<Ring>> nvl;  ///< [(c * R + f) * L + d]: channel c of f to local d
  std::vector<std::vector<std::vector<Record>>> got;        ///< [op][receiver], arrival order
  std::vector<std::unique_ptr<std::atomic<int>>> finished;  ///< [rank * ops + op]: roles done

  ChannelModel(int n, int l, int c, int num_ops, uint32_t cap_net, uint32_t cap_nvl)
      : N(n), L(l), R(n * l), C(c), ops(num_ops), route(num_ops) {
    for (int i = 0; i < C * R * N; ++i) net.push_back(std::make_unique<Ring>(cap_net));
    for (int i = 0; i < C * R * L; ++i) nvl.push_back(std::make_unique<Ring>(cap_nvl));
    got.assign(ops, std::vector<std::vector<Record>>(R));
    for (int i = 0; i < R * ops; ++i) finished.push_back(std::make_unique<std::atomic<int>>(0));
  }

  /// [op]: the counts every role reads, as the kernel will: plan::ChannelRoute
  /// from the per-channel counts of the op's routing (prepare()).
  std::vector<std::unique_ptr<epx::plan::InternodeRoute>> whole;
  std::vector<std::unique_ptr<epx::plan::ChannelRoute>> channel_route;

  /// Builds each op's channel route from `route`; call once the routing is set.
  void prepare() {
    const epx::Topology topo{R, L};
    whole.clear();
    channel_route.clear();
    for (int op = 0; op < ops; ++op) {
      epx::plan::InternodeCounts w;
      w.topology = topo;
      w.tokens_to_rank.assign(static_cast<std::size_t>(R) * R, 0);
      w.tokens_to_node.assign(static_cast<std::size_t>(R) * N, 0);
      epx::plan::ChannelCounts cc;
      cc.channels = C;
      for (int s = 0; s < R; ++s) {
        std::vector<uint64_t> masks(route[op][s].begin(), route[op][s].end());
        for (uint64_t bits : masks) {
          for (int d = 0; d < R; ++d)
            w.tokens_to_rank[static_cast<std::size_t>(s) * R + d] += (bits >> d) & 1u;
          for (int m = 0; m < N; ++m)
            w.tokens_to_node[static_cast<std::size_t>(s) * N + m] +=
                node_mask(static_cast<uint32_t>(bits), m) != 0;
        }
        epx::plan::append_channel_counts(topo, masks, cc);
      }
      whole.push_back(std::make_unique<epx::plan::InternodeRoute>(std::move(w)));
      channel_route.push_back(
          std::make_unique<epx::plan::ChannelRoute>(*whole.back(), std::move(cc)));
    }
  }

  int tokens(int op, int s) const { return static_cast<int>(route[op][s].size()); }
  /// Channel c's tokens of source s in op `op`: [first, last).
  std::pair<int, int> range(int op, int s, int c) const {
    const epx::plan::ChannelSplit split{tokens(op, s), C};
    return {split.first(c), split.end(c)};
  }
  uint32_t node_mask(uint32_t bits, int m) const { return (bits >> (m * L)) & ((1u << L) - 1u); }
  /// Records of channel c of source s for node m (what the forwarder expects).
  uint32_t net_count(int op, int s, int c, int m) const {
    return static_cast<uint32_t>(channel_route[op]->node_records(s, c, m));
  }
  /// Records forwarder f passes on channel c to its node's local rank d.
  uint32_t nvl_count(int op, int f, int c, int d) const {
    return static_cast<uint32_t>(channel_route[op]->forwarded_records(f, c, d));
  }

  static bool try_read(Ring& q, Record& r) {
    if (epx::ring::used(q.tail.load(std::memory_order_acquire), q.read) == 0) return false;
    r = q.slots[epx::ring::slot(q.read, q.cap)];
    ++q.read;
    return true;
  }
  static bool waiting(const Ring& q) {
    return epx::ring::used(q.tail.load(std::memory_order_acquire), q.read) != 0;
  }
  static void free_read(Ring& q) { q.head.store(q.read, std::memory_order_release); }

  /// The end of this role's op on `rank`; then the rank's next op may start
  /// once all its 3 C roles got here (the next kernel in stream order).
  bool end_op(int rank, int op) {
    std::atomic<int>& f = *finished[rank * ops + op];
    f.fetch_add(1);
    return wait([&] { return f.load() == 3 * C; });
  }

  void sender(int s, int c) {
    for (int op = 0; op < ops; ++op) {
      const auto [a, b] = range(op, s, c);
      std::vector<std::vector<Record>> out(N);
      const uint32_t most = std::min(chunk, net[0]->cap);
      for (int t = a; t < b; ++t)
        for (int m = 0; m < N; ++m) {
          const uint32_t mask = node_mask(route[op][s][t], m);
          if (mask == 0) continue;
          out[m].push_back({op, s, t, mask});
          if (out[m].size() == most) {
            if (!push_chunk(*net[(c * R + s) * N + m], out[m])) return;
            out[m].clear();
          }
        }
      for (int m = 0; m < N; ++m)
        if (!push_chunk(*net[(c * R + s) * N + m], out[m])) return;
      if (!end_op(s, op)) return;
    }
  }

  /// The ring kernel's sender (ring_send): nodes in turns, a turn one put
  /// of `chunk` records (or the node's rest) written in batches and then
  /// put (the net ring's tail); a node whose ring lacks room for the whole
  /// put (its head: the forwarder's credits) is passed over, and a pass in
  /// which no node had room waits (idle()) and tries again.
  void sender_batched(int s, int c) {
    for (int op = 0; op < ops; ++op) {
      const auto [a, b] = range(op, s, c);
      std::vector<std::vector<Record>> recs(N);
      std::vector<std::size_t> next(N, 0);
      std::size_t total = 0;
      for (int m = 0; m < N; ++m) {
        for (int t = a; t < b; ++t)
          if (const uint32_t mask = node_mask(route[op][s][t], m))
            recs[m].push_back({op, s, t, mask});
        total += recs[m].size();
      }
      while (total > 0) {
        bool any = false;
        for (int m = 0; m < N; ++m) {
          if (next[m] == recs[m].size()) continue;
          Ring& q = *net[(c * R + s) * N + m];
          const uint32_t sent = q.tail.load(std::memory_order_relaxed);
          const uint32_t want =
              std::min(static_cast<uint32_t>(recs[m].size() - next[m]), std::min(chunk, q.cap));
          if (!epx::ring::room_for(sent, q.head.load(std::memory_order_acquire), want, q.cap))
            continue;
          for (uint32_t done = 0; done < want;) {  // the kernel's batches, one record per warp
            const uint32_t k = std::min(batch, want - done);
            for (uint32_t i = 0; i < k; ++i)
              q.slots[epx::ring::slot(sent + done + i, q.cap)] = recs[m][next[m] + done + i];
            done += k;
          }
          q.tail.store(sent + want, std::memory_order_release);  // the put and its tail add
          next[m] += want;
          total -= want;
          any = true;
        }
        if (!any && !idle()) return;
      }
      if (!end_op(s, op)) return;
    }
  }

  /// The ring kernel's forwarder (ring_forward).
  void forwarder_batched(int f, int c) {
    const int m = f / L, l = f % L;
    std::vector<uint32_t> nvl_sent(L), nvl_pub(L);
    for (int d = 0; d < L; ++d)
      nvl_sent[d] = nvl_pub[d] = nvl[(c * R + f) * L + d]->tail.load(std::memory_order_relaxed);
    auto out = [&](int d) -> Ring& { return *nvl[(c * R + f) * L + d]; };
    auto publish = [&](int d) {
      out(d).tail.store(nvl_sent[d], std::memory_order_release);
      nvl_pub[d] = nvl_sent[d];
    };
    for (int op = 0; op < ops; ++op) {
      std::vector<uint32_t> left(N), freed(N);
      uint32_t total = 0;
      auto input = [&](int src_node) -> Ring& { return *net[(c * R + src_node * L + l) * N + m]; };
      for (int src_node = 0; src_node < N; ++src_node) {
        total += left[src_node] = net_count(op, src_node * L + l, c, m);
        freed[src_node] = input(src_node).read;
      }
      auto free_credits = [&](int src_node) {
        free_read(input(src_node));
        freed[src_node] = input(src_node).read;
      };
      const uint32_t batch_max = std::min(batch, out(0).cap);
      while (total > 0) {
        bool any = false;
        for (int src_node = 0; src_node < N; ++src_node) {
          if (left[src_node] == 0) continue;
          Ring& in = input(src_node);
          const uint32_t avail = std::min(
              epx::ring::used(in.tail.load(std::memory_order_acquire), in.read), left[src_node]);
          for (uint32_t done = 0; done < avail;) {
            const uint32_t k = std::min(batch_max, avail - done);
            if (forwarder_pause.count() > 0) std::this_thread::sleep_for(forwarder_pause);
            std::vector<Record> rs(k);
            std::vector<uint32_t> cnt(L, 0);
            for (uint32_t i = 0; i < k; ++i) {
              rs[i] = in.slots[epx::ring::slot(in.read + i, in.cap)];
              if (rs[i].op != op) {
                ADD_FAILURE() << "forwarder " << f << " channel " << c << " read op " << rs[i].op
                              << " in op " << op;
                stuck = true;
                return;
              }
              for (int d = 0; d < L; ++d) cnt[d] += (rs[i].mask >> d) & 1u;
            }
            for (int d = 0; d < L; ++d) {
              if (cnt[d] == 0) continue;
              Ring& q = out(d);
              if (!epx::ring::room_for(nvl_sent[d], q.head.load(std::memory_order_acquire), cnt[d],
                                       q.cap))
                publish(d);
              if (!wait([&] {
                    return epx::ring::room_for(nvl_sent[d], q.head.load(std::memory_order_acquire),
                                               cnt[d], q.cap);
                  }))
                return;
            }
            std::vector<uint32_t> off(L, 0);
            for (uint32_t i = 0; i < k; ++i)
              for (int d = 0; d < L; ++d)
                if ((rs[i].mask >> d) & 1u)
                  out(d).slots[epx::ring::slot(nvl_sent[d] + off[d]++, out(d).cap)] = rs[i];
            for (int d = 0; d < L; ++d) {
              nvl_sent[d] += cnt[d];
              if (nvl_sent[d] - nvl_pub[d] >= nvl_chunk) publish(d);
            }
            in.read += k;
            left[src_node] -= k;
            total -= k;
            if (in.read - freed[src_node] >= chunk) free_credits(src_node);
            done += k;
          }
          if (avail > 0) any = true;
          free_credits(src_node);  // nothing more waiting in this input now
          for (int d = 0; d < L; ++d) publish(d);
        }
        if (!any && !idle()) return;
      }
      for (int d = 0; d < L; ++d) publish(d);
      for (int src_node = 0; src_node < N; ++src_node) free_credits(src_node);
      if (!end_op(f, op)) return;
    }
  }

  void forwarder(int f, int c) {
    const int m = f / L, l = f % L;
    for (int op = 0; op < ops; ++op) {
      std::vector<uint32_t> left(N), unfreed(N, 0);
      uint32_t total = 0;
      for (int src_node = 0; src_node < N; ++src_node)
        total += left[src_node] = net_count(op, src_node * L + l, c, m);
      auto input = [&](int src_node) -> Ring& { return *net[(c * R + src_node * L + l) * N + m]; };
      while (total > 0) {
        bool any = false;
        for (int src_node = 0; src_node < N; ++src_node) {  // whichever input has a record
          Ring& in = input(src_node);
          Record r;
          if (left[src_node] == 0 || !try_read(in, r)) continue;
          any = true;
          if (r.op != op) {  // a record of another op would mean the counts are off
            ADD_FAILURE() << "forwarder " << f << " channel " << c << " read op " << r.op
                          << " in op " << op;
            stuck = true;
            return;
          }
          for (int d = 0; d < L; ++d)
            if (((r.mask >> d) & 1u) && !push_chunk(*nvl[(c * R + f) * L + d], {r})) return;
          --left[src_node];
          --total;
          if (++unfreed[src_node] >= credit_batch || left[src_node] == 0 ||
              (free_when_idle && !waiting(in))) {
            free_read(in);
            unfreed[src_node] = 0;
          }
        }
        if (!any && !idle()) return;
      }
      if (!end_op(f, op)) return;
    }
  }

  bool run(std::chrono::milliseconds limit) {
    deadline = clock_type::now() + limit;
    // The C receivers of a rank each write their own list (per_channel); merged below.
    std::vector<std::thread> th;
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        th.emplace_back([this, r, c] { batched ? sender_batched(r, c) : sender(r, c); });
        th.emplace_back([this, r, c] { batched ? forwarder_batched(r, c) : forwarder(r, c); });
        th.emplace_back([this, r, c] { receiver_into(r, c); });
      }
    for (auto& t : th) t.join();
    for (int op = 0; op < ops; ++op)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          for (const Record& rec : per_channel[(op * R + r) * C + c]) got[op][r].push_back(rec);
    return !stuck.load();
  }

  /// The receiver of channel c, keeping its records apart from the other
  /// channels' (one writer per list); run() merges them.
  std::vector<std::vector<Record>> per_channel;
  void receiver_into(int r, int c) {
    const int m = r / L, d = r % L;
    for (int op = 0; op < ops; ++op) {
      std::vector<uint32_t> left(L);
      uint32_t total = 0;
      for (int l = 0; l < L; ++l) total += left[l] = nvl_count(op, m * L + l, c, d);
      auto& mine = per_channel[(op * R + r) * C + c];
      while (total > 0) {
        bool any = false;
        for (int l = 0; l < L; ++l) {
          Ring& in = *nvl[(c * R + m * L + l) * L + d];
          Record rec;
          if (left[l] == 0 || !try_read(in, rec)) continue;
          free_read(in);
          any = true;
          --left[l];
          --total;
          mine.push_back(rec);
        }
        if (!any && !idle()) return;
      }
      if (!end_op(r, op)) return;
    }
  }
};

/// Random routing: per op and rank 0 to `max_tokens` tokens, each reaching
/// 0 to 4 ranks.
void random_routing(ChannelModel& md, int max_tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int op = 0; op < md.ops; ++op) {
    md.route[op].resize(md.R);
    for (int s = 0; s < md.R; ++s) {
      md.route[op][s].resize(rng() % (max_tokens + 1));
      for (auto& bits : md.route[op][s]) {
        bits = 0;
        for (int k = static_cast<int>(rng() % 5); k > 0; --k) bits |= 1u << (rng() % md.R);
      }
    }
  }
  md.per_channel.assign(static_cast<std::size_t>(md.ops) * md.R * md.C, {});
  md.prepare();
}

/// Each receiver got exactly its (source, token) pairs in each op, and each
/// (channel, source)'s in token order (a ring keeps its producer's order).
void check_delivery(const ChannelModel& md) {
  for (int op = 0; op < md.ops; ++op)
    for (int r = 0; r < md.R; ++r) {
      for (int c = 0; c < md.C; ++c) {
        std::vector<int> last(md.R, -1);
        for (const Record& rec : md.per_channel[(op * md.R + r) * md.C + c]) {
          EXPECT_GT(rec.token, last[rec.src]) << "op " << op << " receiver " << r << " channel "
                                              << c << " source " << rec.src << ": out of order";
          last[rec.src] = rec.token;
        }
      }
      std::vector<std::vector<int>> per_src(md.R);
      for (const Record& rec : md.got[op][r]) {
        EXPECT_EQ(rec.op, op);
        per_src[rec.src].push_back(rec.token);
      }
      for (int s = 0; s < md.R; ++s) {
        std::sort(per_src[s].begin(), per_src[s].end());
        std::vector<int> want;
        for (int t = 0; t < md.tokens(op, s); ++t)
          if ((md.route[op][s][t] >> r) & 1u) want.push_back(t);
        EXPECT_EQ(per_src[s], want) << "op " << op << ", receiver " << r << ", source " << s;
      }
    }
}

TEST(RingChannelsModel, ChannelsCountsAndRunningCountersOverSeveralOps) {
  struct Case {
    int N, L, C, ops, max_tokens;
    uint32_t cap_net, cap_nvl, chunk, batch;
  };
  for (const Case& c : {Case{2, 1, 3, 4, 40, 1, 1, 1, 1}, Case{2, 2, 2, 3, 60, 3, 2, 2, 2},
                        Case{3, 2, 2, 3, 40, 4, 1, 3, 4}, Case{2, 2, 1, 5, 30, 2, 2, 2, 1},
                        Case{4, 1, 2, 3, 30, 5, 3, 4, 3}}) {
    SCOPED_TRACE("N=" + std::to_string(c.N) + " L=" + std::to_string(c.L) +
                 " C=" + std::to_string(c.C) + " chunk=" + std::to_string(c.chunk) +
                 " batch=" + std::to_string(c.batch));
    ChannelModel md(c.N, c.L, c.C, c.ops, c.cap_net, c.cap_nvl);
    md.chunk = c.chunk;
    md.credit_batch = c.batch;
    random_routing(md, c.max_tokens, static_cast<uint32_t>(c.N * 1000 + c.L * 100 + c.C));
    ASSERT_TRUE(md.run(std::chrono::seconds(30))) << "a role waited past the deadline";
    check_delivery(md);
  }
}

TEST(RingChannelsModel, CreditsFreedOnlyInFullBatchesLargerThanTheRingDeadlock) {
  // 2 nodes of 1, one channel, every token to both ranks; network rings of 2
  // slots and credits freed only per 3 records: the sender waits for room
  // the forwarder never frees (it waits for a third record first).
  auto make = [](bool free_when_idle) {
    auto md = std::make_unique<ChannelModel>(2, 1, 1, 1, 2, 4);
    md->route[0].assign(2, std::vector<uint32_t>(6, 0b11u));
    md->per_channel.assign(2, {});
    md->prepare();
    md->chunk = 1;
    md->credit_batch = 3;
    md->free_when_idle = free_when_idle;
    return md;
  };
  EXPECT_FALSE(make(false)->run(std::chrono::milliseconds(500)));
  // Freeing what was read whenever the ring has nothing more waiting goes through.
  auto ok = make(true);
  ASSERT_TRUE(ok->run(std::chrono::seconds(20)));
  check_delivery(*ok);
}

/// The ring kernel's batched protocol: rings as small as the GPU suite's (4
/// records, batches cut to 4), chunks that are not a multiple of the batch,
/// NVLink rings smaller than a batch, and the default geometry's proportions
/// (48 records per put in rings of 64, batches of 16), over several ops.
TEST(RingChannelsModel, TheKernelsBatchedProtocol) {
  struct Case {
    int N, L, C, ops, max_tokens;
    uint32_t cap_net, cap_nvl, chunk, batch, nvl_chunk;
    int pause_us = 0;
  };
  for (const Case& c :
       {Case{2, 1, 2, 4, 60, 4, 4, 4, 16, 4}, Case{2, 2, 2, 3, 80, 4, 4, 4, 16, 4},
        Case{2, 2, 1, 3, 90, 8, 2, 5, 16, 8}, Case{3, 2, 2, 3, 70, 16, 8, 7, 4, 3},
        Case{2, 2, 1, 3, 200, 64, 64, 48, 16, 8}, Case{4, 1, 2, 3, 60, 6, 5, 6, 3, 2},
        Case{2, 1, 1, 4, 120, 6, 4, 6, 3, 2, 50}, Case{2, 1, 1, 4, 120, 9, 4, 9, 4, 2, 50},
        // the default put of half the ring (HtRingGeometry::of with record sizes)
        Case{2, 2, 2, 3, 300, 64, 64, 32, 16, 8}, Case{3, 1, 1, 3, 200, 16, 8, 8, 16, 8, 20}}) {
    SCOPED_TRACE("N=" + std::to_string(c.N) + " L=" + std::to_string(c.L) +
                 " C=" + std::to_string(c.C) + " net ring=" + std::to_string(c.cap_net) +
                 " nvl ring=" + std::to_string(c.cap_nvl) + " chunk=" + std::to_string(c.chunk) +
                 " batch=" + std::to_string(c.batch));
    ChannelModel md(c.N, c.L, c.C, c.ops, c.cap_net, c.cap_nvl);
    md.batched = true;
    md.chunk = c.chunk;
    md.batch = c.batch;
    md.nvl_chunk = c.nvl_chunk;
    md.forwarder_pause = std::chrono::microseconds(c.pause_us);
    random_routing(md, c.max_tokens, static_cast<uint32_t>(c.N * 7919 + c.cap_net * 31 + c.chunk));
    ASSERT_TRUE(md.run(std::chrono::seconds(30))) << "a role waited past the deadline";
    check_delivery(md);
  }
}

}  // namespace
