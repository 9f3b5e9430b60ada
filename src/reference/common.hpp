// Helpers shared by the CPU reference model's sources (not part of its API).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace epx::ref::detail {

/// Columns per FP8 scale (per-128 quantization).
constexpr int kScaleGroup = 128;

/// The reference's argument check: std::invalid_argument(what) unless ok.
inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

/// a * b as a size (a tensor's element count).
inline std::size_t sz(int64_t a, int64_t b) {
  return static_cast<std::size_t>(a * b);
}

}  // namespace epx::ref::detail
