// CUDA IPC engine (engine.hpp; its driver calls: cuda_ipc_driver.hpp): the peers of one host map
// each other's regions; a put is a cudaMemcpyAsync on the endpoint's own stream and a signal a
// stream-ordered cuStreamWriteValue64 behind it. Completion is tracked by events recorded at each
// mark. With EPX_PROXY_CUMEM=1, regions are cuMem allocations (with a process per rank their POSIX
// file descriptors travel over a host mesh, common/host_mesh.hpp, instead of legacy IPC handles),
// and the streams, the events and every call of the proxy threads live in a CUDA context of the
// engine's own, one shared by the in-process ranks of a device (the constructor says why).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/host_mesh.hpp"
#include "common/topology.hpp"
#include "core/stream_wait.hpp"
#include "epx/communicator.hpp"
#include "transport/proxy/bounds.hpp"
#include "transport/proxy/command.hpp"
#include "transport/proxy/cuda_ipc_driver.hpp"
#include "transport/proxy/engine.hpp"

namespace epx::proxy {
namespace {

using namespace cuda_ipc;  // the driver calls (cuda_ipc_driver.hpp)

/// Closes a file descriptor at the end of its scope (-1: none).
struct FdCloser {
  int fd = -1;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

/// Waits for `stream` until `timeout_s`; false when its work is still queued.
bool drain(cudaStream_t stream, double timeout_s) {
  return detail::wait_stream_for(stream, timeout_s);
}

template <std::size_t N>
void copy_string(char (&dst)[N], const std::string& src) {
  const std::size_t n = std::min(src.size(), N - 1);
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

/// What each rank tells the others when it registers a region (the same
/// plain bytes on every rank: it travels through Communicator::allgather).
struct Record {
  char host[72];     ///< hostname
  char boot_id[40];  ///< /proc/sys/kernel/random/boot_id: tells apart hosts of one name
  int64_t pid;
  uint64_t base;         ///< the region's address in its process
  uint64_t bytes;        ///< the region's size
  uint64_t offset;       ///< base minus the start of its allocation (what the IPC handle maps)
  uint64_t alloc_bytes;  ///< the allocation's size (a cuMem export maps all of it)
  int32_t cumem;         ///< 1: exported as a cuMem file descriptor (EPX_PROXY_CUMEM)
  cudaIpcMemHandle_t handle;
  int32_t failed;  ///< 1: the export failed (error says why)
  char error[300];
};

/// After the peers' handles are opened: whether every rank managed.
struct OpenStatus {
  int32_t failed;
  char error[300];
};

/// Events made per channel up front (more are made when marks pile up).
constexpr std::size_t kEventsPerChannel = 1024;

class CudaIpcEngine final : public Engine {
 public:
  CudaIpcEngine(Communicator& comm, int num_channels, std::vector<uint8_t> targets, bool cumem)
      : comm_(comm),
        device_(comm.device()),
        rank_(comm.rank()),
        num_ranks_(comm.num_ranks()),
        num_channels_(num_channels),
        timeout_s_(env::timeout_seconds()),
        row_copies_(comm.in_process() || env::proxy_row_copies()),
        cumem_(cumem),
        hostname_(hostname()),
        boot_id_(boot_id()),
        hosts_(static_cast<std::size_t>(num_ranks_)),
        reach_(static_cast<std::size_t>(num_ranks_), 0),
        targets_(std::move(targets)) {
    require(num_channels >= 1, "num_channels", "must be >= 1, got " + std::to_string(num_channels));
    require(targets_.empty() || static_cast<int>(targets_.size()) == num_ranks_, "targets",
            "must be empty (every rank) or hold one entry per rank (" + std::to_string(num_ranks_) +
                "), got " + std::to_string(targets_.size()));
    DeviceGuard guard(device_);
    // Fails here, not at the first signal, when the driver or the GPU lacks what signals need.
    CUdevice dev = 0;
    int mem_ops = 0;
    EPX_CU_CHECK(driver().device_get(&dev, device_));
    EPX_CU_CHECK(driver().device_get_attribute(
        &mem_ops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev));
    if (!mem_ops)
      throw Error(ErrorCode::kUnsupported,
                  "cuda_ipc engine: device " + std::to_string(device_) +
                      " cannot write 64-bit values from a stream (cuStreamWriteValue64), which "
                      "its signals need");
    if (cumem_) {
      // The engine's own context. While a thread of this process waits in a
      // blocking call of the primary context, e.g. a copy to pageable memory
      // behind a kernel (PyTorch's .cpu() right after an op), the driver
      // holds every other thread's primary-context call; the proxy's copies
      // would wait for that kernel, which waits for them (and for the
      // peers', whose kernels wait for this one's). Calls of another context
      // go on: measured on H200, a copy took 0.2 ms there against 2.4 s in
      // the primary context. It needs cuMem regions: from an own context,
      // copies between cudaMalloc memory and legacy IPC mappings of the
      // primary context never landed while an op's kernel ran (twelfth
      // session), while the loopback GIN plugin's, between cuMem mappings,
      // did. In-process ranks share one such context per device (a context
      // each would cost every rank device memory): their kernels all run in the primary
      // context, and a copy queued on a hardware queue of that context
      // behind a kernel that waits for it stalls until the kernel's
      // deadline (16 in-process ranks make more streams than the 32 queues,
      // docs/low_latency.md). The queues of another context carry only the
      // proxies' copies.
      ctx_ = comm_.in_process() ? acquire_shared_context(dev) : create_context(dev);
      shared_ctx_ = comm_.in_process();
    }
    // Until the first registration tells the hosts apart: in-process ranks
    // reach each other, other processes are unknown (not reached).
    for (int r = 0; r < num_ranks_; ++r) reach_[r] = comm_.in_process() || r == rank_ ? 1 : 0;
    hosts_[rank_] = hostname_;
    channels_.resize(static_cast<std::size_t>(num_channels));
    for (auto& ch : channels_) {
      ch.streams.assign(static_cast<std::size_t>(num_ranks_), nullptr);
      ch.dirty.assign(static_cast<std::size_t>(num_ranks_), 0);
    }
  }

  ~CudaIpcEngine() override {
    // Never throws: errors here are ignored (the process may be tearing down).
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    cudaSetDevice(device_);
    bool drained = true;
    try {
      ContextScope own(ctx_, true);
      for (auto& ch : channels_)
        for (cudaStream_t s : ch.streams)
          if (s) drained = drain(s, timeout_s_) && drained;
    } catch (...) {
      drained = false;
    }
    // A mapping that a copy may still use stays open (leaked) rather than pulled.
    if (drained)
      for (auto& reg : regions_)
        for (int r = 0; r < static_cast<int>(reg.opened.size()); ++r) unmap_peer(reg, r);
    try {
      ContextScope own(ctx_, true);
      for (auto& ch : channels_) {
        for (cudaStream_t s : ch.streams)
          if (s) cudaStreamDestroy(s);
        for (cudaEvent_t e : ch.all_events) cudaEventDestroy(e);
      }
    } catch (...) {
    }
    if (ctx_ && shared_ctx_)
      release_shared_context(ctx_);
    else if (ctx_)
      driver().ctx_destroy(ctx_);
    if (previous >= 0) cudaSetDevice(previous);
  }

  const char* name() const override { return "cuda_ipc"; }
  std::string held_call_cause() const override {
    if (cumem_) return {};
    return "its copies are CUDA calls of the primary context, which the driver holds while "
           "another thread of this process waits in a blocking primary-context call, such as a "
           "copy to pageable memory (.cpu()) right after an op; wait for the op first, or leave "
           "EPX_PROXY_CUMEM unset or 1 (docs/limitations.md)";
  }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  int num_channels() const override { return num_channels_; }

  void register_region(int id, void* base, std::size_t bytes) override;
  void deregister_region(int id) override;

  /// Known after the first register_region, which tells the hosts apart;
  /// before it, in-process ranks reach each other and other processes none.
  bool reaches(int peer) const override {
    return peer >= 0 && peer < num_ranks_ && reach_[peer] != 0;
  }
  void* mapped(int id, int peer) const override {
    if (id < 0 || id >= kMaxRegions || !regions_[id].registered || !reaches(peer)) return nullptr;
    return regions_[id].peer_base[peer];
  }

  void check_put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
                 uint64_t bytes) const override {
    check_channel(channel);
    const Region& reg = target(peer, region, "put");
    check_put_range("cuda_ipc", "put", rank_, peer, region, dst_off, src_off, bytes, reg.bytes,
                    reg.bytes);
  }

  void put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
           uint64_t bytes) override {
    check_put(channel, peer, region, dst_off, src_off, bytes);
    bind();
    Channel& ch = channel_of(channel);
    const Region& reg = regions_[region];
    cudaStream_t s = stream(ch, peer);
    EPX_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(reg.peer_base[peer]) + dst_off,
                                   static_cast<const char*>(reg.local) + src_off, bytes,
                                   cudaMemcpyDeviceToDevice, s));
    ch.dirty[peer] = 1;
  }

  void put_strided(int channel, int peer, int region, uint64_t dst_off, uint64_t dst_pitch,
                   uint64_t src_off, uint64_t src_pitch, uint64_t width, uint64_t rows) override {
    if (rows == 0) return;
    bind();
    Channel& ch = channel_of(channel);
    const Region& reg = target(peer, region, "put_strided");
    check_strided_put_range("cuda_ipc", rank_, peer, region, dst_off, dst_pitch, src_off, src_pitch,
                            width, rows, reg.bytes, reg.bytes);
    cudaStream_t s = stream(ch, peer);
    char* dst = static_cast<char*>(reg.peer_base[peer]) + dst_off;
    const char* src = static_cast<const char*>(reg.local) + src_off;
    if (row_copies_) {
      // Ranks of one process share one GPU: row copies, as in the in-process
      // suites that passed. (The one failure seen with a pitched copy here,
      // a combine left unwritten, matches what hardware queues shared with
      // the ranks' streams did later; a pitched copy is untested since.)
      // With a process per rank only under EPX_PROXY_ROW_COPIES=1.
      for (uint64_t i = 0; i < rows; ++i)
        EPX_CUDA_CHECK(cudaMemcpyAsync(dst + i * dst_pitch, src + i * src_pitch, width,
                                       cudaMemcpyDeviceToDevice, s));
    } else {
      EPX_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows,
                                       cudaMemcpyDeviceToDevice, s));
    }
    ch.dirty[peer] = 1;
  }

  void signal_add(int channel, int peer, int region, uint64_t sig_off, uint64_t add) override {
    bind();
    Channel& ch = channel_of(channel);
    const Region& reg = target(peer, region, "signal_add");
    check_range("cuda_ipc", "signal_add", "signal word", peer, region, sig_off, 8, reg.bytes);
    if (sig_off % 8 != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  "cuda_ipc engine: signal_add to rank " + std::to_string(peer) + " region " +
                      std::to_string(region) + ": sig_off " + std::to_string(sig_off) +
                      " is not 8-byte aligned");
    // There is no stream-ordered add, only a write. The signal word is
    // written by this (rank, channel) alone (engine.hpp), starts at 0 when
    // the region is registered, and this channel's writes to `peer` all go
    // through one stream, so they land in issue order: after the k-th write
    // the word holds the sum of the first k adds, our running total. Writing
    // the new total therefore has the effect of adding `add`.
    const uint64_t generation = reset_generation_[region].load(std::memory_order_acquire);
    if (ch.generation[region] != generation) {  // reset_signals since this channel's last signal
      std::erase_if(ch.totals, [&](const auto& kv) { return kv.first.region == region; });
      ch.generation[region] = generation;
    }
    uint64_t& total = ch.totals[SigKey{peer, region, sig_off}];
    total += add;
    cudaStream_t s = stream(ch, peer);
    const auto addr =
        reinterpret_cast<CUdeviceptr>(static_cast<char*>(reg.peer_base[peer]) + sig_off);
    EPX_CU_CHECK(driver().stream_write_value64(reinterpret_cast<CUstream>(s), addr, total,
                                               CU_STREAM_WRITE_VALUE_DEFAULT));
    ch.dirty[peer] = 1;
  }

  /// The words were zeroed: each channel drops its running totals for region
  /// `id` before its next signal (the channel's own thread, so no lock).
  void reset_signals(int id) override {
    if (id < 0 || id >= kMaxRegions) return;
    reset_generation_[id].fetch_add(1, std::memory_order_release);
  }

  void mark(int channel, uint64_t token) override {
    bind();
    Channel& ch = channel_of(channel);
    Mark m{token, {}, 0};
    bool shared_done = false;  // in-process: one stream, one event
    for (int p = 0; p < num_ranks_; ++p) {
      if (!ch.dirty[p]) continue;
      ch.dirty[p] = 0;
      if (comm_.in_process() && shared_done) continue;
      shared_done = true;
      cudaEvent_t e = take_event(ch);
      EPX_CUDA_CHECK(cudaEventRecord(e, stream(ch, p)));
      m.events.push_back(e);
    }
    if (m.events.empty() && ch.marks.empty()) {
      ch.completed = std::max(ch.completed, token);  // nothing issued since the last mark
      return;
    }
    ch.marks.push_back(std::move(m));
  }

  uint64_t completed(int channel) override {
    bind();
    Channel& ch = channel_of(channel);
    while (!ch.marks.empty()) {
      Mark& m = ch.marks.front();
      for (; m.done < m.events.size(); ++m.done) {
        const cudaError_t e = cudaEventQuery(m.events[m.done]);
        if (e == cudaErrorNotReady) return ch.completed;
        EPX_CUDA_CHECK(e);
      }
      ch.completed = std::max(ch.completed, m.token);
      for (cudaEvent_t e : m.events) ch.free_events.push_back(e);
      ch.marks.pop_front();
    }
    return ch.completed;
  }

 private:
  struct SigKey {
    int peer, region;
    uint64_t off;
    bool operator==(const SigKey&) const = default;
  };
  struct SigKeyHash {
    std::size_t operator()(const SigKey& k) const {
      return std::hash<uint64_t>()(k.off * 0x9e3779b97f4a7c15ull ^
                                   (static_cast<uint64_t>(k.peer) << 4 | k.region));
    }
  };
  struct Mark {
    uint64_t token;
    std::vector<cudaEvent_t> events;
    std::size_t done;  ///< events already seen complete
  };
  /// What one channel's thread owns: no locks, nobody else touches it while
  /// the proxy runs (a line of its own, away from the other channels').
  struct alignas(64) Channel {
    std::vector<cudaStream_t> streams;  ///< per peer, created on first use
    std::vector<char> dirty;            ///< per peer: work since the last mark
    std::deque<Mark> marks;
    std::vector<cudaEvent_t> free_events, all_events;
    std::unordered_map<SigKey, uint64_t, SigKeyHash> totals;  ///< running signal totals
    std::array<uint64_t, kMaxRegions> generation{};           ///< reset_generation_ seen
    uint64_t completed = 0;
  };
  /// Bumped by reset_signals(id); channels compare before each signal.
  std::array<std::atomic<uint64_t>, kMaxRegions> reset_generation_{};
  struct Region {
    bool registered = false;
    void* local = nullptr;
    std::size_t bytes = 0;
    std::vector<void*> peer_base;  ///< per rank: where its region is mapped here (nullptr: not)
    std::vector<void*> opened;     ///< per rank: what cudaIpcOpenMemHandle / import_cumem mapped
    std::vector<std::size_t> mapped_bytes;  ///< per rank: a cuMem mapping's size (0: IPC)
  };

  /// put, put_strided, signal_add, mark and completed run on the proxy's
  /// channel threads, which make no other CUDA call: each thread stays in the
  /// engine's context from its first call on.
  void bind() const { ContextScope scope(ctx_, false); }

  void check_channel(int c) const {
    require(c >= 0 && c < num_channels_, "channel",
            "must be in [0, " + std::to_string(num_channels_) + "), got " + std::to_string(c));
  }
  Channel& channel_of(int c) {
    check_channel(c);
    return channels_[c];
  }

  const Region& target(int peer, int region, const char* what) const {
    if (peer < 0 || peer >= num_ranks_)
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("cuda_ipc engine: ") + what + ": peer " + std::to_string(peer) +
                      " is not a rank (num_ranks " + std::to_string(num_ranks_) + ")");
    if (!reach_[peer])
      throw Error(ErrorCode::kUnsupported,
                  std::string("cuda_ipc engine: ") + what + ": rank " + std::to_string(rank_) +
                      " (host " + hostname_ + ") cannot reach rank " + std::to_string(peer) +
                      " (host " + (hosts_[peer].empty() ? "unknown" : hosts_[peer]) +
                      "): CUDA IPC works within one host only");
    if (!is_target(peer))
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("cuda_ipc engine: ") + what + ": rank " + std::to_string(peer) +
                      " is not a target of rank " + std::to_string(rank_) +
                      "'s proxy (a peer of its own node is reached by load/store)");
    if (region < 0 || region >= kMaxRegions || !regions_[region].registered)
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("cuda_ipc engine: ") + what + " to rank " + std::to_string(peer) +
                      ": region " + std::to_string(region) + " is not registered");
    return regions_[region];
  }
  bool is_target(int peer) const { return targets_.empty() || targets_[peer] != 0; }

  /// The (channel, peer) endpoint's stream, at the device's greatest
  /// priority; the channel's thread makes it on first use. A stream's work
  /// goes through a hardware queue that other streams of the context may
  /// share, in order: a copy queued behind a kernel that waits for it waits
  /// until that kernel's deadline. Processes of one GPU each have their own
  /// queues; in-process ranks share the context's (CUDA_DEVICE_MAX_CONNECTIONS,
  /// 8 by default), and with 8 the in-process 2x2 suite hit exactly that
  /// (priority does not keep streams apart); with 32 it passed. So in-process
  /// ranks use one stream per channel for all peers (fewer streams to share
  /// the queues; its stronger order is still the order puts need).
  cudaStream_t stream(Channel& ch, int peer) {
    cudaStream_t& s = ch.streams[comm_.in_process() ? 0 : peer];
    if (!s) {
      // The proxy thread's device already; with an own context, the caller's
      // scope made it current.
      if (!ctx_) EPX_CUDA_CHECK(cudaSetDevice(device_));
      int least = 0, greatest = 0;
      EPX_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      EPX_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    }
    return s;
  }

  cudaEvent_t take_event(Channel& ch) {
    if (!ch.free_events.empty()) {
      cudaEvent_t e = ch.free_events.back();
      ch.free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    EPX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ch.all_events.push_back(e);
    return e;
  }

  /// Closes what register_region mapped of `peer`'s region; with `checked`,
  /// a failure throws (else it is ignored: the caller raises its own error,
  /// or tears down).
  static void unmap_peer(Region& reg, int peer, bool checked = false) {
    void* p = peer < static_cast<int>(reg.opened.size()) ? reg.opened[peer] : nullptr;
    if (!p) return;
    reg.opened[peer] = nullptr;
    if (reg.mapped_bytes[peer] > 0) {
      const auto va = reinterpret_cast<CUdeviceptr>(p);
      const CUresult unmapped = driver().mem_unmap(va, reg.mapped_bytes[peer]);
      const CUresult freed = driver().mem_address_free(va, reg.mapped_bytes[peer]);
      if (checked) {
        EPX_CU_CHECK(unmapped);
        EPX_CU_CHECK(freed);
      }
    } else {
      const cudaError_t e = cudaIpcCloseMemHandle(p);
      if (checked) EPX_CUDA_CHECK(e);
    }
  }

  /// The host mesh the cuMem exports travel over, made (collectively) at the
  /// first registration that needs it.
  host_mesh::Mesh& mesh() {
    if (!mesh_) {
      host_mesh::MeshHandle handle{};
      listener_ = std::make_unique<host_mesh::MeshListener>(&handle);
      const std::vector<uint8_t> all = comm_.allgather(&handle, sizeof(handle));
      std::vector<host_mesh::MeshHandle> handles(static_cast<std::size_t>(num_ranks_));
      std::memcpy(handles.data(), all.data(), sizeof(host_mesh::MeshHandle) * num_ranks_);
      std::vector<const host_mesh::MeshHandle*> views;
      for (const auto& h : handles) views.push_back(&h);
      mesh_ = std::make_unique<host_mesh::Mesh>(views, rank_, *listener_, timeout_s_);
      for (const std::string& r : mesh_->rejected())  // the mesh formed without them
        std::fprintf(stderr, "epx cuda_ipc engine, rank %d: %s\n", rank_, r.c_str());
    }
    return *mesh_;
  }

  Communicator& comm_;
  const int device_, rank_, num_ranks_, num_channels_;
  const double timeout_s_;   ///< how long deregistration waits for this rank's copies
  const bool row_copies_;    ///< strided puts as one copy per row (EPX_PROXY_ROW_COPIES)
  const bool cumem_;         ///< cuMem regions and an own context (BufferOptions::proxy_cumem)
  CUcontext ctx_ = nullptr;  ///< the engine's own context (null: the primary one)
  bool shared_ctx_ = false;  ///< ctx_ is the in-process ranks' shared one
  std::unique_ptr<host_mesh::MeshListener> listener_;  ///< cuMem exports: made at first use
  std::unique_ptr<host_mesh::Mesh> mesh_;
  const std::string hostname_, boot_id_;
  std::vector<std::string> hosts_;      ///< per rank: its hostname (known after a registration)
  std::vector<char> reach_;             ///< per rank: same host (CUDA IPC works)
  const std::vector<uint8_t> targets_;  ///< per rank: commands may name it (empty: all)
  std::array<Region, kMaxRegions> regions_;
  std::vector<Channel> channels_;
};

void CudaIpcEngine::register_region(int id, void* base, std::size_t bytes) {
  check_region_id(id, "register_region");
  check_new_region(id, base, bytes, regions_[id].registered, rank_);
  DeviceGuard guard(device_);
  const std::string where = "cuda_ipc engine: register_region(" + std::to_string(id) + ")";

  Record mine;
  std::memset(&mine, 0, sizeof(mine));
  copy_string(mine.host, hostname_);
  copy_string(mine.boot_id, boot_id_);
  mine.pid = static_cast<int64_t>(getpid());
  mine.base = reinterpret_cast<uint64_t>(base);
  mine.bytes = bytes;
  mine.cumem = cumem_ ? 1 : 0;
  FdCloser exported;  // this rank's cuMem export, once the peers have theirs
  if (!comm_.in_process()) {
    // An error here travels in the record, so that every rank raises it
    // instead of the others waiting in the all-gather for this one.
    try {
      CUdeviceptr start = 0;
      std::size_t size = 0;
      EPX_CU_CHECK(
          driver().mem_get_address_range(&start, &size, reinterpret_cast<CUdeviceptr>(base)));
      const uint64_t offset = mine.base - start;
      if (offset + bytes > size)
        throw Error(ErrorCode::kInvalidArgument,
                    where + ": [base, base + " + std::to_string(bytes) +
                        ") runs past the end of its allocation (" + std::to_string(size - offset) +
                        " bytes from base)");
      if (cumem_) {
        const Driver& d = driver();
        CUmemGenericAllocationHandle handle = 0;
        EPX_CU_CHECK(d.mem_retain(&handle, base));
        const CUresult rc =
            d.mem_export(&exported.fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        d.mem_release(handle);  // the retain's reference
        if (rc != CUDA_SUCCESS)
          throw Error(ErrorCode::kCuda,
                      where + ": cuMemExportToShareableHandle failed (CUresult " +
                          std::to_string(static_cast<int>(rc)) +
                          "): with EPX_PROXY_CUMEM=1 regions must be cuMem allocations with "
                          "the POSIX file descriptor handle type (alloc_cumem_region)");
      } else {
        EPX_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, base));
      }
      mine.offset = offset;
      mine.alloc_bytes = size;
    } catch (const std::exception& e) {
      mine.failed = 1;
      copy_string(mine.error, e.what());
    }
  }
  const std::vector<uint8_t> gathered = comm_.allgather(&mine, sizeof(mine));
  std::vector<Record> all(static_cast<std::size_t>(num_ranks_));
  std::memcpy(all.data(), gathered.data(), sizeof(Record) * num_ranks_);

  for (int r = 0; r < num_ranks_; ++r)
    if (all[r].failed)
      throw Error(ErrorCode::kCuda, where + ": rank " + std::to_string(r) +
                                        " could not export its region: " + all[r].error);
  for (int r = 0; r < num_ranks_; ++r)
    if (all[r].bytes != all[0].bytes)
      throw Error(ErrorCode::kInvalidArgument,
                  where + ": every rank must register the same size: rank 0 gives " +
                      std::to_string(all[0].bytes) + " bytes, rank " + std::to_string(r) + " " +
                      std::to_string(all[r].bytes));
  for (int r = 0; r < num_ranks_; ++r)
    if (all[r].cumem != mine.cumem)
      throw Error(ErrorCode::kInvalidArgument,
                  where + ": EPX_PROXY_CUMEM must be the same on every rank: rank " +
                      std::to_string(r) + " has " + std::to_string(all[r].cumem) + ", rank " +
                      std::to_string(rank_) + " " + std::to_string(mine.cumem));
  // cuMem exports travel as file descriptors over the host mesh (one host:
  // the mesh refuses ranks of another boot id, naming them).
  std::vector<host_mesh::Mesh::Item> fds;
  if (cumem_ && !comm_.in_process()) {
    try {
      fds = mesh().allgather({}, exported.fd, "register_region (cuMem exports)");
    } catch (const host_mesh::MeshError& e) {
      throw Error(ErrorCode::kTimeout, where + ": " + e.what());
    }
  }
  std::vector<FdCloser> received(fds.size());
  for (std::size_t r = 0; r < fds.size(); ++r) received[r].fd = fds[r].fd;

  Region reg;
  reg.local = base;
  reg.bytes = bytes;
  reg.peer_base.assign(static_cast<std::size_t>(num_ranks_), nullptr);
  reg.opened.assign(static_cast<std::size_t>(num_ranks_), nullptr);
  reg.mapped_bytes.assign(static_cast<std::size_t>(num_ranks_), 0);
  std::vector<char> reach(static_cast<std::size_t>(num_ranks_), 0);
  OpenStatus status;
  std::memset(&status, 0, sizeof(status));
  for (int r = 0; r < num_ranks_; ++r) {
    hosts_[r] = all[r].host;
    const bool same_host =
        comm_.in_process() || (hosts_[r] == hostname_ && std::string(all[r].boot_id) == boot_id_);
    const bool same_process = comm_.in_process() || (same_host && all[r].pid == mine.pid);
    if (r == rank_) {
      reg.peer_base[r] = base;
    } else if (same_process) {
      reg.peer_base[r] = reinterpret_cast<void*>(all[r].base);
    } else if (same_host && !status.failed && cumem_) {
      try {
        // What the peer says it exported is checked before it is mapped; that
        // the descriptor's allocation holds alloc_bytes, cuMemMap checks.
        check_peer_region(where, r, all[r].bytes, all[r].offset, all[r].alloc_bytes);
        const CUdeviceptr va = import_cumem(received[r].fd, all[r].alloc_bytes, device_);
        reg.opened[r] = reinterpret_cast<void*>(va);
        reg.mapped_bytes[r] = all[r].alloc_bytes;
        reg.peer_base[r] = reinterpret_cast<char*>(va) + all[r].offset;
      } catch (const std::exception& e) {
        status.failed = 1;
        copy_string(status.error,
                    "mapping rank " + std::to_string(r) + "'s cuMem region failed: " + e.what());
      }
    } else if (same_host && !status.failed) {
      void* p = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&p, all[r].handle, cudaIpcMemLazyEnablePeerAccess);
      if (e == cudaSuccess) {
        reg.opened[r] = p;
        // The opened allocation's real size must hold what the peer says.
        try {
          CUdeviceptr start = 0;
          std::size_t size = 0;
          EPX_CU_CHECK(
              driver().mem_get_address_range(&start, &size, reinterpret_cast<CUdeviceptr>(p)));
          check_peer_region(where, r, all[r].bytes, all[r].offset,
                            std::min<uint64_t>(all[r].alloc_bytes, size));
          reg.peer_base[r] = static_cast<char*>(p) + all[r].offset;
        } catch (const std::exception& x) {
          status.failed = 1;
          copy_string(status.error, x.what());
        }
      } else {
        status.failed = 1;
        copy_string(status.error, "cudaIpcOpenMemHandle of rank " + std::to_string(r) +
                                      "'s region failed: " + cudaGetErrorName(e) + " (" +
                                      cudaGetErrorString(e) + ")");
      }
    }
    reach[r] = same_host ? 1 : 0;
  }
  if (!comm_.in_process()) {
    // Every rank learns whether every other could map its peers.
    const std::vector<uint8_t> opened = comm_.allgather(&status, sizeof(status));
    for (int r = 0; r < num_ranks_; ++r) {
      OpenStatus s;
      std::memcpy(&s, opened.data() + sizeof(OpenStatus) * r, sizeof(s));
      if (!s.failed) continue;
      for (int p = 0; p < num_ranks_; ++p)
        unmap_peer(reg, p);  // nothing used it yet; the error below is the news
      throw Error(ErrorCode::kCuda, where + ": rank " + std::to_string(r) + ": " + s.error);
    }
  }
  reach_ = std::move(reach);
  // The Buffer zeroes a region's signal words when it registers it: the
  // running totals start again from 0.
  for (auto& ch : channels_)
    std::erase_if(ch.totals, [id](const auto& kv) { return kv.first.region == id; });
  reg.registered = true;
  regions_[id] = std::move(reg);
  // Every endpoint's stream and some events now, on the registering thread:
  // the proxy threads then make no CUDA object while ops run. (Ranks that
  // share a GPU must not make one there: it may wait for the kernels running,
  // which may wait for this rank.) In the engine's own context, if any.
  ContextScope own(ctx_, true);
  for (auto& ch : channels_) {
    for (int p = 0; p < num_ranks_; ++p)
      if (reach_[p] && is_target(p)) stream(ch, p);  // fewer streams, fewer shared queues
    while (ch.all_events.size() < kEventsPerChannel) {
      cudaEvent_t e = nullptr;
      EPX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      ch.all_events.push_back(e);
      ch.free_events.push_back(e);
    }
  }
}

void CudaIpcEngine::deregister_region(int id) {
  check_region_id(id, "deregister_region");
  require(regions_[id].registered, "deregister_region",
          "region " + std::to_string(id) + " is not registered on rank " + std::to_string(rank_));
  DeviceGuard guard(device_);
  // This rank's copies into the peers' regions are done, then (barrier)
  // everyone's are: no peer still writes this rank's region, nobody reads
  // through the mappings that close now.
  {
    ContextScope own(ctx_, true);
    for (auto& ch : channels_)
      for (int p = 0; p < num_ranks_; ++p)
        if (ch.streams[p] && !drain(ch.streams[p], timeout_s_))
          throw Error(ErrorCode::kTimeout,
                      "cuda_ipc engine: deregister_region(" + std::to_string(id) + "): rank " +
                          std::to_string(rank_) + "'s copies to rank " + std::to_string(p) +
                          " did not finish within " + std::to_string(timeout_s_) + " s");
  }
  comm_.barrier();
  Region& reg = regions_[id];
  for (int r = 0; r < num_ranks_; ++r) unmap_peer(reg, r, true);
  regions_[id] = Region{};
}

}  // namespace

std::unique_ptr<Engine> make_cuda_ipc_engine(Communicator& comm, int num_channels,
                                             std::vector<uint8_t> targets, bool cumem) {
  return std::make_unique<CudaIpcEngine>(comm, num_channels, std::move(targets), cumem);
}

bool cumem_regions(std::optional<bool> option, int ranks_on_device) {
  if (option) return *option;
  if (const auto set = env::proxy_cumem()) return *set;
  return ranks_on_device == 1 || ranks_on_device > kSharedContextRanks;
}

void* alloc_cumem_region(int device, std::size_t& bytes) {
  const Driver& d = driver();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::size_t granularity = 0;
  EPX_CU_CHECK(d.mem_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  bytes = (bytes + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  EPX_CU_CHECK(d.mem_create(&handle, bytes, &prop, 0));
  return reinterpret_cast<void*>(map_allocation(handle, bytes, granularity, device));
}

void free_cumem_region(void* p, std::size_t bytes) {
  if (!p) return;
  const auto va = reinterpret_cast<CUdeviceptr>(p);
  EPX_CU_CHECK(driver().mem_unmap(va, bytes));
  EPX_CU_CHECK(driver().mem_address_free(va, bytes));
}

}  // namespace epx::proxy
