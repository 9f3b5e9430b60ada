// High-throughput dispatch / combine of the CPU reference model.
//
// Receive order on rank r: rows grouped by source rank 0..R-1, and within a
// source in increasing token order; a token is received once per destination
// rank, however many of its top-k experts live there.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "common.hpp"
#include "epx/reference.hpp"

namespace epx::ref {
namespace {

constexpr int kGroup = detail::kScaleGroup;
using detail::check;
using detail::sz;

// Per-source layouts: is_token_in_rank and num_tokens_per_rank of every rank's input.
std::vector<Layout> source_layouts(const std::vector<HtInput>& inputs, int num_topk,
                                   int num_experts) {
  const int R = static_cast<int>(inputs.size());
  std::vector<Layout> layouts;
  layouts.reserve(R);
  for (const HtInput& in : inputs)
    layouts.push_back(get_dispatch_layout(in.topk_idx, in.num_tokens, num_topk, num_experts, R));
  return layouts;
}

// base[r * R + s]: first row of source s's block in rank r's receive order.
std::vector<int> block_bases(const std::vector<Layout>& layouts) {
  const int R = static_cast<int>(layouts.size());
  std::vector<int> base(sz(R, R), 0);
  for (int r = 0; r < R; ++r) {
    int row = 0;
    for (int s = 0; s < R; ++s) {
      base[r * R + s] = row;
      row += layouts[s].num_tokens_per_rank[r];
    }
  }
  return base;
}

void check_common(int R, int hidden, int num_topk, int num_experts, const char* fn) {
  check(R > 0, std::string(fn) + ": need at least one rank");
  check(hidden > 0 && num_topk > 0, std::string(fn) + ": hidden and num_topk must be > 0");
  check(num_experts > 0 && num_experts % R == 0,
        std::string(fn) + ": num_experts must be a positive multiple of the rank count");
}

}  // namespace

std::vector<HtDispatchOutput> ht_dispatch(const std::vector<HtInput>& inputs, int hidden,
                                          int num_topk, int num_experts, int expert_alignment) {
  const int R = static_cast<int>(inputs.size());
  check_common(R, hidden, num_topk, num_experts, "ht_dispatch");
  check(expert_alignment >= 1, "ht_dispatch: expert_alignment must be >= 1");
  const bool fp8 = inputs[0].fp8;
  const int G = hidden / kGroup;
  bool has_weights = false;
  for (int s = 0; s < R; ++s) {
    const HtInput& in = inputs[s];
    const std::string who = "ht_dispatch: rank " + std::to_string(s) + ": ";
    check(in.num_tokens >= 0, who + "num_tokens < 0");
    check(in.fp8 == fp8, who + "all ranks must agree on fp8");
    if (fp8) {
      check(hidden % kGroup == 0, who + "fp8 needs hidden % 128 == 0");
      check(in.x_fp8.size() == sz(in.num_tokens, hidden), who + "x_fp8 must be [T, H]");
      check(in.x_scales.size() == sz(in.num_tokens, G), who + "x_scales must be [T, H/128]");
    } else {
      check(in.x_bf16.size() == sz(in.num_tokens, hidden), who + "x_bf16 must be [T, H]");
    }
    check(in.topk_idx.size() == sz(in.num_tokens, num_topk), who + "topk_idx must be [T, K]");
    has_weights = has_weights || !in.topk_weights.empty();
  }
  if (has_weights)
    for (int s = 0; s < R; ++s)
      check(inputs[s].topk_weights.size() == sz(inputs[s].num_tokens, num_topk),
            "ht_dispatch: rank " + std::to_string(s) +
                ": topk_weights must be [T, K] when any rank passes weights");

  const std::vector<Layout> layouts = source_layouts(inputs, num_topk, num_experts);
  const int E_local = num_experts / R;
  std::vector<int> prefix(sz(R, R), 0), source_tokens(R, 0);
  for (int j = 0; j < R; ++j)
    for (int i = 0, acc = 0; i < R; ++i) {
      acc += layouts[i].num_tokens_per_rank[j];
      prefix[sz(i, R) + j] = acc;
    }
  for (int s = 0; s < R; ++s) source_tokens[s] = inputs[s].num_tokens;
  std::vector<HtDispatchOutput> outs(R);
  for (int r = 0; r < R; ++r) {
    HtDispatchOutput& o = outs[r];
    o.rank_prefix_matrix = prefix;
    o.source_num_tokens = source_tokens;
    int N = 0;
    for (int s = 0; s < R; ++s) N += layouts[s].num_tokens_per_rank[r];
    o.num_recv_tokens = N;
    // Rows are appended below (no zero fill first: these can be gigabytes).
    if (fp8) {
      o.recv_x_fp8.reserve(sz(N, hidden));
      o.recv_x_scales.reserve(sz(N, G));
    } else {
      o.recv_x_bf16.reserve(sz(N, hidden));
    }
    o.recv_topk_idx.resize(sz(N, num_topk));
    if (has_weights) o.recv_topk_weights.resize(sz(N, num_topk));
    o.num_recv_tokens_per_expert.assign(E_local, 0);
    o.recv_src_rank.resize(N);
    o.recv_src_idx.resize(N);

    const int64_t first_expert = static_cast<int64_t>(r) * E_local;
    int row = 0;
    for (int s = 0; s < R; ++s) {
      const HtInput& in = inputs[s];
      for (int t = 0; t < in.num_tokens; ++t) {
        if (!layouts[s].is_token_in_rank[sz(t, R) + r]) continue;
        if (fp8) {
          const auto q = in.x_fp8.begin() + sz(t, hidden);
          o.recv_x_fp8.insert(o.recv_x_fp8.end(), q, q + hidden);
          const auto sc = in.x_scales.begin() + sz(t, G);
          o.recv_x_scales.insert(o.recv_x_scales.end(), sc, sc + G);
        } else {
          const auto xs = in.x_bf16.begin() + sz(t, hidden);
          o.recv_x_bf16.insert(o.recv_x_bf16.end(), xs, xs + hidden);
        }
        for (int k = 0; k < num_topk; ++k) {
          const int64_t e = in.topk_idx[sz(t, num_topk) + k];
          int64_t local = -1;
          if (e >= first_expert && e < first_expert + E_local) {
            local = e - first_expert;
            ++o.num_recv_tokens_per_expert[local];
          }
          o.recv_topk_idx[sz(row, num_topk) + k] = local;
          // DeepEP's meaning: a pick of another rank's expert arrives with weight 0.
          if (has_weights)
            o.recv_topk_weights[sz(row, num_topk) + k] =
                local >= 0 ? in.topk_weights[sz(t, num_topk) + k] : 0.0f;
        }
        o.recv_src_rank[row] = s;
        o.recv_src_idx[row] = t;
        ++row;
      }
    }
    for (int& c : o.num_recv_tokens_per_expert)
      c = (c + expert_alignment - 1) / expert_alignment * expert_alignment;
  }
  return outs;
}

std::vector<HtCombineOutput> ht_combine(const std::vector<HtInput>& routing,
                                        const std::vector<HtCombineInput>& inputs, int hidden,
                                        int num_topk, int num_experts, int ranks_per_node) {
  const int R = static_cast<int>(routing.size());
  check_common(R, hidden, num_topk, num_experts, "ht_combine");
  check(ranks_per_node >= 0 && (ranks_per_node == 0 || R % ranks_per_node == 0),
        "ht_combine: ranks_per_node must be 0 or divide the rank count");
  // One node: no row crosses a network, one sum. Across nodes each node's row
  // travels as BF16.
  const int L = ranks_per_node == 0 ? R : ranks_per_node;
  const bool crosses = L < R;
  check(inputs.size() == routing.size(), "ht_combine: need one input per rank");
  for (int s = 0; s < R; ++s)
    check(routing[s].num_tokens >= 0 &&
              routing[s].topk_idx.size() == sz(routing[s].num_tokens, num_topk),
          "ht_combine: rank " + std::to_string(s) + ": routing topk_idx must be [T, K]");

  const std::vector<Layout> layouts = source_layouts(routing, num_topk, num_experts);
  const std::vector<int> base = block_bases(layouts);
  std::vector<int> num_recv(R, 0);
  bool has_weights = false;
  for (int r = 0; r < R; ++r) {
    for (int s = 0; s < R; ++s) num_recv[r] += layouts[s].num_tokens_per_rank[r];
    const std::string who = "ht_combine: rank " + std::to_string(r) + ": ";
    check(inputs[r].x.size() == sz(num_recv[r], hidden), who + "x must be [num_recv_tokens, H]");
    has_weights = has_weights || !inputs[r].topk_weights.empty();
    for (const auto* b : {&inputs[r].bias_0, &inputs[r].bias_1})
      check(b->empty() || b->size() == sz(routing[r].num_tokens, hidden),
            who + "bias must be empty or [T, H]");
  }
  if (has_weights)
    for (int r = 0; r < R; ++r)
      check(inputs[r].topk_weights.size() == sz(num_recv[r], num_topk),
            "ht_combine: rank " + std::to_string(r) +
                ": topk_weights must be [num_recv_tokens, K] when any rank passes weights");

  std::vector<HtCombineOutput> outs(R);
  std::vector<float> acc(hidden), node_acc(hidden);
  std::vector<float> wacc(num_topk), node_wacc(num_topk);
  std::vector<int> cursor(R);
  for (int s = 0; s < R; ++s) {
    const int T = routing[s].num_tokens;
    const HtCombineInput& own = inputs[s];
    HtCombineOutput& o = outs[s];
    o.combined_x.resize(sz(T, hidden));
    if (has_weights) o.combined_topk_weights.resize(sz(T, num_topk));
    std::fill(cursor.begin(), cursor.end(), 0);
    for (int t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(wacc.begin(), wacc.end(), 0.0f);
      for (int n = 0; n < R / L; ++n) {
        std::fill(node_acc.begin(), node_acc.end(), 0.0f);
        std::fill(node_wacc.begin(), node_wacc.end(), 0.0f);
        bool reached = false;
        for (int r = n * L; r < (n + 1) * L; ++r) {
          if (!layouts[s].is_token_in_rank[sz(t, R) + r]) continue;
          reached = true;
          const int row = base[r * R + s] + cursor[r]++;
          const uint16_t* xr = &inputs[r].x[sz(row, hidden)];
          for (int h = 0; h < hidden; ++h) node_acc[h] += bf16_to_float(xr[h]);
          if (has_weights)
            for (int k = 0; k < num_topk; ++k)
              node_wacc[k] += inputs[r].topk_weights[sz(row, num_topk) + k];
        }
        if (!reached) continue;
        for (int h = 0; h < hidden; ++h)
          acc[h] += crosses ? bf16_to_float(float_to_bf16(node_acc[h])) : node_acc[h];
        for (int k = 0; k < num_topk; ++k) wacc[k] += node_wacc[k];
      }
      for (const auto* b : {&own.bias_0, &own.bias_1})
        if (!b->empty())
          for (int h = 0; h < hidden; ++h) acc[h] += bf16_to_float((*b)[sz(t, hidden) + h]);
      for (int h = 0; h < hidden; ++h) o.combined_x[sz(t, hidden) + h] = float_to_bf16(acc[h]);
      if (has_weights)
        std::copy(wacc.begin(), wacc.end(), o.combined_topk_weights.begin() + sz(t, num_topk));
    }
  }
  return outs;
}

}  // namespace epx::ref
