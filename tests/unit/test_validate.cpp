// Every argument rule: feed the bad input, check the error names the argument
// and the rule. No GPU needed: views carry fake device pointers and nothing is
// dereferenced (except host topk_idx values).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>

#include "common/env.hpp"
#include "common/internode_rings.hpp"
#include "core/algorithm_choices.hpp"
#include "core/internode_handle.hpp"
#include "core/validate.hpp"
#include "epx/buffer.hpp"
#include "expect_error.hpp"
#include "transport/proxy/engine.hpp"

namespace epx {
namespace {

using test::expect_error;

void* fake(std::size_t k = 1) {
  return reinterpret_cast<void*>(0x10000 * k);
}

TensorView dev_view(DType d, std::initializer_list<int64_t> shape, int device = 0,
                    std::size_t k = 1) {
  return TensorView::contiguous(fake(k), d, shape, device);
}

DispatchArgs good_dispatch(int T = 64, int H = 7168, int K = 8, int E = 256, int R = 4) {
  DispatchArgs a;
  a.x = dev_view(DType::kBF16, {T, H});
  a.topk_idx = dev_view(DType::kI64, {T, K}, 0, 2);
  a.topk_weights = dev_view(DType::kF32, {T, K}, 0, 3);
  a.num_tokens_per_rank = dev_view(DType::kI32, {R}, 0, 4);
  a.is_token_in_rank = dev_view(DType::kBool, {T, R}, 0, 5);
  a.num_tokens_per_expert = dev_view(DType::kI32, {E}, 0, 6);
  return a;
}

TEST(Validate, GoodDispatchPasses) {
  EXPECT_NO_THROW(validate::dispatch(good_dispatch(), 4, 0));
}

TEST(Validate, DispatchXOfAnyDtypeWithRowsOf16Bytes) {
  // As DeepEP: the dispatch moves rows of bytes, whatever the dtype.
  for (DType t : {DType::kF32, DType::kI32, DType::kI64, DType::kBool, DType::kFP8E4M3}) {
    auto a = good_dispatch();
    a.x.dtype = t;
    EXPECT_NO_THROW(validate::dispatch(a, 4, 0)) << dtype_name(t);
  }
  auto a = good_dispatch();  // [64, 7168]
  a.x = dev_view(DType::kFP8E4M3, {64, 24});
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"dispatch", "hidden", "16 bytes"});
  a.x = dev_view(DType::kFP8E4M3, {64, 32});  // 32 bytes, no multiple of 128 needed
  EXPECT_NO_THROW(validate::dispatch(a, 4, 0));
}

TEST(Validate, DispatchXDevice) {
  auto a = good_dispatch();
  a.x.device = 1;
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"x", "cuda:0", "cuda:1"});
  a.x.device = kCpu;
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"x", "cpu"});
}

TEST(Validate, DispatchXRowsContiguous) {
  auto a = good_dispatch();
  a.x.strides = {7168, 2};
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"x", "contiguous"});
}

TEST(Validate, HiddenAlignment) {
  auto a = good_dispatch(64, 100);
  a.x = dev_view(DType::kBF16, {64, 100});
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"hidden", "multiple of 16 bytes"});
  expect_error([] { validate::hidden("op", 2880, DType::kFP8E4M3, true); },
               {"hidden", "FP8", "128"});
  EXPECT_NO_THROW(validate::hidden("op", 2880, DType::kBF16, false));
}

TEST(Validate, DispatchScalesAsDeepEp) {
  auto a = good_dispatch();
  a.x.dtype = DType::kFP8E4M3;
  EXPECT_NO_THROW(validate::dispatch(a, 4, 0));  // FP8 without scales: bytes
  a.x_scales = dev_view(DType::kF32, {63, 56}, 0, 9);
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"x_scales", "shape"});
  a.x_scales = dev_view(DType::kF32, {64, 0}, 0, 9);
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"x_scales", ">= 1"});
  a.x_scales = dev_view(DType::kI64, {64, 56}, 0, 9);
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"x_scales", "float32"});
  a.x_scales = dev_view(DType::kF32, {64}, 0, 9);
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"x_scales", "shape"});
  // float32 or int32 (packed UE8M0), per group of 128 or per token, any strides
  for (auto [t, s] : {std::pair{DType::kF32, 56},
                      {DType::kI32, 14},
                      {DType::kF32, 1},
                      {DType::kI32, 1},
                      {DType::kF32, 57}}) {
    a.x_scales = dev_view(t, {64, s}, 0, 9);
    EXPECT_NO_THROW(validate::dispatch(a, 4, 0)) << dtype_name(t) << " " << s;
  }
  a.x_scales->strides = {1, 64};  // column-major, as DeepEP's tests pass
  EXPECT_NO_THROW(validate::dispatch(a, 4, 0));
  auto b = good_dispatch();  // bfloat16 x: no scales
  b.x_scales = dev_view(DType::kF32, {64, 56}, 0, 9);
  expect_error([&] { validate::dispatch(b, 4, 0); }, {"x_scales", "1-byte"});
}

TEST(Validate, TopkShapeAndRange) {
  auto a = good_dispatch();
  a.topk_idx = dev_view(DType::kI64, {63, 8});
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"topk_idx", "shape"});
  a.topk_idx = dev_view(DType::kI32, {64, 8});
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"topk_idx", "int64"});
  expect_error([] { validate::num_topk("op", 17); }, {"topk_idx", "[1, 16]"});
  expect_error([] { validate::num_topk("op", 0); }, {"topk_idx", "[1, 16]"});
  std::vector<int64_t> host = {0, 5, -1, 255, 256, 3};
  auto hv = TensorView::contiguous(host.data(), DType::kI64, {3, 2}, kCpu);
  expect_error([&] { validate::topk_idx_values("op", hv, 256); },
               {"topk_idx", "-1 or in [0, num_experts=256)", "256"});
  host[4] = -2;
  expect_error([&] { validate::topk_idx_values("op", hv, 256); }, {"topk_idx", "-2"});
  host[4] = -1;
  EXPECT_NO_THROW(validate::topk_idx_values("op", hv, 256));
}

TEST(Validate, WeightsNeedIdsAndMatchingShape) {
  auto a = good_dispatch();
  a.topk_idx.reset();
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"topk_weights", "topk_idx"});
  auto b = good_dispatch();
  b.topk_weights = dev_view(DType::kF32, {64, 7});
  expect_error([&] { validate::dispatch(b, 4, 0); }, {"topk_weights", "shape"});
}

TEST(Validate, NumExpertsDivisible) {
  expect_error([] { validate::num_experts("op", 250, 4); },
               {"num_experts", "divisible", "4", "250"});
  expect_error([] { validate::num_experts("op", 0, 4); }, {"num_experts", "> 0"});
  auto a = good_dispatch();
  a.num_tokens_per_expert = dev_view(DType::kI32, {254});
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"num_experts", "divisible"});
}

TEST(Validate, RankInGroup) {
  expect_error([] { validate::rank_in_group("op", "rank_to_mask", 4, 4); },
               {"op: rank_to_mask", "[0, 4)", "got 4"});
  expect_error([] { validate::rank_in_group("op", "rank_to_mask", -1, 4); },
               {"rank_to_mask", "got -1"});
  validate::rank_in_group("op", "rank_to_mask", 0, 4);
  validate::rank_in_group("op", "rank_to_mask", 3, 4);
}

TEST(Validate, LayoutTensorsRequired) {
  auto a = good_dispatch();
  a.is_token_in_rank.reset();
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"get_dispatch_layout"});
  auto b = good_dispatch();
  b.is_token_in_rank = dev_view(DType::kBool, {64, 8});
  expect_error([&] { validate::dispatch(b, 4, 0); }, {"is_token_in_rank", "shape"});
  auto c = good_dispatch();
  c.num_tokens_per_rank = dev_view(DType::kI64, {4});
  expect_error([&] { validate::dispatch(c, 4, 0); }, {"num_tokens_per_rank", "int32"});
}

TEST(Validate, AlignmentAndWorstTokens) {
  auto a = good_dispatch();
  a.expert_alignment = 0;
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"expert_alignment", ">= 1"});
  a.expert_alignment = 1;
  a.num_worst_tokens = -5;
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"num_worst_tokens", ">= 0"});
}

/// A handle as a dispatch of R ranks within one node (L = 0) or across nodes
/// of L ranks makes it: its routing tensors, views of fake memory on cuda:0.
std::shared_ptr<DispatchHandle> routed_handle(int R, int T, int N, int H, int L = 0) {
  auto h = std::make_shared<DispatchHandle>();
  h->num_ranks = R;
  h->num_tokens = T;
  h->num_recv_tokens = N;
  h->hidden = H;
  h->ranks_per_node = L;
  std::size_t k = 20;
  const auto t = [&](DType d, std::initializer_list<int64_t> shape) {
    return Tensor{dev_view(d, shape, 0, k++), nullptr};
  };
  h->is_token_in_rank = t(DType::kBool, {T, R});
  h->recv_src_idx = t(DType::kI32, {N});
  if (L == 0) {
    h->send_slot = t(DType::kI32, {T, R});
    h->send_list = t(DType::kI32, {R, std::max(T, 1)});
    h->send_counts = t(DType::kI32, {R});
    h->recv_offsets = t(DType::kI32, {R + 1});
  } else {
    epx::across(*h).net_send_pos = t(DType::kI32, {T, R / L});
    epx::across(*h).net_rank_pos = t(DType::kI32, {T, R});
    epx::across(*h).net_recv_meta = t(DType::kI32, {N, 3});
    epx::across(*h).net_table = t(DType::kI32, {40});
    epx::across(*h).net_fwd_mask = t(DType::kI32, {R / L, 16});
    epx::across(*h).net_fwd_token = t(DType::kI32, {R / L, 16});
    h->rank_prefix_matrix = t(DType::kI32, {R, R});
    h->source_num_tokens = t(DType::kI32, {R});
  }
  return h;
}

TEST(Validate, HandlesWithoutTheirRoutingTensorsAreRefused) {
  // A handle rebuilt by hand (no tensors) used to launch the combine and the
  // cached dispatch with null pointers.
  auto bare = std::make_shared<DispatchHandle>();
  bare->num_ranks = 4;
  bare->num_tokens = 64;
  bare->num_recv_tokens = 100;
  bare->hidden = 7168;
  CombineArgs c;
  c.handle = bare;
  c.x = dev_view(DType::kBF16, {100, 7168});
  expect_error([&] { validate::combine(c, 4, 0); },
               {"combine: handle: lacks its routing tensor is_token_in_rank"});
  auto a = good_dispatch();
  a.topk_idx.reset();
  a.topk_weights.reset();
  a.handle = bare;
  expect_error([&] { validate::dispatch(a, 4, 0); },
               {"dispatch: handle: lacks its routing tensor is_token_in_rank"});
  for (int L : {0, 2}) {
    SCOPED_TRACE(L);
    auto h = routed_handle(4, 64, 100, 7168, L);
    c.handle = h;
    a.handle = h;
    EXPECT_NO_THROW(validate::combine(c, 4, 0));
    EXPECT_NO_THROW(validate::dispatch(a, 4, 0));
    // each tensor the ops read: missing, of another shape, or on another device
    Tensor& part = L == 0 ? h->recv_offsets : epx::across(*h).net_recv_meta;
    const char* name = L == 0 ? "recv_offsets" : "net_recv_meta";
    const Tensor kept = part;
    part = Tensor{};
    expect_error([&] { validate::combine(c, 4, 0); }, {"handle", name, "got none"});
    part = kept;
    part.view.shape[0] += 1;
    expect_error([&] { validate::dispatch(a, 4, 0); }, {"handle", name});
    part = kept;
    part.view.device = 1;
    expect_error([&] { validate::combine(c, 4, 0); }, {"handle", name, "cuda:0"});
    part = kept;
    EXPECT_NO_THROW(validate::combine(c, 4, 0));
  }
}

TEST(Validate, MisalignedViewsAreRefusedByName) {
  // x = full[:, 4:4 + H] of a [T, H + 8] bf16 tensor: a row pitch of 16-byte
  // multiples from a base 8 bytes off, which the kernels' 16-byte loads fault on.
  auto a = good_dispatch(64, 7168);
  a.x.data = static_cast<char*>(a.x.data) + 8;
  a.x.strides[0] = 7168 + 8;
  expect_error([&] { validate::dispatch(a, 4, 0); },
               {"dispatch: x: must start at a 16-byte aligned address", "8 bytes past"});
  a.x.data = static_cast<char*>(a.x.data) + 8;  // 16 bytes off: fine
  EXPECT_NO_THROW(validate::dispatch(a, 4, 0));
  a.x.strides[0] = 7168 + 4;  // rows 8 bytes apart from each other
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"dispatch: x:", "16 bytes"});
  // an element out of line (int64 top-k ids 4 bytes off)
  a = good_dispatch();
  a.topk_idx->data = static_cast<char*>(a.topk_idx->data) + 4;
  expect_error([&] { validate::dispatch(a, 4, 0); },
               {"dispatch: topk_idx: must be aligned to its element size (8 bytes)"});
  // combine inputs and biases
  CombineArgs c;
  c.handle = routed_handle(4, 32, 100, 4096);
  c.x = dev_view(DType::kBF16, {100, 4096});
  c.bias_1 = dev_view(DType::kBF16, {32, 4096}, 0, 7);
  EXPECT_NO_THROW(validate::combine(c, 4, 0));
  c.bias_1->data = static_cast<char*>(c.bias_1->data) + 2;
  expect_error([&] { validate::combine(c, 4, 0); }, {"combine: bias_1: must start at a 16-byte"});
  c.bias_1.reset();
  c.x.data = static_cast<char*>(c.x.data) + 6;
  expect_error([&] { validate::combine(c, 4, 0); }, {"combine: x: must start at a 16-byte"});
  // low-latency x: a flat slice 2 bytes off
  LowLatencyDispatchArgs l;
  l.x = dev_view(DType::kBF16, {128, 7168});
  l.topk_idx = dev_view(DType::kI64, {128, 8}, 0, 2);
  l.num_max_dispatch_tokens_per_rank = 128;
  l.num_experts = 256;
  EXPECT_NO_THROW(validate::low_latency_dispatch(l, 4, 0));
  l.x.data = static_cast<char*>(l.x.data) + 2;
  expect_error([&] { validate::low_latency_dispatch(l, 4, 0); },
               {"low_latency_dispatch: x: must start at a 16-byte"});
}

TEST(Validate, LowLatencySizeHintRefusesWhatTheOpsRefuse) {
  // (1024, 7168, 32, 256) used to give about 10.4 GB though no dispatch takes
  // 32 x 1024 tokens (the receive lists 24 Ki (rank, token) entries at most).
  expect_error([] { Buffer::get_low_latency_rdma_size_hint(1024, 7168, 32, 256); },
               {"num_max_dispatch_tokens_per_rank", "24576", "1024 x 32"});
  EXPECT_GT(Buffer::get_low_latency_rdma_size_hint(768, 7168, 32, 256), 0u);  // 24 Ki exactly
  LowLatencyDispatchArgs l;
  l.x = dev_view(DType::kBF16, {1, 7168});
  l.topk_idx = dev_view(DType::kI64, {1, 8}, 0, 2);
  l.num_max_dispatch_tokens_per_rank = 1024;
  l.num_experts = 256;
  expect_error([&] { validate::low_latency_dispatch(l, 32, 0); },
               {"num_max_dispatch_tokens_per_rank", "24576"});
}

TEST(Validate, CachedDispatchRules) {
  auto h = std::make_shared<DispatchHandle>();
  h->num_ranks = 4;
  h->num_tokens = 64;
  auto a = good_dispatch();
  a.handle = h;
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"topk_idx", "cached"});
  a.topk_idx.reset();
  a.topk_weights.reset();
  a.num_worst_tokens = 10;
  expect_error([&] { validate::dispatch(a, 4, 0); }, {"num_worst_tokens", "cached"});
}

TEST(Validate, CombineRules) {
  CombineArgs c;
  expect_error([&] { validate::combine(c, 4, 0); }, {"combine", "handle", "required"});
  c.handle = routed_handle(4, 32, 100, 4096);
  c.x = dev_view(DType::kBF16, {99, 4096});
  expect_error([&] { validate::combine(c, 4, 0); }, {"x", "[100, *]"});
  c.x = dev_view(DType::kBF16, {100, 2048});
  expect_error([&] { validate::combine(c, 4, 0); }, {"x", "hidden must match", "4096"});
  c.x = dev_view(DType::kBF16, {100, 4096});
  EXPECT_NO_THROW(validate::combine(c, 4, 0));
  c.bias_0 = dev_view(DType::kBF16, {31, 4096});
  expect_error([&] { validate::combine(c, 4, 0); }, {"bias_0", "[32, 4096]"});
  c.bias_0.reset();
  c.topk_weights = dev_view(DType::kF32, {100, 17});
  expect_error([&] { validate::combine(c, 4, 0); }, {"combine: topk_weights", "[1, 16]"});
  expect_error([&] { validate::combine(c, 8, 0); }, {"handle", "rank count"});
}

TEST(Validate, LowLatencyDispatchRules) {
  LowLatencyDispatchArgs a;
  a.x = dev_view(DType::kBF16, {128, 7168});
  a.topk_idx = dev_view(DType::kI64, {128, 8});
  a.num_max_dispatch_tokens_per_rank = 128;
  a.num_experts = 256;
  EXPECT_NO_THROW(validate::low_latency_dispatch(a, 4, 0));
  a.num_max_dispatch_tokens_per_rank = 64;
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); },
               {"x", "num_max_dispatch_tokens_per_rank=64"});
  a.num_max_dispatch_tokens_per_rank = 0;
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); },
               {"num_max_dispatch_tokens_per_rank", "[1, 1024]"});
  a.num_max_dispatch_tokens_per_rank = 128;
  a.x = dev_view(DType::kBF16, {128, 2880});
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); },
               {"hidden", "multiple of 128", "2880"});
  a.x = dev_view(DType::kBF16, {128, 16384 + 128});
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); },
               {"hidden", "at most 16384", "16512"});
  a.x = dev_view(DType::kBF16, {128, 7168});
  a.num_experts = 1028;
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); },
               {"num_experts", "at most 1024", "1028"});
  a.num_experts = 1024;
  EXPECT_NO_THROW(validate::low_latency_dispatch(a, 4, 0));
  a.num_experts = 256;
  a.use_fp8 = false;
  a.round_scale = true;
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); }, {"use_fp8", "round_scale"});
  a.use_fp8 = true;
  a.round_scale = false;
  a.use_ue8m0 = true;
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); }, {"use_ue8m0", "round_scale"});
  a.use_ue8m0 = false;
  a.cumulative_local_expert_recv_stats = dev_view(DType::kI32, {65});
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); },
               {"cumulative_local_expert_recv_stats", "[64]"});
  a.cumulative_local_expert_recv_stats.reset();
  a.dispatch_wait_recv_cost_stats = dev_view(DType::kI64, {4});
  EXPECT_NO_THROW(validate::low_latency_dispatch(a, 4, 0));
  a.dispatch_wait_recv_cost_stats = dev_view(DType::kI32, {4});
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); },
               {"dispatch_wait_recv_cost_stats", "int64"});
  a.dispatch_wait_recv_cost_stats = dev_view(DType::kI64, {8});
  expect_error([&] { validate::low_latency_dispatch(a, 4, 0); },
               {"dispatch_wait_recv_cost_stats", "[4]"});
}

TEST(Validate, LowLatencyCombineRules) {
  LowLatencyCombineArgs a;
  expect_error([&] { validate::low_latency_combine(a, 4, 0); }, {"handle", "required"});
  auto h = std::make_shared<LowLatencyHandle>();
  h->num_ranks = 4;
  h->num_experts = 256;
  h->num_max_dispatch_tokens_per_rank = 128;
  h->hidden = 7168;
  h->num_tokens = 100;
  h->num_topk = 8;
  a.handle = h;
  a.x = dev_view(DType::kBF16, {64, 512, 7168});
  a.topk_idx = dev_view(DType::kI64, {100, 8});
  a.topk_weights = dev_view(DType::kF32, {100, 8});
  EXPECT_NO_THROW(validate::low_latency_combine(a, 4, 0));
  a.x = dev_view(DType::kBF16, {64, 511, 7168});
  expect_error([&] { validate::low_latency_combine(a, 4, 0); }, {"x", "[64, 512, 7168]"});
  a.x = dev_view(DType::kBF16, {64, 512, 7168});
  a.topk_weights = dev_view(DType::kF32, {100, 4});
  expect_error([&] { validate::low_latency_combine(a, 4, 0); }, {"topk_weights", "[100, 8]"});
  a.topk_weights = dev_view(DType::kF32, {100, 8});
  a.out = dev_view(DType::kBF16, {100, 4096});
  expect_error([&] { validate::low_latency_combine(a, 4, 0); }, {"out", "[100, 7168]"});
  a.out.reset();
  a.combine_wait_recv_cost_stats = dev_view(DType::kI64, {4});
  EXPECT_NO_THROW(validate::low_latency_combine(a, 4, 0));
  a.combine_wait_recv_cost_stats = dev_view(DType::kI64, {4}, 1);
  expect_error([&] { validate::low_latency_combine(a, 4, 0); },
               {"combine_wait_recv_cost_stats", "cuda:0"});
}

TEST(Validate, AnyDeviceWildcard) {
  auto t = dev_view(DType::kI32, {4}, 3);
  EXPECT_NO_THROW(validate::tensor("op", "t", t, DType::kI32, {4}, validate::kAnyDevice));
  auto h = dev_view(DType::kI32, {4}, kCpu);
  expect_error([&] { validate::tensor("op", "t", h, DType::kI32, {4}, validate::kAnyDevice); },
               {"t", "CUDA device"});
  EXPECT_NO_THROW(validate::tensor("op", "t", h, DType::kI32, {4}, kCpu));
}

}  // namespace
}  // namespace epx
