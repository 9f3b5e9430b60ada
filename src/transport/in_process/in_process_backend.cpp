// In-process backend: ranks are threads of one process (Communicator::
// create_in_process). Each rank's symmetric memory is a plain cudaMalloc; the
// ranks swap pointers through the communicator's all-gather, and every peer
// reaches every other by load/store (one device, or peer access enabled
// between devices). The kernels see the same device struct as over NVLink.

#include "common/check.hpp"
#include "common/plan.hpp"
#include "core/stream_wait.hpp"
#include "epx/communicator.hpp"
#include "transport/backend.hpp"
#include "transport/registry.hpp"

namespace epx::transport {
namespace {

class InProcessBackend final : public Backend {
 public:
  InProcessBackend(Communicator& comm, const Topology& topology) : comm_(comm), topo_(topology) {
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~InProcessBackend() override { cudaStreamDestroy(stream_); }

  const char* name() const override { return "in_process"; }
  int rank() const override { return comm_.rank(); }
  int num_ranks() const override { return comm_.num_ranks(); }
  const Topology& topology() const override { return topo_; }

  SymmetricRegion alloc(std::size_t bytes) override {
    SymmetricRegion r;
    r.bytes = plan::align_up(bytes == 0 ? plan::kAlign : bytes, 4096);
    EPX_CUDA_CHECK(cudaMalloc(&r.local, r.bytes));
    // On a stream of its own: the other ranks' kernels on this device keep running.
    EPX_CUDA_CHECK(cudaMemsetAsync(r.local, 0, r.bytes, stream_));
    wait_own_stream(*this, stream_, "alloc", "the zero fill of the symmetric region");
    // The all-gather is a barrier too: every rank's zero fill is done before anyone writes.
    r.peers = comm_.allgather_value(r.local);
    return r;
  }

  void free(SymmetricRegion& r) override {
    if (!r.local) return;
    // Once every rank is here, none issues more work, so waiting for the device
    // (which on a shared GPU includes the other ranks' kernels) cannot block a
    // peer. The free (which may wait for the device too) comes before the last
    // barrier: no rank leaves to launch kernels a peer's free would wait for.
    // The core waited for the ops it tracks with its deadline; the device-wide
    // wait is for those it does not (CUDA graph replays), under a watchdog.
    barrier();
    detail::device_synchronize_watched(
        {"free", comm_.rank(), "every kernel that may still use the region"}, backend_wait_s());
    barrier();  // every device idle: nobody writes this memory any more
    EPX_CUDA_CHECK(cudaFree(r.local));
    barrier();
    r = SymmetricRegion{};
  }

  void barrier() override { comm_.barrier(); }

  dev::AnyTransport device(const SymmetricRegion& r) const override {
    return lsa_device(comm_, topo_, r);
  }

 private:
  Communicator& comm_;
  Topology topo_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_in_process_backend(Communicator& comm, const Topology& topology) {
  if (comm.num_ranks() > kMaxRanksPerNode)
    throw Error(ErrorCode::kUnsupported,
                "in_process backend: at most " + std::to_string(kMaxRanksPerNode) +
                    " ranks in one node; split them into virtual nodes (ranks_per_node) and use "
                    "backend 'proxy'");
  return std::make_unique<InProcessBackend>(comm, topology);
}

const BackendInfo& in_process_backend_info() {
  static const BackendInfo info{
      "in_process", /*auto_order=*/1,
      [](const std::string& from, bool in_process, const Topology& topology) -> std::string {
        if (std::string no = single_node_only(from, "in_process", topology); !no.empty()) return no;
        if (!in_process)
          return from + ": 'in_process' needs ranks from Communicator::create_in_process";
        return "";
      },
      [](Communicator& comm, const Topology& topology, const BackendOptions&) {
        return make_in_process_backend(comm, topology);
      }};
  return info;
}

}  // namespace epx::transport
