// The libfabric proxy engine between forked processes on host memory, over
// tcp;ofi_rxm (127.0.0.1) and shm: the engine alone with random puts and
// signals (every byte checked, no signal before its data), the real Proxy
// threads and rings over it, reordered completions at the receiver, peers
// killed or stopped mid-op, and bad options. Each test forks its ranks before
// any libfabric call; the ranks' exchange is shared memory mapped before the
// fork (the engine only sees the Exchange interface).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.hpp"
#include "transport/proxy/command.hpp"
#include "transport/proxy/libfabric_engine.hpp"
#include "transport/proxy/proxy.hpp"

namespace epx::proxy {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

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

// ---- forked ranks and their exchange -------------------------------------------

constexpr int kMaxRanks = 4;

/// Shared memory of the ranks of one test (mapped before the fork).
struct Board {
  static constexpr std::size_t kSlot = 80 * 1024;  // one allgather contribution
  std::atomic<uint64_t> arrived[kMaxRanks];
  std::atomic<int> stage[kMaxRanks];
  std::atomic<int> code[kMaxRanks];  ///< the ErrorCode a rank caught, + 1 (0: none)
  std::atomic<uint64_t> stat[kMaxRanks][4];
  char message[kMaxRanks][4096];
  uint8_t data[kMaxRanks][kSlot];
};

class ShmExchange final : public Exchange {
 public:
  ShmExchange(Board* b, int rank, int n, double timeout_s)
      : b_(b), rank_(rank), n_(n), timeout_s_(timeout_s) {}
  int rank() const override { return rank_; }
  int num_ranks() const override { return n_; }
  std::vector<uint8_t> allgather(const void* data, std::size_t bytes) override {
    if (bytes > Board::kSlot)
      throw Error(ErrorCode::kInvalidArgument,
                  "test exchange: allgather of " + std::to_string(bytes) + " bytes is too large");
    std::memcpy(b_->data[rank_], data, bytes);
    barrier();
    std::vector<uint8_t> out(bytes * n_);
    for (int r = 0; r < n_; ++r) std::memcpy(out.data() + bytes * r, b_->data[r], bytes);
    barrier();  // nobody writes its slot again before everyone read
    return out;
  }
  void barrier() override {
    const uint64_t g = ++gen_;
    b_->arrived[rank_].store(g, std::memory_order_release);
    const auto t0 = Clock::now();
    for (;;) {
      std::string missing;
      for (int r = 0; r < n_; ++r)
        if (b_->arrived[r].load(std::memory_order_acquire) < g) missing += " " + std::to_string(r);
      if (missing.empty()) return;
      if (since(t0) > timeout_s_)
        throw Error(ErrorCode::kTimeout, "test exchange: barrier " + std::to_string(g) +
                                             " on rank " + std::to_string(rank_) + ": ranks" +
                                             missing + " did not arrive");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  Board* b_;
  int rank_, n_;
  double timeout_s_;
  uint64_t gen_ = 0;
};

/// A failed check inside a rank.
void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

struct Ranks {
  Board* board = nullptr;
  std::vector<pid_t> pids;
  std::vector<int> status;
  Ranks() {
    void* p =
        mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    board = new (p) Board();
  }
  ~Ranks() {
    for (pid_t pid : pids)
      if (pid > 0) kill(pid, SIGKILL);
    for (pid_t pid : pids)
      if (pid > 0) waitpid(pid, nullptr, 0);
    munmap(board, sizeof(Board));
  }
  /// Forks n ranks running body(rank, exchange). A rank exits 0, or 1 with
  /// its failure in board->message (an epx::Error's code in board->code).
  void start(int n, const std::function<void(int, ShmExchange&)>& body, double exchange_s = 10) {
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < n; ++r) {
      const pid_t pid = fork();
      if (pid == 0) {
        int rc = 0;
        try {
          ShmExchange ex(board, r, n, exchange_s);
          body(r, ex);
        } catch (const Error& e) {
          board->code[r].store(static_cast<int>(e.code()) + 1);
          std::snprintf(board->message[r], sizeof board->message[r], "epx::Error: %s", e.what());
          rc = 1;
        } catch (const std::exception& e) {
          std::snprintf(board->message[r], sizeof board->message[r], "%s", e.what());
          rc = 1;
        }
        _exit(rc);
      }
      pids.push_back(pid);
    }
    status.assign(n, -1);
  }
  /// Waits for every rank until `deadline_s`; ranks still running are killed
  /// and reported. Returns "" when all exited 0, else what went wrong.
  std::string wait(double deadline_s) {
    const auto t0 = Clock::now();
    std::string out;
    for (std::size_t r = 0; r < pids.size(); ++r) {
      if (pids[r] <= 0) continue;
      int st = 0;
      pid_t got = 0;
      while ((got = waitpid(pids[r], &st, WNOHANG)) == 0 && since(t0) < deadline_s)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (got == 0) {
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &st, 0);
        out += "rank " + std::to_string(r) + " still running after " + std::to_string(deadline_s) +
               " s (killed); ";
      } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        out += "rank " + std::to_string(r) + " failed (status " + std::to_string(st) +
               "): " + board->message[r] + "; ";
      }
      status[r] = st;
      pids[r] = -1;
    }
    return out;
  }
  void wait_stage(int rank, int at_least, double timeout_s) {
    const auto t0 = Clock::now();
    while (board->stage[rank].load() < at_least && since(t0) < timeout_s)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
};

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

constexpr int kChannels = 2;
constexpr uint64_t kSrc = 128 * 1024;       // the source pattern area
constexpr uint64_t kSeg = 24 * 1024;        // one round's destination segment
constexpr int kRounds = 30;                 // rounds (= signals) per (source, channel, target)
constexpr uint64_t kSlab = kSeg * kRounds;  // per (source, channel) at a target

uint8_t pattern(int rank, uint64_t i) {
  return static_cast<uint8_t>(((i * 2654435761u) >> 11) ^ (rank * 37 + 11));
}
uint64_t slab_off(int src, int c) {
  return kSrc + (static_cast<uint64_t>(src) * kChannels + c) * kSlab;
}
uint64_t sig_off(int src, int c) {
  return kSrc + kSlab * kMaxRanks * kChannels + (static_cast<uint64_t>(src) * kChannels + c) * 8;
}
constexpr uint64_t kRegionBytes = kSrc + kSlab * kMaxRanks * kChannels + 4096;

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
uint64_t check_arrivals(int d, int n, const char* base, double timeout_s) {
  struct Stream {
    int s, c;
    std::vector<Round> rounds;
    std::vector<uint64_t> sums;
    int covered = -1;
    uint64_t last = 0;
  };
  std::vector<Stream> streams;
  for (int s = 0; s < n; ++s)
    for (int c = 0; c < kChannels; ++c) {
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

/// One rank of tests 1 and 3: the engine driven directly, one thread per channel.
void engine_rank(int me, ShmExchange& ex, Board* b, const std::string& provider, uint32_t reorder) {
  const int n = ex.num_ranks();
  std::vector<uint8_t> mem(kRegionBytes, 0);
  for (uint64_t i = 0; i < kSrc; ++i) mem[i] = pattern(me, i);
  LibfabricOptions o;
  o.provider = provider;
  o.timeout_s = 10;
  o.window = 8;  // small: the credits run many laps
  o.test_reorder_window = reorder;
  auto engine = make_libfabric_engine(borrow(ex), kChannels, o);
  engine->register_region(0, mem.data(), mem.size());
  std::vector<std::string> errors(kChannels);
  std::vector<std::thread> senders;
  for (int c = 0; c < kChannels; ++c)
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
    changes = check_arrivals(me, n, reinterpret_cast<const char*>(mem.data()), 20);
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
  expect(s.signals_applied == static_cast<uint64_t>((n - 1) * kChannels * kRounds),
         "signals applied: " + std::to_string(s.signals_applied));
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

// 2. The real Proxy threads and rings over the engine (host memory, no CUDA).
TEST_P(LibfabricEngineTest, ProxyRingsEndToEnd) {
  Ranks ranks;
  const std::string prov = provider();
  ranks.start(2, [&](int me, ShmExchange& ex) {
    const int n = ex.num_ranks();
    std::vector<uint8_t> mem(kRegionBytes, 0);
    for (uint64_t i = 0; i < kSrc; ++i) mem[i] = pattern(me, i);
    LibfabricOptions o;
    o.provider = prov;
    o.timeout_s = 10;
    auto engine = make_libfabric_engine(borrow(ex), kChannels, o);
    engine->register_region(0, mem.data(), mem.size());
    ProxyOptions po;
    po.num_channels = kChannels;
    po.capacity = 64;
    po.device = -1;
    {
      Proxy proxy(*engine, po);
      std::vector<std::string> errors(kChannels);
      std::vector<std::thread> posters;
      for (int c = 0; c < kChannels; ++c)
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
        check_arrivals(me, n, reinterpret_cast<const char*>(mem.data()), 20);
      } catch (const std::exception& e) {
        check_error = e.what();
      }
      for (auto& t : posters) t.join();
      for (const auto& e : errors) expect(e.empty(), e);
      expect(check_error.empty(), check_error);
      proxy.drain(10);
      proxy.check();
      for (int c = 0; c < kChannels; ++c) {
        const ChannelHealth h = proxy.health(c);
        expect(h.completed == h.consumed && h.consumed > 0,
               "channel " + std::to_string(c) + ": consumed " + std::to_string(h.consumed) +
                   ", completed " + std::to_string(h.completed));
      }
      ex.barrier();
    }
    engine->deregister_region(0);
  });
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

// Bad options, each in a forked rank (no libfabric in the test process).
void expect_refused(const LibfabricOptions& o, ErrorCode code,
                    const std::vector<std::string>& words) {
  Ranks ranks;
  ranks.start(1, [&](int, ShmExchange& ex) { make_libfabric_engine(borrow(ex), 1, o); });
  const std::string why = ranks.wait(20);
  ASSERT_FALSE(why.empty()) << "options accepted";
  const std::string msg = ranks.board->message[0];
  EXPECT_EQ(ranks.board->code[0].load(), static_cast<int>(code) + 1) << msg;
  for (const auto& w : words) EXPECT_NE(msg.find(w), std::string::npos) << w << " in: " << msg;
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

}  // namespace
}  // namespace epx::proxy
