// The CPU proxy (transport/proxy): command encoding, the ring protocol under
// many host producers (wrap-around, back-pressure, per-endpoint order),
// channels in parallel, failures, the stop knob and post deadlines, all over
// the host engine (plain memory, simulated ranks). No GPU needed.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.hpp"
#include "transport/proxy/bounds.hpp"
#include "transport/proxy/coalesce.hpp"
#include "transport/proxy/command.hpp"
#include "transport/proxy/host_engine.hpp"
#include "transport/proxy/proxy.hpp"
#include "unit/proxy_test_util.hpp"

namespace epx::proxy {
namespace {

using namespace ptest;  // NOLINT(build/namespaces): the shared test helpers

// ---- encoding -------------------------------------------------------------------

// The layout the GPU poster and the proxy threads both rely on.
static_assert(offsetof(Command, dst_off) == 8 && offsetof(Command, add) == 40 &&
              offsetof(Command, peer) == 48);
static_assert(offsetof(ChannelHost, consumed) == 0 && offsetof(ChannelHost, completed) == 128 &&
              offsetof(ChannelHost, stopped) == 256);
static_assert(seq_of(make_header(kMaxSeq, Op::kSignal, 15)) == kMaxSeq);

TEST(ProxyCommand, HeaderRoundTripsEverySeqOpAndRegion) {
  const uint64_t seqs[] = {0,          1,          2,           255,    256, (1ull << 32) - 1,
                           1ull << 32, 1ull << 48, kMaxSeq - 1, kMaxSeq};
  const Op ops[] = {Op::kNone, Op::kPut, Op::kPutSignal, Op::kSignal};
  int checked = 0;
  for (uint64_t seq : seqs)
    for (Op op : ops)
      for (int region = 0; region < kMaxRegions; ++region) {
        const uint64_t h = make_header(seq, op, region);
        ASSERT_EQ(seq_of(h), seq) << "op " << static_cast<int>(op) << " region " << region;
        ASSERT_EQ(op_of(h), op) << "seq " << seq << " region " << region;
        ASSERT_EQ(region_of(h), region) << "seq " << seq << " op " << static_cast<int>(op);
        ++checked;
      }
  EXPECT_EQ(checked, 10 * 4 * kMaxRegions);
  // The sequence number wraps modulo 2^56 (the proxy compares it that way),
  // and 0 is "never written".
  EXPECT_EQ(seq_of(make_header(kMaxSeq + 1, Op::kPut, 3)), 0u);
  EXPECT_EQ(seq_of(make_header(kMaxSeq + 6, Op::kPut, 3)), 5u);
  EXPECT_EQ(make_header(0, Op::kNone, 0), 0u);
}

// ---- the ring under many producers -------------------------------------------

// R ranks, C channels each, J host producers per (rank, channel), each
// sending N puts to one peer with signals behind them, through rings of 8.
TEST(Proxy, ManyProducersWrapTheRingsKeepOrderAndLoseNothing) {
  constexpr int R = 3, C = 2, J = 2, N = 1200;
  constexpr uint32_t kCapacity = 8;
  constexpr uint64_t kSlot = 64, kSrcBytes = 4096;
  constexpr uint64_t kSigBase = kSrcBytes, kDstBase = kSigBase + 8 * R * C * J;
  constexpr uint64_t kBytes = kDstBase + kSlot * R * C * J * N;
  constexpr uint64_t kPerChannel = J * (N + N / 4);  // commands per (rank, channel)

  auto stream_of = [](int s, int c, int j) { return (s * C + c) * J + j; };
  auto target = [](int s, int j) { return (s + 1 + j) % R; };
  auto src_byte = [](int s, uint64_t k) { return static_cast<char>(1 + (s * 31 + k) % 251); };
  auto src_off = [](int i) { return static_cast<uint64_t>(i) * 24 % (kSrcBytes - kSlot); };
  auto bytes_of = [](int i) { return 8 * (1 + static_cast<uint64_t>(i) % 8); };
  auto dst_off = [&](int stream, int i) { return kDstBase + (stream * uint64_t{N} + i) * kSlot; };

  Ranks ranks(R, C, kBytes);
  for (int s = 0; s < R; ++s)
    for (uint64_t k = 0; k < kSrcBytes; ++k) ranks.base(s)[k] = src_byte(s, k);
  std::vector<std::unique_ptr<Proxy>> proxies;
  ProxyOptions opt;
  opt.num_channels = C;
  opt.capacity = kCapacity;
  for (int r = 0; r < R; ++r) proxies.push_back(std::make_unique<Proxy>(*ranks.engines[r], opt));
  ASSERT_EQ(proxies[0]->view(0).capacity, kCapacity);

  std::mutex report_m;
  std::vector<std::string> reports;
  auto report = [&](std::string what) {
    std::lock_guard lock(report_m);
    if (reports.size() < 10) reports.push_back(std::move(what));
  };

  // Per producer: put i; every 4th (i % 4 == 0) as a put_signal adding 1,
  // the others as puts, with one signal adding 3 behind i % 4 == 3. The
  // word at the target thus counts the puts known to have landed.
  auto produce = [&](int s, int c, int j) {
    const ChannelView v = proxies[s]->view(c);
    const uint32_t p = target(s, j);
    const uint64_t sig = kSigBase + 8 * stream_of(s, c, j);
    for (int i = 0; i < N; ++i) {
      Command cmd = put_cmd(p, dst_off(stream_of(s, c, j), i), src_off(i), bytes_of(i));
      if (i % 4 == 0) {
        cmd.sig_off = sig;
        cmd.add = 1;
        post_from_host(v, cmd, Op::kPutSignal, 0, 10.0, c);
      } else {
        post_from_host(v, cmd, Op::kPut, 0, 10.0, c);
      }
      if (i % 4 == 3) post_from_host(v, signal_cmd(p, sig, 3), Op::kSignal, 0, 10.0, c);
    }
  };
  // Rank p checks, while the producers run, that whenever a word says v
  // puts landed, the first v puts of that stream are there, byte for byte,
  // and nothing past their bytes.
  std::atomic<uint64_t> verified{0};
  auto consume = [&](int p) {
    std::vector<uint64_t> seen(R * C * J, 0);
    const auto start = Clock::now();
    for (bool done = false; !done;) {
      done = true;
      for (int s = 0; s < R; ++s)
        for (int c = 0; c < C; ++c)
          for (int j = 0; j < J; ++j) {
            if (target(s, j) != p) continue;
            const int st = stream_of(s, c, j);
            const uint64_t v = load(ranks.word(p, kSigBase + 8 * st));
            if (v < seen[st] || v > N)
              report("rank " + std::to_string(p) + " stream " + std::to_string(st) +
                     ": signal went from " + std::to_string(seen[st]) + " to " + std::to_string(v));
            for (uint64_t i = seen[st]; i < v && i < N; ++i) {
              const char* got = ranks.base(p) + dst_off(st, static_cast<int>(i));
              const uint64_t n = bytes_of(static_cast<int>(i));
              for (uint64_t k = 0; k < kSlot; ++k) {
                const char want = k < n ? src_byte(s, src_off(static_cast<int>(i)) + k) : 0;
                if (got[k] != want) {
                  report("rank " + std::to_string(p) + " stream " + std::to_string(st) + ": put " +
                         std::to_string(i) + " byte " + std::to_string(k) +
                         " wrong while the signal said " + std::to_string(v));
                  break;
                }
              }
              verified.fetch_add(1, std::memory_order_relaxed);
            }
            seen[st] = std::max(seen[st], v);
            if (v < N) done = false;
          }
      if (seconds_since(start) > 20) {
        report("rank " + std::to_string(p) + ": the signals did not reach " + std::to_string(N));
        return;
      }
      std::this_thread::yield();
    }
  };

  std::vector<std::exception_ptr> errors(R * C * J);
  {
    std::vector<std::jthread> threads;
    for (int p = 0; p < R; ++p) threads.emplace_back(consume, p);
    for (int s = 0; s < R; ++s)
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < J; ++j)
          threads.emplace_back([&, s, c, j] {
            try {
              produce(s, c, j);
            } catch (...) {
              errors[stream_of(s, c, j)] = std::current_exception();
            }
          });
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (const auto& r : reports) ADD_FAILURE() << r;
  EXPECT_EQ(verified.load(), uint64_t{R} * C * J * N);

  for (int s = 0; s < R; ++s)
    for (int c = 0; c < C; ++c) {
      const ChannelView v = proxies[s]->view(c);
      EXPECT_TRUE(wait_until([&] {
        return load(v.host->consumed) == kPerChannel && load(v.host->completed) == kPerChannel;
      })) << "rank "
          << s << " channel " << c << ": consumed " << load(v.host->consumed) << ", completed "
          << load(v.host->completed) << " of " << kPerChannel;
      EXPECT_EQ(load(v.dev->reserved), kPerChannel);
      // The ring went round hundreds of times.
      EXPECT_GE(load(v.host->consumed) / kCapacity, 300u);
      const ChannelHealth h = proxies[s]->health(c);
      EXPECT_EQ(h.state, ChannelHealth::State::kRunning) << h.message;
      EXPECT_EQ(h.consumed, kPerChannel);
      EXPECT_EQ(load(v.host->stopped), 0u);
    }
  for (int s = 0; s < R; ++s) {
    EXPECT_NO_THROW(proxies[s]->check());
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < J; ++j)
        EXPECT_EQ(load(ranks.word(target(s, j), kSigBase + 8 * stream_of(s, c, j))), uint64_t{N})
            << "signal of rank " << s << " channel " << c << " producer " << j;
  }
  // Nothing but the puts' bytes and the signal words changed at any rank.
  for (int p = 0; p < R; ++p)
    for (uint64_t k = 0; k < kSrcBytes; ++k)
      ASSERT_EQ(ranks.base(p)[k], src_byte(p, k)) << "rank " << p << " source byte " << k;
}

// ---- channels in parallel, back-pressure ------------------------------------

/// The host engine, with channel `gated`'s puts held until open() (at most 10 s).
class GatedEngine final : public Engine {
 public:
  GatedEngine(Engine& inner, int gated) : inner_(inner), gated_(gated) {}
  void open() { open_.store(true); }
  /// Puts that reached the gated channel's put (held there until open()).
  int held() const { return held_.load(); }

  const char* name() const override { return "gated"; }
  int rank() const override { return inner_.rank(); }
  int num_ranks() const override { return inner_.num_ranks(); }
  int num_channels() const override { return inner_.num_channels(); }
  void register_region(int id, void* base, std::size_t bytes) override {
    inner_.register_region(id, base, bytes);
  }
  void deregister_region(int id) override { inner_.deregister_region(id); }
  void check_put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
                 uint64_t bytes) const override {
    inner_.check_put(channel, peer, region, dst_off, src_off, bytes);
  }
  bool reaches(int peer) const override { return inner_.reaches(peer); }
  void put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
           uint64_t bytes) override {
    if (channel == gated_) held_.fetch_add(1);
    if (channel == gated_ && !wait_until([&] { return open_.load(); }))
      throw Error(ErrorCode::kTimeout, "gated engine: the gate never opened");
    inner_.put(channel, peer, region, dst_off, src_off, bytes);
  }
  void signal_add(int channel, int peer, int region, uint64_t sig_off, uint64_t add) override {
    inner_.signal_add(channel, peer, region, sig_off, add);
  }
  void reset_signals(int id) override { inner_.reset_signals(id); }
  void mark(int channel, uint64_t token) override { inner_.mark(channel, token); }
  uint64_t completed(int channel) override { return inner_.completed(channel); }

 private:
  Engine& inner_;
  const int gated_;
  std::atomic<bool> open_{false};
  std::atomic<int> held_{0};
};

/// Two ranks of `channels` channels and `bytes` each; rank 0's engine held
/// on channel `gated_channel` (GatedEngine) and rank 0's proxy over it,
/// `capacity` commands per channel.
struct GatedProxy {
  GatedProxy(int channels, uint32_t capacity, std::size_t bytes, int gated_channel)
      : ranks(2, channels, bytes),
        gated(*ranks.engines[0], gated_channel),
        proxy(gated, options(channels, capacity)) {}
  static ProxyOptions options(int channels, uint32_t capacity) {
    ProxyOptions opt;
    opt.num_channels = channels;
    opt.capacity = capacity;
    return opt;
  }
  Ranks ranks;
  GatedEngine gated;
  Proxy proxy;
};

// Channel 0's engine is held: its posters fill the ring and then wait (they
// never overwrite a slot the proxy has not taken), while the other channels'
// threads carry on; once the gate opens, channel 0 drains too.
TEST(Proxy, ChannelsRunInParallelAndAFullRingHoldsItsPosters) {
  constexpr int C = 4;
  constexpr uint32_t kCapacity = 16;
  constexpr uint64_t kPosts = 3 * kCapacity;  // puts per channel, each with a signal
  constexpr uint64_t kSigBase = 0, kDstBase = 4096, kBytes = kDstBase + C * kPosts * 64;
  GatedProxy g(C, kCapacity, kBytes, 0);
  Ranks& ranks = g.ranks;
  GatedEngine& gated = g.gated;
  Proxy& proxy = g.proxy;
  for (uint64_t k = 0; k < 4096; ++k) ranks.base(0)[k] = static_cast<char>(k % 127 + 1);

  std::vector<std::atomic<uint64_t>> posted(C);
  std::vector<std::exception_ptr> errors(C);
  {
    std::vector<std::jthread> producers;
    for (int c = 0; c < C; ++c)
      producers.emplace_back([&, c] {
        try {
          const ChannelView v = proxy.view(c);
          for (uint64_t i = 0; i < kPosts; ++i) {
            Command cmd = put_cmd(1, kDstBase + (c * kPosts + i) * 64, i * 8, 64);
            cmd.sig_off = kSigBase + 8 * c;
            cmd.add = 1;
            post_from_host(v, cmd, Op::kPutSignal, 0, 10.0, c);
            posted[c].fetch_add(1);
          }
        } catch (...) {
          errors[c] = std::current_exception();
        }
      });
    for (int c = 1; c < C; ++c) {
      const ChannelView v = proxy.view(c);
      EXPECT_TRUE(wait_until([&] { return load(v.host->completed) == kPosts; }))
          << "channel " << c << " completed " << load(v.host->completed);
      EXPECT_EQ(load(ranks.word(1, kSigBase + 8 * c)), kPosts) << "channel " << c;
    }
    // Channel 0: the proxy holds command 0 in the engine, so the ring holds
    // exactly `capacity` commands and the producer waits for slot `capacity`.
    EXPECT_TRUE(wait_until([&] { return posted[0].load() == kCapacity; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(posted[0].load(), kCapacity);
    EXPECT_EQ(load(proxy.view(0).host->consumed), 0u);
    EXPECT_EQ(load(ranks.word(1, kSigBase)), 0u);
    gated.open();
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  const ChannelView v0 = proxy.view(0);
  EXPECT_TRUE(wait_until([&] { return load(v0.host->completed) == kPosts; }));
  EXPECT_EQ(load(ranks.word(1, kSigBase)), kPosts);
  for (int c = 0; c < C; ++c)
    for (uint64_t i = 0; i < kPosts; ++i)
      ASSERT_EQ(
          std::memcmp(ranks.base(1) + kDstBase + (c * kPosts + i) * 64, ranks.base(0) + i * 8, 64),
          0)
          << "channel " << c << " put " << i;
  EXPECT_NO_THROW(proxy.check());
}

/// The host engine, but a mark completes only once the test allows its token.
class DeferredEngine final : public Engine {
 public:
  explicit DeferredEngine(Engine& inner) : inner_(inner) {}
  void allow(uint64_t token) {
    std::lock_guard lock(m_);
    allowed_ = token;
  }
  std::vector<uint64_t> marks() {
    std::lock_guard lock(m_);
    return marks_;
  }
  uint64_t completed_calls() const { return completed_calls_.load(); }

  const char* name() const override { return "deferred"; }
  int rank() const override { return inner_.rank(); }
  int num_ranks() const override { return inner_.num_ranks(); }
  int num_channels() const override { return inner_.num_channels(); }
  void register_region(int id, void* base, std::size_t bytes) override {
    inner_.register_region(id, base, bytes);
  }
  void reset_signals(int id) override { inner_.reset_signals(id); }
  void deregister_region(int id) override { inner_.deregister_region(id); }
  void check_put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
                 uint64_t bytes) const override {
    inner_.check_put(channel, peer, region, dst_off, src_off, bytes);
  }
  bool reaches(int peer) const override { return inner_.reaches(peer); }
  void put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
           uint64_t bytes) override {
    inner_.put(channel, peer, region, dst_off, src_off, bytes);
  }
  void signal_add(int channel, int peer, int region, uint64_t sig_off, uint64_t add) override {
    inner_.signal_add(channel, peer, region, sig_off, add);
  }
  void mark(int, uint64_t token) override {
    std::lock_guard lock(m_);
    marks_.push_back(token);
  }
  uint64_t completed(int) override {
    completed_calls_.fetch_add(1);
    std::lock_guard lock(m_);
    uint64_t done = 0;
    for (uint64_t t : marks_)
      if (t <= allowed_) done = t;
    return done;
  }

 private:
  Engine& inner_;
  std::mutex m_;
  std::vector<uint64_t> marks_;
  uint64_t allowed_ = 0;
  std::atomic<uint64_t> completed_calls_{0};
};

// ChannelHost::completed follows the engine's completed tokens, never runs
// ahead of them, and the idle thread keeps polling until everything completed.
// drain() (what a clean waits for): it returns once every reserved command is
// complete, and times out naming the channel while one is held in the engine.
TEST(Proxy, DrainWaitsForEveryReservedCommand) {
  GatedProxy g(2, 16, 8192, 1);
  GatedEngine& gated = g.gated;
  Proxy& proxy = g.proxy;
  for (int c = 0; c < 2; ++c)
    for (uint64_t i = 0; i < 5; ++i)
      post_from_host(proxy.view(c), put_cmd(1, 4096 + (c * 5 + i) * 64, i * 8, 64), Op::kPut, 0,
                     10.0, c);
  try {
    proxy.drain(0.2);  // channel 1's first put waits at the gate
    ADD_FAILURE() << "drain returned while channel 1 held a command";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("proxy channel 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(load(proxy.view(0).host->completed), 5u);  // channel 0 was drained first
  gated.open();
  proxy.drain(10.0);
  for (int c = 0; c < 2; ++c) EXPECT_EQ(load(proxy.view(c).host->completed), 5u) << c;
}

// The traffic totals a bench reads (Buffer::network_traffic): every command,
// the puts and their bytes, the signals, and the engine writes the puts
// became. The first put is issued alone (the ring went idle) and held at the
// gate while the rest are posted, so the thread then takes those 40 in one
// go and merges them into one write.
TEST(Proxy, TrafficCountsCommandsPutsBytesSignalsAndWrites) {
  constexpr uint64_t kRow = 64, kRows = 41, kDst = 8192, kSig = 4096;
  GatedProxy g(1, 128, 1 << 15, 0);
  Proxy& proxy = g.proxy;
  EXPECT_EQ(proxy.traffic(0).commands, 0u);
  post_from_host(proxy.view(0), put_cmd(1, kDst, 0, kRow), Op::kPut, 0, 10.0, 0);
  ASSERT_TRUE(wait_until([&] { return g.gated.held() == 1; }));  // issued alone, on idle
  for (uint64_t i = kRows - 1; i >= 1; --i)                      // backwards: the merge sorts them
    post_from_host(proxy.view(0), put_cmd(1, kDst + i * kRow, i * kRow, kRow), Op::kPut, 0, 10.0,
                   0);
  post_from_host(proxy.view(0), signal_cmd(1, kSig, 3), Op::kSignal, 0, 10.0, 0);
  g.gated.open();
  ASSERT_TRUE(wait_until([&] { return load(g.ranks.word(1, kSig)) == 3; }));
  proxy.drain(10.0);
  const NetworkTraffic t = proxy.traffic(0);
  EXPECT_EQ(t.commands, kRows + 1);
  EXPECT_EQ(t.puts, kRows);
  EXPECT_EQ(t.put_bytes, kRows * kRow);
  EXPECT_EQ(t.signals, 1u);
  EXPECT_EQ(t.writes, 2u);                // the gated first put, then one merged run
  EXPECT_THROW(proxy.traffic(1), Error);  // names the channel range
}

// A step the engine holds for seconds (the CUDA IPC engine's calls behind a
// blocking primary-context call elsewhere in the process) is kept for the
// timeout messages: its length and kind, on its channel only, reported once.
TEST(Proxy, AStepHeldInTheEngineIsReportedOnce) {
  GatedProxy g(2, 16, 8192, 1);
  GatedEngine& gated = g.gated;
  Proxy& proxy = g.proxy;
  for (int c = 0; c < 2; ++c)
    post_from_host(proxy.view(c), put_cmd(1, 4096 + c * 64, 0, 64), Op::kPut, 0, 10.0, c);
  const double held = Proxy::kSlowEngineCallS + 0.3;
  std::this_thread::sleep_for(std::chrono::duration<double>(held));
  gated.open();
  proxy.drain(10.0);
  const Proxy::SlowCall slow = proxy.take_slow_call(1);
  EXPECT_GE(slow.seconds, held - 0.05);
  EXPECT_LT(slow.seconds, held + 5.0);
  EXPECT_NE(std::string(slow.what), "");
  EXPECT_EQ(proxy.take_slow_call(1).seconds, 0.0) << "reported once";
  EXPECT_EQ(proxy.take_slow_call(0).seconds, 0.0) << "channel 0 was never held";
  EXPECT_THROW(proxy.take_slow_call(2), Error);
}

TEST(Proxy, CompletionFollowsTheEngineAndIsPolledWhileIdle) {
  constexpr uint64_t kPosts = 600, kMarkEvery = 256;
  Ranks ranks(2, 1, 4096);
  DeferredEngine engine(*ranks.engines[0]);
  ProxyOptions opt;
  opt.capacity = 1024;
  Proxy proxy(engine, opt);
  const ChannelView v = proxy.view(0);
  for (uint64_t i = 0; i < kPosts; ++i) post_from_host(v, signal_cmd(1, 0, 1), Op::kSignal, 0, 5.0);
  ASSERT_TRUE(wait_until([&] { return load(v.host->consumed) == kPosts; }));
  // Marks: increasing consumed counts, at most kMarkEvery commands apart, the last
  // one at the end of the burst.
  ASSERT_TRUE(wait_until([&] {
    const auto m = engine.marks();
    return !m.empty() && m.back() == kPosts;
  }));
  const std::vector<uint64_t> marks = engine.marks();
  for (std::size_t i = 0; i < marks.size(); ++i) {
    const uint64_t before = i ? marks[i - 1] : 0;
    EXPECT_GT(marks[i], before) << "mark " << i;
    EXPECT_LE(marks[i] - before, kMarkEvery) << "mark " << i;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(load(v.host->completed), 0u) << "nothing completed yet";

  // Part of it completes: the newest mark at or below 300.
  uint64_t partial = 0;
  for (uint64_t t : marks)
    if (t <= 300) partial = t;
  ASSERT_GT(partial, 0u);
  engine.allow(300);
  EXPECT_TRUE(wait_until([&] { return load(v.host->completed) == partial; }))
      << "completed " << load(v.host->completed) << ", want " << partial;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(load(v.host->completed), partial);

  // The rest completes with no new command coming: the idle thread polls.
  const uint64_t calls = engine.completed_calls();
  engine.allow(kPosts);
  EXPECT_TRUE(wait_until([&] { return load(v.host->completed) == kPosts; }));
  EXPECT_GT(engine.completed_calls(), calls);
  EXPECT_EQ(proxy.health(0).completed, kPosts);
  EXPECT_EQ(engine.marks().size(), marks.size()) << "no mark without new commands";
}

// ---- failures -------------------------------------------------------------------

TEST(Proxy, AnEngineErrorFailsTheChannelNamingTheCommand) {
  constexpr uint64_t kBytes = 4096;
  Ranks ranks(2, 2, kBytes);
  ProxyOptions opt;
  opt.num_channels = 2;
  opt.capacity = 16;
  Proxy proxy(*ranks.engines[0], opt);
  const ChannelView v = proxy.view(1);
  for (int i = 0; i < 5; ++i) post_from_host(v, put_cmd(1, 64 * i, 0, 64), Op::kPut, 0, 5.0, 1);
  // Slot 5: 64 bytes at 4040 run past the peer's 4096-byte region.
  Command bad = put_cmd(1, 4040, 8, 64);
  bad.sig_off = 16;
  bad.add = 7;
  EXPECT_EQ(post_from_host(v, bad, Op::kPutSignal, 0, 5.0, 1), 5u);
  ASSERT_TRUE(wait_until([&] { return load(v.host->stopped) == 1u; }));

  const ChannelHealth h = proxy.health(1);
  EXPECT_EQ(h.state, ChannelHealth::State::kFailed);
  EXPECT_EQ(h.consumed, 5u);
  for (const char* part :
       {"proxy channel 1", "slot 5", "op put_signal", "peer 1", "region 0", "dst_off 4040",
        "src_off 8", "bytes 64", "sig_off 16", "add 7", "out of bounds", "4096 bytes"})
    EXPECT_NE(h.message.find(part), std::string::npos) << "'" << part << "' in: " << h.message;
  // Nothing of the bad put landed, nor its signal.
  EXPECT_EQ(load(ranks.word(1, 4088)), 0u);
  EXPECT_EQ(load(ranks.word(1, 16)), 0u);

  const std::string checked = error_of([&] { proxy.check(); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(checked.find(h.message), std::string::npos) << checked;

  // A post to the dead channel gives up at once, though its deadline is long.
  const auto start = Clock::now();
  const std::string refused = error_of(
      [&] { post_from_host(v, put_cmd(1, 0, 0, 8), Op::kPut, 0, 30.0, 1); }, ErrorCode::kInternal);
  EXPECT_LT(seconds_since(start), 1.0);
  EXPECT_NE(refused.find("proxy channel 1"), std::string::npos) << refused;
  EXPECT_NE(refused.find("stopped"), std::string::npos) << refused;

  // The other channel carries on.
  EXPECT_EQ(proxy.health(0).state, ChannelHealth::State::kRunning);
  const ChannelView v0 = proxy.view(0);
  EXPECT_EQ(load(v0.host->stopped), 0u);
  post_from_host(v0, signal_cmd(1, 24, 5), Op::kSignal, 0, 5.0, 0);
  EXPECT_TRUE(wait_until([&] { return load(v0.host->completed) == 1u; }));
  EXPECT_EQ(load(ranks.word(1, 24)), 5u);
}

TEST(Proxy, AMalformedCommandFailsTheChannel) {
  struct Case {
    Op op;
    Command cmd;
    const char* why;
  };
  const Case cases[] = {
      {Op::kNone, put_cmd(1, 0, 0, 8), "unknown op"},
      {static_cast<Op>(9), put_cmd(1, 0, 0, 8), "op 9"},
      {Op::kPut, put_cmd(2, 0, 0, 8), "peer is not a rank"},
      {Op::kPut, put_cmd(1, 0, 0, 0), "a put of 0 bytes"},
  };
  Ranks ranks(2, 1, 4096);
  for (const Case& k : cases) {
    ProxyOptions opt;
    opt.capacity = 8;
    Proxy proxy(*ranks.engines[0], opt);
    const ChannelView v = proxy.view(0);
    post_from_host(v, signal_cmd(1, 0, 1), Op::kSignal, 0, 5.0);
    post_from_host(v, k.cmd, k.op, 0, 5.0);
    ASSERT_TRUE(wait_until([&] { return load(v.host->stopped) == 1u; })) << k.why;
    const ChannelHealth h = proxy.health(0);
    EXPECT_EQ(h.state, ChannelHealth::State::kFailed);
    EXPECT_EQ(h.consumed, 1u);
    EXPECT_NE(h.message.find("malformed command at slot 1"), std::string::npos) << h.message;
    EXPECT_NE(h.message.find(k.why), std::string::npos) << h.message;
    error_of([&] { proxy.check(); }, ErrorCode::kInternal);
  }
  EXPECT_EQ(load(ranks.word(1, 0)), 4u);  // each proxy's good signal, and nothing else
}

TEST(Proxy, TheStopKnobStopsAChannelAfterExactlyNCommands) {
  for (uint64_t n : {uint64_t{0}, uint64_t{37}}) {
    Ranks ranks(2, 2, 4096);
    ProxyOptions opt;
    opt.num_channels = 2;
    opt.capacity = 8;
    opt.stop_channel = 1;
    opt.stop_after = n;
    Proxy proxy(*ranks.engines[0], opt);
    const ChannelView v = proxy.view(1);
    // Posts until refused: the poster waiting for a free slot gives up as
    // soon as the channel reports it stopped, long before its deadline.
    uint64_t accepted = 0;
    const auto start = Clock::now();
    const std::string refused = error_of(
        [&] {
          for (int i = 0; i < 1000; ++i) {
            post_from_host(v, signal_cmd(1, 8, 1), Op::kSignal, 0, 30.0, 1);
            ++accepted;
          }
        },
        ErrorCode::kInternal);
    EXPECT_LT(seconds_since(start), 5.0);
    EXPECT_NE(refused.find("proxy channel 1"), std::string::npos) << refused;
    EXPECT_GE(accepted, n);
    EXPECT_LE(accepted, n + opt.capacity);

    ASSERT_TRUE(wait_until([&] { return load(v.host->stopped) == 1u; }));
    const ChannelHealth h = proxy.health(1);
    EXPECT_EQ(h.state, ChannelHealth::State::kStopped);
    EXPECT_EQ(h.consumed, n);
    EXPECT_EQ(h.message, "proxy channel 1 stopped by EPX_DEBUG_PROXY_STOP after " +
                             std::to_string(n) + " commands");
    EXPECT_EQ(load(ranks.word(1, 8)), n) << "the engine got exactly n commands";
    EXPECT_EQ(error_of([&] { proxy.check(); }, ErrorCode::kInternal), "epx: " + h.message);
    EXPECT_EQ(proxy.health(0).state, ChannelHealth::State::kRunning);
  }
}

TEST(Proxy, StopIsIdempotentAndRefusesLaterPosts) {
  Ranks ranks(2, 3, 4096);
  ProxyOptions opt;
  opt.num_channels = 3;
  opt.capacity = 5;  // rounded up
  auto proxy = std::make_unique<Proxy>(*ranks.engines[0], opt);
  EXPECT_EQ(proxy->num_channels(), 3);
  const ChannelView v = proxy->view(2);
  EXPECT_EQ(v.capacity, 8u);
  EXPECT_EQ(proxy->views_device()[2].ring, v.ring);
  for (int i = 0; i < 20; ++i) post_from_host(v, signal_cmd(1, 0, 2), Op::kSignal, 0, 5.0, 2);
  ASSERT_TRUE(wait_until([&] { return load(v.host->completed) == 20u; }));
  proxy->stop();
  proxy->stop();
  for (int c = 0; c < 3; ++c) {
    const ChannelHealth h = proxy->health(c);
    EXPECT_EQ(h.state, ChannelHealth::State::kStopped) << c;
    EXPECT_NE(h.message.find("proxy channel " + std::to_string(c) + " stopped by Proxy::stop"),
              std::string::npos)
        << h.message;
    EXPECT_EQ(load(proxy->view(c).host->stopped), 1u);
  }
  EXPECT_EQ(proxy->health(2).consumed, 20u);
  error_of([&] { post_from_host(v, signal_cmd(1, 0, 2), Op::kSignal, 0, 5.0, 2); },
           ErrorCode::kInternal);
  proxy.reset();  // the destructor after stop()
  EXPECT_EQ(load(ranks.word(1, 0)), 40u);
}

TEST(Proxy, OptionsAreChecked) {
  Ranks ranks(1, 2, 4096);
  auto make = [&](ProxyOptions o) { Proxy p(*ranks.engines[0], o); };
  ProxyOptions o;
  o.num_channels = 3;  // the engine has 2
  EXPECT_NE(error_of([&] { make(o); }, ErrorCode::kInvalidArgument).find("num_channels"),
            std::string::npos);
  o = {};
  o.capacity = 0;
  EXPECT_NE(error_of([&] { make(o); }, ErrorCode::kInvalidArgument).find("capacity"),
            std::string::npos);
  o = {};
  o.stop_channel = 1;  // one channel only
  EXPECT_NE(error_of([&] { make(o); }, ErrorCode::kInvalidArgument).find("stop_channel"),
            std::string::npos);
}

// ---- post_from_host without a proxy ---------------------------------------------

TEST(PostFromHost, AFullRingTimesOutNamingTheChannelAndSlot) {
  constexpr uint32_t kCapacity = 8;
  std::vector<Command> ring(kCapacity);
  auto host = std::make_unique<ChannelHost>();
  auto dev = std::make_unique<ChannelDevice>();
  std::memset(ring.data(), 0, sizeof(Command) * kCapacity);
  std::memset(host.get(), 0, sizeof(ChannelHost));
  std::memset(dev.get(), 0, sizeof(ChannelDevice));
  const ChannelView v{ring.data(), host.get(), dev.get(), kCapacity};

  for (uint64_t i = 0; i < kCapacity; ++i) {
    Command cmd = put_cmd(static_cast<uint32_t>(i), 100 + i, 200 + i, 300 + i);
    cmd.sig_off = 400 + i;
    cmd.add = 500 + i;
    cmd.reserved0 = 77;  // not copied
    EXPECT_EQ(post_from_host(v, cmd, Op::kPutSignal, static_cast<int>(i), 0.1, 3), i);
  }
  for (uint64_t i = 0; i < kCapacity; ++i) {
    const Command& c = ring[i];
    EXPECT_EQ(c.header, make_header(i + 1, Op::kPutSignal, static_cast<int>(i)));
    EXPECT_EQ(c.dst_off, 100 + i);
    EXPECT_EQ(c.src_off, 200 + i);
    EXPECT_EQ(c.bytes, 300 + i);
    EXPECT_EQ(c.sig_off, 400 + i);
    EXPECT_EQ(c.add, 500 + i);
    EXPECT_EQ(c.peer, i);
    EXPECT_EQ(c.reserved0, 0u);
  }
  const auto start = Clock::now();
  const std::string msg = error_of(
      [&] { post_from_host(v, put_cmd(0, 0, 0, 8), Op::kPut, 0, 0.2, 3); }, ErrorCode::kTimeout);
  const double waited = seconds_since(start);
  EXPECT_GE(waited, 0.2);
  EXPECT_LT(waited, 2.0);
  EXPECT_NE(msg.find("proxy channel 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("slot 8"), std::string::npos) << msg;
  EXPECT_EQ(ring[0].header, make_header(1, Op::kPutSignal, 0)) << "slot 0 was overwritten";

  // Slot 8 stays a hole (reserved, never written); the next post gets slot
  // 9, free once the consumer has taken two commands.
  host->consumed = 2;
  EXPECT_EQ(post_from_host(v, signal_cmd(1, 8, 1), Op::kSignal, 2, 0.1, 3), 9u);
  EXPECT_EQ(ring[1].header, make_header(10, Op::kSignal, 2));
}

}  // namespace
}  // namespace epx::proxy
