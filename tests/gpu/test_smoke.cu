// Foundation smoke test: symmetric memory from the NVLink backend; every rank
// stores into every peer through its load/store pointer, barrier, and checks
// what the others wrote into its own copy.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <variant>
#include <vector>

#include "core/signal_needs.hpp"
#include "core/stream_wait.hpp"

#include "common/plan.hpp"
#include "gpu/harness.hpp"
#include "transport/backend.hpp"

namespace {

// Rank `me` writes value(me, dst, i) into slot [me] of every dst's region that
// it reaches by load/store (`peers[dst]`, null for a peer of another node).
__global__ void write_peers(void* const* peers, int me, int n, int words) {
  for (int dst = 0; dst < n; ++dst) {
    if (peers[dst] == nullptr) continue;
    auto* base = static_cast<uint32_t*>(peers[dst]) + static_cast<size_t>(me) * words;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x)
      base[i] = 0x9E3779B9u * (me + 1) + 0x85EBCA6Bu * (dst + 1) + i;
  }
}

uint32_t smoke_word(int src, int dst, int i) {
  return 0x9E3779B9u * (src + 1) + 0x85EBCA6Bu * (dst + 1) + static_cast<uint32_t>(i);
}

epx::Topology world_topology() {
  auto& w = epx::test::world();
  return epx::Topology{w.num_ranks, w.buffer->num_nvl_ranks()};
}

EPX_GPU_TEST(Smoke, SymmetricPeerStores) {
  auto& w = epx::test::world();
  auto backend = epx::transport::make_backend("auto", *w.comm, world_topology(), {});
  const int words = 1 << 20;  // 4 MiB from each rank
  auto region = backend->alloc(sizeof(uint32_t) * words * w.num_ranks);
  backend->start();
  for (int r = 0; r < w.num_ranks; ++r)
    if (epx::test::same_node(r, w.rank)) ASSERT_NE(region.peers[r], nullptr) << "peer " << r;
  auto d_peers = epx::test::to_device(region.peers);
  write_peers<<<64, 256>>>(d_peers.get(), w.rank, w.num_ranks, words);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  backend->barrier();
  std::vector<uint32_t> got(static_cast<size_t>(words) * w.num_ranks);
  ASSERT_EQ(cudaMemcpy(got.data(), region.local, got.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  size_t bad = 0;
  for (int src = 0; src < w.num_ranks; ++src)
    if (epx::test::same_node(src, w.rank))
      for (int i = 0; i < words; ++i)
        bad += got[static_cast<size_t>(src) * words + i] != smoke_word(src, w.rank, i);
  EXPECT_EQ(bad, 0u) << "rank " << w.rank << " received wrong words";
  backend->free(region);
  EXPECT_TRUE(epx::test::all_ranks(bad == 0));
}

// The transport concept end to end: rank `me` fills its send area [0, block)
// with value(me, dst, i) per destination block, puts block dst to every rank
// dst at [me * block] of dst's receive area with a signal (id me) add of 1 on
// context dst % contexts and a bare add of 1 on the other contexts, then waits
// for every source's signal, and quiets.
// Every kind of peer is covered: itself and its node by load/store, the
// other nodes by the backend's network path.
template <class T>
__global__ void put_signal_all(T t, std::size_t recv_off, int words, int* failed) {
  const int me = t.rank, n = t.num_ranks;
  const std::size_t block = 4u * words;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  uint32_t* send = reinterpret_cast<uint32_t*>(t.local_ptr(0));
  for (int dst = 0; dst < n; ++dst)
    for (int i = threadIdx.x; i < words; i += blockDim.x)
      send[static_cast<std::size_t>(dst) * words + i] =
          0x9E3779B9u * (me + 1) + 0x85EBCA6Bu * (dst + 1) + i;
  __syncthreads();
  for (int dst = warp; dst < n; dst += warps) {
    const int ctx = dst % t.num_contexts;
    t.template put_signal<epx::dev::Warp>(ctx, dst, recv_off + static_cast<std::size_t>(me) * block,
                                          static_cast<std::size_t>(dst) * block, block, me, 1);
    // Every context's word of the signal counts the op (the receiver waits
    // for each); the others carry no put.
    for (int c = 0; c < t.num_contexts; ++c)
      if (c != ctx) t.template signal_add<epx::dev::Warp>(c, dst, me, 1);
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < n &&
      !t.wait_signal(threadIdx.x, 1, epx::OpId::kNone, threadIdx.x))
    atomicExch(failed, 1);
  if (static_cast<int>(threadIdx.x) < t.num_contexts && !t.quiet(threadIdx.x))
    atomicExch(failed, 2);
}

void run_put_signal(const char* backend_name, int contexts) {
  auto& w = epx::test::world();
  epx::transport::BackendOptions bo;
  bo.num_contexts = contexts;
  epx::detail::set_signal_needs(bo, w.num_ranks, false);  // as a Buffer asks
  auto backend = epx::transport::make_backend(backend_name, *w.comm, world_topology(), bo);
  const int words = 16 << 10;  // 64 KiB per (source, destination)
  const std::size_t block = 4u * words, area = block * w.num_ranks;
  const std::size_t signals = 2 * area;
  auto region = backend->alloc(signals + 8u * epx::kMaxContexts * w.num_ranks);
  backend->start();
  auto t = backend->device(region);
  auto& base = epx::dev::base_of(t);
  base.signals = signals;
  base.num_contexts = backend->num_contexts();
  base.timeout_ns = 20'000'000'000ull;
  if (std::holds_alternative<epx::dev::ModuleTransport>(t)) {
    // Its kernels live in its module, which holds the library's kernels
    // only: the LL suite over that backend is its end-to-end test.
    backend->free(region);
    GTEST_SKIP() << backend_name
                 << ": a module's transport; this smoke kernel is not in its module";
  }
  auto failed = epx::test::to_device(std::vector<int>{0});
  std::visit(
      [&](const auto& tt) {
        if constexpr (epx::dev::kBuiltIn<std::decay_t<decltype(tt)>>)
          put_signal_all<<<1, 256, 0, w.stream>>>(tt, area, words, failed.get());
      },
      t);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  // (Not the legacy default stream, nor a device-wide wait: in-process ranks
  // share the GPU, and this kernel waits for the others'.)
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  EXPECT_EQ(epx::test::to_host(failed)[0], 0) << backend_name << ": a wait failed";
  backend->check_health();
  backend->barrier();
  std::vector<uint32_t> got(static_cast<size_t>(words) * w.num_ranks);
  ASSERT_EQ(cudaMemcpy(got.data(), static_cast<char*>(region.local) + area, got.size() * 4,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  size_t bad = 0;
  for (int src = 0; src < w.num_ranks; ++src)
    for (int i = 0; i < words; ++i)
      bad += got[static_cast<size_t>(src) * words + i] != smoke_word(src, w.rank, i);
  EXPECT_EQ(bad, 0u) << backend_name << ": rank " << w.rank << " received wrong words";
  backend->free(region);
  EXPECT_TRUE(epx::test::all_ranks(bad == 0));
}

EPX_GPU_TEST(Smoke, TransportPutSignalDefaultBackend) {
  run_put_signal("auto", 1);
}

EPX_GPU_TEST(Smoke, TransportPutSignalProxyTwoChannels) {
  run_put_signal("proxy", 2);
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

// The NCCL GIN transport by itself: the same all-to-all put + signal, peers
// of other nodes through NCCL's GIN put with a signal add. Needs one GPU per
// rank, processes, and a GIN net plugin; on one host the loopback one:
//   EPX_TEST_NCCL_GIN=1 NCCL_NET_PLUGIN=epxloop LD_LIBRARY_PATH=<dir of
//   libnccl-net-epxloop.so>:... EPX_RANKS_PER_NODE=1 launch.sh 2 epx_gpu_tests
EPX_GPU_TEST(Smoke, TransportPutSignalNcclGin) {
  auto& w = epx::test::world();
  if (std::getenv("EPX_TEST_NCCL_GIN") == nullptr)
    GTEST_SKIP() << "set EPX_TEST_NCCL_GIN=1 with a GIN net plugin (docs/nccl_gin.md)";
  if (w.comm->in_process()) GTEST_SKIP() << "NCCL refuses two ranks on one GPU";
  run_put_signal("nccl", 2);
}
