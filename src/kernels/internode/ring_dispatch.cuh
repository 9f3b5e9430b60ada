// kernels/internode/ring_dispatch.cuh - the ring dispatch (docs/internode_ht.md, "A first
// ring kernel"): ring helpers, sender, forwarder, receiver, ring_dispatch_kernel.
#pragma once

#include "kernels/internode/dispatch.cuh"

namespace epx::kernels::internode {

// ---- ring dispatch (docs/internode_ht.md, "A first ring kernel") -------------
//
// One cooperative launch of 3 C blocks: block b < C sends channel b (its
// contiguous token range), C <= b < 2 C forwards channel b - C, the rest
// receive. Rings of fixed size (plan::HtRingRegion) carry the records, so any
// token count fits: a network ring per (channel, source node) at each
// forwarder (put by the source's sender, its tail a signal, its credits a
// signal back), an NVLink ring per (channel, forwarder) at each local
// receiver (stored by the forwarder, tail and head as plain words). Each
// role moves records in batches of one per warp (kRingBatch). Counts
// come in-band: a sender first puts, per node, its record count and its rows
// per local rank there as words tagged with the rings' op count; a forwarder
// tells each receiver its total the same way. Counters run over the
// buffer's life (the bases area), indexes are 64-bit. The handle state the
// whole-call combine reads comes out as from the whole-call kernels.

using plan::HtRingBase;
using plan::HtRingSignal;

/// Records one batch of a role moves at once: one per warp (warp 0's lanes
/// index a batch).
constexpr int kRingBatch = kThreads / 32;
/// The ring roles' copies: 16-byte loads in flight per lane (a warp moves a
/// whole record alone, 14 KB at hidden 7168: 8 keep 4 KB in flight where the
/// whole-call kernels' 4 keep 2 KB).
constexpr int kRingCopy = 8;
static_assert(kThreads % 32 == 0 && kRingBatch <= 32, "a batch is indexed by one warp's lanes");

template <class T>
__device__ __forceinline__ int ring_sig(const T& t, HtRingSignal kind, int channel, int peer) {
  return plan::ht_ring_signal(t.num_ranks, kind, channel, peer);
}
template <class T>
__device__ __forceinline__ uint64_t* ring_base(const T& t, const plan::HtRingRegion& g,
                                               HtRingBase kind, int channel, int index) {
  return reinterpret_cast<uint64_t*>(t.local_ptr(g.base_word(kind, channel, index)));
}
__device__ __forceinline__ uint64_t ring_tag(uint32_t value, uint64_t op) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(op)) << 32) | value;
}

/// `add` to ring signal `sig` at r on every context, context 0's after the
/// put of [src, src + bytes) to r's `dst` (bytes 0: no put); every member of
/// the Coop group calls it. The caller fenced what the put reads.
template <class Coop = dev::Thread, class T>
__device__ __forceinline__ void ring_put_signal(const T& t, int r, std::size_t dst, std::size_t src,
                                                std::size_t bytes, int sig, uint64_t add) {
  if (bytes > 0)
    t.template put_signal<Coop>(0, r, dst, src, bytes, sig, add);
  else
    t.template signal_add<Coop>(0, r, sig, add);
  if (add > 0)
    for (int c = 1; c < t.num_contexts; ++c) t.template signal_add<Coop>(c, r, sig, add);
}

/// Block-wide: records [from, to) of send ring (c, m) to `peer`'s network
/// ring (c, this rank's node), piece by piece (split where the ring wraps),
/// each piece with its tail add; for m == this node the records are in this
/// rank's own ring already (peer is this rank): the tail alone. The whole
/// block puts: to a same-node peer a put is the block's own copy, which one
/// thread would do at a hundredth of the speed.
template <class T>
__device__ __forceinline__ void ring_put_records(const T& t, const plan::HtRingRegion& g, int c,
                                                 int m, int peer, uint64_t from, uint64_t to) {
  const int n = t.rank / g.ranks_per_node;
  const uint32_t slots = static_cast<uint32_t>(g.geometry.net_slots);
  if (threadIdx.x == 0) __threadfence_system();  // the block's stores, before the put
  __syncthreads();
  while (from < to) {
    const uint32_t k = m == n ? static_cast<uint32_t>(to - from)
                              : ring::contiguous64(from, static_cast<uint32_t>(to - from), slots);
    ring_put_signal<dev::Block>(t, peer, g.net_slot(c, n, from), g.net_send_slot(c, m, from),
                                m == n ? 0 : k * g.record_bytes,
                                ring_sig(t, HtRingSignal::kNetTail, c, t.rank), k);
    from += k;
  }
  __syncthreads();
}

/// EPX_RING_TRACE's clock of this block (thread 0's): whether it runs, when
/// the last pass ended, and the ns of passes that moved nothing.
struct RingClock {
  int on;
  uint64_t start, pass_end, idle_ns;
};
__device__ __forceinline__ RingClock& ring_clock() {
  __shared__ RingClock clock;  // one per block
  return clock;
}
/// Thread 0, at a ring kernel's start.
__device__ __forceinline__ void ring_clock_start(const unsigned long long* trace) {
  RingClock& k = ring_clock();
  k.on = trace != nullptr;
  k.start = k.pass_end = k.on ? dev::globaltimer_ns() : 0;
  k.idle_ns = 0;
}
/// Thread 0, at its end: this block's op into the trace.
__device__ __forceinline__ void ring_clock_end(unsigned long long* trace, int role, int channel) {
  const RingClock& k = ring_clock();
  if (!k.on) return;
  unsigned long long* w =
      trace + (static_cast<std::size_t>(role) * plan::kMaxRingChannels + channel) * kRingTraceWords;
  atomicAdd(w, 1ull);
  atomicAdd(w + 1, static_cast<unsigned long long>(dev::globaltimer_ns() - k.start));
  atomicAdd(w + 2, static_cast<unsigned long long>(k.idle_ns));
}

/// Thread 0 of a polling role, after a pass over its `inputs` (left[i]
/// records still to come from input i, peer(i) its rank): a pass that moved
/// something restarts the idle clock; otherwise false (after reporting
/// kTimeout naming the first input still owed) once nothing moved for the
/// transport's deadline, or when another wait of this launch already failed.
template <class T, class Peer>
__device__ __forceinline__ bool ring_pass_ok(const T& t, bool moved, uint64_t& idle_since,
                                             const int* left, int inputs, Peer peer, int channel,
                                             OpId op = OpId::kDispatch) {
  if (RingClock& k = ring_clock(); k.on) {
    const uint64_t now = dev::globaltimer_ns();
    if (!moved) k.idle_ns += now - k.pass_end;
    k.pass_end = now;
  }
  if (moved) {
    idle_since = dev::globaltimer_ns();
    return true;
  }
  if (t.diag != nullptr) {
    const uint32_t code = *static_cast<volatile uint32_t*>(&t.diag->code);
    if (code == static_cast<uint32_t>(DiagCode::kTimeout) ||
        code == static_cast<uint32_t>(DiagCode::kBadConfig) ||
        code == static_cast<uint32_t>(DiagCode::kProxyStopped))
      return false;
  }
  if (dev::globaltimer_ns() - idle_since <= t.timeout_ns) return true;
  int owed = -1;
  for (int i = 0; i < inputs && owed < 0; ++i)
    if (left[i] > 0) owed = peer(i);
  dev::report(t.diag, DiagCode::kTimeout, op, t.rank, owed, channel, 0, 0);
  return false;
}

/// Sender of channel c: header words for every node, then the channel's
/// records node by node in turns: a turn writes one put's worth (net_chunk
/// records, or the node's rest) into send ring (c, m), in batches of up to
/// one record per warp (kRingBatch), and puts it to forwarder(me, m) with a
/// tail add. A node whose ring lacks room for a whole put (after the
/// forwarder's credits) is passed over until it has; so each forwarder gets
/// a put per round instead of waiting for the nodes before it to finish,
/// and a full ring never holds up the others.
template <class T>
__device__ bool ring_send(const DispatchParams<T>& p, const T& t, int c, uint64_t op) {
  const plan::HtRingRegion& g = p.ring;
  const int L = g.ranks_per_node, N = g.num_nodes(), R = t.num_ranks, me = t.rank;
  const int n = me / L, l = me % L, S = p.num_scales, K = p.num_topk;
  const plan::ChannelSplit split{p.num_tokens, g.geometry.channels};
  const int first = split.first(c), end = split.end(c);
  const RecordFields f(p.hidden_bytes, S, K);
  const uint32_t slots = static_cast<uint32_t>(g.geometry.net_slots);
  const int chunk = g.geometry.net_chunk;  // <= slots (HtRingGeometry::validate)
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  __shared__ int cnt_node[kMaxRanks], cnt_rank[kMaxRanks], left[kMaxRanks], scan[kMaxRanks];
  __shared__ uint64_t sent[kMaxRanks];
  __shared__ int ok, b_n, b_tok[kRingBatch], b_j[kRingBatch], turn, total;
  __shared__ uint64_t idle_since;
  for (int i = threadIdx.x; i < R; i += blockDim.x) cnt_node[i] = cnt_rank[i] = 0;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int tok = first + threadIdx.x; tok < end; tok += blockDim.x) {
    for (int m = 0; m < N; ++m)
      if (p.send_pos[static_cast<int64_t>(tok) * N + m] >= 0) atomicAdd(&cnt_node[m], 1);
    for (int d = 0; d < R; ++d)
      if (p.rank_pos[static_cast<int64_t>(tok) * R + d] >= 0) atomicAdd(&cnt_rank[d], 1);
  }
  __syncthreads();
  // Headers (tagged words; the put rides context 0 ahead of the records' tails)
  for (int m = threadIdx.x; m < N; m += blockDim.x) {
    auto* h = reinterpret_cast<uint64_t*>(t.local_ptr(g.header_send_word(c, m, 0)));
    h[0] = ring_tag(cnt_node[m], op);
    for (int d = 0; d < L; ++d) h[1 + d] = ring_tag(cnt_rank[m * L + d], op);
    __threadfence_system();
    ring_put_signal(t, m * L + l, g.net_header(c, n, 0), g.header_send_word(c, m, 0),
                    g.net_header_bytes(), ring_sig(t, HtRingSignal::kNetTail, c, me), 0);
  }
  for (int m = threadIdx.x; m < N; m += blockDim.x) {
    sent[m] = *ring_base(t, g, HtRingBase::kNetSent, c, m);
    left[m] = cnt_node[m];
    scan[m] = first;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    total = 0;
    for (int m = 0; m < N; ++m) total += left[m];
    idle_since = dev::globaltimer_ns();
  }
  __syncthreads();
  while (ok && total > 0) {
    bool moved = false;
    for (int m = 0; ok && m < N; ++m) {
      if (left[m] == 0) continue;
      const int fwd = m * L + l;
      // Thread 0: this node's turn if its ring has room for a whole put
      if (threadIdx.x == 0) {
        const int want = min(left[m], chunk);
        const uint64_t credited = t.read_signal(ring_sig(t, HtRingSignal::kNetCredit, c, fwd), fwd);
        turn = sent[m] + want <= credited + slots ? want : 0;
      }
      __syncthreads();
      const int k_turn = turn;
      __syncthreads();  // read by all before thread 0 writes the next node's
      if (k_turn == 0) continue;
      const uint64_t from = sent[m];
      for (int got_all = 0; got_all < k_turn;) {
        // Warp 0 collects the next batch: the first tokens from scan[m] on
        // that go to node m, in token order, at most one per warp and no
        // more than the turn has left.
        if (warp == 0) {
          const int cap = min(kRingBatch, k_turn - got_all);
          int got = 0, pos = scan[m];
          while (got < cap && pos < end) {
            const int tok = pos + lane;
            const int j = tok < end ? p.send_pos[static_cast<int64_t>(tok) * N + m] : -1;
            const unsigned hits = __ballot_sync(0xffffffffu, j >= 0);
            const int before = __popc(hits & ((1u << lane) - 1u));
            const int take = min(__popc(hits), cap - got);
            if (j >= 0 && before < take) {
              b_tok[got + before] = tok;
              b_j[got + before] = j;
            }
            // past the last token taken (all 32 when every hit fit)
            const unsigned next = __ballot_sync(0xffffffffu, j >= 0 && before == take);
            pos = next ? pos + __ffs(next) - 1 : pos + 32;
            got += take;
          }
          if (lane == 0) {
            b_n = got;
            scan[m] = min(pos, end);
          }
        }
        __syncthreads();
        const int k = b_n;
        if (k == 0) {
          // fewer tokens for m than its count: the counts and send_pos disagree
          if (threadIdx.x == 0) {
            dev::report(t.diag, DiagCode::kBadConfig, OpId::kDispatch, me, fwd, c,
                        static_cast<uint32_t>(cnt_node[m]), static_cast<uint32_t>(got_all));
            ok = 0;
          }
          __syncthreads();
          break;
        }
        const uint64_t at = from + got_all;
        if (warp < k) {
          const int tok = b_tok[warp];
          // (this node's records straight into its own ring: no copy to put)
          uint8_t* rec = reinterpret_cast<uint8_t*>(
              t.local_ptr(m == n ? g.net_slot(c, n, at + warp) : g.net_send_slot(c, m, at + warp)));
          pack_record<kRingCopy>(p, f, rec, tok, m, b_j[warp], me, R, L, lane);
        }
        got_all += k;
        __syncthreads();
      }
      if (!ok) break;
      ring_put_records(t, g, c, m, fwd, from, from + k_turn);
      if (threadIdx.x == 0) {
        sent[m] = from + k_turn;
        left[m] -= k_turn;
        total -= k_turn;
      }
      moved = true;
      __syncthreads();
    }
    if (threadIdx.x == 0 && ok) {
      if (!ring_pass_ok(
              t, moved, idle_since, left, N, [&](int m) { return m * L + l; }, c))
        ok = 0;
      else if (!moved)
        __nanosleep(256);  // no ring had room: poll the credits less often
    }
    __syncthreads();
  }
  for (int m = threadIdx.x; m < N; m += blockDim.x)
    *ring_base(t, g, HtRingBase::kNetSent, c, m) = sent[m];
  __syncthreads();
  return ok != 0;
}

/// Forwarder of channel c: the headers of every source node's sender c, each
/// local receiver told its total, then records from whichever input ring has
/// some, in batches of up to one per warp: the batch's room in the NVLink
/// ring (c, this rank) of every local rank in the records' masks, each warp
/// storing one record there; its credits returned to the source every
/// net_chunk records and whenever that input has nothing more waiting.
template <class T>
__device__ bool ring_forward(const DispatchParams<T>& p, const T& t, int c, uint64_t op) {
  const plan::HtRingRegion& g = p.ring;
  const int L = g.ranks_per_node, N = g.num_nodes(), me = t.rank, n = me / L, l = me % L;
  const RecordFields f(p.hidden_bytes, p.num_scales, p.num_topk);
  const uint32_t nvl_slots = static_cast<uint32_t>(g.geometry.nvl_slots);
  const int batch_max = min(kRingBatch, g.geometry.nvl_slots);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  __shared__ int ok, left[kMaxRanks], tot[kMaxRanksPerNode];
  __shared__ uint64_t taken[kMaxRanks], freed[kMaxRanks], nvl_sent[kMaxRanksPerNode],
      nvl_pub[kMaxRanksPerNode];
  __shared__ int total, avail, b_cnt[kMaxRanksPerNode];
  __shared__ int b_mask[kRingBatch], b_off[kRingBatch][kMaxRanksPerNode];
  __shared__ uint64_t idle_since;
  if (threadIdx.x == 0) ok = 1;
  if (static_cast<int>(threadIdx.x) < L) tot[threadIdx.x] = 0;
  __syncthreads();
  for (int m = threadIdx.x; m < N; m += blockDim.x) {
    uint32_t v = 0;
    const int src = m * L + l;
    if (!t.wait_tagged(g.net_header(c, m, 0), static_cast<uint32_t>(op), v, t.timeout_ns, t.diag,
                       OpId::kDispatch, src, c)) {
      ok = 0;
      left[m] = 0;
      continue;
    }
    left[m] = static_cast<int>(v);
    for (int d = 0; d < L; ++d) {
      if (!t.wait_tagged(g.net_header(c, m, 1 + d), static_cast<uint32_t>(op), v, t.timeout_ns,
                         t.diag, OpId::kDispatch, src, c)) {
        ok = 0;
        break;
      }
      atomicAdd(&tot[d], static_cast<int>(v));
    }
  }
  __syncthreads();
  if (!ok) return false;
  if (threadIdx.x == 0) {
    total = 0;
    for (int m = 0; m < N; ++m) {
      taken[m] = freed[m] = *ring_base(t, g, HtRingBase::kNetTaken, c, m);
      total += left[m];
    }
    for (int d = 0; d < L; ++d)
      nvl_sent[d] = nvl_pub[d] = *ring_base(t, g, HtRingBase::kNvlSent, c, d);
    idle_since = dev::globaltimer_ns();
  }
  if (static_cast<int>(threadIdx.x) < L)
    t.lsa_tagged_release(n * L + threadIdx.x, g.nvl_header(c, l), tot[threadIdx.x],
                         static_cast<uint32_t>(op));
  __syncthreads();
  auto free_credits = [&](int m) {  // thread 0
    if (taken[m] == freed[m]) return;
    ring_put_signal(t, m * L + l, 0, 0, 0, ring_sig(t, HtRingSignal::kNetCredit, c, me),
                    taken[m] - freed[m]);
    freed[m] = taken[m];
  };
  auto publish = [&](int d) {  // thread 0: the NVLink tail at local rank d
    if (nvl_sent[d] == nvl_pub[d]) return;
    __threadfence_system();
    dev::st_release_sys_u64(reinterpret_cast<uint64_t*>(t.lsa_ptr(n * L + d, g.nvl_tail(c, l))),
                            nvl_sent[d]);
    nvl_pub[d] = nvl_sent[d];
  };
  while (ok && total > 0) {
    bool moved = false;
    for (int m = 0; ok && m < N; ++m) {
      if (left[m] == 0) continue;
      if (threadIdx.x == 0) {
        const uint64_t tail =
            t.read_signal(ring_sig(t, HtRingSignal::kNetTail, c, m * L + l), m * L + l);
        avail = static_cast<int>(min(tail - taken[m], static_cast<uint64_t>(left[m])));
      }
      __syncthreads();
      const int m_avail = avail;
      for (int done = 0; ok && done < m_avail;) {
        const int k = min(batch_max, m_avail - done);
        // Warp 0: lane i reads record i's mask, and each record's slot in
        // each local rank's ring (its rank among the batch's records for it)
        if (warp == 0) {
          int mask = 0;
          if (lane < k) {
            const uint8_t* rec =
                reinterpret_cast<const uint8_t*>(t.local_ptr(g.net_slot(c, m, taken[m] + lane)));
            mask = ld_int(rec + f.mask);
            // For the combine, the ranks that keep the row: with
            // num_worst_tokens a receiver drops rows past it (and its
            // returner sends none back), so the combine's forwarder must
            // not wait for them. The route still takes the full mask.
            int keep = mask;
            if (p.num_worst > 0) {
              const int src = ld_int(rec + f.src);
              for (int d = 0; d < L; ++d)
                if ((mask >> d) & 1) {
                  const int row =
                      (src > 0
                           ? p.ring_rpm[static_cast<std::size_t>(src - 1) * t.num_ranks + n * L + d]
                           : 0) +
                      ld_int(rec + f.pos + 4 * d);
                  if (row >= p.num_recv_rows) keep &= ~(1 << d);
                }
            }
            const int64_t at = static_cast<int64_t>(m) * p.off.slot_rows + ld_int(rec + f.index);
            p.fwd_mask[at] = keep;
            p.fwd_token[at] = ld_int(rec + f.token);
            b_mask[lane] = mask;
          }
          for (int d = 0; d < L; ++d) {
            const unsigned to_d = __ballot_sync(0xffffffffu, lane < k && ((mask >> d) & 1));
            if (lane < k) b_off[lane][d] = __popc(to_d & ((1u << lane) - 1u));
            if (lane == 0) b_cnt[d] = __popc(to_d);
          }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          // Room for the batch in each ring it goes to: publish what is
          // stored first (the receiver frees slots only for records it sees)
          for (int d = 0; ok && d < L; ++d) {
            const uint64_t need = nvl_sent[d] + b_cnt[d];
            if (b_cnt[d] == 0 || need <= nvl_slots) continue;
            const auto* head = reinterpret_cast<const uint64_t*>(t.local_ptr(g.nvl_head(c, d)));
            if (dev::ld_acquire_sys_u64(head) + nvl_slots < need) publish(d);
            if (!dev::spin_until([&] { return dev::ld_acquire_sys_u64(head); },
                                 [&](uint64_t h) { return h + nvl_slots >= need; },
                                 [](uint64_t h) { return static_cast<uint32_t>(h); },
                                 static_cast<uint32_t>(need - nvl_slots), t.timeout_ns, t.diag,
                                 OpId::kDispatch, me, n * L + d, c))
              ok = 0;
          }
        }
        __syncthreads();
        if (!ok) break;
        if (warp < k) {
          const uint8_t* rec =
              reinterpret_cast<const uint8_t*>(t.local_ptr(g.net_slot(c, m, taken[m] + warp)));
          const int mask = b_mask[warp];
          for (int d = 0; d < L; ++d)
            if ((mask >> d) & 1)
              warp_copy<true, kRingCopy>(
                  reinterpret_cast<uint8_t*>(
                      t.lsa_ptr(n * L + d, g.nvl_slot(c, l, nvl_sent[d] + b_off[warp][d]))),
                  rec, static_cast<int>(g.record_bytes), lane);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          for (int d = 0; d < L; ++d) {
            nvl_sent[d] += b_cnt[d];
            if (nvl_sent[d] - nvl_pub[d] >= static_cast<uint64_t>(g.geometry.nvl_chunk)) publish(d);
          }
          taken[m] += k;
          left[m] -= k;
          total -= k;
          if (taken[m] - freed[m] >= static_cast<uint64_t>(g.geometry.net_chunk)) free_credits(m);
        }
        __syncthreads();
        done += k;
      }
      if (m_avail > 0) moved = true;
      if (threadIdx.x == 0 && ok) {
        free_credits(m);  // nothing more waiting in this input now
        for (int d = 0; d < L; ++d) publish(d);
      }
      __syncthreads();
    }
    if (threadIdx.x == 0 && !ring_pass_ok(
                                t, moved, idle_since, left, N, [&](int m) { return m * L + l; }, c))
      ok = 0;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    for (int d = 0; d < L; ++d) publish(d);
    for (int m = 0; m < N; ++m) {
      // After a failure no more posts: each could wait out its own deadline
      // on a stalled proxy, and the buffer is unusable now anyway.
      if (ok) free_credits(m);
      *ring_base(t, g, HtRingBase::kNetTaken, c, m) = taken[m];
    }
    for (int d = 0; d < L; ++d) *ring_base(t, g, HtRingBase::kNvlSent, c, d) = nvl_sent[d];
  }
  __syncthreads();
  return ok != 0;
}

/// Receiver of channel c: the local forwarders' totals, then records from
/// whichever NVLink ring has some, in batches of up to one per warp, each
/// warp unpacking one record to its final row (the source's first row here
/// plus the record's row among its rows), the head returned to the
/// forwarder after each pass over its ring.
template <class T>
__device__ bool ring_receive(const DispatchParams<T>& p, const T& t, int c, uint64_t op) {
  const plan::HtRingRegion& g = p.ring;
  const int L = g.ranks_per_node, me = t.rank, n = me / L, l = me % L, R = t.num_ranks;
  const int S = p.num_scales, K = p.num_topk;
  const RecordFields f(p.hidden_bytes, S, K);
  const int epr = p.num_experts / R, lo = me * epr;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  __shared__ int ok, bad, left[kMaxRanksPerNode], total, avail;
  __shared__ uint64_t taken[kMaxRanksPerNode], idle_since;
  if (threadIdx.x == 0) {
    ok = 1;
    bad = 0;
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < L) {
    uint32_t v = 0;
    if (!t.wait_tagged(g.nvl_header(c, threadIdx.x), static_cast<uint32_t>(op), v, t.timeout_ns,
                       t.diag, OpId::kDispatch, n * L + threadIdx.x, c))
      ok = 0;
    left[threadIdx.x] = static_cast<int>(v);
  }
  __syncthreads();
  if (!ok) return false;
  if (threadIdx.x == 0) {
    total = 0;
    for (int fl = 0; fl < L; ++fl) {
      taken[fl] = *ring_base(t, g, HtRingBase::kNvlTaken, c, fl);
      total += left[fl];
    }
    idle_since = dev::globaltimer_ns();
  }
  __syncthreads();
  while (ok && total > 0) {
    bool moved = false;
    for (int fl = 0; ok && fl < L; ++fl) {
      if (left[fl] == 0) continue;
      if (threadIdx.x == 0) {
        const uint64_t tail = dev::ld_acquire_sys_u64(
            reinterpret_cast<const uint64_t*>(t.local_ptr(g.nvl_tail(c, fl))));
        avail = static_cast<int>(min(tail - taken[fl], static_cast<uint64_t>(left[fl])));
      }
      __syncthreads();
      const int f_avail = avail;
      for (int done = 0; done < f_avail;) {
        const int k = min(kRingBatch, f_avail - done);
        if (warp < k) {
          const uint8_t* rec =
              reinterpret_cast<const uint8_t*>(t.local_ptr(g.nvl_slot(c, fl, taken[fl] + warp)));
          int row = 0;
          if (lane == 0) {
            const int src = ld_int(rec + f.src), pos = ld_int(rec + f.pos + 4 * l);
            row = (src > 0 ? p.ring_rpm[static_cast<std::size_t>(src - 1) * R + me] : 0) + pos;
            if (p.num_worst > 0 && pos >= 0 && row >= p.num_recv_rows) {
              row = -1;  // past num_worst_tokens: dropped (the exchange reported it)
            } else if (row < 0 || row >= p.num_recv_rows || pos < 0) {
              dev::report(t.diag, DiagCode::kBadConfig, OpId::kDispatch, me, src, c,
                          static_cast<uint32_t>(p.num_recv_rows), static_cast<uint32_t>(row));
              row = -1;
              bad = 1;
            }
          }
          row = __shfl_sync(0xffffffffu, row, 0);
          if (row >= 0) unpack_record<kRingCopy>(p, f, rec, row, lo, epr, lane);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          taken[fl] += k;
          left[fl] -= k;
          total -= k;
          if (bad) ok = 0;
        }
        __syncthreads();
        done += k;
      }
      if (threadIdx.x == 0 && f_avail > 0) {
        moved = true;
        // every row read: the forwarder may reuse the slots
        __threadfence_system();
        dev::st_release_sys_u64(
            reinterpret_cast<uint64_t*>(t.lsa_ptr(n * L + fl, g.nvl_head(c, l))), taken[fl]);
      }
      __syncthreads();
    }
    if (threadIdx.x == 0 &&
        !ring_pass_ok(
            t, moved, idle_since, left, L, [&](int fl) { return n * L + fl; }, c))
      ok = 0;
    __syncthreads();
  }
  if (threadIdx.x == 0)
    for (int fl = 0; fl < L; ++fl) *ring_base(t, g, HtRingBase::kNvlTaken, c, fl) = taken[fl];
  __syncthreads();
  return ok != 0;
}

template <class T>
__global__ void __launch_bounds__(kThreads) ring_dispatch_kernel(DispatchParams<T> p) {
  const plan::HtRingRegion& g = p.ring;
  T t = p.t;
  t.signals = g.signals;  // the ring ids' words (ids stay global: NCCL's pool)
  const int C = g.geometry.channels, role = blockIdx.x / C, c = blockIdx.x % C;
  __shared__ int ok;
  __shared__ uint64_t op;
  if (threadIdx.x == 0) {
    ring_clock_start(p.ring_trace);
    ok = barrier_failed(p.t, p.off) ? 0 : 1;
    op = ++*ring_base(t, g, HtRingBase::kOps, c, role);  // the rings' own count
  }
  __syncthreads();
  bool done = ok != 0;
  if (done) {
    if (role == 0)
      done = ring_send(p, t, c, op);
    else if (role == 1)
      done = ring_forward(p, t, c, op);
    else
      done = ring_receive(p, t, c, op);
  }
  if (threadIdx.x == 0) ring_clock_end(p.ring_trace, role, c);
  // Every block counts; the last clears the barrier's failure word.
  last_block_ok(p.t, p.off, kDoneSend, done);
}

}  // namespace epx::kernels::internode
