// High-throughput intranode dispatch and combine.
//
// Every rank's receive staging holds a ring of `capacity` rows per peer rank
// (plan::HtRegion). Sender warps copy whole chunks of rows (num_max_send_tokens
// at most, fewer for a pair with few rows: plan::ht_pair_chunk) straight into
// the destination's ring with NVLink stores, then release-store the chunk's
// flag there with the op's epoch. Receiver warps acquire flags and move rows
// out (dispatch: into recv_x in rank order; combine: reduce per token).
// Tokens a rank sends to itself skip the staging: in dispatch the receiver
// warps copy them (they wait for peers anyway), so sender SMs only feed NVLink.
//
// Rings: chunk j of a pair lands in slot j % slots. A pair with more chunks
// than slots laps: the receiver stores a credit (the epoch, per chunk index)
// into the sender's region once it has consumed chunk j, and the sender
// waits for the credit of chunk j - slots before it writes chunk j. Why this
// cannot deadlock:
// - dispatch: senders and receivers both take their chunks in increasing
//   chunk index over all pairs. A credit wait for chunk j needs chunk
//   j - slots consumed, whose arrival needs only sends of index <= j - slots:
//   every chain of waits strictly lowers the index, down to the first lap.
// - combine: a receiver reduces in token order, and a token needs a chunk of
//   every rank it went to, whatever their indices. So a sender that may wait
//   for credits gives each destination its own warps (a warp never holds one
//   pair's chunk while it waits on another's credit); then every wait at a
//   receiver is for its own tokens of lower index, and chains end again.
//   Senders whose pairs all fit their rings never wait and keep the
//   interleaved order (which spreads uneven pairs over all warps).
// Both arguments, like the protocol without laps (a rank's receivers wait for
// its peers' senders, whose receivers wait for this rank's senders), need
// every block of each rank's kernel resident at once: one block per SM,
// num_sms within the SMs the rank may use. MPS or green-context limits below
// num_sms, or another persistent kernel holding SMs, stall the op until its
// deadline, which reports it.
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

// The high-throughput kernels run within one node: they are instantiated for
// the node's load/store view (dev::node_view) of whatever transport the
// backend gave. Kernels across nodes are a later family.
void launch_ht_dispatch(const dev::AnyTransport& t, const HtDispatchArgs& a, int num_blocks,
                        cudaStream_t stream) {
  HtDispatchParams<dev::LsaTransport> p{};
  static_cast<HtDispatchArgs&>(p) = a;
  p.t = dev::require_node_view(t, "high-throughput dispatch");
  if (p.pull)
    pull_dispatch_kernel<<<num_blocks, kThreads, 0, stream>>>(p);
  else
    dispatch_kernel<<<num_blocks, kThreads, 0, stream>>>(p);
  EPX_LAUNCH_CHECK();
}

void launch_ht_combine(const dev::AnyTransport& t, const HtCombineArgs& a, int num_blocks,
                       cudaStream_t stream) {
  HtCombineParams<dev::LsaTransport> p{};
  static_cast<HtCombineArgs&>(p) = a;
  p.t = dev::require_node_view(t, "high-throughput combine");
  if (p.t.num_ranks <= 2) {
    combine_kernel<2, EPX_HT_COMBINE_SEG2><<<num_blocks, kThreads, 0, stream>>>(p);
  } else if (p.t.num_ranks <= 4) {
    combine_kernel<4, 4><<<num_blocks, kThreads, 0, stream>>>(p);
  } else {
    combine_kernel<kMaxRanksPerNode, 2><<<num_blocks, kThreads, 0, stream>>>(p);
  }
  EPX_LAUNCH_CHECK();
}

void preload_ht_kernels() {
  cudaFuncAttributes a{};
  using T = dev::LsaTransport;
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, dispatch_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, pull_dispatch_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, combine_kernel<2, EPX_HT_COMBINE_SEG2, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, combine_kernel<4, 4, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, combine_kernel<kMaxRanksPerNode, 2, T>));
}

}  // namespace epx::kernels
