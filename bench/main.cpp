// epx-bench: the EPX benchmark. Run one process per GPU:
//   scripts/launch.sh 4 build/default/bench/epx-bench ht --json bench/results/h200x4-ht.json
#include <nccl.h>
#include <sched.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <vector>

#include "bench/common.hpp"
#include "common/check.hpp"
#include "epx/reference.hpp"
#include "epx_git_commit.h"  // generated at every build (bench/CMakeLists.txt)

namespace epx::bench {

Config ht_base_config(const Options& o, int num_ranks) {
  Config c = get_dispatch_config(num_ranks);
  c.num_sms = o.num_sms;
  if (o.recv_tokens > 0) c.num_max_recv_tokens = o.recv_tokens;
  c.num_max_rdma_send_tokens = o.rdma_send_tokens;
  c.num_max_rdma_recv_tokens = o.rdma_recv_tokens;
  c.pull_dispatch = false;  // the push rows; the pull rows set it (EPX_HT_PULL aside)
  return c;
}

int sm_share(const World& w) {
  int gpu_sms = 0;
  EPX_CUDA_CHECK(
      cudaDeviceGetAttribute(&gpu_sms, cudaDevAttrMultiProcessorCount, w.comm->device()));
  return gpu_sms / w.comm->ranks_on_device();
}

std::string ranks_note(const World& w) {
  std::string note = w.comm->in_process() ? " (in-process on one GPU: no NVLink, a proxy)" : "";
  const std::string backend = w.buffer->backend_name();
  const std::string engine = w.buffer->network_engine();
  if (backend == "proxy" || w.buffer->num_rdma_ranks() > 1)
    note += ", backend " + backend + (engine.empty() ? "" : " (engine " + engine + ")") + ", " +
            std::to_string(w.buffer->num_rdma_ranks()) + " nodes of " +
            std::to_string(w.buffer->num_nvl_ranks()) +
            " (peers of other nodes through the network path; on one host not a NIC: the copy "
            "engines for cuda_ipc, the CPU and loopback for libfabric)";
  return note;
}

void line_up(World& w) {
  if (w.comm->in_process()) {
    // No NCCL communicator: the ranks line up on the host instead.
    EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
    w.comm->barrier();
    return;
  }
  EPX_NCCL_CHECK(ncclAllReduce(w.sync_word, w.sync_word, 1, ncclInt32, ncclSum,
                               static_cast<ncclComm_t>(w.comm->nccl_comm()), w.stream));
}

double time_us(World& w, const std::function<void()>& fn, int warmup, int iters,
               std::vector<double>* samples) {
  cudaEvent_t a, b;
  EPX_CUDA_CHECK(cudaEventCreate(&a));
  EPX_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < warmup + iters; ++i) {
    EPX_CUDA_CHECK(cudaMemsetAsync(w.flush, i & 0xff, w.flush_bytes, w.stream));
    line_up(w);
    EPX_CUDA_CHECK(cudaEventRecord(a, w.stream));
    fn();
    EPX_CUDA_CHECK(cudaEventRecord(b, w.stream));
    EPX_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup) t.push_back(ms * 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  if (samples) *samples = t;
  std::sort(t.begin(), t.end());
  return t.empty() ? 0 : t[t.size() / 2];
}

static std::vector<double> gather(World& w, double v) {
  auto all = w.comm->allgather(&v, sizeof(double));
  std::vector<double> out(w.num_ranks);
  std::memcpy(out.data(), all.data(), all.size());
  return out;
}
double mean_over_ranks(World& w, double v) {
  auto a = gather(w, v);
  double s = 0;
  for (double x : a) s += x;
  return s / a.size();
}
double min_over_ranks(World& w, double v) {
  auto a = gather(w, v);
  return *std::min_element(a.begin(), a.end());
}
double max_over_ranks(World& w, double v) {
  auto a = gather(w, v);
  return *std::max_element(a.begin(), a.end());
}

std::string device_name() {
  int dev = 0, n = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  EPX_CUDA_CHECK(cudaGetDeviceCount(&n));
  cudaDeviceProp p{};
  EPX_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return std::string(p.name) + " x" + std::to_string(n);
}

std::string git_commit() {
  return EPX_GIT_COMMIT;
}

std::shared_ptr<void> upload_bytes(const void* data, std::size_t bytes) {
  void* p = nullptr;
  EPX_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)));
  if (bytes) EPX_CUDA_CHECK(cudaMemcpy(p, data, bytes, cudaMemcpyHostToDevice));
  return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
}

TensorView tv(const void* p, DType d, std::initializer_list<int64_t> shape) {
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  return TensorView::contiguous(const_cast<void*>(p), d, shape, dev);
}

}  // namespace epx::bench

namespace epx::bench {
/// One rank's whole benchmark (a process, or a thread with --in-process).
int run_rank(std::shared_ptr<Communicator> comm, const Options& o) {
  World w;
  try {
    w.comm = std::move(comm);
    w.rank = w.comm->rank();
    w.num_ranks = w.comm->num_ranks();
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&w.stream, cudaStreamNonBlocking));
    int l2 = 0;
    EPX_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, w.comm->device()));
    w.flush_bytes = static_cast<std::size_t>(l2) * 2;
    EPX_CUDA_CHECK(cudaMalloc(&w.flush, w.flush_bytes));
    EPX_CUDA_CHECK(cudaMalloc(&w.sync_word, sizeof(int)));
    EPX_CUDA_CHECK(cudaMemset(w.sync_word, 0, sizeof(int)));
    BufferOptions bo;
    bo.backend = o.backend;
    bo.ranks_per_node = o.ranks_per_node;
    bo.num_qps_per_rank = o.qps;
    bo.proxy_engine = o.proxy_engine;
    bo.fabric_provider = o.fabric_provider;
    if (o.family == "fifo") {
      bo.num_rdma_bytes = 1 << 20;  // the fifo family makes its own proxy backend
      bo.backend = "auto";
      bo.ranks_per_node = 0;
      bo.proxy_engine = "auto";  // --engine / --provider are for that backend's engine
      bo.fabric_provider.clear();
    } else if (o.family == "ht") {
      // Nodes of --ranks-per-node or EPX_RANKS_PER_NODE (one host is one node otherwise).
      const char* env_rpn = std::getenv("EPX_RANKS_PER_NODE");
      const int rpn = o.ranks_per_node > 0 ? o.ranks_per_node : env_rpn ? std::atoi(env_rpn) : 0;
      if (rpn > 0 && rpn < w.num_ranks) {
        bo.num_nvl_bytes = static_cast<int64_t>(Buffer::get_internode_nvl_size_hint(
            o.buffer_tokens > 0 ? o.buffer_tokens : o.tokens, o.hidden, w.num_ranks, rpn, o.topk));
      } else {
        const Config c = ht_base_config(o, w.num_ranks);
        bo.num_nvl_bytes = static_cast<int64_t>(c.get_nvl_buffer_size_hint(
            static_cast<std::size_t>(o.hidden) * 2, w.num_ranks, o.topk));
      }
    } else {
      bo.num_rdma_bytes = static_cast<int64_t>(
          Buffer::get_low_latency_rdma_size_hint(o.tokens, o.hidden, w.num_ranks, o.experts));
      bo.enable_shrink = o.shrink;
    }
    w.buffer = std::make_unique<Buffer>(w.comm, bo);
    nlohmann::json result;
    result["device"] = device_name();
    result["commit"] = git_commit();
    result["command"] = o.command;
    result["num_ranks"] = w.num_ranks;
    // In-process ranks share one GPU: no NVLink, shared SMs and HBM (a proxy only).
    result["in_process"] = w.comm->in_process();
    result["backend"] = w.buffer->backend_name();
    result["ranks_per_node"] = w.buffer->num_nvl_ranks();
    result["num_qps_per_rank"] = o.qps;
    result["proxy_engine"] = w.buffer->network_engine();
    // CPUs this rank's threads may run on (the proxy threads inherit it).
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0)
      result["host_cpus_allowed"] = CPU_COUNT(&cpus);
    result["workload"] = {{"tokens", o.tokens},
                          {"hidden", o.hidden},
                          {"topk", o.topk},
                          {"experts", o.experts},
                          {"routing", "uniform random distinct experts, seeded"}};
    result["buffer_bytes_per_rank"] = w.buffer->buffer_bytes();
    if (o.family == "ht") {
      run_ht(w, o, result);
    } else if (o.family == "fifo") {
      run_fifo(w, o, result);
    } else {
      run_ll(w, o, result);
    }
    if (w.rank == 0 && !o.json_path.empty()) {
      std::ofstream(o.json_path) << result.dump(2) << "\n";
      std::printf("wrote %s\n", o.json_path.c_str());
    }
    w.buffer->destroy();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-bench rank %d: %s\n", w.rank, e.what());
    return 1;
  }
  return 0;
}
}  // namespace epx::bench

int main(int argc, char** argv) {
  using namespace epx::bench;
  CLI::App app{"epx-bench: EPX dispatch/combine benchmark (one process per GPU)"};
  Options o;
  app.require_subcommand(1);
  auto* ht = app.add_subcommand("ht", "high-throughput dispatch/combine (training, prefill)");
  auto* ll = app.add_subcommand("ll", "low-latency dispatch/combine (decode)");
  auto* fifo = app.add_subcommand(
      "fifo",
      "the CPU proxy's command path: commands/s per proxy thread, one-way latency (2 ranks)");
  fifo->add_option("--iters", o.iters, "scales the command and round-trip counts")
      ->capture_default_str();
  fifo->add_option("--json", o.json_path, "write results here (rank 0)");
  fifo->add_option("--in-process", o.in_process, "2: both ranks as threads on this GPU")
      ->check(CLI::Range(2, 2));
  fifo->add_flag("--host", o.fifo_host,
                 "no GPU: 2 forked processes on this host, each with its own libfabric engine "
                 "and Proxy on host memory, posting from a host thread");
  fifo->add_option("--engine", o.proxy_engine,
                   "the proxy's engine: auto | cuda_ipc | libfabric (--host: libfabric)")
      ->capture_default_str();
  fifo->add_option("--provider", o.fabric_provider,
                   "the libfabric engine's provider: tcp (tcp;ofi_rxm) | shm, or a libfabric "
                   "provider name");
  for (auto* sc : {ht, ll}) {
    sc->add_option("--tokens", o.tokens, "tokens per rank (ht: 4096, ll: 128)");
    sc->add_option("--hidden", o.hidden, "hidden size")->capture_default_str();
    sc->add_option("--topk", o.topk, "experts per token")->capture_default_str();
    sc->add_option("--experts", o.experts, "experts in total")->capture_default_str();
    sc->add_option("--warmup", o.warmup, "untimed runs")->capture_default_str();
    sc->add_option("--iters", o.iters, "timed runs (median reported)")->capture_default_str();
    sc->add_option("--json", o.json_path, "write results here (rank 0)");
    sc->add_option("--backend", o.backend, "auto | nvlink | in_process | proxy | nccl | nvshmem")
        ->capture_default_str();
    sc->add_option("--ranks-per-node", o.ranks_per_node,
                   "ranks per (virtual) node: fewer than the host holds makes the peers of other "
                   "nodes network peers (0: EPX_RANKS_PER_NODE, else the host)")
        ->capture_default_str();
    sc->add_option("--proxy-engine", o.proxy_engine,
                   "the proxy backend's engine: auto | cuda_ipc | libfabric")
        ->capture_default_str();
    sc->add_option("--fabric-provider", o.fabric_provider,
                   "the libfabric engine's provider (tcp;ofi_rxm, shm, verbs;ofi_rxm, efa)");
    sc->add_option("--qps", o.qps, "contexts per peer (num_qps_per_rank; proxy channels)")
        ->capture_default_str();
  }
  ht->add_option("--sms", o.num_sms, "SMs for the kernels")->capture_default_str();
  ht->add_flag("!--no-sweep", o.sweep, "skip the config sweep");
  ll->add_flag("--pair-sync", o.pair_sync,
               "back to back: the host waits for each pair before the next (tells queued GPU "
               "work apart from the ops themselves)");
  ll->add_flag("--pair-lineup", o.pair_lineup,
               "back to back: the ranks line up (an all-reduce on the stream, no host wait) "
               "before each pair (tells misaligned ranks apart from queued work)");
  ll->add_flag("--shrink", o.shrink,
               "a buffer with enable_shrink (no rank masked): what the mask checks cost");
  for (auto* sc : {ht, ll})
    sc->add_option("--in-process", o.in_process,
                   "run that many ranks as threads on the current GPU (Communicator::"
                   "create_in_process): no NVLink, the ranks share the GPU's SMs and memory; "
                   "for relative comparisons on a one-GPU machine only")
        ->check(CLI::Range(2, 64));
  ht->add_option("--recv-tokens", o.recv_tokens,
                 "ring rows per peer rank (config.num_max_recv_tokens; default: the default "
                 "config's; fewer than a pair's rows makes the ring lap)")
      ->check(CLI::PositiveNumber);
  ht->add_option("--rdma-send-tokens", o.rdma_send_tokens,
                 "across nodes with EPX_HT_RINGS: records per network put "
                 "(config.num_max_rdma_send_tokens; default EPX's)")
      ->check(CLI::PositiveNumber);
  ht->add_option("--rdma-recv-tokens", o.rdma_recv_tokens,
                 "across nodes with EPX_HT_RINGS: records per network ring "
                 "(config.num_max_rdma_recv_tokens; default EPX's)")
      ->check(CLI::PositiveNumber);
  ht->add_option("--buffer-tokens", o.buffer_tokens,
                 "across nodes: size the buffer by get_internode_nvl_size_hint for this many "
                 "tokens (default --tokens); fewer sends the calls that do not fit through the "
                 "rings")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  // In-process ranks share one CUDA context and its hardware queues (8 by
  // default): a proxy's copy stream that shares one with a rank's stream waits
  // behind that rank's kernel, which may wait for the copy. Set before the
  // context exists.
  if (o.in_process > 0) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  o.family = ht->parsed() ? "ht" : fifo->parsed() ? "fifo" : "ll";
  if (o.family == "fifo" && o.fabric_provider == "tcp") o.fabric_provider = "tcp;ofi_rxm";
  if (o.tokens == 0) o.tokens = o.family == "ht" ? 4096 : 128;
  for (int i = 0; i < argc; ++i) o.command += (i ? " " : "") + std::string(argv[i]);
  if (o.fifo_host) {
    // No CUDA call on this path: it runs on a machine without a GPU.
    if (o.in_process > 0) {
      std::fprintf(stderr, "epx-bench fifo: --host and --in-process exclude each other\n");
      return 2;
    }
    if (o.proxy_engine == "auto") o.proxy_engine = "libfabric";
    return run_fifo_host(o);
  }

  if (o.in_process > 0) {
    int dev = 0;
    EPX_CUDA_CHECK(cudaGetDevice(&dev));
    std::vector<std::shared_ptr<epx::Communicator>> comms;
    try {
      comms = epx::Communicator::create_in_process(o.in_process);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "epx-bench: %s\n", e.what());
      return 1;
    }
    std::vector<int> rc(comms.size(), 0);
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < comms.size(); ++r)
      threads.emplace_back([&, r] {
        cudaSetDevice(dev);
        rc[r] = run_rank(comms[r], o);
      });
    for (auto& t : threads) t.join();
    return *std::max_element(rc.begin(), rc.end());
  }
  std::shared_ptr<epx::Communicator> comm;
  try {
    comm = epx::Communicator::from_env();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-bench: %s\n", e.what());
    return 1;
  }
  return run_rank(comm, o);
}
