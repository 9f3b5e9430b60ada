#include "transport/nccl/nccl_backend.hpp"
#include "transport/registry.hpp"

#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/check.hpp"
#include "common/device.cuh"
#include "common/env.hpp"
#include "common/nccl_comm.hpp"
#include "common/plan.hpp"
#include "core/nccl_version.hpp"
#include "core/stream_wait.hpp"
#include "epx/communicator.hpp"
#include "epx/error.hpp"
#include "transport/nccl/device.cuh"

namespace epx::transport {
namespace {

__global__ void gin_lsa_pointers(ncclWindow_t win, const int* lsa_index, int n, char** out) {
  const int i = threadIdx.x;
  if (i < n) out[i] = static_cast<char*>(ncclGetLsaPointer(win, 0, lsa_index[i]));
}

/// Signals [0, count) and `drain` of every context back to 0.
__global__ void gin_reset_signals(const ncclDevComm* comms, int num_contexts, int count,
                                  int drain) {
  const int ctx = blockIdx.x;
  if (ctx >= num_contexts) return;
  ncclGin g(comms[ctx / dev::kGinContextsPerComm], ctx % dev::kGinContextsPerComm);
  for (int s = threadIdx.x; s < count; s += blockDim.x)
    g.resetSignal(static_cast<ncclGinSignal_t>(s));
  if (threadIdx.x == 0) g.resetSignal(static_cast<ncclGinSignal_t>(drain));
}

/// One round of the quiesce: on every context, a signal add of 1 to every
/// rank of another node on signal `drain` (through the credit gate), then a
/// wait until this rank's own word of it reached `expected` (every such
/// rank's add of this round came, and a context's signal comes after its
/// earlier signals and puts to this rank). *failed = 1 at the deadline.
__global__ void gin_drain(const ncclDevComm* comms, unsigned* tickets, int num_contexts,
                          int num_ranks, int ranks_per_node, int me, int drain, uint64_t expected,
                          uint64_t timeout_ns, int* failed) {
  const int ctx = blockIdx.x;
  if (ctx >= num_contexts || threadIdx.x != 0) return;
  const ncclDevComm& dc = comms[ctx / dev::kGinContextsPerComm];
  ncclGin g(dc, ctx % dev::kGinContextsPerComm);
  const int node = me / ranks_per_node;
  for (int r = 0; r < num_ranks; ++r) {
    if (r / ranks_per_node == node) continue;
    if (!dev::gin_credit(dc, ctx % dev::kGinContextsPerComm,
                         tickets ? tickets + ctx * kMaxRanks : nullptr, r, timeout_ns, nullptr, me,
                         ctx)) {
      atomicExch(failed, 1);
      return;
    }
    g.signal(ncclTeamWorld(dc), r, ncclGin_SignalAdd{static_cast<ncclGinSignal_t>(drain), 1},
             ncclCoopThread{});
  }
  const uint64_t t0 = dev::globaltimer_ns();
  while (g.readSignal(static_cast<ncclGinSignal_t>(drain)) < expected) {
    if (dev::globaltimer_ns() - t0 > timeout_ns) {
      atomicExch(failed, 1);
      return;
    }
  }
}

/// No op in flight: each gated context's tickets back to NCCL's produced
/// index per peer (a ticket whose credit wait failed posted nothing, and
/// the tickets ran ahead of it). One block per context, threads per peer.
__global__ void gin_sync_tickets(const ncclDevComm* comms, unsigned* tickets, int num_contexts,
                                 int num_ranks) {
  const int ctx = blockIdx.x;
  if (ctx >= num_contexts) return;
  const ncclGinProxyGpuCtx_t* q =
      dev::gin_proxy_queues(comms[ctx / dev::kGinContextsPerComm], ctx % dev::kGinContextsPerComm);
  if (q == nullptr) return;
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x)
    tickets[ctx * kMaxRanks + r] = *static_cast<const volatile uint32_t*>(q->pis + r);
}

/// Every put posted on every context has read its source (NCCL's counter of
/// the context reached EPX's count of posted puts): no descriptor names a
/// window any more. NCCL's flush waits for the same with no deadline; here
/// *failed = 1 at the deadline.
__global__ void gin_flush_all(const ncclDevComm* comms, const unsigned long long* posted,
                              int num_contexts, uint64_t timeout_ns, int* failed) {
  const int ctx = blockIdx.x;
  if (ctx >= num_contexts || threadIdx.x != 0) return;
  ncclGin g(comms[ctx / dev::kGinContextsPerComm], ctx % dev::kGinContextsPerComm);
  const uint64_t target = posted[ctx];
  const uint64_t t0 = dev::globaltimer_ns();
  while (g.readCounter(dev::NcclGinTransport::counter_of(ctx)) < target) {
    if (dev::globaltimer_ns() - t0 > timeout_ns) {
      atomicExch(failed, 1);
      return;
    }
  }
}

std::string result_name(ncclResult_t r) {
  return std::string(ncclGetErrorString(r)) + " (" + std::to_string(static_cast<int>(r)) + ")";
}

class NcclGin final : public Backend {
 public:
  NcclGin(Communicator& comm, const Topology& topology, int num_contexts, int num_signals,
          int num_cleared_signals)
      : comm_(comm),
        topo_(topology),
        num_contexts_(num_contexts),
        num_signals_(num_signals),
        num_cleared_signals_(num_cleared_signals) {
    try {
      init();
    } catch (...) {
      release();  // a constructor that throws runs no destructor
      throw;
    }
  }

  void init() {
    Communicator& comm = comm_;
    const Topology& topology = topo_;
    const int num_contexts = num_contexts_, num_signals = num_signals_;
    // Before any device struct is made: they are laid out as this build's
    // headers say (the others then name this rank at their first agreement).
    std::string library;
    nccl_version::check_gin_device_abi(nccl_version::loaded(library), NCCL_VERSION_CODE, library);
    // NCCL's splits and device communicators wait for every rank without a
    // deadline: before each, the ranks agree (an all-gather with the
    // communicator's deadline) that every one got there, so a rank that
    // failed first is named instead of waited for. A collective call that
    // fails on this rank is reported at the next agreement.
    DeviceGuard guard(comm.device());
    std::exception_ptr failed;
    auto agree = [&](const std::string& step) {
      transport::agree_before(comm, "nccl backend: " + step, [&] {
        if (failed) std::rethrow_exception(std::exchange(failed, nullptr));
      });
    };
    auto attempt = [&](const std::function<void()>& call) {
      try {
        call();
      } catch (...) {
        failed = std::current_exception();
      }
    };
    attempt([&] {
      require(!comm.in_process() && comm.nccl_comm() != nullptr, "backend",
              "'nccl' needs an NCCL communicator (Communicator::create or from_env), one GPU per "
              "rank: NCCL refuses two ranks on one GPU");
      require(num_contexts >= 1 && num_contexts <= kMaxContexts, "num_qps_per_rank",
              "must be in [1, " + std::to_string(kMaxContexts) + "] for the nccl backend, got " +
                  std::to_string(num_contexts));
      require(num_signals >= 1 && num_signals <= 65536, "num_signals",
              "must be in [1, 65536] (NCCL's signal pool), got " + std::to_string(num_signals));
      EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      EPX_CUDA_CHECK(
          cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(HostWords), cudaHostAllocDefault));
    });
    auto* parent = static_cast<ncclComm_t>(comm.nccl_comm());
    const int K = (num_contexts + dev::kGinContextsPerComm - 1) / dev::kGinContextsPerComm;
    // Own communicators: context c is context c % 4 of comm c / 4. Whether a
    // split shares the parent's resources (and so its 4 GIN contexts) is the
    // parent's splitShare (0 unless the user set it, or
    // NCCL_COMM_SPLIT_SHARE_RESOURCES); shared, the contexts are still
    // correct, only fewer queues.
    for (int k = 0; k < K; ++k) {
      agree("ncclCommSplit of communicator " + std::to_string(k));
      attempt([&] {
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.splitShare = 0;
        ncclComm_t c = nullptr;
        EPX_NCCL_CHECK(ncclCommSplit(parent, 0, comm.rank(), &c, &cfg));
        comms_.push_back(c);
      });
    }
    // GIN forced on (one host is one NCCL node, where NCCL leaves it off),
    // every context connected to every rank now, not at the first op.
    devcomms_.resize(K);
    for (int k = 0; k < K; ++k) {
      agree("ncclDevCommCreate of communicator " + std::to_string(k));
      attempt([&] {
        ncclDevCommRequirements reqs{};
        reqs.ginForceEnable = true;
        reqs.ginContextCount = dev::kGinContextsPerComm;
        reqs.ginSignalCount = num_signals + 1;            // + the quiesce's drain signal
        reqs.ginCounterCount = dev::kGinContextsPerComm;  // one per context: quiet's
        const ncclResult_t r = ncclDevCommCreate(comms_[k], &reqs, &devcomms_[k]);
        if (r != ncclSuccess)
          throw Error(ErrorCode::kUnsupported,
                      "nccl backend: ncclDevCommCreate with GIN failed on rank " +
                          std::to_string(comm.rank()) + ": " + result_name(r) +
                          "; NCCL needs a GIN-capable net plugin (on one host: the loopback "
                          "plugin, NCCL_NET_PLUGIN=epxloop with libnccl-net-epxloop.so on "
                          "LD_LIBRARY_PATH; docs/nccl_gin.md)");
        devcomm_made_.push_back(true);
        require(devcomms_[k].ginContextCount >= 1, "backend",
                "nccl: the device communicator has no GIN context");
        contexts_per_comm_ =
            std::min(contexts_per_comm_, static_cast<int>(devcomms_[k].ginContextCount));
      });
    }
    agree("the exchange of GIN context counts");
    require(contexts_per_comm_ == dev::kGinContextsPerComm || K == 1, "num_qps_per_rank",
            "needs " + std::to_string(dev::kGinContextsPerComm) +
                " GIN contexts per communicator (NCCL_GIN_NCONTEXTS), NCCL gave " +
                std::to_string(contexts_per_comm_));
    if (K == 1) num_contexts_ = std::min(num_contexts_, contexts_per_comm_);
    // A receiver waits for every context's word of a signal: every rank must
    // use the same count.
    const std::vector<int> all = comm.allgather_value(num_contexts_);
    for (int r = 0; r < comm.num_ranks(); ++r) {
      const int theirs = all[r];
      require(theirs == num_contexts_, "num_qps_per_rank",
              "nccl: rank " + std::to_string(r) + " uses " + std::to_string(theirs) +
                  " GIN contexts, rank " + std::to_string(comm.rank()) + " " +
                  std::to_string(num_contexts_) +
                  " (num_qps_per_rank, EPX_GIN_CONTEXTS and NCCL_GIN_NCONTEXTS must agree)");
    }
    EPX_CUDA_CHECK(cudaMalloc(&d_failed_, sizeof(int)));
    EPX_CUDA_CHECK(cudaMalloc(&d_posted_, sizeof(unsigned long long) * kMaxContexts));
    // On the backend's stream: the ticket sync below reads them there.
    EPX_CUDA_CHECK(
        cudaMemsetAsync(d_posted_, 0, sizeof(unsigned long long) * kMaxContexts, stream_));
    const std::size_t ticket_bytes = sizeof(unsigned) * kMaxContexts * kMaxRanks;
    EPX_CUDA_CHECK(cudaMalloc(&d_tickets_, ticket_bytes));
    EPX_CUDA_CHECK(cudaMemsetAsync(d_tickets_, 0, ticket_bytes, stream_));
    // The gate reads NCCL's proxy queue as this build's NCCL headers lay it
    // out: only with that very NCCL at run time.
    int code = 0;
    EPX_NCCL_CHECK(ncclGetVersion(&code));
    credit_gate_ = code == NCCL_VERSION_CODE;
    if (!credit_gate_ && comm.rank() == 0)
      std::fprintf(stderr,
                   "epx: nccl backend: NCCL %d loaded, EPX was built against %d: posts to a "
                   "full GIN proxy queue wait in NCCL, without EPX's deadline\n",
                   code, NCCL_VERSION_CODE);
    EPX_CUDA_CHECK(cudaMalloc(&d_devcomms_, sizeof(ncclDevComm) * K));
    EPX_CUDA_CHECK(cudaMemcpyAsync(d_devcomms_, devcomms_.data(), sizeof(ncclDevComm) * K,
                                   cudaMemcpyHostToDevice, stream_));
    // World rank -> NCCL LSA index, for this rank's (virtual) node: the
    // rank's place in the world team mapped into the LSA team (of comms_[0],
    // whose window gives the pointers).
    const ncclTeam_t world = ncclTeamWorld(comms_[0]);
    const int lsa_size = ncclTeamLsa(comms_[0]).nRanks;
    for (int i = 0; i < topology.ranks_per_node; ++i) {
      const int r = topology.node_of(comm.rank()) * topology.ranks_per_node + i;
      const int idx = ncclTeamRankToLsa(comms_[0], world, r);
      require(idx >= 0 && idx < lsa_size, "ranks_per_node",
              "nccl: rank " + std::to_string(r) +
                  " of this rank's node is not in NCCL's "
                  "load/store team (" +
                  std::to_string(lsa_size) + " ranks): a node must be ranks NVLink reaches");
      lsa_index_.push_back(idx);
    }
    // Tickets start where NCCL's produced indices are (0 unless NCCL posted
    // on these contexts while it set them up).
    sync_tickets();
    wait_own_stream(*this, stream_, "nccl backend setup", "the backend's stream (the tickets)");
  }

  void release() noexcept {
    for (std::size_t k = 0; k < devcomm_made_.size(); ++k)
      ncclDevCommDestroy(comms_[k], &devcomms_[k]);
    devcomm_made_.clear();
    if (d_devcomms_) cudaFree(d_devcomms_);
    d_devcomms_ = nullptr;
    if (d_failed_) cudaFree(d_failed_);
    d_failed_ = nullptr;
    if (d_posted_) cudaFree(d_posted_);
    d_posted_ = nullptr;
    if (d_tickets_) cudaFree(d_tickets_);
    d_tickets_ = nullptr;
    // Aborted where one failed asynchronously, or where the parent was
    // aborted (a peer is presumed gone): a destroy would wait for them.
    for (ncclComm_t c : comms_) detail::close_nccl_comm(c, comm_.aborted());
    comms_.clear();
    if (host_) cudaFreeHost(host_);
    host_ = nullptr;
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  ~NcclGin() override { release(); }  // best effort: destructors do not throw

  const char* name() const override { return "nccl"; }
  int rank() const override { return comm_.rank(); }
  int num_ranks() const override { return comm_.num_ranks(); }
  const Topology& topology() const override { return topo_; }
  int num_contexts() const override { return num_contexts_; }

  SymmetricRegion alloc(std::size_t bytes) override {
    DeviceGuard guard(comm_.device());
    SymmetricRegion r;
    r.bytes = plan::align_up(bytes == 0 ? plan::kAlign : bytes, 4096);
    r.local = alloc_agreed_nccl_memory(*this, comm_, stream_, r.bytes,
                                       "nccl backend: ncclCommWindowRegister");
    auto* wins = new Windows{};
    r.handle = wins;
    for (std::size_t k = 0; k < comms_.size(); ++k)
      EPX_NCCL_CHECK(ncclCommWindowRegister(comms_[k], r.local, r.bytes, &wins->w[k],
                                            NCCL_WIN_COLL_SYMMETRIC));
    const int n = static_cast<int>(lsa_index_.size());
    int* d_index = nullptr;
    char** d_ptrs = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&d_index, sizeof(int) * n));
    EPX_CUDA_CHECK(cudaMalloc(&d_ptrs, sizeof(char*) * n));
    std::copy(lsa_index_.begin(), lsa_index_.end(), host_->lsa_index);
    EPX_CUDA_CHECK(cudaMemcpyAsync(d_index, host_->lsa_index, sizeof(int) * n,
                                   cudaMemcpyHostToDevice, stream_));
    gin_lsa_pointers<<<1, 32, 0, stream_>>>(wins->w[0], d_index, n, d_ptrs);
    EPX_LAUNCH_CHECK();
    EPX_CUDA_CHECK(
        cudaMemcpyAsync(host_->ptrs, d_ptrs, sizeof(char*) * n, cudaMemcpyDeviceToHost, stream_));
    wait_own_stream(*this, stream_, "alloc", "the window's peer pointers");
    std::copy(host_->ptrs, host_->ptrs + n, wins->base);
    EPX_CUDA_CHECK(cudaFree(d_index));
    EPX_CUDA_CHECK(cudaFree(d_ptrs));
    r.peers.assign(comm_.num_ranks(), nullptr);
    const int first = topo_.node_of(comm_.rank()) * topo_.ranks_per_node;
    for (int i = 0; i < n; ++i) r.peers[first + i] = wins->base[i];
    barrier();  // every rank's zero fill is done before anyone writes
    return r;
  }

  void free(SymmetricRegion& r) override {
    if (!r.local) return;
    DeviceGuard guard(comm_.device());
    auto* wins = static_cast<Windows*>(r.handle);
    // No descriptor may still name the windows: every context flushed when
    // the communicators are healthy (a failed one's proxy takes none).
    bool healthy = true;
    try {
      check_health();
    } catch (const Error&) {
      healthy = false;
    }
    int failed = 0;
    if (healthy) {
      EPX_CUDA_CHECK(cudaMemsetAsync(d_failed_, 0, sizeof(int), stream_));
      gin_flush_all<<<num_contexts_, 32, 0, stream_>>>(
          d_devcomms_, d_posted_, num_contexts_,
          static_cast<uint64_t>(env::timeout_seconds() * 1e9), d_failed_);
      EPX_LAUNCH_CHECK();
      EPX_CUDA_CHECK(
          cudaMemcpyAsync(&host_->failed, d_failed_, sizeof(int), cudaMemcpyDeviceToHost, stream_));
      // The flush has its own deadline on the device; the host's is a backstop
      // (a flush that did not end counts as failed: the region is kept).
      failed = detail::wait_stream_for(stream_, backend_wait_s()) ? host_->failed : 1;
    }
    // Kernels of this buffer the core does not track (CUDA graph replays)
    // may still use the region.
    detail::device_synchronize_watched(
        {"free", comm_.rank(), "every kernel that may still use the region"}, backend_wait_s());
    // Deregistering is collective: every rank does it or none. The ranks
    // agree first (an allgather with the deadline, which stands in for the
    // barrier); a rank with puts still in flight, a failed communicator, or
    // a rank that does not answer leaves the region registered and allocated
    // (leaked) everywhere rather than freed under the puts or waited for.
    const int mine = healthy && failed == 0 ? 1 : 0;
    bool all = false;
    try {
      const std::vector<int> got = comm_.allgather_value(mine, env::timeout_seconds());
      all = std::all_of(got.begin(), got.end(), [](int v) { return v == 1; });
    } catch (const Error&) {
      all = false;
    }
    if (!all) {
      std::fprintf(stderr,
                   "epx: nccl backend: rank %d: %s; the region's %zu bytes stay registered "
                   "(not freed)\n",
                   comm_.rank(),
                   mine == 0 ? (healthy ? "puts still in flight at the deadline when freeing a "
                                          "region"
                                        : "a communicator failed")
                             : "another rank could not free the region",
                   r.bytes);
      delete wins;
      r = SymmetricRegion{};
      return;
    }
    for (std::size_t k = 0; k < comms_.size(); ++k)
      EPX_NCCL_CHECK(ncclCommWindowDeregister(comms_[k], wins->w[k]));
    EPX_NCCL_CHECK(ncclMemFree(r.local));
    delete wins;
    r = SymmetricRegion{};
  }

  void barrier() override { comm_.barrier(); }

  dev::AnyTransport device(const SymmetricRegion& r) const override { return gin_device(r); }

  /// The core zeroed the region's signal words (those of same-node peers);
  /// NCCL's words of the other nodes' low-latency signals go back to 0 too
  /// (the core clears the low-latency region only; the high-throughput ops
  /// across nodes keep counting in their own ids).
  void region_cleared(const SymmetricRegion&) override { reset_signals(); }

  dev::NcclGinTransport gin_device(const SymmetricRegion& r) const {
    const auto* wins = static_cast<const Windows*>(r.handle);
    dev::NcclGinTransport t{};
    t.rank = comm_.rank();
    t.num_ranks = comm_.num_ranks();
    t.ranks_per_node = topo_.ranks_per_node;
    t.node_first = topo_.node_of(comm_.rank()) * topo_.ranks_per_node;
    t.num_contexts = num_contexts_;
    for (int i = 0; i < kMaxRanksPerNode; ++i)
      t.base[i] = i < static_cast<int>(lsa_index_.size()) ? wins->base[i] : nullptr;
    t.local = static_cast<char*>(r.local);
    t.comms = d_devcomms_;
    t.posted = d_posted_;
    t.tickets = tickets();
    for (std::size_t k = 0; k < comms_.size(); ++k) t.win[k] = wins->w[k];
    return t;
  }

  /// Nothing this rank sent lands after it returns (with the barrier after
  /// it, nothing anyone sent): a flush only frees the sources, so every rank
  /// also signals every rank of the other nodes on every context and waits
  /// for theirs; a context's signal lands after its earlier puts and signals.
  void quiesce() override {
    DeviceGuard guard(comm_.device());
    check_health();
    sync_tickets();
    int remote = 0;
    for (int r = 0; r < comm_.num_ranks(); ++r) remote += topo_.same_node(comm_.rank(), r) ? 0 : 1;
    ++drain_rounds_;
    EPX_CUDA_CHECK(cudaMemsetAsync(d_failed_, 0, sizeof(int), stream_));
    gin_drain<<<num_contexts_, 32, 0, stream_>>>(
        d_devcomms_, tickets(), num_contexts_, comm_.num_ranks(), topo_.ranks_per_node,
        comm_.rank(), num_signals_, drain_rounds_ * static_cast<uint64_t>(remote),
        static_cast<uint64_t>(env::timeout_seconds() * 1e9), d_failed_);
    EPX_LAUNCH_CHECK();
    EPX_CUDA_CHECK(
        cudaMemcpyAsync(&host_->failed, d_failed_, sizeof(int), cudaMemcpyDeviceToHost, stream_));
    // The drain has its own deadline on the device; this one is a backstop.
    wait_own_stream(*this, stream_, "quiesce", "the backend's drain of every GIN context");
    const int failed = host_->failed;
    if (failed != 0) {
      check_health();  // names a communicator that failed, if one did
      throw Error(ErrorCode::kTimeout,
                  "nccl backend: rank " + std::to_string(comm_.rank()) +
                      "'s quiesce: not every rank of the other nodes answered on every GIN "
                      "context within the deadline (a rank stalled or left)");
    }
    barrier();
  }

  /// No op in flight on this rank (the core waited for its ops first): the
  /// credit gate's tickets back to NCCL's produced indices (at the start, and
  /// after an op whose credit waits failed), on the backend's stream: what
  /// follows there, or a wait for it, comes after.
  void sync_tickets() {
    if (tickets() == nullptr) return;
    gin_sync_tickets<<<num_contexts_, 128, 0, stream_>>>(d_devcomms_, d_tickets_, num_contexts_,
                                                         comm_.num_ranks());
    EPX_LAUNCH_CHECK();
  }

  /// Collective, no op in flight: every context's low-latency signals and
  /// the drain signal back to 0.
  void reset_signals() {
    DeviceGuard guard(comm_.device());
    sync_tickets();
    gin_reset_signals<<<num_contexts_, 256, 0, stream_>>>(d_devcomms_, num_contexts_,
                                                          num_cleared_signals_, num_signals_);
    EPX_LAUNCH_CHECK();
    wait_own_stream(*this, stream_, "clean_low_latency_buffer", "the reset of the GIN signals");
    drain_rounds_ = 0;
    barrier();
  }

  /// GIN puts that did not leave (kNetQuiet) and a full queue to a peer
  /// (kNetCredit), as transport/nccl/device.cuh reports them.
  std::optional<std::string> describe_failure(const DeviceDiag& g,
                                              double timeout_s) const override {
    const auto what = static_cast<OpId>(g.op);
    if (static_cast<DiagCode>(g.code) != DiagCode::kTimeout ||
        (what != OpId::kNetQuiet && what != OpId::kNetCredit))
      return std::nullopt;
    check_health();  // names a failed communicator, if one failed
    std::ostringstream os;
    if (what == OpId::kNetQuiet)
      os << op_name(what) << ": rank " << g.rank << "'s puts on network context " << g.channel
         << " did not all leave within " << timeout_s << " s (" << g.expected << " posted, "
         << g.seen << " done)";
    else
      os << op_name(what) << ": rank " << g.rank << "'s queue to rank " << g.peer
         << " on network context " << g.channel << " had no free slot within " << timeout_s
         << " s (descriptor " << g.expected << ", " << g.seen << " consumed)";
    os << "; the network, or the backend's engine for it (NCCL's GIN proxy), is stalled, or "
       << (what == OpId::kNetQuiet ? std::string("a peer") : "rank " + std::to_string(g.peer))
       << " cannot be reached";
    return os.str();
  }

  void check_health() const override {
    for (std::size_t k = 0; k < comms_.size(); ++k) {
      ncclResult_t e = ncclSuccess;
      EPX_NCCL_CHECK(ncclCommGetAsyncError(comms_[k], &e));
      if (e != ncclSuccess && e != ncclInProgress)
        throw Error(ErrorCode::kTimeout,
                    "nccl backend: rank " + std::to_string(comm_.rank()) + "'s communicator " +
                        std::to_string(k) + " (GIN contexts " +
                        std::to_string(k * dev::kGinContextsPerComm) + "-" +
                        std::to_string(k * dev::kGinContextsPerComm + 3) +
                        ") failed asynchronously: " + result_name(e) +
                        " (its GIN proxy stopped: ops on it would not complete)");
    }
  }

 private:
  struct Windows {
    ncclWindow_t w[dev::kMaxGinComms] = {};
    char* base[kMaxRanksPerNode] = {};
  };
  Communicator& comm_;
  Topology topo_;
  int num_contexts_, num_signals_, num_cleared_signals_;
  int contexts_per_comm_ = dev::kGinContextsPerComm;  ///< the fewest NCCL gave a communicator
  std::vector<ncclComm_t> comms_;
  std::vector<ncclDevComm> devcomms_;
  std::vector<bool> devcomm_made_;
  ncclDevComm* d_devcomms_ = nullptr;
  int* d_failed_ = nullptr;                 ///< the quiesce's deadline flag
  unsigned long long* d_posted_ = nullptr;  ///< [kMaxContexts] puts posted (the quiet's target)
  unsigned* d_tickets_ = nullptr;  ///< [kMaxContexts][kMaxRanks] descriptors (dev::gin_credit)
  /// Pinned words the backend's stream copies to and from.
  struct HostWords {
    int failed;
    int lsa_index[kMaxRanksPerNode];
    char* ptrs[kMaxRanksPerNode];
  };
  HostWords* host_ = nullptr;
  /// The backend's own kernels and copies: a host wait for them polls with a
  /// deadline and does not wait for other work on the device.
  cudaStream_t stream_ = nullptr;
  bool credit_gate_ = false;  ///< the NCCL loaded is the one built against
  unsigned* tickets() const { return credit_gate_ ? d_tickets_ : nullptr; }
  uint64_t drain_rounds_ = 0;  ///< quiesce rounds since the signals were reset
  std::vector<int> lsa_index_;
};

}  // namespace

std::unique_ptr<Backend> make_nccl_gin_backend(Communicator& comm, const Topology& topology,
                                               int num_contexts, int num_signals,
                                               int num_cleared_signals) {
  return std::make_unique<NcclGin>(comm, topology, num_contexts, num_signals, num_cleared_signals);
}

/// By name only (EPX_BACKEND=nccl): GIN contexts num_qps_per_rank, at most
/// EPX_GIN_CONTEXTS (default 4: one communicator, one NCCL progress thread
/// per process on a proxy-type GIN); the signal pool the families asked for.
const BackendInfo& nccl_backend_info() {
  static const BackendInfo info{
      "nccl", /*auto_order=*/-1, nullptr,
      [](Communicator& comm, const Topology& topology, const BackendOptions& options) {
        const int contexts = std::clamp(options.num_contexts, 1, env::gin_contexts(kMaxContexts));
        return make_nccl_gin_backend(comm, topology, contexts, options.num_signals,
                                     options.num_cleared_signals);
      }};
  return info;
}

}  // namespace epx::transport
