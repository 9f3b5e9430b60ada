// core/validate.hpp - argument rules shared by the C++ API and the Python
// binding. Every check throws epx::Error(kInvalidArgument) whose message reads
// "<op>: <argument>: <rule> (got <what>)", before any kernel runs.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "common/plan.hpp"
#include "epx/buffer.hpp"

namespace epx::validate {

inline constexpr int64_t kAny = -1;    ///< wildcard in an expected shape
inline constexpr int kAnyDevice = -2;  ///< wildcard device: any CUDA device (not host)

/// dtype, rank (ndim), shape (kAny = any extent), device (kAnyDevice = any
/// CUDA device; kCpu = host), a data pointer aligned to the element size, and
/// row-major contiguity.
void tensor(const char* op, const char* name, const TensorView& t, DType dtype,
            std::initializer_list<int64_t> shape, int device, bool contiguous = true);

/// What the kernels move 16 bytes at a time (rows of x, biases, outputs):
/// the data pointer a multiple of kVectorAlign and every stride but the last
/// a multiple of kVectorAlign bytes. A view that starts inside a row of a
/// wider tensor (x[:, 4:]) breaks it; so does a flat slice at an odd offset.
inline constexpr uint64_t kVectorAlign = 16;
void vector_aligned(const char* op, const char* name, const TensorView& t);

/// BufferOptions::ht_rings (and get_internode_nvl_size_hint's): -1, 0, 1 or
/// ring records in [2, 2^20], the rule of EPX_HT_RINGS; the error names
/// "ht_rings".
void ht_rings(int value);

/// num_experts > 0 and divisible by num_ranks.
void num_experts(const char* op, int num_experts, int num_ranks);
/// hidden > 0; row bytes a multiple of 16; FP8 (or use_fp8) needs hidden % 128 == 0.
void hidden(const char* op, int64_t hidden, DType dtype, bool fp8_path);
/// A rank of the group: value in [0, num_ranks).
void rank_in_group(const char* op, const char* name, int value, int num_ranks);
/// num_topk in [1, kMaxTopK]; `name` is the argument whose extent it is.
void num_topk(const char* op, int64_t num_topk, const char* name = "topk_idx");
/// Host-side topk_idx values: each -1 or in [0, num_experts). Only for host
/// (kCpu) tensors; device values are checked by the layout kernel.
void topk_idx_values(const char* op, const TensorView& topk_idx, int num_experts);

inline constexpr int kMaxTopK = 16;
inline constexpr int kMaxRanks = epx::kMaxRanks;  ///< in all (8 per node: kMaxRanksPerNode)
inline constexpr int kMaxLowLatencyTokens = plan::kLlMaxTokens;  ///< per rank, per call
inline constexpr int kMaxLayoutExperts = 8192;                   ///< get_dispatch_layout's kernel
/// The low-latency dispatch's receive lists every (source rank, token) of a
/// local expert in shared memory: num_ranks * num_max_dispatch_tokens_per_rank
/// entries at most.
inline constexpr int64_t kMaxLowLatencyRecvList = 24 * 1024;

/// Low-latency sizes (ops, clean_low_latency_buffer, the size hint):
/// num_max_dispatch_tokens_per_rank in [1, kMaxLowLatencyTokens]; hidden > 0,
/// a multiple of 128 and at most plan::kLlMaxHidden; num_experts > 0, divisible
/// by num_ranks and at most plan::kLlMaxExperts; num_ranks times
/// num_max_dispatch_tokens_per_rank at most kMaxLowLatencyRecvList.
void low_latency_sizes(const char* op, int64_t num_max_dispatch_tokens_per_rank, int64_t hidden,
                       int64_t num_experts, int num_ranks);

/// A high-throughput handle holds every routing tensor its combine and
/// cached dispatches read, made for its sizes on `device` (is_token_in_rank
/// and recv_src_idx; within one node send_slot, send_list, send_counts,
/// recv_offsets; across nodes the net_* route tensors, rank_prefix_matrix and
/// source_num_tokens). A handle without them
/// (one rebuilt by hand) is refused, naming the first one missing.
void handle_routing(const char* op, const DispatchHandle& h, int device);

/// Whole-call checks. Return nothing; throw on the first broken rule.
void dispatch_layout(const TensorView& topk_idx, int num_experts, int num_ranks, int device);
void dispatch(const DispatchArgs& a, int num_ranks, int device);
void combine(const CombineArgs& a, int num_ranks, int device);
void low_latency_dispatch(const LowLatencyDispatchArgs& a, int num_ranks, int device);
void low_latency_combine(const LowLatencyCombineArgs& a, int num_ranks, int device);

}  // namespace epx::validate
