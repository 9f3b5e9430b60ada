// kernels/kernels.hpp - launch entry points of the CUDA kernels. Parameters
// travel by value in one struct per kernel; kernels see only the transport.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/diag.hpp"
#include "common/internode_rings.hpp"
#include "common/plan.hpp"
#include "epx/error.hpp"
#include "transport/any.hpp"

namespace epx::kernels {

// ---- layout -------------------------------------------------------------------
struct LayoutParams {
  const int64_t* topk_idx;  ///< [T, K], K <= kLayoutMaxTopK
  int num_tokens, num_topk, num_experts, num_ranks, rank;
  int ranks_per_node;          ///< node (NVLink domain) size: ranks [n * it, (n + 1) * it)
  int* num_tokens_per_rank;    ///< [R] (zeroed by the launcher)
  int* num_tokens_per_expert;  ///< [E] (zeroed by the launcher)
  int* num_tokens_per_node;    ///< nullable: [R / ranks_per_node] (zeroed by the launcher)
  bool* is_token_in_rank;      ///< [T, R]
  DeviceDiag* diag;
};
/// Top-k entries a layout thread keeps (validate::num_topk's bound).
inline constexpr int kLayoutMaxTopK = 16;
void launch_layout(const LayoutParams& p, cudaStream_t stream);

// ---- high-throughput ----------------------------------------------------------
/// Where things live inside the high-throughput symmetric region.
struct HtOffsets {
  std::size_t barrier, counts[2], flags, credits, consumed, config, exports, staging, row_bytes;
  /// Fingerprint of what both ends of a pair must agree on (ring rows, chunk,
  /// send SMs, row layout): a sender refuses a peer whose fingerprint differs.
  uint32_t config_fp;
  int capacity;  ///< ring rows per (source, receiver) pair (plan::HtRegion)
  int chunk, max_chunks, count_row_ints;
};

#if defined(__CUDACC__)
/// Stores this rank's config fingerprint for the op of `epoch` into rank `r`;
/// the caller's barrier flag to `r`, release-stored after it, publishes it
/// (the main kernels' op_begin and the notify kernel).
template <class T>
__device__ __forceinline__ void publish_config(const T& t, const HtOffsets& off, int r,
                                               uint32_t epoch) {
  t.lsa_tagged(r, off.config + 8 * static_cast<std::size_t>(t.rank), off.config_fp, epoch);
}

/// Reports peer `r`'s differing config fingerprint (cold: out of line, so that
/// it takes no registers from the main kernels).
static __device__ __noinline__ void report_bad_config(DeviceDiag* diag, OpId op, int rank, int r,
                                                      uint32_t mine, uint32_t theirs) {
  dev::report(diag, DiagCode::kBadConfig, op, rank, r, -1, mine, theirs);
}

/// After peer `r`'s barrier flag for `epoch` was seen: whether its config
/// fingerprint for this op equals this rank's (reports kBadConfig when not).
template <class T>
__device__ __forceinline__ bool config_matches(const T& t, const HtOffsets& off, uint32_t epoch,
                                               OpId op, int r, DeviceDiag* diag) {
  const uint64_t w = dev::ld_relaxed_sys_u64(
      reinterpret_cast<const uint64_t*>(t.local_ptr(off.config + 8 * static_cast<std::size_t>(r))));
  // A different epoch: the peer has finished this op already (it needed nothing from us).
  if (static_cast<uint32_t>(w >> 32) != epoch || static_cast<uint32_t>(w) == off.config_fp)
    return true;
  report_bad_config(diag, op, t.rank, r, off.config_fp, static_cast<uint32_t>(w));
  return false;
}
#endif  // __CUDACC__

/// A dispatch without a handle: barrier over all ranks, count exchange, and
/// the send plan. (The cached dispatch and the combine are their own barrier.)
struct HtNotifyArgs {
  HtOffsets off;
  uint32_t* op_counter;   ///< local: ops started so far (epoch source)
  uint32_t* done_blocks;  ///< host_counts: blocks finished (the last one resets it)
  // exchange inputs
  const int* num_tokens_per_rank;    ///< [R]
  const int* num_tokens_per_expert;  ///< [E]
  const bool* is_token_in_rank;      ///< [T, R]
  int num_tokens, num_experts, expert_alignment;
  // exchange outputs
  int* send_slot;     ///< [T, R]
  int* send_list;     ///< [R, T]
  int* send_counts;   ///< [R]
  int* recv_offsets;  ///< [R + 1]
  /// Nullable: [R, R], [i][j] = tokens that ranks 0..i send to rank j
  /// (DeepEP's rank_prefix_matrix: column `me` ends each source's rows).
  int* rank_prefix_matrix;
  int* source_num_tokens;  ///< nullable: [R], each source's number of tokens
  int* host_counts;        ///< mapped, nullable: [0] = host_seq once every block is done (so a
                           ///< layout mismatch is reported before), [1] N, [2..2+R) per source,
                           ///< then E_local
  int host_seq;            ///< what [0] gets; the host waits for exactly this value (its dispatch)
  uint64_t timeout_ns;
  DeviceDiag* diag;
  OpId op;
};
template <class T>
struct HtNotifyParams : HtNotifyArgs {
  T t;
};
void launch_ht_notify(const dev::AnyTransport& t, const HtNotifyArgs& a, cudaStream_t stream);

/// What a high-throughput dispatch reads of the caller's tokens (within a
/// node and across nodes alike); core/dispatch_rows.hpp fills it.
struct DispatchRowArgs {
  const uint8_t* x;  ///< rows of hidden_bytes
  int64_t x_row_bytes;
  const float* x_scales;  ///< nullable
  int64_t scale_stride_token, scale_stride_channel;
  const int64_t* topk_idx;    ///< [T, K] nullable
  const float* topk_weights;  ///< [T, K] nullable
};

/// How a high-throughput main kernel gets its epoch (`op_counter`,
/// `done_blocks`, `own_barrier` in both params structs). After a notify
/// kernel (own_barrier false) the counter already holds it. Without one
/// (cached dispatch, combine) the kernel is its own barrier: it takes
/// plan::next_epoch(counter), block 0 tells every rank that this rank has reached the op,
/// each sender warp waits until every peer has before its first store into
/// the peer's staging, and the last block to finish stores the counter.
struct HtDispatchArgs : DispatchRowArgs {
  HtOffsets off;
  uint32_t* op_counter;
  uint32_t* done_blocks;  ///< own_barrier: blocks finished (the last one resets it)
  bool own_barrier;
  int num_tokens, hidden_bytes, num_scales, num_topk, num_experts;
  const int* send_list;     ///< [R, T]
  const int* send_slot;     ///< [T, R]: place of token t in send_list[r], -1 if not sent
  const int* send_counts;   ///< [R]
  const int* recv_offsets;  ///< [R + 1]
  /// Config::pull_dispatch: receivers read the rows from the sender's export
  /// ring (plan::HtRegion); the send blocks fill it.
  bool pull;
  uint8_t* recv_x;           ///< [N, hidden_bytes]
  float* recv_scales;        ///< [N, num_scales]
  int64_t* recv_topk_idx;    ///< [N, K]
  float* recv_topk_weights;  ///< [N, K]
  int* recv_src_idx;         ///< [N]
  int max_recv_rows;         ///< rows allocated for recv_* (num_worst_tokens or N)
  int num_send_blocks;
  uint64_t timeout_ns;
  DeviceDiag* diag;
};
template <class T>
struct HtDispatchParams : HtDispatchArgs {
  T t;
};
void launch_ht_dispatch(const dev::AnyTransport& t, const HtDispatchArgs& a, int num_blocks,
                        cudaStream_t stream);

struct HtCombineArgs {
  HtOffsets off;
  uint32_t* op_counter;
  uint32_t* done_blocks;
  bool own_barrier;
  const uint16_t* x;  ///< [N, H] bf16
  /// Rows of x (N). Rows the routing names past it (a dispatch that
  /// num_worst_tokens truncated, an error already reported) count as zero.
  int num_x_rows;
  const float* topk_weights;  ///< [N, K] nullable
  const uint16_t* bias0;      ///< [T, H] nullable
  const uint16_t* bias1;      ///< [T, H] nullable
  int num_tokens, hidden, num_topk;
  const bool* is_token_in_rank;  ///< [T, R]
  const int* send_slot;          ///< [T, R]
  const int* send_counts;        ///< [R]: my tokens sent to each rank
  const int* recv_offsets;       ///< [R + 1]
  uint16_t* combined_x;          ///< [T, H]
  float* combined_topk_weights;  ///< [T, K] nullable
  int num_send_blocks;
  uint64_t timeout_ns;
  DeviceDiag* diag;
};
template <class T>
struct HtCombineParams : HtCombineArgs {
  T t;
};
void launch_ht_combine(const dev::AnyTransport& t, const HtCombineArgs& a, int num_blocks,
                       cudaStream_t stream);

}  // namespace epx::kernels

// ============================================================================
// High-throughput across nodes (issue 25): src/kernels/internode.cu. The
// first version of docs/internode_ht.md: whole-call areas (plan::HtNetRegion),
// offsets from plan::InternodeRoute on the host, a barrier kernel before each
// op (every rank has finished the previous op, so its areas may be rewritten).
// ============================================================================
namespace epx::kernels {

/// Where an internode op's areas lie (plan::HtNetRegion) and its shapes.
struct HtNetOffsets {
  std::size_t counts, done;  ///< local: u64 op counts, u32 finished-block counters
  std::size_t shapes;        ///< plan::HtNetRegion::shapes
  std::size_t recv, send, stage;
  std::size_t row_bytes, slot_bytes;
  int slot_rows, num_nodes, ranks_per_node;
  int stage_rows;          ///< dispatch: rows of a rank's stage (rows past it are dropped)
  std::size_t count_rows;  ///< num_worst_tokens dispatch: the count exchange's rows
  int count_ints;          ///< ints per count row
};

/// The route table a dispatch uploads (int32, kept in the handle), in this order.
struct HtNetTable {
  int fwd_rows;    ///< [N]: rows this rank forwards for node m's source (its own: m = its node)
  int stage_base;  ///< [L][N]: where those rows start in local rank d's stage (recv_offset)
  int node_rows;   ///< [N]: this rank's rows for each node
  int recv_rows;   ///< [1]: the rows this rank receives
  int ints;        ///< the table's size
  static constexpr HtNetTable make(int num_nodes, int ranks_per_node) {
    HtNetTable t{};
    t.fwd_rows = 0;
    t.stage_base = num_nodes;
    t.node_rows = t.stage_base + ranks_per_node * num_nodes;
    t.recv_rows = t.node_rows + num_nodes;
    t.ints = t.recv_rows + 1;
    return t;
  }
};

/// Which op a barrier opens (its own count in the op-count words).
enum class HtNetOp : int { kDispatch = 1, kCombine = 2 };

/// What every rank must agree on for an op to place rows alike (the barrier
/// compares each peer's with its own): the op, then for a dispatch the hidden
/// bytes, scales per token and top-k, for a combine the hidden size and the
/// top-k of topk_weights (0 without them); then num_worst_tokens (0: the
/// host count exchange sized the areas), and whether this rank's rows for
/// every node fit a slot (set by the barrier from the route's counts), the
/// caller's layout (set by the barrier), and for a ring dispatch the rings'
/// layout (HtRingRegion::layout_word; 0 without rings). A
/// mismatch is reported as kBadConfig of OpId::kBarrier, channel =
/// kHtNetShapeFields * op + the first field that differs.
struct HtNetShape {
  int op, a, b, c, worst, fits, layout, rings;
};
inline constexpr int kHtNetShapeFields = kInternodeShapeFields;

/// send_pos and the per-rank / per-node token counts from is_token_in_rank.
struct HtNetRouteArgs {
  const bool* is_token_in_rank;  ///< [T, R]
  int num_tokens, num_ranks, ranks_per_node;
  int* send_pos;     ///< [T, N]: token t's index in this rank's stream to node m, or -1
  int* rank_pos;     ///< [T, R]: token t's index among this rank's tokens for rank r, or -1
  int* rank_counts;  ///< [R]
  int* node_counts;  ///< [N]
};
void launch_ht_net_route(const HtNetRouteArgs& a, cudaStream_t stream);

/// The ring trace's layout (HtNetDispatchArgs::ring_trace): [role 0..2]
/// [plan::kMaxRingChannels][kRingTraceWords] per op kind.
inline constexpr int kRingTraceWords = 3;
inline constexpr int kRingTraceRoles = 3;

struct HtNetDispatchArgs : DispatchRowArgs {
  HtNetOffsets off;
  const int* table;     ///< HtNetTable layout
  const int* send_pos;  ///< [T, N]
  const int* rank_pos;  ///< [T, R]
  int num_tokens, hidden_bytes, num_scales, num_topk, num_experts;
  int* fwd_mask;   ///< [N, slot_rows]: local ranks each forwarded record reached
  int* fwd_token;  ///< [N, slot_rows]: each forwarded record's token index at its source
  int num_recv_rows;
  uint8_t* recv_x;
  float* recv_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_src_idx;
  int* recv_meta;  ///< [N_recv, 3]: source rank, record index, local ranks the token reached
  int num_blocks;  ///< of the send and receive kernels
  /// The node slots' puts shared by the blocks of a kernel of their own
  /// instead of made by one (Backend::puts_copy_on_sms).
  bool split_puts;
  /// num_worst_tokens (0: none): the table and the handle's counts are made
  /// on the GPU by a count exchange (no host wait), from these:
  int num_worst;
  const int* route_counts;        ///< [R + N]: this rank's tokens per rank, per node
  const int* caller_rank_counts;  ///< [R]: the caller's num_tokens_per_rank (checked)
  int* table_out;                 ///< = table, written by the exchange
  int* rank_prefix_matrix;        ///< [R, R]
  int* source_num_tokens;         ///< [R]
  /// The ring dispatch (EPX_HT_RINGS; docs/internode_ht.md "A first ring
  /// kernel") instead of send, forward and receive: one cooperative launch of
  /// 3 ring.geometry.channels blocks over the rings of `ring`; `ring_rpm`
  /// ([R, R] rank_prefix_matrix) gives each source's first row here. With
  /// num_worst_tokens the exchange kernel runs first (its count rows at
  /// off.count_rows = ring.count_rows) and rows past num_worst are dropped.
  bool use_rings;
  plan::HtRingRegion ring;
  const int* ring_rpm;
  /// EPX_RING_TRACE: per (role, channel) u64 [3]: ring ops, ns in the role,
  /// ns of passes that moved nothing (kRingTraceWords; mapped host memory),
  /// added by each block; nullptr: none.
  unsigned long long* ring_trace = nullptr;
};
/// The barrier, then send, forward and receive.
void launch_ht_net_dispatch(const dev::AnyTransport& t, const HtNetDispatchArgs& a,
                            cudaStream_t stream);

struct HtNetCombineArgs {
  HtNetOffsets off;
  const int* table;
  const uint16_t* x;  ///< [N_recv, H] bf16
  int num_x_rows;
  const float* topk_weights;  ///< [N_recv, K] nullable
  const uint16_t* bias0;
  const uint16_t* bias1;
  const int* send_pos;   ///< [T, N]
  const int* fwd_mask;   ///< [N, slot_rows]
  const int* recv_meta;  ///< [N_recv, 3]
  int num_recv_rows, num_tokens, hidden, num_topk;
  int num_worst;  ///< the dispatch's num_worst_tokens (0: none)
  uint16_t* combined_x;
  float* combined_topk_weights;
  int num_blocks;
  bool split_puts;  ///< as HtNetDispatchArgs::split_puts
  /// The combine rings (EPX_HT_RINGS; docs/internode_ht.md "Combine rings")
  /// instead of return, node sum and finish: one cooperative launch of 3
  /// ring.geometry.channels blocks; the handle's arrays give each role its
  /// records.
  bool use_rings;
  plan::HtRingRegion ring;
  const int* fwd_token;                      ///< [N, slot_rows]
  const int* recv_src_idx;                   ///< [N_recv]
  const int* rank_prefix_matrix;             ///< [R, R]
  const int* source_num_tokens;              ///< [R]
  unsigned long long* ring_trace = nullptr;  ///< as HtNetDispatchArgs::ring_trace
};
/// The barrier, then return, node sum and finish.
void launch_ht_net_combine(const dev::AnyTransport& t, const HtNetCombineArgs& a,
                           cudaStream_t stream);

}  // namespace epx::kernels

// ============================================================================
// Low-latency (issue 4): src/kernels/low_latency.cu. Each op is a send kernel
// (epoch from op_counter, data and flags into the peers' receive slots) and a
// receive kernel (epoch from the op's state word, waits, unpacks locally).
// ============================================================================
namespace epx::kernels {

/// Work-item sizes of the low-latency kernels (the host sizes grids with them).
inline constexpr int kLlThreads = 512;
inline constexpr int kLlDispatchChunk = plan::kLlChunk;  ///< elements per dispatch work item
inline constexpr int kLlCombineSendChunk = 1024;         ///< elements per combine-send work item
/// ... with LogFMT: its round trip makes an item compute-bound, and smaller
/// items spread it over more warps and balance it better.
inline constexpr int kLlCombineSendChunkLogFmt = 256;
inline constexpr int kLlCombineRecvChunk = 256;  ///< elements per combine-receive work item
/// The phases one launch of a low-latency kernel runs (a bit set): its send,
/// its receive, or both (kernels/low_latency/ops.cuh).
inline constexpr int kLlSendPhase = 1, kLlRecvPhase = 2, kLlBothPhases = 3;
inline constexpr int kLlCombineRecvRanksAtOnce = 4;  ///< ranks' rows loaded together
inline constexpr int kLlCombineSendRowsAtOnce = 4;   ///< expert rows loaded together

/// Where things live inside the low-latency symmetric region (plan::LlRegion).
/// Sub-offsets are relative to a half; half h starts at half0 + h * half_bytes.
struct LlOffsets {
  std::size_t control;  ///< local completion counters (uint32[2])
  std::size_t half0, half_bytes;
  std::size_t flags, disp_rows, comb_rows;
  /// Dispatch tags (absolute, like flags): half h at dtags + h * dtags_half_bytes;
  /// inside, counts at 0, masks at dtag_masks, chunk flags at dtag_chunks.
  std::size_t dtags, dtags_half_bytes, dtag_masks, dtag_chunks;
  std::size_t flags_half_bytes;  ///< flags of half 1 start at flags + flags_half_bytes
  /// Combine weights (absolute, like flags): half h at weights + h * weights_half_bytes.
  std::size_t weights, weights_stride, weights_half_bytes;
  /// plan::fingerprint of the dispatch's shapes (maxT, hidden, experts, dtype), 21 bits,
  /// sent above each token count (plan::ll_count_word)
  uint32_t shape_fp;
  // Network transports (plan::LlRegion's network areas; unused otherwise):
  std::size_t tok_done, row_done, net_done;     ///< local counters (u32)
  std::size_t net_masks, net_masks_half_bytes;  ///< mask send area, per half
  std::size_t net_weights;                      ///< weight send area, per half (weights_half_bytes)
  std::size_t net_comb, net_comb_half_bytes;    ///< combined-row send area, per half
};

/// Signal ids of the low-latency ops over a network transport, one per source
/// rank: a source's dispatch (its rows, masks and count), its combine weights,
/// its combined rows. Each op adds 1 per context to the signal (weights: 1).
constexpr int ll_sig_dispatch(int num_ranks, int src) {
  return 0 * num_ranks + src;
}
constexpr int ll_sig_weights(int num_ranks, int src) {
  return 1 * num_ranks + src;
}
constexpr int ll_sig_combine(int num_ranks, int src) {
  return 2 * num_ranks + src;
}
/// Ints of a low-latency dispatch's state: [0] epoch, [2..3] its u64 op count
/// (network transports), [8 + s] tokens of source s.
inline constexpr int kLlStateInts = 8 + plan::kLlMaxRanks;

struct LlDispatchSendArgs {
  LlOffsets off;
  uint32_t* op_counter;  ///< local LL epoch counter (next_epoch of it; the last block stores it)
  int32_t* state;        ///< handle state (kLlStateInts): [0] <- this op's epoch
  /// Network transports: [0] dispatches so far (this one adds 1; the last block stores it)
  uint64_t* seq;
  const uint16_t* x;        ///< [T, H] bf16, contiguous
  const int64_t* topk_idx;  ///< [T, K]
  int64_t* topk_copy;       ///< [T, K] handle copy of topk_idx (nullable)
  int num_tokens, hidden, num_topk, num_experts, max_tokens;
  /// Rows are sent for tokens [0, row_tokens): num_tokens, fewer only under
  /// the test knob EPX_DEBUG_LL_DISPATCH_STOP (a rank dying mid-dispatch).
  /// Tokens past it also skip their handle copy of topk_idx and the bad-id
  /// check (the dying rank makes no later call that would read them).
  int row_tokens;
  int row_bytes;  ///< dispatch row stride in the receive slots
  /// Network puts: 0, token t's on context t % contexts; n > 0, on context
  /// min(t / n, contexts - 1) (EPX_LL_CONTEXT_RANGES). Any context is right:
  /// every context is signalled after all the op's puts.
  int ctx_tokens;
  bool fp8, round_scale;
  DeviceDiag* diag;
};
template <class T>
struct LlDispatchSendParams : LlDispatchSendArgs {
  T t;
};

struct LlDispatchRecvArgs {
  LlOffsets off;
  int32_t*
      state;  ///< handle state: [0] epoch, [2..3] op count (read); [8 + s] <- tokens of source s
  int hidden, num_topk, num_experts, max_tokens, row_bytes;
  int parts;  ///< units per local expert (E_local * parts units, one block each at most)
  bool fp8, ue8m0;
  uint8_t* recv_x;  ///< [E_local, R*maxT, H] bf16 or fp8
  void*
      recv_scales;  ///< f32 [E_local, G, R*maxT] or i32 [E_local, ceil(G/4), R*maxT] (memory order)
  int* recv_count;  ///< [E_local]
  int* src_info;    ///< [E_local, R*maxT]
  int64_t* layout_range;  ///< [E_local, R]
  int2* combine_plan;     ///< [R, W, E_local] (LowLatencyHandle::combine_plan)
  int* stats;             ///< [E_local] nullable, += recv_count
  int64_t* wait_stats;    ///< [R] nullable, += ns waited for source s's masks, per local expert
  uint64_t timeout_ns;
  DeviceDiag* diag;
  /// Arrival order (EPX_LL_ARRIVAL_ORDER=1, experimental): a unit is a local
  /// expert (parts = 1) whose warps form one group per source; each group
  /// reserves its source's rows as soon as that source's token masks are in,
  /// so no source waits for another. Rows of a source stay contiguous and in
  /// token order, the sources in the order they were reserved (as DeepEP).
  bool arrival_order;
};
template <class T>
struct LlDispatchRecvParams : LlDispatchRecvArgs {
  T t;
};
/// The dispatch kernel on `num_blocks` blocks: with a hook, its send phase
/// (every block sends; `ra` picks the kernel only) and later its receive
/// phase, whose blocks take the E_local * ra.parts units in turn (`sa`
/// unused); without, both in one cooperative launch (at most 2 blocks per SM,
/// all resident) whose first `send_blocks` blocks send and the others receive.
void launch_ll_dispatch(const dev::AnyTransport& t, const LlDispatchSendArgs& sa,
                        const LlDispatchRecvArgs& ra, int num_blocks, int send_blocks, int phases,
                        cudaStream_t stream);

struct LlCombineSendArgs {
  LlOffsets off;
  uint32_t* op_counter;
  int32_t* state;  ///< combine state: [0] <- this op's epoch, u64 [1] <- its op count
  /// Network transports: [1] combines so far (this one adds 1; the last block stores it)
  uint64_t* seq;
  const int32_t* disp_state;  ///< the dispatch's handle state ([8 + s]: tokens of source s)
  const uint16_t* x;          ///< [E_local, R*maxT, H] bf16
  const int64_t* topk_idx;    ///< [T, K] of this rank's tokens
  const float* topk_weights;  ///< [T, K] of this rank's tokens
  const int2* combine_plan;   ///< [R, W, E_local] from the dispatch
  /// [R] nullable, zeroed: 1 + the ns block 0 waited for source s's first weight word
  unsigned long long* wait_first;
  int num_tokens, hidden, num_topk, num_experts, max_tokens;
  int ctx_tokens;  ///< as LlDispatchSendArgs::ctx_tokens, for the row puts
  bool logfmt;
  uint64_t timeout_ns;
  DeviceDiag* diag;
};
template <class T>
struct LlCombineSendParams : LlCombineSendArgs {
  T t;
};

struct LlCombineRecvArgs {
  LlOffsets off;
  const int32_t* state;       ///< combine state: [0] epoch, u64 [1] op count
  const int64_t* topk_idx;    ///< [T, K]
  const float* topk_weights;  ///< [T, K]
  uint16_t* out;              ///< [T, H] bf16
  /// [R] nullable: += send_wait_first[s] - 1, or (where 0) the ns waited for s's flag
  int64_t* wait_stats;
  const unsigned long long* send_wait_first;  ///< LlCombineSendParams::wait_first of this call
  int num_tokens, hidden, num_topk, num_experts, max_tokens;
  bool logfmt;
  uint64_t timeout_ns;
  DeviceDiag* diag;
};
template <class T>
struct LlCombineRecvParams : LlCombineRecvArgs {
  T t;
};
/// The combine kernel on `num_blocks` blocks: with a hook, its send phase
/// (`ra` unused) and later its receive phase (`sa` unused); without, both in
/// one launch (one block per SM at most: every block of it resident). The
/// receive waits ra.timeout_ns for a source.
void launch_ll_combine(const dev::AnyTransport& t, const LlCombineSendArgs& sa,
                       const LlCombineRecvArgs& ra, int num_blocks, int phases,
                       cudaStream_t stream);

/// Load every kernel of a family now (cudaFuncGetAttributes), not at its
/// first launch: with CUDA's lazy loading a first launch may wait for the
/// kernels running, which for ranks sharing a GPU can be a peer's kernel
/// waiting for this rank.
void preload_layout_kernels();
void preload_ht_kernels();
void preload_ht_net_kernels();  ///< kernels/internode.cu
void preload_ll_kernels();

/// A module function's return value as an ErrorCode (0 is success, else
/// code + 1; anything else is kInternal).
inline ErrorCode decode_module_error(int rc) {
  const int c = rc - 1;
  return c >= static_cast<int>(ErrorCode::kInvalidArgument) &&
                 c <= static_cast<int>(ErrorCode::kInternal)
             ? static_cast<ErrorCode>(c)
             : ErrorCode::kInternal;
}

/// The low-latency launchers of a module's transport (dev::ModuleTransport):
/// plain functions across the module boundary, each given the transport's
/// data. They return 0, or an ErrorCode + 1 with its message in `err` (the core
/// raises it as epx::Error); nothing is thrown across the boundary.
struct ModuleKernels {
  using Err = char*;
  int (*ll_dispatch)(const dev::NetworkTransportBase& t, const LlDispatchSendArgs& sa,
                     const LlDispatchRecvArgs& ra, int num_blocks, int send_blocks, int phases,
                     cudaStream_t stream, Err err, std::size_t err_len);
  int (*ll_combine)(const dev::NetworkTransportBase& t, const LlCombineSendArgs& sa,
                    const LlCombineRecvArgs& ra, int num_blocks, int phases, cudaStream_t stream,
                    Err err, std::size_t err_len);
  /// The high-throughput ops across nodes (launch_ht_net_dispatch / _combine).
  int (*ht_net_dispatch)(const dev::NetworkTransportBase& t, const HtNetDispatchArgs& a,
                         cudaStream_t stream, Err err, std::size_t err_len);
  int (*ht_net_combine)(const dev::NetworkTransportBase& t, const HtNetCombineArgs& a,
                        cudaStream_t stream, Err err, std::size_t err_len);
};

}  // namespace epx::kernels
