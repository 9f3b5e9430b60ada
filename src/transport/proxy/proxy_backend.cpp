// The CPU-proxy backend: peers in this rank's (possibly virtual) node reached
// by load/store; the others through commands the GPU posts into per-channel
// rings that proxy threads hand to the engine:
//   - cuda_ipc (one host): symmetric memory from cudaMalloc (cuMem with
//     EPX_PROXY_CUMEM=1 and a process per rank), same-node peers through the
//     engine's mappings, puts on the GPU's copy engines;
//   - libfabric (tcp;ofi_rxm, shm, verbs;ofi_rxm, efa): regions the provider
//     registers. This libfabric has no FI_HMEM for CUDA, so they are pinned
//     host memory mapped into the GPU (the kernels read and write it over
//     PCIe; the proxy makes no CUDA call per command); same-node peers are
//     reached by pointer: ranks of one process share it, processes of one
//     node map each other's regions (node_memory.hpp).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include "transport/registry.hpp"

#include "common/check.hpp"
#include "common/env.hpp"
#include "core/stream_wait.hpp"
#include "epx/communicator.hpp"
#include "epx/error.hpp"
#include "transport/backend.hpp"
#include "transport/proxy/libfabric_engine.hpp"
#include "transport/proxy/node_memory.hpp"
#include "transport/proxy/proxy.hpp"

namespace epx::transport {
namespace {

/// EPX_DEBUG_PROXY_STOP naming this rank: its proxy channel stops early (tests).
void read_stop_knob(int rank, proxy::ProxyOptions& o) {
  const auto stop = env::debug_proxy_stop();
  if (!stop || stop->rank != rank) return;
  o.stop_channel = stop->channel;
  o.stop_after = static_cast<uint64_t>(stop->commands);
  std::fprintf(stderr,
               "epx: EPX_DEBUG_PROXY_STOP: rank %d's proxy channel %d stops after %d commands\n",
               stop->rank, stop->channel, stop->commands);
}

/// The engine BufferOptions::proxy_engine (or EPX_PROXY_ENGINE) names; "auto":
/// CUDA IPC where every rank is on one host, else libfabric.
std::string engine_choice(const BackendOptions& options) {
  std::string name = options.proxy_engine.empty() ? "auto" : options.proxy_engine;
  if (name == "auto") name = env::proxy_engine();
  if (name == "auto") name = options.num_hosts > 1 ? "libfabric" : "cuda_ipc";
  if (name != "cuda_ipc" && name != "libfabric")
    throw Error(ErrorCode::kInvalidArgument,
                "proxy_engine: must be auto, cuda_ipc or libfabric, got '" + name + "'");
  if (name == "cuda_ipc" && options.num_hosts > 1)
    throw Error(
        ErrorCode::kInvalidArgument,
        "proxy_engine: cuda_ipc reaches the ranks of one host only, and these ranks run on " +
            std::to_string(options.num_hosts) + " hosts (use libfabric)");
  return name;
}

class ProxyBackend final : public Backend {
 public:
  ProxyBackend(Communicator& comm, const Topology& topology, const BackendOptions& options)
      : comm_(comm),
        topo_(topology),
        engine_name_(engine_choice(options)),
        fabric_(engine_name_ == "libfabric"),
        cumem_(!fabric_ && proxy::cumem_regions(options.proxy_cumem, comm.ranks_on_device())) {
    // One thread per channel: num_qps_per_rank (DeepEP's default is 24) is
    // capped at EPX_PROXY_CHANNELS (default 4) channels per rank.
    num_channels_ = std::clamp(options.num_contexts, 1, env::proxy_channels(kMaxContexts));
    // The proxy carries puts to other nodes only (same-node peers: load/store).
    std::vector<uint8_t> targets(static_cast<std::size_t>(topology.num_ranks), 0);
    for (int r = 0; r < topology.num_ranks; ++r)
      targets[r] = topology.same_node(comm.rank(), r) ? 0 : 1;
    if (fabric_) {
      // Pinned host regions: same-node peers are reached by pointer, which
      // ranks of one process share; the processes of one node map each
      // other's (memfds over a host mesh, node_memory.hpp).
      auto exchange = std::shared_ptr<proxy::Exchange>(proxy::make_communicator_exchange(comm));
      if (!comm.in_process() && topology.ranks_per_node > 1) {
        std::vector<int> node;
        const int first = topology.node_of(comm.rank()) * topology.ranks_per_node;
        for (int i = 0; i < topology.ranks_per_node; ++i) node.push_back(first + i);
        node_memory_ =
            std::make_unique<proxy::NodeMemory>(*exchange, std::move(node), env::timeout_seconds());
      }
      proxy::LibfabricOptions lo;
      lo.provider =
          options.fabric_provider.empty() ? env::fabric_provider() : options.fabric_provider;
      lo.domains = options.fabric_domains.empty() ? env::fabric_domains() : options.fabric_domains;
      lo.timeout_s = env::timeout_seconds();
      engine_ = proxy::make_libfabric_engine(std::move(exchange), num_channels_, lo);
      if (comm.rank() == 0) {
        const proxy::LibfabricStats st = proxy::libfabric_stats(*engine_);
        std::fprintf(stderr,
                     "epx: proxy engine %s (%s), regions in pinned host memory (no FI_HMEM for "
                     "CUDA in this libfabric)\n",
                     proxy::describe(st).c_str(),
                     st.delivery_complete ? "delivery complete" : "transmit complete");
      }
    } else {
      engine_ = proxy::make_cuda_ipc_engine(comm, num_channels_, std::move(targets), cumem_);
    }
    proxy::ProxyOptions po;
    po.num_channels = num_channels_;
    po.device = comm.device();
    if (const auto ring = env::proxy_ring()) po.capacity = *ring;
    read_stop_knob(comm.rank(), po);
    options_ = po;
    // A receiver waits for one signal per context of the sender: every rank
    // must use the same count.
    const std::vector<int> all = comm.allgather_value(num_channels_);
    for (int r = 0; r < comm.num_ranks(); ++r) {
      const int theirs = all[r];
      if (theirs != num_channels_)
        throw Error(ErrorCode::kInvalidArgument,
                    "num_qps_per_rank / EPX_PROXY_CHANNELS: every rank must use the same number "
                    "of proxy channels: rank " +
                        std::to_string(r) + " uses " + std::to_string(theirs) + ", rank " +
                        std::to_string(comm.rank()) + " " + std::to_string(num_channels_));
    }
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~ProxyBackend() override {
    if (proxy_) proxy_->stop();
    if (stream_) cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "proxy"; }
  int rank() const override { return comm_.rank(); }
  int num_ranks() const override { return comm_.num_ranks(); }
  const Topology& topology() const override { return topo_; }
  int num_contexts() const override { return num_channels_; }
  std::string engine_name() const override {
    if (fabric_) return proxy::describe(proxy::libfabric_stats(*engine_));
    return engine_name_ + (cumem_ ? ", own CUDA context" : ", primary context");
  }
  std::optional<NetworkTraffic> network_traffic() const override {
    NetworkTraffic sum;  // not started: nothing carried yet
    for (int c = 0; proxy_ && c < proxy_->num_channels(); ++c) {
      const NetworkTraffic t = proxy_->traffic(c);
      sum.commands += t.commands;
      sum.puts += t.puts;
      sum.put_bytes += t.put_bytes;
      sum.signals += t.signals;
      sum.writes += t.writes;
    }
    return sum;
  }

  SymmetricRegion alloc(std::size_t bytes) override {
    SymmetricRegion r;
    r.bytes = (bytes == 0 ? 4096 : (bytes + 4095) / 4096 * 4096);
    r.id = next_id_++;
    if (r.id >= proxy::kMaxRegions)
      throw Error(ErrorCode::kInternal, "proxy backend: too many regions");
    if (fabric_) {
      if (node_memory_) {
        // Zeroed memfds of every rank of the node, each registered here.
        proxy::NodeMemory::Region nr = node_memory_->alloc(r.bytes);
        try {
          for (int p : node_memory_->node()) register_host(nr.peers[p], nr.bytes, p);
        } catch (...) {
          for (int p : node_memory_->node()) cudaHostUnregister(nr.peers[p]);  // those it made
          cudaGetLastError();  // (the ones it had not made fail)
          node_memory_->free(nr);
          throw;
        }
        r.local = nr.local;
        r.bytes = nr.bytes;
        node_regions_[r.id] = std::move(nr);
      } else {
        // Mapped, so the kernels reach it at the same address (unified addressing).
        EPX_CUDA_CHECK(
            cudaHostAlloc(&r.local, r.bytes, cudaHostAllocMapped | cudaHostAllocPortable));
        std::memset(r.local, 0, r.bytes);
      }
    } else {
      if (cumem_)
        r.local = proxy::alloc_cumem_region(comm_.device(), r.bytes);
      else
        EPX_CUDA_CHECK(cudaMalloc(&r.local, r.bytes));
      // On the backend's stream, waited for with the deadline: not a wait for
      // the whole device (other in-process ranks' kernels included).
      EPX_CUDA_CHECK(cudaMemsetAsync(r.local, 0, r.bytes, stream_));
      wait_own_stream(*this, stream_, "alloc", "the zero fill of the symmetric region");
    }
    // Collective: every rank's region is registered (and zeroed) before any
    // command names it.
    engine_->register_region(r.id, r.local, r.bytes);
    r.peers.assign(comm_.num_ranks(), nullptr);
    // Ranks of one process: every rank's pinned region by its address.
    std::vector<uint64_t> shared;
    if (fabric_ && comm_.in_process())
      shared = comm_.allgather_value(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(r.local)));
    for (int p = 0; p < comm_.num_ranks(); ++p) {
      if (!topo_.same_node(p, comm_.rank())) continue;
      const auto node_region = node_regions_.find(r.id);
      r.peers[p] = p == comm_.rank() ? r.local
                   : !shared.empty() ? reinterpret_cast<void*>(static_cast<uintptr_t>(shared[p]))
                   : node_region != node_regions_.end() ? node_region->second.peers[p]
                                                        : engine_->mapped(r.id, p);
      if (r.peers[p] == nullptr)
        throw Error(ErrorCode::kUnsupported, "proxy backend: rank " + std::to_string(p) +
                                                 " is in rank " + std::to_string(comm_.rank()) +
                                                 "'s node but engine '" + engine_->name() +
                                                 "' does not map its memory");
    }
    barrier();
    return r;
  }

  void free(SymmetricRegion& r) override {
    if (!r.local) return;
    barrier();
    // The core waited for the ops it tracks with its deadline; the
    // device-wide wait is for those it does not (CUDA graph replays), under a
    // watchdog. The proxy's copies are the engine's to wait for (its streams,
    // with the deadline, at stop and deregistration).
    detail::device_synchronize_watched(
        {"free", comm_.rank(), "every kernel that may still use the region"}, backend_wait_s());
    barrier();  // no rank's kernels or proxy still write this memory
    if (proxy_) {
      proxy_->stop();  // commands left in the rings are dropped (the ops are done)
      proxy_.reset();
    }
    engine_->deregister_region(r.id);
    if (const auto it = node_regions_.find(r.id); it != node_regions_.end()) {
      for (int p : node_memory_->node()) EPX_CUDA_CHECK(cudaHostUnregister(it->second.peers[p]));
      node_memory_->free(it->second);
      node_regions_.erase(it);
    } else if (fabric_) {
      EPX_CUDA_CHECK(cudaFreeHost(r.local));
    } else if (cumem_)
      proxy::free_cumem_region(r.local, r.bytes);
    else
      EPX_CUDA_CHECK(cudaFree(r.local));
    barrier();
    r = SymmetricRegion{};
  }

  void barrier() override { comm_.barrier(); }

  /// The rings and threads are made here, while no kernel of this buffer
  /// runs: allocating pinned and device memory can wait for the GPU, which for
  /// ranks sharing one waits for their kernels.
  void start() override {
    if (!proxy_) proxy_ = std::make_unique<proxy::Proxy>(*engine_, options_);
    barrier();
  }

  dev::AnyTransport device(const SymmetricRegion& r) const override {
    if (!proxy_) throw Error(ErrorCode::kInternal, "proxy backend: device() before start()");
    dev::ProxyTransport t{};
    t.rank = comm_.rank();
    t.num_ranks = comm_.num_ranks();
    t.ranks_per_node = topo_.ranks_per_node;
    t.node_first = topo_.node_of(comm_.rank()) * topo_.ranks_per_node;
    for (int i = 0; i < topo_.ranks_per_node; ++i)
      t.base[i] = static_cast<char*>(r.peers[t.node_first + i]);
    t.local = static_cast<char*>(r.local);
    t.region = r.id;
    t.channels = proxy_->views_device();
    return t;
  }

  void quiesce() override {
    if (proxy_) proxy_->drain(env::timeout_seconds());
  }

  void region_cleared(const SymmetricRegion& r) override { engine_->reset_signals(r.id); }

  void check_health() const override {
    if (proxy_) proxy_->check();
  }

  /// A host far ahead of the GPU fills CUDA's launch queue; its thread then
  /// blocks in a launch while the kernels queued before wait for the proxy's
  /// threads, whose CUDA calls can be held meanwhile (the soak at 2x2 stalled
  /// until the deadline with either context, and passed with a host wait
  /// every 50 pairs). 16 ops keep the queue far from full and never hold a
  /// caller that syncs once per layer.
  int default_ops_in_flight() const override { return 16; }

  /// A proxy channel's ring that stayed full, commands that did not complete,
  /// or its thread that stopped (transport/proxy/device.cuh reports them).
  std::optional<std::string> describe_failure(const DeviceDiag& g,
                                              double timeout_s) const override {
    (void)timeout_s;
    const auto code = static_cast<DiagCode>(g.code);
    const auto what = static_cast<OpId>(g.op);
    if (code != DiagCode::kProxyStopped &&
        !(code == DiagCode::kTimeout && (what == OpId::kProxyPost || what == OpId::kProxyQuiet)))
      return std::nullopt;
    check_health();  // names the channel, the command and the cause when it died
    std::ostringstream os;
    os << op_name(what) << ": rank " << g.rank << "'s proxy channel " << g.channel
       << (code == DiagCode::kProxyStopped ? " stopped" : " made no progress within the deadline")
       << " (slot/command " << g.expected << ", channel at " << g.seen
       << "); the proxy thread is stalled or dead";
    const std::string note = stall_note();
    if (!note.empty()) os << "; " << note;
    return os.str();
  }

  std::string stall_note() const override {
    if (!proxy_) return {};
    proxy::Proxy::SlowCall worst;
    int at = -1;
    for (int c = 0; c < proxy_->num_channels(); ++c) {
      const auto s = proxy_->take_slow_call(c);
      if (s.seconds > worst.seconds) worst = s, at = c;
    }
    if (at < 0) return {};
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.1f", worst.seconds);
    std::string note = "rank " + std::to_string(comm_.rank()) + "'s proxy channel " +
                       std::to_string(at) + " spent " + secs + " s in one step of its engine (" +
                       worst.what + ")";
    const std::string cause = engine_->held_call_cause();
    if (!cause.empty()) note += ": " + cause;
    return note;
  }

 private:
  Communicator& comm_;
  Topology topo_;
  const std::string engine_name_;  ///< cuda_ipc | libfabric
  const bool fabric_;              ///< the libfabric engine: pinned host regions
  const bool cumem_;               ///< regions from alloc_cumem_region (BufferOptions::proxy_cumem)
  int num_channels_ = 1;
  int next_id_ = 0;
  cudaStream_t stream_ = nullptr;  ///< the zero fills of the regions
  std::unique_ptr<proxy::Engine> engine_;
  proxy::ProxyOptions options_;
  /// Made by start(), once every region is registered.
  std::unique_ptr<proxy::Proxy> proxy_;
  /// libfabric with several processes in a node: their shared host regions.
  std::unique_ptr<proxy::NodeMemory> node_memory_;
  std::map<int, proxy::NodeMemory::Region> node_regions_;  ///< by region id

  /// Registers rank `owner`'s mapping [p, p + bytes) with CUDA, mapped: the
  /// kernels reach it at the same address (unified addressing), or this
  /// throws naming the rank.
  void register_host(void* p, std::size_t bytes, int owner) const {
    EPX_CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
    void* dev = nullptr;
    EPX_CUDA_CHECK(cudaHostGetDevicePointer(&dev, p, 0));
    if (dev != p)
      throw Error(ErrorCode::kUnsupported,
                  "proxy backend (libfabric): rank " + std::to_string(owner) +
                      "'s shared host region maps at another device address here (" +
                      std::to_string(reinterpret_cast<uintptr_t>(dev)) + " for host " +
                      std::to_string(reinterpret_cast<uintptr_t>(p)) +
                      "): this GPU cannot use registered host memory at its host address");
  }
};

}  // namespace

std::unique_ptr<Backend> make_proxy_backend(Communicator& comm, const Topology& topology,
                                            const BackendOptions& options) {
  return std::make_unique<ProxyBackend>(comm, topology, options);
}

/// Serves any ranks: the last that auto tries (several nodes, or more ranks
/// than one node's load/store backends take).
const BackendInfo& proxy_backend_info() {
  static const BackendInfo info{"proxy", /*auto_order=*/2, nullptr, &make_proxy_backend};
  return info;
}

}  // namespace epx::transport
