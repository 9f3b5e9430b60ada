// transport/backend.hpp - the host side of a communication backend.
//
// A backend owns symmetric memory (same size on every rank), knows which
// peers are in this rank's node (load/store reachable) and how to reach the
// others, and builds the device struct kernels get (transport/any.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/diag.hpp"
#include "common/topology.hpp"
#include "epx/buffer.hpp"
#include "transport/any.hpp"

namespace epx {
class Communicator;
}

namespace epx::transport {

/// One symmetric allocation: this rank's pointer plus, for every rank, its
/// copy as mapped here (nullptr where the rank is in another node).
struct SymmetricRegion {
  void* local = nullptr;
  std::vector<void*> peers;
  std::size_t bytes = 0;
  void* handle = nullptr;  ///< backend-private (e.g. an NCCL window)
  int id = -1;             ///< backend-private (e.g. the proxy engine's region id)
};

struct BackendOptions {
  /// Contexts (queue pairs, proxy channels) per peer: num_qps_per_rank.
  int num_contexts = 1;
  /// The bytes the Buffer will allocate (a backend whose memory is fixed at
  /// start, NVSHMEM's heap, sizes it from this).
  std::size_t heap_bytes = 0;
  /// Signal ids per context the kernel families need (the core adds up what
  /// they declare; a backend whose signals are a pool, NCCL GIN, sizes it
  /// from this), of which clearing a region resets [0, num_cleared_signals).
  int num_signals = 0;
  int num_cleared_signals = 0;
  /// The proxy backend's engine, libfabric provider and domains (BufferOptions).
  std::string proxy_engine = "auto";
  std::string fabric_provider;
  std::string fabric_domains;
  /// BufferOptions::proxy_cumem (unset: EPX_PROXY_CUMEM, else true).
  std::optional<bool> proxy_cumem;
  /// Hosts the ranks run on (1: every rank on this one).
  int num_hosts = 1;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  virtual const Topology& topology() const = 0;
  /// Contexts per peer the device structs use.
  virtual int num_contexts() const { return 1; }
  /// What carries the network operations where the backend has a choice (the
  /// proxy's engine), else "".
  virtual std::string engine_name() const { return {}; }
  /// Buffer::network_traffic: what the engine carried so far, where the
  /// backend counts it.
  virtual std::optional<NetworkTraffic> network_traffic() const { return std::nullopt; }
  /// Collective: every rank allocates `bytes`, zero-filled.
  virtual SymmetricRegion alloc(std::size_t bytes) = 0;
  /// Collective: releases a region from alloc().
  virtual void free(SymmetricRegion& region) = 0;
  /// Host-blocking barrier over all ranks.
  virtual void barrier() = 0;
  /// Collective, once the regions are allocated and before the first kernel
  /// that uses them: starts what serves the ops (the proxy threads). Nothing
  /// it does may wait for the GPU: in-process ranks' kernels may be running.
  virtual void start() {}
  /// The device struct of `region` (the core fills the TransportBase members
  /// that are its own: signals, peer mask, deadline, diagnostic).
  virtual dev::AnyTransport device(const SymmetricRegion& region) const = 0;
  /// Collective, no op in flight on this rank: waits until everything this
  /// rank sent is complete (a proxy's commands still in its rings or copies),
  /// so that a following barrier means nothing lands any more.
  virtual void quiesce() {}
  /// After the caller zeroed `region`'s signal words on every rank (collective,
  /// no op in flight): a backend that keeps state about them resets it.
  virtual void region_cleared(const SymmetricRegion& region) { (void)region; }
  /// Whether the SMs that call a put to a peer in another node copy its bytes
  /// themselves (NVSHMEM's P2P transport between virtual nodes of one host)
  /// rather than an engine (copy engines, a NIC): the high-throughput kernels
  /// then share a slot's put among many blocks instead of leaving it to one.
  /// EPX_NET_SPLIT_PUTS overrides it.
  virtual bool puts_copy_on_sms() const { return false; }
  /// BufferOptions::max_ops_in_flight where neither it nor its variable is
  /// set (0: no bound).
  virtual int default_ops_in_flight() const { return 0; }
  /// Throws epx::Error describing a part of the backend that failed (a proxy
  /// thread that died), naming it; nothing when all is well.
  virtual void check_health() const {}
  /// What a timeout's message should add about this rank's side (a proxy
  /// step that was held for seconds, and what holds it), or "". Reading it
  /// forgets what it reported.
  virtual std::string stall_note() const { return {}; }
  /// The message of a failure this backend's device half reported (its own
  /// DiagCode / OpId pairs: a proxy channel that stopped or made no progress,
  /// network puts that did not leave), raised as kTimeout after the op's name;
  /// it may raise first naming the cause (check_health). nullopt: not one of
  /// the backend's, the core words it. The core has cleared the report;
  /// `timeout_s` is the buffer's deadline.
  virtual std::optional<std::string> describe_failure(const DeviceDiag& report,
                                                      double timeout_s) const {
    (void)report;
    (void)timeout_s;
    return std::nullopt;
  }
};

/// Deadline of a backend's host wait for its own stream (EPX_TIMEOUT_S, the
/// kernels' deadline, and a grace for the work queued around them).
double backend_wait_s();

/// detail::agree_before over `comm` (its all-gather, with its deadline):
/// before a collective NCCL call that waits for every rank without one, the
/// ranks learn whether each one's `local` work succeeded.
void agree_before(Communicator& comm, const std::string& step, const std::function<void()>& local);

/// Waits for `stream` (a stream the backend owns) with backend_wait_s();
/// kTimeout names `op`, the rank, `what` and the backend's stall note.
void wait_own_stream(const Backend& backend, cudaStream_t stream, const char* op,
                     const std::string& what);

/// `bytes` of ncclMemAlloc memory zeroed on `stream` (the backend's own),
/// agreed over `comm` before `step` (a window registration, which waits for
/// every rank without a deadline): a rank whose allocation failed is named
/// instead of waited for. The memory is freed again when anything fails.
void* alloc_agreed_nccl_memory(const Backend& backend, Communicator& comm, cudaStream_t stream,
                               std::size_t bytes, const std::string& step);

/// The LsaTransport of `region` for a group that is one node (every peer
/// mapped): backends nvlink and in_process.
dev::AnyTransport lsa_device(const Communicator& comm, const Topology& topology,
                             const SymmetricRegion& region);

/// The backend `name` names (transport/registry.hpp: a backend's name, or
/// "auto", which EPX_BACKEND overrides; auto takes the first backend in auto
/// order that can serve: nvlink for one node of processes, in_process for one
/// node of threads, else proxy), made over `comm`. Throws epx::Error
/// (kUnsupported) when the machine or the communicator cannot serve it.
std::unique_ptr<Backend> make_backend(const std::string& name, Communicator& comm,
                                      const Topology& topology, const BackendOptions& options);

/// The NVLink backend: NCCL symmetric windows, peers reached by load/store.
std::unique_ptr<Backend> make_nvlink_backend(Communicator& comm, const Topology& topology);

/// Ranks that are threads of one process: cudaMalloc'd memory reached by pointer.
std::unique_ptr<Backend> make_in_process_backend(Communicator& comm, const Topology& topology);

/// The CPU-proxy backend: same-node peers by load/store, the others through
/// commands GPU threads post to proxy threads that drive an engine (CUDA IPC
/// on one host today).
std::unique_ptr<Backend> make_proxy_backend(Communicator& comm, const Topology& topology,
                                            const BackendOptions& options);

}  // namespace epx::transport
