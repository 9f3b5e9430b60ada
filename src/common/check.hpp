// common/check.hpp - every CUDA and NCCL call goes through these.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "epx/error.hpp"

namespace epx::detail {

[[noreturn]] void throw_cuda(cudaError_t err, const char* expr, const char* file, int line);
[[noreturn]] void throw_nccl(int err, const char* expr, const char* file, int line);

}  // namespace epx::detail

#define EPX_CUDA_CHECK(expr)                                                                     \
  do {                                                                                           \
    cudaError_t epx_err_ = (expr);                                                               \
    if (epx_err_ != cudaSuccess) ::epx::detail::throw_cuda(epx_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define EPX_NCCL_CHECK(expr)                                                           \
  do {                                                                                 \
    int epx_res_ = static_cast<int>(expr);                                             \
    if (epx_res_ != 0) ::epx::detail::throw_nccl(epx_res_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Checks the launch that just happened (configuration errors surface here).
#define EPX_LAUNCH_CHECK() EPX_CUDA_CHECK(cudaGetLastError())

#define EPX_INTERNAL_ASSERT(cond)                                                    \
  do {                                                                               \
    if (!(cond))                                                                     \
      throw ::epx::Error(::epx::ErrorCode::kInternal,                                \
                         std::string("assertion failed: " #cond " at ") + __FILE__); \
  } while (0)

namespace epx {
/// Makes `device` current; the previous device again on the way out.
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    EPX_CUDA_CHECK(cudaGetDevice(&previous));
    if (previous != device) EPX_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (previous >= 0) cudaSetDevice(previous);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};
}  // namespace epx
