// kernels/intranode/combine.cuh - the combine: rows back to their sources,
// reduced per token in rank order.
#pragma once

#include "kernels/intranode/common.cuh"

namespace epx::kernels {
namespace {

/// kMaxN: most ranks a token can come back from (R); kSeg: 256-channel
/// segments per reduction pass (registers: kMaxN * kSeg * 4).
template <int kMaxN, int kSeg, class T>
__device__ __forceinline__ void combine_body(const HtCombineParams<T>& p, uint32_t epoch) {
  const int R = p.t.num_ranks, me = p.t.rank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int K = p.num_topk, H = p.hidden;
  const int row_payload = 2 * H;
  const int send_warps = p.num_send_blocks * kWarps;
  auto chunk_of = [&](int rows) { return plan::ht_pair_chunk(rows, p.off.chunk, send_warps, R); };

  // The rings this block uses, one per peer: a sender's in the peer's
  // staging (its rows: what the peer sent me), a receiver's in mine (as many
  // rows as I sent the peer). s_laps: some ring laps. (Kept in shared memory:
  // recomputed per chunk they spill registers.)
  const bool sender = static_cast<int>(blockIdx.x) < p.num_send_blocks;
  __shared__ Ring s_ring[plan::kHtMaxRanks];
  __shared__ int s_laps;
  if (threadIdx.x == 0) s_laps = 0;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < R && static_cast<int>(threadIdx.x) != me) {
    const int r = threadIdx.x;
    const int n = sender ? p.recv_offsets[r + 1] - p.recv_offsets[r] : p.send_counts[r];
    uint8_t* staging = reinterpret_cast<uint8_t*>(sender ? p.t.lsa_ptr(r, p.off.staging)
                                                         : p.t.local_ptr(p.off.staging));
    s_ring[r] = ring_of(
        p, staging,
        sender ? plan::HtRegion::staging_index(me, r) : plan::HtRegion::staging_index(r, me), n,
        chunk_of(n));
    if (s_ring[r].chunks > s_ring[r].slots) atomicOr(&s_laps, 1);
  }
  __syncthreads();

  if (sender) {
    // ---------------- send: my rows for source s go back to s ----------------
    if (R == 1 || !peers_reached(p, epoch, OpId::kCombineNotify, lane)) return;
    const int gw = blockIdx.x * kWarps + warp, nw = p.num_send_blocks * kWarps;
    for_each_send_chunk(
        R, me, gw, nw, s_laps != 0, [&](int dst) { return s_ring[dst].chunks; },
        [&](int dst, int j) {
          const Ring& g = s_ring[dst];
          if (!slot_free(p, g, dst, j, epoch, OpId::kCombineSlot)) return false;
          const int count = p.recv_offsets[dst + 1] - p.recv_offsets[dst];
          const int k0 = j * g.ch, k1 = min(count, k0 + g.ch);
          uint8_t* out_rows = g.row(k0, p.off.row_bytes);
          const int row0 = p.recv_offsets[dst] + k0;  // row of x for k0
          const uint8_t* in_rows =
              reinterpret_cast<const uint8_t*>(p.x + row0 * static_cast<int64_t>(H));
          // Rows past x (a truncated num_worst_tokens dispatch) go back as zeros.
          const int n_in = max(0, min(k1 - k0, p.num_x_rows - row0));
          for (int r = 0; r < k1 - k0; ++r) {
            uint8_t* out = out_rows + static_cast<int64_t>(r) * p.off.row_bytes;
            if (r < n_in)
              warp_copy<false, kSendU>(out, in_rows + static_cast<int64_t>(r) * row_payload,
                                       row_payload, lane);
            else
              warp_zero(out, row_payload, lane);
          }
          if (p.topk_weights) {
            const float* w = p.topk_weights + row0 * static_cast<int64_t>(K);
            move_extras(
                k1 - k0, K,
                [&](int r, int i) { return r < n_in ? __float_as_int(__ldg(w + r * K + i)) : 0; },
                [&](int r, int i, int v) {
                  reinterpret_cast<int*>(out_rows + static_cast<int64_t>(r) * p.off.row_bytes +
                                         row_payload)[i] = v;
                },
                lane);
          }
          // A full fence per lane stays here: without it combine measured slower.
          __threadfence_system();
          __syncwarp();
          if (lane == 0)
            p.t.lsa_flag(dst,
                         p.off.flags + 4 * (static_cast<std::size_t>(me) * p.off.max_chunks + j),
                         epoch);
          return true;
        });
    return;
  }

  // ---------------- receive: reduce each token over the ranks it went to ----------------
  const int gw = (blockIdx.x - p.num_send_blocks) * kWarps + warp;
  const int nw = (gridDim.x - p.num_send_blocks) * kWarps;
  // Lane r: the last chunk from rank r this warp has waited for (one register,
  // not an array of kMaxRanks).
  int ready_chunk = -1;
  // Lane r < R holds the token's (is it in rank r, slot there); the next
  // token's pair is loaded before this one is reduced.
  auto load_meta = [&](int t, int& in, int& slot) {
    in = 0;
    slot = 0;
    if (t < p.num_tokens && lane < R) {
      in = p.is_token_in_rank[static_cast<int64_t>(t) * R + lane] ? 1 : 0;
      slot = p.send_slot[static_cast<int64_t>(t) * R + lane];
    }
  };
  // Tokens gw, gw + nw, ...: all warps work on one window of consecutive
  // tokens, which follows the senders' chunk order. (Groups of 4 or 8
  // consecutive tokens per warp, to share chunk flags, measured 8% and 26%
  // slower at EP2.)
  int in_cur, slot_cur;
  load_meta(gw, in_cur, slot_cur);
  for (int t = gw; t < p.num_tokens; t += nw) {
    int in_next, slot_next;
    load_meta(t + nw, in_next, slot_next);
    const uint8_t* rows[kMaxN];
    const float* wrows[kMaxN];
    int n = 0;
    bool ok = true;
    for (int r = 0; r < R; ++r) {
      if (!__shfl_sync(kFull, in_cur, r)) continue;
      const int k = __shfl_sync(kFull, slot_cur, r);
      if (r == me) {
        const int64_t row = p.recv_offsets[me] + k;
        if (row >= p.num_x_rows) continue;  // truncated dispatch: contributes nothing
        rows[n] = reinterpret_cast<const uint8_t*>(p.x + row * H);
        wrows[n] = p.topk_weights ? p.topk_weights + row * K : nullptr;
      } else {
        const Ring& g = s_ring[r];
        const int j = k / g.ch;
        if (__shfl_sync(kFull, ready_chunk, r) < j) {
          ok = p.t.wait_flag_warp(
              p.off.flags + 4 * (static_cast<std::size_t>(r) * p.off.max_chunks + j), epoch,
              p.timeout_ns, p.diag, OpId::kCombine, r, j);
          if (lane == r) ready_chunk = j;
        }
        const uint8_t* row_in = g.row(k, p.off.row_bytes);
        rows[n] = row_in;
        wrows[n] = p.topk_weights ? reinterpret_cast<const float*>(row_in + row_payload) : nullptr;
      }
      ++n;
      if (!ok) return;
    }
    in_cur = in_next;
    slot_cur = slot_next;
    uint16_t* out = p.combined_x + static_cast<int64_t>(t) * H;
    const uint16_t* b0 = p.bias0 ? p.bias0 + static_cast<int64_t>(t) * H : nullptr;
    const uint16_t* b1 = p.bias1 ? p.bias1 + static_cast<int64_t>(t) * H : nullptr;
    // kSeg 8-channel segments per lane per pass; every contributing row's
    // loads of the pass are issued before the first add. Sum in rank order,
    // then the biases (the reference's order).
    for (int c0 = lane * 8; c0 < H; c0 += kSeg * 32 * 8) {
      int4 v[kMaxN][kSeg];
#pragma unroll
      for (int i = 0; i < kMaxN; ++i) {
#pragma unroll
        for (int g = 0; g < kSeg; ++g) {
          const int c = c0 + g * 256;
          if (i < n && c < H) v[i][g] = dev::ld_l2(reinterpret_cast<const int4*>(rows[i] + 2 * c));
        }
      }
#pragma unroll
      for (int g = 0; g < kSeg; ++g) {
        const int c = c0 + g * 256;
        if (c >= H) break;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int i = 0; i < kMaxN; ++i)
          if (i < n) accumulate_bf16x8(acc, v[i][g]);
        if (b0) accumulate_bf16x8(acc, *reinterpret_cast<const int4*>(b0 + c));
        if (b1) accumulate_bf16x8(acc, *reinterpret_cast<const int4*>(b1 + c));
        dev::st_na(reinterpret_cast<int4*>(out + c), pack_bf16x8(acc));
      }
    }
    if (p.combined_topk_weights && lane < K) {
      float w = 0.f;
      for (int i = 0; i < n; ++i) w += wrows[i] ? wrows[i][lane] : 0.f;
      p.combined_topk_weights[static_cast<int64_t>(t) * K + lane] = w;
    }
    // Rows of chunks whose slot a later chunk of the pair reuses are counted;
    // the chunk's last row gives the slot back (lane r for rank r).
    if (s_laps) {  // (shared memory and reloaded routing: no registers held over the loop)
      __syncwarp();
      int in_t, slot_t;
      load_meta(t, in_t, slot_t);
      if (lane < R && lane != me && in_t) {
        const Ring& g = s_ring[lane];
        const int j = slot_t / g.ch;
        if (g.lapped(j)) row_consumed(p, lane, j, g.ch, epoch);
      }
    }
  }
}

template <int kMaxN, int kSeg, class T>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(HtCombineParams<T> p) {
  const uint32_t epoch = op_begin(p);
  combine_body<kMaxN, kSeg>(p, epoch);
  op_end(p, epoch);
}

}  // namespace
}  // namespace epx::kernels
