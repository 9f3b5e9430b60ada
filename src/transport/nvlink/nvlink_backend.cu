// NVLink backend: symmetric memory from NCCL windows (ncclMemAlloc +
// ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC); every peer in the
// NVLink (LSA) team is reached by plain loads and stores.
#include <nccl.h>
#include <nccl_device.h>

#include <string>

#include "common/check.hpp"
#include "common/plan.hpp"
#include "epx/communicator.hpp"
#include "transport/backend.hpp"

namespace epx::transport {
namespace {

__global__ void lsa_pointers_kernel(ncclWindow_t win, int lsa_size, void** out) {
  int i = threadIdx.x;
  if (i < lsa_size) out[i] = ncclGetLsaPointer(win, 0, i);
}

class NvlinkBackend final : public Backend {
 public:
  NvlinkBackend(Communicator& comm, const Topology& topology) : comm_(comm), topo_(topology) {
    auto* nc = static_cast<ncclComm_t>(comm.nccl_comm());
    ncclTeam_t lsa = ncclTeamLsa(nc);
    if (lsa.nRanks != comm.num_ranks())
      throw Error(ErrorCode::kUnsupported,
                  "nvlink backend: only " + std::to_string(lsa.nRanks) + " of " +
                      std::to_string(comm.num_ranks()) +
                      " ranks share this rank's NVLink domain; an RDMA backend is needed");
    if (comm.num_ranks() > kMaxRanksPerNode)
      throw Error(ErrorCode::kUnsupported,
                  "nvlink backend: at most " + std::to_string(kMaxRanksPerNode) + " ranks");
    for (int r = 0; r < comm.num_ranks(); ++r) lsa_of_world_[r] = ncclTeamRankToLsa(nc, lsa, r);
    lsa_size_ = lsa.nRanks;
  }

  const char* name() const override { return "nvlink"; }
  int rank() const override { return comm_.rank(); }
  int num_ranks() const override { return comm_.num_ranks(); }
  const Topology& topology() const override { return topo_; }

  SymmetricRegion alloc(std::size_t bytes) override {
    auto* nc = static_cast<ncclComm_t>(comm_.nccl_comm());
    SymmetricRegion r;
    r.bytes = plan::align_up(bytes == 0 ? plan::kAlign : bytes, 4096);
    EPX_NCCL_CHECK(ncclMemAlloc(&r.local, r.bytes));
    EPX_CUDA_CHECK(cudaMemset(r.local, 0, r.bytes));
    ncclWindow_t win = nullptr;
    EPX_NCCL_CHECK(ncclCommWindowRegister(nc, r.local, r.bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
    r.handle = win;
    void** d_ptrs = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&d_ptrs, sizeof(void*) * kMaxRanksPerNode));
    lsa_pointers_kernel<<<1, 32>>>(win, lsa_size_, d_ptrs);
    EPX_LAUNCH_CHECK();
    void* lsa_ptrs[kMaxRanksPerNode] = {};
    EPX_CUDA_CHECK(cudaMemcpy(lsa_ptrs, d_ptrs, sizeof(void*) * lsa_size_, cudaMemcpyDeviceToHost));
    EPX_CUDA_CHECK(cudaFree(d_ptrs));
    r.peers.assign(comm_.num_ranks(), nullptr);
    for (int w = 0; w < comm_.num_ranks(); ++w) r.peers[w] = lsa_ptrs[lsa_of_world_[w]];
    barrier();  // every rank's zero fill is done before anyone writes
    return r;
  }

  void free(SymmetricRegion& r) override {
    if (!r.local) return;
    if (comm_.aborted()) {
      // A collective passed its deadline and aborted the communicator, which
      // took the window with it: nothing to deregister, no barrier to hold.
      // The memory is left (a peer may still be storing into it).
      r = SymmetricRegion{};
      return;
    }
    auto* nc = static_cast<ncclComm_t>(comm_.nccl_comm());
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    barrier();
    EPX_NCCL_CHECK(ncclCommWindowDeregister(nc, static_cast<ncclWindow_t>(r.handle)));
    EPX_NCCL_CHECK(ncclMemFree(r.local));
    r = SymmetricRegion{};
  }

  void barrier() override { comm_.barrier(); }

  dev::AnyTransport device(const SymmetricRegion& r) const override {
    return lsa_device(comm_, topo_, r);
  }

 private:
  Communicator& comm_;
  Topology topo_;
  int lsa_of_world_[kMaxRanksPerNode] = {};
  int lsa_size_ = 1;
};

}  // namespace

std::unique_ptr<Backend> make_nvlink_backend(Communicator& comm, const Topology& topology) {
  return std::make_unique<NvlinkBackend>(comm, topology);
}

}  // namespace epx::transport
