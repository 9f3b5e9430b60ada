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
#include "unit/reference_test_util.hpp"

namespace ref = epx::ref;

namespace {

using namespace epx::reftest;  // NOLINT(build/namespaces): the shared generators

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

}  // namespace
