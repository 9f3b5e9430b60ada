// LogFMT: a lossy 10-bit log-domain code for rows of values, in groups of 128.
//
// Group layout (168 bytes, see docs/reference.md):
//   bytes 0..3   float lmax: log2 of the group's largest magnitude, rounded up to a float
//   bytes 4..7   float range: lmax - lmin, in [0, kMaxRange] (clamped to kMaxRange)
//   bytes 8..167 128 codes of 10 bits, a little-endian bit stream (code i at bits 10i..10i+9)
// A code is sign (bit 9) | magnitude m (bits 0..8). m = 0 means zero; m in
// 1..511 means |x| = 2^(lmin + (m - 1) * step) with step = range / 510.
// Floats are stored in host byte order. All arithmetic on the header is done
// in double precision from the stored floats, identically in encode and decode.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "epx/reference.hpp"

namespace epx::ref {
namespace {

constexpr int kGroup = 128;
constexpr int kHeaderBytes = 8;
constexpr int kBits = 10;
constexpr int kPayloadBytes = kGroup * kBits / 8;  // 160
constexpr int kGroupBytes = kHeaderBytes + kPayloadBytes;
constexpr int kLevels = 511;            // magnitude codes 1..511
constexpr double kSteps = kLevels - 1;  // 510 intervals between lmin and lmax
constexpr float kMaxRange = 16.0f;      // largest log2 dynamic range kept per group

int groups_of(int hidden) {
  if (hidden <= 0 || hidden % kGroup != 0)
    throw std::invalid_argument("logfmt: hidden must be a positive multiple of 128");
  return hidden / kGroup;
}

void put_bits(uint8_t* payload, int index, unsigned code) {
  const int pos = index * kBits;
  for (int b = 0; b < kBits; ++b)
    if ((code >> b) & 1u) payload[(pos + b) / 8] |= static_cast<uint8_t>(1u << ((pos + b) % 8));
}

unsigned get_bits(const uint8_t* payload, int index) {
  const int pos = index * kBits;
  unsigned code = 0;
  for (int b = 0; b < kBits; ++b) code |= ((payload[(pos + b) / 8] >> ((pos + b) % 8)) & 1u) << b;
  return code;
}

// Smallest float >= v (v finite, well inside the float range).
float float_up(double v) {
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, INFINITY);
  return f;
}

}  // namespace

std::size_t logfmt_bytes(int hidden) {
  return static_cast<std::size_t>(groups_of(hidden)) * kGroupBytes;
}

double logfmt_max_rel_error() {
  // Rounding in the log domain is off by at most half a step, and the step is
  // at most kMaxRange / 510; the final conversion to float adds 2^-24 relative
  // and the double-precision log/exp a few 1e-14, both covered by (1 + 2^-23).
  return std::exp2(static_cast<double>(kMaxRange) / (2.0 * kSteps)) * (1.0 + 0x1p-23) - 1.0;
}

std::vector<uint8_t> logfmt_encode(const std::vector<float>& row) {
  const int hidden = static_cast<int>(row.size());
  const int G = groups_of(hidden);
  std::vector<uint8_t> out(static_cast<std::size_t>(G) * kGroupBytes, 0);
  for (int g = 0; g < G; ++g) {
    const float* x = row.data() + static_cast<std::size_t>(g) * kGroup;
    uint8_t* dst = out.data() + static_cast<std::size_t>(g) * kGroupBytes;
    float amax = 0.0f, amin = INFINITY;
    for (int i = 0; i < kGroup; ++i) {
      if (!std::isfinite(x[i])) throw std::invalid_argument("logfmt_encode: non-finite value");
      const float a = std::fabs(x[i]);
      if (a < FLT_MIN) continue;  // zero and float subnormals are coded as zero
      amax = std::fmax(amax, a);
      amin = std::fmin(amin, a);
    }
    float lmax = 0.0f, range = 0.0f;
    bool clamped = false;
    if (amax > 0.0f) {
      lmax = float_up(std::log2(static_cast<double>(amax)));
      const double full = static_cast<double>(lmax) - std::log2(static_cast<double>(amin));
      clamped = full > kMaxRange;
      range = clamped ? kMaxRange : float_up(full);
    }
    std::memcpy(dst, &lmax, 4);
    std::memcpy(dst + 4, &range, 4);
    const double step = static_cast<double>(range) / kSteps;
    const double lmin = static_cast<double>(lmax) - static_cast<double>(range);
    for (int i = 0; i < kGroup; ++i) {
      const float a = std::fabs(x[i]);
      unsigned m = 0;
      if (a >= FLT_MIN) {
        double q = 0.0;
        if (step > 0.0) q = std::floor((std::log2(static_cast<double>(a)) - lmin) / step + 0.5);
        if (q < 0.0) q = clamped ? -1.0 : 0.0;  // below the clamped floor: flush to zero
        if (q > kSteps) q = kSteps;
        m = static_cast<unsigned>(q + 1.0);
      }
      const unsigned sign = std::signbit(x[i]) ? 1u : 0u;
      put_bits(dst + kHeaderBytes, i, (sign << 9) | m);
    }
  }
  return out;
}

std::vector<float> logfmt_decode(const std::vector<uint8_t>& code, int hidden) {
  const int G = groups_of(hidden);
  if (code.size() != static_cast<std::size_t>(G) * kGroupBytes)
    throw std::invalid_argument("logfmt_decode: code size != logfmt_bytes(hidden)");
  std::vector<float> out(hidden);
  for (int g = 0; g < G; ++g) {
    const uint8_t* src = code.data() + static_cast<std::size_t>(g) * kGroupBytes;
    float lmax, range;
    std::memcpy(&lmax, src, 4);
    std::memcpy(&range, src + 4, 4);
    const double step = static_cast<double>(range) / kSteps;
    const double lmin = static_cast<double>(lmax) - static_cast<double>(range);
    for (int i = 0; i < kGroup; ++i) {
      const unsigned c = get_bits(src + kHeaderBytes, i);
      const unsigned m = c & 0x1FFu;
      double mag = 0.0;
      if (m != 0) mag = std::fmin(std::exp2(lmin + (m - 1) * step), static_cast<double>(FLT_MAX));
      const float v = static_cast<float>(mag);
      out[static_cast<std::size_t>(g) * kGroup + i] = (c >> 9) ? -v : v;
    }
  }
  return out;
}

}  // namespace epx::ref
