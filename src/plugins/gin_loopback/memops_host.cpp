// plugins/gin_loopback/memops_host.cpp - MemOps over host shared memory.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

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
  const char* name() const override { return "host"; }
  int ptr_support() const override { return NCCL_PTR_HOST; }

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
      if (p >= it->first && p + size <= it->first + it->second.bytes)
        return Export{RegionKind::kExportable, it->second.bytes, p - it->first, it->second.fd};
    }
    return Export{};
  }

  void* import(int fd, uint64_t alloc_bytes, int peer) override {
    void* p = mmap(nullptr, alloc_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      throw MemOpsError("mapping rank " + std::to_string(peer) + "'s allocation of " +
                        std::to_string(alloc_bytes) + " bytes failed: " + errno_text(errno));
    return p;
  }
  void release(void* base, uint64_t alloc_bytes) override { munmap(base, alloc_bytes); }

  void copy_async(int, void* dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void mark(int, uint64_t* word, uint64_t value) override {
    std::atomic_ref<uint64_t>(*word).store(value, std::memory_order_release);
  }
  uint64_t load_mark(const uint64_t* word) override {
    return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(word)).load(std::memory_order_acquire);
  }
  uint64_t read_word(const uint64_t* word) override {
    return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(word)).load(std::memory_order_acquire);
  }
  void write_word(uint64_t* word, uint64_t value) override {
    std::atomic_ref<uint64_t>(*word).store(value, std::memory_order_release);
  }
};

}  // namespace

std::unique_ptr<MemOps> make_host_memops() {
  return std::make_unique<HostMemOps>();
}

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
