#include <random>
#include <utility>

#include "epx/reference.hpp"

namespace epx::ref {

std::vector<int64_t> random_topk(int num_tokens, int num_topk, int num_experts, double masked,
                                 uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::vector<int64_t> out(static_cast<std::size_t>(num_tokens) * num_topk);
  std::vector<int> perm(num_experts);
  for (int t = 0; t < num_tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) perm[e] = e;
    for (int k = 0; k < num_topk; ++k) {
      std::uniform_int_distribution<int> u(k, num_experts - 1);
      std::swap(perm[k], perm[u(g)]);
      const bool m = masked > 0 && coin(g) < masked;
      out[static_cast<std::size_t>(t) * num_topk + k] = m ? -1 : perm[k];
    }
  }
  return out;
}

std::vector<uint16_t> random_bf16(std::size_t n, uint64_t seed, float scale) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(d(g));
  return v;
}

}  // namespace epx::ref
