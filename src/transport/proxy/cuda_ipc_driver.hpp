// transport/proxy/cuda_ipc_driver.hpp - the CUDA driver calls the CUDA IPC
// engine makes (cuda_ipc_engine.cpp), looked up through the runtime so that
// libepx needs no -lcuda at link time: the entry points, a checked call, the
// current-context scope, cuMem mapping and import, and the contexts in-process
// ranks of a device share.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstddef>

namespace epx::proxy::cuda_ipc {

/// Driver functions the runtime does not wrap, looked up through the runtime
/// so that the library needs no -lcuda at link time.
struct Driver {
  PFN_cuStreamWriteValue64_v11070 stream_write_value64 = nullptr;
  PFN_cuMemGetAddressRange_v3020 mem_get_address_range = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuCtxCreate_v11040 ctx_create = nullptr;  // the 12.0 flavour: with affinity parameters
  PFN_cuCtxDestroy_v4000 ctx_destroy = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
  PFN_cuCtxSetCurrent_v4000 ctx_set_current = nullptr;
  // cuMem regions (EPX_PROXY_CUMEM)
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemRetainAllocationHandle_v11000 mem_retain = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import = nullptr;
};

/// The entry points, looked up once (epx::Error kUnsupported naming one the
/// driver does not provide).
const Driver& driver();

/// Throws epx::Error(kCuda) naming the driver error, `expr` and where.
void check_cu(CUresult r, const char* expr, const char* file, int line);
#define EPX_CU_CHECK(expr) ::epx::proxy::cuda_ipc::check_cu((expr), #expr, __FILE__, __LINE__)

/// Makes `ctx` current on this thread (nothing when it is null); with
/// `restore`, the thread's previous context again at the end of the scope.
class ContextScope {
 public:
  ContextScope(CUcontext ctx, bool restore) {
    if (!ctx) return;
    EPX_CU_CHECK(driver().ctx_get_current(&previous_));
    if (previous_ == ctx) return;
    EPX_CU_CHECK(driver().ctx_set_current(ctx));
    restore_ = restore;
  }
  ~ContextScope() {
    if (restore_) driver().ctx_set_current(previous_);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool restore_ = false;
};

/// Read-write access to [va, va + bytes) for `device`.
void grant_access(CUdeviceptr va, std::size_t bytes, int device);
/// Maps all `bytes` of the cuMem allocation `handle` at an address aligned
/// to `alignment` (0: the granularity) for `device`, then releases the
/// handle: the mapping keeps the allocation alive. On failure nothing is
/// left mapped or reserved and the handle is released too.
CUdeviceptr map_allocation(CUmemGenericAllocationHandle handle, std::size_t bytes,
                           std::size_t alignment, int device);
/// Maps the cuMem allocation behind `fd` (a peer's export, `bytes` long) for
/// `device`. Returns its address.
CUdeviceptr import_cumem(int fd, std::size_t bytes, int device);

/// A CUDA context of `dev` for an engine's streams and calls; the calling
/// thread's current context is left as it was.
CUcontext create_context(CUdevice dev);
/// The context the engines of in-process ranks on one device share, made by
/// the first and destroyed with the last.
CUcontext acquire_shared_context(CUdevice dev);
void release_shared_context(CUcontext ctx);

}  // namespace epx::proxy::cuda_ipc
