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
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/internode_handle.hpp"
#include "core/validate.hpp"
#include "epx/buffer.hpp"

namespace epx {
namespace {

constexpr int64_t kAny = validate::kAny;

// Argument sets per op and run: more than 10,000 in all.
constexpr int kLayoutSets = 1500, kDispatchSets = 4000, kCombineSets = 2500,
              kLowLatencyDispatchSets = 3000, kLowLatencyCombineSets = 2500, kSizeHintSets = 1500,
              kMaskSets = 1000, kHostTopkSets = 1000, kConfigSets = 1500, kNumSmsSets = 500,
              kInternodeHintSets = 1500;
static_assert(kLayoutSets + kDispatchSets + kCombineSets + kLowLatencyDispatchSets +
                      kLowLatencyCombineSets + kSizeHintSets + kMaskSets + kHostTopkSets +
                      kConfigSets + kNumSmsSets + kInternodeHintSets >=
                  10000,
              "the fuzz must feed at least 10,000 argument sets per run");

uint64_t seed() {
  static const uint64_t s = [] {
    const char* v = std::getenv("EPX_FUZZ_SEED");
    const uint64_t x = v ? std::strtoull(v, nullptr, 10)
                         : (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
    std::printf("ValidateFuzz: EPX_FUZZ_SEED=%llu%s\n", static_cast<unsigned long long>(x),
                v ? " (from the environment)" : " (drawn for this run)");
    return x;
  }();
  return s;
}

int scaled(int n) {
  const char* s = std::getenv("EPX_FUZZ_SCALE");
  return s ? n * std::max(1, std::atoi(s)) : n;
}

/// The random source, with the few draws the generators need.
struct Gen {
  std::mt19937_64 rng;
  explicit Gen(uint64_t s) : rng(s) {}
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }
  int64_t between(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  }
  template <class T>
  T pick(std::initializer_list<T> xs) {
    return *(xs.begin() + between(0, static_cast<int64_t>(xs.size()) - 1));
  }
  /// A value that breaks an integer rule more often than not: 0, -1, the edges
  /// of typical limits and their neighbours, or anything small.
  int64_t wild() {
    return pick<int64_t>(
        {0,   -1,  -7,   1,    2,    3,    7,    15,   16,    17,    127,
         128, 129, 1023, 1024, 1025, 8191, 8192, 8193, 16384, 16512, between(-1000, 5000)});
  }
};

/// Which arguments the rules find broken; empty = the set is valid.
struct Verdict {
  std::set<std::string> broken;
  void flag(bool bad, const std::string& arg) {
    if (bad) broken.insert(arg);
  }
};

// ---- the rules -----------------------------------------------------------------------

/// Row-major dense: each stride is the product of the later extents, except in
/// dimensions of extent 1, whose stride does not matter.
bool dense(const TensorView& t) {
  int64_t expect = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expect) return false;
    expect *= t.shape[d];
  }
  return true;
}

/// A tensor argument: its dtype; its rank and extents (kAny: any, never
/// negative); non-null data unless it has no element; its device (a CUDA
/// ordinal, kCpu = host memory, kAnyDevice = any CUDA device); dense when asked.
bool tensor_ok(const TensorView& t, DType dtype, const std::vector<int64_t>& shape, int device,
               bool contiguous = true) {
  if (t.dtype != dtype || t.ndim != static_cast<int>(shape.size())) return false;
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0 || (shape[d] != kAny && t.shape[d] != shape[d])) return false;
    n *= t.shape[d];
  }
  if (t.data == nullptr && n != 0) return false;
  // the data pointer a multiple of the element size (where anything is read)
  if (n != 0 && reinterpret_cast<uintptr_t>(t.data) % element_size(t.dtype) != 0) return false;
  if (device == kCpu && t.device != kCpu) return false;
  if (device == validate::kAnyDevice && t.device == kCpu) return false;
  if (device >= 0 && t.device != device) return false;
  return !contiguous || dense(t);
}

/// What the kernels move 16 bytes at a time (rows of x, biases, outputs): the
/// data pointer and every stride but the innermost multiples of 16 bytes.
bool vectors_ok(const TensorView& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
  if (t.data == nullptr || n == 0) return true;  // no element: nothing is read
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int d = 0; d + 1 < t.ndim; ++d)
    if ((t.strides[d] * static_cast<int64_t>(element_size(t.dtype))) % 16 != 0) return false;
  return true;
}

/// A handle of a high-throughput dispatch carries the routing its combine
/// and cached dispatches read (docs/api.md): is_token_in_rank [T, R] bool
/// and recv_src_idx [N] int32; within one node send_slot [T, R],
/// send_list [R, max(T, 1)], send_counts [R], recv_offsets [R + 1]; across
/// nodes net_send_pos [T, nodes], net_rank_pos [T, R], net_recv_meta
/// [N, 3], rank_prefix_matrix [R, R], source_num_tokens [R] and the
/// route's net_table, net_fwd_mask, net_fwd_token (any shape); all int32 on
/// the buffer's device.
bool routing_ok(const DispatchHandle& h, int dev) {
  const int64_t T = h.num_tokens, R = h.num_ranks, N = h.num_recv_tokens;
  if (T < 0 || R < 1 || N < 0) return false;
  const auto has = [&](const Tensor& t, DType dt, std::vector<int64_t> shape) {
    if (t.view.ndim == 0) return false;
    if (shape.empty()) shape.assign(static_cast<std::size_t>(t.view.ndim), kAny);
    return tensor_ok(t.view, dt, shape, dev, false);
  };
  if (!has(h.is_token_in_rank, DType::kBool, {T, R}) || !has(h.recv_src_idx, DType::kI32, {N}))
    return false;
  if (h.ranks_per_node <= 0)
    return has(h.send_slot, DType::kI32, {T, R}) &&
           has(h.send_list, DType::kI32, {R, std::max<int64_t>(T, 1)}) &&
           has(h.send_counts, DType::kI32, {R}) && has(h.recv_offsets, DType::kI32, {R + 1});
  if (R % h.ranks_per_node != 0 || !h.internode) return false;
  const epx::DispatchHandle::Internode& n = *h.internode;
  return has(n.net_send_pos, DType::kI32, {T, R / h.ranks_per_node}) &&
         has(n.net_rank_pos, DType::kI32, {T, R}) && has(n.net_recv_meta, DType::kI32, {N, 3}) &&
         has(h.rank_prefix_matrix, DType::kI32, {R, R}) &&
         has(h.source_num_tokens, DType::kI32, {R}) && has(n.net_table, DType::kI32, {}) &&
         has(n.net_fwd_mask, DType::kI32, {}) && has(n.net_fwd_token, DType::kI32, {});
}

bool topk_ok(int64_t k) {
  return k >= 1 && k <= 16;
}
bool experts_ok(int64_t e, int num_ranks) {
  return e > 0 && e % num_ranks == 0;
}
/// Hidden size of rows of `dtype`: > 0, rows a multiple of 16 bytes, FP8 a
/// multiple of 128 where `fp8` (the low-latency ops).
bool hidden_ok(int64_t h, DType dtype, bool fp8) {
  return h > 0 && (h * static_cast<int64_t>(element_size(dtype))) % 16 == 0 &&
         (!fp8 || h % 128 == 0);
}

void low_latency_size_rules(Verdict& v, int64_t max_tokens, int64_t hidden, int64_t experts,
                            int num_ranks) {
  v.flag(max_tokens < 1 || max_tokens > 1024, "num_max_dispatch_tokens_per_rank");
  v.flag(hidden <= 0 || hidden % 128 != 0 || hidden > 16384, "hidden");
  v.flag(!experts_ok(experts, num_ranks) || experts > 1024, "num_experts");
  // the receive lists every (rank, token) of an expert: 24 Ki entries at most
  v.flag(max_tokens >= 1 && static_cast<int64_t>(num_ranks) * max_tokens > 24 * 1024,
         "num_max_dispatch_tokens_per_rank");
}

Verdict dispatch_layout_rules(const TensorView& topk_idx, int experts, int R, int dev) {
  Verdict v;
  v.flag(!experts_ok(experts, R) || experts > 8192, "num_experts");
  v.flag(!tensor_ok(topk_idx, DType::kI64, {kAny, kAny}, dev), "topk_idx");
  v.flag(topk_idx.ndim == 2 && !topk_ok(topk_idx.shape[1]), "topk_idx");
  return v;
}

Verdict dispatch_rules(const DispatchArgs& a, int R, int dev) {
  Verdict v;
  const TensorView& x = a.x;
  // Rows of any dtype (DeepEP's rule); scales only with 1-byte elements,
  // float32 or int32, [T, S >= 1], any strides.
  if (x.ndim != 2) {
    v.flag(true, "x");
    return v;
  }
  const int64_t T = x.shape[0], H = x.shape[1];
  v.flag(x.device != dev || T < 0 || (x.data == nullptr && T * H != 0), "x");
  v.flag(!hidden_ok(H, x.dtype, false), "hidden");
  // rows: dense inside, starting at 16-byte multiples, from a 16-byte aligned base
  v.flag(x.strides[1] != 1 || !vectors_ok(x), "x");
  if (a.x_scales) {
    const TensorView& sc = *a.x_scales;
    v.flag(element_size(x.dtype) != 1, "x_scales");
    v.flag(!tensor_ok(sc, DType::kF32, {T, kAny}, dev, false) &&
               !tensor_ok(sc, DType::kI32, {T, kAny}, dev, false),
           "x_scales");
    v.flag(sc.ndim == 2 && sc.shape[1] < 1, "x_scales");
  }
  v.flag(a.expert_alignment < 1, "expert_alignment");
  v.flag(a.num_worst_tokens < 0, "num_worst_tokens");
  if (a.handle) {  // cached: the routing comes from the handle of a dispatch of these tokens
    v.flag(a.topk_idx || a.topk_weights, "topk_idx");
    v.flag(a.num_worst_tokens > 0, "num_worst_tokens");
    v.flag(a.handle->num_ranks != R || a.handle->num_tokens != T, "handle");
    v.flag(!routing_ok(*a.handle, dev), "handle");
    return v;
  }
  if (!a.num_tokens_per_rank || !a.is_token_in_rank || !a.num_tokens_per_expert) {
    v.flag(true, "num_tokens_per_rank");  // the three come together from get_dispatch_layout
  } else {
    v.flag(!tensor_ok(*a.num_tokens_per_rank, DType::kI32, {R}, dev), "num_tokens_per_rank");
    v.flag(!tensor_ok(*a.is_token_in_rank, DType::kBool, {T, R}, dev), "is_token_in_rank");
    const TensorView& per_expert = *a.num_tokens_per_expert;
    v.flag(!tensor_ok(per_expert, DType::kI32, {kAny}, dev), "num_tokens_per_expert");
    if (per_expert.ndim == 1) v.flag(!experts_ok(per_expert.shape[0], R), "num_experts");
  }
  v.flag(a.topk_weights && !a.topk_idx, "topk_weights");
  if (a.topk_idx) {
    v.flag(!tensor_ok(*a.topk_idx, DType::kI64, {T, kAny}, dev), "topk_idx");
    if (a.topk_idx->ndim == 2) {
      const int64_t K = a.topk_idx->shape[1];
      v.flag(!topk_ok(K), "topk_idx");
      if (a.topk_weights)
        v.flag(!tensor_ok(*a.topk_weights, DType::kF32, {T, K}, dev), "topk_weights");
    }
  }
  return v;
}

Verdict combine_rules(const CombineArgs& a, int R, int dev) {
  Verdict v;
  if (!a.handle) {
    v.flag(true, "handle");
    return v;
  }
  const DispatchHandle& h = *a.handle;
  v.flag(h.num_ranks != R, "handle");
  v.flag(!routing_ok(h, dev), "handle");
  v.flag(!tensor_ok(a.x, DType::kBF16, {h.num_recv_tokens, kAny}, dev) || !vectors_ok(a.x), "x");
  if (a.x.ndim != 2) return v;
  const int64_t H = a.x.shape[1];
  v.flag(h.hidden != 0 && H != h.hidden, "x");  // the dispatch's hidden size
  v.flag(!hidden_ok(H, DType::kBF16, false), "hidden");
  if (a.topk_weights) {
    v.flag(!tensor_ok(*a.topk_weights, DType::kF32, {h.num_recv_tokens, kAny}, dev),
           "topk_weights");
    if (a.topk_weights->ndim == 2) v.flag(!topk_ok(a.topk_weights->shape[1]), "topk_weights");
  }
  if (a.bias_0)
    v.flag(!tensor_ok(*a.bias_0, DType::kBF16, {h.num_tokens, H}, dev) || !vectors_ok(*a.bias_0),
           "bias_0");
  if (a.bias_1)
    v.flag(!tensor_ok(*a.bias_1, DType::kBF16, {h.num_tokens, H}, dev) || !vectors_ok(*a.bias_1),
           "bias_1");
  return v;
}

Verdict low_latency_dispatch_rules(const LowLatencyDispatchArgs& a, int R, int dev) {
  Verdict v;
  v.flag(!tensor_ok(a.x, DType::kBF16, {kAny, kAny}, dev) || !vectors_ok(a.x), "x");
  if (a.x.ndim != 2) return v;
  const int64_t T = a.x.shape[0], H = a.x.shape[1];
  low_latency_size_rules(v, a.num_max_dispatch_tokens_per_rank, H, a.num_experts, R);
  v.flag(T > a.num_max_dispatch_tokens_per_rank, "x");
  v.flag(!tensor_ok(a.topk_idx, DType::kI64, {T, kAny}, dev), "topk_idx");
  v.flag(a.topk_idx.ndim == 2 && !topk_ok(a.topk_idx.shape[1]), "topk_idx");
  v.flag(!a.use_fp8 && (a.round_scale || a.use_ue8m0), "use_fp8");
  v.flag(a.use_ue8m0 && !a.round_scale, "use_ue8m0");  // UE8M0 scales are powers of two
  if (a.cumulative_local_expert_recv_stats)
    v.flag(!tensor_ok(*a.cumulative_local_expert_recv_stats, DType::kI32, {a.num_experts / R}, dev),
           "cumulative_local_expert_recv_stats");
  if (a.dispatch_wait_recv_cost_stats)
    v.flag(!tensor_ok(*a.dispatch_wait_recv_cost_stats, DType::kI64, {R}, dev),
           "dispatch_wait_recv_cost_stats");
  return v;
}

Verdict low_latency_combine_rules(const LowLatencyCombineArgs& a, int R, int dev) {
  Verdict v;
  if (!a.handle) {
    v.flag(true, "handle");
    return v;
  }
  const LowLatencyHandle& h = *a.handle;
  v.flag(h.num_ranks != R, "handle");
  const int64_t rows = static_cast<int64_t>(R) * h.num_max_dispatch_tokens_per_rank;
  v.flag(
      !tensor_ok(a.x, DType::kBF16, {h.num_experts / R, rows, h.hidden}, dev) || !vectors_ok(a.x),
      "x");
  v.flag(!tensor_ok(a.topk_idx, DType::kI64, {h.num_tokens, h.num_topk}, dev), "topk_idx");
  v.flag(!tensor_ok(a.topk_weights, DType::kF32, {h.num_tokens, h.num_topk}, dev), "topk_weights");
  if (a.out)
    v.flag(!tensor_ok(*a.out, DType::kBF16, {h.num_tokens, h.hidden}, dev) || !vectors_ok(*a.out),
           "out");
  if (a.combine_wait_recv_cost_stats)
    v.flag(!tensor_ok(*a.combine_wait_recv_cost_stats, DType::kI64, {R}, dev),
           "combine_wait_recv_cost_stats");
  return v;
}

/// Config (epx/config.hpp): num_sms >= 2 and at most the SMs a rank may use;
/// num_send_sms >= 0 (0 = a third, a sixth with pull_dispatch, at least 1)
/// leaving >= 1 receive SM; num_max_send_tokens in [1, 1024];
/// num_max_recv_tokens >= num_max_send_tokens; 1 to 8 ranks.
Verdict config_rules(const Config& c, int R, int device_sms) {
  Verdict v;
  v.flag(c.num_sms < 2 || (device_sms > 0 && c.num_sms > device_sms), "config.num_sms");
  const int send =
      c.num_send_sms > 0 ? c.num_send_sms : std::max(1, c.num_sms / (c.pull_dispatch ? 6 : 3));
  v.flag(c.num_send_sms < 0 || send < 1 || c.num_sms - send < 1, "config.num_send_sms");
  v.flag(c.num_max_send_tokens < 1 || c.num_max_send_tokens > 1024, "config.num_max_send_tokens");
  v.flag(c.num_max_recv_tokens < c.num_max_send_tokens, "config.num_max_recv_tokens");
  v.flag(R < 1 || R > 8, "num_ranks");
  return v;
}

// ---- generators -----------------------------------------------------------------------

void* fake_pointer(Gen& g) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(g.between(1, 1 << 20)) << 8);
}

/// A view meant to satisfy (dtype, shape with kAny, device), each aspect
/// broken with probability `p`: the dtype, the rank, one extent (to a
/// neighbour, 0 or a negative), the device, the strides (padded rows,
/// swapped, zero), the data pointer (null).
TensorView gen_tensor(Gen& g, DType dtype, std::vector<int64_t> shape, int device, double p) {
  for (auto& e : shape)
    if (e == kAny) e = g.chance(0.8) ? g.between(1, 64) : g.pick<int64_t>({0, 256, 4096});
  if (g.chance(p)) {
    if (g.chance(0.5) || shape.empty())
      shape.push_back(g.between(1, 8));
    else
      shape.pop_back();
  }
  if (g.chance(p) && !shape.empty()) {
    auto& e = shape[g.between(0, static_cast<int64_t>(shape.size()) - 1)];
    e = g.pick<int64_t>({e + 1, e - 1, 0, -1, -g.between(2, 100), g.between(0, 300)});
  }
  if (shape.size() > static_cast<size_t>(kMaxDims)) shape.resize(kMaxDims);
  TensorView t;
  t.dtype = g.chance(p) ? g.pick({DType::kBF16, DType::kFP8E4M3, DType::kF32, DType::kI32,
                                  DType::kI64, DType::kBool})
                        : dtype;
  t.device = device == validate::kAnyDevice ? static_cast<int>(g.between(0, 3)) : device;
  if (g.chance(p)) t.device = g.pick<int>({kCpu, t.device + 1, 0, 3});
  t.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    stride *= std::max<int64_t>(shape[d], 1);
  }
  if (g.chance(p) && t.ndim >= 1) {
    const int d = static_cast<int>(g.between(0, t.ndim - 1));
    switch (g.between(0, 3)) {
      case 0:  // padded rows
        t.strides[0] += g.between(1, 9);
        break;
      case 1:  // transposed
        if (t.ndim >= 2) std::swap(t.strides[0], t.strides[t.ndim - 1]);
        break;
      case 2:  // broadcast
        t.strides[d] = 0;
        break;
      default:  // every other element
        t.strides[d] *= 2;
        break;
    }
  }
  t.data = g.chance(p / 2) ? nullptr : fake_pointer(g);
  // a base inside a row or an element: a view such as x[:, 4:] or a flat slice
  if (t.data && g.chance(p))
    t.data = static_cast<char*>(t.data) + g.pick<int64_t>({1, 2, 4, 8, 12});
  return t;
}

/// A high-throughput handle for T tokens, N received rows and R ranks
/// (within one node, or across nodes of `L` ranks when L > 0), its routing
/// tensors views of fake memory; with probability p one of them is missing,
/// of another shape, dtype or device.
std::shared_ptr<DispatchHandle> gen_handle(Gen& g, double p, int R, int64_t T, int64_t N, int dev,
                                           int L = 0) {
  auto h = std::make_shared<DispatchHandle>();
  h->num_ranks = R;
  h->num_tokens = static_cast<int>(T);
  h->num_recv_tokens = static_cast<int>(N);
  h->ranks_per_node = L;
  std::vector<Tensor*> parts;
  const auto make = [&](Tensor& t, DType dt, std::vector<int64_t> shape) {
    t.view = gen_tensor(g, dt, std::move(shape), dev, 0.0);
    parts.push_back(&t);
  };
  make(h->is_token_in_rank, DType::kBool, {T, R});
  make(h->recv_src_idx, DType::kI32, {N});
  if (L <= 0) {
    make(h->send_slot, DType::kI32, {T, R});
    make(h->send_list, DType::kI32, {R, std::max<int64_t>(T, 1)});
    make(h->send_counts, DType::kI32, {R});
    make(h->recv_offsets, DType::kI32, {R + 1});
  } else {
    make(epx::across(*h).net_send_pos, DType::kI32, {T, R / L});
    make(epx::across(*h).net_rank_pos, DType::kI32, {T, R});
    make(epx::across(*h).net_recv_meta, DType::kI32, {N, 3});
    make(h->rank_prefix_matrix, DType::kI32, {R, R});
    make(h->source_num_tokens, DType::kI32, {R});
    make(epx::across(*h).net_table, DType::kI32, {g.between(1, 64)});
    make(epx::across(*h).net_fwd_mask, DType::kI32, {R / L, g.between(1, 64)});
    make(epx::across(*h).net_fwd_token, DType::kI32, {R / L, g.between(1, 64)});
  }
  if (g.chance(p)) {
    Tensor& t =
        *parts[static_cast<std::size_t>(g.between(0, static_cast<int64_t>(parts.size()) - 1))];
    switch (g.between(0, 3)) {
      case 0:
        t = Tensor{};  // missing (a handle rebuilt by hand)
        break;
      case 1:
        t.view.shape[0] += 1;
        break;
      case 2:
        t.view.dtype = t.view.dtype == DType::kI32 ? DType::kI64 : DType::kI32;
        break;
      default:
        t.view.device = dev + 1;
        break;
    }
  }
  return h;
}

int gen_ranks(Gen& g) {
  return g.pick<int>({1, 2, 4, 8});
}
int gen_device(Gen& g) {
  return static_cast<int>(g.between(0, 3));
}
/// A value a rule wants (`good`) most of the time, else a wild one.
int64_t good_or_wild(Gen& g, double p, int64_t good) {
  return g.chance(p) ? g.wild() : good;
}

/// How hard a set is broken: a third of the sets not at all (they must pass),
/// the rest with a per-aspect probability of 2 to 30%.
double gen_badness(Gen& g) {
  return g.chance(1.0 / 3) ? 0.0 : g.pick<double>({0.02, 0.05, 0.1, 0.3});
}

// ---- the harness ----------------------------------------------------------------------

/// Tallies of one op's run.
struct Tally {
  int sets = 0, valid = 0, rejected = 0, failures = 0;
  std::map<std::string, int> named;  // arguments named by the rejections
};

std::string named_argument(const std::string& what, const std::set<std::string>& broken) {
  // "epx: <op>: <argument>: <rule>" or "epx: <argument>: <rule>"
  for (const auto& arg : broken)
    if (what.find(": " + arg + ": ") != std::string::npos) return arg;
  return "";
}

/// Runs `check` on one set and compares with the rules' verdict.
template <class Check>
void judge(Tally& t, const Verdict& v, Check&& check,
           const std::function<std::string()>& describe) {
  ++t.sets;
  std::string problem;
  try {
    check();
    if (v.broken.empty()) {
      ++t.valid;
    } else {
      problem = "accepted, but the rules find broken:";
      for (const auto& b : v.broken) problem += " " + b;
    }
  } catch (const Error& e) {
    const std::string arg = named_argument(e.what(), v.broken);
    if (e.code() != ErrorCode::kInvalidArgument)
      problem = std::string("rejected with code ") + to_string(e.code()) + ": " + e.what();
    else if (v.broken.empty())
      problem = std::string("rejected a valid set: ") + e.what();
    else if (arg.empty())
      problem = std::string("the error names none of the broken arguments: ") + e.what();
    else {
      ++t.rejected;
      ++t.named[arg];
    }
  } catch (const std::exception& e) {
    problem = std::string("threw a non-EPX exception: ") + e.what();
  }
  if (!problem.empty() && ++t.failures <= 5)
    ADD_FAILURE() << problem << "\n  set: " << describe() << "\n  (EPX_FUZZ_SEED=" << seed()
                  << ", set " << t.sets << ")";
}

/// Every rule family must have been hit and both outcomes must be common, or
/// the generator has drifted and the run proves little.
void expect_coverage(const char* op, const Tally& t, const std::vector<std::string>& args) {
  EXPECT_EQ(t.failures, 0) << op;
  EXPECT_GE(t.valid, t.sets / 10) << op << ": too few valid sets";
  EXPECT_GE(t.rejected, t.sets / 10) << op << ": too few rejected sets";
  for (const auto& a : args)
    EXPECT_GT(t.named.count(a) ? t.named.at(a) : 0, 0) << op << ": no set was rejected for " << a;
}

std::string show(const TensorView& t) {
  std::ostringstream os;
  os << t.describe() << " strides [";
  for (int d = 0; d < t.ndim; ++d) os << (d ? ", " : "") << t.strides[d];
  os << "]";
  if (!t.data)
    os << " null";
  else if (const auto off = reinterpret_cast<uintptr_t>(t.data) % 16)
    os << " base+" << off;
  return os.str();
}
std::string show(const std::optional<TensorView>& t) {
  return t ? show(*t) : "None";
}

// ---- the ops ------------------------------------------------------------------------------

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

TEST(ValidateFuzz, LowLatencyDispatch) {
  Gen g(seed() ^ 4);
  Tally t;
  for (int i = 0; i < scaled(kLowLatencyDispatchSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    LowLatencyDispatchArgs a;
    a.num_max_dispatch_tokens_per_rank =
        static_cast<int>(good_or_wild(g, p, g.pick<int64_t>({1, 32, 128, 256, 1024})));
    const int64_t maxT = std::max(a.num_max_dispatch_tokens_per_rank, 1);
    const int64_t T = g.between(0, std::min<int64_t>(maxT, 300));
    const int64_t H = g.chance(p) ? g.wild() : 128 * g.between(1, 128);
    a.num_experts = static_cast<int>(good_or_wild(g, p, R * g.between(1, 1024 / R)));
    a.x = gen_tensor(g, DType::kBF16, {T, H}, dev, p);
    a.topk_idx = gen_tensor(g, DType::kI64, {T, g.between(1, 16)}, dev, p);
    a.use_fp8 = g.chance(0.7);
    a.round_scale = a.use_fp8 ? g.chance(0.5) : g.chance(p);
    a.use_ue8m0 = a.round_scale ? g.chance(0.5) : g.chance(p);
    const int64_t local = a.num_experts > 0 ? a.num_experts / R : 1;
    if (g.chance(0.3))
      a.cumulative_local_expert_recv_stats = gen_tensor(g, DType::kI32, {local}, dev, p);
    if (g.chance(0.3)) a.dispatch_wait_recv_cost_stats = gen_tensor(g, DType::kI64, {R}, dev, p);
    judge(
        t, low_latency_dispatch_rules(a, R, dev),
        [&] { validate::low_latency_dispatch(a, R, dev); },
        [&] {
          return "R=" + std::to_string(R) +
                 " maxT=" + std::to_string(a.num_max_dispatch_tokens_per_rank) +
                 " E=" + std::to_string(a.num_experts) + " x=" + show(a.x) +
                 " topk_idx=" + show(a.topk_idx) + " fp8/round/ue8m0=" + std::to_string(a.use_fp8) +
                 std::to_string(a.round_scale) + std::to_string(a.use_ue8m0) +
                 " stats=" + show(a.cumulative_local_expert_recv_stats) +
                 " wait=" + show(a.dispatch_wait_recv_cost_stats);
        });
  }
  expect_coverage(
      "low_latency_dispatch", t,
      {"num_max_dispatch_tokens_per_rank", "x", "hidden", "num_experts", "topk_idx", "use_fp8",
       "use_ue8m0", "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats"});
}

TEST(ValidateFuzz, LowLatencyCombine) {
  Gen g(seed() ^ 5);
  Tally t;
  for (int i = 0; i < scaled(kLowLatencyCombineSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    auto h = std::make_shared<LowLatencyHandle>();
    h->num_ranks = g.chance(p) ? gen_ranks(g) : R;
    h->num_experts = static_cast<int>(R * g.between(1, 32));
    h->num_max_dispatch_tokens_per_rank = static_cast<int>(g.pick<int64_t>({1, 8, 32, 128}));
    h->hidden = static_cast<int>(128 * g.between(1, 16));
    h->num_tokens = static_cast<int>(g.between(0, h->num_max_dispatch_tokens_per_rank));
    h->num_topk = static_cast<int>(g.between(1, 16));
    LowLatencyCombineArgs a;
    if (!g.chance(p / 3)) a.handle = h;
    const int64_t rows = static_cast<int64_t>(R) * h->num_max_dispatch_tokens_per_rank;
    a.x = gen_tensor(g, DType::kBF16, {h->num_experts / R, rows, h->hidden}, dev, p);
    a.topk_idx = gen_tensor(g, DType::kI64, {h->num_tokens, h->num_topk}, dev, p);
    a.topk_weights = gen_tensor(g, DType::kF32, {h->num_tokens, h->num_topk}, dev, p);
    if (g.chance(0.3)) a.out = gen_tensor(g, DType::kBF16, {h->num_tokens, h->hidden}, dev, p);
    if (g.chance(0.3)) a.combine_wait_recv_cost_stats = gen_tensor(g, DType::kI64, {R}, dev, p);
    judge(
        t, low_latency_combine_rules(a, R, dev), [&] { validate::low_latency_combine(a, R, dev); },
        [&] {
          return "R=" + std::to_string(R) + " x=" + show(a.x) + " topk_idx=" + show(a.topk_idx) +
                 " topk_weights=" + show(a.topk_weights) + " out=" + show(a.out) +
                 " stats=" + show(a.combine_wait_recv_cost_stats) +
                 (a.handle ? " handle R=" + std::to_string(h->num_ranks) : " no handle");
        });
  }
  expect_coverage(
      "low_latency_combine", t,
      {"handle", "x", "topk_idx", "topk_weights", "out", "combine_wait_recv_cost_stats"});
}

TEST(ValidateFuzz, LowLatencySizesAndSizeHint) {
  // clean_low_latency_buffer's and get_low_latency_rdma_size_hint's arguments
  Gen g(seed() ^ 6);
  Tally t;
  for (int i = 0; i < scaled(kSizeHintSets); ++i) {
    const double p = gen_badness(g);
    // Low-latency ops run across nodes: up to epx::kMaxRanks (160) ranks.
    const int R = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, -1, 3, 16, 160, 161, 1000})
                                               : gen_ranks(g));
    const int maxT = static_cast<int>(good_or_wild(g, p, g.pick<int64_t>({1, 64, 128, 1024})));
    const int H = static_cast<int>(good_or_wild(g, p, 128 * g.between(1, 128)));
    const int E = static_cast<int>(good_or_wild(g, p, std::max(R, 1) * g.between(1, 1024 / 8)));
    Verdict v;
    v.flag(R < 1 || R > 160, "num_ranks");
    if (R >= 1) low_latency_size_rules(v, maxT, H, E, R);
    std::size_t bytes = 0;
    judge(
        t, v, [&] { bytes = Buffer::get_low_latency_rdma_size_hint(maxT, H, R, E); },
        [&] {
          return "maxT=" + std::to_string(maxT) + " H=" + std::to_string(H) +
                 " R=" + std::to_string(R) + " E=" + std::to_string(E);
        });
    if (v.broken.empty()) {  // at least its two zero-copy inputs [E/R, R*maxT, H] bf16
      const std::size_t zero_copy = 2ull * (E / R) * R * maxT * H;
      EXPECT_GE(bytes, 2 * zero_copy) << maxT << " " << H << " " << R << " " << E;
    }
  }
  expect_coverage("get_low_latency_rdma_size_hint", t,
                  {"num_ranks", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"});
}

TEST(ValidateFuzz, InternodeSizeHint) {
  // get_internode_nvl_size_hint: the whole-call worst case of the
  // high-throughput ops across nodes (docs/api.md): tokens >= 0; hidden > 0,
  // a multiple of 8 (16-byte BF16 rows); 1 to 160 ranks; 1 to 8 ranks per
  // node, dividing the ranks; top-k 0 to 16.
  Gen g(seed() ^ 11);
  Tally t;
  for (int i = 0; i < scaled(kInternodeHintSets); ++i) {
    const double p = gen_badness(g);
    const int R = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, -1, 3, 6, 160, 161, 1000})
                                               : g.pick<int>({2, 4, 8, 16, 32, 64}));
    const int L = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, -1, 3, 5, 9, 16})
                                               : g.pick<int>({1, 2, 4, 8}));
    const int T = static_cast<int>(good_or_wild(g, p, g.between(0, 4096)));
    const int H = static_cast<int>(good_or_wild(g, p, 8 * g.between(1, 1024)));
    const int K = static_cast<int>(good_or_wild(g, p, g.between(0, 16)));
    Verdict v;
    v.flag(T < 0, "num_max_tokens");
    v.flag(H <= 0 || H % 8 != 0, "hidden");
    v.flag(R < 1 || R > 160, "num_ranks");
    v.flag(R >= 1 && R <= 160 && (L < 1 || L > 8 || R % L != 0), "ranks_per_node");
    v.flag(K < 0 || K > 16, "num_topk");
    std::size_t bytes = 0;
    judge(
        t, v, [&] { bytes = Buffer::get_internode_nvl_size_hint(T, H, R, L, K); },
        [&] {
          return "T=" + std::to_string(T) + " H=" + std::to_string(H) + " R=" + std::to_string(R) +
                 " L=" + std::to_string(L) + " K=" + std::to_string(K);
        });
    if (v.broken.empty() && R / L > 1) {
      // At least the other nodes' rows of one token-sized record each, and
      // growing with the tokens.
      EXPECT_GE(bytes, static_cast<std::size_t>(T) * 2u * H)
          << T << " " << H << " " << R << " " << L;
      EXPECT_GE(Buffer::get_internode_nvl_size_hint(T + 1, H, R, L, K), bytes);
    }
  }
  expect_coverage("get_internode_nvl_size_hint", t,
                  {"num_max_tokens", "hidden", "num_ranks", "ranks_per_node", "num_topk"});
}

TEST(ValidateFuzz, ShrinkMaskArguments) {
  // low_latency_update_mask_buffer's rank and low_latency_query_mask_buffer's tensor
  Gen g(seed() ^ 7);
  Tally t;
  for (int i = 0; i < scaled(kMaskSets); ++i) {
    const double p = gen_badness(g);
    const int R = gen_ranks(g), dev = gen_device(g);
    const int rank = static_cast<int>(good_or_wild(g, p, g.between(0, R - 1)));
    const TensorView status = gen_tensor(g, DType::kI32, {R}, dev, p);
    Verdict v;
    v.flag(rank < 0 || rank >= R, "rank_to_mask");
    v.flag(!tensor_ok(status, DType::kI32, {R}, dev), "mask_status");
    judge(
        t, v,
        [&] {
          validate::rank_in_group("low_latency_update_mask_buffer", "rank_to_mask", rank, R);
          validate::tensor("low_latency_query_mask_buffer", "mask_status", status, DType::kI32, {R},
                           dev);
        },
        [&] {
          return "R=" + std::to_string(R) + " rank=" + std::to_string(rank) + " " + show(status);
        });
  }
  expect_coverage("shrink masks", t, {"rank_to_mask", "mask_status"});
}

TEST(ValidateFuzz, HostTopkValues) {
  // topk_idx values, checked on the host for host tensors: -1 or an expert id
  Gen g(seed() ^ 8);
  Tally t;
  for (int i = 0; i < scaled(kHostTopkSets); ++i) {
    const double p = gen_badness(g);
    const int E = static_cast<int>(g.between(1, 512));
    std::vector<int64_t> ids(static_cast<size_t>(g.between(0, 64)));
    for (auto& id : ids)
      id = g.chance(p) ? g.pick<int64_t>({-2, -100, E, E + 1, g.between(-600, 600)})
                       : g.between(-1, E - 1);
    const TensorView v8 =
        TensorView::contiguous(ids.data(), DType::kI64, {static_cast<int64_t>(ids.size())}, kCpu);
    Verdict v;
    for (int64_t id : ids) v.flag(id != -1 && (id < 0 || id >= E), "topk_idx");
    judge(
        t, v, [&] { validate::topk_idx_values("get_dispatch_layout", v8, E); },
        [&] { return "E=" + std::to_string(E) + " n=" + std::to_string(ids.size()); });
  }
  expect_coverage("topk_idx values", t, {"topk_idx"});
}

TEST(ValidateFuzz, Config) {
  Gen g(seed() ^ 9);
  Tally t;
  for (int i = 0; i < scaled(kConfigSets); ++i) {
    const double p = gen_badness(g);
    Config c;
    c.num_sms = static_cast<int>(good_or_wild(g, p, 2 * g.between(1, 33)));
    c.num_send_sms = static_cast<int>(g.chance(p) ? g.wild() : g.pick<int64_t>({0, 0, 1, 4}));
    c.num_max_send_tokens = static_cast<int>(good_or_wild(g, p, g.between(1, 64)));
    c.num_max_recv_tokens =
        static_cast<int>(good_or_wild(g, p, c.num_max_send_tokens * g.between(1, 64)));
    c.pull_dispatch = g.chance(0.3);
    const int R = static_cast<int>(g.chance(p) ? g.pick<int64_t>({0, -1, 9, 16}) : gen_ranks(g));
    const int sms = static_cast<int>(g.pick<int64_t>({0, 132, 66, 33, 16}));
    judge(
        t, config_rules(c, R, sms), [&] { c.validate(R, sms); },
        [&] {
          return "num_sms=" + std::to_string(c.num_sms) +
                 " send_sms=" + std::to_string(c.num_send_sms) +
                 " send_tokens=" + std::to_string(c.num_max_send_tokens) +
                 " recv_tokens=" + std::to_string(c.num_max_recv_tokens) +
                 " pull=" + std::to_string(c.pull_dispatch) + " R=" + std::to_string(R) +
                 " device_sms=" + std::to_string(sms);
        });
  }
  expect_coverage("Config::validate", t,
                  {"config.num_sms", "config.num_send_sms", "config.num_max_send_tokens",
                   "config.num_max_recv_tokens", "num_ranks"});
}

TEST(ValidateFuzz, SetNumSms) {
  const int saved = Buffer::num_sms();
  Gen g(seed() ^ 10);
  Tally t;
  for (int i = 0; i < scaled(kNumSmsSets); ++i) {
    const int n = static_cast<int>(good_or_wild(g, 0.5, 2 * g.between(1, 66)));
    Verdict v;
    v.flag(n < 2 || n % 2 != 0, "num_sms");  // an even number of SMs, at least 2
    judge(
        t, v, [&] { Buffer::set_num_sms(n); }, [&] { return "n=" + std::to_string(n); });
    if (v.broken.empty()) EXPECT_EQ(Buffer::num_sms(), n);
  }
  Buffer::set_num_sms(saved);
  expect_coverage("set_num_sms", t, {"num_sms"});
}

}  // namespace
}  // namespace epx
