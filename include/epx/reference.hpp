// epx/reference.hpp - CPU reference model of every EPX operation.
//
// Simulates R ranks in one process on host vectors (row-major). BF16 values
// are raw bit patterns (uint16_t), FP8 e4m3 raw bytes (uint8_t). The GPU tests
// compare every kernel with these functions; users can do the same.
#pragma once

#include <cstdint>
#include <vector>

namespace epx::ref {

// ---- scalar conversions ------------------------------------------------------
float bf16_to_float(uint16_t v);
uint16_t float_to_bf16(float v);  ///< round to nearest even; NaN stays NaN
float fp8_e4m3_to_float(uint8_t v);
uint8_t float_to_fp8_e4m3(float v);  ///< round to nearest even, saturate to +-448

/// Per-128-channel FP8 quantization of one row of `hidden` floats, as DeepEP
/// does: amax over each group (clamped below at 1e-4), scale = amax / 448
/// (round_scale: the next power of two >= that), q = fp8(x / scale).
/// Writes hidden bytes to `q` and hidden/128 scales to `scales`.
void quantize_row_fp8(const float* x, int hidden, bool round_scale, uint8_t* q, float* scales);
/// UE8M0: the exponent byte of a power-of-two scale (scale = 2^(e - 127)).
uint8_t scale_to_ue8m0(float scale);
float ue8m0_to_scale(uint8_t e);

/// LogFMT (low_latency_combine's use_logfmt): a lossy 10-bit-per-value code
/// for BF16 rows in groups of 128; see docs/reference.md. encode -> decode must stay
/// within the bound logfmt_max_rel_error() of each value's magnitude, except
/// values below the group's representable floor, which may decode to zero.
/// Float arithmetic shared with the kernels (same bits). Non-finite input and
/// (decode) a group header no encoder writes throw std::invalid_argument.
std::vector<uint8_t> logfmt_encode(const std::vector<float>& row);  ///< hidden % 128 == 0
std::vector<float> logfmt_decode(const std::vector<uint8_t>& code, int hidden);
std::size_t logfmt_bytes(int hidden);
double logfmt_max_rel_error();

// ---- seeded test data (tests and benchmarks draw from the same generators) ----
/// [T, K] routing: K distinct experts per token, uniform over [0, E); each slot
/// is -1 with probability `masked`. Deterministic in `seed`.
std::vector<int64_t> random_topk(int num_tokens, int num_topk, int num_experts, double masked,
                                 uint64_t seed);
/// n BF16 values drawn from N(0, scale^2). Deterministic in `seed`.
std::vector<uint16_t> random_bf16(std::size_t n, uint64_t seed, float scale = 1.0f);

// ---- routing -----------------------------------------------------------------
struct Layout {
  std::vector<int> num_tokens_per_rank;    ///< [R]
  std::vector<int> num_tokens_per_expert;  ///< [E]
  std::vector<uint8_t> is_token_in_rank;   ///< [T, R], 0/1
  /// [R / ranks_per_node] when ranks_per_node > 0: tokens with any expert on
  /// a rank of node n (ranks [n * rpn, (n + 1) * rpn)), each counted once.
  std::vector<int> num_tokens_per_node;
};
/// topk_idx is [T, K]; -1 marks an unused slot; experts are spread evenly,
/// expert e lives on rank e / (E / R).
Layout get_dispatch_layout(const std::vector<int64_t>& topk_idx, int num_tokens, int num_topk,
                           int num_experts, int num_ranks, int ranks_per_node = 0);

// ---- high-throughput ---------------------------------------------------------
struct HtInput {  ///< one rank's dispatch input
  int num_tokens = 0;
  bool fp8 = false;
  std::vector<uint16_t> x_bf16;     ///< [T, H] when !fp8
  std::vector<uint8_t> x_fp8;       ///< [T, H] when fp8
  std::vector<float> x_scales;      ///< [T, H/128] when fp8
  std::vector<int64_t> topk_idx;    ///< [T, K]
  std::vector<float> topk_weights;  ///< [T, K] or empty
};

struct HtDispatchOutput {  ///< one rank's dispatch output
  int num_recv_tokens = 0;
  std::vector<uint16_t> recv_x_bf16;
  std::vector<uint8_t> recv_x_fp8;
  std::vector<float> recv_x_scales;
  std::vector<int64_t> recv_topk_idx;    ///< [N, K] local expert ids, -1 elsewhere
  std::vector<float> recv_topk_weights;  ///< [N, K] the weights, 0 where the expert is elsewhere
                                         ///< (empty if none given)
  std::vector<int> num_recv_tokens_per_expert;  ///< [E_local], each rounded up to alignment
  std::vector<int> recv_src_rank;               ///< [N]
  std::vector<int> recv_src_idx;                ///< [N]
  /// [R, R]: [i][j] = tokens that ranks 0..i send to rank j (DeepEP's
  /// rank_prefix_matrix; the same on every rank).
  std::vector<int> rank_prefix_matrix;
  std::vector<int> source_num_tokens;  ///< [R]: each rank's num_tokens
};

/// Received rows are grouped by source rank in rank order, and within a source
/// in token order. A token goes to a rank once, however many of its experts
/// live there.
std::vector<HtDispatchOutput> ht_dispatch(const std::vector<HtInput>& inputs, int hidden,
                                          int num_topk, int num_experts, int expert_alignment);

struct HtCombineInput {     ///< one rank's combine input (rows in its dispatch receive order)
  std::vector<uint16_t> x;  ///< [N, H] bf16
  std::vector<float> topk_weights;       ///< [N, K] or empty
  std::vector<uint16_t> bias_0, bias_1;  ///< [T, H] of the receiving (original) rank, or empty
};
struct HtCombineOutput {
  std::vector<uint16_t> combined_x;  ///< [T, H] bf16: sum over ranks the token went to (+bias)
  std::vector<float> combined_topk_weights;  ///< [T, K] sum of the weights rows, or empty
};
/// `routing` is the dispatch input of every rank (only num_tokens and
/// topk_idx are read). Sums in float32 then rounds to BF16 once.
///
/// ranks_per_node L (0, or L == R: one node, as above) groups the sum the
/// way the combine across nodes does it (docs/internode_ht.md): per token,
/// each node's rows are summed in float32 in ascending rank order and rounded
/// to BF16 (the one row per node that crosses the network); the token's rank
/// adds the nodes' rows in ascending node order in float32, then the biases,
/// and rounds to BF16. Weights are summed the same way with no rounding.
/// L must divide R.
std::vector<HtCombineOutput> ht_combine(const std::vector<HtInput>& routing,
                                        const std::vector<HtCombineInput>& inputs, int hidden,
                                        int num_topk, int num_experts, int ranks_per_node = 0);

// ---- low-latency -------------------------------------------------------------
struct LlDispatchOutput {  ///< one rank's low-latency dispatch output
  /// [E_local, R*maxT, H]: rows of expert e packed from row 0, by source rank
  /// in rank order, within a source in token order. Rows past recv_count are
  /// unspecified (left as zero here).
  std::vector<uint16_t> recv_x_bf16;
  std::vector<uint8_t> recv_x_fp8;
  std::vector<float> recv_x_scales;   ///< [E_local, R*maxT, H/128] row-major here (logical)
  std::vector<int> recv_count;        ///< [E_local]
  std::vector<int> src_info;          ///< [E_local, R*maxT] source token index, -1 past count
  std::vector<int> recv_src_rank;     ///< [E_local, R*maxT] source rank, -1 past count
  std::vector<int64_t> layout_range;  ///< [E_local, R]: (begin << 32) | count
};
/// x per rank is [T_r, H] bf16 (T_r <= max_tokens); topk_idx per rank [T_r, K].
std::vector<LlDispatchOutput> ll_dispatch(const std::vector<std::vector<uint16_t>>& x,
                                          const std::vector<std::vector<int64_t>>& topk_idx,
                                          const std::vector<int>& num_tokens, int hidden,
                                          int num_topk, int num_experts, int max_tokens,
                                          bool use_fp8, bool round_scale);

/// expert_out per rank is [E_local, R*maxT, H] bf16 in the packed order of
/// ll_dispatch. Returns per rank [T_r, H] bf16: sum over k of
/// topk_weights[t][k] * expert_out(row of (t, k)), float32 accumulate.
/// use_logfmt passes each expert row through logfmt encode/decode first
/// (the decoded floats are used as they are).
std::vector<std::vector<uint16_t>> ll_combine(const std::vector<std::vector<uint16_t>>& expert_out,
                                              const std::vector<std::vector<int64_t>>& topk_idx,
                                              const std::vector<std::vector<float>>& topk_weights,
                                              const std::vector<int>& num_tokens, int hidden,
                                              int num_topk, int num_experts, int max_tokens,
                                              bool use_logfmt);

}  // namespace epx::ref
