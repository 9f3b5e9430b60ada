// transport/proxy/engine.hpp - what carries a proxy's commands to the peers.
//
// An engine owns the endpoints (one per (channel, peer)), the registration of
// this rank's regions with every peer it reaches, and completion tracking. The
// proxy threads call it; engines for other fabrics (libfabric: EFA, verbs,
// tcp; ibverbs RC with several QPs and ports) implement the same interface.
//
// Threading: register_region / deregister_region are collective over the
// group and are called while no proxy thread runs. Every per-channel call
// (put, signal_add, mark, completed) for channel c comes from the one thread
// that serves c; calls for different channels may run concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace epx {
class Communicator;
}

namespace epx::proxy {

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  virtual int num_channels() const = 0;

  /// Collective: this rank's region `id` (< kMaxRegions) is [base, base + bytes);
  /// afterwards commands may name `id` at any peer this engine reaches (every
  /// rank registers the same ids with the same sizes).
  virtual void register_region(int id, void* base, std::size_t bytes) = 0;
  /// Collective: undoes register_region (no command naming `id` is in flight).
  virtual void deregister_region(int id) = 0;
  /// Whether `peer` can be reached at all (false: the command is refused with
  /// an error that names the peer).
  virtual bool reaches(int peer) const = 0;
  /// The address of `peer`'s region `id` in this process where the engine has
  /// it mapped for loads and stores (CUDA IPC on one host), else nullptr.
  virtual void* mapped(int /*id*/, int /*peer*/) const { return nullptr; }

  /// Starts copying `bytes` from this rank's region at `src_off` to `peer`'s
  /// region at `dst_off`. Asynchronous; effects on one (channel, peer)
  /// endpoint happen in call order. Throws epx::Error on a bad argument (an
  /// offset past the region, an unreachable peer) or an engine failure.
  virtual void put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
                   uint64_t bytes) = 0;
  /// Throws what put would throw for these arguments (a bad channel, an
  /// unreachable peer, an unregistered region, a range out of bounds) and
  /// copies nothing: whoever holds puts back to merge them (the Coalescer)
  /// checks each one first, so that out-of-bounds puts cannot merge into an
  /// in-bounds copy.
  virtual void check_put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
                         uint64_t bytes) const = 0;
  /// `rows` puts of `width` bytes each: row i from `src_off + i * src_pitch`
  /// to `dst_off + i * dst_pitch` (pitches >= width), in any order among
  /// themselves, ordered like one put with the endpoint's other calls.
  /// Engines with a strided copy override it; the default puts row by row.
  virtual void put_strided(int channel, int peer, int region, uint64_t dst_off, uint64_t dst_pitch,
                           uint64_t src_off, uint64_t src_pitch, uint64_t width, uint64_t rows) {
    for (uint64_t i = 0; i < rows; ++i)
      put(channel, peer, region, dst_off + i * dst_pitch, src_off + i * src_pitch, width);
  }
  /// Adds `add` to the 8-byte signal word at `sig_off` of `peer`'s region,
  /// after every earlier put of this (channel, peer) endpoint has landed.
  /// A signal word is written by one (rank, channel) only: the device
  /// transport gives each source rank and channel its own word.
  virtual void signal_add(int channel, int peer, int region, uint64_t sig_off, uint64_t add) = 0;
  /// Collective, no command in flight: the signal words of region `id` were
  /// zeroed on every rank; an engine that keeps state about them resets it.
  virtual void reset_signals(int id) = 0;
  /// Marks the commands of `channel` issued so far with `token` (increasing).
  virtual void mark(int channel, uint64_t token) = 0;
  /// The largest token whose marked commands have all completed (0: none).
  /// Non-blocking.
  virtual uint64_t completed(int channel) = 0;
  /// What most likely held one of this engine's calls for seconds, and what
  /// to do about it (a timeout's message adds it), or "".
  virtual std::string held_call_cause() const { return {}; }
};

/// CUDA IPC (one host): each region is exported (cudaIpcGetMemHandle; ranks
/// that are threads of one process swap pointers instead) and mapped by every
/// other rank of the host; a put is a cudaMemcpyAsync on the endpoint's own
/// stream, a signal a stream-ordered write (cuStreamWriteValue64) of the
/// signal word's running total after it. Refuses, naming them, peers on
/// another host. Regions must be cudaMalloc'd device memory (cuMem ones from
/// alloc_cumem_region where `cumem`). `targets`
/// (empty: every rank; else one entry per rank): the peers commands may name,
/// the only ones that get a stream per channel (others are refused). `cumem`:
/// the regions are cuMem ones and the engine's streams live in a CUDA context
/// of its own (cumem_regions says which the backend chose).
std::unique_ptr<Engine> make_cuda_ipc_engine(Communicator& comm, int num_channels,
                                             std::vector<uint8_t> targets, bool cumem);

/// In-process ranks up to this many per device share the primary context with
/// the proxy's copies by default. Measured on one H100 (docs/benchmarks.md):
/// at 4 ranks as 2x2 the engine's own context makes a low-latency op about 4x
/// slower (the GPU time-slices between the two contexts); at 16 ranks as 4x4
/// the primary context's copies queue behind kernels that wait for them and
/// the combine of a late rank's step stalls, which the own context avoids.
inline constexpr int kSharedContextRanks = 4;

/// Whether the CUDA IPC engine wants cuMem regions (and its own context):
/// `option` (BufferOptions::proxy_cumem) when set, else EPX_PROXY_CUMEM when
/// set, else yes for a process per rank (ranks_on_device 1) and for more than
/// kSharedContextRanks in-process ranks on the device. The backend then
/// allocates them with alloc_cumem_region instead of cudaMalloc, and passes
/// the same choice to make_cuda_ipc_engine.
bool cumem_regions(std::optional<bool> option, int ranks_on_device);
/// Device memory on `device` that the engine exports as a POSIX file
/// descriptor: `bytes` is rounded up to the allocation granularity (the size
/// to register and to free).
void* alloc_cumem_region(int device, std::size_t& bytes);
void free_cumem_region(void* p, std::size_t bytes);

}  // namespace epx::proxy
