// kernels/copy.cuh - the warp copy loop of the high-throughput kernels, in
// a header of its own so that bench/nvlink_probe.cu measures the same loop.
#pragma once

#include "common/device.cuh"

namespace epx::kernels {

template <bool kCoherent>
__device__ __forceinline__ int4 load16(const int4* p) {
  if constexpr (kCoherent) {
    return dev::ld_l2(p);
  } else {
    return dev::ld_nc(p);
  }
}

/// Warp-cooperative copy of `bytes` (multiple of 16). Software-pipelined: each
/// lane keeps kU vectors in flight, loading the next batch's vector right
/// after storing the current one; the tail (< 32 * kU vectors) is loaded in
/// full before it is stored, so a row costs about one memory latency per
/// batch. kCoherent: the source is written by peers during the kernel
/// (L2-coherent loads, kept after the flag wait); otherwise read-only loads.
template <bool kCoherent, int kU>
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
  auto* d = reinterpret_cast<int4*>(dst);
  auto* s = reinterpret_cast<const int4*>(src);
  const int n = bytes / 16;
  const int full = n / (32 * kU) * (32 * kU);
  int4 v[kU];
  if (full > 0) {
#pragma unroll
    for (int u = 0; u < kU; ++u) v[u] = load16<kCoherent>(s + lane + 32 * u);
  }
  for (int i = 0; i < full; i += 32 * kU) {
    const bool more = i + 32 * kU < full;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      dev::st_na(d + i + lane + 32 * u, v[u]);
      if (more) v[u] = load16<kCoherent>(s + i + 32 * kU + lane + 32 * u);
    }
  }
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (full + lane + 32 * u < n) v[u] = load16<kCoherent>(s + full + lane + 32 * u);
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (full + lane + 32 * u < n) dev::st_na(d + full + lane + 32 * u, v[u]);
}

}  // namespace epx::kernels
