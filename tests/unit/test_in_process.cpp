// The host collectives of in-process ranks (threads of one process) and the
// argument rules of Communicator::create_in_process; no GPU needed.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/host_group.hpp"
#include "core/stream_wait.hpp"
#include "epx/buffer.hpp"

namespace epx {
namespace {

std::string message_of(const std::function<void()>& f, ErrorCode code) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected an epx::Error";
  return {};
}

TEST(InProcessGroup, AllGatherIsInRankOrderOnEveryRankAndRepeats) {
  constexpr int R = 4;
  detail::InProcessGroup g(R, 30.0);
  std::vector<std::vector<uint8_t>> got(R * 50);
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        for (int i = 0; i < 50; ++i) {
          const int mine[2] = {r, 1000 * i + r};
          got[i * R + r] = g.allgather(r, mine, sizeof(mine));
        }
      });
  }
  for (int i = 0; i < 50; ++i)
    for (int r = 0; r < R; ++r) {
      const auto& v = got[i * R + r];
      ASSERT_EQ(v.size(), R * 2 * sizeof(int));
      for (int s = 0; s < R; ++s) {
        int pair[2];
        std::memcpy(pair, v.data() + s * sizeof(pair), sizeof(pair));
        EXPECT_EQ(pair[0], s) << "call " << i << " on rank " << r;
        EXPECT_EQ(pair[1], 1000 * i + s) << "call " << i << " on rank " << r;
      }
    }
}

TEST(InProcessGroup, AnInfiniteDeadlineWaitsInsteadOfExpiring) {
  // An infinite (or huge) timeout must not overflow into a deadline already
  // past: the late rank arrives 100 ms after the first.
  EXPECT_EQ(detail::capped_wait_seconds(std::numeric_limits<double>::infinity()),
            detail::kMaxWaitSeconds);
  EXPECT_EQ(detail::capped_wait_seconds(2.5), 2.5);
  for (double timeout : {std::numeric_limits<double>::infinity(), 1e12}) {
    detail::InProcessGroup g(2, timeout);
    std::atomic<int> failed{0};
    {
      std::jthread late([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        try {
          g.barrier(1);
        } catch (const Error&) {
          ++failed;
        }
      });
      try {
        g.barrier(0);
      } catch (const Error&) {
        ++failed;
      }
    }
    EXPECT_EQ(failed.load(), 0) << "timeout " << timeout;
  }
}

TEST(InProcessGroup, BarrierHoldsEveryRankUntilTheLastArrives) {
  constexpr int R = 3;
  detail::InProcessGroup g(R, 30.0);
  std::atomic<int> before{0}, passed_early{0};
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        if (r == R - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        before.fetch_add(1);
        g.barrier(r);
        if (before.load() != R) passed_early.fetch_add(1);
      });
  }
  EXPECT_EQ(passed_early.load(), 0);
}

TEST(InProcessGroup, TimeoutNamesTheMissingRankAndBreaksTheGroup) {
  detail::InProcessGroup g(3, 0.2);
  std::string first, second;
  {
    std::jthread a([&] { first = message_of([&] { g.barrier(0); }, ErrorCode::kTimeout); });
    std::jthread b([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      second = message_of([&] { g.barrier(1); }, ErrorCode::kTimeout);
    });
  }
  // Rank 2 never came: whoever timed out first names it; the other gives up.
  const std::string both = first + " | " + second;
  EXPECT_NE(both.find("rank(s) 2 did not arrive"), std::string::npos) << both;
  EXPECT_NE(both.find("gave up"), std::string::npos) << both;
  const std::string late = message_of([&] { g.barrier(2); }, ErrorCode::kTimeout);
  EXPECT_NE(late.find("after an earlier barrier timed out"), std::string::npos) << late;
}

TEST(InProcessGroup, TwoThreadsOfOneRankAreNamed) {
  // A second thread entering for rank 0 while the first waits there is a
  // caller's bug (one rank's communicator used from two threads): the error
  // names it, and the first entry still completes once rank 1 arrives.
  detail::InProcessGroup g(2, 30.0);
  std::atomic<bool> first_done{false};
  std::string twice;
  {
    std::jthread a([&] {
      g.barrier(0);
      first_done = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    twice = message_of([&] { g.barrier(0); }, ErrorCode::kInternal);
    g.barrier(1);
  }
  EXPECT_TRUE(first_done.load());
  EXPECT_NE(twice.find("rank 0 entered twice"), std::string::npos) << twice;
  EXPECT_NE(twice.find("two threads use one rank's communicator"), std::string::npos) << twice;
  // Both call stacks, so that the code holding the rank's place is named.
  const std::size_t here = twice.find("this thread:"),
                    there = twice.find("the waiting thread, when it entered:");
  ASSERT_NE(here, std::string::npos) << twice;
  ASSERT_NE(there, std::string::npos) << twice;
  EXPECT_LT(here, there);
  EXPECT_NE(twice.find("\n    ", there), std::string::npos) << "no frames: " << twice;
}

TEST(InProcessGroup, BadArgumentsAreNamed) {
  EXPECT_NE(message_of([] { detail::InProcessGroup(0, 1.0); }, ErrorCode::kInvalidArgument)
                .find("num_ranks"),
            std::string::npos);
  EXPECT_NE(message_of([] { detail::InProcessGroup(2, 0.0); }, ErrorCode::kInvalidArgument)
                .find("timeout_s"),
            std::string::npos);
  detail::InProcessGroup g(2, 1.0);
  EXPECT_NE(message_of([&] { g.barrier(2); }, ErrorCode::kInvalidArgument).find("rank"),
            std::string::npos);
}

TEST(InProcessGroup, AllGatherRefusesDifferentSizesAndStaysInStep) {
  detail::InProcessGroup g(2, 30.0);
  std::string m0, m1;
  std::vector<uint8_t> after0, after1;
  {
    // Rank 0 calls again at once after its error: the group must not hand
    // rank 1 that next call's data for the failed one.
    std::jthread a([&] {
      int v = 1;
      m0 = message_of([&] { g.allgather(0, &v, sizeof(v)); }, ErrorCode::kInvalidArgument);
      const int16_t next = 100;
      after0 = g.allgather(0, &next, sizeof(next));
    });
    std::jthread b([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      int64_t v = 1;
      m1 = message_of([&] { g.allgather(1, &v, sizeof(v)); }, ErrorCode::kInvalidArgument);
      const int16_t next = 101;
      after1 = g.allgather(1, &next, sizeof(next));
    });
  }
  EXPECT_NE(m0.find("bytes"), std::string::npos) << m0;
  EXPECT_NE(m1.find("same on every rank"), std::string::npos) << m1;
  for (const auto* got : {&after0, &after1}) {
    ASSERT_EQ(got->size(), 4u);
    int16_t v[2];
    std::memcpy(v, got->data(), 4);
    EXPECT_EQ(v[0], 100);
    EXPECT_EQ(v[1], 101);
  }
}

TEST(InProcessGroup, CreateInProcessChecksItsArgumentsFirst) {
  // These fail before any CUDA call, so they run without a GPU.
  EXPECT_NE(message_of([] { Communicator::create_in_process(0); }, ErrorCode::kInvalidArgument)
                .find("num_ranks"),
            std::string::npos);
  EXPECT_NE(message_of([] { Communicator::create_in_process(161); }, ErrorCode::kInvalidArgument)
                .find("num_ranks"),
            std::string::npos);
  EXPECT_NE(message_of([] { Communicator::create_in_process(2, {0}); }, ErrorCode::kInvalidArgument)
                .find("devices"),
            std::string::npos);
  EXPECT_NE(
      message_of([] { Communicator::create_in_process(2, {}, -1.0); }, ErrorCode::kInvalidArgument)
          .find("timeout_s"),
      std::string::npos);
}

TEST(Communicator, CreateChecksItsArgumentsFirst) {
  // Before NCCL or CUDA is touched, so without a GPU too.
  const UniqueId id{};
  EXPECT_NE(message_of([&] { Communicator::create(id, 0, 0); }, ErrorCode::kInvalidArgument)
                .find("num_ranks"),
            std::string::npos);
  EXPECT_NE(message_of([&] { Communicator::create(id, 0, 1, 0.0); }, ErrorCode::kInvalidArgument)
                .find("timeout_s"),
            std::string::npos);
  EXPECT_NE(
      message_of([&] { Communicator::create(id, 2, 2); }, ErrorCode::kInvalidArgument).find("rank"),
      std::string::npos);
}

}  // namespace
}  // namespace epx
