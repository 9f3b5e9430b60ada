// get_dispatch_layout of the CPU reference model.
#include <stdexcept>
#include <string>

#include "epx/reference.hpp"

namespace epx::ref {

Layout get_dispatch_layout(const std::vector<int64_t>& topk_idx, int num_tokens, int num_topk,
                           int num_experts, int num_ranks, int ranks_per_node) {
  if (ranks_per_node < 0 || (ranks_per_node > 0 && num_ranks % ranks_per_node != 0))
    throw std::invalid_argument("get_dispatch_layout: ranks_per_node must divide num_ranks");
  if (num_tokens < 0 || num_topk <= 0 || num_ranks <= 0 || num_experts <= 0 ||
      num_experts % num_ranks != 0)
    throw std::invalid_argument("get_dispatch_layout: bad sizes (need E % R == 0, K > 0)");
  if (topk_idx.size() != static_cast<std::size_t>(num_tokens) * num_topk)
    throw std::invalid_argument("get_dispatch_layout: topk_idx must be [T, K]");
  const int per_rank = num_experts / num_ranks;
  Layout out;
  out.num_tokens_per_rank.assign(num_ranks, 0);
  out.num_tokens_per_expert.assign(num_experts, 0);
  out.is_token_in_rank.assign(static_cast<std::size_t>(num_tokens) * num_ranks, 0);
  if (ranks_per_node > 0) out.num_tokens_per_node.assign(num_ranks / ranks_per_node, 0);
  for (int t = 0; t < num_tokens; ++t) {
    uint8_t* in_rank = out.is_token_in_rank.data() + static_cast<std::size_t>(t) * num_ranks;
    for (int k = 0; k < num_topk; ++k) {
      const int64_t e = topk_idx[static_cast<std::size_t>(t) * num_topk + k];
      if (e < 0) continue;
      if (e >= num_experts)
        throw std::invalid_argument("get_dispatch_layout: expert id " + std::to_string(e) +
                                    " >= num_experts");
      ++out.num_tokens_per_expert[e];
      in_rank[e / per_rank] = 1;
    }
    for (int r = 0; r < num_ranks; ++r) out.num_tokens_per_rank[r] += in_rank[r];
    for (int n = 0; ranks_per_node > 0 && n < num_ranks / ranks_per_node; ++n) {
      bool any = false;
      for (int r = n * ranks_per_node; r < (n + 1) * ranks_per_node; ++r) any = any || in_rank[r];
      out.num_tokens_per_node[n] += any ? 1 : 0;
    }
  }
  return out;
}

}  // namespace epx::ref
