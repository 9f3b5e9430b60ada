// Property tests of the CPU reference model (epx/reference.hpp): the
// low-latency dispatch and combine, and LogFMT.
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
