// Scalar conversions of the CPU reference model: BF16, FP8 e4m3 (the "fn"
// variant: no infinities, 0x7F/0xFF are NaN), per-128 FP8 row quantization and
// the UE8M0 exponent-byte scale encoding.
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "common.hpp"
#include "epx/reference.hpp"

namespace epx::ref {
namespace {

constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;
constexpr int kGroup = detail::kScaleGroup;

uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// Round-to-nearest-even of a non-negative float to an integer-valued float.
// The argument is always < 2^24 here, so the result is exact.
float rne(float v) {
  float f = std::floor(v);
  float d = v - f;  // exact for v < 2^23
  if (d > 0.5f || (d == 0.5f && std::fmod(f, 2.0f) != 0.0f)) f += 1.0f;
  return f;
}

}  // namespace

float bf16_to_float(uint16_t v) {
  return float_of(static_cast<uint32_t>(v) << 16);
}

uint16_t float_to_bf16(float v) {
  uint32_t u = bits_of(v);
  if (std::isnan(v)) {
    // Keep the sign and the top payload bits; force the quiet bit so the
    // truncated pattern can never turn into an infinity.
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest even on the 16 discarded bits. Overflow past the largest
  // finite value correctly carries into the exponent and yields infinity.
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

float fp8_e4m3_to_float(uint8_t v) {
  const bool neg = (v & 0x80u) != 0;
  const int exp = (v >> 3) & 0xF;
  const int man = v & 0x7;
  float mag;
  if (exp == 0xF && man == 0x7) {
    mag = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), -9);  // subnormal: man * 2^-6 / 8
  } else {
    mag = std::ldexp(static_cast<float>(8 + man), exp - 7 - 3);
  }
  return neg ? -mag : mag;
}

uint8_t float_to_fp8_e4m3(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80u : 0x00u;
  if (std::isnan(v)) return static_cast<uint8_t>(sign | 0x7Fu);
  const float a = std::fabs(v);
  if (a >= kFp8Max) return static_cast<uint8_t>(sign | 0x7Eu);  // saturate (also inf)
  if (a < 0x1p-6f) {
    // Subnormal range (and zero): quantum 2^-9. A result of 8 is exactly the
    // smallest normal, whose code is also 8 (exp 1, mantissa 0).
    const int q = static_cast<int>(rne(a * 512.0f));
    return static_cast<uint8_t>(sign | q);
  }
  // Normal range: keep 3 of the 23 float mantissa bits, rounding to nearest
  // even; a carry out of the mantissa bumps the exponent, as it should. The
  // float exponent bias is 127 and the e4m3 bias 7, hence the offset.
  uint32_t u = bits_of(a);
  u += 0x7FFFFu + ((u >> 20) & 1u);
  const uint32_t code = (u >> 20) - ((127u - 7u) << 3);
  // a < 448 rounds at most to 448 (code 0x7E): the next step, 480, needs a >= 464.
  return static_cast<uint8_t>(sign | code);
}

void quantize_row_fp8(const float* x, int hidden, bool round_scale, uint8_t* q, float* scales) {
  if (hidden % kGroup != 0) throw std::invalid_argument("quantize_row_fp8: hidden % 128 != 0");
  for (int g = 0; g < hidden / kGroup; ++g) {
    const float* xg = x + static_cast<std::ptrdiff_t>(g) * kGroup;
    float amax = 0.0f;
    for (int i = 0; i < kGroup; ++i) amax = std::fmax(amax, std::fabs(xg[i]));
    amax = std::fmax(amax, kAmaxFloor);
    float scale = amax / kFp8Max;
    if (round_scale) {
      // Smallest power of two >= scale, computed exactly.
      int e2;
      const float m = std::frexp(scale, &e2);  // scale = m * 2^e2, m in [0.5, 1)
      scale = (m == 0.5f) ? scale : std::ldexp(1.0f, e2);
    }
    scales[g] = scale;
    for (int i = 0; i < kGroup; ++i) q[g * kGroup + i] = float_to_fp8_e4m3(xg[i] / scale);
  }
}

uint8_t scale_to_ue8m0(float scale) {
  // Exponent byte of the float. Subnormal scales (< 2^-126) have byte 0,
  // which decodes to 2^-127.
  return static_cast<uint8_t>((bits_of(scale) >> 23) & 0xFFu);
}

float ue8m0_to_scale(uint8_t e) {
  if (e == 0xFF) return std::numeric_limits<float>::quiet_NaN();  // 2^128: OCP NaN code
  if (e == 0) return float_of(0x00400000u);                       // 2^-127 (subnormal)
  return float_of(static_cast<uint32_t>(e) << 23);
}

}  // namespace epx::ref
