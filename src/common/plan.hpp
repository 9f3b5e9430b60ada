// common/plan.hpp - how the symmetric buffers are carved up. Pure arithmetic,
// shared by the host logic, the size hints and the unit tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "common/topology.hpp"

namespace epx::plan {

/// Ranks of the high-throughput region (one node) and of the low-latency one (all ranks).
inline constexpr int kHtMaxRanks = kMaxRanksPerNode;
inline constexpr int kLlMaxRanks = epx::kMaxRanks;
inline constexpr std::size_t kAlign = 128;

constexpr std::size_t align_up(std::size_t v, std::size_t a) {
  return (v + a - 1) / a * a;
}

/// The epoch of the op after the one of epoch `e` (HT and LL counters alike):
/// e + 1, except where the counter wraps, after 2^32 ops: 0 is what every flag
/// and tagged word holds until first written, so an op of epoch 0 could take
/// a never-written word as this op's; the wrap goes to 2, not 1, so that
/// consecutive epochs keep alternating parity (the halves of the double
/// buffers are picked by epoch & 1).
constexpr uint32_t next_epoch(uint32_t e) {
  const uint32_t n = e + 1u;
  return n | (static_cast<uint32_t>(n == 0u) << 1);  // branch-free: 0 -> 2
}

/// FNV-1a over `values` (8 bytes each): the fingerprint ranks exchange to
/// check that they run an op with the same config and shapes.
constexpr uint32_t fingerprint(std::initializer_list<long long> values) {
  uint32_t h = 2166136261u;
  for (long long v : values)
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint8_t>(static_cast<unsigned long long>(v) >> (8 * i));
      h *= 16777619u;
    }
  return h;
}

/// One staged dispatch row: payload, FP8 scales (f32), top-k ids (i32),
/// weights (f32), source token index (i32).
constexpr std::size_t ht_dispatch_row_bytes(std::size_t hidden_bytes, int num_scales,
                                            int num_topk) {
  return align_up(hidden_bytes + 4u * num_scales + 8u * num_topk + 4u, 16);
}
/// One staged combine row: BF16 payload and top-k weights (f32).
constexpr std::size_t ht_combine_row_bytes(int hidden, int num_topk) {
  return align_up(2u * hidden + 4u * num_topk, 16);
}

/// Rows per chunk (one sender warp, one flag) between a sender and a receiver
/// that exchange `rows` rows: the config's `chunk`, or fewer when the pair has
/// few rows, so that it still has about as many chunks as the sender has warps
/// per peer (`send_warps / (num_ranks - 1)`). A warp copies a chunk alone with
/// a few KB in flight: at 128 tokens per rank (EP2) chunks of 4 rows made the
/// dispatch 52 us against 31 us with 1. Both sides compute it from the pair's
/// row count (the sender's send count, the receiver's receive count: equal)
/// and the config, which every rank must share. Never more chunks per pair
/// than max(rows / chunk, 2 * send_warps / (num_ranks - 1)) + 1.
constexpr int ht_pair_chunk(int rows, int chunk, int send_warps, int num_ranks) {
  if (num_ranks <= 1 || send_warps <= 0) return chunk;
  const long long c = static_cast<long long>(rows) * (num_ranks - 1) / send_warps;
  return static_cast<int>(c < 1 ? 1 : (c < chunk ? c : chunk));
}

/// High-throughput region, per rank. The control and flag areas have a fixed
/// size and place whatever the call (dispatch or combine, any config), so a
/// flag is never overwritten by another op's staged rows:
///   [barrier flags uint32[kHtMaxRanks]]
///   [two count-exchange areas: int32[kHtMaxRanks][1 + kMaxLocalExperts]]
///   [chunk flags uint32[kHtMaxRanks][kMaxChunks]]   [src][j]: epoch of the op whose
///                 chunk j from src has landed here
///   [credits uint32[kHtMaxRanks][kMaxChunks]]       [dst][j]: epoch of the op whose
///                 chunk j to dst has been consumed there (written by dst)
///   [consumed uint64[kHtMaxRanks][kMaxChunks]]      local: {rows of chunk j from src
///                 reduced so far, epoch << 32} (combine receivers count rows)
///   [config uint64[kHtMaxRanks]]                    [src]: {src's config fingerprint,
///                 epoch << 32} (every rank of an op must use the same ring and chunks)
///   [export uint64]                               pull dispatch: {this rank's token
///                 count, epoch << 32}
///   [staging: R - 1 peer sources x capacity rows x row_bytes]   (varies per call)
/// A rank's own rows never stage (dispatch copies them from x, combine reads
/// them from x), so the staging has no area for the rank itself: source `src`
/// uses area staging_index(src, me).
///
/// The staging of a pair is a ring of `capacity` rows (config.num_max_recv_tokens):
/// chunk j of a pair lands in slot j % ring_slots(chunk), and a sender waits
/// for the credit of chunk j - ring_slots before it writes chunk j, so a call
/// may move any number of rows through a ring of any size. Flags and credits
/// are per chunk index, not per slot, so a lap never mistakes one chunk for another.
///
/// Pull dispatch (Config::pull_dispatch): the staging is instead the rank's
/// export ring, read by its peers: batch c of ht_pull_batch() consecutive
/// tokens at slot c % (staged rows / batch), row per token. Its per-batch words
/// use two areas above, each in the exporter's region: `consumed` [r][c] =
/// {mask of the batch's tokens rank r takes | slot of the first << 8,
/// epoch << 32} (release-stored once the rows are in), `credits` [r][c] =
/// epoch once r has read batch c (only when a later batch reuses its slot).
/// Both are epoch-tagged and compared exactly, and ops never overlap, so the
/// combine's use of the same words is harmless.
inline constexpr int kMaxLocalExperts = 1024;
inline constexpr int kMaxChunks = 16384;  ///< per (source, receiver) pair and call

/// Chunks a pair with `rows` rows sends, at `chunk` rows per chunk.
constexpr int ht_num_chunks(int rows, int chunk) {
  return chunk > 0 ? (rows + chunk - 1) / chunk : 0;
}

/// Tokens per batch of the pull dispatch (one word per receiver, at most 8:
/// the word's mask has 8 bits), for a staging of `staged_rows` rows.
inline constexpr int kPullBatch = 8;
constexpr int ht_pull_batch(int staged_rows) {
  return staged_rows < kPullBatch ? (staged_rows > 0 ? staged_rows : 1) : kPullBatch;
}

struct HtRegion {
  int num_ranks = 0, num_experts = 0, capacity = 0, chunk = 0;
  std::size_t row_bytes = 0;

  int max_chunks() const { return kMaxChunks; }
  /// Slots of `pair_chunk` rows in a pair's ring (at least one).
  static constexpr int ring_slots(int capacity_rows, int pair_chunk) {
    return pair_chunk > 0 && capacity_rows >= pair_chunk ? capacity_rows / pair_chunk : 1;
  }
  /// Staging areas: one per peer.
  int staged_sources() const { return num_ranks > 1 ? num_ranks - 1 : 0; }
  /// Area of source `src` (a peer, src != me) in the staging of rank `me`.
  static constexpr int staging_index(int src, int me) { return src < me ? src : src - 1; }
  /// Count-exchange row a source writes into every rank: [its token count
  /// to each of the R ranks, its number of tokens, then its picks of each of
  /// the receiver's E_local experts]. Every rank thus learns the whole R x R
  /// count matrix (DeepEP's rank_prefix_matrix) and each source's tokens.
  static constexpr int count_row_ints() { return kHtMaxRanks + 1 + kMaxLocalExperts; }

  static constexpr std::size_t barrier_offset() { return 0; }  // uint32[kHtMaxRanks]
  static constexpr std::size_t counts_bytes() {
    return align_up(4u * kHtMaxRanks * count_row_ints(), kAlign);
  }
  static constexpr std::size_t counts_offset(int parity) {
    return align_up(4u * kHtMaxRanks, kAlign) + parity * counts_bytes();
  }
  static constexpr std::size_t flags_offset() { return counts_offset(2); }
  static constexpr std::size_t credits_offset() {
    return align_up(flags_offset() + 4u * kHtMaxRanks * kMaxChunks, kAlign);
  }
  static constexpr std::size_t consumed_offset() {
    return align_up(credits_offset() + 4u * kHtMaxRanks * kMaxChunks, kAlign);
  }
  /// uint64[kHtMaxRanks]: {fingerprint of the sender's config and row layout, epoch << 32}
  /// per source, stored before its barrier flag; senders compare before any store.
  static constexpr std::size_t config_offset() {
    return align_up(consumed_offset() + 8u * kHtMaxRanks * kMaxChunks, kAlign);
  }
  static constexpr std::size_t export_offset() {
    return align_up(config_offset() + 8u * kHtMaxRanks, kAlign);
  }
  static constexpr std::size_t staging_offset() { return align_up(export_offset() + 8u, kAlign); }
  /// Staging rows in all (the pull dispatch's export ring).
  int staged_rows() const { return staged_sources() * capacity; }
  std::size_t total_bytes() const {
    return staging_offset() + static_cast<std::size_t>(staged_sources()) * capacity * row_bytes;
  }
};

}  // namespace epx::plan

// ============================================================================
// Low-latency region (issue 4). Owned by the low-latency path; appended here so
// the size hint, the host logic and the unit tests share one piece of arithmetic.
// ============================================================================
namespace epx::plan {

/// Picks reserved per token in the routing metadata (the size hint has no top-k).
inline constexpr int kLlMaxTopK = 16;
/// Most tokens per rank and call (num_max_dispatch_tokens_per_rank).
inline constexpr int kLlMaxTokens = 1024;
/// Most experts in total, and the largest hidden size (the dispatch's tag area
/// has a fixed size for every shape).
inline constexpr int kLlMaxExperts = 1024;
inline constexpr int kLlMaxHidden = 16384;
/// Elements per dispatch chunk (one sender warp, one arrival flag).
inline constexpr int kLlChunk = 512;
inline constexpr int kLlMaxChunks = kLlMaxHidden / kLlChunk;
/// A source's token count travels with a 21-bit fingerprint of the op's
/// shapes above it (count < 2^kLlCountBits), so a receiver refuses a sender
/// whose maxT, hidden, experts or dtype differ from its own.
inline constexpr int kLlCountBits = 11;
static_assert(kLlMaxTokens < (1 << kLlCountBits));
constexpr uint32_t ll_count_word(int num_tokens, uint32_t shape_fp) {
  return static_cast<uint32_t>(num_tokens) | (shape_fp << kLlCountBits);
}
constexpr int ll_count_of(uint32_t word) {
  return static_cast<int>(word & ((1u << kLlCountBits) - 1u));
}
constexpr uint32_t ll_shape_of(uint32_t word) {
  return word >> kLlCountBits;
}
/// 32-token words of a token mask at most.
inline constexpr int kLlMaxMaskWords = kLlMaxTokens / 32;

/// Low-latency region, per rank (all offsets from the region start):
///   [control: local completion counters of the send kernels]
///   [flags of half 0][flags of half 1]  uint32[2][kLlMaxRanks]: row 1 the combine's,
///                 one word per source rank holding the epoch of the last op that
///                 filled it; row 0 unused (the dispatch has per-chunk flags below)
///   [weights of half 0][weights of half 1]  per source: uint64 [kLlMaxTokens][kLlMaxTopK]
///                 combine weights, entry [t][j] = {f32 weight bits, epoch << 32} of the
///                 j-th distinct local expert (ascending id) that token t of the source
///                 picked on the receiving rank
///   [dispatch tags of half 0][of half 1]   only epoch-tagged words, each:
///       counts    uint64 [kLlMaxRanks]: {num_tokens, epoch << 32} per source
///       masks     uint64 [R][kLlMaxMaskWords][E_local]: {token mask, epoch << 32};
///                 bit t % 32 of word [s][t / 32][le] is set when token t of source s
///                 picks local expert le of the receiving rank
///       chunks    uint32 [R][kLlMaxTokens][kLlMaxChunks]: epoch of the op whose chunk
///                 c of token t of source s has arrived (release-stored after it)
///   [network control]   signals and send counters (network transports; below)
///   [network send areas of a fixed place]  mask and weight sends (below)
///   [half 0][half 1]       one half per op parity (epoch & 1), each:
///       disp rows per source: [maxT] dispatch rows (payload, FP8 scales) at slot = token
///       comb rows per source: [maxT] bf16 rows (one per (token, expert rank))
///   [combine row sends]         transports with peers in other nodes (below)
///   [zero-copy 0][zero-copy 1]  bf16 [E_local, R*maxT, H] combine inputs
///                               (get_next_low_latency_combine_buffer); optional: the ops
///                               themselves need core_bytes() (with the network: net_end()).
struct LlRegion {
  int num_ranks = 0, max_tokens = 0, hidden = 0, num_experts = 0;

  int local_experts() const { return num_experts / num_ranks; }
  int rows_per_expert() const { return num_ranks * max_tokens; }

  /// One dispatch row in the receive slots: FP8 payload + f32 scales, or BF16 payload.
  std::size_t dispatch_row_bytes(bool fp8) const {
    return fp8 ? align_up(static_cast<std::size_t>(hidden) + 4u * (hidden / 128), 16)
               : 2u * static_cast<std::size_t>(hidden);
  }
  std::size_t dispatch_row_capacity() const {
    const std::size_t a = dispatch_row_bytes(true), b = dispatch_row_bytes(false);
    return a > b ? a : b;
  }
  std::size_t combine_row_bytes() const { return 2u * static_cast<std::size_t>(hidden); }

  /// Completion counters, the flags and the weights of both halves: a fixed
  /// place and size whatever maxT, hidden and E are, so no call's rows ever
  /// land on a word that a later call with another shape compares against
  /// its epoch (the weights carry their epoch in the word itself).
  static constexpr std::size_t flags_bytes() { return align_up(2u * 4u * kLlMaxRanks, kAlign); }
  static constexpr std::size_t flags_base() { return kAlign; }
  /// Per source in a weights area: uint64 [kLlMaxTokens][kLlMaxTopK].
  static constexpr std::size_t weights_stride() {
    return 8u * static_cast<std::size_t>(kLlMaxTokens) * kLlMaxTopK;
  }
  std::size_t weights_half_bytes() const {
    return static_cast<std::size_t>(num_ranks) * weights_stride();
  }
  static constexpr std::size_t weights_base() { return flags_base() + 2 * flags_bytes(); }
  /// Dispatch tags: sub-offsets inside one half's tag area, and its size.
  static constexpr std::size_t dtag_counts_offset() { return 0; }
  static constexpr std::size_t dtag_masks_offset() { return align_up(8u * kLlMaxRanks, kAlign); }
  static constexpr std::size_t dtag_chunks_offset() {
    return dtag_masks_offset() + 8u * kLlMaxMaskWords * static_cast<std::size_t>(kLlMaxExperts);
  }
  std::size_t dtags_half_bytes() const {
    return align_up(dtag_chunks_offset() +
                        4u * static_cast<std::size_t>(num_ranks) * kLlMaxTokens * kLlMaxChunks,
                    kAlign);
  }
  std::size_t dtags_base() const { return weights_base() + 2 * weights_half_bytes(); }
  // Network control (transports with peers in other nodes), after the
  // dispatch tags: a fixed place and size for a buffer (they depend on R
  // only), since the signals count every op of the buffer whatever its shapes.
  //   [signals u64 [kNetSignalKinds * kLlMaxRanks][kMaxContexts]]   per source:
  //                 its dispatch (kind 0), combine weights (1), combine rows (2)
  //   [tok_done u32 [kLlMaxTokens]]     dispatch: chunks of token t in its send slot
  //   [row_done u32 [R][kLlMaxTokens]]  combine: chunks of row (s, t) in its send slot
  //   [net_done u32 [4]]                [0] combine: blocks done with their weights;
  //                                     [1] / [2] dispatch / combine: a block's part failed
  static constexpr int kNetSignalKinds = 3;
  static constexpr std::size_t signals_bytes() {
    return align_up(8u * kNetSignalKinds * kLlMaxRanks * kMaxContexts, kAlign);
  }
  std::size_t signals_offset() const { return dtags_base() + 2 * dtags_half_bytes(); }
  std::size_t tok_done_offset() const { return signals_offset() + signals_bytes(); }
  std::size_t row_done_offset() const {
    return align_up(tok_done_offset() + 4u * kLlMaxTokens, kAlign);
  }
  std::size_t net_done_offset() const {
    return align_up(row_done_offset() + 4u * static_cast<std::size_t>(num_ranks) * kLlMaxTokens,
                    kAlign);
  }
  std::size_t control_bytes() const { return align_up(net_done_offset() + 16u, kAlign); }

  // ---- network send areas of a fixed place (after the control) -------------
  //   [mask sends of half 0][half 1]     u64 [R][kLlMaxMaskWords][E_local] tagged words
  //   [weight sends of half 0][half 1]   u64 [R][kLlMaxTokens][kLlMaxTopK] tagged words
  // A rank whose shapes differ from its peer's writes that peer's rows where
  // the peer's layout has something else. Rows never reach a place that does
  // not move with the shapes, so what a rank sends as tagged words must live
  // there: else a mismatched peer's rows would overwrite them and the rank
  // would forward garbage instead of the words that let everyone diagnose
  // the mismatch.
  static constexpr std::size_t net_masks_half_bytes() {
    return align_up(8u * kLlMaxMaskWords * static_cast<std::size_t>(kLlMaxExperts), kAlign);
  }
  std::size_t net_masks_offset() const { return control_bytes(); }
  std::size_t net_weights_offset() const { return net_masks_offset() + 2 * net_masks_half_bytes(); }
  /// Everything of a fixed place and size for a buffer (R only): the halves follow.
  std::size_t fixed_bytes() const { return net_weights_offset() + 2 * weights_half_bytes(); }
  /// 32-token words of a token mask.
  int mask_words() const { return (max_tokens + 31) / 32; }
  // Offsets inside a half (its flags, weights and tags live before the halves).
  std::size_t dispatch_rows_offset() const { return 0; }
  std::size_t combine_rows_offset() const {
    return align_up(dispatch_rows_offset() +
                        static_cast<std::size_t>(num_ranks) * max_tokens * dispatch_row_capacity(),
                    kAlign);
  }
  std::size_t half_bytes() const {
    return align_up(combine_rows_offset() +
                        static_cast<std::size_t>(num_ranks) * max_tokens * combine_row_bytes(),
                    kAlign);
  }
  std::size_t half_offset(int parity) const { return fixed_bytes() + parity * half_bytes(); }
  /// Bytes dispatch and combine need (the network transports: net_end()).
  std::size_t core_bytes() const { return fixed_bytes() + 2 * half_bytes(); }
  /// One zero-copy combine input [E_local, R*maxT, H] bf16.
  std::size_t zero_copy_bytes() const {
    return align_up(2u * static_cast<std::size_t>(local_experts()) * rows_per_expert() * hidden,
                    kAlign);
  }

  // ---- combine row sends (transports with peers in other nodes) -----------
  // After the halves:
  //   [combine row sends of half 0][half 1]  bf16 [R][maxT][H]
  // They move with the shapes; a mismatched peer's dispatch rows may land
  // there, which is harmless: a combine writes its rows before it puts them.
  // A dispatch row for a remote rank is sent from this rank's own receive
  // slot [me][t] (the same bytes at every destination), its count word from
  // its own count word: they need no send area. An op's first act is to wait
  // until the puts that read the last op's send areas are complete.
  std::size_t net_comb_half_bytes() const {
    return align_up(static_cast<std::size_t>(num_ranks) * max_tokens * combine_row_bytes(), kAlign);
  }
  std::size_t net_comb_offset() const { return core_bytes(); }
  std::size_t net_end() const { return net_comb_offset() + 2 * net_comb_half_bytes(); }
  std::size_t zero_copy_offset(int slot) const { return net_end() + slot * zero_copy_bytes(); }
  /// Everything, network areas and zero-copy inputs included
  /// (get_low_latency_rdma_size_hint).
  std::size_t total_bytes() const { return zero_copy_offset(2); }
};

}  // namespace epx::plan
