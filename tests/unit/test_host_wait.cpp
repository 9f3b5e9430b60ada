// The host waits' poll loop and deadline error (core/stream_wait.hpp,
// common/poll.hpp) driven by fake queries: no GPU needed.
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <string>

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

}  // namespace
}  // namespace epx
