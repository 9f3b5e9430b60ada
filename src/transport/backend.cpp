#include "transport/backend.hpp"

#include <nccl.h>

#include <algorithm>

#include "common/agree.hpp"
#include "common/check.hpp"
#include "common/env.hpp"
#include "common/internode_rings.hpp"
#include "common/internode_route.hpp"
#include "core/stream_wait.hpp"
#include "epx/communicator.hpp"
#include "epx/error.hpp"
#include "transport/nccl/nccl_backend.hpp"
#include "transport/nvshmem/nvshmem_backend.hpp"

namespace epx::transport {

std::unique_ptr<Backend> make_backend(const std::string& requested, Communicator& comm,
                                      const Topology& topology, const BackendOptions& options) {
  std::string name = requested.empty() ? "auto" : requested;
  std::string from = "backend";
  if (name == "auto") {
    name = env::get("EPX_BACKEND").value_or("auto");
    if (name != "auto") from = "EPX_BACKEND";
  }
  const std::string nodes = std::to_string(topology.num_nodes()) + " nodes of " +
                            std::to_string(topology.ranks_per_node) + " ranks";
  if (name == "nvshmem") return make_nvshmem_backend(comm, topology, options);
  if (name == "nccl") {
    // GIN contexts: num_qps_per_rank, at most EPX_GIN_CONTEXTS (default 4: one
    // communicator, one NCCL progress thread per process on a proxy-type GIN).
    const int cap = env::gin_contexts(kMaxContexts);
    const int contexts = std::clamp(options.num_contexts, 1, cap);
    // Signal ids: the low-latency ops' (a source's dispatch, combine weights and
    // combine rows), then the high-throughput ones' across nodes
    // (plan::ht_net_signal), then with EPX_HT_RINGS the rings'
    // (plan::ht_ring_signal); clearing the low-latency region resets the first.
    const int R = comm.num_ranks();
    const int signals =
        options.ht_rings ? plan::ht_ring_signal_count(R) : plan::kSignalKindsAll * R;
    return make_nccl_gin_backend(comm, topology, contexts, signals,
                                 plan::LlRegion::kNetSignalKinds * R);
  }
  if (name == "auto") {
    if (!topology.single_node()) return make_proxy_backend(comm, topology, options);
    if (comm.in_process()) return make_in_process_backend(comm, topology);
    return make_nvlink_backend(comm, topology);
  }
  if (name == "proxy") return make_proxy_backend(comm, topology, options);
  if (name == "nvlink" || name == "in_process") {
    if (!topology.single_node())
      throw Error(ErrorCode::kUnsupported,
                  from + ": '" + name + "' reaches only peers of this rank's node, and the " +
                      std::to_string(comm.num_ranks()) + " ranks form " + nodes +
                      " (ranks_per_node / EPX_RANKS_PER_NODE); use backend 'proxy'");
    if (name == "in_process") {
      if (!comm.in_process())
        throw Error(ErrorCode::kUnsupported,
                    from + ": 'in_process' needs ranks from Communicator::create_in_process");
      return make_in_process_backend(comm, topology);
    }
    if (comm.in_process())
      throw Error(ErrorCode::kUnsupported,
                  from +
                      ": 'nvlink' needs an NCCL communicator (Communicator::create or from_env); "
                      "ranks from Communicator::create_in_process use 'in_process' (auto)");
    return make_nvlink_backend(comm, topology);
  }
  throw Error(
      ErrorCode::kInvalidArgument,
      from + ": must be one of auto|nvlink|in_process|proxy|nccl|nvshmem, got '" + name + "'");
}

double backend_wait_s() {
  return env::timeout_seconds() + 5.0;
}

void agree_before(Communicator& comm, const std::string& step, const std::function<void()>& local) {
  detail::agree_before(
      step.c_str(), comm.rank(),
      [&comm](const void* data, std::size_t bytes) { return comm.allgather(data, bytes); }, local);
}

void wait_own_stream(const Backend& backend, cudaStream_t stream, const char* op,
                     const std::string& what) {
  detail::wait_stream(stream, {op, backend.rank(), what}, backend_wait_s(),
                      [&backend] { return backend.stall_note(); });
}

void* alloc_agreed_nccl_memory(const Backend& backend, Communicator& comm, cudaStream_t stream,
                               std::size_t bytes, const std::string& step) {
  void* p = nullptr;
  try {
    agree_before(comm, step, [&] {
      EPX_NCCL_CHECK(ncclMemAlloc(&p, bytes));
      EPX_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
      wait_own_stream(backend, stream, "alloc", "the zero fill of the symmetric region");
    });
  } catch (...) {
    if (p) ncclMemFree(p);
    throw;
  }
  return p;
}

dev::AnyTransport lsa_device(const Communicator& comm, const Topology& topology,
                             const SymmetricRegion& region) {
  dev::LsaTransport t{};
  t.rank = comm.rank();
  t.num_ranks = comm.num_ranks();
  t.ranks_per_node = topology.ranks_per_node;
  t.node_first = topology.node_of(comm.rank()) * topology.ranks_per_node;
  for (int r = 0; r < comm.num_ranks() && r < kMaxRanksPerNode; ++r)
    t.base[r] = static_cast<char*>(r == comm.rank() ? region.local : region.peers[r]);
  return t;
}

}  // namespace epx::transport
