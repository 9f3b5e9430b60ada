// plugins/gin_loopback/memops_cuda.cpp - MemOps for GPU ranges (built with
// EPX_GIN_LOOP_CUDA), over the host memops, which keep every host range.
//
// - classify: an NCCL_PTR_CUDA range must be device memory of one device (the
//   rank's, fixed by its first GPU registration); a cuMem allocation whose
//   handle types include POSIX_FILE_DESCRIPTOR is exportable (an fd from
//   cuMemExportToShareableHandle), other GPU memory (handle type NONE: NCCL's
//   per-context signal buffers; plain cudaMalloc) is local-only.
// - import: cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap,
//   cuMemSetAccess for this rank's device; release unmaps it.
// - copies: cuMemcpyAsync on a non-blocking stream of the device's greatest
//   priority, one per peer, made at the first GPU registration (never in the
//   progress path); a small host source (NCCL's inline values) is first copied
//   into a pinned staging slot, so the caller may reuse it at once.
// - marks: cuStreamWriteValue64 of the request's sequence number into pinned
//   host memory behind the peer's copies, so completed() is a load.
// - signals: the target's read-modify-write on its applier stream, no kernel:
//   an 8-byte copy to pinned memory, a wait for it (polled, with the
//   plugin's deadline), cuStreamWriteValue64 of old + add (the applier is
//   the only remote writer of a signal word).
//
// Driver functions are looked up through the CUDA runtime (linked statically)
// at the first GPU registration, so the plugin loads without libcuda (CPU CI)
// and makes no CUDA call before that. Every entry point that calls CUDA first
// makes the plugin's own context of the device current (NCCL's progress thread
// has none; init says why not the primary one); those of the user thread
// (classify, import, release) put the caller's context back. Every call is checked; a failure
// throws MemOpsError naming the call and the peer, which the plugin makes sticky.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/poll.hpp"
#include "plugins/gin_loopback/abi.hpp"
#include "plugins/gin_loopback/memops.hpp"

namespace epx::gin_loop {
namespace {

// The driver functions used, resolved by name through the runtime. Members are
// typed after this toolkit's declarations and resolved at its CUDA_VERSION,
// so each pointer has the ABI of the declaration it is called through.
// clang-format off
#define EPX_GIN_DRIVER_FUNCTIONS(X) \
  X(cuInit) \
  X(cuGetErrorName) \
  X(cuGetErrorString) \
  X(cuDeviceGet) \
  X(cuDeviceGetAttribute) \
  X(cuCtxCreate) \
  X(cuCtxDestroy) \
  X(cuCtxGetCurrent) \
  X(cuCtxSetCurrent) \
  X(cuCtxGetStreamPriorityRange) \
  X(cuStreamCreateWithPriority) \
  X(cuStreamDestroy) \
  X(cuStreamQuery) \
  X(cuMemcpyAsync) \
  X(cuStreamWriteValue64) \
  X(cuPointerGetAttribute) \
  X(cuMemGetAddressRange) \
  X(cuMemRetainAllocationHandle) \
  X(cuMemGetAllocationPropertiesFromHandle) \
  X(cuMemRelease) \
  X(cuMemExportToShareableHandle) \
  X(cuMemImportFromShareableHandle) \
  X(cuMemAddressReserve) \
  X(cuMemAddressFree) \
  X(cuMemMap) \
  X(cuMemUnmap) \
  X(cuMemSetAccess) \
  X(cuMemHostAlloc) \
  X(cuMemFreeHost) \
  X(cuMemHostGetDevicePointer)
// clang-format on

struct Driver {
#define EPX_GIN_MEMBER(fn) decltype(&::fn) p_##fn = nullptr;
  EPX_GIN_DRIVER_FUNCTIONS(EPX_GIN_MEMBER)
#undef EPX_GIN_MEMBER
  std::string error;  ///< why the driver is unusable ("" if it is usable)
};

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    auto resolve = [&x](const char* symbol, void** out) {
      if (!x.error.empty()) return;
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t rc =
          cudaGetDriverEntryPointByVersion(symbol, out, CUDA_VERSION, cudaEnableDefault, &found);
      if (rc != cudaSuccess)
        x.error = std::string("no usable CUDA driver: cudaGetDriverEntryPointByVersion(\"") +
                  symbol + "\") failed: " + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) +
                  ")";
      else if (found != cudaDriverEntryPointSuccess || !*out)
        x.error = std::string("the CUDA driver lacks ") + symbol + " at CUDA version " +
                  std::to_string(CUDA_VERSION) + " (driver older than this toolkit?)";
    };
#define EPX_GIN_RESOLVE(fn) resolve(#fn, reinterpret_cast<void**>(&x.p_##fn));
    EPX_GIN_DRIVER_FUNCTIONS(EPX_GIN_RESOLVE)
#undef EPX_GIN_RESOLVE
    if (x.error.empty()) {
      const CUresult rc = x.p_cuInit(0);
      if (rc != CUDA_SUCCESS) x.error = "cuInit failed: CUresult " + std::to_string(int(rc));
    }
    return x;
  }();
  return d;
}

std::string cu_text(CUresult rc) {
  const char* name = nullptr;
  const char* text = nullptr;
  const Driver& d = driver();
  if (d.p_cuGetErrorName == nullptr || d.p_cuGetErrorName(rc, &name) != CUDA_SUCCESS || !name)
    name = "unknown CUresult";
  if (d.p_cuGetErrorString == nullptr || d.p_cuGetErrorString(rc, &text) != CUDA_SUCCESS || !text)
    text = "";
  return std::string(name) + " (" + std::to_string(static_cast<int>(rc)) +
         (*text ? std::string(": ") + text : std::string()) + ")";
}

/// Throws MemOpsError "<where>: <call> failed: <error>" unless rc is success.
void check(CUresult rc, const char* call, const std::string& where) {
  if (rc != CUDA_SUCCESS) throw MemOpsError(where + ": " + call + " failed: " + cu_text(rc));
}
#define EPX_CU(where, fn, ...) check(driver().p_##fn(__VA_ARGS__), #fn, where)

std::string peer_text(int peer) {
  return "rank " + std::to_string(peer);
}

constexpr std::size_t kStageBytes = 64;    ///< host sources up to this size are staged
constexpr std::size_t kScratchWords = 64;  ///< GPU signal words read back per wait
constexpr auto kPollEvery = std::chrono::milliseconds(10);

class CudaMemOps final : public MemOps {
 public:
  CudaMemOps(int nranks, int depth, std::unique_ptr<MemOps> host, double timeout_s)
      : nranks_(nranks),
        depth_(depth),
        timeout_s_(timeout_s),
        host_(std::move(host)),
        on_stream_(static_cast<std::size_t>(nranks), 0),
        staged_(static_cast<std::size_t>(nranks), 0) {}
  ~CudaMemOps() override { teardown(); }

  const char* name() const override { return "cuda"; }

  Export classify(void* data, std::size_t size, int type) override {
    if (type != NCCL_PTR_CUDA) return host_->classify(data, size, type);
    const std::string where = "regMrSym of an NCCL_PTR_CUDA range";
    const Driver& d = driver();
    if (!d.error.empty()) throw MemOpsError(where + ": " + d.error);
    const auto ptr = reinterpret_cast<CUdeviceptr>(data);
    unsigned int memory_type = 0;
    EPX_CU(where, cuPointerGetAttribute, &memory_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr);
    if (memory_type != CU_MEMORYTYPE_DEVICE)
      throw MemOpsError(where + ": the range is not GPU memory (CUDA memory type " +
                        std::to_string(memory_type) + "); register host memory as NCCL_PTR_HOST");
    int ordinal = -1;
    EPX_CU(where, cuPointerGetAttribute, &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
    ensure_ready(ordinal, where);
    Current cur(*this, true, where);

    CUdeviceptr base = 0;
    std::size_t bytes = 0;
    EPX_CU(where, cuMemGetAddressRange, &base, &bytes, ptr);
    if (ptr + size > base + bytes)
      throw MemOpsError(where + ": [data, data + " + std::to_string(size) +
                        ") runs past the end of its allocation of " + std::to_string(bytes) +
                        " bytes");
    Export ex;
    ex.device = true;
    CUmemGenericAllocationHandle handle = 0;
    const CUresult rc = d.p_cuMemRetainAllocationHandle(&handle, data);
    if (rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_NOT_SUPPORTED)
      return ex;  // not a cuMem allocation (cudaMalloc): nothing to export, local-only
    check(rc, "cuMemRetainAllocationHandle", where);
    try {
      CUmemAllocationProp prop{};
      EPX_CU(where, cuMemGetAllocationPropertiesFromHandle, &prop, handle);
      if (prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop.location.id != device_)
        throw MemOpsError(where + ": the allocation lives on device " +
                          std::to_string(prop.location.id) + ", this rank's GPU is device " +
                          std::to_string(device_));
      if (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        int fd = -1;
        EPX_CU(where, cuMemExportToShareableHandle, &fd, handle,
               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        ex.kind = RegionKind::kExportable;
        ex.alloc_bytes = bytes;
        ex.offset = ptr - base;
        ex.fd = fd;
        ex.close_fd = true;
      }
      // Else handle type NONE (NCCL's signal buffers) or no POSIX FD: local-only.
    } catch (...) {
      d.p_cuMemRelease(handle);  // the retain's reference; the first error is the one thrown
      throw;
    }
    EPX_CU(where, cuMemRelease, handle);
    return ex;
  }

  void* import(int fd, uint64_t alloc_bytes, bool device, int peer) override {
    if (!device) return host_->import(fd, alloc_bytes, device, peer);
    const std::string where = "importing " + peer_text(peer) + "'s GPU allocation of " +
                              std::to_string(alloc_bytes) + " bytes";
    if (!ready_.load(std::memory_order_acquire))
      throw MemOpsError(where +
                        ": this rank registered no GPU memory in this collective "
                        "(regMrSym's ranges must be GPU memory on every rank or on none)");
    Current cur(*this, true, where);
    const Driver& d = driver();
    CUmemGenericAllocationHandle handle = 0;
    EPX_CU(where, cuMemImportFromShareableHandle, &handle,
           reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUdeviceptr va = 0;
    bool mapped = false;
    try {
      EPX_CU(where, cuMemAddressReserve, &va, alloc_bytes, 0, 0, 0);
      EPX_CU(where, cuMemMap, va, alloc_bytes, 0, handle, 0);
      mapped = true;
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = device_;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      EPX_CU(where, cuMemSetAccess, va, alloc_bytes, &access, 1);
      EPX_CU(where, cuMemRelease, handle);  // the mapping keeps the allocation alive
      handle = 0;
    } catch (...) {
      if (mapped) d.p_cuMemUnmap(va, alloc_bytes);
      if (va) d.p_cuMemAddressFree(va, alloc_bytes);
      if (handle) d.p_cuMemRelease(handle);
      throw;
    }
    return reinterpret_cast<void*>(va);
  }

  void release(void* base, uint64_t alloc_bytes, bool device) override {
    if (!device) return host_->release(base, alloc_bytes, device);
    const std::string where = "unmapping a peer's GPU allocation of " +
                              std::to_string(alloc_bytes) + " bytes (deregistration)";
    Current cur(*this, true, where);
    // Copies into the mapping may still be queued: every peer stream drains first.
    std::string first;
    auto note = [&first](CUresult rc, const char* call, const std::string& what) {
      if (rc != CUDA_SUCCESS && first.empty())
        first = what + ": " + call + " failed: " + cu_text(rc);
    };
    const Driver& d = driver();
    for (int p = 0; p < nranks_; ++p) {
      const std::string what = where + ", the stream of " + peer_text(p);
      try {
        wait_stream(streams_[p], what);
      } catch (const MemOpsError& e) {
        if (first.empty()) first = e.what();
      }
    }
    const auto va = reinterpret_cast<CUdeviceptr>(base);
    note(d.p_cuMemUnmap(va, alloc_bytes), "cuMemUnmap", where);
    note(d.p_cuMemAddressFree(va, alloc_bytes), "cuMemAddressFree", where);
    if (!first.empty()) throw MemOpsError(first);
  }

  void copy_async(int peer, void* dst, bool dst_device, const void* src, bool src_device,
                  std::size_t bytes) override {
    if (!dst_device && !src_device) {
      // Host to host: done at once (NCCL never mixes these with GPU copies to one peer).
      host_->copy_async(peer, dst, dst_device, src, src_device, bytes);
      return;
    }
    const std::string where = "copy of " + std::to_string(bytes) + " bytes to " + peer_text(peer);
    need_ready(where);
    Current cur(*this, false, where);
    const CUstream stream = streams_[static_cast<std::size_t>(peer)];
    auto s = reinterpret_cast<CUdeviceptr>(src);
    if (!src_device && bytes <= kStageBytes) {
      // The source (an inline value) may change as soon as this returns.
      const uint64_t slot =
          staged_[static_cast<std::size_t>(peer)]++ % static_cast<uint64_t>(depth_);
      const std::size_t at =
          (static_cast<std::size_t>(peer) * static_cast<std::size_t>(depth_) + slot) * kStageBytes;
      std::memcpy(staging_ + at, src, bytes);
      s = staging_dev_ + at;
    }
    EPX_CU(where, cuMemcpyAsync, reinterpret_cast<CUdeviceptr>(dst), s, bytes, stream);
    on_stream_[static_cast<std::size_t>(peer)] = 1;
  }

  void mark(int peer, uint64_t seq) override {
    if (!on_stream_[static_cast<std::size_t>(peer)]) return host_->mark(peer, seq);
    const std::string where =
        "completion mark of request " + std::to_string(seq) + " to " + peer_text(peer);
    Current cur(*this, false, where);
    EPX_CU(where, cuStreamWriteValue64, streams_[static_cast<std::size_t>(peer)],
           marks_dev_ + static_cast<CUdeviceptr>(peer) * 8, seq, CU_STREAM_WRITE_VALUE_DEFAULT);
  }

  uint64_t completed(int peer) override {
    const uint64_t host = host_->completed(peer);
    if (!on_stream_[static_cast<std::size_t>(peer)]) return host;
    const uint64_t dev = std::atomic_ref<uint64_t>(marks_[peer]).load(std::memory_order_acquire);
    return std::max(host, dev);
  }

  void add_word(uint64_t* word, uint64_t add, bool device) override {
    std::vector<WordAdd> one{{word, add, device}};
    add_words(one);
  }

  /// Host words through the host memops; GPU words merged (one per word),
  /// then read back up to kScratchWords at a time with one wait, and each
  /// written back with its sum added, on the applier stream (in order after
  /// the reads, and before the next batch's reads).
  void add_words(std::vector<WordAdd>& adds) override {
    merge_word_adds(adds);
    std::size_t gpu = 0;
    for (const WordAdd& a : adds)
      if (a.device)
        adds[gpu++] = a;
      else
        host_->add_word(a.word, a.add, false);
    if (gpu == 0) return;
    const std::string where = "applying " + std::to_string(gpu) + " signal word(s)";
    need_ready(where);
    Current cur(*this, false, where);
    uint64_t* scratch = marks_ + nranks_;
    const CUdeviceptr scratch_dev = marks_dev_ + static_cast<CUdeviceptr>(nranks_) * 8;
    for (std::size_t first = 0; first < gpu; first += kScratchWords) {
      const std::size_t n = std::min(kScratchWords, gpu - first);
      for (std::size_t i = 0; i < n; ++i)
        EPX_CU(where, cuMemcpyAsync, scratch_dev + static_cast<CUdeviceptr>(i) * 8,
               reinterpret_cast<CUdeviceptr>(adds[first + i].word), 8, applier_);
      wait_stream(applier_, where + ": the signal applier's read of the words");
      for (std::size_t i = 0; i < n; ++i) {
        const uint64_t old = std::atomic_ref<uint64_t>(scratch[i]).load(std::memory_order_acquire);
        EPX_CU(where, cuStreamWriteValue64, applier_,
               reinterpret_cast<CUdeviceptr>(adds[first + i].word), old + adds[first + i].add,
               CU_STREAM_WRITE_VALUE_DEFAULT);
      }
    }
  }

  void poll() override {
    if (!ready_.load(std::memory_order_acquire)) return;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_poll_) return;
    next_poll_ = now + kPollEvery;
    Current cur(*this, false, "polling the copy streams");
    for (int p = 0; p <= nranks_; ++p) {
      if (p < nranks_ && !on_stream_[static_cast<std::size_t>(p)]) continue;
      const CUstream s = p < nranks_ ? streams_[static_cast<std::size_t>(p)] : applier_;
      const CUresult rc = driver().p_cuStreamQuery(s);
      if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_NOT_READY)
        throw MemOpsError((p < nranks_ ? "the copy stream of " + peer_text(p)
                                       : std::string("the signal applier stream")) +
                          ": cuStreamQuery reports an earlier failure: " + cu_text(rc));
    }
  }

 private:
  /// Makes the plugin's context current; with `restore`, the caller's again on exit.
  class Current {
   public:
    Current(const CudaMemOps& m, bool restore, const std::string& where) {
      EPX_CU(where, cuCtxGetCurrent, &previous_);
      if (previous_ == m.ctx_) return;
      EPX_CU(where, cuCtxSetCurrent, m.ctx_);
      restore_ = restore;
    }
    ~Current() {
      if (restore_) driver().p_cuCtxSetCurrent(previous_);
    }
    Current(const Current&) = delete;
    Current& operator=(const Current&) = delete;

   private:
    CUcontext previous_ = nullptr;
    bool restore_ = false;
  };

  /// Polls `stream` (cuStreamQuery) until its work is done; past the
  /// plugin's deadline throws MemOpsError naming `where` (on NCCL's proxy
  /// thread, a stalled GPU then fails the request instead of holding the
  /// thread). The plugin's context is current.
  void wait_stream(CUstream stream, const std::string& where) const {
    const Driver& d = driver();
    CUresult failed = CUDA_SUCCESS;
    const bool done = detail::poll_until(
        [&] {
          const CUresult rc = d.p_cuStreamQuery(stream);
          if (rc == CUDA_ERROR_NOT_READY) return false;
          failed = rc;
          return true;
        },
        timeout_s_);
    check(failed, "cuStreamQuery", where);
    if (!done)
      throw MemOpsError(where + ": the stream's work did not finish within " +
                        std::to_string(timeout_s_) +
                        " s (EPX_GIN_LOOP_TIMEOUT_S / EPX_TIMEOUT_S): the GPU is held by "
                        "work queued before it or has stalled");
  }

  void need_ready(const std::string& where) const {
    if (!ready_.load(std::memory_order_acquire))
      throw MemOpsError(where + ": no GPU memory is registered, so no stream exists");
  }

  /// The first GPU registration fixes the device and makes the streams and pinned words.
  void ensure_ready(int ordinal, const std::string& where) {
    std::lock_guard lock(init_m_);
    if (ready_.load(std::memory_order_acquire)) {
      if (ordinal != device_)
        throw MemOpsError(where + ": the range is on device " + std::to_string(ordinal) +
                          ", but this rank registered device " + std::to_string(device_) +
                          " memory before (one GPU per rank)");
      return;
    }
    try {
      init(ordinal, where);
    } catch (...) {
      teardown();
      throw;
    }
    ready_.store(true, std::memory_order_release);
  }

  void init(int ordinal, const std::string& where) {
    CUdevice dev = 0;
    EPX_CU(where, cuDeviceGet, &dev, ordinal);
    int mem_ops = 0;
    EPX_CU(where, cuDeviceGetAttribute, &mem_ops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
           dev);
    if (!mem_ops)
      throw MemOpsError(where + ": device " + std::to_string(ordinal) +
                        " cannot write 64-bit values from a stream (cuStreamWriteValue64), which "
                        "completion marks and signals need");
    // The plugin's own context, not the device's primary one: while a thread
    // of the process waits in a blocking call of the primary context (a
    // pageable copy behind a kernel, as PyTorch's .cpu() right after an op),
    // the driver holds every other primary-context call, and the copies that
    // kernel waits for would never be issued. Calls in another context go on
    // (measured on H200: 0.2 ms against 2.4 s). NCCL's windows and signal
    // buffers are cuMem allocations, which every context of the device reaches.
    CUcontext previous = nullptr;
    EPX_CU(where, cuCtxGetCurrent, &previous);
    EPX_CU(where, cuCtxCreate, &ctx_, nullptr, 0, dev);
    EPX_CU(where, cuCtxSetCurrent, previous);  // cuCtxCreate made it current
    dev_ = dev;
    device_ = ordinal;
    Current cur(*this, true, where);
    int least = 0, greatest = 0;
    EPX_CU(where, cuCtxGetStreamPriorityRange, &least, &greatest);
    streams_.assign(static_cast<std::size_t>(nranks_), nullptr);
    for (auto& s : streams_)
      EPX_CU(where, cuStreamCreateWithPriority, &s, CU_STREAM_NON_BLOCKING, greatest);
    EPX_CU(where, cuStreamCreateWithPriority, &applier_, CU_STREAM_NON_BLOCKING, greatest);
    // Pinned words: one completion mark per peer, then the applier's scratch words.
    void* p = nullptr;
    const std::size_t mark_bytes = (static_cast<std::size_t>(nranks_) + kScratchWords) * 8;
    EPX_CU(where, cuMemHostAlloc, &p, mark_bytes,
           CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    marks_ = static_cast<uint64_t*>(p);
    std::memset(marks_, 0, mark_bytes);
    EPX_CU(where, cuMemHostGetDevicePointer, &marks_dev_, marks_, 0);
    const std::size_t stage_bytes =
        static_cast<std::size_t>(nranks_) * static_cast<std::size_t>(depth_) * kStageBytes;
    EPX_CU(where, cuMemHostAlloc, &p, stage_bytes,
           CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    staging_ = static_cast<char*>(p);
    EPX_CU(where, cuMemHostGetDevicePointer, &staging_dev_, staging_, 0);
  }

  /// Frees what init made (errors ignored: nothing is left to report them to).
  /// Streams whose work does not end within the deadline are left, with the
  /// pinned words they write and the context (a leak, said on stderr).
  void teardown() noexcept {
    if (!ctx_) return;
    const Driver& d = driver();
    CUcontext previous = nullptr;
    d.p_cuCtxGetCurrent(&previous);
    d.p_cuCtxSetCurrent(ctx_);
    bool idle = true;
    auto drain = [&](CUstream s) {
      idle = detail::poll_until([&] { return d.p_cuStreamQuery(s) != CUDA_ERROR_NOT_READY; },
                                timeout_s_) &&
             idle;
      d.p_cuStreamDestroy(s);  // with work left, CUDA destroys it once that is done
    };
    for (CUstream s : streams_)
      if (s) drain(s);
    streams_.clear();
    if (applier_) drain(applier_);
    applier_ = nullptr;
    if (!idle) {
      std::fprintf(stderr,
                   "epx gin loopback: device %d: copy or signal streams still busy after %.0f s "
                   "(EPX_GIN_LOOP_TIMEOUT_S / EPX_TIMEOUT_S) at teardown; their pinned words and "
                   "the plugin's context are left allocated\n",
                   device_, timeout_s_);
      d.p_cuCtxSetCurrent(previous == ctx_ ? nullptr : previous);
      marks_ = nullptr;
      staging_ = nullptr;
      ctx_ = nullptr;
      return;
    }
    if (marks_) d.p_cuMemFreeHost(marks_);
    marks_ = nullptr;
    if (staging_) d.p_cuMemFreeHost(staging_);
    staging_ = nullptr;
    d.p_cuCtxSetCurrent(previous == ctx_ ? nullptr : previous);
    d.p_cuCtxDestroy(ctx_);
    ctx_ = nullptr;
  }

  const int nranks_;
  const int depth_;
  const double timeout_s_;  ///< EPX_GIN_LOOP_TIMEOUT_S / EPX_TIMEOUT_S: every stream wait
  const std::unique_ptr<MemOps> host_;

  std::mutex init_m_;
  std::atomic<bool> ready_{false};
  int device_ = -1;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  std::vector<CUstream> streams_;  ///< per peer
  CUstream applier_ = nullptr;     ///< the target's signal read-modify-writes
  uint64_t* marks_ = nullptr;      ///< pinned: nranks completion marks, then kScratchWords scratch
  CUdeviceptr marks_dev_ = 0;
  char* staging_ = nullptr;  ///< pinned: depth slots of kStageBytes per peer
  CUdeviceptr staging_dev_ = 0;

  // Under the plugin's per-collComm mutex (the progress path).
  std::vector<uint8_t> on_stream_;  ///< per peer: a copy went through its stream
  std::vector<uint64_t> staged_;    ///< per peer: host sources staged so far
  std::chrono::steady_clock::time_point next_poll_{};
};

}  // namespace

std::unique_ptr<MemOps> make_cuda_memops(int nranks, int depth, std::unique_ptr<MemOps> host,
                                         double timeout_s) {
  return std::make_unique<CudaMemOps>(nranks, depth, std::move(host), timeout_s);
}

int memops_ptr_support() {
  return NCCL_PTR_HOST | NCCL_PTR_CUDA;
}
std::unique_ptr<MemOps> make_memops(int nranks, int depth, double timeout_s) {
  return make_cuda_memops(nranks, depth, make_host_memops(nranks), timeout_s);
}

}  // namespace epx::gin_loop
