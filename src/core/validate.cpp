#include "core/validate.hpp"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include "core/internode_handle.hpp"

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

/// Bytes `p` lies past the last multiple of `align` (0: aligned).
uint64_t misalignment(const void* p, uint64_t align) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)) % align;
}

std::string address_str(const void* p) {
  std::ostringstream os;
  os << p;
  return os.str();
}

}  // namespace

void vector_aligned(const char* op, const char* name, const TensorView& t) {
  if (t.data == nullptr || t.numel() == 0) return;
  if (const uint64_t off = misalignment(t.data, kVectorAlign))
    fail(op, name,
         "must start at a 16-byte aligned address (the kernels read and write it 16 bytes at a "
         "time); it starts at " +
             address_str(t.data) + ", " + std::to_string(off) +
             " bytes past a multiple of 16 (a view such as x[:, k:] of a wider tensor; pass "
             "x.contiguous() or a view whose offset is a multiple of 16 bytes) (got " +
             t.describe() + ")");
  const auto esize = static_cast<int64_t>(element_size(t.dtype));
  for (int d = 0; d + 1 < t.ndim; ++d)
    if ((t.strides[d] * esize) % static_cast<int64_t>(kVectorAlign) != 0)
      fail(op, name,
           "dimension " + std::to_string(d) + "'s stride (" + std::to_string(t.strides[d]) +
               " elements of " + std::to_string(esize) +
               " B) must be a multiple of 16 bytes (the kernels read and write rows 16 bytes at a "
               "time) (got " +
               t.describe() + ")");
}

void tensor(const char* op, const char* name, const TensorView& t, DType dtype,
            std::initializer_list<int64_t> shape, int device, bool contiguous) {
  if (t.data == nullptr && t.numel() != 0) fail(op, name, "is null");
  if (t.dtype != dtype)
    fail(op, name, std::string("must be ") + dtype_name(dtype) + " (got " + t.describe() + ")");
  if (t.data != nullptr && t.numel() != 0) {
    const uint64_t esize = element_size(dtype);
    if (const uint64_t off = misalignment(t.data, esize))
      fail(op, name,
           "must be aligned to its element size (" + std::to_string(esize) +
               " bytes); it starts at " + address_str(t.data) + ", " + std::to_string(off) +
               " bytes past a multiple (got " + t.describe() + ")");
  }
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

void ht_rings(int value) {
  require(value >= -1 && value <= (1 << 20), "ht_rings",
          "must be -1 (the rings where the whole-call areas do not fit), 0 (never), 1 (always, "
          "default ring sizes) or ring records in [2, 2^20] (always), got " +
              std::to_string(value));
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
  if (static_cast<int64_t>(num_ranks) * max_tokens > kMaxLowLatencyRecvList)
    fail(op, "num_max_dispatch_tokens_per_rank",
         "times the rank count must be at most " + std::to_string(kMaxLowLatencyRecvList) +
             " (the receive lists every (rank, token) of an expert in shared memory), got " +
             std::to_string(max_tokens) + " x " + std::to_string(num_ranks) + " ranks");
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
  if (a.x.strides[1] != 1)
    fail(op, "x", "rows must be contiguous (stride 1 along hidden; got " + a.x.describe() + ")");
  vector_aligned(op, "x", a.x);
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
    handle_routing(op, *a.handle, device);
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

namespace {
/// One routing tensor of a handle: defined (it was made by a dispatch), of
/// `dtype`, on `device`, of `shape` (kAny: any extent; empty: any rank).
void routing_tensor(const char* op, const char* what, const Tensor& t, DType dtype,
                    std::initializer_list<int64_t> shape, int device) {
  const TensorView& v = t.view;
  const bool any_rank = shape.size() == 0;
  bool ok = v.ndim > 0 && (v.data != nullptr || v.numel() == 0) && v.dtype == dtype &&
            v.device == device && (any_rank || v.ndim == static_cast<int>(shape.size()));
  int d = 0;
  for (int64_t s : shape) {
    if (!ok) break;
    ok = s == kAny || v.shape[d] == s;
    ++d;
  }
  if (!ok)
    fail(op, "handle",
         std::string("lacks its routing tensor ") + what + " (" + dtype_name(dtype) + " " +
             (any_rank ? std::string("of any shape") : shape_str(shape)) + " on cuda:" +
             std::to_string(device) + "; got " + (v.ndim > 0 ? v.describe() : "none") +
             "): pass the handle a dispatch of this buffer returned");
}
}  // namespace

void handle_routing(const char* op, const DispatchHandle& h, int device) {
  const int64_t T = h.num_tokens, R = h.num_ranks, N = h.num_recv_tokens;
  if (T < 0 || R < 1 || N < 0)
    fail(op, "handle",
         "has impossible sizes (num_tokens " + std::to_string(T) + ", num_ranks " +
             std::to_string(R) + ", num_recv_tokens " + std::to_string(N) + ")");
  routing_tensor(op, "is_token_in_rank", h.is_token_in_rank, DType::kBool, {T, R}, device);
  routing_tensor(op, "recv_src_idx", h.recv_src_idx, DType::kI32, {N}, device);
  if (h.ranks_per_node <= 0) {  // within one node (high_throughput.cpp)
    routing_tensor(op, "send_slot", h.send_slot, DType::kI32, {T, R}, device);
    routing_tensor(op, "send_list", h.send_list, DType::kI32, {R, std::max<int64_t>(T, 1)}, device);
    routing_tensor(op, "send_counts", h.send_counts, DType::kI32, {R}, device);
    routing_tensor(op, "recv_offsets", h.recv_offsets, DType::kI32, {R + 1}, device);
    return;
  }
  // Across nodes (internode.cpp): the route, the forwarding records, the
  // receive metadata and the source counts.
  if (R % h.ranks_per_node != 0)
    fail(op, "handle",
         "has ranks_per_node " + std::to_string(h.ranks_per_node) + " that does not divide " +
             std::to_string(R) + " ranks");
  const int64_t nodes = R / h.ranks_per_node;
  const DispatchHandle::Internode& hn = across(h, op);
  routing_tensor(op, "net_send_pos", hn.net_send_pos, DType::kI32, {T, nodes}, device);
  routing_tensor(op, "net_rank_pos", hn.net_rank_pos, DType::kI32, {T, R}, device);
  routing_tensor(op, "net_table", hn.net_table, DType::kI32, {}, device);
  routing_tensor(op, "net_fwd_mask", hn.net_fwd_mask, DType::kI32, {}, device);
  routing_tensor(op, "net_fwd_token", hn.net_fwd_token, DType::kI32, {}, device);
  routing_tensor(op, "net_recv_meta", hn.net_recv_meta, DType::kI32, {N, 3}, device);
  routing_tensor(op, "rank_prefix_matrix", h.rank_prefix_matrix, DType::kI32, {R, R}, device);
  routing_tensor(op, "source_num_tokens", h.source_num_tokens, DType::kI32, {R}, device);
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
  vector_aligned(op, "x", a.x);
  for (const auto& [bias, bname] : {std::pair{&a.bias_0, "bias_0"}, std::pair{&a.bias_1, "bias_1"}})
    if (*bias) {
      tensor(op, bname, **bias, DType::kBF16, {h.num_tokens, a.x.shape[1]}, device);
      vector_aligned(op, bname, **bias);
    }
  handle_routing(op, h, device);
}

void low_latency_dispatch(const LowLatencyDispatchArgs& a, int num_ranks, int device) {
  const char* op = "low_latency_dispatch";
  tensor(op, "x", a.x, DType::kBF16, {kAny, kAny}, device);
  vector_aligned(op, "x", a.x);
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
  vector_aligned(op, "x", a.x);
  tensor(op, "topk_idx", a.topk_idx, DType::kI64, {h.num_tokens, h.num_topk}, device);
  tensor(op, "topk_weights", a.topk_weights, DType::kF32, {h.num_tokens, h.num_topk}, device);
  if (a.out) {
    tensor(op, "out", *a.out, DType::kBF16, {h.num_tokens, h.hidden}, device);
    vector_aligned(op, "out", *a.out);
  }
  if (a.combine_wait_recv_cost_stats)
    tensor(op, "combine_wait_recv_cost_stats", *a.combine_wait_recv_cost_stats, DType::kI64,
           {num_ranks}, device);
}

}  // namespace epx::validate
