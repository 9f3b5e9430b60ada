// Foundation smoke test: symmetric memory from the NVLink backend; every rank
// stores into every peer through its load/store pointer, barrier, and checks
// what the others wrote into its own copy.
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "core/stream_wait.hpp"

#include "common/plan.hpp"
#include "gpu/harness.hpp"
#include "transport/backend.hpp"

namespace {

// Rank `me` writes value(me, dst, i) into slot [me] of every dst's region.
__global__ void write_peers(epx::transport::SymmetricRegion r, int me, int n, int words) {
  for (int dst = 0; dst < n; ++dst) {
    auto* base = static_cast<uint32_t*>(r.peers[dst]) + static_cast<size_t>(me) * words;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x)
      base[i] = 0x9E3779B9u * (me + 1) + 0x85EBCA6Bu * (dst + 1) + i;
  }
}

EPX_GPU_TEST(Smoke, SymmetricPeerStores) {
  auto& w = epx::test::world();
  auto backend = epx::transport::make_backend("auto", *w.comm);
  const int words = 1 << 20;  // 4 MiB from each rank
  auto region = backend->alloc(sizeof(uint32_t) * words * w.num_ranks);
  for (int r = 0; r < w.num_ranks; ++r) ASSERT_NE(region.peers[r], nullptr) << "peer " << r;
  write_peers<<<64, 256>>>(region, w.rank, w.num_ranks, words);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  backend->barrier();
  std::vector<uint32_t> got(static_cast<size_t>(words) * w.num_ranks);
  ASSERT_EQ(cudaMemcpy(got.data(), region.local, got.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  size_t bad = 0;
  for (int src = 0; src < w.num_ranks; ++src)
    for (int i = 0; i < words; ++i)
      bad += got[static_cast<size_t>(src) * words + i] !=
             0x9E3779B9u * (src + 1) + 0x85EBCA6Bu * (w.rank + 1) + static_cast<uint32_t>(i);
  EXPECT_EQ(bad, 0u) << "rank " << w.rank << " received wrong words";
  backend->free(region);
  EXPECT_TRUE(epx::test::all_ranks(bad == 0));
}

// Spins until *flag != 0 (host-mapped), or for at most max_ns (its own deadline).
__global__ void spin_on_host_flag(const volatile int* flag, unsigned long long max_ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (*flag == 0 && now - start < max_ns);
}

// The host collectives' wait (Communicator::barrier / allgather over NCCL):
// work that does not finish gives false at the deadline, not a hang; work
// that finishes gives true; an error raised by the poll ends the wait.
EPX_GPU_TEST(Smoke, StreamWaitHasADeadline) {
  using epx::detail::wait_stream_for;
  int* flag = nullptr;
  ASSERT_EQ(cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped), cudaSuccess);
  int* flag_dev = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_dev), flag, 0), cudaSuccess);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  auto set_flag = [&](int v) { *static_cast<volatile int*>(flag) = v; };
  auto spin = [&] {
    set_flag(0);
    spin_on_host_flag<<<1, 32, 0, s>>>(flag_dev, 30'000'000'000ull);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  };
  using clock = std::chrono::steady_clock;
  spin();
  const auto t0 = clock::now();
  EXPECT_FALSE(wait_stream_for(s, 0.2));
  const double waited = std::chrono::duration<double>(clock::now() - t0).count();
  EXPECT_GE(waited, 0.2);
  EXPECT_LT(waited, 5.0);
  int polls = 0;
  EXPECT_FALSE(wait_stream_for(s, 0.05, [&] { ++polls; }));
  EXPECT_GT(polls, 0);
  set_flag(1);
  EXPECT_TRUE(wait_stream_for(s, 10.0));
  spin();
  EXPECT_THROW(
      wait_stream_for(s, 10.0, [] { throw epx::Error(epx::ErrorCode::kNccl, "poll failed"); }),
      epx::Error);
  set_flag(1);
  EXPECT_TRUE(wait_stream_for(s, 10.0));
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(flag), cudaSuccess);
}

}  // namespace
