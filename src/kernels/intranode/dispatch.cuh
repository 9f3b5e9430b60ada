// kernels/intranode/dispatch.cuh - the push dispatch: senders store chunks of
// rows into each peer's ring, receivers move them into recv_x in rank order.
#pragma once

#include "kernels/intranode/common.cuh"

namespace epx::kernels {
namespace {

template <class T>
__device__ __forceinline__ void dispatch_body(const HtDispatchParams<T>& p, uint32_t epoch) {
  const int R = p.t.num_ranks, me = p.t.rank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int K = p.num_topk, epr = p.num_experts > 0 ? p.num_experts / R : 0;
  const int extras = p.num_scales + 2 * K + 1;  // 4-byte words after the payload
  const int send_warps = p.num_send_blocks * kWarps;
  auto chunk_of = [&](int rows) { return plan::ht_pair_chunk(rows, p.off.chunk, send_warps, R); };

  // Rows [b0, b0 + nb) of the send list to `dst`, one token id per lane.
  auto token_ids = [&](int dst, int b0, int nb) {
    return lane < nb ? __ldg(p.send_list + static_cast<int64_t>(dst) * p.num_tokens + b0 + lane)
                     : 0;
  };

  if (static_cast<int>(blockIdx.x) < p.num_send_blocks) {
    // ---------------- send (peers only) ----------------
    if (R == 1 || !peers_reached(p, epoch, OpId::kDispatchNotify, lane)) return;
    auto ring = [&](int dst) {
      const int n = p.send_counts[dst];
      return ring_of(p, reinterpret_cast<uint8_t*>(p.t.lsa_ptr(dst, p.off.staging)),
                     plan::HtRegion::staging_index(me, dst), n, chunk_of(n));
    };
    const int gw = blockIdx.x * kWarps + warp, nw = p.num_send_blocks * kWarps;
    // Interleaved order even when lapping: dispatch receivers consume in chunk order.
    for_each_send_chunk(
        R, me, gw, nw, false, [&](int dst) { return ring(dst).chunks; },
        [&](int dst, int j) {
          const Ring g = ring(dst);
          if (!slot_free(p, g, dst, j, epoch, OpId::kDispatchSlot)) return false;
          const int k0 = j * g.ch, k1 = min(p.send_counts[dst], k0 + g.ch);
          const int lo_e = dst * epr;
          uint8_t* rows = g.row(j * g.ch, p.off.row_bytes);
          for (int b0 = k0; b0 < k1; b0 += kBatch) {
            const int nb = min(kBatch, k1 - b0);
            const int my_t = token_ids(dst, b0, nb);
            uint8_t* batch = rows + static_cast<int64_t>(b0 - k0) * p.off.row_bytes;
            copy_token_rows<kSendU>(
                p, my_t, nb, lo_e, epr, extras,
                [&](int r) { return batch + static_cast<int64_t>(r) * p.off.row_bytes; },
                [&](int r, int i, int v) {
                  reinterpret_cast<int*>(batch + static_cast<int64_t>(r) * p.off.row_bytes +
                                         p.hidden_bytes)[i] = v;
                },
                lane);
          }
          // The warp barrier orders every lane's stores before lane 0's
          // release-store at system scope (measured: a full fence per
          // lane here costs 3-6%).
          __syncwarp();
          if (lane == 0)
            p.t.lsa_flag(dst,
                         p.off.flags + 4 * (static_cast<std::size_t>(me) * p.off.max_chunks + j),
                         epoch);
          return true;
        });
    return;
  }

  // ---------------- receive (and the rows a rank sends itself) ----------------
  int max_chunks = 0;
  for (int s = 0; s < R; ++s) {
    const int n = p.recv_offsets[s + 1] - p.recv_offsets[s];
    max_chunks = max(max_chunks, ceil_div(n, chunk_of(n)));
  }
  max_chunks = min(max_chunks, p.off.max_chunks);  // as ring_of: wrong peer counts stay in bounds
  const int gw = (blockIdx.x - p.num_send_blocks) * kWarps + warp;
  const int nw = (gridDim.x - p.num_send_blocks) * kWarps;
  uint8_t* const staging = reinterpret_cast<uint8_t*>(p.t.local_ptr(p.off.staging));
  for (int item = gw; item < max_chunks * R; item += nw) {
    const int j = item / R, src = (me + 1 + item % R) % R;
    const int n_src = p.recv_offsets[src + 1] - p.recv_offsets[src], ch = chunk_of(n_src);
    const int k0 = j * ch, k1 = min(n_src, k0 + ch);
    if (k0 >= k1) continue;
    const int64_t row0 = p.recv_offsets[src] + k0;
    if (src == me) {
      // send_list[me] holds send_counts[me] ids; the two counts differ only
      // when the caller's layout tensors disagree: never read past the list.
      const int lo_e = me * epr, k1s = min(k1, p.send_counts[me]);
      for (int b0 = k0; b0 < k1s; b0 += kBatch) {
        const int64_t out0 = p.recv_offsets[me] + b0;
        const int nb = rows_fitting(p, out0, min(kBatch, k1s - b0), me, b0, lane);
        const int my_t = token_ids(me, b0, nb);
        copy_token_rows<kRecvU>(
            p, my_t, nb, lo_e, epr, extras,
            [&](int r) { return p.recv_x + (out0 + r) * p.hidden_bytes; },
            [&](int r, int i, int v) { store_extra(p, out0 + r, i, v); }, lane);
      }
      continue;
    }
    if (!p.t.wait_flag_warp(
            p.off.flags + 4 * (static_cast<std::size_t>(src) * p.off.max_chunks + j), epoch,
            p.timeout_ns, p.diag, OpId::kDispatch, src, j))
      return;
    const Ring g = ring_of(p, staging, plan::HtRegion::staging_index(src, me), n_src, ch);
    const uint8_t* in = g.row(k0, p.off.row_bytes);
    const int n = rows_fitting(p, row0, k1 - k0, src, k0, lane);
    for (int r = 0; r < n; ++r)
      warp_copy<true, kRecvU>(p.recv_x + (row0 + r) * p.hidden_bytes,
                              in + static_cast<int64_t>(r) * p.off.row_bytes, p.hidden_bytes, lane);
    move_extras(
        n, extras,
        [&](int r, int i) {
          return __ldcg(reinterpret_cast<const int*>(
                            in + static_cast<int64_t>(r) * p.off.row_bytes + p.hidden_bytes) +
                        i);
        },
        [&](int r, int i, int v) { store_extra(p, row0 + r, i, v); }, lane);
    // Rows past num_worst_tokens were not copied, but the slot is free all the same.
    if (g.lapped(j)) {
      __syncwarp();
      if (lane == 0) give_credit(p, src, j, epoch);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(HtDispatchParams<T> p) {
  const uint32_t epoch = op_begin(p);
  dispatch_body(p, epoch);
  op_end(p, epoch);
}

}  // namespace
}  // namespace epx::kernels
