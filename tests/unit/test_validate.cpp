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
#include "transport/proxy/engine.hpp"

namespace epx {
namespace {

void* fake(std::size_t k = 1) {
  return reinterpret_cast<void*>(0x10000 * k);
}

TensorView dev_view(DType d, std::initializer_list<int64_t> shape, int device = 0,
                    std::size_t k = 1) {
  return TensorView::contiguous(fake(k), d, shape, device);
}

/// Runs `fn`, expects epx::Error with code `code` whose message contains every `parts`.
template <class Fn>
void expect_error(Fn&& fn, std::initializer_list<const char*> parts,
                  ErrorCode code = ErrorCode::kInvalidArgument) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const char* p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << e.what() << " lacks '" << p << "'";
  }
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

/// Puts an environment variable back as it was when the scope ends.
class SavedEnv {
 public:
  explicit SavedEnv(const char* name) : name_(name) {
    const char* v = std::getenv(name);
    had_ = v != nullptr;
    if (had_) value_ = v;
  }
  ~SavedEnv() {
    if (had_)
      setenv(name_, value_.c_str(), 1);
    else
      unsetenv(name_);
  }
  SavedEnv(const SavedEnv&) = delete;
  SavedEnv& operator=(const SavedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string value_;
};

TEST(Env, HtPullSetsTheDispatchConfigs) {
  unsetenv("EPX_HT_PULL");
  EXPECT_FALSE(get_dispatch_config(4).pull_dispatch);
  setenv("EPX_HT_PULL", "1", 1);
  EXPECT_TRUE(get_dispatch_config(4).pull_dispatch);
  EXPECT_FALSE(get_combine_config(4).pull_dispatch);
  setenv("EPX_HT_PULL", "2", 1);
  expect_error([] { get_dispatch_config(4); }, {"EPX_HT_PULL", "0 or 1"});
  unsetenv("EPX_HT_PULL");
}

/// A 0-or-1 switch `name` read by `get`: unset and "0" are off, "1" on;
/// another number or a word is an error naming the variable and the rule.
void expect_zero_or_one_switch(const char* name, bool (*get)(), bool unset = false) {
  SCOPED_TRACE(name);
  const SavedEnv saved(name);
  unsetenv(name);
  EXPECT_EQ(get(), unset);
  setenv(name, "1", 1);
  EXPECT_TRUE(get());
  setenv(name, "0", 1);
  EXPECT_FALSE(get());
  setenv(name, "2", 1);
  expect_error([&] { get(); }, {name, "0 or 1"});
  setenv(name, "rows", 1);
  expect_error([&] { get(); }, {name, "0 or 1", "'rows'"});
  setenv(name, "01", 1);
  expect_error([&] { get(); }, {name, "0 or 1"});
}

TEST(Env, NvshmemTraceIsZeroOrOne) {
  expect_zero_or_one_switch("EPX_NVSHMEM_TRACE", env::nvshmem_trace);
}

TEST(Env, FabricDomainsIsTheListAsGivenAndUnsetIsEmpty) {
  // Empty means the provider's first domain; the engine parses the list.
  const SavedEnv saved("EPX_FABRIC_DOMAINS");
  unsetenv("EPX_FABRIC_DOMAINS");
  EXPECT_EQ(env::fabric_domains(), "");
  setenv("EPX_FABRIC_DOMAINS", "mlx5_0,mlx5_1", 1);
  EXPECT_EQ(env::fabric_domains(), "mlx5_0,mlx5_1");
}

TEST(Env, SwitchesUnsetTakeTheirDefaults) {
  // Unset switches are read during Buffer creation: their default, with no
  // value looked at (an empty optional dereferenced aborts under
  // _GLIBCXX_ASSERTIONS, which CI builds with).
  for (const char* name :
       {"EPX_HT_PULL", "EPX_PROXY_ROW_COPIES", "EPX_PROXY_CUMEM", "EPX_LL_CONTEXT_RANGES",
        "EPX_LL_ARRIVAL_ORDER", "EPX_NET_SPLIT_PUTS", "EPX_NVSHMEM_TRACE", "EPX_DEBUG_PROXY"})
    unsetenv(name);
  EXPECT_FALSE(env::ht_pull());
  EXPECT_FALSE(env::proxy_row_copies());
  EXPECT_FALSE(env::proxy_cumem().has_value());
  EXPECT_FALSE(env::ll_context_ranges());
  EXPECT_FALSE(env::ll_arrival_order());
  EXPECT_FALSE(env::net_split_puts().has_value());
  EXPECT_FALSE(env::nvshmem_trace());
  EXPECT_EQ(env::debug_proxy(), env::ProxyDebug::kOff);
}

/// An integer variable read by `get` takes `good`, and refuses each of `bad`
/// (out of its range, or past 32 bits, where narrowing would have wrapped it
/// into range) naming the variable.
template <class Get>
void expect_ranged(const char* name, Get get, const char* good,
                   std::initializer_list<const char*> bad) {
  SCOPED_TRACE(name);
  const SavedEnv saved(name);
  setenv(name, good, 1);
  EXPECT_NO_THROW(get());
  for (const char* b : bad) {
    setenv(name, b, 1);
    expect_error([&] { get(); }, {name, "must be"});
  }
}

TEST(Env, IntegerVariablesAreRangeCheckedBeforeNarrowing) {
  expect_ranged("EPX_RANKS_PER_NODE", env::ranks_per_node, "4",
                {"-1", "4294967298", "x", "9223372036854775808"});
  expect_ranged("EPX_PROXY_CHANNELS", [] { return env::proxy_channels(16); }, "16",
                {"0", "17", "4294967297"});
  expect_ranged("EPX_GIN_CONTEXTS", [] { return env::gin_contexts(16); }, "8",
                {"0", "17", "4294967297"});
  expect_ranged("EPX_PROXY_RING", env::proxy_ring, "64", {"15", "4194305", "4294967312"});
  expect_ranged("EPX_DEBUG_PROXY", env::debug_proxy, "stats", {"2", "yes"});
  {
    const SavedEnv r("RANK"), w("WORLD_SIZE"), l("LOCAL_RANK"), m("MASTER_PORT");
    setenv("WORLD_SIZE", "4", 1);
    unsetenv("LOCAL_RANK");
    unsetenv("MASTER_PORT");
    setenv("RANK", "4294967296", 1);  // 2^32: was narrowed to rank 0
    expect_error([] { env::rank_info(); }, {"RANK", "[0, WORLD_SIZE=4)", "4294967296"});
    setenv("RANK", "1", 1);
    EXPECT_EQ(env::rank_info().rank, 1);
    EXPECT_EQ(env::rank_info().local_rank, 1);  // LOCAL_RANK unset: the rank
    EXPECT_EQ(env::rank_info().master_port, 29500);
    setenv("WORLD_SIZE", "4294967297", 1);  // 2^32 + 1: was narrowed to 1
    expect_error([] { env::rank_info(); }, {"WORLD_SIZE", "must be in"});
    setenv("WORLD_SIZE", "4", 1);
    setenv("LOCAL_RANK", "4294967296", 1);
    expect_error([] { env::rank_info(); }, {"LOCAL_RANK", "must be in"});
    unsetenv("LOCAL_RANK");
    setenv("MASTER_PORT", "4294996796", 1);  // 2^32 + 29500: was narrowed to 29500
    expect_error([] { env::rank_info(); }, {"MASTER_PORT", "[1, 65534]"});
    setenv("MASTER_PORT", "65535", 1);  // NCCL's bootstrap takes port + 1
    expect_error([] { env::rank_info(); }, {"MASTER_PORT", "[1, 65534]"});
  }
}

TEST(Env, LlArrivalOrderIsZeroOrOne) {
  expect_zero_or_one_switch("EPX_LL_ARRIVAL_ORDER", env::ll_arrival_order);
}

TEST(Env, LlContextRangesIsZeroOrOne) {
  expect_zero_or_one_switch("EPX_LL_CONTEXT_RANGES", env::ll_context_ranges);
}

TEST(Env, HtRingsIsAutoOffOneOrARingSize) {
  const SavedEnv saved("EPX_HT_RINGS");
  unsetenv("EPX_HT_RINGS");
  EXPECT_EQ(env::ht_rings(), -1);  // the rings where the whole-call areas do not fit
  setenv("EPX_HT_RINGS", "0", 1);
  EXPECT_EQ(env::ht_rings(), 0);
  setenv("EPX_HT_RINGS", "1", 1);
  EXPECT_EQ(env::ht_rings(), 1);
  setenv("EPX_HT_RINGS", "4", 1);
  EXPECT_EQ(env::ht_rings(), 4);
  setenv("EPX_HT_RINGS", "-1", 1);
  expect_error([] { env::ht_rings(); }, {"EPX_HT_RINGS", "ring records"});
  setenv("EPX_HT_RINGS", "rings", 1);
  expect_error([] { env::ht_rings(); }, {"EPX_HT_RINGS", "integer"});
}

TEST(Env, ProxyRowCopiesIsZeroOrOne) {
  expect_zero_or_one_switch("EPX_PROXY_ROW_COPIES", env::proxy_row_copies);
}

/// Unless the rings are off (EPX_HT_RINGS=0), the internode size hint also
/// holds the rings (of the default config's channels: a channel per three
/// SMs) and their state block: a buffer of the hint's size takes them; with
/// them off the hint is the whole-call worst case alone.
TEST(Env, InternodeSizeHintHoldsTheRings) {
  const SavedEnv saved("EPX_HT_RINGS");
  const int R = 4, L = 2, H = 7168, K = 8, T = 128;
  setenv("EPX_HT_RINGS", "0", 1);
  const std::size_t off = Buffer::get_internode_nvl_size_hint(T, H, R, L, K);
  const std::size_t record = epx::plan::ht_net_record_bytes(2 * H, 0, K, L);
  for (const int records : {-1, 1, 4}) {  // -1: unset, the default
    if (records < 0)
      unsetenv("EPX_HT_RINGS");
    else
      setenv("EPX_HT_RINGS", std::to_string(records).c_str(), 1);
    const std::size_t on = Buffer::get_internode_nvl_size_hint(T, H, R, L, K);
    EXPECT_GT(on, off) << records;
    epx::plan::HtRingGeometry g;  // 1: the default sizes
    g.channels = (epx::get_dispatch_config(R).num_sms) / 3;
    if (records > 1) {
      g.net_slots = g.nvl_slots = records;
      g.net_chunk = std::min(g.net_chunk, records);
      g.nvl_chunk = std::min(g.nvl_chunk, records);
    }
    EXPECT_NO_THROW(epx::plan::HtRingRegion::make(epx::Topology{R, L}, g, record,
                                                  epx::plan::HtNetRegion::body(R), on))
        << "EPX_HT_RINGS=" << records << ": " << on << " bytes";
  }
}

TEST(Env, ProxyCumemIsUnsetZeroOrOne) {
  // unset: no value (proxy::cumem_regions picks the default); else a 0/1 switch
  expect_zero_or_one_switch("EPX_PROXY_CUMEM", [] { return env::proxy_cumem().value_or(false); });
  const SavedEnv saved("EPX_PROXY_CUMEM");
  unsetenv("EPX_PROXY_CUMEM");
  EXPECT_FALSE(env::proxy_cumem().has_value());
}

TEST(Env, NetSplitPutsIsUnsetZeroOrOne) {
  const SavedEnv saved("EPX_NET_SPLIT_PUTS");
  unsetenv("EPX_NET_SPLIT_PUTS");
  EXPECT_FALSE(env::net_split_puts().has_value());
  setenv("EPX_NET_SPLIT_PUTS", "1", 1);
  EXPECT_EQ(env::net_split_puts(), std::optional<bool>(true));
  setenv("EPX_NET_SPLIT_PUTS", "0", 1);
  EXPECT_EQ(env::net_split_puts(), std::optional<bool>(false));
  setenv("EPX_NET_SPLIT_PUTS", "yes", 1);
  expect_error([] { env::net_split_puts(); }, {"EPX_NET_SPLIT_PUTS"});
  setenv("EPX_NET_SPLIT_PUTS", "3", 1);
  expect_error([] { env::net_split_puts(); }, {"EPX_NET_SPLIT_PUTS", "0 or 1"});
}

TEST(Env, LlSmsIsAPositiveCount) {
  const SavedEnv saved("EPX_LL_SMS");
  unsetenv("EPX_LL_SMS");
  EXPECT_FALSE(env::ll_sms().has_value());
  setenv("EPX_LL_SMS", "100", 1);
  EXPECT_EQ(env::ll_sms(), 100);
  setenv("EPX_LL_SMS", "0", 1);
  expect_error([] { env::ll_sms(); }, {"EPX_LL_SMS", ">= 1"});
  setenv("EPX_LL_SMS", "many", 1);
  expect_error([] { env::ll_sms(); }, {"EPX_LL_SMS"});
}

TEST(Env, MaxOpsInFlightIsACountOrZero) {
  const SavedEnv saved("EPX_MAX_OPS_IN_FLIGHT");
  unsetenv("EPX_MAX_OPS_IN_FLIGHT");
  EXPECT_FALSE(env::max_ops_in_flight().has_value());
  setenv("EPX_MAX_OPS_IN_FLIGHT", "0", 1);
  EXPECT_EQ(env::max_ops_in_flight(), 0);
  setenv("EPX_MAX_OPS_IN_FLIGHT", "16", 1);
  EXPECT_EQ(env::max_ops_in_flight(), 16);
  for (const char* bad : {"-1", "2000000", "some"}) {
    setenv("EPX_MAX_OPS_IN_FLIGHT", bad, 1);
    expect_error([] { env::max_ops_in_flight(); }, {"EPX_MAX_OPS_IN_FLIGHT"});
  }
  setenv("EPX_MAX_OPS_IN_FLIGHT", "-1", 1);
  expect_error([] { env::max_ops_in_flight(); }, {"EPX_MAX_OPS_IN_FLIGHT", "[0, 1048576]", "-1"});
}

/// The options a Buffer could be made from: the rules of every field, each
/// error naming the field and its rule.
TEST(BufferOptions, ValidateNamesTheFieldAndTheRule) {
  BufferOptions ok;
  ok.num_rdma_bytes = 1;
  EXPECT_NO_THROW(ok.validate());  // every algorithm choice unset
  auto with = [&](auto set) {
    BufferOptions o = ok;
    set(o);
    return o;
  };
  expect_error([&] { with([](BufferOptions& o) { o.num_rdma_bytes = -1; }).validate(); },
               {"num_rdma_bytes", ">= 0", "-1"});
  expect_error([&] { with([](BufferOptions& o) { o.num_rdma_bytes = 0; }).validate(); },
               {"num_nvl_bytes", "must be > 0"});
  expect_error([&] { with([](BufferOptions& o) { o.num_qps_per_rank = 0; }).validate(); },
               {"num_qps_per_rank", ">= 1"});
  for (const int bad : {-2, (1 << 20) + 1})
    expect_error([&] { with([&](BufferOptions& o) { o.ht_rings = bad; }).validate(); },
                 {"ht_rings", "ring records in [2, 2^20]", std::to_string(bad).c_str()});
  for (const int good : {-1, 0, 1, 2, 1 << 20})
    EXPECT_NO_THROW(with([&](BufferOptions& o) { o.ht_rings = good; }).validate()) << good;
  for (const int bad : {0, -3, (1 << 20) + 1})
    expect_error([&] { with([&](BufferOptions& o) { o.ll_sms = bad; }).validate(); },
                 {"ll_sms", "must be in [1, 2^20]", std::to_string(bad).c_str()});
  EXPECT_NO_THROW(with([](BufferOptions& o) { o.ll_sms = 1; }).validate());
  for (const int bad : {-1, (1 << 20) + 1})
    expect_error([&] { with([&](BufferOptions& o) { o.max_ops_in_flight = bad; }).validate(); },
                 {"max_ops_in_flight", "[0, 2^20]", std::to_string(bad).c_str()});
  for (const int good : {0, 1, 1 << 20})
    EXPECT_NO_THROW(with([&](BufferOptions& o) { o.max_ops_in_flight = good; }).validate());
}

/// A field set wins over its variable, which is then not even read (a
/// malformed one does not refuse the buffer); a field unset takes the
/// variable, and with both unset the built-in default.
TEST(BufferOptions, AlgorithmFieldsWinOverTheirVariables) {
  const char* names[] = {"EPX_HT_RINGS",          "EPX_NET_SPLIT_PUTS", "EPX_LL_ARRIVAL_ORDER",
                         "EPX_LL_CONTEXT_RANGES", "EPX_LL_SMS",         "EPX_MAX_OPS_IN_FLIGHT"};
  const SavedEnv s0(names[0]), s1(names[1]), s2(names[2]), s3(names[3]), s4(names[4]), s5(names[5]);
  for (const char* n : names) unsetenv(n);
  BufferOptions o;
  AlgorithmChoices c = resolve_algorithm_choices(o);
  EXPECT_EQ(c.ht_rings, -1);
  EXPECT_FALSE(c.net_split_puts.has_value());
  EXPECT_FALSE(c.ll_arrival_order);
  EXPECT_FALSE(c.ll_context_ranges);
  EXPECT_FALSE(c.ll_sms.has_value());
  EXPECT_FALSE(c.max_ops_in_flight.has_value());

  setenv("EPX_HT_RINGS", "0", 1);
  setenv("EPX_NET_SPLIT_PUTS", "1", 1);
  setenv("EPX_LL_ARRIVAL_ORDER", "1", 1);
  setenv("EPX_LL_CONTEXT_RANGES", "1", 1);
  setenv("EPX_LL_SMS", "7", 1);
  setenv("EPX_MAX_OPS_IN_FLIGHT", "5", 1);
  c = resolve_algorithm_choices(o);  // unset fields: the variables
  EXPECT_EQ(c.ht_rings, 0);
  EXPECT_EQ(c.net_split_puts, std::optional<bool>(true));
  EXPECT_TRUE(c.ll_arrival_order);
  EXPECT_TRUE(c.ll_context_ranges);
  EXPECT_EQ(c.ll_sms, std::optional<int>(7));
  EXPECT_EQ(c.max_ops_in_flight, std::optional<int>(5));

  o.ht_rings = 64;
  o.net_split_puts = false;
  o.ll_arrival_order = false;
  o.ll_context_ranges = false;
  o.ll_sms = 3;
  o.max_ops_in_flight = 0;
  c = resolve_algorithm_choices(o);
  EXPECT_EQ(c.ht_rings, 64);
  EXPECT_EQ(c.net_split_puts, std::optional<bool>(false));
  EXPECT_FALSE(c.ll_arrival_order);
  EXPECT_FALSE(c.ll_context_ranges);
  EXPECT_EQ(c.ll_sms, std::optional<int>(3));
  EXPECT_EQ(c.max_ops_in_flight, std::optional<int>(0));

  for (const char* n : names) setenv(n, "bad", 1);
  EXPECT_NO_THROW(resolve_algorithm_choices(o));  // every field set: no variable read
  o.ll_sms.reset();
  expect_error([&] { resolve_algorithm_choices(o); }, {"EPX_LL_SMS"});
  o.ll_sms = 3;
  o.max_ops_in_flight.reset();
  expect_error([&] { resolve_algorithm_choices(o); }, {"EPX_MAX_OPS_IN_FLIGHT"});
}

TEST(BufferOptions, ProxyCumemFieldWinsOverItsVariable) {
  const SavedEnv saved("EPX_PROXY_CUMEM");
  unsetenv("EPX_PROXY_CUMEM");
  // the defaults: a process per rank, and in-process ranks by how many share the device
  EXPECT_TRUE(proxy::cumem_regions(std::nullopt, 1));
  EXPECT_FALSE(proxy::cumem_regions(std::nullopt, 2));
  EXPECT_FALSE(proxy::cumem_regions(std::nullopt, proxy::kSharedContextRanks));
  EXPECT_TRUE(proxy::cumem_regions(std::nullopt, proxy::kSharedContextRanks + 1));
  EXPECT_TRUE(proxy::cumem_regions(std::nullopt, 16));
  setenv("EPX_PROXY_CUMEM", "0", 1);
  EXPECT_FALSE(proxy::cumem_regions(std::nullopt, 1));
  EXPECT_FALSE(proxy::cumem_regions(std::nullopt, 16));
  EXPECT_TRUE(proxy::cumem_regions(true, 4));
  setenv("EPX_PROXY_CUMEM", "1", 1);
  EXPECT_TRUE(proxy::cumem_regions(std::nullopt, 4));
  setenv("EPX_PROXY_CUMEM", "bad", 1);
  EXPECT_FALSE(proxy::cumem_regions(false, 16));  // set: the variable is not read
  expect_error([] { proxy::cumem_regions(std::nullopt, 1); }, {"EPX_PROXY_CUMEM", "0 or 1"});
}

/// The size hint's ht_rings is the buffer's field: set, it decides over
/// EPX_HT_RINGS; a bad one is refused naming it.
TEST(BufferOptions, InternodeSizeHintTakesTheRingsField) {
  const SavedEnv saved("EPX_HT_RINGS");
  const int R = 4, L = 2, H = 7168, K = 8, T = 128;
  setenv("EPX_HT_RINGS", "0", 1);
  const std::size_t off = Buffer::get_internode_nvl_size_hint(T, H, R, L, K);
  unsetenv("EPX_HT_RINGS");
  const std::size_t automatic = Buffer::get_internode_nvl_size_hint(T, H, R, L, K);
  EXPECT_GT(automatic, off);
  EXPECT_EQ(Buffer::get_internode_nvl_size_hint(T, H, R, L, K, 0), off);
  EXPECT_EQ(Buffer::get_internode_nvl_size_hint(T, H, R, L, K, -1), automatic);
  setenv("EPX_HT_RINGS", "0", 1);
  EXPECT_EQ(Buffer::get_internode_nvl_size_hint(T, H, R, L, K, -1), automatic);
  expect_error([&] { Buffer::get_internode_nvl_size_hint(T, H, R, L, K, -2); },
               {"ht_rings", "ring records"});
}

TEST(Env, RankInfoFromTorchrunAndMpi) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "3", 1);
  setenv("MASTER_PORT", "29500", 1);
  auto i = env::rank_info();
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_STREQ(i.launcher, "torchrun");
  setenv("RANK", "4", 1);
  expect_error([] { env::rank_info(); }, {"RANK", "[0, WORLD_SIZE=4)"});
  setenv("RANK", "x", 1);
  expect_error([] { env::rank_info(); }, {"RANK", "integer", "'x'"});
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("LOCAL_RANK");
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  i = env::rank_info();
  EXPECT_EQ(i.rank, 1);
  EXPECT_EQ(i.world_size, 2);
  EXPECT_STREQ(i.launcher, "mpirun");
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("EPX_TIMEOUT_S", "-1", 1);
  expect_error([] { env::timeout_seconds(); }, {"EPX_TIMEOUT_S", "> 0"});
  setenv("EPX_TIMEOUT_S", "2.5", 1);
  EXPECT_DOUBLE_EQ(env::timeout_seconds(), 2.5);
  unsetenv("EPX_TIMEOUT_S");
  EXPECT_DOUBLE_EQ(env::timeout_seconds(), 60.0);
  // the epoch-wrap test knob: unset, a 32-bit value, or an error naming it
  unsetenv("EPX_DEBUG_EPOCH_START");
  EXPECT_FALSE(env::debug_epoch_start().has_value());
  setenv("EPX_DEBUG_EPOCH_START", "4294967290", 1);
  EXPECT_EQ(env::debug_epoch_start(), std::optional<uint32_t>(4294967290u));
  setenv("EPX_DEBUG_EPOCH_START", "4294967296", 1);
  expect_error([] { env::debug_epoch_start(); }, {"EPX_DEBUG_EPOCH_START", "[0, 4294967295]"});
  setenv("EPX_DEBUG_EPOCH_START", "-1", 1);
  expect_error([] { env::debug_epoch_start(); }, {"EPX_DEBUG_EPOCH_START", "[0, 4294967295]"});
  setenv("EPX_DEBUG_EPOCH_START", "x", 1);
  expect_error([] { env::debug_epoch_start(); }, {"EPX_DEBUG_EPOCH_START", "integer"});
  unsetenv("EPX_DEBUG_EPOCH_START");
  // the mid-dispatch death knob: unset, RANK:TOKENS, or an error naming it
  unsetenv("EPX_DEBUG_LL_DISPATCH_STOP");
  EXPECT_FALSE(env::debug_ll_dispatch_stop().has_value());
  setenv("EPX_DEBUG_LL_DISPATCH_STOP", "2:5", 1);
  const auto stop = env::debug_ll_dispatch_stop();
  ASSERT_TRUE(stop.has_value());
  EXPECT_EQ(stop->rank, 2);
  EXPECT_EQ(stop->tokens, 5);
  setenv("EPX_DEBUG_LL_DISPATCH_STOP", "0:2147483647", 1);
  EXPECT_EQ(env::debug_ll_dispatch_stop()->tokens, 2147483647);
  for (const char* bad : {"2", "2:", ":5", "2:5:1", "2:5x", "-1:5", "2:-5", "a:b", " 2:5", "+2:5",
                          "2: 5", "0:2147483648", "99999999999:1"}) {
    setenv("EPX_DEBUG_LL_DISPATCH_STOP", bad, 1);
    expect_error([] { env::debug_ll_dispatch_stop(); },
                 {"EPX_DEBUG_LL_DISPATCH_STOP", "RANK:TOKENS"});
  }
  unsetenv("EPX_DEBUG_LL_DISPATCH_STOP");
  // the dead-proxy knob: unset, RANK:CHANNEL:COMMANDS, or an error naming it
  unsetenv("EPX_DEBUG_PROXY_STOP");
  EXPECT_FALSE(env::debug_proxy_stop().has_value());
  setenv("EPX_DEBUG_PROXY_STOP", "3:1:7", 1);
  const auto proxy_stop = env::debug_proxy_stop();
  ASSERT_TRUE(proxy_stop.has_value());
  EXPECT_EQ(proxy_stop->rank, 3);
  EXPECT_EQ(proxy_stop->channel, 1);
  EXPECT_EQ(proxy_stop->commands, 7);
  for (const char* bad :
       {"3", "3:1", "3:1:", "3::7", "3:1:7:2", "-3:1:7", "3:1:x", " 3:1:7", "3:1:2147483648"}) {
    setenv("EPX_DEBUG_PROXY_STOP", bad, 1);
    expect_error([] { env::debug_proxy_stop(); },
                 {"EPX_DEBUG_PROXY_STOP", "RANK:CHANNEL:COMMANDS"});
  }
  unsetenv("EPX_DEBUG_PROXY_STOP");
}

}  // namespace
}  // namespace epx
