// Multi-rank GPU test runner. Either one process per GPU (scripts/launch.sh
// or torchrun), or with --in-process=R (or EPX_TEST_IN_PROCESS=R) R ranks as
// threads of this process on the current GPU (Communicator::create_in_process):
// the multi-rank protocol on one GPU, for machines with fewer GPUs than ranks.
// Every rank runs every test; a rank's failure fails the run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "gpu/harness.hpp"

namespace {

/// Communicator, buffer and stream of one rank (collective: every rank at once).
void set_up(epx::test::World& w, std::shared_ptr<epx::Communicator> comm) {
  w.comm = std::move(comm);
  w.rank = w.comm->rank();
  w.num_ranks = w.comm->num_ranks();
  epx::BufferOptions o;
  o.num_nvl_bytes = static_cast<int64_t>(std::getenv("EPX_TEST_NVL_BYTES")
                                             ? std::atoll(std::getenv("EPX_TEST_NVL_BYTES"))
                                             : (1ll << 30));
  // The largest LL workload of the suite (network areas included).
  o.num_rdma_bytes =
      std::max<int64_t>(1ll << 30, static_cast<int64_t>(epx::Buffer::get_low_latency_rdma_size_hint(
                                       128, 8192, w.comm->num_ranks(), 256)));
  o.allocator = epx::test::poisoning_allocator(/*capture_arena=*/w.comm->in_process());
  // EPX_TEST_QPS: contexts per peer (proxy channels) of the shared buffer.
  if (const char* q = std::getenv("EPX_TEST_QPS")) o.num_qps_per_rank = std::atoi(q);
  o.timeout_s = 20;
  if (cudaStreamCreateWithFlags(&w.stream, cudaStreamNonBlocking) != cudaSuccess)
    throw epx::Error(epx::ErrorCode::kCuda, "cudaStreamCreateWithFlags");
  w.buffer = std::make_unique<epx::Buffer>(w.comm, o);
}

int in_process_ranks(int argc, char** argv) {
  const char* v = std::getenv("EPX_TEST_IN_PROCESS");
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--in-process=", 13) == 0) v = argv[i] + 13;
  if (!v) return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < 1) {
    std::fprintf(stderr,
                 "epx_gpu_tests: --in-process / EPX_TEST_IN_PROCESS must be a rank count "
                 ">= 1, got '%s'\n",
                 v);
    std::exit(2);
  }
  return static_cast<int>(n);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::UnitTest::GetInstance()->listeners().Append(epx::test::new_rank_failure_listener());
  const int in_process = in_process_ranks(argc, argv);
  // In-process ranks share one CUDA context, where loading a kernel at its
  // first launch (CUDA's default lazy loading) may wait for the kernels
  // running: a peer's, waiting for this rank. Load every kernel at start-up.
  if (in_process > 0) setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  // They also share its hardware queues (8 by default): a proxy's copy stream
  // that shares one with a rank's stream waits behind that rank's kernel,
  // which may wait for the copy (seen: 20 s timeouts in hook mode). More
  // queues than the ranks' and proxies' streams make that unlikely.
  if (in_process > 0) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("epx_gpu_tests: SKIPPED: no CUDA device\n");
    return 77;
  }
  auto& worlds = epx::test::in_process_worlds();
  try {
    if (in_process > 0) {
      // A rank that fails may leave the others in a collective: 120 s, not hours.
      auto comms = epx::Communicator::create_in_process(in_process, {}, 120.0);
      // The default configs' SMs must fit each rank's share of the GPU.
      const int share = epx::test::sm_share(*comms[0]) & ~1;  // set_num_sms takes an even count
      if (epx::Buffer::num_sms() > share) {
        epx::Buffer::set_num_sms(share);
        std::printf("epx_gpu_tests: default configs use %d SMs per rank\n", share);
      }
      worlds.resize(comms.size());
      std::vector<std::string> errors(comms.size());
      {
        std::vector<std::jthread> threads;
        for (std::size_t r = 0; r < comms.size(); ++r)
          threads.emplace_back([&, r] {
            try {
              cudaSetDevice(comms[r]->device());
              set_up(worlds[r], comms[r]);
            } catch (const std::exception& e) {
              errors[r] = e.what();
            }
          });
      }
      for (const auto& e : errors)
        if (!e.empty()) throw epx::Error(epx::ErrorCode::kInternal, e);
      const std::string engine = worlds[0].buffer->network_engine();
      std::printf(
          "epx_gpu_tests: %d in-process ranks on GPU %d (backend %s%s, %d nodes of %d, %d "
          "contexts per peer)\n",
          in_process, worlds[0].comm->device(), worlds[0].buffer->backend_name(),
          engine.empty() ? "" : (", engine " + engine).c_str(), worlds[0].buffer->num_rdma_ranks(),
          worlds[0].buffer->num_nvl_ranks(), worlds[0].buffer->num_network_contexts());
    } else {
      set_up(epx::test::world(), epx::Communicator::from_env());
      auto& w = epx::test::world();
      if (w.rank == 0)
        std::printf(
            "epx_gpu_tests: %d ranks (backend %s%s, %d nodes of %d, %d contexts per peer)\n",
            w.num_ranks, w.buffer->backend_name(),
            w.buffer->network_engine().empty() ? ""
                                               : (", engine " + w.buffer->network_engine()).c_str(),
            w.buffer->num_rdma_ranks(), w.buffer->num_nvl_ranks(),
            w.buffer->num_network_contexts());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx_gpu_tests: setup failed: %s\n", e.what());
    return 1;
  }
  // A run killed by its time limit (SIGTERM) or by hand ends here at once.
  // Some libraries' handlers (libinfinipath's, loaded with libfabric's psm
  // provider) call exit(), whose static destructors then tear down the
  // ranks' buffers on this thread while the rank threads still run: a
  // collective of rank 0 entered from two threads ("in-process barrier: rank
  // 0 entered twice", seen three times at the end of a cut run). Set after
  // the setup, which loads those libraries, so that this handler wins.
  for (int sig : {SIGTERM, SIGINT})
    std::signal(sig, [](int s) {
      const char m[] = "epx_gpu_tests: stopped by a signal; exiting without teardown\n";
      (void)!write(2, m, sizeof m - 1);
      _exit(128 + s);
    });
  const int rank = in_process > 0 ? 0 : epx::test::world().rank;
  // Rank 0 prints the whole report; the others print their failures only.
  if (rank != 0) GTEST_FLAG_SET(brief, true);
  int rc = RUN_ALL_TESTS();
  if (in_process > 0) {
    std::vector<std::jthread> threads;
    for (auto& w : worlds)
      threads.emplace_back([&w] {
        cudaSetDevice(w.comm->device());
        try {
          w.buffer->destroy();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: destroy failed: %s\n", w.rank, e.what());
        }
        w.buffer.reset();
      });
  } else {
    auto& w = epx::test::world();
    w.buffer->destroy();
    w.buffer.reset();
  }
  std::printf("rank %d: %s\n", rank, rc == 0 ? "all tests passed" : "FAILURES");
  return rc;
}
