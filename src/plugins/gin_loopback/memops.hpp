// plugins/gin_loopback/memops.hpp - the memory operations the loopback GIN
// plugin is written against: classify and export a registered range, import a
// peer's export, an asynchronous copy, a completion mark, and the read / write
// of a 64-bit word (the target applies signals with them).
//
// Two implementations are planned: the host one (memops_host.cpp, memfd
// shared memory, synchronous; what CI runs) and a CUDA one (cuMem POSIX-FD
// export / import, cudaMemcpyAsync and cuStreamWriteValue64 on per-peer
// streams; not written yet). Failures throw MemOpsError with a sentence that
// names the argument or peer; the plugin turns it into an NCCL result code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

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
  uint64_t alloc_bytes = 0;  ///< size of the whole allocation (exportable only)
  uint64_t offset = 0;       ///< data - allocation start (exportable only)
  int fd = -1;               ///< kExportable: a descriptor for the allocation, owned by the MemOps
};

class MemOps {
 public:
  virtual ~MemOps() = default;
  virtual const char* name() const = 0;
  /// The NCCL_PTR_* bits of ranges this implementation can register.
  virtual int ptr_support() const = 0;
  /// Classifies a range of this process registered with NCCL type `type`.
  virtual Export classify(void* data, std::size_t size, int type) = 0;
  /// Maps a peer's exportable allocation (`fd` received from it; the caller
  /// closes it afterwards); returns the address of the allocation's start.
  virtual void* import(int fd, uint64_t alloc_bytes, int peer) = 0;
  /// Undoes import().
  virtual void release(void* base, uint64_t alloc_bytes) = 0;
  /// Queues a copy on `peer`'s stream (effects in call order per peer).
  virtual void copy_async(int peer, void* dst, const void* src, std::size_t bytes) = 0;
  /// Stores `value` to `*word` once every earlier copy_async of `peer` is done.
  virtual void mark(int peer, uint64_t* word, uint64_t value) = 0;
  /// Acquire-loads a completion word written by mark().
  virtual uint64_t load_mark(const uint64_t* word) = 0;
  /// Reads / writes an 8-byte word of registered memory of this process
  /// (a signal: the target's applier is its only remote writer).
  virtual uint64_t read_word(const uint64_t* word) = 0;
  virtual void write_word(uint64_t* word, uint64_t value) = 0;
};

/// Host memory: exportable ranges are those inside an allocation made by
/// host_alloc_shared (a memfd mapped MAP_SHARED); every other NCCL_PTR_HOST
/// range is local-only; NCCL_PTR_CUDA is refused (this build has no CUDA
/// memops). Copies are memcpy, done when copy_async returns.
std::unique_ptr<MemOps> make_host_memops();

/// A memfd-backed allocation of `bytes` (zeroed) that host memops export;
/// what tests register as "windows". Throws MemOpsError on failure.
void* host_alloc_shared(std::size_t bytes);
/// Frees an allocation of host_alloc_shared (unknown pointer: MemOpsError).
void host_free_shared(void* base);

}  // namespace epx::gin_loop
