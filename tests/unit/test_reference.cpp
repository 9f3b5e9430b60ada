// Property tests of the CPU reference model (epx/reference.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "epx/reference.hpp"
#include "reference/logfmt_math.hpp"

namespace ref = epx::ref;

namespace {

std::size_t sz(int64_t a, int64_t b) {
  return static_cast<std::size_t>(a * b);
}

float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// Each test seeds its own generator with a fixed base seed; setting
// EPX_TEST_SEED=<n> mixes n into every seed to run the same properties on new data.
uint64_t mix_seed(uint64_t base) {
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
std::vector<int64_t> random_topk(Rng& rng, int T, int K, int E, int R) {
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

std::vector<uint16_t> random_bf16(Rng& rng, std::size_t n, bool small_ints) {
  std::vector<uint16_t> v(n);
  for (auto& b : v)
    b = ref::float_to_bf16(small_ints ? static_cast<float>(rng.uniform_int(-8, 8))
                                      : rng.normal() * static_cast<float>(rng.uniform(0.1, 10.0)));
  return v;
}

std::vector<float> random_weights(Rng& rng, std::size_t n, bool dyadic) {
  std::vector<float> w(n);
  for (auto& x : w)
    x = dyadic ? static_cast<float>(rng.uniform_int(-64, 64)) / 64.0f
               : static_cast<float>(rng.uniform(-1.0, 1.0));
  return w;
}

// ---- scalar conversions --------------------------------------------------------

TEST(RefConvert, Bf16KnownValues) {
  EXPECT_EQ(ref::float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(ref::float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(ref::float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(ref::float_to_bf16(-2.0f), 0xC000);
  // Ties to even: 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7.
  EXPECT_EQ(ref::float_to_bf16(1.0f + 0x1p-8f), 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(ref::float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);
  EXPECT_EQ(ref::float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
  EXPECT_EQ(ref::float_to_bf16(1.0f + 0x1p-8f - 0x1p-20f), 0x3F80);
  EXPECT_EQ(ref::float_to_bf16(INFINITY), 0x7F80);
  EXPECT_EQ(ref::float_to_bf16(-INFINITY), 0xFF80);
  EXPECT_EQ(ref::float_to_bf16(FLT_MAX), 0x7F80);  // rounds past the largest bf16
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(NAN))));
  // A NaN whose payload lives only in the low bits must not become infinity.
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(float_of(0x7F800001u)))));
  EXPECT_EQ(ref::bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(ref::bf16_to_float(0x4049), 3.140625f);
  EXPECT_EQ(ref::bf16_to_float(0x0001), 0x1p-133f);  // bf16 subnormal
}

TEST(RefConvert, Bf16AllPatternsRoundTrip) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = ref::bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(f))));
    } else {
      ASSERT_EQ(ref::float_to_bf16(f), b) << std::hex << b;
    }
  }
}

TEST(RefConvert, Bf16RoundsToNearestEven) {
  Rng rng(101);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = static_cast<uint32_t>(rng.g());
    const float x = float_of(u);
    if (!std::isfinite(x)) continue;
    const uint16_t got = ref::float_to_bf16(x);
    // Candidates: truncation and the next bf16 away from zero.
    const uint16_t lo = static_cast<uint16_t>(u >> 16), hi = static_cast<uint16_t>(lo + 1);
    const double dlo = std::fabs(static_cast<double>(ref::bf16_to_float(lo)) - x);
    const float fhi = ref::bf16_to_float(hi);
    const double dhi = std::isinf(fhi) ? INFINITY : std::fabs(static_cast<double>(fhi) - x);
    uint16_t want = dlo < dhi ? lo : (dhi < dlo ? hi : ((lo & 1) ? hi : lo));
    if (std::isinf(fhi) && (u & 0xFFFFu) >= 0x8000u && ((u & 0xFFFFu) > 0x8000u || (lo & 1)))
      want = hi;  // overflow to infinity under RNE
    ASSERT_EQ(got, want) << std::hex << u;
    if (std::fabs(x) >= FLT_MIN && std::fabs(x) < 0x1p127f) {
      ASSERT_LE(std::fabs(ref::bf16_to_float(got) - x), std::fabs(x) * 0x1p-8f);
    }
  }
}

TEST(RefConvert, Fp8KnownValues) {
  EXPECT_EQ(ref::float_to_fp8_e4m3(0.0f), 0x00);
  EXPECT_EQ(ref::float_to_fp8_e4m3(-0.0f), 0x80);
  EXPECT_EQ(ref::float_to_fp8_e4m3(1.0f), 0x38);
  EXPECT_EQ(ref::float_to_fp8_e4m3(-1.0f), 0xB8);
  EXPECT_EQ(ref::float_to_fp8_e4m3(448.0f), 0x7E);
  EXPECT_EQ(ref::float_to_fp8_e4m3(0.001953125f), 0x01);   // 2^-9, smallest subnormal
  EXPECT_EQ(ref::float_to_fp8_e4m3(0x1p-6f), 0x08);        // smallest normal
  EXPECT_EQ(ref::float_to_fp8_e4m3(7 * 0x1p-9f), 0x07);    // largest subnormal
  EXPECT_EQ(ref::float_to_fp8_e4m3(0x1p-10f), 0x00);       // tie -> even (0)
  EXPECT_EQ(ref::float_to_fp8_e4m3(3 * 0x1p-10f), 0x02);   // tie 1.5 * 2^-9 -> 2
  EXPECT_EQ(ref::float_to_fp8_e4m3(15 * 0x1p-10f), 0x08);  // tie 7.5 * 2^-9 -> 8 (normal)
  EXPECT_EQ(ref::float_to_fp8_e4m3(1.0625f), 0x38);        // tie between 1 and 1.125
  EXPECT_EQ(ref::float_to_fp8_e4m3(1.1875f), 0x3A);        // tie between 1.125 and 1.25
  EXPECT_EQ(ref::float_to_fp8_e4m3(1.06f), 0x38);
  EXPECT_EQ(ref::float_to_fp8_e4m3(1.065f), 0x39);
  EXPECT_EQ(ref::float_to_fp8_e4m3(-416.0f), 0xFD);
  EXPECT_EQ(ref::float_to_fp8_e4m3(440.0f), 0x7E);  // tie between 416 and 448 -> 448 (even)
  EXPECT_EQ(ref::float_to_fp8_e4m3(449.0f), 0x7E);  // saturation
  EXPECT_EQ(ref::float_to_fp8_e4m3(1e9f), 0x7E);
  EXPECT_EQ(ref::float_to_fp8_e4m3(-1e9f), 0xFE);
  EXPECT_EQ(ref::float_to_fp8_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(ref::float_to_fp8_e4m3(-INFINITY), 0xFE);
  EXPECT_EQ(ref::float_to_fp8_e4m3(NAN) & 0x7F, 0x7F);
  EXPECT_EQ(ref::fp8_e4m3_to_float(0x00), 0.0f);
  EXPECT_EQ(ref::fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(ref::fp8_e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(ref::fp8_e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(ref::fp8_e4m3_to_float(0x01), 0.001953125f);
  EXPECT_EQ(ref::fp8_e4m3_to_float(0x08), 0x1p-6f);
  EXPECT_EQ(ref::fp8_e4m3_to_float(0x3A), 1.25f);
  EXPECT_TRUE(std::isnan(ref::fp8_e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(ref::fp8_e4m3_to_float(0xFF)));
  EXPECT_TRUE(std::signbit(ref::fp8_e4m3_to_float(0x80)));
}

TEST(RefConvert, Fp8AllCodesRoundTripAndOrder) {
  float prev = -1.0f;
  for (int c = 0; c < 256; ++c) {
    const float f = ref::fp8_e4m3_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f));
      continue;
    }
    EXPECT_EQ(ref::float_to_fp8_e4m3(f), c) << c;
    if (c < 0x80) {
      EXPECT_GT(f, prev) << c;  // positive codes are increasing
      prev = f;
      EXPECT_EQ(ref::fp8_e4m3_to_float(static_cast<uint8_t>(c | 0x80)), -f);
    }
  }
}

TEST(RefConvert, Fp8IsNearestFiniteValue) {
  std::vector<float> finite;
  for (int c = 0; c < 0x7F; ++c) finite.push_back(ref::fp8_e4m3_to_float(static_cast<uint8_t>(c)));
  Rng rng(202);
  double worst_rel = 0.0;
  for (int i = 0; i < 100000; ++i) {
    const float x =
        static_cast<float>(std::exp2(rng.uniform(-14.0, 9.5))) * (rng.chance(0.5) ? -1.0f : 1.0f);
    const uint8_t q = ref::float_to_fp8_e4m3(x);
    const float got = ref::fp8_e4m3_to_float(q);
    const float ax = std::fabs(x);
    double best = INFINITY;
    for (float f : finite) best = std::min(best, std::fabs(static_cast<double>(f) - ax));
    ASSERT_EQ(std::signbit(got), std::signbit(x));
    if (ax <= 448.0f) {
      ASSERT_EQ(std::fabs(static_cast<double>(std::fabs(got)) - ax), best) << x;
      // Round-trip bound: 2^-4 relative for normals, 2^-10 absolute for subnormals.
      ASSERT_LE(std::fabs(got - x), std::max(ax * 0x1p-4f, 0x1p-10f)) << x;
      if (ax >= 0x1p-6f) worst_rel = std::max(worst_rel, double{std::fabs(got - x) / ax});
    } else {
      ASSERT_EQ(std::fabs(got), 448.0f) << x;
    }
  }
  EXPECT_GT(worst_rel, 0.05);  // the 2^-4 bound is nearly reached
}

void check_quantize(bool round_scale, uint64_t seed) {
  Rng rng(seed);
  const int H = 128 * 12;
  double worst = 0.0;
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<float> x(H);
    for (int g = 0; g < H / 128; ++g) {
      const int kind = rng.uniform_int(0, 5);
      const double mag = std::exp2(rng.uniform(-24.0, 12.0));
      for (int i = 0; i < 128; ++i) {
        float& v = x[g * 128 + i];
        if (kind == 0)
          v = 0.0f;  // all zero group
        else if (kind == 1)
          v = static_cast<float>(mag * 1e-9);  // below the amax floor
        else
          v = rng.chance(0.05) ? 0.0f : static_cast<float>(rng.normal() * mag);
      }
    }
    std::vector<uint8_t> q(H);
    std::vector<float> scales(H / 128);
    ref::quantize_row_fp8(x.data(), H, round_scale, q.data(), scales.data());
    for (int g = 0; g < H / 128; ++g) {
      float amax = 0.0f;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(x[g * 128 + i]));
      amax = std::max(amax, 1e-4f);
      const float scale = scales[g];
      if (round_scale) {
        int e;
        ASSERT_EQ(std::frexp(scale, &e), 0.5f) << "scale is not a power of two";
        ASSERT_GE(scale, amax / 448.0f);
        ASSERT_LT(scale, 2.0f * (amax / 448.0f));
        ASSERT_EQ(ref::ue8m0_to_scale(ref::scale_to_ue8m0(scale)), scale);
      } else {
        ASSERT_EQ(scale, amax / 448.0f);
      }
      for (int i = 0; i < 128; ++i) {
        const float xi = x[g * 128 + i], ax = std::fabs(xi);
        const uint8_t qi = q[g * 128 + i];
        ASSERT_EQ(qi, ref::float_to_fp8_e4m3(xi / scale));
        const float deq = ref::fp8_e4m3_to_float(qi) * scale;
        ASSERT_LE(std::fabs(ref::fp8_e4m3_to_float(qi)), 448.0f);
        // fp8 rounding of v = x/scale: |q - v| <= max(|v| 2^-4, 2^-10); the
        // float division and product add at most 2^-24 relative each.
        const double main = std::max(ax * 0x1p-4, scale * 0x1p-10);
        const double tol = main + 0x1p-21 * (ax + 448.0 * scale);
        const double err = std::fabs(static_cast<double>(deq) - xi);
        ASSERT_LE(err, tol) << "x=" << xi << " scale=" << scale;
        worst = std::max(worst, err / main);
      }
    }
  }
  EXPECT_GT(worst, 0.5);  // the bound is tight, not vacuous
}

TEST(RefConvert, QuantizeRowFp8Bound) {
  check_quantize(false, 303);
}
TEST(RefConvert, QuantizeRowFp8RoundScaleBound) {
  check_quantize(true, 304);
}

TEST(RefConvert, QuantizeRowFp8KnownGroup) {
  std::vector<float> x(128, 0.0f);
  x[0] = 448.0f;
  x[1] = -224.0f;
  x[2] = 1.0f;
  std::vector<uint8_t> q(128);
  float scale;
  ref::quantize_row_fp8(x.data(), 128, false, q.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], ref::float_to_fp8_e4m3(-224.0f));
  EXPECT_EQ(q[2], 0x38);
  EXPECT_EQ(q[3], 0x00);
  ref::quantize_row_fp8(x.data(), 128, true, q.data(), &scale);
  EXPECT_EQ(scale, 1.0f);  // already a power of two: kept
  x[0] = 300.0f;           // scale 300/448 -> rounded up to 1
  x[1] = 0.0f;
  ref::quantize_row_fp8(x.data(), 128, true, q.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(q[0], ref::float_to_fp8_e4m3(300.0f));
  std::fill(x.begin(), x.end(), 0.0f);
  ref::quantize_row_fp8(x.data(), 128, false, q.data(), &scale);
  EXPECT_EQ(scale, 1e-4f / 448.0f);
  for (uint8_t b : q) EXPECT_EQ(b, 0);
}

TEST(RefConvert, Ue8m0RoundTrip) {
  for (int k = -126; k <= 127; ++k) {
    const float s = std::ldexp(1.0f, k);
    const uint8_t e = ref::scale_to_ue8m0(s);
    EXPECT_EQ(e, k + 127);
    EXPECT_EQ(ref::ue8m0_to_scale(e), s);
  }
  for (int e = 1; e <= 254; ++e)
    EXPECT_EQ(ref::scale_to_ue8m0(ref::ue8m0_to_scale(static_cast<uint8_t>(e))), e);
  EXPECT_EQ(ref::ue8m0_to_scale(0), 0x1p-127f);
  EXPECT_TRUE(std::isnan(ref::ue8m0_to_scale(255)));
}

// ---- layout --------------------------------------------------------------------

TEST(RefLayout, KnownExample) {
  // E = 8 on R = 4 ranks (2 experts each), K = 3.
  const std::vector<int64_t> idx = {0,  1,  7,   //
                                    -1, -1, -1,  //
                                    5,  5,  -1,  //
                                    2,  4,  6};
  const ref::Layout l = ref::get_dispatch_layout(idx, 4, 3, 8, 4);
  EXPECT_EQ(l.num_tokens_per_rank, (std::vector<int>{1, 1, 2, 2}));
  EXPECT_EQ(l.num_tokens_per_expert, (std::vector<int>{1, 1, 1, 0, 1, 2, 1, 1}));
  EXPECT_EQ(l.is_token_in_rank,
            (std::vector<uint8_t>{1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1}));
}

TEST(RefLayout, RandomProperties) {
  Rng rng(404);
  for (int iter = 0; iter < 200; ++iter) {
    const int R = std::vector<int>{1, 2, 3, 4, 8}[rng.uniform_int(0, 4)];
    const int E = R * rng.uniform_int(1, 8);
    const int K = rng.uniform_int(1, 9);
    const int T = rng.uniform_int(0, 70);
    const std::vector<int64_t> idx = random_topk(rng, T, K, E, R);
    const ref::Layout l = ref::get_dispatch_layout(idx, T, K, E, R);
    ASSERT_EQ(l.num_tokens_per_rank.size(), static_cast<std::size_t>(R));
    ASSERT_EQ(l.num_tokens_per_expert.size(), static_cast<std::size_t>(E));
    ASSERT_EQ(l.is_token_in_rank.size(), sz(T, R));
    int valid = 0;
    for (int64_t e : idx) valid += e >= 0;
    int sum = 0;
    for (int c : l.num_tokens_per_expert) sum += c;
    EXPECT_EQ(sum, valid);
    std::vector<int> col(R, 0);
    for (int t = 0; t < T; ++t) {
      bool any = false;
      for (int r = 0; r < R; ++r) {
        bool want = false;
        for (int k = 0; k < K; ++k) {
          const int64_t e = idx[sz(t, K) + k];
          want = want || (e >= 0 && e / (E / R) == r);
        }
        ASSERT_EQ(l.is_token_in_rank[sz(t, R) + r], want ? 1 : 0);
        col[r] += l.is_token_in_rank[sz(t, R) + r];
        any = any || want;
      }
      bool all_masked = true;
      for (int k = 0; k < K; ++k) all_masked = all_masked && idx[sz(t, K) + k] < 0;
      EXPECT_EQ(any, !all_masked);
    }
    EXPECT_EQ(l.num_tokens_per_rank, col);
    for (int e = 0; e < E; ++e)
      EXPECT_EQ(l.num_tokens_per_expert[e], std::count(idx.begin(), idx.end(), e));
  }
}

TEST(RefLayout, TokensPerNode) {
  // The known example on 2 nodes of 2 ranks: token 0 reaches nodes 0 (ranks
  // 0) and 1 (rank 3), token 2 node 1 twice (expert 5 twice), token 3 nodes 0
  // and 1 (ranks 1, 2, 3: node 1 once).
  const std::vector<int64_t> idx = {0, 1, 7, -1, -1, -1, 5, 5, -1, 2, 4, 6};
  EXPECT_EQ(ref::get_dispatch_layout(idx, 4, 3, 8, 4, 2).num_tokens_per_node,
            (std::vector<int>{2, 3}));
  EXPECT_EQ(ref::get_dispatch_layout(idx, 4, 3, 8, 4, 1).num_tokens_per_node,
            ref::get_dispatch_layout(idx, 4, 3, 8, 4).num_tokens_per_rank);
  EXPECT_EQ(ref::get_dispatch_layout(idx, 4, 3, 8, 4, 4).num_tokens_per_node,
            (std::vector<int>{3}));
  EXPECT_TRUE(ref::get_dispatch_layout(idx, 4, 3, 8, 4).num_tokens_per_node.empty());
  EXPECT_THROW(ref::get_dispatch_layout(idx, 4, 3, 8, 4, 3), std::invalid_argument);
  // Random: a token counts once per node holding any of its ranks.
  Rng rng(405);
  for (int iter = 0; iter < 100; ++iter) {
    const int rpn = rng.uniform_int(1, 4), nodes = rng.uniform_int(1, 5), R = rpn * nodes;
    const int E = R * rng.uniform_int(1, 4), K = rng.uniform_int(1, 9), T = rng.uniform_int(0, 50);
    const std::vector<int64_t> idx2 = random_topk(rng, T, K, E, R);
    const ref::Layout l = ref::get_dispatch_layout(idx2, T, K, E, R, rpn);
    std::vector<int> want(nodes, 0);
    for (int t = 0; t < T; ++t)
      for (int n = 0; n < nodes; ++n) {
        bool hit = false;
        for (int k = 0; k < K; ++k) {
          const int64_t e = idx2[sz(t, K) + k];
          hit = hit || (e >= 0 && e / (E / R) / rpn == n);
        }
        want[n] += hit ? 1 : 0;
      }
    ASSERT_EQ(l.num_tokens_per_node, want);
  }
}

// ---- high-throughput ------------------------------------------------------------

struct HtCase {
  int R, E, K, H;
  std::vector<int> T;
};

std::vector<HtCase> ht_cases(Rng& rng) {
  std::vector<HtCase> c = {
      {4, 16, 4, 256, {37, 0, 64, 5}},  // a rank with zero tokens
      {1, 8, 3, 128, {20}},             // one rank
      {2, 2, 2, 128, {1, 1}},           // one token per rank
      {3, 9, 6, 256, {10, 11, 12}},     // K larger than E_local
      {2, 4, 1, 128, {0, 0}},           // nothing at all
  };
  std::vector<int> t8(8);
  for (int& t : t8) t = rng.uniform_int(0, 40);
  c.push_back({8, 64, 8, 128, t8});
  return c;
}

std::vector<ref::HtInput> make_ht_inputs(Rng& rng, const HtCase& c, bool small_ints, bool weights,
                                         bool fp8 = false) {
  std::vector<ref::HtInput> in(c.R);
  for (int r = 0; r < c.R; ++r) {
    ref::HtInput& x = in[r];
    x.num_tokens = c.T[r];
    x.fp8 = fp8;
    if (fp8) {
      x.x_fp8.resize(sz(c.T[r], c.H));
      for (auto& b : x.x_fp8) b = static_cast<uint8_t>(rng.uniform_int(0, 255));
      x.x_scales.resize(sz(c.T[r], c.H / 128));
      for (auto& s : x.x_scales) s = static_cast<float>(rng.uniform(0.01, 2.0));
    } else {
      x.x_bf16 = random_bf16(rng, sz(c.T[r], c.H), small_ints);
    }
    x.topk_idx = random_topk(rng, c.T[r], c.K, c.E, c.R);
    if (weights) x.topk_weights = random_weights(rng, sz(c.T[r], c.K), small_ints);
  }
  return in;
}

bool token_on_rank(const ref::HtInput& in, int t, int K, int per_rank, int r) {
  for (int k = 0; k < K; ++k) {
    const int64_t e = in.topk_idx[sz(t, K) + k];
    if (e >= 0 && e / per_rank == r) return true;
  }
  return false;
}

// The ranks token (s, t) reached, in rank order.
std::vector<int> ranks_reached(const ref::HtInput& in, int t, int K, int E, int R) {
  std::vector<int> out;
  for (int r = 0; r < R; ++r)
    if (token_on_rank(in, t, K, E / R, r)) out.push_back(r);
  return out;
}

TEST(RefHt, DispatchReceiveOrderAndContents) {
  Rng rng(505);
  for (const HtCase& c : ht_cases(rng)) {
    SCOPED_TRACE("R=" + std::to_string(c.R) + " E=" + std::to_string(c.E));
    const auto in = make_ht_inputs(rng, c, false, true);
    const auto out = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
    ASSERT_EQ(out.size(), static_cast<std::size_t>(c.R));
    const int El = c.E / c.R;
    for (int r = 0; r < c.R; ++r) {
      const ref::HtDispatchOutput& o = out[r];
      // Expected receive list, built directly from the definition.
      std::vector<std::pair<int, int>> want;
      for (int s = 0; s < c.R; ++s)
        for (int t = 0; t < c.T[s]; ++t)
          if (token_on_rank(in[s], t, c.K, El, r)) want.emplace_back(s, t);
      const int N = static_cast<int>(want.size());
      ASSERT_EQ(o.num_recv_tokens, N);
      ASSERT_EQ(o.recv_x_bf16.size(), sz(N, c.H));
      ASSERT_EQ(o.recv_topk_idx.size(), sz(N, c.K));
      ASSERT_EQ(o.recv_topk_weights.size(), sz(N, c.K));
      ASSERT_TRUE(o.recv_x_fp8.empty());
      std::vector<int> per_expert(El, 0);
      for (int n = 0; n < N; ++n) {
        const auto [s, t] = want[n];
        ASSERT_EQ(o.recv_src_rank[n], s);
        ASSERT_EQ(o.recv_src_idx[n], t);
        if (n > 0) {  // grouped by source, token order within a source
          ASSERT_TRUE(o.recv_src_rank[n] > o.recv_src_rank[n - 1] ||
                      (o.recv_src_rank[n] == o.recv_src_rank[n - 1] &&
                       o.recv_src_idx[n] > o.recv_src_idx[n - 1]));
        }
        ASSERT_EQ(0,
                  std::memcmp(&o.recv_x_bf16[sz(n, c.H)], &in[s].x_bf16[sz(t, c.H)], sz(c.H, 2)));
        for (int k = 0; k < c.K; ++k) {
          const int64_t e = in[s].topk_idx[sz(t, c.K) + k];
          const int64_t got = o.recv_topk_idx[sz(n, c.K) + k];
          const float w = o.recv_topk_weights[sz(n, c.K) + k];
          if (e >= 0 && e / El == r) {
            ASSERT_EQ(got, e - r * El);
            ++per_expert[got];
            ASSERT_EQ(w, in[s].topk_weights[sz(t, c.K) + k]);
          } else {
            ASSERT_EQ(got, -1);
            ASSERT_EQ(w, 0.0f);  // DeepEP zeroes the weights of other ranks' experts
          }
        }
      }
      EXPECT_EQ(o.num_recv_tokens_per_expert, per_expert);
      // rank_prefix_matrix[i][j]: tokens of ranks 0..i that rank j receives
      // (counted from the definition: any of the token's experts on j).
      ASSERT_EQ(o.rank_prefix_matrix.size(), sz(c.R, c.R));
      for (int j = 0; j < c.R; ++j)
        for (int i = 0, acc = 0; i < c.R; ++i) {
          for (int t = 0; t < c.T[i]; ++t) acc += token_on_rank(in[i], t, c.K, El, j) ? 1 : 0;
          ASSERT_EQ(o.rank_prefix_matrix[sz(i, c.R) + j], acc) << "i=" << i << " j=" << j;
        }
      ASSERT_EQ(o.source_num_tokens, c.T);
    }
  }
}

TEST(RefHt, ExpertAlignmentRoundsUp) {
  Rng rng(506);
  const HtCase c{4, 16, 4, 128, {50, 3, 0, 31}};
  const auto in = make_ht_inputs(rng, c, false, false);
  const auto base = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
  bool some_rounded = false;
  for (int align : {2, 3, 4, 128}) {
    const auto out = ref::ht_dispatch(in, c.H, c.K, c.E, align);
    for (int r = 0; r < c.R; ++r)
      for (int e = 0; e < c.E / c.R; ++e) {
        const int raw = base[r].num_recv_tokens_per_expert[e];
        const int got = out[r].num_recv_tokens_per_expert[e];
        EXPECT_EQ(got % align, 0);
        EXPECT_GE(got, raw);
        EXPECT_LT(got, raw + align);
        some_rounded = some_rounded || got != raw;
      }
  }
  EXPECT_TRUE(some_rounded);
}

// combine(dispatch(x)) with every rank sending back its received rows gives
// x times the number of ranks each token reached.
void check_round_trip(bool small_ints, uint64_t seed) {
  Rng rng(seed);
  for (const HtCase& c : ht_cases(rng)) {
    SCOPED_TRACE("R=" + std::to_string(c.R) + " E=" + std::to_string(c.E));
    const auto in = make_ht_inputs(rng, c, small_ints, true);
    const auto d = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
    std::vector<ref::HtCombineInput> ci(c.R);
    for (int r = 0; r < c.R; ++r) {
      ci[r].x = d[r].recv_x_bf16;
      ci[r].topk_weights = d[r].recv_topk_weights;
    }
    const auto out = ref::ht_combine(in, ci, c.H, c.K, c.E);
    // With no row received anywhere, weights [0, K] look like "no weights": empty output.
    bool any_rows = false;
    for (const auto& o : d) any_rows = any_rows || o.num_recv_tokens > 0;
    for (int s = 0; s < c.R; ++s) {
      ASSERT_EQ(out[s].combined_x.size(), sz(c.T[s], c.H));
      ASSERT_EQ(out[s].combined_topk_weights.size(), any_rows ? sz(c.T[s], c.K) : 0u);
      for (int t = 0; t < c.T[s]; ++t) {
        const int n = static_cast<int>(ranks_reached(in[s], t, c.K, c.E, c.R).size());
        for (int h = 0; h < c.H; ++h) {
          const float x = ref::bf16_to_float(in[s].x_bf16[sz(t, c.H) + h]);
          const float got = ref::bf16_to_float(out[s].combined_x[sz(t, c.H) + h]);
          // Exact (<= 11 significant bits); a token that reached no rank gives +0.
          const float want = 0.0f + x * static_cast<float>(n);
          if (small_ints) {
            ASSERT_EQ(got, want);
          } else {
            ASSERT_EQ(out[s].combined_x[sz(t, c.H) + h], ref::float_to_bf16(want));
            ASSERT_LE(std::fabs(got - want), std::fabs(want) * 0x1p-8f);
          }
        }
        // Only the rank of a pick's expert sends its weight back (the others
        // received 0), so the combined weights are the token's own; a -1 pick
        // comes back 0.
        for (int k = 0; k < c.K && any_rows; ++k) {
          const int64_t e = in[s].topk_idx[sz(t, c.K) + k];
          const float w = e >= 0 ? in[s].topk_weights[sz(t, c.K) + k] : 0.0f;
          ASSERT_EQ(out[s].combined_topk_weights[sz(t, c.K) + k], w);
        }
      }
    }
  }
}

TEST(RefHt, CombineOfDispatchExactSmallIntegers) {
  check_round_trip(true, 601);
}
TEST(RefHt, CombineOfDispatchRandomValues) {
  check_round_trip(false, 602);
}

/// Combine inputs of unrelated random rows and weights for every row the
/// dispatch `d` delivered, biases by bias_mask (bit 0: bias_0, bit 1: bias_1),
/// and where each rank received (source, token).
struct CombineInputs {
  std::vector<ref::HtCombineInput> ci;
  std::vector<std::map<std::pair<int, int>, int>> row_of;
};
CombineInputs random_combine_inputs(Rng& rng, const HtCase& c,
                                    const std::vector<ref::HtDispatchOutput>& d, int bias_mask) {
  CombineInputs out{std::vector<ref::HtCombineInput>(c.R),
                    std::vector<std::map<std::pair<int, int>, int>>(c.R)};
  for (int r = 0; r < c.R; ++r) {
    ref::HtCombineInput& ci = out.ci[r];
    ci.x = random_bf16(rng, sz(d[r].num_recv_tokens, c.H), false);
    ci.topk_weights = random_weights(rng, sz(d[r].num_recv_tokens, c.K), false);
    if (bias_mask & 1) ci.bias_0 = random_bf16(rng, sz(c.T[r], c.H), false);
    if (bias_mask & 2) ci.bias_1 = random_bf16(rng, sz(c.T[r], c.H), false);
    for (int n = 0; n < d[r].num_recv_tokens; ++n)
      out.row_of[r][{d[r].recv_src_rank[n], d[r].recv_src_idx[n]}] = n;
  }
  return out;
}

// Every rank returns its own, unrelated rows; the combine must add, per
// token, exactly the rows the dispatch put there, in rank order, plus biases.
TEST(RefHt, CombineSumsTheRightRowsPlusBias) {
  Rng rng(603);
  for (const HtCase& c : ht_cases(rng)) {
    SCOPED_TRACE("R=" + std::to_string(c.R) + " E=" + std::to_string(c.E));
    for (int bias_mask = 0; bias_mask < 4; ++bias_mask) {
      const auto in = make_ht_inputs(rng, c, false, true);
      const auto d = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
      const auto [ci, row_of] = random_combine_inputs(rng, c, d, bias_mask);
      const auto out = ref::ht_combine(in, ci, c.H, c.K, c.E);
      bool any_rows = false;
      for (const auto& o : d) any_rows = any_rows || o.num_recv_tokens > 0;
      for (int s = 0; s < c.R; ++s)
        for (int t = 0; t < c.T[s]; ++t) {
          const std::vector<int> reached = ranks_reached(in[s], t, c.K, c.E, c.R);
          for (int h = 0; h < c.H; ++h) {
            float acc = 0.0f;
            double exact = 0.0, mag = 0.0;
            auto add = [&](uint16_t b) {
              acc += ref::bf16_to_float(b);
              exact += ref::bf16_to_float(b);
              mag += std::fabs(ref::bf16_to_float(b));
            };
            for (int r : reached) add(ci[r].x[sz(row_of[r].at({s, t}), c.H) + h]);
            if (bias_mask & 1) add(ci[s].bias_0[sz(t, c.H) + h]);
            if (bias_mask & 2) add(ci[s].bias_1[sz(t, c.H) + h]);
            const uint16_t got = out[s].combined_x[sz(t, c.H) + h];
            ASSERT_EQ(got, ref::float_to_bf16(acc)) << "s=" << s << " t=" << t << " h=" << h;
            ASSERT_LE(std::fabs(ref::bf16_to_float(got) - exact),
                      std::fabs(exact) * 0x1p-8 + mag * 0x1p-21);
          }
          ASSERT_EQ(out[s].combined_topk_weights.size(), any_rows ? sz(c.T[s], c.K) : 0u);
          for (int k = 0; k < c.K && any_rows; ++k) {
            float w = 0.0f;
            for (int r : reached) w += ci[r].topk_weights[sz(row_of[r].at({s, t}), c.K) + k];
            ASSERT_EQ(out[s].combined_topk_weights[sz(t, c.K) + k], w);
          }
        }
    }
  }
}

// Across nodes (ranks_per_node L < R) the combine sums each node's rows in
// float32, rounds that to BF16 (the row that crosses the network), then adds
// the nodes' rows in node order, then the biases, and rounds once more.
// Checked against that statement written out here; L == R (and 0) is the
// one-node sum, bit for bit; and the grouping does change some results.
TEST(RefHt, CombineAcrossNodesSumsEachNodeThenTheNodes) {
  Rng rng(605);
  const std::vector<HtCase> cases = {
      {4, 16, 4, 128, {37, 0, 64, 5}},
      {8, 64, 8, 128, {20, 3, 0, 40, 17, 9, 1, 33}},
      {6, 12, 5, 256, {11, 12, 13, 0, 2, 30}},
  };
  bool some_differ = false;
  for (const HtCase& c : cases) {
    for (int L = 1; L <= c.R; ++L) {
      if (c.R % L != 0) continue;
      SCOPED_TRACE("R=" + std::to_string(c.R) + " L=" + std::to_string(L));
      const auto in = make_ht_inputs(rng, c, false, true);
      const auto d = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
      const auto [ci, row_of] = random_combine_inputs(rng, c, d, /*bias_mask=*/1);
      const auto out = ref::ht_combine(in, ci, c.H, c.K, c.E, L);
      const auto flat = ref::ht_combine(in, ci, c.H, c.K, c.E);
      for (int s = 0; s < c.R; ++s)
        for (int t = 0; t < c.T[s]; ++t) {
          const std::vector<int> reached = ranks_reached(in[s], t, c.K, c.E, c.R);
          for (int h = 0; h < c.H; ++h) {
            float total = 0.0f;
            for (int n = 0; n < c.R / L; ++n) {
              float node = 0.0f;
              bool any = false;
              for (int r : reached)
                if (r / L == n) {
                  node += ref::bf16_to_float(ci[r].x[sz(row_of[r].at({s, t}), c.H) + h]);
                  any = true;
                }
              if (any) total += L < c.R ? ref::bf16_to_float(ref::float_to_bf16(node)) : node;
            }
            total += ref::bf16_to_float(ci[s].bias_0[sz(t, c.H) + h]);
            const uint16_t got = out[s].combined_x[sz(t, c.H) + h];
            ASSERT_EQ(got, ref::float_to_bf16(total)) << "s=" << s << " t=" << t << " h=" << h;
            if (L == c.R) ASSERT_EQ(got, flat[s].combined_x[sz(t, c.H) + h]);
            some_differ = some_differ || got != flat[s].combined_x[sz(t, c.H) + h];
          }
          for (int k = 0; k < c.K; ++k) {
            float w = 0.0f;
            for (int n = 0; n < c.R / L; ++n) {
              float node = 0.0f;
              for (int r : reached)
                if (r / L == n) node += ci[r].topk_weights[sz(row_of[r].at({s, t}), c.K) + k];
              w += node;
            }
            ASSERT_EQ(out[s].combined_topk_weights[sz(t, c.K) + k], w);
          }
        }
    }
  }
  EXPECT_TRUE(some_differ) << "grouping by node never changed a sum: the test shows nothing";
  // L must divide R.
  HtCase c{4, 16, 4, 128, {3, 3, 3, 3}};
  const auto in = make_ht_inputs(rng, c, false, false);
  const auto d = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
  std::vector<ref::HtCombineInput> ci(c.R);
  for (int r = 0; r < c.R; ++r) ci[r].x = d[r].recv_x_bf16;
  for (int bad : {3, -1, 8})
    EXPECT_THROW(ref::ht_combine(in, ci, c.H, c.K, c.E, bad), std::invalid_argument) << bad;
}

TEST(RefHt, EdgeCases) {
  Rng rng(604);
  // Every token masked: nothing is received, combine gives zeros (or the bias).
  {
    HtCase c{2, 4, 3, 128, {5, 2}};
    auto in = make_ht_inputs(rng, c, true, true);
    for (auto& x : in) std::fill(x.topk_idx.begin(), x.topk_idx.end(), -1);
    const auto d = ref::ht_dispatch(in, c.H, c.K, c.E, 4);
    std::vector<ref::HtCombineInput> ci(c.R);
    for (int r = 0; r < c.R; ++r) {
      EXPECT_EQ(d[r].num_recv_tokens, 0);
      EXPECT_EQ(d[r].num_recv_tokens_per_expert, (std::vector<int>{0, 0}));
      ci[r].topk_weights = d[r].recv_topk_weights;
      ci[r].bias_1 = random_bf16(rng, sz(c.T[r], c.H), true);
    }
    const auto out = ref::ht_combine(in, ci, c.H, c.K, c.E);
    for (int r = 0; r < c.R; ++r) {
      EXPECT_EQ(out[r].combined_x, ci[r].bias_1);
      EXPECT_TRUE(out[r].combined_topk_weights.empty());  // no weights came back
    }
  }
  // R = 1: every token with a valid pick is received once, in order.
  {
    HtCase c{1, 4, 4, 128, {9}};
    auto in = make_ht_inputs(rng, c, true, false);
    in[0].topk_idx[0] = 0, in[0].topk_idx[1] = 3, in[0].topk_idx[2] = 3, in[0].topk_idx[3] = -1;
    const auto d = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
    int valid_rows = 0;
    for (int t = 0; t < 9; ++t) valid_rows += token_on_rank(in[0], t, c.K, 4, 0);
    EXPECT_EQ(d[0].num_recv_tokens, valid_rows);
    EXPECT_EQ(d[0].recv_src_idx[0], 0);
    EXPECT_EQ(std::vector<int64_t>(d[0].recv_topk_idx.begin(), d[0].recv_topk_idx.begin() + 4),
              (std::vector<int64_t>{0, 3, 3, -1}));
    EXPECT_TRUE(d[0].recv_topk_weights.empty());
  }
  // All experts of a token on one rank: received once there, nowhere else.
  {
    HtCase c{4, 8, 4, 128, {1, 0, 0, 0}};
    auto in = make_ht_inputs(rng, c, true, true);
    in[0].topk_idx = {5, 4, 5, 4};
    const auto d = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
    for (int r = 0; r < 4; ++r) EXPECT_EQ(d[r].num_recv_tokens, r == 2 ? 1 : 0);
    EXPECT_EQ(d[2].recv_topk_idx, (std::vector<int64_t>{1, 0, 1, 0}));
    EXPECT_EQ(d[2].num_recv_tokens_per_expert, (std::vector<int>{2, 2}));
    std::vector<ref::HtCombineInput> ci(c.R);
    for (int r = 0; r < c.R; ++r) ci[r].x = d[r].recv_x_bf16;
    const auto out = ref::ht_combine(in, ci, c.H, c.K, c.E);
    EXPECT_EQ(out[0].combined_x, in[0].x_bf16);  // reached one rank: x itself
  }
}

TEST(RefHt, Fp8Dispatch) {
  Rng rng(605);
  for (const HtCase& c : ht_cases(rng)) {
    const auto in = make_ht_inputs(rng, c, false, true, true);
    const auto d = ref::ht_dispatch(in, c.H, c.K, c.E, 1);
    const int G = c.H / 128;
    for (int r = 0; r < c.R; ++r) {
      const int N = d[r].num_recv_tokens;
      ASSERT_TRUE(d[r].recv_x_bf16.empty());
      ASSERT_EQ(d[r].recv_x_fp8.size(), sz(N, c.H));
      ASSERT_EQ(d[r].recv_x_scales.size(), sz(N, G));
      for (int n = 0; n < N; ++n) {
        const int s = d[r].recv_src_rank[n], t = d[r].recv_src_idx[n];
        ASSERT_TRUE(token_on_rank(in[s], t, c.K, c.E / c.R, r));
        ASSERT_EQ(0, std::memcmp(&d[r].recv_x_fp8[sz(n, c.H)], &in[s].x_fp8[sz(t, c.H)], c.H));
        ASSERT_EQ(0,
                  std::memcmp(&d[r].recv_x_scales[sz(n, G)], &in[s].x_scales[sz(t, G)], sz(G, 4)));
      }
    }
    // Same routing in bf16 gives the same receive order.
    auto in16 = make_ht_inputs(rng, c, false, true);
    for (int r = 0; r < c.R; ++r) in16[r].topk_idx = in[r].topk_idx;
    const auto d16 = ref::ht_dispatch(in16, c.H, c.K, c.E, 1);
    for (int r = 0; r < c.R; ++r) {
      EXPECT_EQ(d16[r].recv_src_rank, d[r].recv_src_rank);
      EXPECT_EQ(d16[r].recv_src_idx, d[r].recv_src_idx);
    }
  }
}

TEST(RefHt, RejectsBadInput) {
  Rng rng(606);
  const HtCase c{2, 4, 2, 128, {3, 3}};
  auto in = make_ht_inputs(rng, c, true, true);
  EXPECT_THROW(ref::ht_dispatch(in, c.H, c.K, 5, 1), std::invalid_argument);  // E % R
  EXPECT_THROW(ref::ht_dispatch(in, c.H, c.K, c.E, 0), std::invalid_argument);
  in[1].topk_idx[0] = 4;  // expert id out of range
  EXPECT_THROW(ref::ht_dispatch(in, c.H, c.K, c.E, 1), std::invalid_argument);
}

// ---- low-latency ----------------------------------------------------------------

struct LlCase {
  int R, E, K, H, maxT;
  std::vector<int> T;
};

std::vector<LlCase> ll_cases() {
  return {
      {4, 16, 4, 256, 40, {37, 0, 40, 5}},
      {1, 4, 3, 128, 8, {8}},
      {2, 2, 2, 128, 1, {1, 1}},
      {3, 6, 5, 128, 16, {16, 3, 9}},
      {8, 32, 8, 128, 12, {12, 0, 7, 1, 12, 5, 9, 2}},
  };
}

struct LlInputs {
  std::vector<std::vector<uint16_t>> x;
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<float>> w;
};

LlInputs make_ll_inputs(Rng& rng, const LlCase& c) {
  LlInputs in;
  for (int r = 0; r < c.R; ++r) {
    in.x.push_back(random_bf16(rng, sz(c.T[r], c.H), false));
    in.idx.push_back(random_topk(rng, c.T[r], c.K, c.E, c.R));
    std::vector<float> w = random_weights(rng, sz(c.T[r], c.K), false);
    // Weights of masked slots are huge: using them would be obvious.
    for (std::size_t i = 0; i < w.size(); ++i)
      if (in.idx[r][i] < 0) w[i] = 1e6f;
    in.w.push_back(w);
  }
  return in;
}

// Distinct valid experts of token (s, t).
std::set<int64_t> experts_of(const LlInputs& in, int s, int t, int K) {
  std::set<int64_t> out;
  for (int k = 0; k < K; ++k)
    if (in.idx[s][sz(t, K) + k] >= 0) out.insert(in.idx[s][sz(t, K) + k]);
  return out;
}

void check_ll_dispatch(bool use_fp8, bool round_scale, uint64_t seed) {
  Rng rng(seed);
  for (const LlCase& c : ll_cases()) {
    SCOPED_TRACE("R=" + std::to_string(c.R) + " E=" + std::to_string(c.E));
    const LlInputs in = make_ll_inputs(rng, c);
    const auto out =
        ref::ll_dispatch(in.x, in.idx, c.T, c.H, c.K, c.E, c.maxT, use_fp8, round_scale);
    const int El = c.E / c.R, cap = c.R * c.maxT, G = c.H / 128;
    ASSERT_EQ(out.size(), static_cast<std::size_t>(c.R));
    for (int r = 0; r < c.R; ++r) {
      const ref::LlDispatchOutput& o = out[r];
      ASSERT_EQ(o.recv_count.size(), static_cast<std::size_t>(El));
      ASSERT_EQ(o.src_info.size(), sz(El, cap));
      ASSERT_EQ(o.layout_range.size(), sz(El, c.R));
      if (use_fp8) {
        ASSERT_EQ(o.recv_x_fp8.size(), sz(El, cap) * c.H);
        ASSERT_EQ(o.recv_x_scales.size(), sz(El, cap) * G);
      } else {
        ASSERT_EQ(o.recv_x_bf16.size(), sz(El, cap) * c.H);
      }
      int total = 0, want_total = 0;
      for (int s = 0; s < c.R; ++s)
        for (int t = 0; t < c.T[s]; ++t)
          for (int64_t e : experts_of(in, s, t, c.K)) want_total += e / El == r;
      for (int le = 0; le < El; ++le) {
        const int e = r * El + le;
        std::vector<std::pair<int, int>> want;  // (source rank, token) in packed order
        for (int s = 0; s < c.R; ++s)
          for (int t = 0; t < c.T[s]; ++t)
            if (experts_of(in, s, t, c.K).count(e)) want.emplace_back(s, t);
        ASSERT_EQ(o.recv_count[le], static_cast<int>(want.size()));
        total += o.recv_count[le];
        for (int i = 0; i < cap; ++i) {
          const std::size_t slot = sz(le, cap) + i;
          if (i >= o.recv_count[le]) {
            ASSERT_EQ(o.src_info[slot], -1);
            ASSERT_EQ(o.recv_src_rank[slot], -1);
            if (!use_fp8) {
              for (int h = 0; h < c.H; ++h) ASSERT_EQ(o.recv_x_bf16[slot * c.H + h], 0);
            }
            continue;
          }
          const auto [s, t] = want[i];
          ASSERT_EQ(o.recv_src_rank[slot], s);
          ASSERT_EQ(o.src_info[slot], t);
          const uint16_t* xs = &in.x[s][sz(t, c.H)];
          if (use_fp8) {
            std::vector<float> xf(c.H);
            for (int h = 0; h < c.H; ++h) xf[h] = ref::bf16_to_float(xs[h]);
            std::vector<uint8_t> q(c.H);
            std::vector<float> sc(G);
            ref::quantize_row_fp8(xf.data(), c.H, round_scale, q.data(), sc.data());
            ASSERT_EQ(0, std::memcmp(&o.recv_x_fp8[slot * c.H], q.data(), c.H));
            ASSERT_EQ(0, std::memcmp(&o.recv_x_scales[slot * G], sc.data(), sz(G, 4)));
          } else {
            ASSERT_EQ(0, std::memcmp(&o.recv_x_bf16[slot * c.H], xs, sz(c.H, 2)));
          }
        }
        int begin = 0;
        for (int s = 0; s < c.R; ++s) {
          const int64_t count =
              std::count_if(want.begin(), want.end(), [s](const auto& p) { return p.first == s; });
          const int64_t lr = o.layout_range[sz(le, c.R) + s];
          EXPECT_EQ(lr >> 32, begin);
          EXPECT_EQ(lr & 0xFFFFFFFF, count);
          begin += static_cast<int>(count);
        }
      }
      EXPECT_EQ(total, want_total);
    }
  }
}

TEST(RefLl, DispatchBf16) {
  check_ll_dispatch(false, false, 701);
}
TEST(RefLl, DispatchFp8) {
  check_ll_dispatch(true, false, 702);
}
TEST(RefLl, DispatchFp8RoundScale) {
  check_ll_dispatch(true, true, 703);
}

TEST(RefLl, DuplicatePickIsSentOnce) {
  const std::vector<std::vector<uint16_t>> x = {std::vector<uint16_t>(128, 0x3F80)};
  const std::vector<std::vector<int64_t>> idx = {{1, 1, -1, 0}};
  const auto d = ref::ll_dispatch(x, idx, {1}, 128, 4, 2, 4, false, false);
  EXPECT_EQ(d[0].recv_count, (std::vector<int>{1, 1}));
  const auto y = ref::ll_combine({d[0].recv_x_bf16}, idx, {{0.25f, 0.5f, 1e6f, 2.0f}}, {1}, 128, 4,
                                 2, 4, false);
  for (uint16_t b : y[0]) EXPECT_EQ(ref::bf16_to_float(b), 2.75f);  // (0.25 + 0.5 + 2) * 1
}

// Combine of independent per-expert rows: token (s, t) must collect, for each
// valid pick k, w_k times the row its expert holds for it.
void check_ll_combine(bool use_logfmt, uint64_t seed) {
  Rng rng(seed);
  const double bound = ref::logfmt_max_rel_error();
  for (const LlCase& c : ll_cases()) {
    SCOPED_TRACE("R=" + std::to_string(c.R) + " E=" + std::to_string(c.E));
    const LlInputs in = make_ll_inputs(rng, c);
    const auto d = ref::ll_dispatch(in.x, in.idx, c.T, c.H, c.K, c.E, c.maxT, false, false);
    const int El = c.E / c.R, cap = c.R * c.maxT;
    for (int mode = 0; mode < 2; ++mode) {
      // mode 0: expert_out = dispatched x; mode 1: unrelated rows per expert.
      std::vector<std::vector<uint16_t>> eo(c.R);
      std::map<std::tuple<int64_t, int, int>, const uint16_t*> row;  // (e, s, t) -> row
      for (int r = 0; r < c.R; ++r) {
        eo[r] = mode == 0 ? d[r].recv_x_bf16 : random_bf16(rng, sz(El, cap) * c.H, false);
        for (int le = 0; le < El; ++le)
          for (int i = 0; i < d[r].recv_count[le]; ++i) {
            const std::size_t slot = sz(le, cap) + i;
            row[{r * El + le, d[r].recv_src_rank[slot], d[r].src_info[slot]}] = &eo[r][slot * c.H];
          }
      }
      const auto out = ref::ll_combine(eo, in.idx, in.w, c.T, c.H, c.K, c.E, c.maxT, use_logfmt);
      ASSERT_EQ(out.size(), static_cast<std::size_t>(c.R));
      double worst = 0.0;
      for (int s = 0; s < c.R; ++s) {
        ASSERT_EQ(out[s].size(), sz(c.T[s], c.H));
        for (int t = 0; t < c.T[s]; ++t) {
          // LogFMT codes what crosses from each rank once: the raw row where the
          // token has one distinct expert there, else the weighted sum of the
          // rank's experts' rows (`part`, exact here), which may then flush
          // values below 2^-16 of their group's largest.
          const int64_t* idx = &in.idx[s][sz(t, c.K)];
          std::vector<int> distinct(c.R, 0);
          std::set<int64_t> seen;
          for (int k = 0; k < c.K; ++k)
            if (idx[k] >= 0 && seen.insert(idx[k]).second) ++distinct[idx[k] / El];
          std::vector<std::vector<double>> part(c.R);
          for (int r = 0; r < c.R; ++r) {
            if (distinct[r] < 2) continue;
            part[r].assign(c.H, 0.0);
            for (int k = 0; k < c.K; ++k)
              if (idx[k] >= 0 && idx[k] / El == r)
                for (int h = 0; h < c.H; ++h)
                  part[r][h] +=
                      in.w[s][sz(t, c.K) + k] * ref::bf16_to_float(row.at({idx[k], s, t})[h]);
          }
          for (int h = 0; h < c.H; ++h) {
            double exact = 0.0, mag = 0.0, flush = 0.0;
            for (int k = 0; k < c.K; ++k) {
              const int64_t e = idx[k];
              if (e < 0) continue;
              const double w = in.w[s][sz(t, c.K) + k];
              const uint16_t* er = row.at({e, s, t});
              const double v = ref::bf16_to_float(er[h]);
              exact += w * v;
              mag += std::fabs(w * v);
              if (distinct[e / El] >= 2) continue;  // coded in its rank's sum
              double amax = 0.0;
              for (int i = h / 128 * 128; i < h / 128 * 128 + 128; ++i)
                amax = std::max(amax, std::fabs(double{ref::bf16_to_float(er[i])}));
              if (std::fabs(v) < amax * 0x1p-16) flush += std::fabs(w * v);
            }
            for (int r = 0; r < c.R; ++r) {
              if (part[r].empty()) continue;
              double amax = 0.0;
              for (int i = h / 128 * 128; i < h / 128 * 128 + 128; ++i)
                amax = std::max(amax, std::fabs(part[r][i]));
              // 2^-15: the sum is float32 where it is coded, exact here
              if (std::fabs(part[r][h]) < amax * 0x1p-15) flush += std::fabs(part[r][h]);
            }
            if (mode == 0) {
              // sum_k w_k * x with x the token's own row.
              double wsum = 0.0;
              for (int k = 0; k < c.K; ++k)
                if (in.idx[s][sz(t, c.K) + k] >= 0) wsum += in.w[s][sz(t, c.K) + k];
              ASSERT_NEAR(exact, wsum * ref::bf16_to_float(in.x[s][sz(t, c.H) + h]),
                          1e-9 * (1 + mag));
            }
            const double got = ref::bf16_to_float(out[s][sz(t, c.H) + h]);
            // bf16 output rounding, float accumulation, and (logfmt) the per-value bound.
            const double tol = std::fabs(exact) * 0x1p-8 + mag * (c.K * 0x1p-23) +
                               (use_logfmt ? mag * bound * (1 + 0x1p-7) + flush : 0.0);
            ASSERT_LE(std::fabs(got - exact), tol) << "s=" << s << " t=" << t << " h=" << h;
            if (mag > 0) worst = std::max(worst, std::fabs(got - exact) / mag);
          }
        }
      }
      // Logfmt really changes values (its error exceeds bf16's on some output).
      if (use_logfmt && std::accumulate(c.T.begin(), c.T.end(), 0) >= 20) {
        EXPECT_GT(worst, 0x1p-8);
      }
    }
  }
}

TEST(RefLl, CombinePlain) {
  check_ll_combine(false, 801);
}
TEST(RefLl, CombineLogfmt) {
  check_ll_combine(true, 802);
}

TEST(RefLl, CombineLogfmtCloseToPlain) {
  Rng rng(803);
  const LlCase c{4, 16, 4, 256, 40, {37, 0, 40, 5}};
  const LlInputs in = make_ll_inputs(rng, c);
  const auto d = ref::ll_dispatch(in.x, in.idx, c.T, c.H, c.K, c.E, c.maxT, false, false);
  std::vector<std::vector<uint16_t>> eo;
  for (const auto& o : d) eo.push_back(o.recv_x_bf16);
  const auto plain = ref::ll_combine(eo, in.idx, in.w, c.T, c.H, c.K, c.E, c.maxT, false);
  const auto lf = ref::ll_combine(eo, in.idx, in.w, c.T, c.H, c.K, c.E, c.maxT, true);
  const double bound = ref::logfmt_max_rel_error();
  int differ = 0;
  for (int s = 0; s < c.R; ++s)
    for (int t = 0; t < c.T[s]; ++t) {
      double wabs = 0.0;
      for (int k = 0; k < c.K; ++k)
        if (in.idx[s][sz(t, c.K) + k] >= 0) wabs += std::fabs(in.w[s][sz(t, c.K) + k]);
      for (int h = 0; h < c.H; ++h) {
        const double a = ref::bf16_to_float(plain[s][sz(t, c.H) + h]);
        const double b = ref::bf16_to_float(lf[s][sz(t, c.H) + h]);
        const double x = std::fabs(ref::bf16_to_float(in.x[s][sz(t, c.H) + h]));
        double amax = 0.0;
        for (int i = h / 128 * 128; i < h / 128 * 128 + 128; ++i)
          amax = std::max(amax, std::fabs(double{ref::bf16_to_float(in.x[s][sz(t, c.H) + i])}));
        const double flush = x < amax * 0x1p-16 ? wabs * x : 0.0;
        differ += a != b;
        // Per-value LogFMT error plus the bf16 rounding of both results.
        ASSERT_LE(std::fabs(a - b), wabs * x * (bound * (1 + 0x1p-7) + 0x1p-7 + 0x1p-20) + flush);
      }
    }
  EXPECT_GT(differ, 0);
}

// ---- LogFMT ---------------------------------------------------------------------

TEST(RefLogfmt, SizeAndBound) {
  EXPECT_EQ(ref::logfmt_bytes(128), 168u);
  EXPECT_EQ(ref::logfmt_bytes(7168), 56u * 168u);
  const double b = ref::logfmt_max_rel_error();
  EXPECT_GT(b, 0.01095);  // 2^(16/1020) - 1 = 0.010932 plus the float arithmetic's terms
  EXPECT_LT(b, 0.01097);
  EXPECT_THROW(ref::logfmt_bytes(100), std::invalid_argument);
}

TEST(RefLogfmt, RoundTripWithinBound) {
  Rng rng(901);
  const double bound = ref::logfmt_max_rel_error();
  const int H = 128 * 16;
  double worst = 0.0;
  int flushed = 0;
  for (int iter = 0; iter < 200; ++iter) {
    std::vector<float> x(H);
    for (int g = 0; g < H / 128; ++g) {
      const int kind = g % 8;
      const double center = rng.uniform(-100.0, 100.0);  // log2 of the group's magnitude
      for (int i = 0; i < 128; ++i) {
        double l = center;
        switch (kind) {
          case 0:
            l += rng.uniform(-2.0, 2.0);
            break;  // narrow range
          case 1:
            l += rng.uniform(-8.0, 8.0);
            break;  // just under the clamp
          case 2:
            l += rng.uniform(-15.0, 15.0);
            break;  // clamped: small values may flush
          case 3:
            l = 0.0;
            break;  // all equal magnitude
          case 4:
            l = i == 5 ? center : -1000.0;
            break;  // a single nonzero
          case 5:
            l = rng.uniform(120.0, 127.99);
            break;  // near FLT_MAX
          case 6:
            l = rng.uniform(-126.0, -110.0);
            break;  // near FLT_MIN
          default:
            l += rng.uniform(-1.0, 1.0);
            break;
        }
        float v = l < -500.0 ? 0.0f : static_cast<float>(std::exp2(l));
        if (kind == 7 && rng.chance(0.3)) v = 0.0f;
        if (kind == 0 && i == 0) v = -0.0f;
        x[g * 128 + i] = rng.chance(0.5) ? -v : v;
      }
    }
    const std::vector<uint8_t> code = ref::logfmt_encode(x);
    ASSERT_EQ(code.size(), ref::logfmt_bytes(H));
    const std::vector<float> y = ref::logfmt_decode(code, H);
    ASSERT_EQ(y.size(), x.size());
    for (int g = 0; g < H / 128; ++g) {
      double amax = 0.0;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(double{x[g * 128 + i]}));
      for (int i = 0; i < 128; ++i) {
        const double xi = x[g * 128 + i], yi = y[g * 128 + i];
        if (xi == 0.0) {
          ASSERT_EQ(yi, 0.0);
          continue;
        }
        ASSERT_EQ(std::signbit(xi), std::signbit(yi));
        const double rel = std::fabs(yi - xi) / std::fabs(xi);
        if (std::fabs(xi) >= amax * 0x1p-16) {
          ASSERT_LE(rel, bound) << "x=" << xi << " y=" << yi << " group kind " << g % 8;
          worst = std::max(worst, rel);
        } else if (yi == 0.0) {
          ++flushed;  // below the group's floor
        } else {
          ASSERT_LE(rel, bound);
        }
      }
    }
  }
  EXPECT_GT(worst, 0.8 * bound);  // the bound is nearly attained
  EXPECT_GT(flushed, 0);          // the clamp did happen
}

// log2_approx over every mantissa of the binades around 1 (where the
// polynomial alone decides), and of the extreme and some random exponents
// (where the final addition of the exponent rounds).
TEST(RefLogfmt, Log2ApproxWithinItsBound) {
  namespace lm = epx::logfmt_math;
  Rng rng(905);
  std::vector<int> exps = {-126, -125, -1, 0, 1, 126, 127};
  for (int i = 0; i < 6; ++i) exps.push_back(rng.uniform_int(-126, 127));
  double worst = 0.0, worst_poly = 0.0;
  for (const int e : exps) {
    for (uint32_t m = 0; m < (1u << 23); ++m) {
      const float a = float_of((static_cast<uint32_t>(e + 127) << 23) | m);
      const double err = std::fabs(double{lm::log2_approx(a)} - std::log2(double{a}));
      worst = std::max(worst, err);
      if (e == 0 || e == -1) worst_poly = std::max(worst_poly, err);
    }
  }
  EXPECT_LE(worst, lm::kLog2AbsError);
  EXPECT_LT(worst_poly, 3e-6);  // the polynomial itself, where e adds nothing
}

// exp2_approx relative to 2^x over [-126, 128) in steps of 2^-12 and at
// random points; past FLT_MAX it gives inf, below FLT_MIN a subnormal close
// to 2^x, and it is exact at integers.
TEST(RefLogfmt, Exp2ApproxWithinItsBound) {
  namespace lm = epx::logfmt_math;
  Rng rng(906);
  double worst = 0.0;
  auto check = [&](float x) {
    const double want = std::exp2(double{x});
    const double got = lm::exp2_approx(x);
    worst = std::max(worst, std::fabs(got / want - 1.0));
  };
  for (int i = -126 * 4096; i < 128 * 4096; ++i) check(static_cast<float>(i) / 4096.0f);
  for (int i = 0; i < 1000000; ++i) check(static_cast<float>(rng.uniform(-126.0, 127.99)));
  EXPECT_LE(worst, lm::kExp2RelError);
  for (int n = -126; n <= 127; ++n)
    EXPECT_EQ(lm::exp2_approx(static_cast<float>(n)), std::ldexp(1.0f, n)) << n;
  EXPECT_EQ(lm::exp2_approx(128.5f), INFINITY);
  const float sub = lm::exp2_approx(-140.25f);
  EXPECT_LT(sub, FLT_MIN);
  EXPECT_NEAR(sub, std::exp2(-140.25), 0x1p-149);
}

TEST(RefLogfmt, KnownGroup) {
  std::vector<float> x(128, 0.0f);
  x[0] = 1.0f;
  x[1] = -2.0f;
  x[2] = 4.0f;  // range 2 -> step 2/510; powers of two on exact levels
  const auto code = ref::logfmt_encode(x);
  const auto y = ref::logfmt_decode(code, 128);
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[1], -2.0f);
  EXPECT_EQ(y[2], 4.0f);
  for (int i = 3; i < 128; ++i) EXPECT_EQ(y[i], 0.0f);
  std::vector<float> zeros(256, 0.0f);
  EXPECT_EQ(ref::logfmt_decode(ref::logfmt_encode(zeros), 256), zeros);
  x[3] = NAN;
  EXPECT_THROW(ref::logfmt_encode(x), std::invalid_argument);
  // Headers no encoder writes are refused (they would leave exp2's range).
  auto with_header = [&](float lmax, float range) {
    std::vector<uint8_t> code = ref::logfmt_encode(zeros);
    std::memcpy(code.data() + 168, &lmax, 4);  // the second group
    std::memcpy(code.data() + 172, &range, 4);
    return code;
  };
  EXPECT_NO_THROW(ref::logfmt_decode(with_header(127.9f, 16.0f), 256));
  EXPECT_THROW(ref::logfmt_decode(with_header(1000.0f, 1.0f), 256), std::invalid_argument);
  EXPECT_THROW(ref::logfmt_decode(with_header(-300.0f, 1.0f), 256), std::invalid_argument);
  EXPECT_THROW(ref::logfmt_decode(with_header(0.0f, 17.0f), 256), std::invalid_argument);
  EXPECT_THROW(ref::logfmt_decode(with_header(0.0f, -1.0f), 256), std::invalid_argument);
  EXPECT_THROW(ref::logfmt_decode(with_header(NAN, 1.0f), 256), std::invalid_argument);
}

}  // namespace
