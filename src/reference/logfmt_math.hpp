// LogFMT arithmetic shared by the CPU reference (src/reference/logfmt.cpp) and
// the combine kernels (src/kernels/low_latency.cu), so both produce the same
// bits. Only IEEE-754 float operations with one rounding each are used (add,
// sub, mul, div, fma, floor, exact bit manipulation): every a * b + c is an
// explicit fma and every other operation goes through the helpers below.
// A host caller that passes a product straight into these functions could
// still have it fused after inlining (GCC contracts across inlined calls on
// FMA hardware), so every host target that includes this header is built
// with -ffp-contract=off (epx_reference, the tests). log2 and exp2 are
// polynomials (coefficients fitted for EPX), not the math libraries', whose
// results differ between libm and CUDA.
//
// Accuracy (checked by tests/unit/test_reference.cpp: log2 over every
// mantissa of 13 binades, exp2 in steps of 2^-12 and at random points):
// |log2_approx(a) - log2(a)| <= kLog2AbsError for normal a (polynomial error
// below 3e-6 plus the rounding of e + log2(m), at most 2^-18 for |e| <= 128);
// |exp2_approx(x) / 2^x - 1| <= kExp2RelError for results in the normal range.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define EPX_LOGFMT_HD __host__ __device__ __forceinline__
#else
#define EPX_LOGFMT_HD inline
#endif

namespace epx::logfmt_math {

constexpr int kGroup = 128;
constexpr float kSteps = 510.0f;    // intervals between lmin and lmax
constexpr float kMaxRange = 16.0f;  // largest log2 dynamic range kept per group
constexpr double kLog2AbsError = 0x1p-16;
constexpr double kExp2RelError = 0x1p-21;

// add, sub, mul, div: one IEEE operation, rounded to nearest, never fused.
#if defined(__CUDA_ARCH__)
#define EPX_LOGFMT_OP(name, intrinsic, op)     \
  EPX_LOGFMT_HD float name(float a, float b) { \
    return intrinsic(a, b);                    \
  }
#else
#define EPX_LOGFMT_OP(name, intrinsic, op)     \
  EPX_LOGFMT_HD float name(float a, float b) { \
    return a op b;                             \
  }
#endif
EPX_LOGFMT_OP(add, __fadd_rn, +)
EPX_LOGFMT_OP(sub, __fsub_rn, -)
EPX_LOGFMT_OP(mul, __fmul_rn, *)
EPX_LOGFMT_OP(div, __fdiv_rn, /)
#undef EPX_LOGFMT_OP

EPX_LOGFMT_HD float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
/// The bits of one 4-byte type as another (memcpy: registers only, also on the device).
template <class To, class From>
EPX_LOGFMT_HD To bit_as(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}
EPX_LOGFMT_HD uint32_t bits_of(float f) {
  return bit_as<uint32_t>(f);
}
EPX_LOGFMT_HD float float_of(uint32_t u) {
  return bit_as<float>(u);
}

/// log2(a) for a normal, positive, finite float: a = 2^e * m with m in
/// [sqrt(1/2), sqrt(2)), log2(m) = r * q(r) with r = m - 1 (exact) and q of
/// degree 5. Any input gives a finite result (the kernels rely on it).
EPX_LOGFMT_HD float log2_approx(float a) {
  const uint32_t u = bits_of(a);
  // e = floor(log2(a / sqrt(1/2))) from the bits; subtracting it from the
  // exponent field leaves m in [sqrt(1/2), sqrt(2)).
  const int e = static_cast<int32_t>(u - 0x3F3504F4u) >> 23;
  const float r = sub(float_of(u - (static_cast<uint32_t>(e) << 23)), 1.0f);
  float q = -2.052982897e-01f;
  q = fma(q, r, 3.220854998e-01f);
  q = fma(q, r, -3.677039742e-01f);
  q = fma(q, r, 4.793243706e-01f);
  q = fma(q, r, -7.211225629e-01f);
  q = fma(q, r, 1.442715764e+00f);
  return fma(q, r, static_cast<float>(e));
}

/// 2^n for an integer n in [-126, 127], exactly.
EPX_LOGFMT_HD float pow2i(int n) {
  return float_of(static_cast<uint32_t>(n + 127) << 23);
}

/// 2^x for x in [-252, 254]: 2^n * p(f) with n = floor(x + 1/2) and f = x - n
/// in [-1/2, 1/2] (exact). The scaling is two exact-or-once-rounded products,
/// so subnormal results round once and results past FLT_MAX become inf.
/// Branch-free (selects only), as the kernels want it.
EPX_LOGFMT_HD float exp2_approx(float x) {
  const float n = floorf(add(x, 0.5f));
  const float f = sub(x, n);
  float p = 1.321867225e-03f;  // 2^f = 1 + f * p(f): exact at f = 0
  p = fma(p, f, 9.671698324e-03f);
  p = fma(p, f, 5.550893024e-02f);
  p = fma(p, f, 2.402223796e-01f);
  p = fma(p, f, 6.931468844e-01f);
  p = fma(p, f, 1.0f);
  const int ni = static_cast<int>(n);
  const int n1 = ni >> 1, n2 = ni - n1;  // floor(ni / 2); both in [-126, 127] for x in range
  return mul(mul(p, pow2i(n1)), pow2i(n2));
}

/// What a group's header determines: lmin = lmax - range, the step between
/// levels and its inverse (0 for a zero range).
struct Group {
  float lmax = 0.0f, range = 0.0f;
  float lmin = 0.0f, step = 0.0f, inv_step = 0.0f;
  bool clamped = false;  ///< the group's magnitudes spanned more than kMaxRange (encoder only)
};

EPX_LOGFMT_HD Group group_of_header(float lmax, float range) {
  Group g;
  g.lmax = lmax;
  g.range = range;
  g.lmin = sub(lmax, range);
  g.step = div(range, kSteps);
  g.inv_step = range > 0.0f ? div(kSteps, range) : 0.0f;
  return g;
}

/// The encoder's header of a group whose largest and smallest magnitudes of
/// at least FLT_MIN are amax and amin (amax = 0: no such value).
EPX_LOGFMT_HD Group group_of_extremes(float amax, float amin) {
  if (!(amax > 0.0f)) return group_of_header(0.0f, 0.0f);
  const float lmax = log2_approx(amax);
  const float full = sub(lmax, log2_approx(amin));
  const bool clamped = full > kMaxRange;
  Group g = group_of_header(lmax, clamped ? kMaxRange : (full > 0.0f ? full : 0.0f));
  g.clamped = clamped;
  return g;
}

/// Magnitude code 0..511 of |x| = a: 0 for zero, float subnormals and (in a
/// clamped group) values more than half a step below 2^lmin. Branch-free: the
/// log is taken of every a (finite garbage for a < FLT_MIN, not used), and a
/// zero range gives inv_step = 0, so q = 0.
EPX_LOGFMT_HD unsigned magnitude_code(const Group& g, float a) {
  float q = floorf(fma(sub(log2_approx(a), g.lmin), g.inv_step, 0.5f));
  q = q < kSteps ? q : kSteps;
  const unsigned below = g.clamped ? 0u : 1u;  // q < 0
  const unsigned m = q < 0.0f ? below : static_cast<unsigned>(q) + 1u;
  return a >= FLT_MIN ? m : 0u;
}

/// The magnitude that code m stands for: 2^(lmin + (m - 1) step), at most
/// FLT_MAX. Branch-free, as magnitude_code.
EPX_LOGFMT_HD float magnitude_of_code(const Group& g, unsigned m) {
  const float v = exp2_approx(fma(sub(static_cast<float>(m), 1.0f), g.step, g.lmin));
  const float c = v < FLT_MAX ? v : FLT_MAX;
  return m != 0u ? c : 0.0f;
}

}  // namespace epx::logfmt_math
