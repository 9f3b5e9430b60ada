#include "core/validate.hpp"

#include <sstream>
#include <string>

namespace epx::validate {
namespace {

[[noreturn]] void fail(const char* op, const std::string& arg, const std::string& rule) {
  throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + arg + ": " + rule);
}

std::string shape_str(std::initializer_list<int64_t> shape) {
  std::ostringstream os;
  os << "[";
  int i = 0;
  for (int64_t s : shape)
    os << (i++ ? ", " : "") << (s == kAny ? std::string("*") : std::to_string(s));
  os << "]";
  return os.str();
}

}  // namespace

void tensor(const char* op, const char* name, const TensorView& t, DType dtype,
            std::initializer_list<int64_t> shape, int device, bool contiguous) {
  if (t.data == nullptr && t.numel() != 0) fail(op, name, "is null");
  if (t.dtype != dtype)
    fail(op, name, std::string("must be ") + dtype_name(dtype) + " (got " + t.describe() + ")");
  if (t.ndim != static_cast<int>(shape.size()))
    fail(op, name, "must have shape " + shape_str(shape) + " (got " + t.describe() + ")");
  int d = 0;
  for (int64_t s : shape) {
    if (s != kAny && t.shape[d] != s)
      fail(op, name, "must have shape " + shape_str(shape) + " (got " + t.describe() + ")");
    if (t.shape[d] < 0) fail(op, name, "has a negative extent (got " + t.describe() + ")");
    ++d;
  }
  if (device == kCpu && t.device != kCpu)
    fail(op, name, "must be in host memory (got " + t.describe() + ")");
  if (device == kAnyDevice && t.device == kCpu)
    fail(op, name, "must be on a CUDA device (got " + t.describe() + ")");
  if (device != kCpu && device != kAnyDevice && t.device != device)
    fail(op, name, "must be on cuda:" + std::to_string(device) + " (got " + t.describe() + ")");
  if (contiguous && !t.is_contiguous())
    fail(op, name, "must be contiguous (got " + t.describe() + ")");
}

void num_experts(const char* op, int num_experts, int num_ranks) {
  if (num_experts <= 0)
    fail(op, "num_experts", "must be > 0 (got " + std::to_string(num_experts) + ")");
  if (num_experts % num_ranks != 0)
    fail(op, "num_experts",
         "must be divisible by the number of ranks " + std::to_string(num_ranks) + " (got " +
             std::to_string(num_experts) + ")");
}

void rank_in_group(const char* op, const char* name, int value, int num_ranks) {
  if (value < 0 || value >= num_ranks)
    fail(op, name,
         "must be a rank of the group, in [0, " + std::to_string(num_ranks) + ") (got " +
             std::to_string(value) + ")");
}

void hidden(const char* op, int64_t hidden, DType dtype, bool fp8_path) {
  if (hidden <= 0) fail(op, "hidden", "must be > 0 (got " + std::to_string(hidden) + ")");
  if ((hidden * static_cast<int64_t>(element_size(dtype))) % 16 != 0)
    fail(op, "hidden",
         "a row must be a multiple of 16 bytes (hidden " + std::to_string(hidden) + " x " +
             std::to_string(element_size(dtype)) + " B)");
  if (fp8_path && hidden % 128 != 0)
    fail(op, "hidden", "FP8 needs a multiple of 128 (got " + std::to_string(hidden) + ")");
}

void num_topk(const char* op, int64_t k, const char* name) {
  if (k < 1 || k > kMaxTopK)
    fail(op, name,
         "top-k must be in [1, " + std::to_string(kMaxTopK) + "] (got " + std::to_string(k) + ")");
}

void topk_idx_values(const char* op, const TensorView& t, int num_experts) {
  if (t.device != kCpu) return;
  const auto* v = t.ptr<const int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (v[i] != -1 && (v[i] < 0 || v[i] >= num_experts))
      fail(op, "topk_idx",
           "values must be -1 or in [0, num_experts=" + std::to_string(num_experts) +
               ") (element " + std::to_string(i) + " is " + std::to_string(v[i]) + ")");
  }
}

void low_latency_sizes(const char* op, int64_t max_tokens, int64_t hidden, int64_t num_experts,
                       int num_ranks) {
  if (max_tokens <= 0 || max_tokens > kMaxLowLatencyTokens)
    fail(op, "num_max_dispatch_tokens_per_rank",
         "must be in [1, " + std::to_string(kMaxLowLatencyTokens) + "] (got " +
             std::to_string(max_tokens) + ")");
  if (hidden <= 0) fail(op, "hidden", "must be > 0 (got " + std::to_string(hidden) + ")");
  if (hidden % 128 != 0)
    fail(op, "hidden", "must be a multiple of 128 (got " + std::to_string(hidden) + ")");
  if (hidden > plan::kLlMaxHidden)
    fail(op, "hidden",
         "must be at most " + std::to_string(plan::kLlMaxHidden) + " (got " +
             std::to_string(hidden) + ")");
  if (num_experts <= 0)
    fail(op, "num_experts", "must be > 0 (got " + std::to_string(num_experts) + ")");
  if (num_experts > plan::kLlMaxExperts)
    fail(op, "num_experts",
         "must be at most " + std::to_string(plan::kLlMaxExperts) + " for low-latency (got " +
             std::to_string(num_experts) + ")");
  validate::num_experts(op, static_cast<int>(num_experts), num_ranks);
}

void dispatch_layout(const TensorView& topk_idx, int num_experts, int num_ranks, int device) {
  const char* op = "get_dispatch_layout";
  validate::num_experts(op, num_experts, num_ranks);
  if (num_experts > kMaxLayoutExperts)
    fail(op, "num_experts",
         "must be at most " + std::to_string(kMaxLayoutExperts) + " (got " +
             std::to_string(num_experts) + ")");
  tensor(op, "topk_idx", topk_idx, DType::kI64, {kAny, kAny}, device);
  num_topk(op, topk_idx.shape[1]);
}

void dispatch(const DispatchArgs& a, int num_ranks, int device) {
  const char* op = "dispatch";
  // As DeepEP: rows of any dtype (the dispatch moves bytes) whose size is a
  // multiple of 16 bytes; scales only with 1-byte elements (FP8), float32 or
  // int32 (packed UE8M0), [num_tokens, any number >= 1], moved with the rows.
  if (a.x.ndim != 2) fail(op, "x", "must be [num_tokens, hidden] (got " + a.x.describe() + ")");
  if (a.x.device != device)
    fail(op, "x", "must be on cuda:" + std::to_string(device) + " (got " + a.x.describe() + ")");
  const int64_t T = a.x.shape[0], H = a.x.shape[1];
  if (T < 0) fail(op, "x", "has a negative extent (got " + a.x.describe() + ")");
  hidden(op, H, a.x.dtype, false);
  if (a.x.data == nullptr && T > 0) fail(op, "x", "is null");
  if (a.x.strides[1] != 1 ||
      (a.x.strides[0] * static_cast<int64_t>(element_size(a.x.dtype))) % 16 != 0)
    fail(op, "x", "rows must be contiguous and 16-byte aligned (got " + a.x.describe() + ")");
  if (a.x_scales) {
    if (element_size(a.x.dtype) != 1)
      fail(op, "x_scales",
           "needs x of 1-byte elements (float8_e4m3fn; got " + a.x.describe() + ")");
    const TensorView& sc = *a.x_scales;
    const DType sd = sc.dtype == DType::kI32 ? DType::kI32 : DType::kF32;
    tensor(op, "x_scales", sc, sd, {T, kAny}, device, false);
    if (sc.shape[1] < 1)
      fail(
          op, "x_scales",
          "must have at least one scale per token ([num_tokens, >= 1]; got " + sc.describe() + ")");
  }
  if (a.expert_alignment < 1)
    fail(op, "expert_alignment", "must be >= 1 (got " + std::to_string(a.expert_alignment) + ")");
  if (a.num_worst_tokens < 0)
    fail(op, "num_worst_tokens", "must be >= 0 (got " + std::to_string(a.num_worst_tokens) + ")");
  if (a.handle) {
    if (a.topk_idx || a.topk_weights)
      fail(op, "topk_idx", "must be None for a cached dispatch (handle given)");
    if (a.num_worst_tokens > 0)
      fail(op, "num_worst_tokens", "must be 0 for a cached dispatch (handle given)");
    if (a.handle->num_ranks != num_ranks)
      fail(op, "handle", "was made by a buffer of another rank count");
    if (a.handle->num_tokens != T)
      fail(op, "handle",
           "was made for " + std::to_string(a.handle->num_tokens) + " tokens, x has " +
               std::to_string(T));
    return;
  }
  if (!a.num_tokens_per_rank || !a.is_token_in_rank || !a.num_tokens_per_expert)
    fail(op, "num_tokens_per_rank",
         "num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert are required without a "
         "handle "
         "(from get_dispatch_layout)");
  tensor(op, "num_tokens_per_rank", *a.num_tokens_per_rank, DType::kI32, {num_ranks}, device);
  tensor(op, "is_token_in_rank", *a.is_token_in_rank, DType::kBool, {T, num_ranks}, device);
  tensor(op, "num_tokens_per_expert", *a.num_tokens_per_expert, DType::kI32, {kAny}, device);
  num_experts(op, static_cast<int>(a.num_tokens_per_expert->shape[0]), num_ranks);
  if (a.topk_weights && !a.topk_idx) fail(op, "topk_weights", "needs topk_idx");
  if (a.topk_idx) {
    tensor(op, "topk_idx", *a.topk_idx, DType::kI64, {T, kAny}, device);
    num_topk(op, a.topk_idx->shape[1]);
    if (a.topk_weights)
      tensor(op, "topk_weights", *a.topk_weights, DType::kF32, {T, a.topk_idx->shape[1]}, device);
  }
}

void combine(const CombineArgs& a, int num_ranks, int device) {
  const char* op = "combine";
  if (!a.handle) fail(op, "handle", "is required (the handle returned by dispatch)");
  const auto& h = *a.handle;
  if (h.num_ranks != num_ranks) fail(op, "handle", "was made by a buffer of another rank count");
  tensor(op, "x", a.x, DType::kBF16, {h.num_recv_tokens, kAny}, device);
  if (h.hidden && a.x.shape[1] != h.hidden)
    fail(op, "x",
         "hidden must match the dispatch (" + std::to_string(h.hidden) + ", got " + a.x.describe() +
             ")");
  hidden(op, a.x.shape[1], DType::kBF16, false);
  if (a.topk_weights) {
    tensor(op, "topk_weights", *a.topk_weights, DType::kF32, {h.num_recv_tokens, kAny}, device);
    num_topk(op, a.topk_weights->shape[1], "topk_weights");
  }
  if (a.bias_0) tensor(op, "bias_0", *a.bias_0, DType::kBF16, {h.num_tokens, a.x.shape[1]}, device);
  if (a.bias_1) tensor(op, "bias_1", *a.bias_1, DType::kBF16, {h.num_tokens, a.x.shape[1]}, device);
}

void low_latency_dispatch(const LowLatencyDispatchArgs& a, int num_ranks, int device) {
  const char* op = "low_latency_dispatch";
  tensor(op, "x", a.x, DType::kBF16, {kAny, kAny}, device);
  const int64_t T = a.x.shape[0], H = a.x.shape[1];
  low_latency_sizes(op, a.num_max_dispatch_tokens_per_rank, H, a.num_experts, num_ranks);
  if (T > a.num_max_dispatch_tokens_per_rank)
    fail(op, "x",
         "has " + std::to_string(T) + " tokens, more than num_max_dispatch_tokens_per_rank=" +
             std::to_string(a.num_max_dispatch_tokens_per_rank));
  tensor(op, "topk_idx", a.topk_idx, DType::kI64, {T, kAny}, device);
  num_topk(op, a.topk_idx.shape[1]);
  if (!a.use_fp8 && (a.round_scale || a.use_ue8m0))
    fail(op, "use_fp8", "round_scale and use_ue8m0 need use_fp8=True");
  if (a.use_ue8m0 && !a.round_scale)
    fail(op, "use_ue8m0", "needs round_scale=True (UE8M0 scales are powers of two)");
  if (a.cumulative_local_expert_recv_stats)
    tensor(op, "cumulative_local_expert_recv_stats", *a.cumulative_local_expert_recv_stats,
           DType::kI32, {a.num_experts / num_ranks}, device);
  if (a.dispatch_wait_recv_cost_stats)
    tensor(op, "dispatch_wait_recv_cost_stats", *a.dispatch_wait_recv_cost_stats, DType::kI64,
           {num_ranks}, device);
}

void low_latency_combine(const LowLatencyCombineArgs& a, int num_ranks, int device) {
  const char* op = "low_latency_combine";
  if (!a.handle) fail(op, "handle", "is required (the handle returned by low_latency_dispatch)");
  const auto& h = *a.handle;
  if (h.num_ranks != num_ranks) fail(op, "handle", "was made by a buffer of another rank count");
  const int64_t E_local = h.num_experts / num_ranks,
                rows = static_cast<int64_t>(num_ranks) * h.num_max_dispatch_tokens_per_rank;
  tensor(op, "x", a.x, DType::kBF16, {E_local, rows, h.hidden}, device);
  tensor(op, "topk_idx", a.topk_idx, DType::kI64, {h.num_tokens, h.num_topk}, device);
  tensor(op, "topk_weights", a.topk_weights, DType::kF32, {h.num_tokens, h.num_topk}, device);
  if (a.out) tensor(op, "out", *a.out, DType::kBF16, {h.num_tokens, h.hidden}, device);
  if (a.combine_wait_recv_cost_stats)
    tensor(op, "combine_wait_recv_cost_stats", *a.combine_wait_recv_cost_stats, DType::kI64,
           {num_ranks}, device);
}

}  // namespace epx::validate
