// kernels/low_latency/dispatch_send.cuh - the dispatch's send phase (row items and mask units)
// and dispatch_send_phase, hook mode's send.
#pragma once

#include "kernels/low_latency/common.cuh"

namespace epx::kernels {
namespace {

// ============================================================================
// dispatch: send. Warps take (token, 512-column chunk) row items and
// (32-token word, 32-expert group) mask units. A row item stores its chunk
// into slot [me][token] of every rank that hosts one of the token's picks
// (in the order me + 1, me + 2, ...: ranks start on different peers, so no
// rank's ingress takes everyone's first stores), then release-stores this op's epoch into that
// rank's arrival flag of (me, token, chunk). A mask unit sends one tagged word {mask, epoch} per
// expert to the expert's rank, for every word of maxT (zero past the token
// count), so a receiver needs no count to know which words to wait for.
// ============================================================================
__device__ __forceinline__ std::size_t tags_of(const LlOffsets& o, uint32_t epoch) {
  return o.dtags + (epoch & 1u) * o.dtags_half_bytes;
}

__device__ __forceinline__ std::size_t mask_word_offset(const LlOffsets& o, std::size_t tags,
                                                        int src, int w, int le, int E_local) {
  return tags + o.dtag_masks +
         8u * ((static_cast<std::size_t>(src) * plan::kLlMaxMaskWords + w) * E_local + le);
}

__device__ __forceinline__ std::size_t chunk_flag_offset(const LlOffsets& o, std::size_t tags,
                                                         int src, int t, int c) {
  return tags + o.dtag_chunks +
         4u * ((static_cast<std::size_t>(src) * plan::kLlMaxTokens + t) * plan::kLlMaxChunks + c);
}

/// Network transports: offset of the tagged mask word for (rank r, word w,
/// local expert le) in this rank's mask send area of the op's half.
__device__ __forceinline__ std::size_t net_mask_offset(const LlOffsets& o, uint32_t epoch, int r,
                                                       int w, int le, int E_local) {
  return o.net_masks + (epoch & 1u) * o.net_masks_half_bytes +
         8u * ((static_cast<std::size_t>(r) * plan::kLlMaxMaskWords + w) * E_local + le);
}

/// The op's epoch (next_epoch of the op counter); block 0 records it in the handle state
/// and sends this rank's token count to every rank (in this rank's node; the
/// others get it with the op's last puts). Network transports: a block that
/// sends (`sends`) first waits until the puts that read its send areas are done.
template <class T>
__device__ __forceinline__ uint32_t dispatch_begin(const LlDispatchSendParams<T>& p, uint64_t seq,
                                                   bool sends, bool& send_ok) {
  const uint32_t epoch = plan::next_epoch(*p.op_counter);
  send_ok = true;
  if constexpr (kNet<T>)
    if (sends) send_ok = quiet_send_areas(p.t);
  if (blockIdx.x == 0) {
    const std::size_t tags = tags_of(p.off, epoch);
    if (static_cast<int>(threadIdx.x) < p.t.num_ranks && !p.t.masked(threadIdx.x)) {
      bool direct = true;
      if constexpr (kNet<T>) direct = p.t.same_node(threadIdx.x);
      if (direct)
        p.t.lsa_tagged(threadIdx.x, tags + 8u * static_cast<std::size_t>(p.t.rank),
                       plan::ll_count_word(p.num_tokens, p.off.shape_fp), epoch);
    }
    if (threadIdx.x == 0) {
      p.state[0] = static_cast<int32_t>(epoch);
      if constexpr (kNet<T>) *reinterpret_cast<uint64_t*>(p.state + 2) = seq;
    }
  }
  return epoch;
}

/// FP8 of one lane's 16 elements (a, b) with the scale of its 128-element
/// group (8 lanes): ref::quantize_row_fp8.
__device__ __forceinline__ int4 fp8_quantize16(const int4& a, const int4& b, bool round_scale,
                                               float& scale) {
  float f[16];
  unpack_bf16x8(a, f);
  unpack_bf16x8(b, f + 8);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 4));
  scale = fp8_scale(amax, round_scale);
  // x / scale, correctly rounded; a power-of-two scale (round_scale) has an
  // exact reciprocal, and x * (1 / scale) is then the same number.
  const float inv = 1.0f / scale;
#pragma unroll
  for (int i = 0; i < 16; ++i) f[i] = round_scale ? f[i] * inv : __fdiv_rn(f[i], scale);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = fp8x2_e4m3_bits(f[4 * i], f[4 * i + 1]) |
           (fp8x2_e4m3_bits(f[4 * i + 2], f[4 * i + 3]) << 16);
  return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                   static_cast<int>(w[3]));
}

/// Network transports: one (token t, 512-column chunk c) row item, with the
/// lane's 16 elements in a, b. The chunk goes to every rank of this node that
/// hosts one of the token's picks (stores, then an arrival flag, as without a
/// network) and, when some picks are on ranks of other nodes, into this
/// rank's own slot [me][t] (the same bytes every destination gets); the warp
/// that writes the token's last chunk there puts the whole row to each of
/// those ranks (one message per (token, rank)).
template <class T>
__device__ __forceinline__ void net_send_chunk(const LlDispatchSendParams<T>& p, uint32_t epoch,
                                               int t, int c, int64_t e, const int4& a,
                                               const int4& b) {
  const int R = p.t.num_ranks, me = p.t.rank, lane = threadIdx.x % 32;
  const int H = p.hidden, E = p.num_experts, E_local = E / R;
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  const std::size_t tags = tags_of(p.off, epoch);
  const int r_k = e >= 0 && e < E ? static_cast<int>(e / E_local) : -1;  // rank of pick `lane`
  const uint32_t same_rank = __match_any_sync(kFull, r_k);       // every lane (not after an &&)
  const bool leader = r_k >= 0 && lane == __ffs(same_rank) - 1;  // one lane per rank
  // Shrink: nothing is stored or put to a masked rank. Whether the row goes
  // through the send slot (and counts in tok_done) does not look at the mask,
  // which may change between two chunks of the token: every chunk counts.
  const bool live = leader && !p.t.masked(r_k);
  const bool remote = leader && !p.t.same_node(r_k);
  const uint32_t lives = __ballot_sync(kFull, live), remotes = __ballot_sync(kFull, remote);
  if (lives == 0u && remotes == 0u) return;
  const bool to_self = __any_sync(kFull, live && r_k == me);
  const int h0 = c * kDispatchChunk + lane * 16;
  const bool active = h0 < H;
  const std::size_t slot =
      half + p.off.disp_rows + (static_cast<std::size_t>(me) * p.max_tokens + t) * p.row_bytes;
  float scale = 0.0f;
  const int4 q = p.fp8 ? fp8_quantize16(a, b, p.round_scale, scale) : a;
  auto store = [&](char* row) {
    if (!active) return;
    if (p.fp8) {
      dev::st_na(reinterpret_cast<int4*>(row + h0), q);
      if ((lane & 7) == 0) reinterpret_cast<float*>(row + H)[h0 / 128] = scale;
    } else {
      dev::st_na(reinterpret_cast<int4*>(row + 2 * h0), a);
      dev::st_na(reinterpret_cast<int4*>(row + 2 * h0) + 1, b);
    }
  };
  for (uint32_t m = lives & ~remotes; m != 0u; m &= m - 1u)
    store(p.t.lsa_ptr(__shfl_sync(kFull, r_k, __ffs(m) - 1), slot));
  if (remotes != 0u && !to_self) store(p.t.local_ptr(slot));
  __syncwarp();  // every lane's stores before the arrival flags (release, cumulative)
  if (live && !remote) p.t.lsa_flag(r_k, chunk_flag_offset(p.off, tags, me, t, c), epoch);
  if (remotes == 0u) return;
  const int C = ceil_div(H, kDispatchChunk);
  if (!last_part(reinterpret_cast<uint32_t*>(p.t.local_ptr(p.off.tok_done)) + t, C)) return;
  const int ctx = put_context(p.ctx_tokens, t, p.t.num_contexts);
  const uint32_t to_put = __ballot_sync(kFull, remote && !p.t.masked(r_k));  // mask at put time
  for (uint32_t m = to_put; m != 0u; m &= m - 1u)
    p.t.template put<dev::Warp>(ctx, __shfl_sync(kFull, r_k, __ffs(m) - 1), slot, slot,
                                p.row_bytes);
}

/// Send work of warps gw = first, first + stride, ...
template <class T>
__device__ __forceinline__ void dispatch_send_items(const LlDispatchSendParams<T>& p,
                                                    uint32_t epoch, int first, int stride) {
  const int R = p.t.num_ranks, me = p.t.rank;
  const int lane = threadIdx.x % 32;
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  const std::size_t tags = tags_of(p.off, epoch);
  const int H = p.hidden, K = p.num_topk, E = p.num_experts, E_local = E / R;
  const int C = ceil_div(H, kDispatchChunk);
  uint32_t live = 0;  // shrink: no store to a masked rank (network transports ask per rank)
  if constexpr (!kNet<T>) live = p.t.live_ranks();
  // The mask units come first: receivers need them before any row.
  const int groups = ceil_div(E, 32), W = ceil_div(p.max_tokens, 32);
  const int mask_units = W * groups;
  const int items = mask_units + p.row_tokens * C;  // row_tokens: num_tokens but in a test
  for (int item = first; item < items; item += stride) {
    if (item < mask_units) {
      const int w = item / groups, g = item % groups;
      const int t = w * 32 + lane;
      uint32_t mine = 0;  // bit j: token t picks expert 32 g + j
      if (t < p.num_tokens) {
        int64_t v[plan::kLlMaxTopK];
#pragma unroll
        for (int k = 0; k < plan::kLlMaxTopK; ++k)
          v[k] = k < K ? p.topk_idx[static_cast<int64_t>(t) * K + k] : -1;
#pragma unroll
        for (int k = 0; k < plan::kLlMaxTopK; ++k) {
          const int64_t j = v[k] - 32 * g;
          if (v[k] >= 0 && v[k] < E && j >= 0 && j < 32) mine |= 1u << static_cast<int>(j);
        }
      }
      if (lane == 0) tl_mark_any(kTlDispatch, kTlSendMasksIn, mine);
      uint32_t word = 0;  // lane j: the tokens that pick expert 32 g + j
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const uint32_t b = __ballot_sync(kFull, (mine >> j) & 1u);
        if (lane == j) word = b;
      }
      const int e = 32 * g + lane;
      if constexpr (!kNet<T>) {
        if (e < E && ((live >> (e / E_local)) & 1u))
          p.t.lsa_tagged(e / E_local, mask_word_offset(p.off, tags, me, w, e % E_local, E_local),
                         word, epoch);
      } else if (e < E && !p.t.masked(e / E_local)) {
        const int r = e / E_local, le = e % E_local;
        if (p.t.same_node(r))
          p.t.lsa_tagged(r, mask_word_offset(p.off, tags, me, w, le, E_local), word, epoch);
        else  // into the send area; the op's last block puts it
          dev::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(p.t.local_ptr(
                                      net_mask_offset(p.off, epoch, r, w, le, E_local))),
                                  (static_cast<uint64_t>(epoch) << 32) | word);
      }
      if (lane == 0) tl_mark_any(kTlDispatch, kTlSendMasks);
      continue;
    }
    const int t = (item - mask_units) / C, c = (item - mask_units) % C;
    // The row's loads go out before the routing's (both in flight at once).
    const int h0 = c * kDispatchChunk + lane * 16;  // this lane's 16 elements
    const bool active = h0 < H;                     // H % 128 == 0: whole groups of 8 lanes
    int4 a = make_int4(0, 0, 0, 0), b = a;
    if (active) {
      const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(t) * H + h0);
      a = dev::ld_nc(src);
      b = dev::ld_nc(src + 1);
    }
    const int64_t e = lane < K ? p.topk_idx[static_cast<int64_t>(t) * K + lane] : -1;
    const bool valid = e >= 0 && e < E;
    if constexpr (kNet<T>) {
      if (c == 0 && lane < K) {
        if (!valid && e != -1)
          dev::report(p.diag, DiagCode::kBadExpert, OpId::kLowLatencyDispatchSend, me, -1, lane, 0,
                      static_cast<uint32_t>(e), t);
        if (p.topk_copy) p.topk_copy[static_cast<int64_t>(t) * K + lane] = e;
      }
      net_send_chunk(p, epoch, t, c, e, a, b);
      continue;
    }
    const uint32_t dst_mask =
        __reduce_or_sync(kFull, valid ? (1u << static_cast<int>(e / E_local)) : 0u) & live;
    if (c == 0 && lane < K) {
      if (!valid && e != -1)
        dev::report(p.diag, DiagCode::kBadExpert, OpId::kLowLatencyDispatchSend, me, -1, lane, 0,
                    static_cast<uint32_t>(e), t);
      if (p.topk_copy) p.topk_copy[static_cast<int64_t>(t) * K + lane] = e;
    }
    if (dst_mask == 0u) continue;

    const std::size_t slot =
        half + p.off.disp_rows + (static_cast<std::size_t>(me) * p.max_tokens + t) * p.row_bytes;
    if (p.fp8) {
      float f[16];
      unpack_bf16x8(a, f);
      unpack_bf16x8(b, f + 8);
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
      amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 4));
      const float scale = fp8_scale(amax, p.round_scale);
      // x / scale, correctly rounded; a power-of-two scale (round_scale) has an
      // exact reciprocal, and x * (1 / scale) is then the same number.
      const float inv = 1.0f / scale;
#pragma unroll
      for (int i = 0; i < 16; ++i) f[i] = p.round_scale ? f[i] * inv : __fdiv_rn(f[i], scale);
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = fp8x2_e4m3_bits(f[4 * i], f[4 * i + 1]) |
               (fp8x2_e4m3_bits(f[4 * i + 2], f[4 * i + 3]) << 16);
      const int4 q = make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]),
                               static_cast<int>(w[2]), static_cast<int>(w[3]));
      if (active) {
        for (int i = 1; i <= R; ++i) {
          const int r = (me + i) % R;  // rotated, see kernel comment
          if (!((dst_mask >> r) & 1u)) continue;
          char* row = p.t.lsa_ptr(r, slot);
          dev::st_na(reinterpret_cast<int4*>(row + h0), q);
          if ((lane & 7) == 0) reinterpret_cast<float*>(row + H)[h0 / 128] = scale;
        }
      }
    } else if (active) {
      for (int i = 1; i <= R; ++i) {
        const int r = (me + i) % R;
        if (!((dst_mask >> r) & 1u)) continue;
        int4* row = reinterpret_cast<int4*>(p.t.lsa_ptr(r, slot) + 2 * h0);
        dev::st_na(row, a);
        dev::st_na(row + 1, b);
      }
    }
    // Arrival of this chunk: the warp barrier orders every lane's stores
    // before lane r's release store (cumulative), which the receiver acquires.
    __syncwarp();
    if (lane < R && ((dst_mask >> lane) & 1u))
      p.t.lsa_flag(lane, chunk_flag_offset(p.off, tags, me, t, c), epoch);
  }
}

/// Every block calls this once after its send work; the last one resets the
/// count and publishes the epoch to the next op. Nothing waits for it.
/// Network transports: the last block, once every block's sends are posted,
/// puts this rank's token masks and count to each rank of another node and
/// then adds 1 to that rank's dispatch signal on every context (after the
/// context's row puts). A rank that dies mid-dispatch (the test knob) sends
/// none of it, as a dead rank would: its rows without a signal are no message.
template <class T>
__device__ __forceinline__ void net_dispatch_finish(const LlDispatchSendParams<T>& p,
                                                    uint32_t epoch) {
  if (p.row_tokens < p.num_tokens) return;
  const int R = p.t.num_ranks, me = p.t.rank, E_local = p.num_experts / R;
  const int W = ceil_div(p.max_tokens, 32);
  const std::size_t tags = tags_of(p.off, epoch);
  const std::size_t count = tags + 8u * static_cast<std::size_t>(me);
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    if (p.t.same_node(r) || p.t.masked(r)) continue;
    p.t.template put<dev::Thread>(0, r, mask_word_offset(p.off, tags, me, 0, 0, E_local),
                                  net_mask_offset(p.off, epoch, r, 0, 0, E_local),
                                  8u * W * E_local);
    p.t.template put<dev::Thread>(0, r, count, count, 8u);
    signal_contexts(p.t, r, ll_sig_dispatch(R, me));
  }
}

/// Every block calls this once after its send work; the last one resets the
/// count and publishes the epoch to the next op (network transports: after
/// sending what needs every block's work). Nothing waits for it.
template <class T>
__device__ __forceinline__ void dispatch_count_done(const LlDispatchSendParams<T>& p,
                                                    uint32_t epoch, uint64_t seq,
                                                    bool failed = false) {
  EPX_TL(kTlDispatch, kTlSendItems);
  __syncthreads();
  uint32_t* control = reinterpret_cast<uint32_t*>(p.t.local_ptr(p.off.control));
  if constexpr (!kNet<T>) {
    if (threadIdx.x == 0 && dev::last_block_done(control + kDoneDispatch)) *p.op_counter = epoch;
  } else {
    uint32_t* fail = net_failed_word(p.t, p.off, kNetFailedDispatch);
    if (failed && threadIdx.x == 0) atomicOr(fail, 1u);  // before the count's release
    if (dev::block_counted_last(control + kDoneDispatch)) {
      if (*static_cast<volatile uint32_t*>(fail) == 0u) net_dispatch_finish(p, epoch);
      __syncthreads();
      if (threadIdx.x == 0) {
        *fail = 0u;
        *p.op_counter = epoch;
        p.seq[0] = seq;
      }
    }
  }
  tl_mark(kTlDispatch, kTlSendCounted);
}

/// Network transports: this op's count of its kind (dispatches: [0],
/// combines: [1]), what the receivers' signals reach; 0 otherwise.
template <class T>
__device__ __forceinline__ uint64_t next_seq(const uint64_t* counter) {
  if constexpr (kNet<T>) return *counter + 1;
  return 0;
}

/// Hook mode's send launch (low_latency/ops.cuh): every block sends.
template <class T>
__device__ __forceinline__ void dispatch_send_phase(const LlDispatchSendParams<T>& p) {
  tl_mark(kTlDispatch, kTlSendStart);
  tl_mark(kTlDispatch, kTlSendStartMax);
  const uint64_t seq = next_seq<T>(p.seq);
  bool send_ok = true;
  const uint32_t epoch = dispatch_begin(p, seq, true, send_ok);
  if (send_ok)
    dispatch_send_items(p, epoch, blockIdx.x * kWarps + threadIdx.x / 32, gridDim.x * kWarps);
  dispatch_count_done(p, epoch, seq, !send_ok);
}

/// The receive's row copies: rows i in [0, n_rows) of local expert le, row_of(i)
/// = {packed row j, source s, token t}, in units of (row, 2 KiB segment), each
/// after the arrival flags of its chunks. False (for this thread) when a wait
/// failed (reported); the caller combines the block's answers.
/// Warps first_warp, first_warp + warp_stride, ... take the units.
template <class RowOf, class T>
__device__ __forceinline__ bool copy_rows(const LlDispatchRecvParams<T>& p, uint32_t epoch, int le,
                                          int n_rows, RowOf row_of, int first_warp = -1,
                                          int warp_stride = kWarps) {
  const int lane = threadIdx.x % 32;
  const int warp = first_warp >= 0 ? first_warp : static_cast<int>(threadIdx.x / 32);
  const int R = p.t.num_ranks, RT = R * p.max_tokens, H = p.hidden;
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  const std::size_t tags = tags_of(p.off, epoch);
  // Rows: work units of (row, 2 KiB segment = 128 int4, 4 per lane), so that
  // the few rows of an expert spread over all warps of its blocks. A segment
  // holds 4 FP8 chunks (512 B each, with their 16 scales) or 2 BF16 chunks.
  const int out_row_bytes = p.fp8 ? H : 2 * H;
  const int n16 = out_row_bytes / 16;
  const int segs = ceil_div(n16, 128);
  const int C = ceil_div(H, kDispatchChunk);
  const int seg_chunks = p.fp8 ? 4 : 2;
  const int G = H / 128, G4 = (G + 3) / 4;
  bool all_ok = true;
  for (int u = warp; u < n_rows * segs; u += warp_stride) {
    const int i = u / segs, seg = u % segs;
    const int3 row = row_of(i);
    const int j = row.x, s = row.y, t = row.z;
    const int c = seg * seg_chunks + lane;
    bool arrived = true;
    // A source in another node sent no chunk flags: its dispatch signal,
    // awaited before its token masks, covers its rows.
    bool flagged = true;
    if constexpr (kNet<T>) flagged = p.t.same_node(s);
    if (lane < seg_chunks && c < C && flagged)
      arrived = p.t.wait_flag_eq(chunk_flag_offset(p.off, tags, s, t, c), epoch, p.timeout_ns,
                                 p.diag, OpId::kLowLatencyDispatchRecv, s, le);
    // Shrink: a source masked after its token mask came (it stopped mid-op)
    // leaves zeros in its rows.
    const bool gone = !__all_sync(kFull, arrived) && __any_sync(kFull, p.t.masked(s));
    if (!gone && !__all_sync(kFull, arrived)) {
      all_ok = false;
      break;
    }
    __syncwarp();  // the waiting lanes' acquires before every lane's loads
    const char* src = p.t.local_ptr(half + p.off.disp_rows +
                                    (static_cast<std::size_t>(s) * p.max_tokens + t) * p.row_bytes);
    uint8_t* dst = p.recv_x + (static_cast<int64_t>(le) * RT + j) * out_row_bytes;
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    const int c0 = seg * 128 + lane;
    int4 v4[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      v4[q] = c0 + 32 * q < n16 && !gone ? dev::ld_l2(s4 + c0 + 32 * q) : make_int4(0, 0, 0, 0);
    // The scales of this segment's 16 groups load with its data.
    const float* sc = reinterpret_cast<const float*>(src + H);
    const int g = 16 * seg + lane;
    float s1 = 0.0f;
    if (p.fp8 && !p.ue8m0 && lane < 16 && g < G && !gone) s1 = __ldcg(sc + g);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (c0 + 32 * q < n16) d4[c0 + 32 * q] = v4[q];
    if (p.fp8 && !p.ue8m0) {
      if (lane < 16 && g < G)
        static_cast<float*>(p.recv_scales)[(static_cast<int64_t>(le) * G + g) * RT + j] = s1;
    } else if (p.fp8) {
      const int q = 4 * seg + lane;  // packed word q holds groups 4q .. 4q+3
      if (lane < 4 && q < G4) {
        uint32_t packed = 0;
        for (int b = 0; b < 4; ++b) {
          const int gg = 4 * q + b;
          const uint32_t byte =
              gg < G && !gone ? (__float_as_uint(__ldcg(sc + gg)) >> 23) & 0xffu : 0u;
          packed |= byte << (8 * b);
        }
        static_cast<int32_t*>(p.recv_scales)[(static_cast<int64_t>(le) * G4 + q) * RT + j] =
            static_cast<int32_t>(packed);
      }
    }
  }
  return all_ok;
}

}  // namespace
}  // namespace epx::kernels
