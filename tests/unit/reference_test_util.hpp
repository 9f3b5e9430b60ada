// unit/reference_test_util.hpp - the reference tests' seeded generator and
// random inputs (EPX_TEST_SEED=<n> mixes n into every seed).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "epx/reference.hpp"

namespace epx::reftest {

namespace ref = epx::ref;

inline std::size_t sz(int64_t a, int64_t b) {
  return static_cast<std::size_t>(a * b);
}

inline float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// Each test seeds its own generator with a fixed base seed; setting
// EPX_TEST_SEED=<n> mixes n into every seed to run the same properties on new data.
inline uint64_t mix_seed(uint64_t base) {
  const char* env = std::getenv("EPX_TEST_SEED");
  if (env == nullptr || *env == '\0') return base;
  return base ^ (std::strtoull(env, nullptr, 10) * 0x9E3779B97F4A7C15ull);
}

struct Rng {
  explicit Rng(uint64_t seed) : g(mix_seed(seed)) {}
  std::mt19937_64 g;
  int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(g); }
  bool chance(double p) { return uniform(0.0, 1.0) < p; }
  float normal() { return static_cast<float>(std::normal_distribution<double>(0.0, 1.0)(g)); }
};

// Random top-k rows: some rows all -1, some with every expert on one rank,
// the rest random with masked slots and occasional duplicated experts.
inline std::vector<int64_t> random_topk(Rng& rng, int T, int K, int E, int R) {
  const int per_rank = E / R;
  std::vector<int64_t> idx(sz(T, K), -1);
  for (int t = 0; t < T; ++t) {
    int64_t* row = &idx[sz(t, K)];
    const double kind = rng.uniform(0.0, 1.0);
    if (kind < 0.1) continue;  // goes nowhere
    if (kind < 0.25) {         // all on one rank
      const int r = rng.uniform_int(0, R - 1);
      for (int k = 0; k < K; ++k) row[k] = r * per_rank + rng.uniform_int(0, per_rank - 1);
      continue;
    }
    for (int k = 0; k < K; ++k) {
      if (rng.chance(0.2)) continue;
      if (k > 0 && row[k - 1] >= 0 && rng.chance(0.1)) {
        row[k] = row[k - 1];  // duplicate pick
        continue;
      }
      row[k] = rng.uniform_int(0, E - 1);
    }
  }
  return idx;
}

inline std::vector<uint16_t> random_bf16(Rng& rng, std::size_t n, bool small_ints) {
  std::vector<uint16_t> v(n);
  for (auto& b : v)
    b = ref::float_to_bf16(small_ints ? static_cast<float>(rng.uniform_int(-8, 8))
                                      : rng.normal() * static_cast<float>(rng.uniform(0.1, 10.0)));
  return v;
}

inline std::vector<float> random_weights(Rng& rng, std::size_t n, bool dyadic) {
  std::vector<float> w(n);
  for (auto& x : w)
    x = dyadic ? static_cast<float>(rng.uniform_int(-64, 64)) / 64.0f
               : static_cast<float>(rng.uniform(-1.0, 1.0));
  return w;
}

}  // namespace epx::reftest
