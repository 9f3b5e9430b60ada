// tests/unit/validate_fuzz_util.hpp - the fuzz of argument validation: its generator, the
// rules each set is judged by (restated from docs/api.md and the comments of
// core/validate.hpp and epx/config.hpp, not from validate.cpp), the tally and the set
// counts. test_validate_fuzz.cpp (the high-throughput ops) and
// test_validate_fuzz_ll.cpp (low-latency ops, size hints, masks, Config) use it.
#pragma once

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

namespace epx::vfuzz {

inline constexpr int64_t kAny = validate::kAny;

// Argument sets per op and run: more than 10,000 in all.
inline constexpr int kLayoutSets = 1500, kDispatchSets = 4000, kCombineSets = 2500,
                     kLowLatencyDispatchSets = 3000, kLowLatencyCombineSets = 2500,
                     kSizeHintSets = 1500, kMaskSets = 1000, kHostTopkSets = 1000,
                     kConfigSets = 1500, kNumSmsSets = 500, kInternodeHintSets = 1500;
static_assert(kLayoutSets + kDispatchSets + kCombineSets + kLowLatencyDispatchSets +
                      kLowLatencyCombineSets + kSizeHintSets + kMaskSets + kHostTopkSets +
                      kConfigSets + kNumSmsSets + kInternodeHintSets >=
                  10000,
              "the fuzz must feed at least 10,000 argument sets per run");

inline uint64_t seed() {
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

inline int scaled(int n) {
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
inline bool dense(const TensorView& t) {
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
inline bool tensor_ok(const TensorView& t, DType dtype, const std::vector<int64_t>& shape,
                      int device, bool contiguous = true) {
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
inline bool vectors_ok(const TensorView& t) {
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
inline bool routing_ok(const DispatchHandle& h, int dev) {
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

inline bool topk_ok(int64_t k) {
  return k >= 1 && k <= 16;
}
inline bool experts_ok(int64_t e, int num_ranks) {
  return e > 0 && e % num_ranks == 0;
}
/// Hidden size of rows of `dtype`: > 0, rows a multiple of 16 bytes, FP8 a
/// multiple of 128 where `fp8` (the low-latency ops).
inline bool hidden_ok(int64_t h, DType dtype, bool fp8) {
  return h > 0 && (h * static_cast<int64_t>(element_size(dtype))) % 16 == 0 &&
         (!fp8 || h % 128 == 0);
}

inline void low_latency_size_rules(Verdict& v, int64_t max_tokens, int64_t hidden, int64_t experts,
                                   int num_ranks) {
  v.flag(max_tokens < 1 || max_tokens > 1024, "num_max_dispatch_tokens_per_rank");
  v.flag(hidden <= 0 || hidden % 128 != 0 || hidden > 16384, "hidden");
  v.flag(!experts_ok(experts, num_ranks) || experts > 1024, "num_experts");
  // the receive lists every (rank, token) of an expert: 24 Ki entries at most
  v.flag(max_tokens >= 1 && static_cast<int64_t>(num_ranks) * max_tokens > 24 * 1024,
         "num_max_dispatch_tokens_per_rank");
}

inline Verdict dispatch_layout_rules(const TensorView& topk_idx, int experts, int R, int dev) {
  Verdict v;
  v.flag(!experts_ok(experts, R) || experts > 8192, "num_experts");
  v.flag(!tensor_ok(topk_idx, DType::kI64, {kAny, kAny}, dev), "topk_idx");
  v.flag(topk_idx.ndim == 2 && !topk_ok(topk_idx.shape[1]), "topk_idx");
  return v;
}

inline Verdict dispatch_rules(const DispatchArgs& a, int R, int dev) {
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

inline Verdict combine_rules(const CombineArgs& a, int R, int dev) {
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

inline Verdict low_latency_dispatch_rules(const LowLatencyDispatchArgs& a, int R, int dev) {
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

inline Verdict low_latency_combine_rules(const LowLatencyCombineArgs& a, int R, int dev) {
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
inline Verdict config_rules(const Config& c, int R, int device_sms) {
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

inline void* fake_pointer(Gen& g) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(g.between(1, 1 << 20)) << 8);
}

/// A view meant to satisfy (dtype, shape with kAny, device), each aspect
/// broken with probability `p`: the dtype, the rank, one extent (to a
/// neighbour, 0 or a negative), the device, the strides (padded rows,
/// swapped, zero), the data pointer (null).
inline TensorView gen_tensor(Gen& g, DType dtype, std::vector<int64_t> shape, int device,
                             double p) {
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
inline std::shared_ptr<DispatchHandle> gen_handle(Gen& g, double p, int R, int64_t T, int64_t N,
                                                  int dev, int L = 0) {
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

inline int gen_ranks(Gen& g) {
  return g.pick<int>({1, 2, 4, 8});
}
inline int gen_device(Gen& g) {
  return static_cast<int>(g.between(0, 3));
}
/// A value a rule wants (`good`) most of the time, else a wild one.
inline int64_t good_or_wild(Gen& g, double p, int64_t good) {
  return g.chance(p) ? g.wild() : good;
}

/// How hard a set is broken: a third of the sets not at all (they must pass),
/// the rest with a per-aspect probability of 2 to 30%.
inline double gen_badness(Gen& g) {
  return g.chance(1.0 / 3) ? 0.0 : g.pick<double>({0.02, 0.05, 0.1, 0.3});
}

// ---- the harness ----------------------------------------------------------------------

/// Tallies of one op's run.
struct Tally {
  int sets = 0, valid = 0, rejected = 0, failures = 0;
  std::map<std::string, int> named;  // arguments named by the rejections
};

inline std::string named_argument(const std::string& what, const std::set<std::string>& broken) {
  // "epx: <op>: <argument>: <rule>" or "epx: <argument>: <rule>"
  for (const auto& arg : broken)
    if (what.find(": " + arg + ": ") != std::string::npos) return arg;
  return "";
}

/// Runs `check` on one set and compares with the rules' verdict.
template <class Check>
inline void judge(Tally& t, const Verdict& v, Check&& check,
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
inline void expect_coverage(const char* op, const Tally& t, const std::vector<std::string>& args) {
  EXPECT_EQ(t.failures, 0) << op;
  EXPECT_GE(t.valid, t.sets / 10) << op << ": too few valid sets";
  EXPECT_GE(t.rejected, t.sets / 10) << op << ": too few rejected sets";
  for (const auto& a : args)
    EXPECT_GT(t.named.count(a) ? t.named.at(a) : 0, 0) << op << ": no set was rejected for " << a;
}

inline std::string show(const TensorView& t) {
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
inline std::string show(const std::optional<TensorView>& t) {
  return t ? show(*t) : "None";
}

// ---- the ops ------------------------------------------------------------------------------

}  // namespace epx::vfuzz
