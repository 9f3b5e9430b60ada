// Fuzzed argument validation: seeded random argument sets (shapes, dtypes,
// strides, devices, null data, index ranges, configs, handles made for other
// calls or buffers) go to the validation of every public op. Each set is
// judged by the rules written below, restated from docs/api.md and the
// comments of core/validate.hpp and epx/config.hpp (not from validate.cpp): a
// set the rules accept must pass; a set they reject must raise
// Error(kInvalidArgument) naming one of the arguments they found broken.
// Nothing else may happen (no other exception, no crash). Views carry fake
// device pointers; validation never dereferences them.
//
// Every run draws a fresh seed (printed; every failure names it too), so CI
// covers new sets each time; EPX_FUZZ_SEED=N reproduces a run;
// EPX_FUZZ_SCALE=K runs K times as many sets.
//
// This file: the layout, dispatch and combine; the harness: validate_fuzz_util.hpp.
#include <gtest/gtest.h>

#include "validate_fuzz_util.hpp"

namespace epx {
namespace {

using namespace vfuzz;

TEST(ValidateFuzz, DispatchLayout) {
  Gen g(seed() ^ 1);
  Tally t;
  for (int i = 0; i < scaled(kLayoutSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    const int E = static_cast<int>(good_or_wild(g, p, R * g.between(1, 64)));
    const TensorView idx =
        gen_tensor(g, DType::kI64, {g.between(0, 300), g.between(1, 16)}, dev, p);
    judge(
        t, dispatch_layout_rules(idx, E, R, dev),
        [&] { validate::dispatch_layout(idx, E, R, dev); },
        [&] { return "R=" + std::to_string(R) + " E=" + std::to_string(E) + " " + show(idx); });
  }
  expect_coverage("get_dispatch_layout", t, {"num_experts", "topk_idx"});
}

TEST(ValidateFuzz, Dispatch) {
  Gen g(seed() ^ 2);
  Tally t;
  for (int i = 0; i < scaled(kDispatchSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    // x: FP8 with scales (per 128 or per token, float32 or int32), or rows of
    // another dtype, each a multiple of 16 bytes.
    const bool fp8 = g.chance(0.4);
    const DType xt =
        fp8 ? DType::kFP8E4M3 : g.pick({DType::kBF16, DType::kBF16, DType::kF32, DType::kI64});
    const int64_t T = g.between(0, 300);
    const int64_t H = (fp8 ? 128 : 8) * g.between(1, fp8 ? 56 : 900) /
                      static_cast<int64_t>(element_size(xt) > 2 ? element_size(xt) / 2 : 1);
    const int64_t K = g.between(1, 16), E = R * g.between(1, 32);
    DispatchArgs a;
    a.x = gen_tensor(g, xt, {T, H}, dev, p);
    if (fp8 != g.chance(p))
      a.x_scales = gen_tensor(g, g.chance(0.5) ? DType::kF32 : DType::kI32,
                              {T, g.chance(0.5) ? H / 128 : g.pick<int64_t>({1, 7})}, dev, p);
    a.expert_alignment = static_cast<int>(good_or_wild(g, p, g.pick<int64_t>({1, 64, 128})));
    a.num_worst_tokens = static_cast<int>(good_or_wild(g, p, g.chance(0.3) ? 4 * T : 0));
    if (g.chance(0.3)) {  // cached: a handle from a dispatch of these tokens, or of others
      const int hR = g.chance(p) ? gen_ranks(g) : R;
      const int L = hR % 2 == 0 && g.chance(0.3) ? hR / 2 : 0;
      auto h = gen_handle(g, p, hR, g.chance(p) ? g.between(0, 300) : T, g.between(0, 600), dev, L);
      h->hidden = static_cast<int>(H);
      a.handle = h;
      if (!g.chance(p)) a.num_worst_tokens = 0;
      if (g.chance(p)) a.topk_idx = gen_tensor(g, DType::kI64, {T, K}, dev, p);
    } else {
      if (!g.chance(p / 2)) {
        a.num_tokens_per_rank = gen_tensor(g, DType::kI32, {R}, dev, p);
        a.is_token_in_rank = gen_tensor(g, DType::kBool, {T, R}, dev, p);
        a.num_tokens_per_expert = gen_tensor(g, DType::kI32, {E}, dev, p);
      }
      if (!g.chance(p)) a.topk_idx = gen_tensor(g, DType::kI64, {T, K}, dev, p);
      if (!g.chance(p)) a.topk_weights = gen_tensor(g, DType::kF32, {T, K}, dev, p);
    }
    judge(
        t, dispatch_rules(a, R, dev), [&] { validate::dispatch(a, R, dev); },
        [&] {
          return "R=" + std::to_string(R) + " dev=" + std::to_string(dev) + " x=" + show(a.x) +
                 " x_scales=" + show(a.x_scales) + " topk_idx=" + show(a.topk_idx) +
                 " topk_weights=" + show(a.topk_weights) +
                 " num_tokens_per_rank=" + show(a.num_tokens_per_rank) +
                 " is_token_in_rank=" + show(a.is_token_in_rank) +
                 " num_tokens_per_expert=" + show(a.num_tokens_per_expert) +
                 " align=" + std::to_string(a.expert_alignment) +
                 " worst=" + std::to_string(a.num_worst_tokens) +
                 (a.handle ? " handle(R=" + std::to_string(a.handle->num_ranks) +
                                 ", T=" + std::to_string(a.handle->num_tokens) + ")"
                           : std::string());
        });
  }
  expect_coverage("dispatch", t,
                  {"x", "hidden", "x_scales", "expert_alignment", "num_worst_tokens", "handle",
                   "num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert",
                   "num_experts", "topk_idx", "topk_weights"});
}

TEST(ValidateFuzz, Combine) {
  Gen g(seed() ^ 3);
  Tally t;
  for (int i = 0; i < scaled(kCombineSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    const int64_t T = g.between(0, 300), N = g.between(0, 600),
                  H = g.chance(p / 2) ? g.pick<int64_t>({4, 12, 100}) : 8 * g.between(1, 900);
    CombineArgs a;
    if (!g.chance(p / 3)) {  // the handle of this buffer's dispatch, or of another one
      const int hR = g.chance(p) ? gen_ranks(g) : R;
      const int L = hR % 2 == 0 && g.chance(0.3) ? hR / 2 : 0;
      auto h = gen_handle(g, p, hR, T, N, dev, L);
      h->hidden = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, H + 8, 2 * H}) : H);
      a.handle = h;
    }
    a.x = gen_tensor(g, DType::kBF16, {N, H}, dev, p);
    if (g.chance(0.5)) a.topk_weights = gen_tensor(g, DType::kF32, {N, g.between(1, 16)}, dev, p);
    if (g.chance(0.3)) a.bias_0 = gen_tensor(g, DType::kBF16, {T, H}, dev, p);
    if (g.chance(0.3)) a.bias_1 = gen_tensor(g, DType::kBF16, {T, H}, dev, p);
    judge(
        t, combine_rules(a, R, dev), [&] { validate::combine(a, R, dev); },
        [&] {
          return "R=" + std::to_string(R) + " x=" + show(a.x) +
                 " topk_weights=" + show(a.topk_weights) + " bias_0=" + show(a.bias_0) +
                 " bias_1=" + show(a.bias_1) +
                 (a.handle ? " handle(R=" + std::to_string(a.handle->num_ranks) +
                                 ", T=" + std::to_string(a.handle->num_tokens) +
                                 ", N=" + std::to_string(a.handle->num_recv_tokens) +
                                 ", H=" + std::to_string(a.handle->hidden) + ")"
                           : std::string(" no handle"));
        });
  }
  expect_coverage("combine", t, {"handle", "x", "hidden", "topk_weights", "bias_0", "bias_1"});
}

}  // namespace
}  // namespace epx
