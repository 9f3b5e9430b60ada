// Faults through the Proxy over the libfabric engine (LibfabricProxyFaultTest,
// 3 forked ranks, 2 channels, tcp;ofi_rxm and shm on host memory): a peer
// SIGKILLed or SIGSTOPped while the others wait inside an op for its
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
using forked::Board;
using forked::Clock;
using forked::expect;
using forked::kMaxRanks;
using forked::since;

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
                         ::testing::Values("tcp;ofi_rxm", "shm"), provider_test_name);

}  // namespace
}  // namespace epx::proxy
