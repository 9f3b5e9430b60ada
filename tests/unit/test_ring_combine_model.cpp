// A host model of the combine rings (internode/ring_combine.cuh, "combine
// through the rings"; docs/internode_ht.md, "Combine rings, and where the
// ring time goes"), the protocol of ring_return, ring_combine_forward and
// ring_combine_finish with threads for blocks:
// - channels: each source's tokens split into C contiguous ranges
//   (plan::ChannelSplit), every role of channel c working on those only;
// - returner (every rank d): its rows of each source m L + l in channel c,
//   in token order, into return ring (c, d, m) at forwarder l of its node,
//   a batch at a time into whichever stream has room;
// - forwarder (rank n L + l): per source node m, the records it forwarded
//   from source m L + l in channel c, in order; a batch is the longest run
//   whose rows from every local rank in its mask are there and that fits the
//   source's network ring; the sum goes into that ring, put (the tail
//   published) every `chunk` records, at the stream's end, and whenever the
//   stream cannot move;
// - finisher (every source): its channel's tokens in order, each the sum of
//   the next record of each node it reached; credits returned every `chunk`
//   records and before it waits.
// Counts come from the routing (as the kernels read them from the handle),
// the counters run on over several ops, and every role's waits share a
// deadline. Checked: every token's sum over the ranks it reached arrives,
// each row matched to its own token; and that a finisher which returns
// credits only in batches larger than its ring deadlocks.
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
#include "common/ring.hpp"
#include "unit/ring_model.hpp"

namespace {

using epx::test_ring::clock_type;

/// A returned row (value: what rank `rank` returns for the token) or a
/// node's sum (value: the sum over its ranks).
struct Row {
  int op = -1, src = -1, token = -1;
  int64_t value = 0;
};
using Ring = epx::test_ring::Ring<Row>;

struct CombineModel : epx::test_ring::Deadline {
  int N, L, R, C, ops;
  uint32_t chunk = 1;         ///< records per forwarder put (at most the network ring's size)
  uint32_t batch = 16;        ///< records per batch at most (a warp each)
  uint32_t credit_batch = 0;  ///< finisher: 0 frees every `chunk`; else only in full batches
  bool free_before_wait = true;
  /// [op][s][t]: the ranks token t of source s reaches (bit r: rank r)
  std::vector<std::vector<std::vector<uint32_t>>> route;
  std::vector<std::unique_ptr<Ring>>
      ret;  ///< [((c R + f) L + d) N + m]: at f, from local d, node m's
  std::vector<std::unique_ptr<Ring>>
      net;  ///< [(c R + s) N + m]: at source s, from node m's forwarder
  std::vector<std::vector<std::vector<int64_t>>> result;    ///< [op][s][t]
  std::vector<std::unique_ptr<std::atomic<int>>> finished;  ///< [rank * ops + op]: roles done

  CombineModel(int n, int l, int c, int num_ops, uint32_t ret_cap, uint32_t net_cap)
      : N(n), L(l), R(n * l), C(c), ops(num_ops), route(num_ops), result(num_ops) {
    for (int i = 0; i < C * R * L * N; ++i) ret.push_back(std::make_unique<Ring>(ret_cap));
    for (int i = 0; i < C * R * N; ++i) net.push_back(std::make_unique<Ring>(net_cap));
    for (int i = 0; i < R * ops; ++i) finished.push_back(std::make_unique<std::atomic<int>>(0));
  }

  /// What rank d returns for token t of source s in op `op` (distinct per
  /// rank, so a row taken for the wrong token or rank changes the sum).
  static int64_t value(int op, int s, int t, int d) {
    return ((static_cast<int64_t>(op) * 131 + s) * 8191 + t) * 37 + d + 1;
  }
  int64_t expected(int op, int s, int t) const {
    int64_t v = 0;
    for (int d = 0; d < R; ++d)
      if ((route[op][s][t] >> d) & 1u) v += value(op, s, t, d);
    return v;
  }
  uint32_t node_mask(uint32_t bits, int m) const { return (bits >> (m * L)) & ((1u << L) - 1u); }
  std::pair<int, int> range(int op, int s, int c) const {
    const epx::plan::ChannelSplit split{static_cast<int>(route[op][s].size()), C};
    return {split.first(c), split.end(c)};
  }
  static uint32_t avail(const Ring& q) {
    return epx::ring::used(q.tail.load(std::memory_order_acquire), q.read);
  }
  bool check(const Row& r, int op, int src, int token, const char* who) {
    if (r.op == op && r.src == src && r.token == token) return true;
    ADD_FAILURE() << who << ": expected op " << op << " source " << src << " token " << token
                  << ", read op " << r.op << " source " << r.src << " token " << r.token;
    stuck = true;
    return false;
  }
  /// This role's op on `rank` is done; the rank's next op starts once all
  /// its 3 C roles got here (the next kernel in stream order).
  bool end_op(int rank, int op) {
    std::atomic<int>& f = *finished[rank * ops + op];
    f.fetch_add(1);
    return wait([&] { return f.load() == 3 * C; });
  }

  void returner(int d, int c) {
    const int n = d / L, dl = d % L, S = L * N;
    for (int op = 0; op < ops; ++op) {
      // Stream i = l N + m: rows of source m L + l for this rank, in token order
      std::vector<std::vector<Row>> rows(S);
      std::vector<std::size_t> next(S, 0);
      std::size_t total = 0;
      for (int i = 0; i < S; ++i) {
        const int src = (i % N) * L + i / N;
        const auto [a, b] = range(op, src, c);
        for (int t = a; t < b; ++t)
          if ((route[op][src][t] >> d) & 1u) rows[i].push_back({op, src, t, value(op, src, t, d)});
        total += rows[i].size();
      }
      auto ring_of = [&](int i) -> Ring& {
        const int f = n * L + i / N;
        return *ret[((c * R + f) * L + dl) * N + i % N];
      };
      while (total > 0) {
        bool moved = false;
        for (int i = 0; i < S; ++i) {
          if (next[i] == rows[i].size()) continue;
          Ring& q = ring_of(i);
          const uint32_t t = q.tail.load(std::memory_order_relaxed);
          const uint32_t room = q.cap - epx::ring::used(t, q.head.load(std::memory_order_acquire));
          const uint32_t k =
              std::min({room, batch, static_cast<uint32_t>(rows[i].size() - next[i])});
          if (k == 0) continue;
          for (uint32_t j = 0; j < k; ++j)
            q.slots[epx::ring::slot(t + j, q.cap)] = rows[i][next[i] + j];
          q.tail.store(t + k, std::memory_order_release);
          next[i] += k;
          total -= k;
          moved = true;
        }
        if (!moved && !idle()) return;
      }
      if (!end_op(d, op)) return;
    }
  }

  void forwarder(int f, int c) {
    const int n = f / L, l = f % L;
    for (int op = 0; op < ops; ++op) {
      struct Rec {
        int token;
        uint32_t mask;
      };
      std::vector<std::vector<Rec>> recs(N);
      std::vector<std::size_t> next(N, 0);
      std::vector<uint32_t> sent(N), pending(N);
      std::size_t total = 0;
      for (int m = 0; m < N; ++m) {
        const int src = m * L + l;
        const auto [a, b] = range(op, src, c);
        for (int t = a; t < b; ++t)
          if (const uint32_t mask = node_mask(route[op][src][t], n)) recs[m].push_back({t, mask});
        total += recs[m].size();
        sent[m] = pending[m] = net[(c * R + src) * N + n]->tail.load(std::memory_order_relaxed);
      }
      auto in = [&](int d, int m) -> Ring& { return *ret[((c * R + f) * L + d) * N + m]; };
      while (total > 0) {
        bool moved = false;
        for (int m = 0; m < N; ++m) {
          if (next[m] == recs[m].size()) continue;
          const int src = m * L + l;
          Ring& out = *net[(c * R + src) * N + n];
          // The longest run of records whose rows are all there
          const uint32_t k0 = std::min(batch, static_cast<uint32_t>(recs[m].size() - next[m]));
          std::vector<uint32_t> have(L), cnt(L, 0);
          for (int d = 0; d < L; ++d) have[d] = avail(in(d, m));
          uint32_t k = 0;
          for (; k < k0; ++k) {
            const uint32_t mask = recs[m][next[m] + k].mask;
            bool ok = true;
            for (int d = 0; d < L; ++d)
              if (((mask >> d) & 1u) && cnt[d] >= have[d]) ok = false;
            if (!ok) break;
            for (int d = 0; d < L; ++d) cnt[d] += (mask >> d) & 1u;
          }
          // ... that fits the source's ring, and no put past `chunk`
          const uint32_t room =
              out.cap - epx::ring::used(sent[m], out.head.load(std::memory_order_acquire));
          const uint32_t cut = std::min({k, room, chunk - (sent[m] - pending[m])});
          if (cut > 0) {
            for (uint32_t i = 0; i < cut; ++i) {
              const Rec& r = recs[m][next[m] + i];
              int64_t sum = 0;
              for (int d = 0; d < L; ++d) {
                if (!((r.mask >> d) & 1u)) continue;
                Ring& q = in(d, m);
                const Row& row = q.slots[epx::ring::slot(q.read, q.cap)];
                if (!check(row, op, src, r.token, "forwarder")) return;
                sum += row.value;
                ++q.read;
              }
              out.slots[epx::ring::slot(sent[m] + i, out.cap)] = {op, src, r.token, sum};
            }
            for (int d = 0; d < L; ++d)  // every row read: the returners may reuse the slots
              in(d, m).head.store(in(d, m).read, std::memory_order_release);
            sent[m] += cut;
            next[m] += cut;
            total -= cut;
            moved = true;
          }
          // A full put, the stream's end, or a stream that cannot move: put it
          if (sent[m] - pending[m] >= chunk || next[m] == recs[m].size() || cut == 0) {
            out.tail.store(sent[m], std::memory_order_release);
            pending[m] = sent[m];
          }
        }
        if (!moved && !idle()) return;
      }
      if (!end_op(f, op)) return;
    }
  }

  void finisher(int s, int c) {
    for (int op = 0; op < ops; ++op) {
      const auto [a, b] = range(op, s, c);
      auto in = [&](int m) -> Ring& { return *net[(c * R + s) * N + m]; };
      std::vector<uint32_t> freed(N);
      for (int m = 0; m < N; ++m) freed[m] = in(m).read;
      auto free_credits = [&](int m, uint32_t at_least) {
        Ring& q = in(m);
        if (q.read - freed[m] >= std::max(at_least, 1u)) {
          q.head.store(q.read, std::memory_order_release);
          freed[m] = q.read;
        }
      };
      const uint32_t every = credit_batch > 0 ? credit_batch : chunk;
      for (int tok = a; tok < b;) {
        const uint32_t k0 = std::min(batch, static_cast<uint32_t>(b - tok));
        std::vector<uint32_t> have(N), cnt(N, 0);
        for (int m = 0; m < N; ++m) have[m] = avail(in(m));
        uint32_t k = 0;
        for (; k < k0; ++k) {
          const uint32_t bits = route[op][s][tok + k];
          bool ok = true;
          for (int m = 0; m < N; ++m)
            if (node_mask(bits, m) != 0 && cnt[m] >= have[m]) ok = false;
          if (!ok) break;
          for (int m = 0; m < N; ++m) cnt[m] += node_mask(bits, m) != 0;
        }
        if (k == 0) {
          // Waiting: every slot read goes back first (unless the negative
          // case holds them), then the deadline
          if (free_before_wait)
            for (int m = 0; m < N; ++m) free_credits(m, 1);
          if (!idle()) return;
          continue;
        }
        for (uint32_t i = 0; i < k; ++i) {
          const int t = tok + static_cast<int>(i);
          int64_t sum = 0;
          for (int m = 0; m < N; ++m) {
            if (node_mask(route[op][s][t], m) == 0) continue;
            Ring& q = in(m);
            const Row& row = q.slots[epx::ring::slot(q.read, q.cap)];
            if (!check(row, op, s, t, "finisher")) return;
            sum += row.value;
            ++q.read;
          }
          result[op][s][t] = sum;
        }
        for (int m = 0; m < N; ++m) free_credits(m, every);
        tok += static_cast<int>(k);
      }
      for (int m = 0; m < N; ++m) free_credits(m, 1);
      if (!end_op(s, op)) return;
    }
  }

  /// Runs every role until the ops are done or the deadline; true if done.
  bool run(std::chrono::milliseconds limit) {
    deadline = clock_type::now() + limit;
    for (int op = 0; op < ops; ++op) {
      result[op].assign(R, {});
      for (int s = 0; s < R; ++s) result[op][s].assign(route[op][s].size(), -1);
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        threads.emplace_back([this, r, c] { returner(r, c); });
        threads.emplace_back([this, r, c] { forwarder(r, c); });
        threads.emplace_back([this, r, c] { finisher(r, c); });
      }
    for (auto& t : threads) t.join();
    return !stuck.load();
  }
};

/// Random routing: each source 0 to `most` tokens, a token reaching each
/// rank with probability `p` (some reach none, some sources send nothing).
void random_route(CombineModel& m, int most, double p, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> count(0, most);
  std::bernoulli_distribution hit(p);
  for (int op = 0; op < m.ops; ++op) {
    m.route[op].assign(m.R, {});
    for (int s = 0; s < m.R; ++s) {
      const int T = s == 1 ? 0 : count(rng);  // rank 1 sends nothing
      for (int t = 0; t < T; ++t) {
        uint32_t bits = 0;
        for (int d = 0; d < m.R; ++d)
          if (hit(rng)) bits |= 1u << d;
        m.route[op][s].push_back(bits);
      }
    }
  }
}

TEST(RingCombineModel, EveryTokensSumArrivesOverSeveralOps) {
  struct Case {
    int N, L, C;
    uint32_t ret_cap, net_cap, chunk, batch;
    double p;
  };
  // Tiny rings (1 record) force every wait; chunks up to the ring's size.
  for (const Case& k : {Case{2, 2, 2, 1, 4, 2, 16, 0.4}, Case{2, 2, 3, 2, 8, 3, 4, 0.5},
                        Case{3, 2, 2, 1, 2, 1, 16, 0.3}, Case{4, 2, 3, 3, 6, 4, 2, 0.25},
                        Case{2, 4, 2, 1, 3, 2, 3, 0.3}, Case{4, 1, 2, 1, 1, 1, 16, 0.6},
                        Case{2, 1, 1, 5, 7, 7, 16, 0.9}}) {
    CombineModel m(k.N, k.L, k.C, 3, k.ret_cap, k.net_cap);
    m.chunk = k.chunk;
    m.batch = k.batch;
    random_route(m, 40, k.p, static_cast<uint32_t>(k.N * 100 + k.L * 10 + k.C));
    const std::string at = "N" + std::to_string(k.N) + " L" + std::to_string(k.L) + " C" +
                           std::to_string(k.C) + " rings " + std::to_string(k.ret_cap) + "/" +
                           std::to_string(k.net_cap) + " chunk " + std::to_string(k.chunk);
    ASSERT_TRUE(m.run(std::chrono::seconds(20))) << "stuck: " << at;
    for (int op = 0; op < m.ops; ++op)
      for (int s = 0; s < m.R; ++s)
        for (std::size_t t = 0; t < m.route[op][s].size(); ++t)
          ASSERT_EQ(m.result[op][s][t], m.expected(op, s, static_cast<int>(t)))
              << at << ": op " << op << " source " << s << " token " << t;
  }
}

/// A finisher that gives slots back only in full batches larger than its
/// ring, not before it waits, holds the very slots the forwarder needs for
/// the record it waits for: stuck. (The kernel returns them before waiting.)
TEST(RingCombineModel, CreditsHeldWhileWaitingDeadlock) {
  CombineModel m(2, 1, 1, 1, 4, 2);
  m.chunk = 2;
  m.credit_batch = 3;  // more than the network ring's 2 records
  m.free_before_wait = false;
  m.route[0].assign(2, std::vector<uint32_t>(8, 0x3u));  // every token to both ranks (nodes)
  EXPECT_FALSE(m.run(std::chrono::milliseconds(500)));
  // The rule restores progress
  CombineModel ok(2, 1, 1, 1, 4, 2);
  ok.chunk = 2;
  ok.credit_batch = 3;
  ok.route[0].assign(2, std::vector<uint32_t>(8, 0x3u));
  ASSERT_TRUE(ok.run(std::chrono::seconds(10)));
  for (int s = 0; s < 2; ++s)
    for (int t = 0; t < 8; ++t) ASSERT_EQ(ok.result[0][s][t], ok.expected(0, s, t));
}

}  // namespace
