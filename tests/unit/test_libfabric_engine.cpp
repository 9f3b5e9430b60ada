// The libfabric proxy engine between forked processes on host memory, over
// tcp;ofi_rxm (127.0.0.1) and shm: the engine alone with random puts and
// signals (every byte checked, no signal before its data), the real Proxy
// threads and rings over it, reordered completions at the receiver, peers
// killed or stopped mid-op, and bad options. Each test forks its ranks before
// any libfabric call; the ranks' exchange is shared memory mapped before the
// fork (the engine only sees the Exchange interface).
//
// Faults through the Proxy (LibfabricProxyFaultTest, 3 ranks, 2 channels):
// a peer SIGKILLed or SIGSTOPped while the others wait inside an op for its
// signals, and a proxy thread that dies (stop_channel / stop_after). Every
// survivor must raise within a bound an epx::Error with the expected code
// whose message names the op, the rank and channel it awaited, and where the
// engine can tell (writes to the victim in flight: tcp's completion error,
// or the engine's write timeout) the engine's own error through the proxy
// channel that carried them; where it cannot (nothing in flight, or only the
// victim's proxy thread died) the wait's deadline names them. Then every
// surviving process destroys its Proxy and engine within a bound and forms a
// new group with a new engine + Proxy that moves every byte correctly.
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.hpp"
#include "transport/proxy/command.hpp"
#include "transport/proxy/libfabric_engine.hpp"
#include "transport/proxy/proxy.hpp"
#include "unit/forked_ranks.hpp"
#include "unit/libfabric_test_util.hpp"

namespace epx::proxy {
namespace {

using namespace lftest;  // NOLINT(build/namespaces): the shared test helpers

using forked::Clock;
using forked::since;

// ---- the immediate-data encoding -------------------------------------------------

TEST(LibfabricImm, RoundTripsKindSourceAndEpoch) {
  using namespace fabric_imm;
  for (Kind k : {Kind::kPut, Kind::kMailbox})
    for (int src : {0, 1, 17, 2047, kMaxRanks - 1})
      for (uint64_t epoch : {uint64_t{0}, uint64_t{1}, uint64_t{kEpochMask},
                             uint64_t{kEpochMask} + 1, uint64_t{1} << 40}) {
        const uint32_t imm = encode(k, src, epoch);
        EXPECT_EQ(kind_of(imm), k);
        EXPECT_EQ(src_of(imm), src);
        EXPECT_EQ(epoch_of(imm), epoch & kEpochMask);
      }
  // Kind 0 never comes out of encode for a put or a mailbox entry: a zero
  // immediate (a write without data) is recognisably not one of ours.
  EXPECT_NE(kind_of(encode(Kind::kPut, 0, 0)), Kind::kNone);
}

TEST(LibfabricImm, FullEpochIsRebuiltInsideTheWindowAcrossTheWrap) {
  using namespace fabric_imm;
  uint64_t e = 0;
  // The receiver applied 10 epochs and expects [10, 74).
  EXPECT_TRUE(full_epoch(encode(Kind::kPut, 3, 10), 10, 64, e));
  EXPECT_EQ(e, 10u);
  EXPECT_TRUE(full_epoch(encode(Kind::kPut, 3, 73), 10, 64, e));
  EXPECT_EQ(e, 73u);
  EXPECT_FALSE(full_epoch(encode(Kind::kPut, 3, 74), 10, 64, e));
  EXPECT_FALSE(full_epoch(encode(Kind::kPut, 3, 9), 10, 64, e));  // already applied
  // Across the 18-bit wrap: applied = 2^18 - 2, the sender at 2^18 + 5.
  const uint64_t applied = (uint64_t{1} << 18) - 2;
  EXPECT_TRUE(full_epoch(encode(Kind::kMailbox, 0, (uint64_t{1} << 18) + 5), applied, 64, e));
  EXPECT_EQ(e, (uint64_t{1} << 18) + 5);
  // And far beyond 2^32 epochs.
  const uint64_t big = (uint64_t{7} << 32) + 12345;
  EXPECT_TRUE(full_epoch(encode(Kind::kPut, 1, big + 3), big, 4096, e));
  EXPECT_EQ(e, big + 3);
  EXPECT_EQ(sizeof(MailboxEntry), 32u);
}

// ---- forked ranks and their exchange: forked_ranks.hpp ---------------------------

using forked::Board;
using forked::expect;
using forked::kMaxRanks;
using forked::Ranks;
using forked::ShmExchange;

// ---- the traffic of tests 1-3 -----------------------------------------------------

constexpr int kMaxChannels = 4;             // the layout's room: the rails tests use 4
constexpr uint64_t kSrc = 128 * 1024;       // the source pattern area
constexpr uint64_t kSeg = 24 * 1024;        // one round's destination segment
constexpr int kRounds = 30;                 // rounds (= signals) per (source, channel, target)
constexpr uint64_t kSlab = kSeg * kRounds;  // per (source, channel) at a target

uint64_t slab_off(int src, int c) {
  return kSrc + (static_cast<uint64_t>(src) * kMaxChannels + c) * kSlab;
}
uint64_t sig_off(int src, int c) {
  return kSrc + kSlab * kMaxRanks * kMaxChannels +
         (static_cast<uint64_t>(src) * kMaxChannels + c) * 8;
}
constexpr uint64_t kRegionBytes = kSrc + kSlab * kMaxRanks * kMaxChannels + 4096;

struct PutPlan {
  uint64_t dst, src, bytes;
};
struct Round {
  std::vector<PutPlan> puts;  ///< dst relative to the region
  uint64_t add;
};
/// What source `s` sends to target `d` on channel `c`: random puts at random
/// offsets and sizes (non-overlapping, gaps between), signals with random adds.
std::vector<Round> plan(int s, int d, int c) {
  std::mt19937_64 rng(static_cast<uint64_t>(s) * 1000003 + d * 1009 + c * 17 + 5);
  std::vector<Round> rounds(kRounds);
  for (int k = 0; k < kRounds; ++k) {
    Round& r = rounds[k];
    const int n = static_cast<int>(rng() % 5);  // 0: a signal alone
    uint64_t cursor = 0;
    for (int i = 0; i < n; ++i) {
      cursor += rng() % 64;
      const uint64_t max = (rng() % 4 == 0) ? 16384 : 2048;
      const uint64_t bytes = 1 + rng() % max;
      if (cursor + bytes > kSeg) break;
      r.puts.push_back({slab_off(s, c) + k * kSeg + cursor, rng() % (kSrc - bytes), bytes});
      cursor += bytes;
    }
    r.add = 1 + rng() % (uint64_t{1} << 40);  // far past 32 bits
  }
  return rounds;
}

/// What rank `d` checks: for every (source, channel), each time the signal
/// word changes it must equal a prefix sum of the adds, and every byte of the
/// rounds it covers must be there already; at the end the whole slab must be
/// exactly the puts (zeros between). Returns the signal changes seen.
uint64_t check_arrivals(int d, int n, const char* base, double timeout_s,
                        int channels = kChannels) {
  struct Stream {
    int s, c;
    std::vector<Round> rounds;
    std::vector<uint64_t> sums;
    int covered = -1;
    uint64_t last = 0;
  };
  std::vector<Stream> streams;
  for (int s = 0; s < n; ++s)
    for (int c = 0; c < channels; ++c) {
      if (s == d) continue;
      Stream st{s, c, plan(s, d, c), {}, -1, 0};
      uint64_t sum = 0;
      for (const Round& r : st.rounds) st.sums.push_back(sum += r.add);
      streams.push_back(std::move(st));
    }
  auto check_round = [&](const Stream& st, int k) {
    for (const PutPlan& p : st.rounds[k].puts)
      for (uint64_t i = 0; i < p.bytes; ++i)
        if (static_cast<uint8_t>(base[p.dst + i]) != pattern(st.s, p.src + i))
          throw std::runtime_error(
              "rank " + std::to_string(d) + ": signal from rank " + std::to_string(st.s) +
              " channel " + std::to_string(st.c) + " covering round " + std::to_string(k) +
              " is visible before byte " + std::to_string(i) + " of its put of " +
              std::to_string(p.bytes) + " bytes at " + std::to_string(p.dst));
  };
  uint64_t changes = 0;
  const auto t0 = Clock::now();
  std::size_t done = 0;
  while (done < streams.size()) {
    done = 0;
    for (Stream& st : streams) {
      const uint64_t v = std::atomic_ref<const uint64_t>(
                             *reinterpret_cast<const uint64_t*>(base + sig_off(st.s, st.c)))
                             .load(std::memory_order_acquire);
      if (v != st.last) {
        int k = st.covered + 1;
        while (k < kRounds && st.sums[k] != v) ++k;
        expect(k < kRounds, "rank " + std::to_string(d) + ": signal word of rank " +
                                std::to_string(st.s) + " channel " + std::to_string(st.c) +
                                " reads " + std::to_string(v) + ", not a sum of its adds in order");
        for (int j = st.covered + 1; j <= k; ++j) check_round(st, j);
        st.covered = k;
        st.last = v;
        ++changes;
      }
      if (st.covered == kRounds - 1) ++done;
    }
    if (since(t0) > timeout_s) {
      std::string late;
      for (const Stream& st : streams)
        if (st.covered != kRounds - 1)
          late += " (rank " + std::to_string(st.s) + " channel " + std::to_string(st.c) + ": " +
                  std::to_string(st.covered + 1) + " rounds)";
      throw std::runtime_error("rank " + std::to_string(d) + ": signals missing after " +
                               std::to_string(timeout_s) + " s:" + late);
    }
  }
  // Every byte of every slab: the puts' bytes, zeros elsewhere.
  for (const Stream& st : streams) {
    std::vector<uint8_t> want(kSlab, 0);
    const uint64_t at = slab_off(st.s, st.c);
    for (const Round& r : st.rounds)
      for (const PutPlan& p : r.puts)
        for (uint64_t i = 0; i < p.bytes; ++i) want[p.dst - at + i] = pattern(st.s, p.src + i);
    expect(std::memcmp(want.data(), base + at, kSlab) == 0,
           "rank " + std::to_string(d) + ": slab of rank " + std::to_string(st.s) + " channel " +
               std::to_string(st.c) + " differs from its puts");
  }
  return changes;
}

/// `list` split at commas.
std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= list.size() && !list.empty()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

/// One rank of tests 1 and 3 (and of the rails tests): the engine driven
/// directly, one thread per channel, on `domains` (empty: the default).
/// Besides the bytes and signals, checks which domain each channel reports
/// and that each received exactly the writes its peers sent on it; `more`
/// checks the stats further.
void engine_rank(int me, ShmExchange& ex, Board* b, const std::string& provider, uint32_t reorder,
                 int channels = kChannels, const std::string& domains = "",
                 const std::function<void(const LibfabricStats&)>& more = {}) {
  const int n = ex.num_ranks();
  std::vector<uint8_t> mem(kRegionBytes, 0);
  for (uint64_t i = 0; i < kSrc; ++i) mem[i] = pattern(me, i);
  LibfabricOptions o;
  o.provider = provider;
  o.domains = domains;
  o.timeout_s = 10;
  o.window = 8;  // small: the credits run many laps
  o.test_reorder_window = reorder;
  auto engine = make_libfabric_engine(borrow(ex), channels, o);
  engine->register_region(0, mem.data(), mem.size());
  std::vector<std::string> errors(channels);
  std::vector<std::thread> senders;
  for (int c = 0; c < channels; ++c)
    senders.emplace_back([&, c] {
      try {
        std::vector<std::vector<Round>> plans(n);
        for (int d = 0; d < n; ++d)
          if (d != me) plans[d] = plan(me, d, c);
        uint64_t token = 0;
        for (int k = 0; k < kRounds; ++k) {
          for (int d = 0; d < n; ++d) {
            if (d == me) continue;
            for (const PutPlan& p : plans[d][k].puts) engine->put(c, d, 0, p.dst, p.src, p.bytes);
            engine->signal_add(c, d, 0, sig_off(me, c), plans[d][k].add);
          }
          engine->mark(c, ++token);
          (void)engine->completed(c);
        }
        const auto t0 = Clock::now();
        while (engine->completed(c) < token) {
          expect(since(t0) < 15, "channel " + std::to_string(c) + ": marks incomplete");
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      } catch (const std::exception& e) {
        errors[c] = e.what();
      }
    });
  std::string check_error;
  uint64_t changes = 0;
  try {
    changes = check_arrivals(me, n, reinterpret_cast<const char*>(mem.data()), 20, channels);
  } catch (const std::exception& e) {
    check_error = e.what();
  }
  for (auto& t : senders) t.join();
  for (const auto& e : errors) expect(e.empty(), e);
  expect(check_error.empty(), check_error);
  const LibfabricStats s = libfabric_stats(*engine);
  b->stat[me][0] = changes;
  b->stat[me][1] = s.signals_waited;
  b->stat[me][2] = s.signals_applied;
  b->stat[me][3] = s.delivery_complete ? 1 : 0;
  expect(s.signals_applied == static_cast<uint64_t>((n - 1) * channels * kRounds),
         "signals applied: " + std::to_string(s.signals_applied));
  // The domains: those named, or the provider's first one; channel c on c % n.
  const std::vector<std::string> want =
      domains.empty() ? std::vector<std::string>{libfabric_domains(provider).at(0)}
                      : split(domains);
  expect(s.domains == want, "rank " + std::to_string(me) + ": engine reports " +
                                std::to_string(s.domains.size()) + " domains, not " + domains);
  expect(s.channel_domains.size() == static_cast<std::size_t>(channels) &&
             s.channel_writes_received.size() == static_cast<std::size_t>(channels),
         "per-channel stats for " + std::to_string(s.channel_domains.size()) + " channels");
  for (int c = 0; c < channels; ++c) {
    expect(s.channel_domains[c] == want[c % want.size()],
           "channel " + std::to_string(c) + " reports domain " + s.channel_domains[c]);
    // Every put (the providers here take 16 KiB in one write) and signal its
    // peers sent on channel c arrived on channel c's endpoint.
    uint64_t sent = 0;
    for (int src = 0; src < n; ++src)
      if (src != me)
        for (const Round& r : plan(src, me, c)) sent += r.puts.size() + 1;
    expect(s.channel_writes_received[c] == sent,
           "rank " + std::to_string(me) + " channel " + std::to_string(c) + " (domain " +
               s.channel_domains[c] + ") received " + std::to_string(s.channel_writes_received[c]) +
               " writes, its peers sent " + std::to_string(sent));
  }
  if (more) more(s);
  ex.barrier();  // everyone's checks are done before any endpoint closes
  engine->deregister_region(0);
}

// 1. The engine alone: 3 ranks, 2 channels, everyone to everyone.
TEST_P(LibfabricEngineTest, RandomPutsAndSignalsLandBeforeTheirSignals) {
  Ranks ranks;
  const std::string prov = provider();
  Board* b = ranks.board;
  ranks.start(3, [&](int me, ShmExchange& ex) { engine_rank(me, ex, b, prov, 0); });
  const std::string why = ranks.wait(40);
  ASSERT_TRUE(why.empty()) << why;
  for (int r = 0; r < 3; ++r) {
    EXPECT_GT(b->stat[r][0].load(), 0u) << "rank " << r << " saw no signal change";
    std::printf(
        "rank %d: %llu signal changes checked, %llu signals waited for their puts, "
        "delivery complete %llu\n",
        r, (unsigned long long)b->stat[r][0], (unsigned long long)b->stat[r][1],
        (unsigned long long)b->stat[r][3]);
  }
}

// 3. The same with the receivers handling immediate data in a random order
// (windows of 16): signals still never early, and some provably waited.
TEST_P(LibfabricEngineTest, ReorderedCompletionsStillNeverShowASignalEarly) {
  Ranks ranks;
  const std::string prov = provider();
  Board* b = ranks.board;
  ranks.start(3, [&](int me, ShmExchange& ex) { engine_rank(me, ex, b, prov, 16); });
  const std::string why = ranks.wait(40);
  ASSERT_TRUE(why.empty()) << why;
  uint64_t waited = 0;
  for (int r = 0; r < 3; ++r) waited += b->stat[r][1];
  EXPECT_GT(waited, 0u) << "no signal arrived before its puts: the reordering did not happen";
  std::printf("signals that arrived before their puts and waited: %llu\n",
              (unsigned long long)waited);
}

/// One rank of test 2: the real Proxy threads and rings over the engine on
/// `channels` channels and `domains` (empty: the default).
void proxy_rank(int me, ShmExchange& ex, const std::string& prov, int channels = kChannels,
                const std::string& domains = "") {
  const int n = ex.num_ranks();
  std::vector<uint8_t> mem(kRegionBytes, 0);
  for (uint64_t i = 0; i < kSrc; ++i) mem[i] = pattern(me, i);
  LibfabricOptions o;
  o.provider = prov;
  o.domains = domains;
  o.timeout_s = 10;
  auto engine = make_libfabric_engine(borrow(ex), channels, o);
  engine->register_region(0, mem.data(), mem.size());
  ProxyOptions po;
  po.num_channels = channels;
  po.capacity = 64;
  po.device = -1;
  {
    Proxy proxy(*engine, po);
    std::vector<std::string> errors(channels);
    std::vector<std::thread> posters;
    for (int c = 0; c < channels; ++c)
      posters.emplace_back([&, c] {
        try {
          const ChannelView v = proxy.view(c);
          for (int d = 0; d < n; ++d) {
            if (d == me) continue;
            const auto rounds = plan(me, d, c);
            for (const Round& r : rounds) {
              for (std::size_t i = 0; i < r.puts.size(); ++i) {
                Command cmd{};
                cmd.peer = static_cast<uint32_t>(d);
                cmd.dst_off = r.puts[i].dst;
                cmd.src_off = r.puts[i].src;
                cmd.bytes = r.puts[i].bytes;
                const bool last = i + 1 == r.puts.size();
                if (last) {
                  cmd.sig_off = sig_off(me, c);
                  cmd.add = r.add;
                }
                post_from_host(v, cmd, last ? Op::kPutSignal : Op::kPut, 0, 10.0, c);
              }
              if (r.puts.empty()) {
                Command cmd{};
                cmd.peer = static_cast<uint32_t>(d);
                cmd.sig_off = sig_off(me, c);
                cmd.add = r.add;
                post_from_host(v, cmd, Op::kSignal, 0, 10.0, c);
              }
            }
          }
        } catch (const std::exception& e) {
          errors[c] = e.what();
        }
      });
    std::string check_error;
    try {
      check_arrivals(me, n, reinterpret_cast<const char*>(mem.data()), 20, channels);
    } catch (const std::exception& e) {
      check_error = e.what();
    }
    for (auto& t : posters) t.join();
    for (const auto& e : errors) expect(e.empty(), e);
    expect(check_error.empty(), check_error);
    proxy.drain(10);
    proxy.check();
    for (int c = 0; c < channels; ++c) {
      const ChannelHealth h = proxy.health(c);
      expect(h.completed == h.consumed && h.consumed > 0,
             "channel " + std::to_string(c) + ": consumed " + std::to_string(h.consumed) +
                 ", completed " + std::to_string(h.completed));
    }
    ex.barrier();
  }
  engine->deregister_region(0);
}

// 2. The real Proxy threads and rings over the engine (host memory, no CUDA).
TEST_P(LibfabricEngineTest, ProxyRingsEndToEnd) {
  Ranks ranks;
  const std::string prov = provider();
  ranks.start(2, [&](int me, ShmExchange& ex) { proxy_rank(me, ex, prov); });
  const std::string why = ranks.wait(40);
  ASSERT_TRUE(why.empty()) << why;
}

// 4. A peer killed (SIGKILL) or stopped (SIGSTOP) while the others wait for
// their writes to it to complete: they raise epx::Error(kTimeout) within the
// deadline, naming the peer and the channel.
void peer_fault(const std::string& prov, int sig) {
  constexpr int kN = 3, kVictim = 2;
  constexpr double kTimeout = 3.0;
  Ranks ranks;
  Board* b = ranks.board;
  ranks.start(kN, [&](int me, ShmExchange& ex) {
    std::vector<uint8_t> mem(256 * 1024, 0);
    LibfabricOptions o;
    o.provider = prov;
    o.timeout_s = kTimeout;
    auto engine = make_libfabric_engine(borrow(ex), 1, o);
    engine->register_region(0, mem.data(), mem.size());
    uint64_t token = 0;
    const auto t0 = Clock::now();
    try {
      for (int round = 0;; ++round) {
        for (int d = 0; d < kN; ++d)
          if (d != me) {
            engine->put(0, d, 0, 4096 + 8192 * me, 0, 8192);
            engine->signal_add(0, d, 0, 8 * me, 1);
          }
        engine->mark(0, ++token);
        while (engine->completed(0) < token) std::this_thread::yield();
        if (round == 20) b->stage[me].store(1);
        expect(since(t0) < 20, "rank " + std::to_string(me) + ": no error after 20 s");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } catch (const Error& e) {
      // The proxy's stall note gets the same message.
      const std::string cause = engine->held_call_cause();
      expect(!cause.empty() && std::string(e.what()).find(cause) != std::string::npos,
             "held_call_cause() '" + cause + "' is not the error '" + e.what() + "'");
      // A survivor's engine stays up until every survivor raised: one that
      // exits at once breaks its writes to the others, which would then name
      // it instead of the victim (seen over shm under ASan).
      b->stage[me].store(2);
      const auto t1 = Clock::now();
      for (int r = 0; r < kN; ++r)
        while (r != kVictim && b->stage[r].load() < 2 && since(t1) < 15)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      throw;
    }
  });
  for (int r = 0; r < kN; ++r) ranks.wait_stage(r, 1, 20);
  const auto t_fault = Clock::now();
  kill(ranks.pids[kVictim], sig);
  // The survivors end with their error; then the victim goes.
  std::string out;
  for (int r = 0; r < kN; ++r)
    if (r != kVictim) {
      int st = 0;
      pid_t got = 0;
      while ((got = waitpid(ranks.pids[r], &st, WNOHANG)) == 0 && since(t_fault) < 15)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      ASSERT_NE(got, 0) << "rank " << r << " did not raise an error within 15 s of the fault";
      ranks.pids[r] = -1;
      const double took = since(t_fault);
      const std::string msg = b->message[r];
      EXPECT_EQ(b->code[r].load(), static_cast<int>(ErrorCode::kTimeout) + 1) << msg;
      EXPECT_NE(msg.find("rank " + std::to_string(kVictim)), std::string::npos) << msg;
      EXPECT_NE(msg.find("channel 0"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank " + std::to_string(r)), std::string::npos) << msg;
      EXPECT_LT(took, kTimeout + 5) << msg;
      std::printf("rank %d after %.2f s: %s\n", r, took, msg.c_str());
    }
  kill(ranks.pids[kVictim], SIGKILL);
}

TEST_P(LibfabricEngineTest, KilledPeerIsAnErrorNamingItAndTheChannel) {
  peer_fault(provider(), SIGKILL);
}
TEST_P(LibfabricEngineTest, StoppedPeerIsATimeoutNamingItAndTheChannel) {
  peer_fault(provider(), SIGSTOP);
}

INSTANTIATE_TEST_SUITE_P(Providers, LibfabricEngineTest, ::testing::Values("tcp;ofi_rxm", "shm"),
                         provider_test_name);

// Bad options, each in a forked rank (no libfabric in the test process).
void expect_refused(const LibfabricOptions& o, ErrorCode code,
                    const std::vector<std::string>& words, int channels = 1) {
  Ranks ranks;
  ranks.start(1, [&](int, ShmExchange& ex) { make_libfabric_engine(borrow(ex), channels, o); });
  const std::string why = ranks.wait(20);
  ASSERT_FALSE(why.empty()) << "options accepted";
  const std::string msg = ranks.board->message[0];
  EXPECT_EQ(ranks.board->code[0].load(), static_cast<int>(code) + 1) << msg;
  for (const auto& w : words) EXPECT_NE(msg.find(w), std::string::npos) << w << " in: " << msg;
}

// ---- ranks in separate network namespaces --------------------------------------
//
// Two ranks that share no network stack, as on two hosts: each forks into a
// network namespace of its own (unshare), and a veth pair joins them, one end
// in each, with an address of its own (10.231.x.1 and .2). The engine runs
// tcp;ofi_rxm over that pair only (the veth end is the rank's one domain and
// FI_TCP_IFACE), with the random traffic of the other tests. Needs the
// privilege to make namespaces and veth links (root in CI) and iproute2's
// `ip`; else it skips saying which.

/// "" when `cmd` (a shell command) exits 0, else what it printed.
std::string run_shell(const std::string& cmd) {
  std::string out;
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (!f) return "popen failed";
  char buf[256];
  while (fgets(buf, sizeof buf, f)) out += buf;
  const int st = pclose(f);
  return st == 0 ? "" : (out.empty() ? "exit status " + std::to_string(st) : out);
}

/// Why namespaces joined by veth cannot be made here ("" if they can).
std::string netns_missing() {
  if (!run_shell("ip -V").empty()) return "iproute2's ip is not installed";
  const pid_t pid = fork();
  if (pid == 0) _exit(unshare(CLONE_NEWNET) == 0 ? 0 : 1);
  int st = 0;
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    return "unshare(CLONE_NEWNET) is not permitted for this user";
  const std::string a = "epxp" + std::to_string(getpid() % 100000);
  const std::string made = run_shell("ip link add " + a + "a type veth peer name " + a + "b");
  if (!made.empty()) return "cannot make a veth pair: " + made;
  run_shell("ip link del " + a + "a");
  return "";
}

TEST(LibfabricNetns, TwoRanksInSeparateNetworkNamespacesOverAVethPair) {
  if (const std::string why = netns_missing(); !why.empty()) GTEST_SKIP() << why;
  Ranks ranks;
  Board* b = ranks.board;
  const std::string base = "epx" + std::to_string(getpid() % 100000);
  const std::string ifs[2] = {base + "a", base + "b"};
  const int subnet = 1 + static_cast<int>(getpid() % 250);
  ranks.start(2, [&](int me, ShmExchange& ex) {
    expect(unshare(CLONE_NEWNET) == 0, std::string("unshare: ") + std::strerror(errno));
    b->stage[me].store(1);  // the parent moves this rank's veth end in now
    const auto t0 = Clock::now();
    while (b->stage[me].load() == 1 && since(t0) < 20)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    expect(b->stage[me].load() == 2, "the parent did not hand over the veth end");
    const std::string ip = "10.231." + std::to_string(subnet) + "." + std::to_string(me + 1);
    const std::string set = run_shell("ip link set lo up && ip addr add " + ip + "/24 dev " +
                                      ifs[me] + " && ip link set " + ifs[me] + " up");
    expect(set.empty(), "configuring " + ifs[me] + ": " + set);
    // Only the veth end is there (no eth0, and lo is this namespace's own).
    setenv("FI_TCP_IFACE", ifs[me].c_str(), 1);
    ex.barrier();  // both ends up
    engine_rank(me, ex, b, "tcp;ofi_rxm", 0, kChannels, ifs[me], [&](const LibfabricStats& st) {
      for (const std::string& a : st.channel_addresses)
        expect(a.find("//" + ip + ":") != std::string::npos,
               "rank " + std::to_string(me) + " endpoint " + a + " is not on " + ip);
    });
  });
  for (int r = 0; r < 2; ++r) ranks.wait_stage(r, 1, 20);
  std::string moved = run_shell("ip link add " + ifs[0] + " type veth peer name " + ifs[1]);
  for (int r = 0; r < 2 && moved.empty(); ++r)
    moved = run_shell("ip link set " + ifs[r] + " netns " + std::to_string(ranks.pids[r]));
  if (!moved.empty()) run_shell("ip link del " + ifs[0]);  // (gone with the namespaces otherwise)
  for (int r = 0; r < 2; ++r) b->stage[r].store(moved.empty() ? 2 : 3);
  ASSERT_TRUE(moved.empty()) << "making or moving the veth pair: " << moved;
  const std::string why = ranks.wait(60);
  ASSERT_TRUE(why.empty()) << why;
  for (int r = 0; r < 2; ++r) EXPECT_GT(b->stat[r][0].load(), 0u) << "rank " << r;
}

TEST(LibfabricEngineOptions, UnknownProviderIsNamed) {
  LibfabricOptions o;
  o.provider = "no_such_provider";
  expect_refused(o, ErrorCode::kInvalidArgument, {"no_such_provider", "unknown"});
}

TEST(LibfabricEngineOptions, ProviderWithoutRmaIsNamedWithWhatItLacks) {
  // The udp provider itself must exist here (it refuses for lacking FI_RMA).
  const std::string probe = provider_missing("udp");
  if (probe.find("lacks") == std::string::npos)
    GTEST_SKIP() << "no udp provider to refuse here: " << (probe.empty() ? "it has RMA" : probe);
  LibfabricOptions o;
  o.provider = "udp";
  expect_refused(o, ErrorCode::kUnsupported, {"'udp'", "FI_RMA"});
}

TEST(LibfabricEngineOptions, BadWindowIsRefused) {
  LibfabricOptions o;
  o.provider = "shm";
  o.window = 6;
  expect_refused(o, ErrorCode::kInvalidArgument, {"window", "6"});
}

TEST(LibfabricEngineOptions, MoreDomainsThanChannelsIsRefused) {
  LibfabricOptions o;
  o.provider = "tcp;ofi_rxm";
  o.domains = "lo,eth0,eth1";
  expect_refused(o, ErrorCode::kInvalidArgument, {"3 fabric domains", "2 channels", "c % n"}, 2);
}

TEST(LibfabricEngineOptions, EmptyOrRepeatedDomainNameIsRefused) {
  LibfabricOptions o;
  o.provider = "tcp;ofi_rxm";
  o.domains = "lo,,eth0";
  expect_refused(o, ErrorCode::kInvalidArgument, {"'lo,,eth0'", "empty name"}, 3);
  o.domains = "lo, lo";
  expect_refused(o, ErrorCode::kInvalidArgument, {"'lo' twice"}, 2);
}

// The domain tests below ask tcp;ofi_rxm for its domains: it must run here.
std::string tcp_missing() {
  setenv("FI_TCP_IFACE", "lo", 0);
  return provider_missing("tcp;ofi_rxm");
}

TEST(LibfabricEngineOptions, UnknownDomainIsNamedWithTheProvidersDomains) {
  if (const std::string why = tcp_missing(); !why.empty()) GTEST_SKIP() << why;
  LibfabricOptions o;
  o.provider = "tcp;ofi_rxm";
  o.domains = "lo,no_such_domain";
  expect_refused(o, ErrorCode::kInvalidArgument,
                 {"'tcp;ofi_rxm'", "no domain 'no_such_domain'", "its domains: lo"}, 2);
}

// A rank whose setup fails still takes part in the setup exchange: its peer
// raises at once naming it and its error, not at the exchange's deadline.
TEST(LibfabricEngineOptions, PeerWithAnUnknownDomainIsNamedByTheOthersAtOnce) {
  if (const std::string why = tcp_missing(); !why.empty()) GTEST_SKIP() << why;
  Ranks ranks;
  ranks.start(
      2,
      [&](int me, ShmExchange& ex) {
        LibfabricOptions o;
        o.provider = "tcp;ofi_rxm";
        o.domains = me == 1 ? "no_such_domain" : "lo";
        make_libfabric_engine(borrow(ex), 2, o);
      },
      60);
  const auto t0 = Clock::now();
  const std::string why = ranks.wait(30);
  EXPECT_LT(since(t0), 20) << "the peer waited for the failed rank until a deadline";
  ASSERT_NE(ranks.status[0], 0) << "rank 0 accepted a peer that failed";
  ASSERT_NE(ranks.status[1], 0);
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(ranks.board->code[r].load(), static_cast<int>(ErrorCode::kInvalidArgument) + 1)
        << ranks.board->message[r];
  const std::string msg0 = ranks.board->message[0];
  EXPECT_NE(msg0.find("rank 1 could not set up"), std::string::npos) << msg0;
  EXPECT_NE(msg0.find("'no_such_domain'"), std::string::npos) << msg0;
  const std::string msg1 = ranks.board->message[1];
  EXPECT_NE(msg1.find("'no_such_domain'"), std::string::npos) << msg1;
}

// ---- rails: channels striped over several domains ---------------------------------
//
// tcp;ofi_rxm has a domain per IP interface (lo and, say, eth0): two of them
// stand in for two NICs or the two ports of one. FI_TCP_IFACE (ctest sets it
// to lo) would hide every other interface, so these tests unset it.

/// tcp;ofi_rxm's domains on this host as the ranks will see them (probed in a
/// forked child).
std::vector<std::string> tcp_domains() {
  Ranks ranks;
  Board* b = ranks.board;
  ranks.start(1, [&](int, ShmExchange&) {
    std::string joined;
    for (const std::string& d : libfabric_domains("tcp;ofi_rxm"))
      joined += (joined.empty() ? "" : ",") + d;
    std::snprintf(b->message[0], sizeof b->message[0], "%s", joined.c_str());
  });
  const std::string why = ranks.wait(20);
  if (!why.empty()) throw std::runtime_error("listing the tcp;ofi_rxm domains: " + why);
  return split(b->message[0]);
}

class LibfabricRailsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* v = std::getenv("FI_TCP_IFACE")) saved_ = v;
    unsetenv("FI_TCP_IFACE");
    const std::vector<std::string> all = tcp_domains();
    // lo first where there is one, then the first other domain.
    if (std::find(all.begin(), all.end(), "lo") != all.end()) picked_.push_back("lo");
    for (const std::string& d : all)
      if (picked_.size() < 2 && std::find(picked_.begin(), picked_.end(), d) == picked_.end())
        picked_.push_back(d);
    if (picked_.size() < 2) {
      std::string have;
      for (const std::string& d : all) have += " " + d;
      GTEST_SKIP() << "fewer than two tcp;ofi_rxm domains on this host (it has:"
                   << (have.empty() ? " none" : have) << "); the rails tests need two";
    }
    domains_ = picked_[0] + "," + picked_[1];
  }
  void TearDown() override {
    if (saved_) setenv("FI_TCP_IFACE", saved_->c_str(), 1);
  }
  /// Per-rank checks beyond engine_rank's: channels on different domains
  /// have different addresses, those on lo a 127.0.0.1 one and the others
  /// none, and the description names both domains.
  std::function<void(const LibfabricStats&)> addresses() const {
    const std::string domains = domains_;
    return [domains](const LibfabricStats& s) {
      expect(s.channel_addresses.size() >= 2 && s.channel_addresses[0] != s.channel_addresses[1],
             "channels 0 and 1 have one address: " + s.channel_addresses.at(0));
      for (std::size_t c = 0; c < s.channel_addresses.size(); ++c) {
        const bool loopback = s.channel_addresses[c].find("127.0.0.1") != std::string::npos;
        expect(loopback == (s.channel_domains[c] == "lo"),
               "channel " + std::to_string(c) + " on domain " + s.channel_domains[c] +
                   " has address " + s.channel_addresses[c]);
      }
      const std::string d = describe(s);
      expect(d.find("domains " + domains) != std::string::npos,
             "the description '" + d + "' does not name domains " + domains);
      std::string line = d + ":";
      for (std::size_t c = 0; c < s.channel_addresses.size(); ++c)
        line += " channel " + std::to_string(c) + " " + s.channel_addresses[c] + " " +
                std::to_string(s.channel_writes_received[c]) + " writes in;";
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);  // the ranks end with _exit
    };
  }
  /// Runs engine_rank on n ranks, 4 channels over the two domains with the
  /// addresses() checks, completions reordered in windows of `reorder` (0: in
  /// order); returns ranks.wait's verdict ("" when every rank passed).
  std::string run_engine_ranks(Ranks& ranks, int n, uint32_t reorder) const {
    Board* b = ranks.board;
    const std::string domains = domains_;
    const auto more = addresses();
    ranks.start(n, [&](int me, ShmExchange& ex) {
      engine_rank(me, ex, b, "tcp;ofi_rxm", reorder, 4, domains, more);
    });
    return ranks.wait(60);
  }
  std::optional<std::string> saved_;
  std::vector<std::string> picked_;
  std::string domains_;
};

// Random puts, put+signals and signals on 4 channels over 2 domains (channels
// 0 and 2 on the first, 1 and 3 on the second), 2 and 3 ranks: every byte
// checked, no signal before its data, every write counted on its channel.
TEST_F(LibfabricRailsTest, TwoRanksFourChannelsOverTwoDomains) {
  Ranks ranks;
  const std::string why = run_engine_ranks(ranks, 2, 0);
  ASSERT_TRUE(why.empty()) << why;
  for (int r = 0; r < 2; ++r) EXPECT_GT(ranks.board->stat[r][0].load(), 0u) << "rank " << r;
}

TEST_F(LibfabricRailsTest, ThreeRanksFourChannelsOverTwoDomainsWithReorderedCompletions) {
  Ranks ranks;
  const std::string why = run_engine_ranks(ranks, 3, 16);
  ASSERT_TRUE(why.empty()) << why;
}

// The real Proxy threads and rings over the two domains.
TEST_F(LibfabricRailsTest, ProxyRingsOverTwoDomains) {
  Ranks ranks;
  const std::string domains = domains_;
  ranks.start(2, [&](int me, ShmExchange& ex) { proxy_rank(me, ex, "tcp;ofi_rxm", 4, domains); });
  const std::string why = ranks.wait(60);
  ASSERT_TRUE(why.empty()) << why;
}

// Channel c talks to its peer's channel c on the peer's domain c % n: ranks
// that name different numbers of domains are refused, every rank naming each
// rank's count and domains.
TEST_F(LibfabricRailsTest, RanksWithDifferentNumbersOfDomainsAreRefusedNamingThem) {
  Ranks ranks;
  const std::string two = domains_, one = picked_[1];
  ranks.start(2, [&](int me, ShmExchange& ex) {
    LibfabricOptions o;
    o.provider = "tcp;ofi_rxm";
    o.domains = me == 0 ? two : one;
    make_libfabric_engine(borrow(ex), 2, o);
  });
  (void)ranks.wait(30);
  for (int r = 0; r < 2; ++r) {
    const std::string msg = ranks.board->message[r];
    ASSERT_NE(ranks.status[r], 0) << "rank " << r << " accepted the mismatch";
    EXPECT_EQ(ranks.board->code[r].load(), static_cast<int>(ErrorCode::kInvalidArgument) + 1)
        << msg;
    for (const std::string& w :
         std::vector<std::string>{"same number of libfabric domains", "rank 0 uses 2 (" + two + ")",
                                  "rank 1 uses 1 (" + one + ")"})
      EXPECT_NE(msg.find(w), std::string::npos) << w << " in: " << msg;
  }
}

}  // namespace
}  // namespace epx::proxy
