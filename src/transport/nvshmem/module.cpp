// transport/nvshmem/module.cpp - the host half of the NVSHMEM module
// (libepx_nvshmem.so, docs/nvshmem.md): bootstrap from EPX's communicator by
// NVSHMEM's unique id, the symmetric heap, peer pointers, quiet and barriers,
// and the module's table (module.hpp). Only this module links NVSHMEM: the
// device state NVSHMEM sets up at init is the one of this module's own
// device code (libnvshmem_device.a's init is linked in here).
#include <cuda_runtime_api.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/poll.hpp"
#include "transport/nvshmem/module.hpp"

namespace epx::nvshmem_module {

const kernels::ModuleKernels* ll_kernels();            // ll_kernels.cu
int preload_ll_kernels(char* err, std::size_t n);      // ll_kernels.cu
int preload_ht_net_kernels(char* err, std::size_t n);  // ht_kernels.cu

namespace {
/// Every kernel of the module.
int preload_all(char* err, std::size_t n) {
  const int rc = preload_ll_kernels(err, n);
  return rc != 0 ? rc : preload_ht_net_kernels(err, n);
}
}  // namespace

namespace {

std::mutex g_mutex;
int g_refs = 0;  ///< inits not yet finalized on this process
int g_device = -1;
int g_rank = -1;

/// Why a host call of NVSHMEM cannot be bounded, as a Watch says it.
constexpr const char* kNoWayOut =
    "NVSHMEM offers no way to bound it; a peer is dead or its proxy stalled "
    "(NVSHMEM_DEBUG=INFO shows where it waits)";

/// NVSHMEM's host calls have no deadline, and none can be interrupted. While
/// one runs, a thread says on stderr, once per EPX deadline (EPX_TIMEOUT_S),
/// that it did not return: a hang in NVSHMEM is named (rank, call, seconds,
/// why there is no deadline), not silent. EPX_NVSHMEM_TRACE=1 also says when
/// each call starts and ends.
class Watch {
 public:
  Watch(int rank, std::string what, const char* why = kNoWayOut)
      : rank_(rank),
        what_(std::move(what)),
        why_(why),
        trace_(env::nvshmem_trace()),
        t0_(std::chrono::steady_clock::now()) {
    if (trace_) std::fprintf(stderr, "epx nvshmem rank %d: %s ...\n", rank_, what_.c_str());
    thread_ = std::thread([this] {
      const auto every = std::chrono::duration<double>(env::timeout_seconds());
      std::unique_lock<std::mutex> lock(m_);
      while (!cv_.wait_for(lock, every, [this] { return done_; }))
        std::fprintf(stderr, "epx nvshmem rank %d: %s did not return within %.0f s: %s\n", rank_,
                     what_.c_str(), seconds(), why_);
    });
  }
  ~Watch() {
    {
      std::lock_guard<std::mutex> lock(m_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (trace_)
      std::fprintf(stderr, "epx nvshmem rank %d: %s done in %.3f s\n", rank_, what_.c_str(),
                   seconds());
  }
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

 private:
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  const int rank_;
  const std::string what_;
  const char* const why_;
  const bool trace_;
  const std::chrono::steady_clock::time_point t0_;
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

[[noreturn]] void fail(ErrorCode code, const std::string& what) {
  throw Error(code, "nvshmem: " + what);
}

/// NVSHMEM host calls that return a status: nonzero is an error naming the call.
void check_status(int status, const char* call) {
  if (status != 0)
    fail(ErrorCode::kBootstrap, std::string(call) + " returned " + std::to_string(status));
}

/// Waits for `s` with EPX's deadline (EPX_TIMEOUT_S); past it throws
/// kTimeout naming `op`, this rank and `what`, the work left queued.
void wait_stream(cudaStream_t s, const char* op, const std::string& what) {
  const double timeout_s = env::timeout_seconds();
  const bool done = detail::poll_until(
      [s] {
        const cudaError_t e = cudaStreamQuery(s);
        if (e == cudaErrorNotReady) return false;
        EPX_CUDA_CHECK(e);
        return true;
      },
      timeout_s);
  if (!done)
    fail(ErrorCode::kTimeout, std::string(op) + ": rank " + std::to_string(g_rank) +
                                  " waited more than " + std::to_string(timeout_s) + " s for " +
                                  what);
}

/// A stream of the module's own for one call, destroyed after it (with work
/// still queued after a timeout, CUDA destroys it once that is done).
struct OwnStream {
  cudaStream_t s = nullptr;
  OwnStream() { EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~OwnStream() { cudaStreamDestroy(s); }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
};

int init(const Host& host, std::size_t heap_bytes, char* err, std::size_t n) {
  return guarded(err, n, [&] {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_refs > 0) {
      // One NVSHMEM job per process: a later Buffer must be of the same ranks.
      if (nvshmem_n_pes() != host.num_ranks || nvshmem_my_pe() != host.rank ||
          g_device != host.device)
        fail(ErrorCode::kUnsupported,
             "this process already runs NVSHMEM as PE " + std::to_string(nvshmem_my_pe()) + " of " +
                 std::to_string(nvshmem_n_pes()) + " on GPU " + std::to_string(g_device) +
                 "; a Buffer of rank " + std::to_string(host.rank) + " of " +
                 std::to_string(host.num_ranks) + " on GPU " + std::to_string(host.device) +
                 " cannot share it (destroy the other Buffers first)");
      ++g_refs;
      return;
    }
    EPX_CUDA_CHECK(cudaSetDevice(host.device));
    // NVSHMEM builds NCCL teams of its own at init unless told not to; EPX
    // uses no NVSHMEM collective that needs them, and their roots would share
    // whatever NCCL_COMM_ID the process has set.
    ::setenv("NVSHMEM_DISABLE_NCCL", "1", 0);
    // The heap is sized at init: room for this Buffer's regions twice (later
    // Buffers of the process share it) and 1 GiB, unless the user sized it.
    if (std::getenv("NVSHMEM_SYMMETRIC_SIZE") == nullptr) {
      const std::size_t mib = std::size_t{1} << 20;
      const std::size_t want = 2 * heap_bytes + 1024 * mib;
      ::setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string((want + mib - 1) / mib * mib).c_str(), 0);
    }
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (host.rank == 0) {
      Watch w(host.rank, "nvshmemx_get_uniqueid");
      check_status(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
    }
    std::vector<nvshmemx_uniqueid_t> all(static_cast<std::size_t>(host.num_ranks));
    char gerr[512] = {0};
    if (host.allgather(host.ctx, &id, sizeof(id), all.data(), gerr, sizeof(gerr)) != 0)
      fail(ErrorCode::kBootstrap, std::string("sharing the unique id: ") + gerr);
    id = all[0];
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    check_status(nvshmemx_set_attr_uniqueid_args(host.rank, host.num_ranks, &id, &attr),
                 "nvshmemx_set_attr_uniqueid_args");
    // nvshmemx_init_attr's own steps, minus its exit() when the status is
    // nonzero, which becomes an epx::Error here (NVSHMEM may still exit on
    // failures inside).
    int provided = 0;
    nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                  NVSHMEM_VENDOR_PATCH_VERSION};
    nvshmemx_init_init_attr_ver_only(attr);
    Watch w(host.rank, "NVSHMEM's init by unique id (" + std::to_string(host.num_ranks) +
                           " PEs, NVSHMEM_SYMMETRIC_SIZE " + std::getenv("NVSHMEM_SYMMETRIC_SIZE") +
                           ")");
    check_status(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                      NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version),
                 "nvshmemi_init_thread (NVSHMEM's init by unique id)");
    if (nvshmem_my_pe() != host.rank || nvshmem_n_pes() != host.num_ranks)
      fail(ErrorCode::kBootstrap, "NVSHMEM made this rank PE " + std::to_string(nvshmem_my_pe()) +
                                      " of " + std::to_string(nvshmem_n_pes()) + ", EPX rank " +
                                      std::to_string(host.rank) + " of " +
                                      std::to_string(host.num_ranks));
    g_device = host.device;
    g_rank = host.rank;
    g_refs = 1;
  });
}

/// What every entry after init needs: the lock (NVSHMEM runs SERIALIZED, so
/// two Buffers on two threads must not interleave its collectives), NVSHMEM
/// up, and this process's device current on the calling thread.
struct Entry {
  std::lock_guard<std::mutex> lock{g_mutex};
  explicit Entry(const char* what) {
    if (g_refs <= 0) fail(ErrorCode::kInternal, std::string(what) + " before init");
    EPX_CUDA_CHECK(cudaSetDevice(g_device));
  }
};

int finalize(char* err, std::size_t n) {
  return guarded(err, n, [&] {
    Entry entry("finalize");
    if (--g_refs == 0) {
      Watch w(g_rank, "nvshmem_finalize");
      nvshmem_finalize();
    }
  });
}

int alloc(std::size_t bytes, void** out, char* err, std::size_t n) {
  return guarded(err, n, [&] {
    Entry entry("alloc");
    void* p = nullptr;
    {
      Watch w(g_rank, "nvshmem_malloc(" + std::to_string(bytes) + ")");
      p = nvshmem_malloc(bytes);
    }
    if (p == nullptr)
      fail(ErrorCode::kBufferTooSmall,
           "nvshmem_malloc(" + std::to_string(bytes) +
               ") failed: the symmetric heap is full (NVSHMEM_SYMMETRIC_SIZE, set before the "
               "first Buffer, is " +
               std::string(std::getenv("NVSHMEM_SYMMETRIC_SIZE")
                               ? std::getenv("NVSHMEM_SYMMETRIC_SIZE")
                               : "unset") +
               ")");
    {
      // On a stream of its own, with the deadline: not a wait for the whole
      // device.
      OwnStream own;
      EPX_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, own.s));
      wait_stream(own.s, "alloc", "the zero fill of the heap block");
    }
    Watch w(g_rank, "nvshmem_barrier_all after the heap block's zero fill");
    nvshmem_barrier_all();  // every PE's zero fill is done before anyone writes
    *out = p;
  });
}

int free_block(void* p, char* err, std::size_t n) {
  return guarded(err, n, [&] {
    Entry entry("free");
    {
      // The core waited for the ops it tracks with its deadline; this is for
      // kernels it does not (CUDA graph replays), which may still use the block.
      Watch d(g_rank, "cudaDeviceSynchronize before nvshmem_free",
              "it waits for every stream of the GPU, and CUDA offers no way to bound it");
      EPX_CUDA_CHECK(cudaDeviceSynchronize());
    }
    Watch w(g_rank, "nvshmem_free");
    nvshmem_free(p);  // collective, with its own barrier
  });
}

void* peer_ptr(void* local, int pe) {
  return nvshmem_ptr(local, pe);
}

int quiesce(char* err, std::size_t n) {
  return guarded(err, n, [&] {
    Entry entry("quiesce");
    {
      // The quiet runs on a stream, which can be polled: past the deadline
      // this rank reports instead of waiting on (NVSHMEM cannot cancel the
      // quiet; it stays queued).
      OwnStream own;
      nvshmemx_quiet_on_stream(own.s);
      wait_stream(own.s, "quiesce",
                  "nvshmemx_quiet_on_stream (every put this PE issued to complete): a peer is "
                  "dead or NVSHMEM's proxy stalled, and NVSHMEM offers no way to cancel the "
                  "quiet");
    }
    Watch w(g_rank, "nvshmem_barrier_all (quiesce)");
    nvshmem_barrier_all();
  });
}

int barrier(char* err, std::size_t n) {
  return guarded(err, n, [&] {
    Entry entry("barrier");
    Watch w(g_rank, "nvshmem_barrier_all");
    nvshmem_barrier_all();
  });
}

}  // namespace

}  // namespace epx::nvshmem_module

#define EPX_STR2(x) #x
#define EPX_STR(x) EPX_STR2(x)

extern "C" __attribute__((visibility("default"))) const epx::nvshmem_module::Api*
epx_nvshmem_module_api() {
  using namespace epx::nvshmem_module;
  static const Api api{kAbiVersion,
                       EPX_STR(NVSHMEM_VENDOR_MAJOR_VERSION) "." EPX_STR(
                           NVSHMEM_VENDOR_MINOR_VERSION) "." EPX_STR(NVSHMEM_VENDOR_PATCH_VERSION),
                       init,
                       finalize,
                       alloc,
                       free_block,
                       peer_ptr,
                       quiesce,
                       barrier,
                       preload_all,
                       ll_kernels()};
  return &api;
}
