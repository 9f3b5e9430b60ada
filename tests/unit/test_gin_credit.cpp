// The NCCL GIN credit gate's arithmetic (transport/nccl/credit.hpp) in a host
// model of NCCL's GIN proxy queue to one peer: poster threads each take an
// EPX ticket, wait until the gate lets the ticket pass, then claim NCCL's
// slot (produced index, fetch-add) as postGfd does and check whether NCCL
// would now wait for a credit; a consumer thread frees slots in order, at
// random moments, as NCCL's proxy advances its consumed index. The gate's
// promise: NCCL never waits. Without the gate the same model makes NCCL
// wait (the check can fail).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "transport/nccl/credit.hpp"

namespace {

namespace gc = epx::gin_credit;

struct Queue {
  std::atomic<uint32_t> tickets{0}, produced{0}, consumed{0};
  std::atomic<long> nccl_waits{0}, posted{0};
  /// Per claimed slot (index - start): its descriptor was written. The proxy
  /// consumes a slot only after that, in order, so the consumed index never
  /// passes a claim that is still checking for room (as in NCCL).
  std::vector<std::atomic<bool>> written;
};

/// `posters` threads post `each` descriptors; with `gated` false they skip
/// the gate. Indices start at `start` (near the 32-bit wrap in one case).
void run(Queue& q, int posters, int each, uint32_t queue_size, bool gated, uint32_t start) {
  q.tickets = q.produced = q.consumed = start;
  q.written = std::vector<std::atomic<bool>>(static_cast<std::size_t>(posters) * each);
  std::atomic<bool> done{false};
  std::thread consumer([&] {
    std::mt19937 rng(7);
    while (!done.load() || q.consumed.load() != q.produced.load()) {
      const uint32_t c = q.consumed.load(), p = q.produced.load();
      // in order, once written, now and then
      if (c != p && q.written[c - start].load() && rng() % 2 == 0) q.consumed.store(c + 1);
      if (rng() % 16 == 0) std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < posters; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int i = 0; i < each; ++i) {
        if (gated) {
          const uint32_t k = q.tickets.fetch_add(1);
          const auto t0 = std::chrono::steady_clock::now();
          while (!gc::may_post(k, q.consumed.load(), static_cast<int32_t>(queue_size))) {
            ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20))
                << "the gate never let ticket " << k << " pass";
            std::this_thread::yield();
          }
        }
        if (rng() % 3 == 0) std::this_thread::yield();  // between the gate and NCCL's claim
        const uint32_t idx = q.produced.fetch_add(1);
        if (gc::nccl_would_wait(idx, q.consumed.load(), queue_size)) {
          ++q.nccl_waits;  // NCCL would spin here until the proxy frees a slot
          while (gc::nccl_would_wait(idx, q.consumed.load(), queue_size)) std::this_thread::yield();
        }
        q.written[idx - start] = true;
        ++q.posted;
      }
    });
  for (auto& th : threads) th.join();
  done = true;
  consumer.join();
}

TEST(GinCredit, GatedPostsNeverFindTheQueueFull) {
  for (uint32_t start : {0u, 0xFFFFFF00u}) {  // and across the 32-bit wrap
    Queue q;
    run(q, 6, 1500, 4, true, start);
    EXPECT_EQ(q.posted.load(), 6 * 1500);
    EXPECT_EQ(q.nccl_waits.load(), 0) << "start " << start;
  }
}

TEST(GinCredit, UngatedPostsDoFindItFull) {
  Queue q;
  run(q, 6, 1500, 4, false, 0);
  EXPECT_GT(q.nccl_waits.load(), 0);  // the model can show a wait
}

TEST(GinCredit, Arithmetic) {
  EXPECT_TRUE(gc::may_post(0, 0, 32));
  EXPECT_TRUE(gc::may_post(31, 0, 32));
  EXPECT_FALSE(gc::may_post(32, 0, 32));
  EXPECT_TRUE(gc::may_post(3, 0xFFFFFFF0u, 32));  // 19 ahead, across the wrap
  EXPECT_FALSE(gc::may_post(20, 0xFFFFFFF0u, 32));
  EXPECT_TRUE(gc::may_post(5, 9, 32));  // consumed past the ticket: passes, no wrap
  EXPECT_TRUE(gc::nccl_would_wait(32, 0, 32));
  EXPECT_FALSE(gc::nccl_would_wait(31, 0, 32));
}

}  // namespace
