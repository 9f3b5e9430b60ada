// kernels/bf16.cuh - BF16 packing of the high-throughput combines: eight
// channels (one 16-byte vector) summed in float32 and rounded back.
#pragma once

#include <cstdint>

namespace epx::kernels {

/// Adds the eight BF16 channels of `v` to `acc`.
__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[8], const int4& v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                         static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += __uint_as_float(w[i] << 16);
    acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint32_t f32_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return u >> 16;
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  int4 o;
  o.x = static_cast<int>(f32_to_bf16_bits(acc[0]) | (f32_to_bf16_bits(acc[1]) << 16));
  o.y = static_cast<int>(f32_to_bf16_bits(acc[2]) | (f32_to_bf16_bits(acc[3]) << 16));
  o.z = static_cast<int>(f32_to_bf16_bits(acc[4]) | (f32_to_bf16_bits(acc[5]) << 16));
  o.w = static_cast<int>(f32_to_bf16_bits(acc[6]) | (f32_to_bf16_bits(acc[7]) << 16));
  return o;
}

}  // namespace epx::kernels
