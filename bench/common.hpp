// bench/common.hpp - what every epx-bench family shares: the world, timing
// with CUDA events around a rank-synchronized start, L2 flushing, results.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace epx::bench {

struct Options {
  std::string family;  ///< "ht" | "ll" | "fifo"
  int tokens = 0, hidden = 7168, topk = 8, experts = 256;
  int num_sms = 24;
  int recv_tokens = 0;  ///< ht: ring rows per peer (0: the default config's)
  int rdma_send_tokens = 0, rdma_recv_tokens = 0;  ///< ht across nodes, the ring dispatch's
  int in_process = 0;  ///< > 0: that many ranks as threads on one GPU (no NVLink: a proxy)
  std::string backend = "auto";  ///< BufferOptions::backend
  int ranks_per_node = 0;  ///< BufferOptions::ranks_per_node (0: EPX_RANKS_PER_NODE or the host)
  int qps = 1;             ///< BufferOptions::num_qps_per_rank (proxy channels)
  std::string proxy_engine = "auto";  ///< BufferOptions::proxy_engine
  std::string fabric_provider;        ///< BufferOptions::fabric_provider
  /// fifo: the host-memory variant (fifo_host.cpp): 2 forked processes, each
  /// with its own libfabric engine (--provider) and Proxy, no GPU
  bool fifo_host = false;
  int warmup = 10, iters = 50;
  bool sweep = true;
  bool shrink = false;       ///< ll: BufferOptions::enable_shrink (no rank masked)
  bool pair_sync = false;    ///< ll: the host waits after each back-to-back pair (diagnosis)
  bool pair_lineup = false;  ///< ll: the ranks line up (device all-reduce) before each pair
  std::string json_path;
  std::string command;  ///< the command line, for the result file
  int64_t nvl_bytes = 0, rdma_bytes = 0;
  /// ht across nodes: num_nvl_bytes is the hint for this many tokens (0: --tokens)
  int buffer_tokens = 0;
};

struct World {
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<Buffer> buffer;
  cudaStream_t stream = nullptr;
  int rank = 0, num_ranks = 1;
  void* flush = nullptr;  ///< 2x L2 worth of bytes, rewritten between runs
  std::size_t flush_bytes = 0;
  int* sync_word = nullptr;
};

/// The HT bench's base config: the default for R ranks at --sms, with the
/// --recv-tokens ring if given (also what sizes the buffer).
Config ht_base_config(const Options& o, int num_ranks);
/// What the tables print after the rank count: in-process ranks are a proxy.
std::string ranks_note(const World& w);
/// SMs this rank may use: the GPU's, split among the in-process ranks on it.
int sm_share(const World& w);

/// Lines the ranks up before a timed run: a one-int NCCL all-reduce on the
/// stream (in-process ranks, which have no NCCL communicator: a host barrier
/// after the stream drains).
void line_up(World& w);

/// Median over `iters` runs of `fn` (microseconds), each run after an L2
/// flush and a device-side all-reduce that lines the ranks up, timed with
/// CUDA events on the caller's stream.
double time_us(World& w, const std::function<void()>& fn, int warmup, int iters,
               std::vector<double>* samples = nullptr);

/// Mean / min over ranks of a per-rank value.
double mean_over_ranks(World& w, double v);
double min_over_ranks(World& w, double v);
double max_over_ranks(World& w, double v);

std::string device_name();
std::string git_commit();
/// Device copy of host data (freed with the last owner).
std::shared_ptr<void> upload_bytes(const void* data, std::size_t bytes);
template <class T>
std::shared_ptr<void> upload(const std::vector<T>& v) {
  return upload_bytes(v.data(), v.size() * sizeof(T));
}
/// Contiguous view of device memory on the current device.
TensorView tv(const void* p, DType d, std::initializer_list<int64_t> shape);

/// Each family fills `result` (rank 0 writes it to Options::json_path).
void run_ht(World& w, const Options& o, nlohmann::json& result);
void run_ll(World& w, const Options& o, nlohmann::json& result);
void run_fifo(World& w, const Options& o, nlohmann::json& result);
/// epx-bench fifo --host (no World: no GPU, no Communicator); the exit code.
int run_fifo_host(const Options& o);

}  // namespace epx::bench
