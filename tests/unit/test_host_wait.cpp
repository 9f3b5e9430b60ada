// The host waits' poll loop and deadline error (core/stream_wait.hpp,
// common/poll.hpp) driven by fake queries: no GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/agree.hpp"
#include "common/host_group.hpp"
#include "common/poll.hpp"
#include "core/stream_wait.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

using clock = std::chrono::steady_clock;

double seconds_since(clock::time_point t0) {
  return std::chrono::duration<double>(clock::now() - t0).count();
}

TEST(PollUntil, ReturnsAsSoonAsTheQueryIsReady) {
  int queries = 0, ticks = 0;
  const auto t0 = clock::now();
  EXPECT_TRUE(detail::poll_until([&] { return ++queries == 200; }, 30.0, [&] { ++ticks; }));
  EXPECT_EQ(queries, 200);
  EXPECT_EQ(ticks, 199);  // between polls only: none after the ready one
  EXPECT_LT(seconds_since(t0), 5.0);
}

TEST(PollUntil, GivesUpAtTheDeadlineAndSleepsBetweenPolls) {
  int queries = 0;
  const auto t0 = clock::now();
  EXPECT_FALSE(detail::poll_until([&] { return ++queries < 0; }, 0.2));
  const double took = seconds_since(t0);
  EXPECT_GE(took, 0.2);
  EXPECT_LT(took, 5.0);
  // Backing off to 1 ms sleeps: a few hundred polls in 0.2 s, not millions.
  EXPECT_LT(queries, 2000);
  EXPECT_GT(queries, 64);
}

TEST(PollUntil, AZeroDeadlineStillPollsOnce) {
  int queries = 0;
  EXPECT_TRUE(detail::poll_until([&] { return ++queries == 1; }, 0.0));
  EXPECT_FALSE(detail::poll_until([&] { return false; }, 0.0));
}

TEST(PollUntil, WhatTheQueryOrTheTickThrowsPassesThrough) {
  EXPECT_THROW(detail::poll_until([]() -> bool { throw std::runtime_error("query"); }, 10.0),
               std::runtime_error);
  EXPECT_THROW(detail::poll_until([] { return false; }, 10.0,
                                  [] { throw Error(ErrorCode::kNccl, "async error"); }),
               Error);
}

TEST(WaitUntil, ReturnsWhenReadyWithoutAskingForANote) {
  int queries = 0;
  bool asked = false;
  detail::wait_until([&] { return ++queries >= 3; }, {"destroy", 2, "the comm stream"}, 30.0,
                     [&] {
                       asked = true;
                       return std::string("unused");
                     });
  EXPECT_EQ(queries, 3);
  EXPECT_FALSE(asked);
}

TEST(WaitUntil, TimeoutNamesOpRankWhatDeadlineAndTheStallNote) {
  const auto t0 = clock::now();
  try {
    detail::wait_until(
        [] { return false; }, {"clean_low_latency_buffer", 3, "the last low-latency op's event"},
        0.25, [] { return std::string("rank 3's proxy channel 1 spent 9.0 s in one step"); });
    FAIL() << "expected kTimeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    const std::string m = e.what();
    EXPECT_NE(m.find("clean_low_latency_buffer: rank 3 waited more than 0.25 s for the last "
                     "low-latency op's event"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("EPX_TIMEOUT_S"), std::string::npos) << m;
    EXPECT_NE(m.find("; rank 3's proxy channel 1 spent 9.0 s in one step"), std::string::npos) << m;
  }
  EXPECT_GE(seconds_since(t0), 0.25);
}

TEST(WaitUntil, NoNoteLeavesNoTrailingSeparator) {
  const std::string m = detail::wait_timeout_message({"quiesce", 0, "the backend's stream"}, 5, "");
  EXPECT_EQ(m.back(), ')') << m;
  EXPECT_NE(m.find("quiesce: rank 0 waited more than 5 s for the backend's stream"),
            std::string::npos)
      << m;
  EXPECT_NE(detail::wait_timeout_message({"free", -1, "x"}, 1, "").find("free: rank ?"),
            std::string::npos);
}

TEST(WaitUntil, ATickThatThrowsEndsTheWaitWithItsError) {
  int ticks = 0;
  try {
    detail::wait_until([] { return false; }, {"destroy", 1, "the comm stream"}, 30.0, {},
                       [&] {
                         if (++ticks == 5) throw Error(ErrorCode::kNccl, "communicator failed");
                       });
    FAIL() << "expected the tick's error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNccl);
    EXPECT_EQ(ticks, 5);
  }
}

TEST(Watchdog, ReportsWhileTheCallRunsPastItsDeadlineAndStopsAfter) {
  testing::internal::CaptureStderr();
  int reports = 0;
  {
    detail::Watchdog w("rank 5: nvshmem_barrier_all did not return: no way to bound it", 0.05);
    std::this_thread::sleep_for(std::chrono::milliseconds(260));
    reports = w.reports();
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_GE(reports, 2);
  EXPECT_NE(err.find("epx: rank 5: nvshmem_barrier_all did not return: no way to bound it ("),
            std::string::npos)
      << err;
}

TEST(Watchdog, ACallThatReturnsInTimeIsNotReported) {
  testing::internal::CaptureStderr();
  {
    detail::Watchdog w("never printed", 30.0);
    EXPECT_EQ(w.reports(), 0);
  }
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

// "Agree before joining", with ranks that are threads exchanging through an
// in-process group (what Communicator::allgather does for NCCL ranks).
struct Outcome {
  bool threw = false;
  ErrorCode code = ErrorCode::kInternal;
  std::string what;
  bool joined = false;  ///< went on to the step after the agreement
};

std::vector<Outcome> run_agreement(int R, double timeout_s, const std::function<void(int)>& local,
                                   const std::vector<int>& absent = {}) {
  detail::InProcessGroup g(R, timeout_s);
  std::vector<Outcome> out(static_cast<std::size_t>(R));
  std::vector<std::jthread> threads;
  for (int r = 0; r < R; ++r) {
    if (std::find(absent.begin(), absent.end(), r) != absent.end()) continue;
    threads.emplace_back([&, r] {
      try {
        detail::agree_before(
            "ncclCommSplit", r,
            [&](const void* data, std::size_t bytes) { return g.allgather(r, data, bytes); },
            [&] { local(r); });
        out[r].joined = true;
      } catch (const Error& e) {
        out[r].threw = true;
        out[r].code = e.code();
        out[r].what = e.what();
      } catch (const std::exception& e) {  // a local error that is not an epx::Error, rethrown
        out[r].threw = true;
        out[r].what = e.what();
      }
    });
  }
  threads.clear();
  return out;
}

TEST(AgreeBefore, EveryRankJoinsWhenAllAreReady) {
  std::atomic<int> ran{0};
  const auto out = run_agreement(4, 30.0, [&](int) { ++ran; });
  EXPECT_EQ(ran.load(), 4);
  for (const Outcome& o : out) {
    EXPECT_FALSE(o.threw) << o.what;
    EXPECT_TRUE(o.joined);
  }
}

TEST(AgreeBefore, ARankThatFailedLocallyIsNamedByEveryOtherAndNobodyJoins) {
  const auto out = run_agreement(4, 30.0, [](int r) {
    if (r == 2)
      throw Error(ErrorCode::kInvalidArgument, "num_qps_per_rank: must be in [1, 16], got 40");
  });
  for (int r = 0; r < 4; ++r) {
    const Outcome& o = out[r];
    ASSERT_TRUE(o.threw) << "rank " << r;
    EXPECT_FALSE(o.joined);
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument) << o.what;
    if (r == 2) {
      // Its own error, as it was thrown.
      EXPECT_EQ(o.what, "epx: num_qps_per_rank: must be in [1, 16], got 40");
    } else {
      EXPECT_NE(o.what.find("ncclCommSplit: rank 2 failed before joining it: num_qps_per_rank: "
                            "must be in [1, 16], got 40"),
                std::string::npos)
          << o.what;
      EXPECT_NE(o.what.find("rank " + std::to_string(r) + " did not join either"),
                std::string::npos)
          << o.what;
      EXPECT_EQ(o.what.find("epx: num_qps"), std::string::npos) << "prefix kept: " << o.what;
    }
  }
}

TEST(AgreeBefore, SeveralFailuresNameTheFirstAndCountTheRest) {
  const auto out = run_agreement(4, 30.0, [](int r) {
    if (r == 1) throw std::runtime_error("out of memory");
    if (r == 3) throw Error(ErrorCode::kCuda, "cudaMalloc failed");
  });
  EXPECT_EQ(out[0].code, ErrorCode::kInternal);  // rank 1's was not an epx::Error
  EXPECT_NE(out[0].what.find("rank 1 failed before joining it: out of memory (1 more rank(s) "
                             "failed)"),
            std::string::npos)
      << out[0].what;
  EXPECT_NE(out[2].what.find("rank 1 failed"), std::string::npos) << out[2].what;
  EXPECT_EQ(out[1].what, "out of memory");
  EXPECT_EQ(out[3].code, ErrorCode::kCuda);
  EXPECT_EQ(out[3].what, "epx: cudaMalloc failed");
}

TEST(AgreeBefore, ARankThatNeverAnswersEndsTheExchangeAtItsDeadline) {
  // Rank 3 never arrives: the others' exchange times out (the all-gather's
  // deadline), naming it, instead of waiting in the library's step.
  const auto out = run_agreement(4, 0.3, [](int) {}, {3});
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(out[r].threw);
    EXPECT_EQ(out[r].code, ErrorCode::kTimeout) << out[r].what;
    EXPECT_FALSE(out[r].joined);
  }
  // The first to time out names the missing rank; the others say they gave up.
  int named = 0;
  for (int r = 0; r < 3; ++r)
    named += out[r].what.find("rank(s) 3 did not arrive") != std::string::npos;
  EXPECT_GE(named, 1);
}

TEST(AgreeBefore, ALocalFailureWinsOverAFailedExchange) {
  try {
    detail::agree_before(
        "ncclCommWindowRegister", 0,
        [](const void*, std::size_t) -> std::vector<uint8_t> {
          throw Error(ErrorCode::kTimeout, "allgather: timed out");
        },
        [] { throw Error(ErrorCode::kBufferTooSmall, "ncclMemAlloc: out of memory"); });
    FAIL() << "expected the local error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBufferTooSmall);
    EXPECT_EQ(std::string(e.what()), "epx: ncclMemAlloc: out of memory");
  }
}

}  // namespace
}  // namespace epx
