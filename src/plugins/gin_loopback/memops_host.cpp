// plugins/gin_loopback/memops_host.cpp - MemOps over host shared memory (the
// memfd windows of the CPU tests, malloc'd inline values), and the host-only
// build's make_memops.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "plugins/gin_loopback/abi.hpp"
#include "plugins/gin_loopback/memops.hpp"

namespace epx::gin_loop {

const char* to_string(RegionKind kind) {
  return kind == RegionKind::kExportable ? "exportable" : "local-only";
}

namespace {

struct SharedAlloc {
  std::size_t bytes = 0;
  int fd = -1;
};

// Process-wide table of host_alloc_shared allocations, by start address.
std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}
std::map<uintptr_t, SharedAlloc>& table() {
  static std::map<uintptr_t, SharedAlloc> t;
  return t;
}

std::string errno_text(int e) {
  return std::string(std::strerror(e));
}

class HostMemOps final : public MemOps {
 public:
  explicit HostMemOps(int nranks) : done_(static_cast<std::size_t>(nranks), 0) {}
  const char* name() const override { return "host"; }

  Export classify(void* data, std::size_t size, int type) override {
    if (type == NCCL_PTR_CUDA)
      throw MemOpsError(
          "type NCCL_PTR_CUDA: this build of the plugin has host memops only (no CUDA memops); "
          "register host memory with NCCL_PTR_HOST");
    if (type != NCCL_PTR_HOST)
      throw MemOpsError("type " + std::to_string(type) + " is not NCCL_PTR_HOST (" +
                        std::to_string(NCCL_PTR_HOST) + ")");
    const auto p = reinterpret_cast<uintptr_t>(data);
    std::lock_guard lock(table_mutex());
    auto it = table().upper_bound(p);
    if (it != table().begin()) {
      --it;
      if (p >= it->first && p + size <= it->first + it->second.bytes) {
        Export ex;
        ex.kind = RegionKind::kExportable;
        ex.alloc_bytes = it->second.bytes;
        ex.offset = p - it->first;
        ex.fd = it->second.fd;  // the table's: stays open
        return ex;
      }
    }
    return Export{};
  }

  void* import(int fd, uint64_t alloc_bytes, bool device, int peer) override {
    if (device)
      throw MemOpsError("rank " + std::to_string(peer) +
                        " registered GPU memory; this build has host memops only");
    // The descriptor is the peer's: it must hold what the peer says it does
    // (a mapping past its end faults at first use, not here).
    struct stat st {};
    if (fstat(fd, &st) != 0)
      throw MemOpsError("fstat of rank " + std::to_string(peer) +
                        "'s allocation failed: " + errno_text(errno));
    if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) < alloc_bytes)
      throw MemOpsError("rank " + std::to_string(peer) + " sent a descriptor of " +
                        std::to_string(st.st_size) + " bytes for an allocation of " +
                        std::to_string(alloc_bytes) + " bytes");
    void* p = mmap(nullptr, alloc_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      throw MemOpsError("mapping rank " + std::to_string(peer) + "'s allocation of " +
                        std::to_string(alloc_bytes) + " bytes failed: " + errno_text(errno));
    return p;
  }
  void release(void* base, uint64_t alloc_bytes, bool) override { munmap(base, alloc_bytes); }

  void copy_async(int, void* dst, bool dst_device, const void* src, bool src_device,
                  std::size_t bytes) override {
    if (dst_device || src_device) throw MemOpsError("a GPU copy reached the host memops");
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void mark(int peer, uint64_t seq) override {
    std::atomic_ref<uint64_t>(done_[static_cast<std::size_t>(peer)])
        .store(seq, std::memory_order_release);
  }
  uint64_t completed(int peer) override {
    return std::atomic_ref<uint64_t>(done_[static_cast<std::size_t>(peer)])
        .load(std::memory_order_acquire);
  }
  void add_word(uint64_t* word, uint64_t add, bool device) override {
    if (device) throw MemOpsError("a GPU signal word reached the host memops");
    std::atomic_ref<uint64_t> w(*word);
    w.store(w.load(std::memory_order_acquire) + add, std::memory_order_release);
  }

 private:
  std::vector<uint64_t> done_;  ///< per peer: the last mark
};

}  // namespace

std::unique_ptr<MemOps> make_host_memops(int nranks) {
  return std::make_unique<HostMemOps>(nranks);
}

#ifndef EPX_GIN_LOOP_CUDA
int memops_ptr_support() {
  return NCCL_PTR_HOST;
}
std::unique_ptr<MemOps> make_memops(int nranks, int, double) {
  return make_host_memops(nranks);
}
#endif

void* host_alloc_shared(std::size_t bytes) {
  if (bytes == 0) throw MemOpsError("host_alloc_shared: bytes must be > 0");
  const int fd = memfd_create("epx-gin-loop", MFD_CLOEXEC);
  if (fd < 0) throw MemOpsError("host_alloc_shared: memfd_create failed: " + errno_text(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    close(fd);
    throw MemOpsError("host_alloc_shared: ftruncate(" + std::to_string(bytes) +
                      ") failed: " + errno_text(e));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    close(fd);
    throw MemOpsError("host_alloc_shared: mmap of " + std::to_string(bytes) +
                      " bytes failed: " + errno_text(e));
  }
  std::lock_guard lock(table_mutex());
  table()[reinterpret_cast<uintptr_t>(p)] = SharedAlloc{bytes, fd};
  return p;
}

void host_free_shared(void* base) {
  SharedAlloc a;
  {
    std::lock_guard lock(table_mutex());
    auto it = table().find(reinterpret_cast<uintptr_t>(base));
    if (it == table().end())
      throw MemOpsError("host_free_shared: pointer was not returned by host_alloc_shared");
    a = it->second;
    table().erase(it);
  }
  munmap(base, a.bytes);
  close(a.fd);
}

}  // namespace epx::gin_loop
