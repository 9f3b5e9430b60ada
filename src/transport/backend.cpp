#include "transport/backend.hpp"

#include <nccl.h>

#include <algorithm>

#include "common/agree.hpp"
#include "common/check.hpp"
#include "common/env.hpp"
#include "core/stream_wait.hpp"
#include "epx/communicator.hpp"
#include "epx/error.hpp"

namespace epx::transport {

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
