// Low-latency dispatch / combine of the CPU reference model.
//
// Every (source rank s, token t, expert e) with e among t's valid top-k picks
// is sent once to the rank owning e, even if t picks e more than once. On the
// owner, expert e's rows are packed from row 0: source 0's tokens in token
// order, then source 1's, and so on.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common.hpp"
#include "epx/reference.hpp"

namespace epx::ref {
namespace {

constexpr int kGroup = detail::kScaleGroup;
using detail::check;
using detail::sz;

void check_sizes(const char* fn, int R, const std::vector<int>& num_tokens,
                 const std::vector<std::vector<int64_t>>& topk_idx, int hidden, int num_topk,
                 int num_experts, int max_tokens) {
  const std::string f(fn);
  check(R > 0, f + ": need at least one rank");
  check(hidden > 0 && num_topk > 0 && max_tokens >= 0, f + ": bad hidden/num_topk/max_tokens");
  check(num_experts > 0 && num_experts % R == 0,
        f + ": num_experts must be a positive multiple of the rank count");
  check(topk_idx.size() == static_cast<std::size_t>(R), f + ": need topk_idx for every rank");
  for (int s = 0; s < R; ++s) {
    const std::string who = f + ": rank " + std::to_string(s) + ": ";
    check(num_tokens[s] >= 0 && num_tokens[s] <= max_tokens, who + "need 0 <= T <= max_tokens");
    check(topk_idx[s].size() == sz(num_tokens[s], num_topk), who + "topk_idx must be [T, K]");
    for (int64_t e : topk_idx[s]) check(e < num_experts, who + "expert id >= num_experts");
  }
}

// The distinct valid experts of one top-k row, in order of first appearance.
int distinct_experts(const int64_t* row, int num_topk, int64_t* out) {
  int n = 0;
  for (int k = 0; k < num_topk; ++k) {
    const int64_t e = row[k];
    if (e < 0 || std::find(out, out + n, e) != out + n) continue;
    out[n++] = e;
  }
  return n;
}

// Packed-row placement shared by dispatch and combine.
struct Placement {
  std::vector<int> count;  ///< [E, R]: tokens of source s that expert e receives
  std::vector<int> begin;  ///< [E, R]: first row of source s's block for expert e
};

Placement place(const std::vector<std::vector<int64_t>>& topk_idx,
                const std::vector<int>& num_tokens, int num_topk, int num_experts) {
  const int R = static_cast<int>(num_tokens.size());
  Placement p;
  p.count.assign(sz(num_experts, R), 0);
  p.begin.assign(sz(num_experts, R), 0);
  std::vector<int64_t> picks(num_topk);
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < num_tokens[s]; ++t) {
      const int n = distinct_experts(&topk_idx[s][sz(t, num_topk)], num_topk, picks.data());
      for (int i = 0; i < n; ++i) ++p.count[sz(picks[i], R) + s];
    }
  for (int e = 0; e < num_experts; ++e) {
    int row = 0;
    for (int s = 0; s < R; ++s) {
      p.begin[sz(e, R) + s] = row;
      row += p.count[sz(e, R) + s];
    }
  }
  return p;
}

}  // namespace

std::vector<LlDispatchOutput> ll_dispatch(const std::vector<std::vector<uint16_t>>& x,
                                          const std::vector<std::vector<int64_t>>& topk_idx,
                                          const std::vector<int>& num_tokens, int hidden,
                                          int num_topk, int num_experts, int max_tokens,
                                          bool use_fp8, bool round_scale) {
  const int R = static_cast<int>(num_tokens.size());
  check_sizes("ll_dispatch", R, num_tokens, topk_idx, hidden, num_topk, num_experts, max_tokens);
  check(x.size() == static_cast<std::size_t>(R), "ll_dispatch: need x for every rank");
  for (int s = 0; s < R; ++s)
    check(x[s].size() == sz(num_tokens[s], hidden),
          "ll_dispatch: rank " + std::to_string(s) + ": x must be [T, H]");
  check(!use_fp8 || hidden % kGroup == 0, "ll_dispatch: fp8 needs hidden % 128 == 0");

  const int E_local = num_experts / R;
  const int cap = R * max_tokens;  // rows per local expert
  const int G = hidden / kGroup;
  const Placement p = place(topk_idx, num_tokens, num_topk, num_experts);

  std::vector<LlDispatchOutput> outs(R);
  for (int r = 0; r < R; ++r) {
    LlDispatchOutput& o = outs[r];
    if (use_fp8) {
      o.recv_x_fp8.assign(sz(E_local, cap) * hidden, 0);
      o.recv_x_scales.assign(sz(E_local, cap) * G, 0.0f);
    } else {
      o.recv_x_bf16.assign(sz(E_local, cap) * hidden, 0);
    }
    o.recv_count.assign(E_local, 0);
    o.src_info.assign(sz(E_local, cap), -1);
    o.recv_src_rank.assign(sz(E_local, cap), -1);
    o.layout_range.assign(sz(E_local, R), 0);
    for (int le = 0; le < E_local; ++le) {
      const int e = r * E_local + le;
      for (int s = 0; s < R; ++s) {
        const int64_t b = p.begin[sz(e, R) + s], c = p.count[sz(e, R) + s];
        o.layout_range[sz(le, R) + s] = (b << 32) | c;
        o.recv_count[le] += static_cast<int>(c);
      }
    }
  }

  // Walk the sources in (rank, token) order and append each token to the
  // blocks of its distinct experts; this yields the packed order directly.
  std::vector<int> fill(num_experts, 0);  // rows written so far per global expert
  std::vector<int64_t> picks(num_topk);
  std::vector<float> xf(hidden);
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < num_tokens[s]; ++t) {
      const uint16_t* xs = &x[s][sz(t, hidden)];
      const int n = distinct_experts(&topk_idx[s][sz(t, num_topk)], num_topk, picks.data());
      if (n > 0 && use_fp8)
        for (int h = 0; h < hidden; ++h) xf[h] = bf16_to_float(xs[h]);
      for (int i = 0; i < n; ++i) {
        const int e = static_cast<int>(picks[i]);
        LlDispatchOutput& o = outs[e / E_local];
        const std::size_t slot = sz(e % E_local, cap) + fill[e]++;
        if (use_fp8) {
          quantize_row_fp8(xf.data(), hidden, round_scale, &o.recv_x_fp8[slot * hidden],
                           &o.recv_x_scales[slot * G]);
        } else {
          std::memcpy(&o.recv_x_bf16[slot * hidden], xs, sz(hidden, sizeof(uint16_t)));
        }
        o.src_info[slot] = t;
        o.recv_src_rank[slot] = s;
      }
    }
  return outs;
}

std::vector<std::vector<uint16_t>> ll_combine(const std::vector<std::vector<uint16_t>>& expert_out,
                                              const std::vector<std::vector<int64_t>>& topk_idx,
                                              const std::vector<std::vector<float>>& topk_weights,
                                              const std::vector<int>& num_tokens, int hidden,
                                              int num_topk, int num_experts, int max_tokens,
                                              bool use_logfmt) {
  const int R = static_cast<int>(num_tokens.size());
  check_sizes("ll_combine", R, num_tokens, topk_idx, hidden, num_topk, num_experts, max_tokens);
  check(!use_logfmt || hidden % kGroup == 0, "ll_combine: logfmt needs hidden % 128 == 0");
  const int E_local = num_experts / R;
  const int cap = R * max_tokens;
  check(
      expert_out.size() == static_cast<std::size_t>(R) && topk_weights.size() == expert_out.size(),
      "ll_combine: need expert_out and topk_weights for every rank");
  for (int r = 0; r < R; ++r) {
    const std::string who = "ll_combine: rank " + std::to_string(r) + ": ";
    check(expert_out[r].size() == sz(E_local, cap) * hidden,
          who + "expert_out must be [E_local, R*max_tokens, H]");
    check(topk_weights[r].size() == sz(num_tokens[r], num_topk),
          who + "topk_weights must be [T, K]");
  }

  const Placement p = place(topk_idx, num_tokens, num_topk, num_experts);
  std::vector<std::vector<uint16_t>> outs(R);
  std::vector<int> cursor(num_experts);
  std::vector<int64_t> picks(num_topk);
  std::vector<int> rows(num_topk);
  std::vector<float> acc(hidden), row_f(hidden), part(hidden);
  for (int s = 0; s < R; ++s) {
    const int T = num_tokens[s];
    outs[s].resize(sz(T, hidden));
    std::fill(cursor.begin(), cursor.end(), 0);
    for (int t = 0; t < T; ++t) {
      const int64_t* idx = &topk_idx[s][sz(t, num_topk)];
      const int n = distinct_experts(idx, num_topk, picks.data());
      for (int i = 0; i < n; ++i) rows[i] = p.begin[sz(picks[i], R) + s] + cursor[picks[i]]++;
      std::fill(acc.begin(), acc.end(), 0.0f);
      auto expert_row = [&](int64_t e) {
        const int row = rows[std::find(picks.begin(), picks.begin() + n, e) - picks.begin()];
        const uint16_t* src = &expert_out[e / E_local][(sz(e % E_local, cap) + row) *
                                                       static_cast<std::size_t>(hidden)];
        for (int h = 0; h < hidden; ++h) row_f[h] = bf16_to_float(src[h]);
      };
      const float* w_t = &topk_weights[s][sz(t, num_topk)];
      if (!use_logfmt) {
        for (int k = 0; k < num_topk; ++k) {
          if (idx[k] < 0) continue;
          expert_row(idx[k]);
          for (int h = 0; h < hidden; ++h) acc[h] = std::fma(w_t[k], row_f[h], acc[h]);
        }
      } else {
        // What crosses from each rank r the token reached, in ascending r, is
        // LogFMT-coded once: with one distinct expert there its raw row,
        // weighted here by each pick naming r (in k order); with several the
        // float32 sum, at r, of each expert's row times the sum of its picks'
        // weights (in k order), in ascending expert id, added here as it is.
        std::vector<int64_t> here;  // the token's distinct experts on r, ascending
        for (int r = 0; r < R; ++r) {
          here.clear();
          for (int i = 0; i < n; ++i)
            if (picks[i] / E_local == r) here.push_back(picks[i]);
          std::sort(here.begin(), here.end());
          if (here.empty()) continue;
          if (here.size() == 1) {
            expert_row(here[0]);
            row_f = logfmt_decode(logfmt_encode(row_f), hidden);
            for (int k = 0; k < num_topk; ++k)
              if (idx[k] >= 0 && idx[k] / E_local == r)
                for (int h = 0; h < hidden; ++h) acc[h] = std::fma(w_t[k], row_f[h], acc[h]);
            continue;
          }
          std::fill(part.begin(), part.end(), 0.0f);
          for (const int64_t e : here) {
            float wsum = 0.0f;
            for (int k = 0; k < num_topk; ++k)
              if (idx[k] == e) wsum += w_t[k];
            expert_row(e);
            for (int h = 0; h < hidden; ++h) part[h] = std::fma(wsum, row_f[h], part[h]);
          }
          part = logfmt_decode(logfmt_encode(part), hidden);
          for (int h = 0; h < hidden; ++h) acc[h] += part[h];
        }
      }
      for (int h = 0; h < hidden; ++h) outs[s][sz(t, hidden) + h] = float_to_bf16(acc[h]);
    }
  }
  return outs;
}

}  // namespace epx::ref
