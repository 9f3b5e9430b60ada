// Foundation smoke test: symmetric memory from the NVLink backend; every rank
// stores into every peer through its load/store pointer, barrier, and checks
// what the others wrote into its own copy.
#include <gtest/gtest.h>

#include <vector>

#include "core/plan.hpp"
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

}  // namespace
