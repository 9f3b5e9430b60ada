// transport/proxy/cuda_ipc_driver.cpp - cuda_ipc_driver.hpp's definitions.
#include "transport/proxy/cuda_ipc_driver.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "common/check.hpp"
#include "epx/error.hpp"

namespace epx::proxy::cuda_ipc {

namespace {

void* driver_entry_point(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  // The CUDA 12.0 flavour of each symbol (cuStreamWriteValue64_v2 and so on).
  EPX_CUDA_CHECK(cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr)
    throw Error(ErrorCode::kUnsupported,
                std::string("cuda_ipc engine: the CUDA driver does not provide ") + symbol);
  return fn;
}

}  // namespace

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    x.stream_write_value64 = reinterpret_cast<PFN_cuStreamWriteValue64_v11070>(
        driver_entry_point("cuStreamWriteValue64"));
    x.mem_get_address_range = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(
        driver_entry_point("cuMemGetAddressRange"));
    x.get_error_name =
        reinterpret_cast<PFN_cuGetErrorName_v6000>(driver_entry_point("cuGetErrorName"));
    x.device_get = reinterpret_cast<PFN_cuDeviceGet_v2000>(driver_entry_point("cuDeviceGet"));
    x.device_get_attribute = reinterpret_cast<PFN_cuDeviceGetAttribute_v2000>(
        driver_entry_point("cuDeviceGetAttribute"));
    x.ctx_create = reinterpret_cast<PFN_cuCtxCreate_v11040>(driver_entry_point("cuCtxCreate"));
    x.ctx_destroy = reinterpret_cast<PFN_cuCtxDestroy_v4000>(driver_entry_point("cuCtxDestroy"));
    x.ctx_get_current =
        reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(driver_entry_point("cuCtxGetCurrent"));
    x.ctx_set_current =
        reinterpret_cast<PFN_cuCtxSetCurrent_v4000>(driver_entry_point("cuCtxSetCurrent"));
#define EPX_CU_ENTRY(member, type, symbol) \
  x.member = reinterpret_cast<type>(driver_entry_point(symbol))
    EPX_CU_ENTRY(mem_create, PFN_cuMemCreate_v10020, "cuMemCreate");
    EPX_CU_ENTRY(mem_granularity, PFN_cuMemGetAllocationGranularity_v10020,
                 "cuMemGetAllocationGranularity");
    EPX_CU_ENTRY(mem_reserve, PFN_cuMemAddressReserve_v10020, "cuMemAddressReserve");
    EPX_CU_ENTRY(mem_address_free, PFN_cuMemAddressFree_v10020, "cuMemAddressFree");
    EPX_CU_ENTRY(mem_map, PFN_cuMemMap_v10020, "cuMemMap");
    EPX_CU_ENTRY(mem_unmap, PFN_cuMemUnmap_v10020, "cuMemUnmap");
    EPX_CU_ENTRY(mem_set_access, PFN_cuMemSetAccess_v10020, "cuMemSetAccess");
    EPX_CU_ENTRY(mem_release, PFN_cuMemRelease_v10020, "cuMemRelease");
    EPX_CU_ENTRY(mem_retain, PFN_cuMemRetainAllocationHandle_v11000, "cuMemRetainAllocationHandle");
    EPX_CU_ENTRY(mem_export, PFN_cuMemExportToShareableHandle_v10020,
                 "cuMemExportToShareableHandle");
    EPX_CU_ENTRY(mem_import, PFN_cuMemImportFromShareableHandle_v10020,
                 "cuMemImportFromShareableHandle");
#undef EPX_CU_ENTRY
    return x;
  }();
  return d;
}

void check_cu(CUresult r, const char* expr, const char* file, int line) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (driver().get_error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown";
  throw Error(ErrorCode::kCuda, std::string("CUDA driver error ") + name + " (" +
                                    std::to_string(static_cast<int>(r)) + ") in " + expr + " at " +
                                    file + ":" + std::to_string(line));
}

/// Read-write access to [va, va + bytes) for `device`.
void grant_access(CUdeviceptr va, std::size_t bytes, int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EPX_CU_CHECK(driver().mem_set_access(va, bytes, &access, 1));
}

/// Maps all `bytes` of the cuMem allocation `handle` at an address aligned
/// to `alignment` (0: the granularity) for `device`, then releases the
/// handle: the mapping keeps the allocation alive. On failure nothing is
/// left mapped or reserved and the handle is released too.
CUdeviceptr map_allocation(CUmemGenericAllocationHandle handle, std::size_t bytes,
                           std::size_t alignment, int device) {
  const Driver& d = driver();
  CUdeviceptr va = 0;
  bool mapped = false;
  try {
    EPX_CU_CHECK(d.mem_reserve(&va, bytes, alignment, 0, 0));
    EPX_CU_CHECK(d.mem_map(va, bytes, 0, handle, 0));
    mapped = true;
    grant_access(va, bytes, device);
  } catch (...) {
    if (mapped) d.mem_unmap(va, bytes);
    if (va) d.mem_address_free(va, bytes);
    d.mem_release(handle);
    throw;
  }
  EPX_CU_CHECK(d.mem_release(handle));
  return va;
}

/// Maps the cuMem allocation behind `fd` (a peer's export, `bytes` long) for
/// `device`. Returns its address.
CUdeviceptr import_cumem(int fd, std::size_t bytes, int device) {
  CUmemGenericAllocationHandle handle = 0;
  EPX_CU_CHECK(driver().mem_import(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  return map_allocation(handle, bytes, 0, device);
}

/// A CUDA context of `dev` for an engine's streams and calls; the calling
/// thread's current context is left as it was.
CUcontext create_context(CUdevice dev) {
  CUcontext previous = nullptr, ctx = nullptr;
  EPX_CU_CHECK(driver().ctx_get_current(&previous));
  EPX_CU_CHECK(driver().ctx_create(&ctx, nullptr, 0, 0, dev));
  EPX_CU_CHECK(driver().ctx_set_current(previous));  // ctx_create made it current
  return ctx;
}

namespace {

/// The context the engines of in-process ranks on one device share, made by
/// the first and destroyed with the last.
struct SharedContexts {
  std::mutex mutex;
  std::unordered_map<CUdevice, std::pair<CUcontext, int>> by_device;  ///< context, users
};
SharedContexts& shared_contexts() {
  static SharedContexts* all = new SharedContexts;  // never destroyed: engines may outlive statics
  return *all;
}

}  // namespace

CUcontext acquire_shared_context(CUdevice dev) {
  SharedContexts& all = shared_contexts();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto& entry = all.by_device[dev];
  if (entry.second == 0) entry.first = create_context(dev);
  ++entry.second;
  return entry.first;
}
void release_shared_context(CUcontext ctx) {
  SharedContexts& all = shared_contexts();
  std::lock_guard<std::mutex> lock(all.mutex);
  for (auto it = all.by_device.begin(); it != all.by_device.end(); ++it) {
    if (it->second.first != ctx) continue;
    if (--it->second.second == 0) {
      driver().ctx_destroy(ctx);
      all.by_device.erase(it);
    }
    return;
  }
}

}  // namespace epx::proxy::cuda_ipc
