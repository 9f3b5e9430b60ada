// The GPU tests' shared_reference (tests/gpu/shared_reference.hpp): in-process
// ranks asking for the same key get one copy, made once.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gpu/shared_reference.hpp"

namespace {

using epx::test::shared_reference;

TEST(SharedReference, ConcurrentAsksMakeOneCopy) {
  std::atomic<int> made{0};
  constexpr int kThreads = 16;
  std::vector<std::shared_ptr<const std::vector<int>>> got(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      got[i] = shared_reference<std::vector<int>>("concurrent", [&] {
        ++made;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // others arrive meanwhile
        return std::vector<int>(1000, 7);
      });
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(made.load(), 1);
  for (const auto& p : got) {
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p.get(), got[0].get());
    EXPECT_EQ((*p)[999], 7);
  }
}

TEST(SharedReference, KeysAreSeparateAndReleasedDataIsMadeAgain) {
  int made = 0;
  auto make = [&] { return ++made; };
  auto a = shared_reference<int>("key a", make);
  auto b = shared_reference<int>("key b", make);
  EXPECT_EQ(*a, 1);
  EXPECT_EQ(*b, 2);
  auto a2 = shared_reference<int>("key a", make);  // still held: shared
  EXPECT_EQ(a2.get(), a.get());
  a.reset();
  a2.reset();
  auto a3 = shared_reference<int>("key a", make);  // every holder let go: made again
  EXPECT_EQ(*a3, 3);
}

TEST(SharedReference, AFailedMakeReachesTheWaiters) {
  // The make fails only 300 ms after this thread said it is about to ask, so
  // the ask finds it still being made and waits for it.
  std::atomic<bool> started{false}, asking{false};
  std::thread maker([&] {
    EXPECT_THROW(
        shared_reference<int>("fails",
                              [&]() -> int {
                                started = true;
                                while (!asking) std::this_thread::yield();
                                std::this_thread::sleep_for(std::chrono::milliseconds(300));
                                throw std::runtime_error("no data");
                              }),
        std::runtime_error);
  });
  while (!started) std::this_thread::yield();
  asking = true;
  int made_here = 0;
  EXPECT_THROW(shared_reference<int>("fails", [&] { return ++made_here; }), std::runtime_error);
  EXPECT_EQ(made_here, 0);
  maker.join();
  // Asked again after the failure: made anew.
  EXPECT_EQ(*shared_reference<int>("fails", [] { return 2; }), 2);
}

}  // namespace
