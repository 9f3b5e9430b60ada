// kernels/intranode/pull_dispatch.cuh - the pull dispatch (Config::pull_dispatch):
// receivers read their rows from each sender's own export ring.
#pragma once

#include "kernels/intranode/common.cuh"

namespace epx::kernels {
namespace {

// ---------------- pull dispatch (Config::pull_dispatch) ----------------
// The send blocks copy each token that some peer takes once, into this rank's
// own staging (its export ring: batch c of `batch` consecutive tokens at slot
// c % slots), then release-store one tagged word per peer and batch, in this
// rank's region: {mask of the batch's tokens the peer takes | that peer's
// slot of the first << 8, epoch}. Receivers read the word and the rows they
// take straight from the sender's ring into recv_x (NVLink loads): no staging
// copy on the receiving side, and a token leaves its sender's HBM once per
// taker. Every peer, once done with a batch whose slot a later batch reuses
// (rows taken or none), stores a credit into the sender's region; the sender
// waits for every peer's credit of batch c - slots before it writes batch c.
// Deadlock-free as the push dispatch: senders and receivers both take batches
// in increasing index, so every chain of waits lowers the index. The rank's own rows go from x to
// recv_x on the receive side, in the same batches.

struct PullRing {
  int batch, slots;
};
template <class T>
__device__ __forceinline__ PullRing pull_ring(const HtDispatchParams<T>& p) {
  const int rows = (p.t.num_ranks - 1) * p.off.capacity;
  PullRing g;
  g.batch = plan::ht_pull_batch(rows);
  g.slots = max(1, rows / g.batch);
  return g;
}

/// Offset of the word of batch c for receiver r, in the sender's region.
template <class T>
__device__ __forceinline__ std::size_t pull_word_offset(const HtDispatchParams<T>& p, int r,
                                                        int c) {
  return p.off.consumed + 8 * (static_cast<std::size_t>(r) * p.off.max_chunks + c);
}

/// Receiver r's word of batch c of this rank's tokens (without the epoch):
/// the batch's tokens r takes as a mask, and r's slot of the first << 8.
template <class T>
__device__ __forceinline__ uint32_t pull_word(const HtDispatchParams<T>& p, int c, int batch,
                                              int r) {
  const int R = p.t.num_ranks, t0 = c * batch, nt = min(batch, p.num_tokens - t0);
  uint32_t mask = 0;
  int first = 0;
  for (int i = nt - 1; i >= 0; --i) {
    const int s = __ldg(p.send_slot + static_cast<int64_t>(t0 + i) * R + r);
    if (s >= 0) {
      mask |= 1u << i;
      first = s;
    }
  }
  return mask | (static_cast<uint32_t>(first) << 8);
}

/// Position of the (n + 1)-th set bit of m (m has more than n set bits).
__device__ __forceinline__ int nth_set_bit(uint32_t m, int n) {
  for (int i = 0; i < n; ++i) m &= m - 1;
  return __ffs(static_cast<int>(m)) - 1;
}

template <class T>
__device__ __forceinline__ void pull_export(const HtDispatchParams<T>& p, uint32_t epoch, int gw,
                                            int nw, int lane) {
  const int R = p.t.num_ranks, me = p.t.rank;
  const PullRing g = pull_ring(p);
  const int nb = min(ceil_div(p.num_tokens, g.batch), p.off.max_chunks);
  const int extras = p.num_scales + 2 * p.num_topk + 1;
  const std::size_t rb = p.off.row_bytes;
  uint8_t* const ring = reinterpret_cast<uint8_t*>(p.t.local_ptr(p.off.staging));
  const bool peer_lane = lane < R && lane != me;
  for (int c = gw; c < nb; c += nw) {
    if (c >= g.slots) {
      // Every peer is done with the slot's last batch: it credits every batch
      // it has read the word of, rows or none. (Waiting only for the peers
      // that took rows of it broke the chain when none did: a batch no peer
      // takes would let batch c overwrite batch c - 2 slots while a peer still
      // reads it.)
      const int old = c - g.slots;
      bool ok = true;
      if (peer_lane)
        ok = p.t.wait_flag_eq(credit_offset(p, lane, old), epoch, p.timeout_ns, p.diag,
                              OpId::kDispatchSlot, lane, old);
      if (!__all_sync(kFull, ok)) return;
      __syncwarp();  // every lane's acquire before any lane's stores into the slot
    }
    const uint32_t word = peer_lane ? pull_word(p, c, g.batch, lane) : 0u;
    const uint32_t need = __reduce_or_sync(kFull, word & 0xffu);  // tokens some peer takes
    const int n = __popc(need), t0 = c * g.batch;
    const int my_t = lane < n ? t0 + nth_set_bit(need, lane) : 0;
    uint8_t* const rows = ring + static_cast<int64_t>(c % g.slots) * g.batch * rb;
    // Top-k ids stay global (lo_e 0, all experts): each receiver rebases its own.
    copy_token_rows<kSendU>(
        p, my_t, n, 0, p.num_experts, extras,
        [&](int r) { return rows + static_cast<int64_t>(nth_set_bit(need, r)) * rb; },
        [&](int r, int i, int v) {
          reinterpret_cast<int*>(rows + static_cast<int64_t>(nth_set_bit(need, r)) * rb +
                                 p.hidden_bytes)[i] = v;
        },
        lane);
    __syncwarp();  // orders every lane's stores before the words' release
    if (peer_lane) p.t.lsa_tagged_release(me, pull_word_offset(p, lane, c), word, epoch);
  }
}

template <class T>
__device__ __forceinline__ void pull_receive(const HtDispatchParams<T>& p, uint32_t epoch, int gw,
                                             int nw, int lane) {
  const int R = p.t.num_ranks, me = p.t.rank, K = p.num_topk;
  const int epr = p.num_experts > 0 ? p.num_experts / R : 0, lo_e = me * epr;
  const int extras = p.num_scales + 2 * K + 1;
  const std::size_t rb = p.off.row_bytes;
  const PullRing g = pull_ring(p);
  // Lane s: rank s's token count, published by its send blocks.
  uint32_t tokens = static_cast<uint32_t>(p.num_tokens);
  bool ok = true;
  if (lane < R && lane != me)
    ok = p.t.wait_tagged_at(lane, p.off.exports, epoch, tokens, p.timeout_ns, p.diag,
                            OpId::kDispatch, -1);
  if (!__all_sync(kFull, ok)) return;
  int nb = 0;
  for (int s = 0; s < R; ++s)
    nb = max(nb, ceil_div(static_cast<int>(__shfl_sync(kFull, tokens, s)), g.batch));
  nb = min(nb, p.off.max_chunks);  // as the senders: wrong counts stay in bounds
  for (int item = gw; item < nb * R; item += nw) {
    const int c = item / R, src = (me + 1 + item % R) % R;
    const int t0 = c * g.batch;
    const int n_tok = static_cast<int>(__shfl_sync(kFull, tokens, src));
    if (t0 >= n_tok) continue;
    uint32_t word = 0;
    if (src == me) {
      word = pull_word(p, c, g.batch, me);
    } else {
      int okw = 1;
      if (lane == 0)
        okw = p.t.wait_tagged_at(src, pull_word_offset(p, me, c), epoch, word, p.timeout_ns, p.diag,
                                 OpId::kDispatch, c);
      okw = __shfl_sync(kFull, okw, 0);
      word = __shfl_sync(kFull, word, 0);
      __syncwarp();  // lane 0's acquire before every lane's loads of the rows
      if (!okw) return;
    }
    const uint32_t mask = word & 0xffu;
    // The sender waits for this credit before it reuses the slot (see pull_export).
    const bool credit = src != me && c + g.slots < ceil_div(n_tok, g.batch);
    if (mask == 0) {
      if (credit && lane == 0) give_credit(p, src, c, epoch);
      continue;
    }
    const int k0 = static_cast<int>(word >> 8);
    const int n_src = p.recv_offsets[src + 1] - p.recv_offsets[src];
    const int64_t row0 = p.recv_offsets[src] + k0;
    const int n = rows_fitting(p, row0, min(__popc(mask), max(0, n_src - k0)), src, k0, lane);
    if (src == me) {
      const int my_t = lane < n ? t0 + nth_set_bit(mask, lane) : 0;
      copy_token_rows<kRecvU>(
          p, my_t, n, lo_e, epr, extras,
          [&](int r) { return p.recv_x + (row0 + r) * p.hidden_bytes; },
          [&](int r, int i, int v) { store_extra(p, row0 + r, i, v); }, lane);
      continue;
    }
    const uint8_t* rows = reinterpret_cast<const uint8_t*>(p.t.lsa_ptr(src, p.off.staging)) +
                          static_cast<int64_t>(c % g.slots) * g.batch * rb;
    for (int r = 0; r < n; ++r)
      warp_copy<true, kRecvU>(p.recv_x + (row0 + r) * p.hidden_bytes,
                              rows + static_cast<int64_t>(nth_set_bit(mask, r)) * rb,
                              p.hidden_bytes, lane);
    move_extras(
        n, extras,
        [&](int r, int i) {
          const int w =
              __ldcg(reinterpret_cast<const int*>(
                         rows + static_cast<int64_t>(nth_set_bit(mask, r)) * rb + p.hidden_bytes) +
                     i);
          const int k = i - p.num_scales;  // top-k ids come global: rebase to mine
          if (k >= 0 && k < K) return w >= lo_e && w < lo_e + epr ? w - lo_e : -1;
          if (k >= K && k < 2 * K) {  // a weight: 0 unless its pick's expert is mine
            const int e = __ldcg(
                reinterpret_cast<const int*>(
                    rows + static_cast<int64_t>(nth_set_bit(mask, r)) * rb + p.hidden_bytes) +
                i - K);
            return e >= lo_e && e < lo_e + epr ? w : 0;
          }
          return w;
        },
        [&](int r, int i, int v) { store_extra(p, row0 + r, i, v); }, lane);
    // Rows past num_worst_tokens were not copied, but the slot is free all the same.
    if (credit) {
      __syncwarp();
      if (lane == 0) give_credit(p, src, c, epoch);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) pull_dispatch_kernel(HtDispatchParams<T> p) {
  const uint32_t epoch = op_begin(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (static_cast<int>(blockIdx.x) < p.num_send_blocks) {
    // My ring is read by peers until they have reached this op: wait for them.
    if (p.t.num_ranks > 1 && peers_reached(p, epoch, OpId::kDispatchNotify, lane)) {
      if (blockIdx.x == 0 && warp == 0 && lane == 0)
        p.t.lsa_tagged(p.t.rank, p.off.exports, static_cast<uint32_t>(p.num_tokens), epoch);
      pull_export(p, epoch, blockIdx.x * kWarps + warp, p.num_send_blocks * kWarps, lane);
    }
  } else {
    pull_receive(p, epoch, (blockIdx.x - p.num_send_blocks) * kWarps + warp,
                 (gridDim.x - p.num_send_blocks) * kWarps, lane);
  }
  op_end(p, epoch);
}

}  // namespace
}  // namespace epx::kernels
