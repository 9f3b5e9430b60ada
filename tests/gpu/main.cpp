// Multi-rank GPU test runner: one process per GPU (scripts/launch.sh or
// torchrun). Every rank runs every test; a rank's failure fails the run.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "gpu/harness.hpp"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("epx_gpu_tests: SKIPPED: no CUDA device\n");
    return 77;
  }
  auto& w = epx::test::world();
  try {
    w.comm = epx::Communicator::from_env();
    w.rank = w.comm->rank();
    w.num_ranks = w.comm->num_ranks();
    epx::BufferOptions o;
    o.num_nvl_bytes = static_cast<int64_t>(std::getenv("EPX_TEST_NVL_BYTES")
                                               ? std::atoll(std::getenv("EPX_TEST_NVL_BYTES"))
                                               : (1ll << 30));
    o.num_rdma_bytes = 1ll << 30;
    o.allocator = epx::test::poisoning_allocator();
    o.timeout_s = 20;
    w.buffer = std::make_unique<epx::Buffer>(w.comm, o);
    cudaStreamCreateWithFlags(&w.stream, cudaStreamNonBlocking);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx_gpu_tests: setup failed: %s\n", e.what());
    return 1;
  }
  // Rank 0 prints the whole report; the others print their failures only.
  if (w.rank != 0) GTEST_FLAG_SET(brief, true);
  int rc = RUN_ALL_TESTS();
  w.buffer->destroy();
  w.buffer.reset();
  std::printf("rank %d: %s\n", w.rank, rc == 0 ? "all tests passed" : "FAILURES");
  return rc;
}
