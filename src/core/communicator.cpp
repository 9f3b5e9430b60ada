#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/host_group.hpp"
#include "common/nccl_comm.hpp"
#include "common/plan.hpp"
#include "common/topology.hpp"
#include "core/nccl_version.hpp"
#include "core/stream_wait.hpp"
#include "epx/buffer.hpp"

namespace epx {

static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes, "ncclUniqueId size changed");

namespace nccl_version {

Version decode(int code) {
  if (code >= 10000) return {code / 10000, code / 100 % 100, code % 100};
  return {code / 1000, code / 100 % 10, code % 100};
}

std::string to_string(const Version& v) {
  return std::to_string(v.major) + "." + std::to_string(v.minor) + "." + std::to_string(v.patch);
}

bool at_least(const Version& found, const Version& needed) {
  if (found.major != needed.major) return found.major > needed.major;
  if (found.minor != needed.minor) return found.minor > needed.minor;
  return found.patch >= needed.patch;
}

void check(int code, const std::string& library) {
  const Version found = decode(code);
  if (at_least(found, kRequired)) return;
  throw Error(ErrorCode::kUnsupported,
              "NCCL " + to_string(found) + " is loaded" +
                  (library.empty() ? std::string() : " (" + library + ")") + "; EPX needs NCCL " +
                  to_string(kRequired) +
                  " or newer (its device API). Load a newer libnccl.so.2 first: pip install "
                  "'nvidia-nccl-cu13>=2.28.9', or put its lib directory first in "
                  "LD_LIBRARY_PATH (a framework imported before EPX may have loaded its own)");
}

void check_gin_device_abi(int code, int built_code, const std::string& library) {
  const Version found = decode(code), built = decode(built_code);
  if (found.major == built.major && found.minor == built.minor) return;
  const std::string series = std::to_string(built.major) + "." + std::to_string(built.minor);
  throw Error(ErrorCode::kUnsupported,
              "nccl backend: NCCL " + to_string(found) + " is loaded" +
                  (library.empty() ? std::string() : " (" + library + ")") +
                  ", but EPX's GIN device code was built against NCCL " + to_string(built) +
                  "'s headers and runs only with NCCL " + series +
                  ".x (NCCL's device communicator may change layout between minor versions). "
                  "Load NCCL " +
                  series + " first (pip install 'nvidia-nccl-cu13==" + to_string(built) +
                  "', or its lib directory first in LD_LIBRARY_PATH), or choose backend "
                  "proxy, nvlink or nvshmem, which run with this NCCL");
}

int loaded(std::string& library) {
  int code = 0;
  EPX_NCCL_CHECK(ncclGetVersion(&code));
  Dl_info info{};
  library.clear();
  if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) != 0 && info.dli_fname)
    library = info.dli_fname;
  return code;
}

}  // namespace nccl_version

namespace {
/// The NCCL this process runs with, checked against the oldest EPX needs.
void check_loaded_nccl() {
  std::string library;
  const int code = nccl_version::loaded(library);
  nccl_version::check(code, library);
}
}  // namespace

UniqueId Communicator::new_unique_id() {
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  UniqueId out;
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

std::shared_ptr<Communicator> Communicator::create(const UniqueId& id, int rank, int num_ranks,
                                                   double timeout_s) {
  require(num_ranks >= 1, "num_ranks", "must be >= 1, got " + std::to_string(num_ranks));
  require(timeout_s > 0, "timeout_s", "must be > 0 seconds, got " + std::to_string(timeout_s));
  require(
      rank >= 0 && rank < num_ranks, "rank",
      "must be in [0, num_ranks=" + std::to_string(num_ranks) + "), got " + std::to_string(rank));
  check_loaded_nccl();
  std::shared_ptr<Communicator> c(new Communicator());
  c->rank_ = rank;
  c->num_ranks_ = num_ranks;
  c->timeout_s_ = timeout_s;
  EPX_CUDA_CHECK(cudaGetDevice(&c->device_));
  ncclUniqueId nid;
  std::memcpy(&nid, id.data(), sizeof(nid));
  ncclComm_t comm = nullptr;
  EPX_NCCL_CHECK(ncclCommInitRank(&comm, num_ranks, nid, rank));
  c->comm_ = comm;
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking));
  EPX_CUDA_CHECK(cudaMalloc(&c->scratch_, 4096));
  return c;
}

std::shared_ptr<Communicator> Communicator::from_env() {
  env::RankInfo info = env::rank_info();
  int ndev = 0;
  EPX_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  require(info.local_rank < ndev, "LOCAL_RANK",
          "must name a visible GPU (this process sees " + std::to_string(ndev) + "), got " +
              std::to_string(info.local_rank));
  EPX_CUDA_CHECK(cudaSetDevice(info.local_rank));
  const bool set_here = !env::get("NCCL_COMM_ID");
  if (set_here) {
    // NCCL's own bootstrap root serves the id: every rank derives the same one.
    std::string addr = info.master_addr + ":" + std::to_string(info.master_port + 1);
    setenv("NCCL_COMM_ID", addr.c_str(), 1);
  }
  // Unset again once this communicator is up: left set, every later unique
  // id of the process (NVSHMEM's own NCCL teams, torch's, the user's) would
  // be that one fixed address, and their roots collide on its port.
  struct Unset {
    bool active;
    ~Unset() {
      if (active) unsetenv("NCCL_COMM_ID");
    }
  } unset{set_here};
  return create(new_unique_id(), info.rank, info.world_size);
}

std::vector<std::shared_ptr<Communicator>> Communicator::create_in_process(int num_ranks,
                                                                           std::vector<int> devices,
                                                                           double timeout_s) {
  require(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks",
          "must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(num_ranks));
  require(devices.empty() || static_cast<int>(devices.size()) == num_ranks, "devices",
          "must be empty (every rank on the current device) or name one device per rank: " +
              std::to_string(devices.size()) + " given for " + std::to_string(num_ranks) +
              " ranks");
  require(timeout_s > 0, "timeout_s", "must be > 0 seconds, got " + std::to_string(timeout_s));
  int current = 0, ndev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&current));
  EPX_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  if (devices.empty()) devices.assign(static_cast<std::size_t>(num_ranks), current);
  for (int r = 0; r < num_ranks; ++r)
    require(devices[r] >= 0 && devices[r] < ndev, "devices",
            "device of rank " + std::to_string(r) + " must be in [0, " + std::to_string(ndev) +
                "), got " + std::to_string(devices[r]));
  // Ranks on distinct devices reach each other's memory by pointer. The
  // caller's device is current again on every way out.
  struct RestoreDevice {
    int device;
    ~RestoreDevice() { cudaSetDevice(device); }
  } restore{current};
  const std::set<int> distinct(devices.begin(), devices.end());
  for (int a : distinct)
    for (int b : distinct) {
      if (a == b) continue;
      int ok = 0;
      EPX_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, a, b));
      if (!ok)
        throw Error(ErrorCode::kUnsupported, "create_in_process: device " + std::to_string(a) +
                                                 " cannot access device " + std::to_string(b) +
                                                 "'s memory (no peer access)");
      EPX_CUDA_CHECK(cudaSetDevice(a));
      cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled)
        (void)cudaGetLastError();  // so a later launch check does not report it
      else
        EPX_CUDA_CHECK(e);
    }
  auto group = std::make_shared<detail::InProcessGroup>(num_ranks, timeout_s);
  std::vector<std::shared_ptr<Communicator>> out;
  for (int r = 0; r < num_ranks; ++r) {
    std::shared_ptr<Communicator> c(new Communicator());
    c->rank_ = r;
    c->num_ranks_ = num_ranks;
    c->device_ = devices[r];
    c->ranks_on_device_ = static_cast<int>(std::count(devices.begin(), devices.end(), devices[r]));
    c->group_ = group;
    out.push_back(std::move(c));
  }
  return out;
}

Communicator::~Communicator() {
  detail::close_nccl_comm(static_cast<ncclComm_t>(comm_));
  if (scratch_) cudaFree(scratch_);
  if (stream_) cudaStreamDestroy(stream_);
}

void Communicator::throw_if_aborted(const char* what) const {
  if (aborted_)
    throw Error(ErrorCode::kTimeout, std::string(what) + ": rank " + std::to_string(rank_) +
                                         ": the communicator was aborted (" + abort_reason_ +
                                         "); make a new one");
}

void Communicator::wait_collective(const char* what, double timeout_s) {
  auto* nc = static_cast<ncclComm_t>(comm_);
  auto abort = [&](std::string reason) {
    // ncclCommAbort's own result is not checked: the caller throws either way.
    ncclCommAbort(nc);
    comm_ = nullptr;
    aborted_ = true;
    abort_reason_ = std::move(reason);
  };
  auto async_error = [&] {
    ncclResult_t r = ncclSuccess;
    EPX_NCCL_CHECK(ncclCommGetAsyncError(nc, &r));
    if (r != ncclSuccess && r != ncclInProgress) {
      abort(std::string(what) + ": NCCL reported an asynchronous error: " + ncclGetErrorString(r));
      throw Error(ErrorCode::kNccl, std::string(what) + ": rank " + std::to_string(rank_) + ": " +
                                        abort_reason_ + "; the NCCL communicator is aborted");
    }
  };
  if (detail::wait_stream_for(stream_, timeout_s, async_error)) return;
  abort(std::string(what) + " passed its " + std::to_string(timeout_s) + " s deadline");
  throw Error(ErrorCode::kTimeout,
              std::string(what) + ": rank " + std::to_string(rank_) + " waited " +
                  std::to_string(timeout_s) +
                  " s for the other ranks (one died, hangs, or did not make this call); the "
                  "NCCL communicator is aborted: make a new one");
}

void Communicator::barrier() {
  if (group_) return group_->barrier(rank_);
  throw_if_aborted("barrier");
  auto* nc = static_cast<ncclComm_t>(comm_);
  EPX_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, nc, stream_));
  wait_collective("barrier", timeout_s_);
}

std::vector<uint8_t> Communicator::allgather(const void* data, std::size_t bytes,
                                             double timeout_s) {
  if (group_) return group_->allgather(rank_, data, bytes);
  throw_if_aborted("allgather");
  auto* nc = static_cast<ncclComm_t>(comm_);
  void* d = nullptr;
  EPX_CUDA_CHECK(cudaMallocAsync(&d, bytes * (num_ranks_ + 1), stream_));
  char* mine = static_cast<char*>(d) + bytes * num_ranks_;
  EPX_CUDA_CHECK(cudaMemcpyAsync(mine, data, bytes, cudaMemcpyHostToDevice, stream_));
  EPX_NCCL_CHECK(ncclAllGather(mine, d, bytes, ncclUint8, nc, stream_));
  try {
    wait_collective("allgather", timeout_s > 0.0 ? timeout_s : timeout_s_);
  } catch (...) {
    cudaFreeAsync(d, stream_);  // after the aborted collective; its result does not matter here
    throw;
  }
  std::vector<uint8_t> out(bytes * num_ranks_);
  EPX_CUDA_CHECK(cudaMemcpyAsync(out.data(), d, out.size(), cudaMemcpyDeviceToHost, stream_));
  EPX_CUDA_CHECK(cudaFreeAsync(d, stream_));
  // The collective is done: what is left is this rank's copy out of it.
  const double wait_s = timeout_s > 0.0 ? timeout_s : timeout_s_;
  if (!detail::wait_stream_for(stream_, wait_s))
    throw Error(
        ErrorCode::kTimeout,
        detail::wait_timeout_message(
            {"allgather", rank_, "the copy of the gathered bytes to the host"}, wait_s, ""));
  return out;
}

}  // namespace epx
