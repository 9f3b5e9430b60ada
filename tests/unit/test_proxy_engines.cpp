// The CPU proxy's engines without a GPU: the coalescer (fewer engine calls,
// the same bytes, signals and fences kept in order), the host engine's checks
// and the CUDA IPC engine's bounds arithmetic.
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

// ---- coalescing: fewer engine calls, same bytes --------------------------------

/// Records the calls a Coalescer makes (no memory moves).
class RecordingEngine final : public Engine {
 public:
  struct Call {
    std::string op;
    int peer;
    uint64_t dst, src, bytes, dst_pitch, src_pitch, rows;
  };
  std::vector<Call> calls;
  /// Every region's size on every rank, what check_put bounds puts by.
  uint64_t region_bytes = uint64_t{1} << 40;
  /// check_put accepts anything (what merging alone must then keep apart).
  bool lax = false;

  const char* name() const override { return "recording"; }
  void check_put(int, int peer, int region, uint64_t dst_off, uint64_t src_off,
                 uint64_t bytes) const override {
    if (!lax)
      check_put_range("recording", "put", 0, peer, region, dst_off, src_off, bytes, region_bytes,
                      region_bytes);
  }
  int rank() const override { return 0; }
  int num_ranks() const override { return 4; }
  int num_channels() const override { return 1; }
  void register_region(int, void*, std::size_t) override {}
  void deregister_region(int) override {}
  bool reaches(int) const override { return true; }
  void put(int, int peer, int, uint64_t dst_off, uint64_t src_off, uint64_t bytes) override {
    calls.push_back({"put", peer, dst_off, src_off, bytes, 0, 0, 1});
  }
  void put_strided(int, int peer, int, uint64_t dst_off, uint64_t dst_pitch, uint64_t src_off,
                   uint64_t src_pitch, uint64_t width, uint64_t rows) override {
    calls.push_back({"strided", peer, dst_off, src_off, width, dst_pitch, src_pitch, rows});
  }
  void signal_add(int, int peer, int, uint64_t sig_off, uint64_t add) override {
    calls.push_back({"signal", peer, sig_off, 0, add, 0, 0, 0});
  }
  void reset_signals(int) override {}
  void mark(int, uint64_t) override {}
  uint64_t completed(int) override { return 0; }
};

// Rows of one width at one pitch, taken out of order (as warps finish them),
// go out as one strided copy per peer; a contiguous run as one put.
TEST(Coalescer, RunsBecomeOneCopyWhateverTheOrder) {
  RecordingEngine e;
  Coalescer q(e, 0, 4);
  const uint64_t kRow = 7392, kPitch = 14336;
  for (int t : {3, 0, 1, 5, 2, 4, 7, 6}) {
    q.put(1, 0, 1000 + t * kPitch, 50000 + t * kPitch, kRow);
    q.put(2, 0, 1000 + t * kPitch, 50000 + t * kPitch, kRow);
  }
  for (int k : {2, 0, 1}) q.put(3, 0, 64 + 100 * k, 8 + 100 * k, 100);
  EXPECT_EQ(q.queued(), 19u);
  EXPECT_TRUE(e.calls.empty());  // nothing issued before a flush
  q.flush_all();
  EXPECT_EQ(q.queued(), 0u);
  ASSERT_EQ(e.calls.size(), 3u);
  for (const auto& c : e.calls) {
    if (c.peer == 3) {
      EXPECT_EQ(c.op, "put");
      EXPECT_EQ(c.dst, 64u);
      EXPECT_EQ(c.src, 8u);
      EXPECT_EQ(c.bytes, 300u);
    } else {
      EXPECT_EQ(c.op, "strided");
      EXPECT_EQ(c.dst, 1000u);
      EXPECT_EQ(c.src, 50000u);
      EXPECT_EQ(c.bytes, kRow);
      EXPECT_EQ(c.dst_pitch, kPitch);
      EXPECT_EQ(c.src_pitch, kPitch);
      EXPECT_EQ(c.rows, 8u);
    }
  }
}

// A signal to a peer issues that peer's queued puts first (and only those).
TEST(Coalescer, ASignalFollowsThePutsQueuedBeforeIt) {
  RecordingEngine e;
  Coalescer q(e, 0, 4);
  q.put(1, 0, 0, 0, 64);
  q.put(2, 0, 0, 0, 64);
  q.put(1, 0, 64, 64, 64);
  q.flush(1);
  e.signal_add(0, 1, 0, 4096, 1);
  ASSERT_EQ(e.calls.size(), 2u);
  EXPECT_EQ(e.calls[0].op, "put");
  EXPECT_EQ(e.calls[0].peer, 1);
  EXPECT_EQ(e.calls[0].bytes, 128u);
  EXPECT_EQ(e.calls[1].op, "signal");
  EXPECT_EQ(q.queued(), 1u);  // peer 2's put waits for its own flush
  q.flush_all();
  ASSERT_EQ(e.calls.size(), 3u);
  EXPECT_EQ(e.calls[2].peer, 2);
}

// Puts whose destinations overlap keep the order they were taken in (the
// later bytes win); irregular ones stay single puts; a full queue is issued.
TEST(Coalescer, OverlapsKeepTheirOrderAndAFullQueueIsIssued) {
  RecordingEngine e;
  Coalescer q(e, 0, 4, 4);
  q.put(1, 0, 128, 0, 64);
  q.put(1, 0, 100, 64, 64);  // overlaps the first
  q.put(1, 0, 0, 128, 8);
  q.flush(1);
  ASSERT_EQ(e.calls.size(), 3u);
  EXPECT_EQ(e.calls[0].dst, 128u);
  EXPECT_EQ(e.calls[1].dst, 100u);
  EXPECT_EQ(e.calls[2].dst, 0u);
  e.calls.clear();
  // Unequal widths and a descending source: no run.
  q.put(2, 0, 0, 512, 16);
  q.put(2, 0, 32, 256, 16);
  q.put(2, 0, 64, 0, 32);
  EXPECT_TRUE(e.calls.empty());
  q.put(2, 0, 128, 1024, 16);  // the fourth: the queue is issued
  EXPECT_EQ(q.queued(), 0u);
  ASSERT_EQ(e.calls.size(), 4u);
  for (const auto& c : e.calls) EXPECT_EQ(c.op, "put");
}

// Over the host engine through a proxy: strided rows posted in a scrambled
// order land byte for byte, with the signal after them.
TEST(Coalescer, ScrambledRowsLandThroughAProxy) {
  constexpr uint64_t kRow = 40, kPitch = 64, kRows = 200, kDst = 65536, kSig = 60000;
  Ranks ranks(2, 1, 1 << 17);
  for (uint64_t k = 0; k < kRows * kPitch; ++k) ranks.base(0)[k] = static_cast<char>(1 + k % 253);
  ProxyOptions opt;
  opt.num_channels = 1;
  opt.capacity = 64;
  Proxy proxy(*ranks.engines[0], opt);
  const ChannelView v = proxy.view(0);
  for (uint64_t i = 0; i < kRows; ++i) {
    const uint64_t t = (i * 37) % kRows;  // a permutation of the rows
    post_from_host(v, put_cmd(1, kDst + t * kPitch, t * kPitch, kRow), Op::kPut, 0, 10.0, 0);
  }
  post_from_host(v, signal_cmd(1, kSig, 1), Op::kSignal, 0, 10.0, 0);
  ASSERT_TRUE(wait_until([&] { return load(ranks.word(1, kSig)) == 1; }));
  for (uint64_t t = 0; t < kRows; ++t)
    for (uint64_t k = 0; k < kPitch; ++k)
      ASSERT_EQ(ranks.base(1)[kDst + t * kPitch + k],
                k < kRow ? static_cast<char>(1 + (t * kPitch + k) % 253) : 0)
          << "row " << t << " byte " << k;
  EXPECT_NO_THROW(proxy.check());
}

// Through a proxy: a fence command ends the runs (what came before it goes
// to the engine first), and is itself no engine call.
TEST(Coalescer, AFenceKeepsEarlierPutsAheadOfLaterOnes) {
  RecordingEngine e;
  ProxyOptions opt;
  opt.num_channels = 1;
  opt.capacity = 64;
  Proxy proxy(e, opt);
  const ChannelView v = proxy.view(0);
  for (uint64_t i = 0; i < 3; ++i)
    post_from_host(v, put_cmd(1, 64 * i, 64 * i, 64), Op::kPut, 0, 10.0, 0);
  Command fence{};
  post_from_host(v, fence, Op::kFence, 0, 10.0, 0);
  for (uint64_t i = 3; i < 6; ++i)
    post_from_host(v, put_cmd(1, 64 * i, 64 * i, 64), Op::kPut, 0, 10.0, 0);
  ASSERT_TRUE(wait_until([&] { return load(v.host->consumed) == 7; }));
  proxy.stop();  // joins the thread: the calls are all recorded
  ASSERT_EQ(e.calls.size(), 2u);
  EXPECT_EQ(e.calls[0].op, "put");
  EXPECT_EQ(e.calls[0].dst, 0u);
  EXPECT_EQ(e.calls[0].bytes, 192u);
  EXPECT_EQ(e.calls[1].dst, 192u);
  EXPECT_EQ(e.calls[1].bytes, 192u);
}

// ---- the host engine ----------------------------------------------------------------

TEST(HostEngine, ChecksRangesAlignmentRegistrationAndSizes) {
  Ranks ranks(2, 1, 1024);
  Engine& e = *ranks.engines[0];
  EXPECT_STREQ(e.name(), "host");
  EXPECT_TRUE(e.reaches(1));
  EXPECT_FALSE(e.reaches(2));
  EXPECT_EQ(e.mapped(0, 1), ranks.base(1));
  EXPECT_EQ(e.mapped(1, 1), nullptr);

  std::string m = error_of([&] { e.put(0, 1, 0, 1000, 0, 32); }, ErrorCode::kInvalidArgument);
  for (const char* part : {"destination", "[1000, 1000 + 32 bytes)", "rank 1", "region 0", "1024"})
    EXPECT_NE(m.find(part), std::string::npos) << "'" << part << "' in: " << m;
  m = error_of([&] { e.put(0, 1, 0, 0, 1020, 8); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(m.find("source [1020, 1020 + 8 bytes)"), std::string::npos) << m;
  m = error_of([&] { e.put(0, 1, 0, ~uint64_t{0} - 4, 0, 8); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(m.find("out of bounds"), std::string::npos) << m;  // no overflow past the check
  m = error_of([&] { e.signal_add(0, 1, 0, 12, 1); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(m.find("not 8-byte aligned"), std::string::npos) << m;
  m = error_of([&] { e.signal_add(0, 1, 0, 1024, 1); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(m.find("signal word"), std::string::npos) << m;
  m = error_of([&] { e.put(0, 1, 3, 0, 0, 8); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(m.find("region 3 is not registered"), std::string::npos) << m;
  m = error_of([&] { e.put(0, 5, 0, 0, 0, 8); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(m.find("peer 5"), std::string::npos) << m;
  m = error_of([&] { e.put(1, 1, 0, 0, 0, 8); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(m.find("channel"), std::string::npos) << m;

  // A put and a signal that fit land, synchronously; marks complete at once.
  std::memcpy(ranks.base(0) + 64, "0123456789abcdef", 16);
  e.put(0, 1, 0, 512, 64, 16);
  e.signal_add(0, 1, 0, 1016, 9);
  EXPECT_EQ(std::memcmp(ranks.base(1) + 512, "0123456789abcdef", 16), 0);
  EXPECT_EQ(ranks.word(1, 1016), 9u);
  e.mark(0, 42);
  EXPECT_EQ(e.completed(0), 42u);

  // Sizes must agree; every rank raises, naming both.
  std::vector<uint64_t> a(64), b(128);
  const std::string sizes = error_of(
      [&] {
        on_every_rank(2, [&](int r) {
          ranks.engines[r]->register_region(1, r ? b.data() : a.data(), r ? 1024 : 512);
        });
      },
      ErrorCode::kInvalidArgument);
  EXPECT_NE(sizes.find("same size"), std::string::npos) << sizes;
  EXPECT_NE(sizes.find("512"), std::string::npos) << sizes;
  EXPECT_NE(sizes.find("1024"), std::string::npos) << sizes;

  // Deregistration is collective and the region can be registered again.
  on_every_rank(2, [&](int r) { ranks.engines[r]->deregister_region(0); });
  EXPECT_EQ(e.mapped(0, 1), nullptr);
  error_of([&] { e.put(0, 1, 0, 0, 0, 8); }, ErrorCode::kInvalidArgument);
  on_every_rank(2, [&](int r) { ranks.engines[r]->register_region(0, ranks.base(r), 1024); });
  EXPECT_EQ(e.mapped(0, 1), ranks.base(1));
}

TEST(HostEngine, RegistrationWaitsForEveryRankWithADeadline) {
  auto fabric = std::make_shared<HostFabric>(3, 0.2);
  auto e0 = make_host_engine(fabric, 0, 3, 1);
  std::vector<uint64_t> mem(16);
  const auto start = Clock::now();
  const std::string m =
      error_of([&] { e0->register_region(0, mem.data(), 128); }, ErrorCode::kTimeout);
  EXPECT_GE(seconds_since(start), 0.2);
  EXPECT_NE(m.find("rank(s) 1, 2 did not arrive"), std::string::npos) << m;
}

// Two puts, each out of bounds, whose sums wrap past 2^64 so that merged
// they would be one 256-byte copy at offset 0 of a 4 KiB region: each is
// refused as it is taken, naming it, and nothing reaches the engine.
TEST(Coalescer, OutOfBoundsPutsThatWouldMergeInBoundsAreRefused) {
  RecordingEngine e;
  e.region_bytes = 4096;
  Coalescer q(e, 0, 4);
  const uint64_t half = uint64_t{1} << 63;
  const std::string first = error_of([&] { q.put(1, 0, 0, 0, half); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(first.find("destination [0, 0 + 9223372036854775808 bytes) is out of bounds of rank "
                       "1's region 0 (4096 bytes)"),
            std::string::npos)
      << first;
  const std::string second =
      error_of([&] { q.put(1, 0, half, half, half + 256); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(second.find("destination [9223372036854775808, 9223372036854775808 + "
                        "9223372036854776064 bytes) is out of bounds"),
            std::string::npos)
      << second;
  EXPECT_EQ(q.queued(), 0u);
  q.flush_all();
  EXPECT_TRUE(e.calls.empty());
  // In bounds they still merge.
  q.put(1, 0, 0, 0, 128);
  q.put(1, 0, 128, 128, 128);
  q.flush_all();
  ASSERT_EQ(e.calls.size(), 1u);
  EXPECT_EQ(e.calls[0].bytes, 256u);
}

// Merging itself never wraps: with an engine that checks nothing, puts whose
// sums pass 2^64 reach it as they were taken (contiguous and strided runs).
TEST(Coalescer, MergingNeverWraps) {
  RecordingEngine e;
  e.lax = true;
  Coalescer q(e, 0, 4);
  const uint64_t half = uint64_t{1} << 63;
  q.put(1, 0, 0, 0, half);
  q.put(1, 0, half, half, half + 256);
  q.flush_all();
  ASSERT_EQ(e.calls.size(), 2u);
  EXPECT_EQ(e.calls[0].op, "put");
  EXPECT_EQ(e.calls[0].bytes, half);
  EXPECT_EQ(e.calls[1].op, "put");
  EXPECT_EQ(e.calls[1].dst, half);
  EXPECT_EQ(e.calls[1].bytes, half + 256);
  // Rows at pitch 2^31 from 2^64 - 2^32: the third would sit past 2^64 (at 0).
  e.calls.clear();
  const uint64_t pitch = uint64_t{1} << 31, start = 0 - 2 * pitch;
  for (uint64_t k = 0; k < 3; ++k) q.put(2, 0, start + k * pitch, 4096 + k * pitch, 64);
  q.flush_all();
  uint64_t rows = 0;
  for (const auto& c : e.calls) {
    rows += c.rows;
    if (c.op == "strided") {
      uint64_t span = 0;
      EXPECT_TRUE(strided_span(c.dst_pitch, c.bytes, c.rows, &span));
      uint64_t end = 0;
      EXPECT_TRUE(add_fits(c.dst, span, &end)) << "a strided run wrapped past 2^64";
    }
  }
  EXPECT_EQ(rows, 3u);
}

// The host engine's check_put: what its put refuses, without copying.
TEST(HostEngineBounds, CheckPutRefusesWhatPutWould) {
  auto fabric = std::make_shared<HostFabric>(1);
  auto engine = make_host_engine(fabric, 0, 1, 1);
  std::vector<char> mem(4096, 0);
  engine->register_region(0, mem.data(), mem.size());
  EXPECT_NO_THROW(engine->check_put(0, 0, 0, 4000, 0, 96));
  const uint64_t wrap = 0 - uint64_t{64};
  EXPECT_NE(error_of([&] { engine->check_put(0, 0, 0, wrap, 0, 128); }, ErrorCode::kInvalidArgument)
                .find("host engine: put: destination [18446744073709551552"),
            std::string::npos);
  EXPECT_NE(error_of([&] { engine->check_put(0, 0, 0, 0, 4000, 97); }, ErrorCode::kInvalidArgument)
                .find("source [4000, 4000 + 97 bytes) is out of bounds of rank 0's region 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { engine->check_put(0, 0, 1, 0, 0, 8); }, ErrorCode::kInvalidArgument)
                .find("region 1 is not registered"),
            std::string::npos);
  EXPECT_NE(error_of([&] { engine->check_put(1, 0, 0, 0, 0, 8); }, ErrorCode::kInvalidArgument)
                .find("channel"),
            std::string::npos);
  EXPECT_NE(error_of([&] { engine->put(0, 0, 0, wrap, 0, 128); }, ErrorCode::kInvalidArgument)
                .find("out of bounds"),
            std::string::npos);
  engine->deregister_region(0);
}

// The range checks of the CUDA IPC engine (bounds.hpp, which its put,
// put_strided and register_region call), here without a GPU.
TEST(CudaIpcBounds, PutRangesAreCheckedWithoutOverflow) {
  EXPECT_NO_THROW(check_put_range("cuda_ipc", "put", 0, 1, 2, 0, 4032, 64, 4096, 4096));
  const std::string wrap = error_of(
      [] { check_put_range("cuda_ipc", "put", 0, 1, 2, 0 - uint64_t{32}, 0, 64, 4096, 4096); },
      ErrorCode::kInvalidArgument);
  EXPECT_NE(wrap.find("cuda_ipc engine: put: destination [18446744073709551584"), std::string::npos)
      << wrap;
  EXPECT_NE(wrap.find("rank 1's region 2 (4096 bytes)"), std::string::npos) << wrap;
  const std::string src =
      error_of([] { check_put_range("cuda_ipc", "put", 3, 1, 2, 0, 4033, 64, 4096, 4096); },
               ErrorCode::kInvalidArgument);
  EXPECT_NE(src.find("source [4033, 4033 + 64 bytes) is out of bounds of rank 3's region 2"),
            std::string::npos)
      << src;
}

TEST(CudaIpcBounds, StridedSpansThatOverflowAreRefused) {
  // 4 rows of 64 at pitch 1024 from 1024: ends at 1024 + 3 * 1024 + 64.
  EXPECT_NO_THROW(
      check_strided_put_range("cuda_ipc", 0, 1, 0, 1024, 1024, 0, 64, 64, 4, 4160, 4096));
  EXPECT_NE(error_of(
                [] {
                  check_strided_put_range("cuda_ipc", 0, 1, 0, 1024, 1024, 0, 64, 64, 4, 4159,
                                          4096);
                },
                ErrorCode::kInvalidArgument)
                .find("destination [1024, 1024 + 3136 bytes) is out of bounds"),
            std::string::npos);
  // (2^33 - 1) * 2^31 + 2^31 is 2^64: a span that wraps to 0 bytes.
  const uint64_t pitch = uint64_t{1} << 31, rows = uint64_t{1} << 33;
  const std::string span = error_of(
      [&] {
        check_strided_put_range("cuda_ipc", 0, 1, 0, 0, pitch, 0, pitch, pitch, rows, 4096, 4096);
      },
      ErrorCode::kInvalidArgument);
  EXPECT_NE(span.find("put_strided to rank 1: the destination span of 8589934592 rows of "
                      "2147483648 bytes at pitch 2147483648 overflows 64 bits"),
            std::string::npos)
      << span;
  EXPECT_NE(
      error_of(
          [] { check_strided_put_range("cuda_ipc", 0, 1, 0, 0, 32, 0, 64, 64, 2, 4096, 4096); },
          ErrorCode::kInvalidArgument)
          .find("pitches (32, 64) must be >= the width 64"),
      std::string::npos);
}

TEST(CudaIpcBounds, PeerRegionsMustLieInTheirAllocation) {
  EXPECT_NO_THROW(check_peer_region("register_region(0)", 1, 4096, 2048, 6144));
  const std::string past =
      error_of([] { check_peer_region("register_region(0)", 1, 4096, 2049, 6144); },
               ErrorCode::kInvalidArgument);
  EXPECT_NE(past.find("register_region(0): rank 1 describes its region as 4096 bytes at offset "
                      "2049 of an allocation of 6144 bytes"),
            std::string::npos)
      << past;
  // An offset near 2^64 whose sum with the size wraps into the allocation.
  EXPECT_NE(error_of([] { check_peer_region("r", 2, 64, 0 - uint64_t{16}, 6144); },
                     ErrorCode::kInvalidArgument)
                .find("rank 2 describes its region as 64 bytes at offset 18446744073709551600"),
            std::string::npos);
  EXPECT_NE(error_of([] { check_peer_region("r", 2, 0, 0, 6144); }, ErrorCode::kInvalidArgument)
                .find("0 bytes"),
            std::string::npos);
}

}  // namespace
}  // namespace epx::proxy
