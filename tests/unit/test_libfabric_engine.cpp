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

namespace epx::proxy {
namespace {

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

/// Whether `provider` can run here (probed in a forked child): "" if so.
std::string provider_missing(const std::string& provider) {
  static std::map<std::string, std::string> cache;
  auto it = cache.find(provider);
  if (it != cache.end()) return it->second;
  Ranks ranks;
  ranks.start(1, [&](int, ShmExchange& ex) {
    LibfabricOptions o;
    o.provider = provider;
    auto shared = std::shared_ptr<Exchange>(&ex, [](Exchange*) {});
    make_libfabric_engine(shared, 1, o);
  });
  std::string why = ranks.wait(20);
  if (!why.empty()) why = "provider " + provider + " cannot run here: " + why;
  cache[provider] = why;
  return why;
}

// ---- the traffic of tests 1-3 -----------------------------------------------------

constexpr int kChannels = 2;                // channels of the tests on one domain
constexpr int kMaxChannels = 4;             // the layout's room: the rails tests use 4
constexpr uint64_t kSrc = 128 * 1024;       // the source pattern area
constexpr uint64_t kSeg = 24 * 1024;        // one round's destination segment
constexpr int kRounds = 30;                 // rounds (= signals) per (source, channel, target)
constexpr uint64_t kSlab = kSeg * kRounds;  // per (source, channel) at a target

uint8_t pattern(int rank, uint64_t i) {
  return static_cast<uint8_t>(((i * 2654435761u) >> 11) ^ (rank * 37 + 11));
}
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

std::shared_ptr<Exchange> borrow(ShmExchange& ex) {
  return std::shared_ptr<Exchange>(&ex, [](Exchange*) {});
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

class LibfabricEngineTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    setenv("FI_TCP_IFACE", "lo", 0);  // 127.0.0.1 only
    const std::string why = provider_missing(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
  std::string provider() const { return GetParam(); }
};

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
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& ch : s)
                             if (ch == ';') ch = '_';
                           return s;
                         });

// ---- faults through the Proxy ------------------------------------------------------
//
// 3 ranks, each a libfabric engine under the real Proxy (host memory, 2
// channels, commands posted with post_from_host). In every round each rank
// posts to every peer on every channel a put and a put+signal, then waits
// (await_signal: a deadline, and this rank's proxy health on every poll) for
// every peer's signal of the round in its own region, and checks the bytes.
// Rounds 0..2 run clean; in round 3 rank 2 (the victim) faults:
//   kKill    the others posted round 3 to it and wait for its signals when it
//            is SIGKILLed. It was stopped before they posted, so that their
//            writes to it are in flight when it dies (as writes to a process
//            that dies inside an op are): the engine has something to lose.
//   kStop    the same, but it stays stopped (SIGSTOP): a peer that stops
//            progressing.
//   kKillIdle  SIGKILLed while the others wait for its signals, but only
//            once every write they sent it completed: the engine has nothing
//            in flight to it and cannot tell; the wait's deadline names it.
//   kThread  its proxy thread of channel 1 dies after round 2
//            (ProxyOptions::stop_channel / stop_after); the process lives on.
// Then every surviving process destroys its Proxy and engine (within a
// bound) and forms a new group with the others (kKill, kStop: ranks 0 and 1;
// kThread: all three), a new engine + Proxy each, whose rounds move every
// byte correctly again.

constexpr int kFaultRanks = 3, kVictim = 2;
constexpr int kCleanRounds = 3, kFaultRound = 3, kRegroupRounds = 2, kMaxRound = 4;
constexpr uint64_t kPatBytes = 64 * 1024;  // the source pattern area
constexpr uint64_t kPiece = 8 * 1024;      // one (source, channel, round) area at a receiver
constexpr uint64_t area_off(int src, int c, int round) {
  return kPatBytes + ((static_cast<uint64_t>(src) * kChannels + c) * kMaxRound + round) * kPiece;
}
constexpr uint64_t fsig_off(int src, int c) {
  return area_off(kMaxRanks, 0, 0) + (static_cast<uint64_t>(src) * kChannels + c) * 8;
}
constexpr uint64_t kFaultRegionBytes = fsig_off(kMaxRanks, 0) + 4096;

constexpr double kEngineTimeoutS = 2.5;  ///< the engine's: a write incomplete this long fails
/// The fault round's waits: past the engine's timeout, so that whatever the
/// engine can tell arrives before the wait gives up on its own.
constexpr double kAwaitS = 4.5;
constexpr double kCleanAwaitS = 10;             ///< waits that must succeed (a loaded CI host)
constexpr double kRaiseBoundS = kAwaitS + 2.5;  ///< every survivor raises within this of the fault
constexpr double kTeardownBoundS = 5;           ///< ~Proxy + ~engine after the fault
constexpr double kHardLimitS = 30;              ///< a rank still running then has hung

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();  // CLOCK_MONOTONIC: one clock for every process of the host
}

/// Part `part` (0: the put, 1: the put+signal) of what a source sends to
/// `dst` on channel `c` in `round`: source offset and bytes.
struct Piece {
  uint64_t src_off, bytes;
};
Piece piece(int dst, int c, int round, int part) {
  const uint64_t bytes = 1024 + 512 * round + 256 * c + 128 * part + 8 * dst;  // < kPiece / 2
  return {(round * 4099u + dst * 1031u + c * 517u + part * 263u) % (kPatBytes - bytes), bytes};
}

std::vector<uint8_t> fault_region(int me) {
  std::vector<uint8_t> mem(kFaultRegionBytes, 0);
  for (uint64_t i = 0; i < kPatBytes; ++i) mem[i] = pattern(me, i);
  return mem;
}

/// Posts round `round` to `d` on channel `c`: a put, then a put+signal (add 1).
void post_to(const Proxy& proxy, int me, int d, int c, int round) {
  const ChannelView v = proxy.view(c);
  for (int part = 0; part < 2; ++part) {
    const Piece p = piece(d, c, round, part);
    Command cmd{};
    cmd.peer = static_cast<uint32_t>(d);
    cmd.dst_off = area_off(me, c, round) + part * (kPiece / 2);
    cmd.src_off = p.src_off;
    cmd.bytes = p.bytes;
    if (part == 1) {
      cmd.sig_off = fsig_off(me, c);
      cmd.add = 1;
    }
    post_from_host(v, cmd, part ? Op::kPutSignal : Op::kPut, 0, 5.0, c);
  }
}
void post_round(const Proxy& proxy, int me, int n, int round) {
  for (int d = 0; d < n; ++d)
    if (d != me)
      for (int c = 0; c < kChannels; ++c) post_to(proxy, me, d, c, round);
}

/// Which way a wait gave up.
enum class GaveUp : int { kNone = 0, kProxy = 1, kDeadline = 2 };

/// Waits until this rank's signal word of (src, channel) reaches `want`,
/// polling this rank's proxy health on the way (unless `proxy` is null);
/// throws epx::Error naming this rank, the op, and the source rank and
/// channel awaited:
///   - with the proxy's code and message once a channel of this rank's proxy
///     failed (the awaited channel is looked at first): the engine saw the
///     loss (a completion error, a write that never completed) and said whom;
///   - kTimeout once `deadline_s` passed with the proxy reporting nothing:
///     then only the wait knows that the signal never came.
/// `gave` (if given) says which of the two it was.
void await_signal(const Proxy* proxy, int me, const uint8_t* base, int src, int channel,
                  uint64_t want, const std::string& op, double deadline_s, GaveUp* gave) {
  const auto& word = *reinterpret_cast<const uint64_t*>(base + fsig_off(src, channel));
  auto read = [&] { return std::atomic_ref<const uint64_t>(word).load(std::memory_order_acquire); };
  auto what = [&] {
    return "rank " + std::to_string(me) + ": " + op + ": waiting for rank " + std::to_string(src) +
           "'s signal on channel " + std::to_string(channel) + " (its word reads " +
           std::to_string(read()) + ", want " + std::to_string(want) + ")";
  };
  const auto t0 = Clock::now();
  for (;;) {
    if (read() >= want) return;
    for (int k = 0; proxy && k <= proxy->num_channels(); ++k) {
      const int c = k == 0 ? channel : k - 1;
      if (k > 0 && c == channel) continue;
      const ChannelHealth h = proxy->health(c);
      if (h.state != ChannelHealth::State::kRunning) {
        if (gave) *gave = GaveUp::kProxy;
        throw Error(h.code, what() + ": this rank's " + h.message);
      }
    }
    if (since(t0) > deadline_s) {
      if (gave) *gave = GaveUp::kDeadline;
      throw Error(ErrorCode::kTimeout,
                  what() + ": no signal after " + std::to_string(deadline_s) +
                      " s while this rank's proxy and engine report no failure (rank " +
                      std::to_string(src) + " sends nothing on channel " + std::to_string(channel) +
                      ": it died, stopped, or its proxy thread did)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

/// Waits for every peer's signal of `round` on every channel (await_signal),
/// then checks the bytes those signals cover.
void finish_round(const Proxy* proxy, const std::vector<uint8_t>& mem, int me, int n, int round,
                  const std::string& op, double deadline_s, GaveUp* gave) {
  for (int s = 0; s < n; ++s)
    if (s != me)
      for (int c = 0; c < kChannels; ++c)
        await_signal(proxy, me, mem.data(), s, c, static_cast<uint64_t>(round) + 1, op, deadline_s,
                     gave);
  for (int s = 0; s < n; ++s)
    if (s != me)
      for (int c = 0; c < kChannels; ++c)
        for (int part = 0; part < 2; ++part) {
          const Piece p = piece(me, c, round, part);
          const uint8_t* got = mem.data() + area_off(s, c, round) + part * (kPiece / 2);
          for (uint64_t i = 0; i < p.bytes; ++i)
            expect(got[i] == pattern(s, p.src_off + i),
                   "rank " + std::to_string(me) + ": " + op + ": byte " + std::to_string(i) +
                       " of rank " + std::to_string(s) + "'s part " + std::to_string(part) +
                       " on channel " + std::to_string(c) + " is wrong");
        }
}

ProxyOptions fault_proxy_options() {
  ProxyOptions po;
  po.num_channels = kChannels;
  po.capacity = 64;
  po.device = -1;
  return po;
}

/// What one rank saw of the fault (shared memory: the test reads it).
struct FaultRecord {
  std::atomic<int> code{0};  ///< the fault's ErrorCode + 1 (0: nothing raised)
  std::atomic<int> gave{0};  ///< GaveUp
  std::atomic<int64_t> raised_ns{0};
  std::atomic<int64_t> teardown_ns{-1};  ///< ~Proxy + ~engine after the fault
  std::atomic<int> regrouped{0};         ///< rounds checked byte by byte in the new group
  char message[4096];
};
struct FaultBoard {
  Board regroup;           ///< the exchange of the group formed after the fault
  std::atomic<int> go{0};  ///< set by the test: post the fault round
  FaultRecord rec[kMaxRanks];
};
/// A FaultBoard mapped shared, before the fork.
struct SharedFaultBoard {
  FaultBoard* p = nullptr;
  SharedFaultBoard() {
    void* m = mmap(nullptr, sizeof(FaultBoard), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("mmap failed");
    p = new (m) FaultBoard();
  }
  ~SharedFaultBoard() { munmap(p, sizeof(FaultBoard)); }
  SharedFaultBoard(const SharedFaultBoard&) = delete;
  SharedFaultBoard& operator=(const SharedFaultBoard&) = delete;
};

void record(FaultRecord& rec, const Error& e, GaveUp gave) {
  std::snprintf(rec.message, sizeof rec.message, "%s", e.what());
  rec.gave.store(static_cast<int>(gave));
  rec.raised_ns.store(now_ns());
  rec.code.store(static_cast<int>(e.code()) + 1);
}

/// The group formed after the fault: a new engine and Proxy, rounds checked
/// byte by byte, a clean drain, and a collective teardown.
void regroup_rounds(ShmExchange& ex, const std::string& prov) {
  const int me = ex.rank(), n = ex.num_ranks();
  std::vector<uint8_t> mem = fault_region(me);
  LibfabricOptions o;
  o.provider = prov;
  o.timeout_s = 10;
  auto engine = make_libfabric_engine(borrow(ex), kChannels, o);
  engine->register_region(0, mem.data(), mem.size());
  auto proxy = std::make_unique<Proxy>(*engine, fault_proxy_options());
  for (int k = 0; k < kRegroupRounds; ++k) {
    post_round(*proxy, me, n, k);
    finish_round(proxy.get(), mem, me, n, k, "regrouped round " + std::to_string(k), kCleanAwaitS,
                 nullptr);
  }
  proxy->drain(10);
  proxy->check();
  ex.barrier();  // every member has its bytes before any endpoint closes
  proxy.reset();
  engine->deregister_region(0);
}

enum class Fault { kKill, kStop, kKillIdle, kThread };

std::string fault_op() {
  return "round " + std::to_string(kFaultRound) +
         " (a put and a put_signal to every peer on every channel, then every peer's signals)";
}

void fault_rank(int me, ShmExchange& ex, FaultBoard* fb, Board* b, const std::string& prov,
                Fault fault) {
  const int n = ex.num_ranks();
  const bool victim = me == kVictim;
  FaultRecord& rec = fb->rec[me];
  std::vector<uint8_t> mem = fault_region(me);
  LibfabricOptions o;
  o.provider = prov;
  o.timeout_s = kEngineTimeoutS;
  auto engine = make_libfabric_engine(borrow(ex), kChannels, o);
  engine->register_region(0, mem.data(), mem.size());
  ProxyOptions po = fault_proxy_options();
  if (fault == Fault::kThread && victim) {
    po.stop_channel = 1;  // its thread takes the clean rounds' commands, then dies
    po.stop_after = static_cast<uint64_t>(kCleanRounds) * (n - 1) * 2;
  }
  auto proxy = std::make_unique<Proxy>(*engine, po);
  // kThread's victim waits without looking at its own proxy: its channel 1
  // stops as soon as it took round 2's commands, while it waits for round 2.
  const Proxy* watched = fault == Fault::kThread && victim ? nullptr : proxy.get();
  for (int k = 0; k < kCleanRounds; ++k) {
    post_round(*proxy, me, n, k);
    finish_round(watched, mem, me, n, k, "round " + std::to_string(k), kCleanAwaitS, nullptr);
  }
  b->stage[me].store(1);
  if (victim && fault != Fault::kThread) {
    // Parked: the test stops it, then kills it or leaves it stopped.
    const auto t0 = Clock::now();
    while (since(t0) < kHardLimitS) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    throw std::runtime_error("rank " + std::to_string(me) + " was never stopped");
  }
  const auto t0 = Clock::now();
  while (fb->go.load() == 0) {
    expect(since(t0) < 20, "rank " + std::to_string(me) + ": the test never said go");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (victim) {
    // kThread: channel 1's thread is gone. post_from_host refuses its
    // commands once it sees the channel stopped (before that they sit in the
    // ring, never taken); channel 0's go out.
    for (int d = 0; d < n; ++d)
      if (d != me)
        for (int c = 0; c < kChannels; ++c) try {
            post_to(*proxy, me, d, c, kFaultRound);
          } catch (const Error&) {
            if (c != 1) throw;
          }
    const auto t1 = Clock::now();
    while (proxy->health(1).state == ChannelHealth::State::kRunning) {
      expect(since(t1) < 5, "proxy channel 1 still runs past its stop_after");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    try {
      proxy->check();
      throw std::runtime_error("Proxy::check() did not raise after channel 1's thread died");
    } catch (const Error& e) {
      record(rec, e, GaveUp::kProxy);
    }
    // Its engine still receives: the peers' signals of the round arrive on
    // both channels, with their bytes (waits that do not look at this
    // rank's proxy, which has a dead channel).
    finish_round(nullptr, mem, me, n, kFaultRound, fault_op(), kCleanAwaitS, nullptr);
  } else {
    post_round(*proxy, me, n, kFaultRound);
    if (fault == Fault::kKillIdle) {
      // Every write of the round is complete (the victim took them) before
      // the test kills it.
      proxy->drain(kCleanAwaitS);
    }
    b->stage[me].store(2);
    GaveUp gave = GaveUp::kNone;
    try {
      finish_round(proxy.get(), mem, me, n, kFaultRound, fault_op(), kAwaitS, &gave);
      throw std::runtime_error("rank " + std::to_string(me) + ": " + fault_op() +
                               " completed although rank " + std::to_string(kVictim) + " faulted");
    } catch (const Error& e) {
      record(rec, e, gave);
    }
  }
  b->stage[me].store(3);
  std::vector<int> members;
  for (int r = 0; r < n; ++r)
    if (fault == Fault::kThread || r != kVictim) members.push_back(r);
  // Tear down once every member raised: an engine that closes early could
  // hand a slower member's engine a second failure, naming this rank.
  const auto t2 = Clock::now();
  for (int r : members)
    while (b->stage[r].load() < 3) {
      expect(since(t2) < 15, "rank " + std::to_string(r) + " never raised");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  const int64_t t3 = now_ns();
  proxy.reset();
  engine.reset();
  rec.teardown_ns.store(now_ns() - t3);
  const int new_rank =
      static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
  ShmExchange regroup(&fb->regroup, new_rank, static_cast<int>(members.size()), 10);
  regroup_rounds(regroup, prov);
  rec.regrouped.store(kRegroupRounds);
}

/// The ranks a message names ("rank N"), in order.
std::vector<int> ranks_named(const std::string& msg) {
  std::vector<int> out;
  const std::regex re("rank (\\d+)");
  for (auto it = std::sregex_iterator(msg.begin(), msg.end(), re); it != std::sregex_iterator();
       ++it)
    out.push_back(std::stoi((*it)[1].str()));
  return out;
}

void proxy_fault(const std::string& prov, Fault fault) {
  SharedFaultBoard shared;
  FaultBoard* fb = shared.p;
  Ranks ranks;
  Board* b = ranks.board;
  ranks.start(kFaultRanks,
              [&](int me, ShmExchange& ex) { fault_rank(me, ex, fb, b, prov, fault); });
  // Every rank through the clean rounds (a rank that failed says why at once).
  const auto t_clean = Clock::now();
  auto clean = [&] {
    for (int r = 0; r < kFaultRanks; ++r)
      if (b->stage[r].load() < 1) return false;
    return true;
  };
  auto failed = [&] {
    for (int r = 0; r < kFaultRanks; ++r)
      if (b->message[r][0] != 0) return true;
    return false;
  };
  while (!clean() && !failed() && since(t_clean) < 20)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_TRUE(clean()) << "the clean rounds did not finish within " << since(t_clean)
                       << " s: " << ranks.wait(2);
  const pid_t victim = ranks.pids[kVictim];
  int64_t t_fault = 0;
  if (fault == Fault::kThread) {
    t_fault = now_ns();
    fb->go.store(1);
  } else if (fault == Fault::kKillIdle) {
    fb->go.store(1);
    for (int r = 0; r < kFaultRanks; ++r)
      if (r != kVictim) ranks.wait_stage(r, 2, 10);
    t_fault = now_ns();
    ASSERT_EQ(kill(victim, SIGKILL), 0);
    waitpid(victim, nullptr, 0);
    ranks.pids[kVictim] = -1;
  } else {
    ASSERT_EQ(kill(victim, SIGSTOP), 0);
    int st = 0;
    ASSERT_EQ(waitpid(victim, &st, WUNTRACED), victim);
    ASSERT_TRUE(WIFSTOPPED(st));
    t_fault = now_ns();  // kStop: the survivors post to a stopped peer from here on
    fb->go.store(1);
    if (fault == Fault::kKill) {
      for (int r = 0; r < kFaultRanks; ++r)
        if (r != kVictim) ranks.wait_stage(r, 2, 10);
      t_fault = now_ns();
      ASSERT_EQ(kill(victim, SIGKILL), 0);
      waitpid(victim, &st, 0);
      ranks.pids[kVictim] = -1;
    }
  }
  const std::string why = ranks.wait(kHardLimitS, fault == Fault::kStop ? kVictim : -1);
  if (fault == Fault::kStop) {
    kill(victim, SIGKILL);
    waitpid(victim, nullptr, 0);
    ranks.pids[kVictim] = -1;
  }
  ASSERT_TRUE(why.empty()) << why;
  for (int r = 0; r < kFaultRanks; ++r) {
    if (r == kVictim && fault != Fault::kThread) continue;
    const FaultRecord& rec = fb->rec[r];
    const std::string msg = rec.message;
    const double took = (rec.raised_ns.load() - t_fault) * 1e-9;
    SCOPED_TRACE("rank " + std::to_string(r) + " raised after " + std::to_string(took) +
                 " s: " + msg);
    std::printf(
        "rank %d raised %.2f s after the fault, tore down in %.3f s, then %d rounds in the "
        "new group: %s\n",
        r, took, rec.teardown_ns.load() * 1e-9, rec.regrouped.load(), msg.c_str());
    EXPECT_GT(took, 0.0);
    EXPECT_LT(took, kRaiseBoundS);
    EXPECT_GE(rec.teardown_ns.load(), 0);
    EXPECT_LT(rec.teardown_ns.load() * 1e-9, kTeardownBoundS);
    EXPECT_EQ(rec.regrouped.load(), kRegroupRounds);
    if (r == kVictim) {
      // kThread's own rank: Proxy::check() names the channel whose thread died.
      EXPECT_EQ(rec.code.load(), static_cast<int>(ErrorCode::kInternal) + 1);
      EXPECT_EQ(msg.rfind("epx: proxy channel 1 stopped by EPX_DEBUG_PROXY_STOP", 0), 0u);
      continue;
    }
    EXPECT_EQ(rec.code.load(), static_cast<int>(ErrorCode::kTimeout) + 1);
    // The op and what it awaited: this rank, the round, the victim, a channel.
    const std::string head = "epx: rank " + std::to_string(r) + ": " + fault_op() +
                             ": waiting for rank " + std::to_string(kVictim) +
                             "'s signal on channel ";
    ASSERT_EQ(msg.rfind(head, 0), 0u) << "want it to start with: " << head;
    const int waited = msg[head.size()] - '0';
    // No rank but this one and the victim is named.
    const std::vector<int> named = ranks_named(msg);
    for (int x : named) EXPECT_TRUE(x == r || x == kVictim) << "names rank " << x;
    if (fault == Fault::kThread || fault == Fault::kKillIdle) {
      // kThread: the victim's engine is alive and completes every write, and
      // its channel 0 still works; kKillIdle: nothing was in flight to the
      // victim when it died. Only the wait can tell, at its deadline.
      EXPECT_EQ(rec.gave.load(), static_cast<int>(GaveUp::kDeadline));
      EXPECT_EQ(waited, fault == Fault::kThread ? 1 : 0);
      EXPECT_NE(msg.find("no signal after"), std::string::npos);
      EXPECT_GT(took, kAwaitS - 1.0);
      continue;
    }
    // kKill, kStop: the engine saw its writes to the victim fail and said so
    // through the proxy channel that carried them (either channel: both
    // carry writes to it), before the wait's deadline.
    EXPECT_EQ(rec.gave.load(), static_cast<int>(GaveUp::kProxy));
    std::smatch m;
    const std::regex via(": this rank's proxy channel (\\d): ");
    ASSERT_TRUE(std::regex_search(msg, m, via)) << "no proxy channel named";
    const std::string ch = m[1].str();
    EXPECT_NE(msg.find("libfabric engine (provider " + prov + ") rank " + std::to_string(r) +
                       " channel " + ch + ": "),
              std::string::npos);
    EXPECT_NE(msg.find(" to rank " + std::to_string(kVictim) + " on channel " + ch),
              std::string::npos);
    if (fault == Fault::kKill && prov == "tcp;ofi_rxm") {
      // A dead tcp peer breaks the connection: a completion error, at once.
      EXPECT_NE(msg.find("(the peer died or its connection broke)"), std::string::npos);
      EXPECT_LT(took, kEngineTimeoutS);
    } else {
      // shm, or a stopped peer: the writes to it never complete, or the
      // transmit queue to it stays full (the engine's timeout either way).
      EXPECT_TRUE(msg.find("has no completion after") != std::string::npos ||
                  msg.find("the transmit queue stayed full for") != std::string::npos);
      EXPECT_GT(took, kEngineTimeoutS - 0.5);
    }
  }
}

class LibfabricProxyFaultTest : public LibfabricEngineTest {};

// (a) A peer SIGKILLed while the others wait inside an op for its signals.
TEST_P(LibfabricProxyFaultTest, KilledPeerMidOpIsTheEnginesErrorNamingItThenSurvivorsRegroup) {
  proxy_fault(provider(), Fault::kKill);
}
// (a) The same with nothing in flight to it when it dies: the wait names it.
TEST_P(LibfabricProxyFaultTest, KilledIdlePeerMidOpIsTheWaitsDeadlineNamingItThenSurvivorsRegroup) {
  proxy_fault(provider(), Fault::kKillIdle);
}
// (c) A peer that stops progressing (SIGSTOP) inside an op.
TEST_P(LibfabricProxyFaultTest, StoppedPeerMidOpIsTheEnginesTimeoutNamingItThenSurvivorsRegroup) {
  proxy_fault(provider(), Fault::kStop);
}
// (b) A proxy thread that dies (stop_channel / stop_after) on one rank.
TEST_P(LibfabricProxyFaultTest, DeadProxyThreadIsNamedByCheckAndByThePeersWaitsThenAllRegroup) {
  proxy_fault(provider(), Fault::kThread);
}

INSTANTIATE_TEST_SUITE_P(Providers, LibfabricProxyFaultTest,
                         ::testing::Values("tcp;ofi_rxm", "shm"), [](const auto& info) {
                           std::string s = info.param;
                           for (char& ch : s)
                             if (ch == ';') ch = '_';
                           return s;
                         });

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
