// NVLink backend: symmetric memory from NCCL windows (ncclMemAlloc +
// ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC); every peer in the
// NVLink (LSA) team is reached by plain loads and stores.
#include <nccl.h>
#include <nccl_device.h>
#include "transport/registry.hpp"

#include <string>

#include "common/check.hpp"
#include "common/plan.hpp"
#include "core/stream_wait.hpp"
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
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_ptrs_),
                                 sizeof(void*) * kMaxRanksPerNode, cudaHostAllocDefault));
  }
  ~NvlinkBackend() override {
    if (host_ptrs_) cudaFreeHost(host_ptrs_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "nvlink"; }
  int rank() const override { return comm_.rank(); }
  int num_ranks() const override { return comm_.num_ranks(); }
  const Topology& topology() const override { return topo_; }

  SymmetricRegion alloc(std::size_t bytes) override {
    auto* nc = static_cast<ncclComm_t>(comm_.nccl_comm());
    SymmetricRegion r;
    r.bytes = plan::align_up(bytes == 0 ? plan::kAlign : bytes, 4096);
    r.local = alloc_agreed_nccl_memory(*this, comm_, stream_, r.bytes,
                                       "nvlink backend: ncclCommWindowRegister");
    ncclWindow_t win = nullptr;
    EPX_NCCL_CHECK(ncclCommWindowRegister(nc, r.local, r.bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
    r.handle = win;
    void** d_ptrs = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&d_ptrs, sizeof(void*) * kMaxRanksPerNode));
    lsa_pointers_kernel<<<1, 32, 0, stream_>>>(win, lsa_size_, d_ptrs);
    EPX_LAUNCH_CHECK();
    EPX_CUDA_CHECK(cudaMemcpyAsync(host_ptrs_, d_ptrs, sizeof(void*) * lsa_size_,
                                   cudaMemcpyDeviceToHost, stream_));
    wait_own_stream(*this, stream_, "alloc", "the window's peer pointers");
    EPX_CUDA_CHECK(cudaFree(d_ptrs));
    r.peers.assign(comm_.num_ranks(), nullptr);
    for (int w = 0; w < comm_.num_ranks(); ++w) r.peers[w] = host_ptrs_[lsa_of_world_[w]];
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
    // The core waited for the ops it tracks; kernels it does not (CUDA graph
    // replays) may still use the window.
    detail::device_synchronize_watched(
        {"free", comm_.rank(), "every kernel that may still use the region"}, backend_wait_s());
    // Deregistering waits for every rank without a deadline: the ranks agree
    // first (this stands in for the barrier), so one that failed above is
    // named instead of waited for.
    agree_before(comm_, "nvlink backend: ncclCommWindowDeregister", [] {});
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
  cudaStream_t stream_ = nullptr;  ///< the backend's own fills and copies
  void** host_ptrs_ = nullptr;     ///< pinned: the window's LSA pointers, read back
};

}  // namespace

std::unique_ptr<Backend> make_nvlink_backend(Communicator& comm, const Topology& topology) {
  return std::make_unique<NvlinkBackend>(comm, topology);
}

const BackendInfo& nvlink_backend_info() {
  static const BackendInfo info{
      "nvlink", /*auto_order=*/0,
      [](const std::string& from, bool in_process, const Topology& topology) -> std::string {
        if (std::string no = single_node_only(from, "nvlink", topology); !no.empty()) return no;
        if (in_process)
          return from +
                 ": 'nvlink' needs an NCCL communicator (Communicator::create or from_env); "
                 "ranks from Communicator::create_in_process use 'in_process' (auto)";
        return "";
      },
      [](Communicator& comm, const Topology& topology, const BackendOptions&) {
        return make_nvlink_backend(comm, topology);
      }};
  return info;
}

}  // namespace epx::transport
