// kernels/internode/ring_combine.cuh - the combine through the rings (docs/internode_ht.md,
// "Combine rings"): returner, forwarder, finisher, ring_combine_kernel.
#pragma once

#include "kernels/internode/combine.cuh"

namespace epx::kernels::internode {

// ---- combine through the rings -------------------------------------------------
//
// The reverse of the ring dispatch, in fixed rings (docs/internode_ht.md,
// "Combine rings"): one cooperative launch of 3 C blocks, per channel c (a
// contiguous range of each source's tokens, as the dispatch's, from the
// handle) a returner, a forwarder and a finisher. Every count comes from the
// handle, so the rings carry no headers. Each (source, channel) is a pipeline
// of its own: returner streams per (forwarder, source node), forwarder
// streams per source node, each served whenever it can move; the finisher
// takes its tokens in order, which is each input's order, so a record it
// waits for is never behind a full ring.

/// First index i in [lo, hi) with a[i] >= v (a ascending there).
__device__ __forceinline__ int lower_bound_at(const int* a, int lo, int hi, int v) {
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (a[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// Returner of channel c (every rank d): its received rows whose source token
/// lies in the source's channel c, per stream (forwarder l, source node m),
/// i.e. per source m L + l, in row order (the source's token order) into
/// return ring (c, d, m) at forwarder l; a batch of up to one row per warp
/// into whichever stream has room, the tail stored after each batch.
template <class T>
__device__ bool ring_return(const CombineParams<T>& p, const T& t, int c) {
  const plan::HtRingRegion& g = p.ring;
  const int L = g.ranks_per_node, N = g.num_nodes(), R = t.num_ranks, me = t.rank;
  const int n = me / L, dl = me % L, S = L * N;
  const uint64_t slots = static_cast<uint64_t>(g.ret_slots());
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  __shared__ int ok, total, k_now, next[kMaxRanks], left[kMaxRanks];
  __shared__ uint64_t sent[kMaxRanks], idle_since;
  if (threadIdx.x == 0) {
    ok = 1;
    total = 0;
    idle_since = dev::globaltimer_ns();
  }
  __syncthreads();
  // Rows of source src here: [rpm[src - 1][me], rpm[src][me]) in its token
  // order (within the rows that exist: num_worst_tokens may have dropped some)
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const int l = s / N, m = s % N, src = m * L + l;
    const int hi =
        min(p.rank_prefix_matrix[static_cast<std::size_t>(src) * R + me], p.num_recv_rows);
    const int lo =
        min(src > 0 ? p.rank_prefix_matrix[static_cast<std::size_t>(src - 1) * R + me] : 0, hi);
    const plan::ChannelSplit split{p.source_num_tokens[src], g.geometry.channels};
    const int a = lower_bound_at(p.recv_src_idx, lo, hi, split.first(c));
    const int b = lower_bound_at(p.recv_src_idx, a, hi, split.end(c));
    next[s] = a;
    left[s] = b - a;
    atomicAdd(&total, b - a);
    sent[s] = *reinterpret_cast<const uint64_t*>(t.local_ptr(g.ret_word(g.ret_sent, c, l, m)));
  }
  __syncthreads();
  while (ok && total > 0) {
    bool moved = false;
    for (int s = 0; ok && s < S; ++s) {
      if (left[s] == 0) continue;
      const int l = s / N, m = s % N, fwd = n * L + l;
      if (threadIdx.x == 0) {
        const uint64_t head = dev::ld_acquire_sys_u64(
            reinterpret_cast<const uint64_t*>(t.local_ptr(g.ret_word(g.ret_heads, c, l, m))));
        const uint64_t room = slots - (sent[s] - head);
        k_now = static_cast<int>(min(room, static_cast<uint64_t>(min(left[s], kRingBatch))));
      }
      __syncthreads();
      const int k = k_now;
      if (k > 0) {
        if (warp < k)
          return_row<kRingCopy>(
              p, reinterpret_cast<uint8_t*>(t.lsa_ptr(fwd, g.ret_slot(c, dl, m, sent[s] + warp))),
              next[s] + warp, lane);
        __syncthreads();
        if (threadIdx.x == 0) {
          sent[s] += k;
          next[s] += k;
          left[s] -= k;
          total -= k;
          __threadfence_system();  // the block's row stores, before the tail
          dev::st_release_sys_u64(
              reinterpret_cast<uint64_t*>(t.lsa_ptr(fwd, g.ret_word(g.ret_tails, c, dl, m))),
              sent[s]);
        }
        moved = true;
      }
      __syncthreads();
    }
    if (threadIdx.x == 0 &&
        !ring_pass_ok(
            t, moved, idle_since, left, S, [&](int s) { return n * L + s / N; }, c, OpId::kCombine))
      ok = 0;
    __syncthreads();
  }
  for (int s = threadIdx.x; s < S; s += blockDim.x)
    *reinterpret_cast<uint64_t*>(t.local_ptr(g.ret_word(g.ret_sent, c, s / N, s % N))) = sent[s];
  __syncthreads();
  return ok != 0;
}

/// Forwarder of channel c (rank n L + l): per source node m, the records it
/// forwarded from source m L + l in channel c (the handle's fwd_token /
/// fwd_mask), in order; each record's rows from the local ranks in its mask
/// (the next row of each return ring (c, d, m)) summed in ascending rank
/// order in float32 and rounded to BF16, the weights in float32, into the
/// send copy of network ring (c, n) at the source, put every net_chunk
/// records with a tail add. Batches of up to one record per warp, of the
/// records whose rows are all there and that fit the ring; a stream that
/// cannot move puts what it holds first.
template <class T>
__device__ bool ring_combine_forward(const CombineParams<T>& p, const T& t, int c) {
  const plan::HtRingRegion& g = p.ring;
  const int L = g.ranks_per_node, N = g.num_nodes(), me = t.rank, n = me / L, l = me % L;
  const int H = p.hidden, K = p.num_topk, slot_rows = p.off.slot_rows;
  const uint32_t slots = static_cast<uint32_t>(g.geometry.net_slots);
  const int chunk = g.geometry.net_chunk;
  const HtNetTable tab = HtNetTable::make(N, L);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  __shared__ int ok, total, k_now, next[kMaxRanks], left[kMaxRanks];
  __shared__ uint64_t sent[kMaxRanks], pending[kMaxRanks], taken[kMaxRanks], idle_since;
  __shared__ int b_mask[kRingBatch], b_off[kRingBatch][kMaxRanksPerNode], b_cnt[kMaxRanksPerNode];
  if (threadIdx.x == 0) {
    ok = 1;
    total = 0;
    idle_since = dev::globaltimer_ns();
  }
  __syncthreads();
  for (int m = threadIdx.x; m < N; m += blockDim.x) {
    const int src = m * L + l, rows = p.table[tab.fwd_rows + m];
    const plan::ChannelSplit split{p.source_num_tokens[src], g.geometry.channels};
    const int* tok = p.fwd_token + static_cast<int64_t>(m) * slot_rows;
    const int a = lower_bound_at(tok, 0, rows, split.first(c));
    const int b = lower_bound_at(tok, a, rows, split.end(c));
    next[m] = a;
    left[m] = b - a;
    atomicAdd(&total, b - a);
    sent[m] = pending[m] = *ring_base(t, g, HtRingBase::kNetSent, c, m);
  }
  for (int i = threadIdx.x; i < L * N; i += blockDim.x)  // i = d N + m
    taken[i] =
        *reinterpret_cast<const uint64_t*>(t.local_ptr(g.ret_word(g.ret_taken, c, i / N, i % N)));
  __syncthreads();
  // Stream m's sums since `pending` go out to its source (block-uniform: shared)
  auto flush = [&](int m) {
    const uint64_t to = sent[m];
    if (pending[m] == to) return;
    ring_put_records(t, g, c, m, m * L + l, pending[m], to);
    if (threadIdx.x == 0) pending[m] = to;
    __syncthreads();
  };
  while (ok && total > 0) {
    bool moved = false;
    for (int m = 0; ok && m < N; ++m) {
      if (left[m] == 0) continue;
      const int src = m * L + l;
      if (warp == 0) {
        // The next records' masks, each one's row in each return ring, and
        // the longest run of them whose rows are all there
        const int k0 = min(kRingBatch, left[m]);
        const int mask =
            lane < k0 ? p.fwd_mask[static_cast<int64_t>(m) * slot_rows + next[m] + lane] : 0;
        uint64_t have = 0;
        if (lane < L)
          have = dev::ld_acquire_sys_u64(reinterpret_cast<const uint64_t*>(
                     t.local_ptr(g.ret_word(g.ret_tails, c, lane, m)))) -
                 taken[lane * N + m];
        bool ready = lane < k0;
        for (int d = 0; d < L; ++d) {
          const unsigned to_d = __ballot_sync(0xffffffffu, lane < k0 && ((mask >> d) & 1));
          const int off = __popc(to_d & ((1u << lane) - 1u));
          const uint64_t have_d = __shfl_sync(0xffffffffu, have, d);
          if ((mask >> d) & 1) ready = ready && static_cast<uint64_t>(off) < have_d;
          if (lane < k0) b_off[lane][d] = off;
        }
        const unsigned not_ready = ~__ballot_sync(0xffffffffu, ready);
        int k = not_ready ? __ffs(not_ready) - 1 : 32;
        k = min(k, k0);
        if (lane == 0) {
          // Room in the source's ring, and no put past net_chunk records
          const uint64_t credit = t.read_signal(ring_sig(t, HtRingSignal::kNetCredit, c, src), src);
          // (a late credit of an op with larger rings may leave more
          // outstanding than this op's ring holds: no room then)
          const uint64_t used = sent[m] - credit;
          const uint64_t room = used >= slots ? 0 : slots - used;
          k = static_cast<int>(min(static_cast<uint64_t>(k), room));
          k = min(k, chunk - static_cast<int>(sent[m] - pending[m]));
        }
        k = __shfl_sync(0xffffffffu, k, 0);
        for (int d = 0; d < L; ++d) {
          const unsigned to_d = __ballot_sync(0xffffffffu, lane < k && ((mask >> d) & 1));
          if (lane == 0) b_cnt[d] = __popc(to_d);
        }
        if (lane < k0) b_mask[lane] = mask;
        if (lane == 0) k_now = k;
      }
      __syncthreads();
      const int k = k_now;
      if (k > 0) {
        if (warp < k) {
          const int mask = b_mask[warp];
          // (this rank's own sums straight into its own ring: no copy to put)
          uint8_t* out = reinterpret_cast<uint8_t*>(t.local_ptr(
              m == n ? g.net_slot(c, n, sent[m] + warp) : g.net_send_slot(c, m, sent[m] + warp)));
          sum_records<false>(
              reinterpret_cast<int4*>(out), reinterpret_cast<float*>(out + 2 * H), L,
              [&](int d) -> const uint8_t* {
                return (mask >> d) & 1 ? reinterpret_cast<const uint8_t*>(t.local_ptr(g.ret_slot(
                                             c, d, m, taken[d * N + m] + b_off[warp][d])))
                                       : nullptr;
              },
              nullptr, nullptr, H, K, lane);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          // every row read: the returners may reuse the slots
          __threadfence_system();
          for (int d = 0; d < L; ++d) {
            if (b_cnt[d] == 0) continue;
            taken[d * N + m] += b_cnt[d];
            dev::st_release_sys_u64(
                reinterpret_cast<uint64_t*>(t.lsa_ptr(n * L + d, g.ret_word(g.ret_heads, c, l, m))),
                taken[d * N + m]);
          }
          sent[m] += k;
          next[m] += k;
          left[m] -= k;
          total -= k;
        }
        moved = true;
        __syncthreads();
      }
      // A full put, the stream's end, or a stream that cannot move now: put
      // what it holds (a source may be waiting for exactly those records)
      if (sent[m] - pending[m] >= static_cast<uint64_t>(chunk) || left[m] == 0 || k == 0) flush(m);
      __syncthreads();
    }
    if (threadIdx.x == 0 &&
        !ring_pass_ok(
            t, moved, idle_since, left, N, [&](int m) { return m * L + l; }, c, OpId::kCombine))
      ok = 0;
    __syncthreads();
  }
  if (ok)
    for (int m = 0; m < N; ++m) flush(m);
  for (int m = threadIdx.x; m < N; m += blockDim.x)
    *ring_base(t, g, HtRingBase::kNetSent, c, m) = sent[m];
  for (int i = threadIdx.x; i < L * N; i += blockDim.x)
    *reinterpret_cast<uint64_t*>(t.local_ptr(g.ret_word(g.ret_taken, c, i / N, i % N))) = taken[i];
  __syncthreads();
  return ok != 0;
}

/// Finisher of channel c (every source rank n L + l): its tokens of channel
/// c in order, each the sum in float32 of its nodes' rows in ascending node
/// order (the next record of network ring (c, m) for each node m it
/// reached), then the biases, rounded to BF16; its weights the same in
/// float32. Batches of up to one token per warp, of the tokens whose rows
/// are all there; credits returned to each forwarder every net_chunk
/// records and before waiting.
template <class T>
__device__ bool ring_combine_finish(const CombineParams<T>& p, const T& t, int c) {
  const plan::HtRingRegion& g = p.ring;
  const int L = g.ranks_per_node, N = g.num_nodes(), me = t.rank, l = me % L;
  const int H = p.hidden, K = p.num_topk;
  const plan::ChannelSplit split{p.num_tokens, g.geometry.channels};
  const int end = split.end(c);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  __shared__ int ok, k_now, tok_next, waiting_for, b_off[kRingBatch][kMaxRanks], b_cnt[kMaxRanks];
  __shared__ uint64_t taken[kMaxRanks], freed[kMaxRanks], idle_since;
  if (threadIdx.x == 0) {
    ok = 1;
    tok_next = split.first(c);
    idle_since = dev::globaltimer_ns();
  }
  for (int m = threadIdx.x; m < N; m += blockDim.x)
    taken[m] = freed[m] = *ring_base(t, g, HtRingBase::kNetTaken, c, m);
  __syncthreads();
  auto free_credits = [&](int m) {  // thread 0
    if (taken[m] == freed[m]) return;
    ring_put_signal(t, m * L + l, 0, 0, 0, ring_sig(t, HtRingSignal::kNetCredit, c, me),
                    taken[m] - freed[m]);
    freed[m] = taken[m];
  };
  while (ok && tok_next < end) {
    const int first = tok_next;
    if (warp == 0) {
      const int k0 = min(kRingBatch, end - first);
      const int tok = first + lane;
      bool ready = lane < k0;
      int wait_m = -1;
      for (int m = 0; m < N; ++m) {
        const bool has = lane < k0 && p.send_pos[static_cast<int64_t>(tok) * N + m] >= 0;
        const unsigned hits = __ballot_sync(0xffffffffu, has);
        const int off = __popc(hits & ((1u << lane) - 1u));
        uint64_t have = 0;
        if (lane == 0 && hits != 0u)
          have = t.read_signal(ring_sig(t, HtRingSignal::kNetTail, c, m * L + l), m * L + l) -
                 taken[m];
        have = __shfl_sync(0xffffffffu, have, 0);
        if (has && static_cast<uint64_t>(off) >= have) {
          if (ready && wait_m < 0) wait_m = m;
          ready = false;
        }
        if (lane < k0) b_off[lane][m] = off;
      }
      const unsigned not_ready = ~__ballot_sync(0xffffffffu, ready);
      const int k = min(not_ready ? __ffs(not_ready) - 1 : 32, k0);
      for (int m = 0; m < N; ++m) {
        const bool has = lane < k && p.send_pos[static_cast<int64_t>(first + lane) * N + m] >= 0;
        const unsigned hits = __ballot_sync(0xffffffffu, has);
        if (lane == 0) b_cnt[m] = __popc(hits);
      }
      // the node the first token not ready waits for (for a timeout's name)
      const int w = __shfl_sync(0xffffffffu, wait_m, k < 32 ? k : 0);
      if (lane == 0) {
        k_now = k;
        waiting_for = w;
      }
    }
    __syncthreads();
    const int k = k_now;
    if (k > 0) {
      if (warp < k) {
        const int tok = first + warp;
        const int* pos = p.send_pos + static_cast<int64_t>(tok) * N;
        auto row = [&](int m) -> const uint8_t* {
          return pos[m] >= 0 ? reinterpret_cast<const uint8_t*>(
                                   t.local_ptr(g.net_slot(c, m, taken[m] + b_off[warp][m])))
                             : nullptr;
        };
        auto bias = [&](const uint16_t* b) {
          return b ? reinterpret_cast<const int4*>(b + static_cast<int64_t>(tok) * H) : nullptr;
        };
        sum_records<false>(reinterpret_cast<int4*>(p.combined_x + static_cast<int64_t>(tok) * H),
                           p.combined_topk_weights
                               ? p.combined_topk_weights + static_cast<int64_t>(tok) * K
                               : nullptr,
                           N, row, bias(p.bias0), bias(p.bias1), H, K, lane);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int m = 0; m < N; ++m) {
          taken[m] += b_cnt[m];
          if (taken[m] - freed[m] >= static_cast<uint64_t>(g.geometry.net_chunk)) free_credits(m);
        }
        tok_next = first + k;
      }
    } else if (threadIdx.x == 0) {
      // Waiting: every slot read goes back first (a forwarder may need room
      // for the very record this waits for)
      for (int m = 0; m < N; ++m) free_credits(m);
    }
    // The deadline, naming the forwarder the first token not ready waits for
    const int owed = 1;
    if (threadIdx.x == 0 &&
        !ring_pass_ok(
            t, k > 0, idle_since, &owed, 1,
            [&](int) { return waiting_for >= 0 ? waiting_for * L + l : -1; }, c, OpId::kCombine))
      ok = 0;
    __syncthreads();
  }
  if (threadIdx.x == 0)
    for (int m = 0; m < N; ++m) {
      if (ok) free_credits(m);
      *ring_base(t, g, HtRingBase::kNetTaken, c, m) = taken[m];
    }
  __syncthreads();
  return ok != 0;
}

template <class T>
__global__ void __launch_bounds__(kThreads) ring_combine_kernel(CombineParams<T> p) {
  const plan::HtRingRegion& g = p.ring;
  T t = p.t;
  t.signals = g.signals;  // the ring ids' words (ids stay global: NCCL's pool)
  const int C = g.geometry.channels, role = blockIdx.x / C, c = blockIdx.x % C;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ring_clock_start(p.ring_trace);
    ok = barrier_failed(p.t, p.off) ? 0 : 1;
  }
  __syncthreads();
  bool done = ok != 0;
  if (done) {
    if (role == 0)
      done = ring_return(p, t, c);
    else if (role == 1)
      done = ring_combine_forward(p, t, c);
    else
      done = ring_combine_finish(p, t, c);
  }
  if (threadIdx.x == 0) ring_clock_end(p.ring_trace, role, c);
  // Every block counts; the last clears the barrier's failure word.
  last_block_ok(p.t, p.off, kDoneReturn, done);
}

}  // namespace epx::kernels::internode
