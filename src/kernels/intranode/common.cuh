// kernels/intranode/common.cuh - what the high-throughput kernels within one
// node share: block geometry, the rings' arithmetic, the op's epoch, the
// row and extras copies (the protocol: intranode.cu's header).
#pragma once

#include "common/check.hpp"
#include "kernels/bf16.cuh"
#include "kernels/copy.cuh"
#include "kernels/kernels.hpp"

namespace epx::kernels {
namespace {

constexpr int kThreads = 512;
// Vectors in flight per lane in a warp copy: senders (NVLink stores) and
// receivers (local copies: staging or x into recv_x). Measured at EP2
// (nvidia-h200-x2): receivers at 16 instead of 8 cut the dispatch by 3-4%;
// senders at 16 spill and gain nothing. The combine at R <= 2 reduces 8
// segments per pass (two rows in flight instead of four). The macros exist
// for A/B builds (-DEPX_HT_RECV_U=8 ...).
#ifndef EPX_HT_SEND_U
#define EPX_HT_SEND_U 8
#endif
#ifndef EPX_HT_RECV_U
#define EPX_HT_RECV_U 16
#endif
#ifndef EPX_HT_COMBINE_SEG2
#define EPX_HT_COMBINE_SEG2 8
#endif
constexpr int kSendU = EPX_HT_SEND_U, kRecvU = EPX_HT_RECV_U;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

/// Warp-cooperative zero fill of `bytes` (multiple of 16).
__device__ __forceinline__ void warp_zero(uint8_t* dst, int bytes, int lane) {
  auto* d = reinterpret_cast<int4*>(dst);
  for (int i = lane; i < bytes / 16; i += 32) dev::st_na(d + i, make_int4(0, 0, 0, 0));
}

__device__ __forceinline__ int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

/// The ring of a (source, receiver) pair in the receiver's staging: chunk j
/// of `ch` rows starts at row (j % slots) * ch of the pair's area, so row k
/// of the pair sits at row k % (slots * ch).
struct Ring {
  uint8_t* area;  ///< the pair's area (capacity rows)
  int ch, slots, chunks, span;
  __device__ __forceinline__ uint8_t* row(int k, std::size_t row_bytes) const {
    return area + static_cast<int64_t>(k % span) * static_cast<int64_t>(row_bytes);
  }
  /// Whether the receiver owes the sender a credit for chunk j: a later chunk reuses its slot.
  __device__ __forceinline__ bool lapped(int j) const { return j + slots < chunks; }
};

template <class P>
__device__ __forceinline__ Ring ring_of(const P& p, uint8_t* staging, int area, int rows, int ch) {
  Ring g;
  g.area = staging + static_cast<int64_t>(area) * p.off.capacity * p.off.row_bytes;
  g.ch = ch;
  g.slots = plan::HtRegion::ring_slots(p.off.capacity, ch);
  // Never past the flag and credit areas, even when a peer's counts are wrong
  // (an inconsistent layout with num_worst_tokens, which has no host check
  // before the kernel): rows past it are not moved, and the notify kernel
  // reports the layout.
  g.chunks = min(ceil_div(rows, ch), p.off.max_chunks);
  g.span = g.slots * ch;
  return g;
}

/// Credit word of chunk j of the pair (me -> dst), in the sender's region.
template <class P>
__device__ __forceinline__ std::size_t credit_offset(const P& p, int dst, int j) {
  return p.off.credits + 4 * (static_cast<std::size_t>(dst) * p.off.max_chunks + j);
}

/// A sender warp, before it writes chunk j of a pair into `dst`'s ring: waits
/// until `dst` has consumed the chunk that last used the slot. False when the
/// wait failed.
template <class P>
__device__ __forceinline__ bool slot_free(const P& p, const Ring& g, int dst, int j, uint32_t epoch,
                                          OpId op) {
  if (j < g.slots) return true;
  return p.t.wait_flag_warp(credit_offset(p, dst, j - g.slots), epoch, p.timeout_ns, p.diag, op,
                            dst, j - g.slots);
}

/// A receiver, once chunk j from `src` is consumed (every lane's loads of it
/// done: call after a warp barrier, on one lane): lets `src` reuse the slot.
template <class P>
__device__ __forceinline__ void give_credit(const P& p, int src, int j, uint32_t epoch) {
  p.t.lsa_flag(src, credit_offset(p, p.t.rank, j), epoch);
}

/// A combine receiver lane, after its warp reduced a row of chunk j from
/// `src` (after a warp barrier): counts the row in a word tagged with the
/// op's epoch (so a word an earlier, failed op left behind counts from zero);
/// the chunk's last row gives the slot back.
template <class P>
__device__ __forceinline__ void row_consumed(const P& p, int src, int j, int ch, uint32_t epoch) {
  __threadfence();  // the warp's loads of the row come before the count that covers them
  auto* w = reinterpret_cast<unsigned long long*>(p.t.local_ptr(p.off.consumed)) +
            static_cast<std::size_t>(src) * p.off.max_chunks + j;
  unsigned long long old = *reinterpret_cast<volatile unsigned long long*>(w), next;
  while (true) {
    next = static_cast<uint32_t>(old >> 32) == epoch
               ? old + 1
               : (static_cast<unsigned long long>(epoch) << 32) | 1ull;
    const unsigned long long seen = atomicCAS(w, old, next);
    if (seen == old) break;
    old = seen;
  }
  if (static_cast<int>(static_cast<uint32_t>(next)) == ch) {
    __threadfence();
    give_credit(p, src, j, epoch);
  }
}

/// The chunks a sender sends, in an order that cannot deadlock with credits
/// (see the top of the file): body(dst, j) for every chunk j of every peer
/// dst, as warp gw of nw; stops when body returns false. num_chunks(dst) and
/// laps(dst) describe the pair.
template <class NumChunks, class Body>
__device__ __forceinline__ void for_each_send_chunk(int R, int me, int gw, int nw, bool own_warps,
                                                    NumChunks num_chunks, Body body) {
  // One loop, one inlined body, for both orders (two bodies spill registers).
  // Interleaved: item i -> (chunk i / (R - 1), peer i % (R - 1)). Own warps:
  // destination gw / per gets warps [d * per, (d + 1) * per) (nw >= 16 > R - 1;
  // leftover warps idle), which take its chunks round-robin.
  const int per = nw / (R - 1), own_dst = (me + 1 + gw / per) % R;
  int end = 0;
  if (own_warps) {
    end = gw / per < R - 1 ? num_chunks(own_dst) : 0;
  } else {
    for (int r = 0; r < R; ++r)
      if (r != me) end = max(end, num_chunks(r));
    end *= R - 1;
  }
  const int stride = own_warps ? per : nw;
  for (int i = own_warps ? gw % per : gw; i < end; i += stride) {
    const int j = own_warps ? i : i / (R - 1);
    const int dst = own_warps ? own_dst : (me + 1 + i % (R - 1)) % R;
    if (j < num_chunks(dst) && !body(dst, j)) return;
  }
}

/// How many of `n` rows starting at output row `row0` fit the outputs; fewer
/// (reported once) only when num_worst_tokens was too small.
template <class T>
__device__ __forceinline__ int rows_fitting(const HtDispatchParams<T>& p, int64_t row0, int n,
                                            int src, int slot, int lane) {
  if (row0 + n <= p.max_recv_rows) return n;
  if (lane == 0)
    dev::report(p.diag, DiagCode::kTooManyTokens, OpId::kDispatch, p.t.rank, src, slot,
                p.max_recv_rows, static_cast<uint32_t>(row0 + n - 1));
  return p.max_recv_rows > row0 ? static_cast<int>(p.max_recv_rows - row0) : 0;
}

/// The op's epoch (see the comment above HtDispatchParams). With its own barrier, block 0 tells
/// every rank that this rank has reached the op: its previous op's kernel
/// has finished, so peers may write into its staging.
template <class P>
__device__ __forceinline__ uint32_t op_begin(const P& p) {
  // After a notify kernel the counter holds the epoch already (never 0, so
  // next_epoch(counter - 1) gives it back).
  const uint32_t epoch =
      plan::next_epoch(*p.op_counter - 1u + static_cast<uint32_t>(p.own_barrier));
  if (p.own_barrier && blockIdx.x == 0 && static_cast<int>(threadIdx.x) < p.t.num_ranks) {
    publish_config(p.t, p.off, threadIdx.x, epoch);  // the flag's release store publishes it
    p.t.lsa_flag(threadIdx.x, p.off.barrier + 4 * static_cast<std::size_t>(p.t.rank), epoch);
  }
  return epoch;
}

/// A sender warp, before its first store into a peer: with the op's own
/// barrier, waits until every peer has reached this op (lane r polls rank
/// r's flag; the warp barrier orders the other lanes' later stores after the
/// acquires); then checks that every peer's config fingerprint (stored before
/// its flag, by this kernel or by the notify kernel) is this rank's. False
/// when a wait failed or a peer's config differs (reported: kBadConfig ends
/// every wait of the launch, on both ranks, since each checks the other).
template <class P>
__device__ __forceinline__ bool peers_reached(const P& p, uint32_t epoch, OpId op, int lane) {
  bool ok = true;
  if (p.own_barrier && lane < p.t.num_ranks && lane != p.t.rank)
    ok = p.t.wait_flag(p.off.barrier + 4 * static_cast<std::size_t>(lane), epoch, p.timeout_ns,
                       p.diag, op, lane, -1);
  if (ok && lane < p.t.num_ranks && lane != p.t.rank)
    ok = config_matches(p.t, p.off, epoch,
                        op == OpId::kDispatchNotify ? OpId::kDispatch : OpId::kCombine, lane,
                        p.diag);
  const bool all = __all_sync(kFull, ok);
  __syncwarp();
  return all;
}

/// Every block once, at its end (also after a failed wait): with the op's own
/// barrier the last one resets the count and publishes the epoch to the next op.
template <class P>
__device__ __forceinline__ void op_end(const P& p, uint32_t epoch) {
  if (!p.own_barrier) return;
  __syncthreads();
  if (threadIdx.x == 0 && dev::last_block_done(p.done_blocks)) *p.op_counter = epoch;
}

/// Rows of a chunk go through a warp in batches of up to 32 (one token id per lane).
constexpr int kBatch = 32;
/// Extra words a lane loads before it stores any (hides their latency).
constexpr int kExtraDepth = 8;

/// Word i of a row's extras (FP8 scales, local top-k ids, top-k weights,
/// source index) for token t sent to the rank whose experts start at lo_e.
template <class T>
__device__ __forceinline__ int extra_word(const HtDispatchParams<T>& p, int t, int i, int lo_e,
                                          int epr) {
  const int K = p.num_topk;
  if (i < p.num_scales)
    return __float_as_int(
        __ldg(p.x_scales + t * p.scale_stride_token + i * p.scale_stride_channel));
  i -= p.num_scales;
  if (i < K) {
    const int64_t e = p.topk_idx ? __ldg(p.topk_idx + static_cast<int64_t>(t) * K + i) : -1;
    return (e >= lo_e && e < lo_e + epr) ? static_cast<int>(e - lo_e) : -1;
  }
  i -= K;
  if (i < K) {
    // As DeepEP: the weight of a pick whose expert lives on another rank is 0
    // (weights always come with ids), so a combine of the received weights
    // gives back each token's own.
    if (!p.topk_weights) return 0;
    const int64_t e = __ldg(p.topk_idx + static_cast<int64_t>(t) * K + i);
    return e >= lo_e && e < lo_e + epr
               ? __float_as_int(__ldg(p.topk_weights + static_cast<int64_t>(t) * K + i))
               : 0;
  }
  return t;
}

/// Stores word i of output row `row`'s extras into the recv_* outputs.
template <class T>
__device__ __forceinline__ void store_extra(const HtDispatchParams<T>& p, int64_t row, int i,
                                            int v) {
  const int K = p.num_topk;
  if (i < p.num_scales) {
    p.recv_scales[row * p.num_scales + i] = __int_as_float(v);
    return;
  }
  i -= p.num_scales;
  if (i < K) {
    if (p.recv_topk_idx) p.recv_topk_idx[row * K + i] = v;
    return;
  }
  i -= K;
  if (i < K) {
    if (p.recv_topk_weights) p.recv_topk_weights[row * K + i] = __int_as_float(v);
    return;
  }
  p.recv_src_idx[row] = v;
}

/// Moves the extras of `n` rows, `extras` words each: word w of the batch
/// comes from get(r, i) and goes to put(r, i, v). Each lane loads
/// kExtraDepth words before storing any; lanes past the end load the last
/// word again (in bounds) and store nothing. get/put are called with the same
/// control flow on every lane (get may shuffle).
template <class Get, class Put>
__device__ __forceinline__ void move_extras(int n, int extras, Get get, Put put, int lane) {
  const int total = n * extras;
  for (int base = 0; base < total; base += 32 * kExtraDepth) {
    int v[kExtraDepth];
#pragma unroll
    for (int u = 0; u < kExtraDepth; ++u) {
      const int w = min(base + 32 * u + lane, total - 1), r = w / extras;
      v[u] = get(r, w - r * extras);
    }
#pragma unroll
    for (int u = 0; u < kExtraDepth; ++u) {
      const int w = base + 32 * u + lane, r = w / extras;
      if (w < total) put(r, w - r * extras, v[u]);
    }
  }
}

/// Copies the rows of `nb` tokens of x (ids one per lane in my_t) to
/// dst_row(r), then their extras (routing rebased to the experts starting at
/// lo_e) to put(r, i, v). Used for peers' staging and for a rank's own rows.
template <int kU, class DstRow, class Put, class T>
__device__ __forceinline__ void copy_token_rows(const HtDispatchParams<T>& p, int my_t, int nb,
                                                int lo_e, int epr, int extras, DstRow dst_row,
                                                Put put, int lane) {
  for (int r = 0; r < nb; ++r) {
    const int t = __shfl_sync(kFull, my_t, r);
    warp_copy<false, kU>(dst_row(r), p.x + static_cast<int64_t>(t) * p.x_row_bytes, p.hidden_bytes,
                         lane);
  }
  move_extras(
      nb, extras,
      [&](int r, int i) { return extra_word(p, __shfl_sync(kFull, my_t, r), i, lo_e, epr); }, put,
      lane);
}

}  // namespace
}  // namespace epx::kernels
