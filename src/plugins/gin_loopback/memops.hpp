// plugins/gin_loopback/memops.hpp - the memory operations the loopback GIN
// plugin is written against: classify and export a registered range, import a
// peer's export, an asynchronous copy, a completion mark per peer, and the
// target's read-modify-write of a signal word.
//
// One MemOps per collComm (made at connect): it owns the per-peer completion
// words and, with CUDA, the per-peer streams. Two implementations:
//  - host (memops_host.cpp): memfd shared memory, synchronous memcpy; what CI runs;
//  - CUDA (memops_cuda.cpp, built with EPX_GIN_LOOP_CUDA): GPU ranges go
//    through the driver (cuMem POSIX-FD export / import, cuMemcpyAsync and
//    cuStreamWriteValue64 on per-peer streams); host ranges keep the host
//    memops, so the choice is made per registered pointer (Export::device).
// Failures throw MemOpsError with a sentence that names the call and the peer;
// the plugin turns it into an NCCL result code (sticky on the collComm).
//
// Threading: the plugin calls copy_async / mark / completed / add_word / poll
// under its per-collComm mutex; classify / import / release may run
// concurrently with them (registration on the user thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace epx::gin_loop {

class MemOpsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// How peers may reach a registered range.
enum class RegionKind : uint32_t {
  kExportable = 0,  ///< backed by an allocation peers can map (memfd / cuMem POSIX FD)
  kLocalOnly = 1,   ///< only its own process may touch it (signal buffers, malloc'd inlines)
};
const char* to_string(RegionKind kind);

/// What classify() learns about [data, data + size).
struct Export {
  RegionKind kind = RegionKind::kLocalOnly;
  bool device = false;       ///< GPU memory: copies, imports and words go through CUDA
  uint64_t alloc_bytes = 0;  ///< size of the whole allocation (exportable only)
  uint64_t offset = 0;       ///< data - allocation start (exportable only)
  int fd = -1;               ///< kExportable: a descriptor for the allocation
  bool close_fd = false;     ///< the descriptor was made for this call: the caller closes it
};

/// One signal add at the target: *word += add (`device`: GPU memory).
struct WordAdd {
  uint64_t* word = nullptr;
  uint64_t add = 0;
  bool device = false;
};

/// Folds the adds to one word into its first entry's (the sum, wrapping as
/// the word does), keeping the words' first-seen order. Every add a target
/// applies at once has its put done, so the order they land in does not
/// matter; what matters is one read-modify-write per word instead of one
/// per add (an LL op adds to the same word once per row).
inline void merge_word_adds(std::vector<WordAdd>& adds) {
  std::size_t kept = 0;
  std::unordered_map<const uint64_t*, std::size_t> at;  // word -> its entry
  at.reserve(adds.size());
  for (std::size_t i = 0; i < adds.size(); ++i) {
    const auto [it, fresh] = at.try_emplace(adds[i].word, kept);
    if (fresh)
      adds[kept++] = adds[i];
    else
      adds[it->second].add += adds[i].add;
  }
  adds.resize(kept);
}

class MemOps {
 public:
  virtual ~MemOps() = default;
  virtual const char* name() const = 0;
  /// Classifies a range of this process registered with NCCL type `type`
  /// (NCCL_PTR_HOST or NCCL_PTR_CUDA); the user thread's call.
  virtual Export classify(void* data, std::size_t size, int type) = 0;
  /// Maps a peer's exportable allocation (`fd` received from it; the caller
  /// closes it afterwards; `device`: the peer's Export::device); returns the
  /// address of the allocation's start in this process.
  virtual void* import(int fd, uint64_t alloc_bytes, bool device, int peer) = 0;
  /// Undoes import() (waits for copies still in flight).
  virtual void release(void* base, uint64_t alloc_bytes, bool device) = 0;
  /// Queues a copy to `peer` (effects in call order per peer); `*_device`:
  /// that side is GPU memory (either: the CUDA path). The source may be reused
  /// once it returns (a small host source is staged).
  virtual void copy_async(int peer, void* dst, bool dst_device, const void* src, bool src_device,
                          std::size_t bytes) = 0;
  /// Makes completed(peer) reach `seq` once every earlier copy_async of `peer`
  /// is done (seq grows by one per request).
  virtual void mark(int peer, uint64_t seq) = 0;
  /// The last mark of `peer` known done (an acquire load; never a CUDA call).
  virtual uint64_t completed(int peer) = 0;
  /// *word += add, for an 8-byte signal word of this process (`device`: GPU
  /// memory); the target's applier is the only remote writer of such words.
  virtual void add_word(uint64_t* word, uint64_t add, bool device) = 0;
  /// Every add of `adds` (may reorder and merge them, and may change the
  /// vector); the CUDA memops read all GPU words back with one wait.
  virtual void add_words(std::vector<WordAdd>& adds) {
    for (const WordAdd& a : adds) add_word(a.word, a.add, a.device);
  }
  /// Throws the failure of an asynchronous operation, if any has been seen
  /// (rate-limited; called from the progress path).
  virtual void poll() {}
};

/// The NCCL_PTR_* bits this build registers: HOST, plus CUDA with EPX_GIN_LOOP_CUDA.
int memops_ptr_support();
/// The memops of one collComm of `nranks` ranks and `depth` requests per peer:
/// host memops, wrapped by the CUDA memops when they are built in (no CUDA
/// call happens until a GPU range is registered). `timeout_s` bounds every
/// wait the CUDA memops make for their streams (the plugin's deadline).
std::unique_ptr<MemOps> make_memops(int nranks, int depth, double timeout_s);

/// Host memory only: exportable ranges are those inside an allocation made by
/// host_alloc_shared (a memfd mapped MAP_SHARED); every other NCCL_PTR_HOST
/// range is local-only; NCCL_PTR_CUDA is refused. Copies are memcpy, done when
/// copy_async returns.
std::unique_ptr<MemOps> make_host_memops(int nranks);
/// The CUDA memops over `host` (which serves every host range).
std::unique_ptr<MemOps> make_cuda_memops(int nranks, int depth, std::unique_ptr<MemOps> host,
                                         double timeout_s);

/// A memfd-backed allocation of `bytes` (zeroed) that host memops export;
/// what tests register as "windows". Throws MemOpsError on failure.
void* host_alloc_shared(std::size_t bytes);
/// Frees an allocation of host_alloc_shared (unknown pointer: MemOpsError).
void host_free_shared(void* base);

}  // namespace epx::gin_loop
