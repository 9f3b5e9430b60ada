// The LogFMT round trip of the low-latency combine kernels, in a header so
// that tests/gpu/test_logfmt.cu checks this very function against the CPU
// reference, bit for bit.
#pragma once

#include <cfloat>

#include "reference/logfmt_math.hpp"

namespace epx::kernels {

/// logfmt_decode(logfmt_encode(.)) of one 128-value group held as 8 values by
/// each of 16 consecutive lanes (lanes 0-15 and 16-31 are two groups). Every
/// lane of the warp must call it. The arithmetic is the reference's
/// (reference/logfmt_math.hpp, float operations only), so for finite values
/// the results are the same bits as ref::logfmt_decode(ref::logfmt_encode(.));
/// NaN becomes a signed zero and infinity FLT_MAX (the reference throws).
__device__ __forceinline__ void logfmt_roundtrip(float* v) {
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
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float out = lm::magnitude_of_code(g, lm::magnitude_code(g, fabsf(v[i])));
    v[i] = signbit(v[i]) ? -out : out;
  }
}

}  // namespace epx::kernels
