// LogFMT: a lossy 10-bit log-domain code for rows of values, in groups of 128.
//
// Group layout (168 bytes, see docs/reference.md):
//   bytes 0..3   float lmax: log2_approx of the group's largest magnitude
//   bytes 4..7   float range: lmax - log2_approx(smallest), in [0, kMaxRange] (clamped)
//   bytes 8..167 128 codes of 10 bits, a little-endian bit stream (code i at bits 10i..10i+9)
// A code is sign (bit 9) | magnitude m (bits 0..8). m = 0 means zero; m in
// 1..511 means |x| = exp2_approx(lmin + (m - 1) * step) with step = range / 510.
// Floats are stored in host byte order. The arithmetic is logfmt_math.hpp's,
// the same bits as the combine kernels' (float operations only).
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "epx/reference.hpp"
#include "logfmt_math.hpp"

namespace epx::ref {
namespace {

namespace lm = epx::logfmt_math;

constexpr int kGroup = lm::kGroup;
constexpr int kHeaderBytes = 8;
constexpr int kBits = 10;
constexpr int kPayloadBytes = kGroup * kBits / 8;  // 160
constexpr int kGroupBytes = kHeaderBytes + kPayloadBytes;

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

}  // namespace

std::size_t logfmt_bytes(int hidden) {
  return static_cast<std::size_t>(groups_of(hidden)) * kGroupBytes;
}

double logfmt_max_rel_error() {
  // The encoder's rounding in the log domain is off by at most half a step
  // (step <= kMaxRange / 510), plus the error of log2_approx, plus the float
  // roundings of (log2 - lmin) * inv_step + 1/2 and of lmin + (m - 1) step
  // (each below 2^-17 binades for |lmax| <= 128); exp2_approx adds a factor
  // (1 + kExp2RelError). The unit tests check the log2 and exp2 terms and
  // the whole bound on sampled rows.
  const double binades =
      static_cast<double>(lm::kMaxRange) / (2.0 * lm::kSteps) + lm::kLog2AbsError + 3.0 * 0x1p-17;
  return std::exp2(binades) * (1.0 + lm::kExp2RelError) - 1.0;
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
    const lm::Group grp = lm::group_of_extremes(amax, amin);
    std::memcpy(dst, &grp.lmax, 4);
    std::memcpy(dst + 4, &grp.range, 4);
    for (int i = 0; i < kGroup; ++i) {
      const unsigned sign = std::signbit(x[i]) ? 1u : 0u;
      put_bits(dst + kHeaderBytes, i, (sign << 9) | lm::magnitude_code(grp, std::fabs(x[i])));
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
    // What the encoder can write; anything else would leave exp2_approx's range.
    if (!(std::fabs(lmax) <= 128.0f && range >= 0.0f && range <= lm::kMaxRange))
      throw std::invalid_argument("logfmt_decode: group " + std::to_string(g) +
                                  " has a header no encoder writes (lmax " + std::to_string(lmax) +
                                  ", range " + std::to_string(range) + ")");
    const lm::Group grp = lm::group_of_header(lmax, range);
    for (int i = 0; i < kGroup; ++i) {
      const unsigned c = get_bits(src + kHeaderBytes, i);
      const float v = lm::magnitude_of_code(grp, c & 0x1FFu);
      out[static_cast<std::size_t>(g) * kGroup + i] = (c >> 9) ? -v : v;
    }
  }
  return out;
}

}  // namespace epx::ref
