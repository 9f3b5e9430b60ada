// LogFMT as the low-latency combine kernels put it on the wire, in a header
// so that tests/gpu/test_logfmt.cu checks these very functions against the
// CPU reference, bit for bit.
#pragma once

#include <cfloat>
#include <cstddef>
#include <cstdint>

#include "reference/logfmt_math.hpp"

namespace epx::kernels {

// ---- LogFMT on the wire -------------------------------------------------------
//
// The combine's rows cross in LogFMT: a 128-value group as 168 bytes (the
// reference's size, ref::logfmt_bytes) instead of 256, laid out for the 16
// lanes that hold it, 8 values each:
//   [0, 8)     the header: lmax, range (floats)
//   [8, 136)   16 x u64: lane i's codes 0..7, bits 0..63 of its 80-bit word
//   [136, 168) 16 x u16: bits 64..79 of lane i's word
// Code j of a lane is bits 10j..10j+9: sign (bit 9) | magnitude (bits 0..8),
// as the reference's codes. The values are the reference's bit for bit
// (ref::logfmt_decode(ref::logfmt_encode(.)) of the group); only the byte
// order of the codes differs from its bit stream.

inline constexpr int kLogFmtGroupBytes = 168;

/// Bytes of a row of `hidden` values on the wire (hidden % 128 == 0).
__host__ __device__ constexpr std::size_t logfmt_wire_bytes(int hidden) {
  return static_cast<std::size_t>(hidden / logfmt_math::kGroup) * kLogFmtGroupBytes;
}

/// What one lane reads of its group: its codes and the header.
struct LogFmtLane {
  uint64_t lo;
  uint32_t hi;
  float lmax, range;
};

/// Codes `v` (8 values of lane `li` = lane % 16 of the half-warp holding a
/// group) into the group's wire bytes at `group`; only lanes with `store` set
/// write (a half whose group lies past the row), but every lane of the warp
/// must call it (the extremes are shuffled across each half).
__device__ __forceinline__ void logfmt_store(const float (&v)[8], uint8_t* group, int li,
                                             bool store) {
  namespace lm = epx::logfmt_math;
  float amax = 0.0f, amin = INFINITY;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float a = fabsf(v[i]);
    const bool counts = a >= FLT_MIN;  // zero and float subnormals are coded as zero
    amax = fmaxf(amax, counts ? a : 0.0f);
    amin = fminf(amin, counts ? a : INFINITY);
  }
#pragma unroll
  for (int m = 8; m >= 1; m >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    amin = fminf(amin, __shfl_xor_sync(0xffffffffu, amin, m));
  }
  const lm::Group g = lm::group_of_extremes(amax, amin);
  uint64_t lo = 0;
  uint32_t hi = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t code = (signbit(v[i]) ? 0x200u : 0u) | lm::magnitude_code(g, fabsf(v[i]));
    const int bit = 10 * i;
    if (bit + 10 <= 64) {
      lo |= static_cast<uint64_t>(code) << bit;
    } else if (bit >= 64) {
      hi |= code << (bit - 64);
    } else {  // straddles: bits 60..69
      lo |= static_cast<uint64_t>(code) << bit;
      hi |= code >> (64 - bit);
    }
  }
  if (!store) return;
  if (li == 0) *reinterpret_cast<float2*>(group) = make_float2(g.lmax, g.range);
  reinterpret_cast<uint64_t*>(group + 8)[li] = lo;
  reinterpret_cast<uint16_t*>(group + 136)[li] = static_cast<uint16_t>(hi);
}

/// Lane `li`'s part of the group at `group` (written by another rank during
/// the op: loads past L1).
__device__ __forceinline__ LogFmtLane logfmt_load(const uint8_t* group, int li) {
  LogFmtLane w;
  const float2 h = __ldcg(reinterpret_cast<const float2*>(group));
  w.lmax = h.x;
  w.range = h.y;
  w.lo = __ldcg(reinterpret_cast<const unsigned long long*>(group + 8) + li);
  w.hi = __ldcg(reinterpret_cast<const unsigned short*>(group + 136) + li);
  return w;
}

/// The 8 values of a lane's part.
__device__ __forceinline__ void logfmt_decode(const LogFmtLane& w, float (&v)[8]) {
  namespace lm = epx::logfmt_math;
  const lm::Group g = lm::group_of_header(w.lmax, w.range);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int bit = 10 * i;
    uint32_t code;
    if (bit + 10 <= 64)
      code = static_cast<uint32_t>(w.lo >> bit) & 0x3FFu;
    else if (bit >= 64)
      code = (w.hi >> (bit - 64)) & 0x3FFu;
    else
      code = (static_cast<uint32_t>(w.lo >> bit) | (w.hi << (64 - bit))) & 0x3FFu;
    const float out = lm::magnitude_of_code(g, code & 0x1FFu);
    v[i] = (code & 0x200u) ? -out : out;
  }
}

}  // namespace epx::kernels
