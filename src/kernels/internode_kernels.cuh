// kernels/internode_kernels.cuh - the high-throughput kernels across nodes
// (issue 25; docs/internode_ht.md "A first version"), templates over the
// device transport: libepx instantiates them for its transports
// (kernels/internode.cu), the NVSHMEM module for its own
// (transport/nvshmem/ht_kernels.cu). Each op is a barrier kernel, then three
// kernels; the launchers are launch_ht_net_dispatch_for / _combine_for.
#pragma once

#include "common/check.hpp"
#include "common/internode_channels.hpp"
#include "common/internode_rings.hpp"
#include "common/internode_route.hpp"
#include "common/ring.hpp"
#include "kernels/bf16.cuh"
#include "kernels/copy.cuh"
#include "kernels/kernels.hpp"

namespace epx::kernels::internode {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
/// Finished-block counters (plan::HtNetRegion::kDone), one per kernel.
/// kFailed: a block whose wait failed (reported) sets it; the last block
/// then sends nothing, so that the peers time out naming this rank instead
/// of taking rows that never came, and clears it.
/// kDoneNodePut and kNodePutGo: node_put_kernel's count, and the word the
/// kernel before it sets when the node slots may be put (split puts).
enum DoneWord : int {
  kDoneSend = 0,
  kDoneForward,
  kDoneReturn,
  kDoneNodeSum,
  kDoneNodePut,
  kNodePutGo,
  kFailed = 8
};

using plan::HtNetSignal;

template <class T>
__device__ __forceinline__ int sig(const T& t, HtNetSignal kind, int src) {
  return plan::ht_net_signal(t.num_ranks, kind, src);
}
template <class T>
__device__ __forceinline__ uint64_t* op_counts(const T& t, const HtNetOffsets& o) {
  return reinterpret_cast<uint64_t*>(t.local_ptr(o.counts));
}
template <class T>
__device__ __forceinline__ uint32_t* done_word(const T& t, const HtNetOffsets& o, DoneWord w) {
  return reinterpret_cast<uint32_t*>(t.local_ptr(o.done)) + w;
}
/// Block-wide: counts the block in `w` (with `ok` false it marks the op
/// failed); true for the last block when no block failed. The last block
/// also clears `clear` (failed or not), a word every block read before it
/// counted.
template <class T>
__device__ __forceinline__ bool last_block_ok(const T& t, const HtNetOffsets& o, DoneWord w,
                                              bool ok, uint32_t* clear = nullptr) {
  uint32_t* failed = done_word(t, o, kFailed);
  if (!ok && threadIdx.x == 0) atomicOr(failed, 1u);
  if (!dev::block_counted_last(done_word(t, o, w))) return false;
  __shared__ int any_failed;
  if (threadIdx.x == 0) {
    any_failed = static_cast<int>(*static_cast<volatile uint32_t*>(failed));
    *failed = 0u;
    if (clear != nullptr) *clear = 0u;
  }
  __syncthreads();
  return any_failed == 0;
}
/// Adds 1 to signal `s` at rank r on every context (a receiver waits until
/// every context's word counts the op); context 0's add follows this
/// thread's earlier puts to r.
template <class T>
__device__ __forceinline__ void signal_all_contexts(const T& t, int r, int s) {
  for (int c = 0; c < t.num_contexts; ++c) t.template signal_add<dev::Thread>(c, r, s, 1);
}

/// Block-wide: one node's slot to rank r, then 1 added to signal `s` there on
/// every context (context 0's after the bytes landed). The block shares the
/// put: a transport that copies with the calling threads (NVSHMEM over P2P)
/// needs the whole block for a slot of megabytes, where one thread took
/// half a second.
template <class T>
__device__ __forceinline__ void put_node(const T& t, int r, std::size_t dst, std::size_t src,
                                         std::size_t bytes, int s) {
  if (bytes > 0)
    t.template put_signal<dev::Block>(0, r, dst, src, bytes, s, 1);
  else
    t.template signal_add<dev::Block>(0, r, s, 1);
  if (threadIdx.x == 0)
    for (int c = 1; c < t.num_contexts; ++c) t.template signal_add<dev::Thread>(c, r, s, 1);
  __syncthreads();
}

/// The end of a kernel whose last block puts each other node's slot (send
/// slot m to rank m * L + l's receive slot n, `rows[m]` rows, signal `kind`).
/// With split puts the last block only sets kNodePutGo, and node_put_kernel
/// (launched next) shares the puts among its blocks.
template <class T>
__device__ __forceinline__ void put_node_slots(const T& t, const HtNetOffsets& o, const int* rows,
                                               HtNetSignal kind, bool split) {
  const int L = o.ranks_per_node, N = o.num_nodes, n = t.rank / L, l = t.rank % L;
  if (split) {
    if (threadIdx.x == 0) *done_word(t, o, kNodePutGo) = 1u;
    return;
  }
  for (int m = 0; m < N; ++m)
    if (m != n)
      put_node(t, m * L + l, o.recv + n * o.slot_bytes, o.send + m * o.slot_bytes,
               static_cast<std::size_t>(rows[m]) * o.row_bytes, sig(t, kind, t.rank));
}

template <class T>
struct NodePutParams {
  HtNetOffsets off;
  const int* rows;  ///< [N]: rows of each node's send slot
  HtNetSignal kind;
  T t;
};

/// Split puts (where the SMs that call a put copy its bytes themselves, as
/// NVSHMEM over P2P does, one block per slot of megabytes was the dispatch's
/// and the combine's whole time): block b puts part b of every other node's
/// slot, waits until its puts are complete (quiet), and the last block
/// signals each of those ranks, so every part landed before the signal.
/// Nothing moves unless the kernel before set kNodePutGo (an op that failed
/// before sends nothing: the peers time out naming this rank).
template <class T>
__global__ void __launch_bounds__(kThreads) node_put_kernel(NodePutParams<T> p) {
  const auto& t = p.t;
  const HtNetOffsets& o = p.off;
  const int L = o.ranks_per_node, N = o.num_nodes, n = t.rank / L, l = t.rank % L;
  uint32_t* go = done_word(t, o, kNodePutGo);
  if (*static_cast<volatile uint32_t*>(go) == 0u) return;  // every block alike
  for (int m = 0; m < N; ++m) {
    if (m == n) continue;
    const std::size_t bytes = static_cast<std::size_t>(p.rows[m]) * o.row_bytes;
    const std::size_t part = (bytes / gridDim.x + 16) & ~static_cast<std::size_t>(15);
    const std::size_t b0 = min(bytes, blockIdx.x * part), len = min(part, bytes - b0);
    if (len > 0)
      t.template put<dev::Block>(0, m * L + l, o.recv + n * o.slot_bytes + b0,
                                 o.send + m * o.slot_bytes + b0, len);
  }
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) ok = t.quiet(0) ? 1 : 0;
  __syncthreads();
  // kNodePutGo is cleared even when this op failed: a later op whose send
  // fails (and so does not set it) must not put slots it never filled.
  if (!last_block_ok(t, o, kDoneNodePut, ok != 0, go)) return;
  for (int m = 0; m < N; ++m)
    if (m != n) put_node(t, m * L + l, 0, 0, 0, sig(t, p.kind, t.rank));
}

template <class T>
inline void launch_node_put(const T& t, const HtNetOffsets& off, const int* rows, HtNetSignal kind,
                            int blocks, cudaStream_t stream) {
  NodePutParams<T> p{off, rows, kind, t};
  node_put_kernel<T><<<blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

/// One thread: `ints` words of this rank's region at `src` (already written
/// and fenced) to rank r's at `dst`, then 1 added to signal `s` there on
/// every context, after the words: over NVLink stores, a fence, the signals;
/// over the network a put with context 0's signal, then the others'. For the
/// barrier's shape and the count exchange's row.
template <class T>
__device__ __forceinline__ void put_words_signal(const T& t, int r, std::size_t dst,
                                                 std::size_t src, int ints, int s) {
  if (void* q = t.lsa_ptr(r, dst)) {
    const auto* w = reinterpret_cast<const volatile int*>(t.local_ptr(src));
    for (int i = 0; i < ints; ++i) static_cast<volatile int*>(q)[i] = w[i];
    __threadfence_system();
    signal_all_contexts(t, r, s);
    return;
  }
  t.template put_signal<dev::Thread>(0, r, dst, src, 4u * ints, s, 1);
  for (int c = 1; c < t.num_contexts; ++c) t.template signal_add<dev::Thread>(c, r, s, 1);
}

/// Block-wide: waits for signal `kind` of peer(i) for i in [0, count) (a
/// negative peer is skipped) to reach `ops`; true when every wait did
/// (a failed one is reported by the transport).
template <class T, class Peer>
__device__ __forceinline__ bool wait_peers(const T& t, HtNetSignal kind, int count, Peer peer,
                                           uint64_t ops, OpId op) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int r = peer(i);
    if (r >= 0 && !t.wait_signal(plan::ht_net_signal(t.num_ranks, kind, r), ops, op, r)) ok = 0;
  }
  __syncthreads();
  return ok != 0;
}

/// Warp-wide: dst[v] = BF16 of the float32 sum, in order, of src(i)[v] for
/// i in [0, n) (src gives nullptr for a row not summed), then of bias0[v]
/// and bias1[v] where given, for the nv 16-byte vectors of a row. Each lane
/// keeps kSumVectors vectors' loads of two rows in flight.
constexpr int kSumVectors = 4;
/// kPairs false: one row at a time, for the ring kernel, where the second
/// row's registers spilled (ring combine kernel's stack 152 -> 368 bytes) for
/// no gain there (4x H200: proxy -6%, nvshmem +4% per combine).
template <bool kPairs = true, class Src>
__device__ __forceinline__ void sum_rows(int4* dst, int nv, int n, Src src, const int4* bias0,
                                         const int4* bias1, int lane) {
  constexpr int kU = kSumVectors;
  for (int v0 = lane; v0 < nv; v0 += 32 * kU) {
    float acc[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
    auto add = [&](const int4* row, bool coherent) {
      int4 x[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (v0 + 32 * u < nv) x[u] = coherent ? dev::ld_l2(row + v0 + 32 * u) : row[v0 + 32 * u];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (v0 + 32 * u < nv) accumulate_bf16x8(acc[u], x[u]);
    };
    // Two rows at a time: both rows' loads in flight before either is added
    // (the adds stay in row order, so the sum is the same).
    for (int i = 0; i < n; i += kPairs ? 2 : 1) {
      const int4* r0 = src(i);
      const int4* r1 = kPairs && i + 1 < n ? src(i + 1) : nullptr;
      if (r0 == nullptr || r1 == nullptr) {
        if (r0) add(r0, true);
        if (r1) add(r1, true);
        continue;
      }
      int4 x0[kU], x1[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (v0 + 32 * u < nv) {
          x0[u] = dev::ld_l2(r0 + v0 + 32 * u);
          x1[u] = dev::ld_l2(r1 + v0 + 32 * u);
        }
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (v0 + 32 * u < nv) {
          accumulate_bf16x8(acc[u], x0[u]);
          accumulate_bf16x8(acc[u], x1[u]);
        }
    }
    if (bias0) add(bias0, false);
    if (bias1) add(bias1, false);
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (v0 + 32 * u < nv) dst[v0 + 32 * u] = pack_bf16x8(acc[u]);
  }
}

// ---- barrier -------------------------------------------------------------------

template <class T>
struct BarrierParams {
  HtNetOffsets off;
  HtNetOp op;
  HtNetShape shape;
  /// [N]: this rank's rows per node, checked against off.slot_rows (the
  /// shape's `fits`); nullptr: they fit (the host sized the slots).
  const int* node_counts;
  T t;
};

/// Where source `src`'s shape for ops of `parity` lands (src = num_ranks:
/// this rank's own copy, what its puts send).
__device__ __forceinline__ std::size_t shape_at(const HtNetOffsets& o, int num_ranks, int parity,
                                                int src) {
  const std::size_t i = src == num_ranks ? 2u * num_ranks + parity
                                         : static_cast<std::size_t>(parity) * num_ranks + src;
  return o.shapes + plan::HtNetRegion::kShapeBytes * i;
}

/// A shape's words, stored and loaded past L1 (peers write them).
static_assert(sizeof(HtNetShape) == 4 * kHtNetShapeFields &&
              sizeof(HtNetShape) <= plan::HtNetRegion::kShapeBytes);
__device__ __forceinline__ void store_shape(void* at, const HtNetShape& v) {
  auto* w = static_cast<volatile int*>(at);
  const int* f = reinterpret_cast<const int*>(&v);
  for (int i = 0; i < kHtNetShapeFields; ++i) w[i] = f[i];
}
__device__ __forceinline__ HtNetShape load_shape(const void* at) {
  const auto* w = static_cast<const volatile int*>(at);
  HtNetShape v;
  int* f = reinterpret_cast<int*>(&v);
  for (int i = 0; i < kHtNetShapeFields; ++i) f[i] = w[i];
  return v;
}

/// Reports peer r's differing shape (cold, out of line).
static __device__ __noinline__ void report_bad_shape(DeviceDiag* diag, int rank, int r, int channel,
                                                     int mine, int theirs) {
  dev::report(diag, DiagCode::kBadConfig, OpId::kBarrier, rank, r, channel,
              static_cast<uint32_t>(mine), static_cast<uint32_t>(theirs));
}

/// One block: counts the op, waits until the puts of earlier ops left this
/// rank, tells every rank it arrived (with this op's shape), waits for every
/// rank's arrival and compares its shape with this rank's. After it every
/// rank has finished the previous op, so its areas may be rewritten. Shapes
/// alternate between two areas by op parity: a peer rewrites one only after
/// the next barrier, which this rank enters after reading it.
template <class T>
__global__ void __launch_bounds__(kThreads) barrier_kernel(BarrierParams<T> p) {
  const auto& t = p.t;
  __shared__ uint64_t ops;
  __shared__ int ok;
  __shared__ HtNetShape shape;
  if (threadIdx.x == 0) {
    uint64_t* c = op_counts(t, p.off);
    ops = ++c[0];
    ++c[static_cast<int>(p.op)];
    ok = 1;
    shape = p.shape;
    shape.fits = 1;
    if (p.node_counts)
      for (int m = 0; m < p.off.num_nodes; ++m) shape.fits &= p.node_counts[m] <= p.off.slot_rows;
  }
  __syncthreads();
  const int parity = static_cast<int>(ops & 1u);
  if (static_cast<int>(threadIdx.x) < t.num_contexts && !t.quiet(threadIdx.x)) ok = 0;
  __syncthreads();
  // A failure (reported) marks the op failed: the next kernel's last block
  // then sends nothing, and the op's stores into peers are skipped, so a
  // peer that is late, not dead, never gets this op's rows into areas it
  // may still read; the peers time out naming this rank.
  uint32_t* failed = done_word(t, p.off, kFailed);
  if (!ok) {
    if (threadIdx.x == 0) atomicOr(failed, 1u);
    return;
  }
  if (threadIdx.x == 0) {
    store_shape(t.local_ptr(shape_at(p.off, t.num_ranks, parity, t.num_ranks)), shape);
    __threadfence_system();  // before any put of it
    // Its own rows not fitting a slot: refused on every rank (the others see
    // `fits` differ, or do not fit either and report it themselves).
    if (!shape.fits) {
      report_bad_shape(t.diag, t.rank, t.rank, kHtNetShapeFields * shape.op + 5, 1, 0);
      atomicOr(done_word(t, p.off, kFailed), 1u);
    }
  }
  __syncthreads();
  // Every rank's arrival, with this op's shape
  for (int r = threadIdx.x; r < t.num_ranks; r += blockDim.x)
    if (r != t.rank)
      put_words_signal(t, r, shape_at(p.off, t.num_ranks, parity, t.rank),
                       shape_at(p.off, t.num_ranks, parity, t.num_ranks), kHtNetShapeFields,
                       sig(t, HtNetSignal::kBarrier, t.rank));
  for (int r = threadIdx.x; r < t.num_ranks; r += blockDim.x) {
    if (r == t.rank) continue;
    if (!t.wait_signal(sig(t, HtNetSignal::kBarrier, r), ops, OpId::kBarrier, r)) {
      atomicOr(failed, 1u);
      continue;
    }
    const HtNetShape theirs = load_shape(t.local_ptr(shape_at(p.off, t.num_ranks, parity, r)));
    const int* mine_f = reinterpret_cast<const int*>(&shape);
    const int* their_f = reinterpret_cast<const int*>(&theirs);
    for (int i = 0; i < kHtNetShapeFields; ++i)
      if (mine_f[i] != their_f[i]) {
        report_bad_shape(t.diag, t.rank, r, kHtNetShapeFields * shape.op + i, mine_f[i],
                         their_f[i]);
        atomicOr(failed, 1u);
        break;
      }
  }
}

/// Whether the op's barrier failed (kFailed, before any block of the next
/// kernel counted itself).
template <class T>
__device__ __forceinline__ bool barrier_failed(const T& t, const HtNetOffsets& o) {
  return *static_cast<volatile uint32_t*>(done_word(t, o, kFailed)) != 0u;
}

template <class T>
inline void launch_barrier(const T& t, const HtNetOffsets& off, HtNetOp op, HtNetShape shape,
                           const int* node_counts, cudaStream_t stream) {
  BarrierParams<T> p{off, op, shape, node_counts, t};
  barrier_kernel<T><<<1, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

// ---- dispatch ------------------------------------------------------------------

template <class T>
struct DispatchParams : HtNetDispatchArgs {
  T t;
};

/// The byte offsets of a record's fields after the payload.
struct RecordFields {
  int scales, ids, weights, token, mask, index, src, pos;
  __device__ RecordFields(int hidden_bytes, int S, int K) {
    scales = hidden_bytes;
    ids = scales + 4 * S;
    weights = ids + 4 * K;
    token = weights + 4 * K;
    mask = token + 4;
    index = mask + 4;
    src = index + 4;
    pos = src + 4;  ///< int [L]: the record's row among the source's rows at each local rank
  }
};

/// Word `i` after a record's payload (RecordFields::scales on): token
/// `tok`'s S scales, then its K expert ids, then its K weights (0 without
/// topk_weights), as int bits.
__device__ __forceinline__ int record_extra(const HtNetDispatchArgs& p, int tok, int i, int S,
                                            int K) {
  if (i < S)
    return __float_as_int(p.x_scales[tok * p.scale_stride_token + i * p.scale_stride_channel]);
  if (i < S + K) return static_cast<int>(p.topk_idx[static_cast<int64_t>(tok) * K + (i - S)]);
  return p.topk_weights
             ? __float_as_int(p.topk_weights[static_cast<int64_t>(tok) * K + (i - S - K)])
             : 0;
}

/// A word peers or the network wrote during this kernel (past L1).
__device__ __forceinline__ int ld_int(const void* p) {
  return *static_cast<const volatile int*>(p);
}
__device__ __forceinline__ float ld_float(const void* p) {
  return *static_cast<const volatile float*>(p);
}

__device__ __forceinline__ int* word_at(uint8_t* rec, int off) {
  return reinterpret_cast<int*>(rec + off);
}

/// One warp (`lane` of 32, all calling) packs token `tok`'s record for node
/// m into `rec`: the payload, the extra words, its row among the source's
/// rows at each of node m's local ranks (-1 where it does not go), the mask
/// of those ranks, the token, its index `j` in the source's stream to node m
/// and the source rank. kU: the payload copy's 16-byte loads in flight per lane.
template <int kU = 4>
__device__ __forceinline__ void pack_record(const HtNetDispatchArgs& p, const RecordFields& f,
                                            uint8_t* rec, int tok, int m, int j, int src,
                                            int num_ranks, int ranks_per_node, int lane) {
  const int L = ranks_per_node, S = p.num_scales, K = p.num_topk;
  warp_copy<false, kU>(rec, p.x + static_cast<int64_t>(tok) * p.x_row_bytes, p.hidden_bytes, lane);
  for (int i = lane; i < S + 2 * K; i += 32)
    word_at(rec, f.scales + 4 * i)[0] = record_extra(p, tok, i, S, K);
  const int at = lane < L ? p.rank_pos[static_cast<int64_t>(tok) * num_ranks + m * L + lane] : -1;
  if (lane < L) word_at(rec, f.pos)[lane] = at;
  const unsigned mask = __ballot_sync(0xffffffffu, lane < L && at >= 0);
  if (lane == 0) {
    *word_at(rec, f.token) = tok;
    *word_at(rec, f.mask) = static_cast<int>(mask);
    *word_at(rec, f.index) = j;
    *word_at(rec, f.src) = src;
  }
}

/// One warp (`lane` of 32, all calling) unpacks the record `rec` (written by
/// peers or the network during this kernel) into output row `row`: the
/// payload, the scales, the top-k ids rebased to this rank's experts [lo, lo
/// + epr) (-1 and weight 0 elsewhere), recv_src_idx and recv_meta. kU as
/// pack_record's.
template <int kU = 4>
__device__ __forceinline__ void unpack_record(const HtNetDispatchArgs& p, const RecordFields& f,
                                              const uint8_t* rec, int row, int lo, int epr,
                                              int lane) {
  const int S = p.num_scales, K = p.num_topk;
  warp_copy<true, kU>(p.recv_x + static_cast<int64_t>(row) * p.hidden_bytes, rec, p.hidden_bytes,
                      lane);
  for (int i = lane; i < S; i += 32)
    p.recv_scales[static_cast<int64_t>(row) * S + i] =
        ld_float(reinterpret_cast<const float*>(rec + f.scales) + i);
  for (int i = lane; i < K; i += 32) {
    const int e = ld_int(reinterpret_cast<const int*>(rec + f.ids) + i);
    const bool mine = e >= lo && e < lo + epr;
    if (p.recv_topk_idx) p.recv_topk_idx[static_cast<int64_t>(row) * K + i] = mine ? e - lo : -1;
    if (p.recv_topk_weights)
      p.recv_topk_weights[static_cast<int64_t>(row) * K + i] =
          mine ? ld_float(reinterpret_cast<const float*>(rec + f.weights) + i) : 0.0f;
  }
  if (lane == 0) {
    p.recv_src_idx[row] = ld_int(rec + f.token);
    p.recv_meta[3 * row] = ld_int(rec + f.src);
    p.recv_meta[3 * row + 1] = ld_int(rec + f.index);
    p.recv_meta[3 * row + 2] = ld_int(rec + f.mask);
  }
}

/// A num_worst_tokens dispatch's count exchange, on the GPU (no host wait):
/// each rank puts its count row (tokens, whether the caller's
/// num_tokens_per_rank disagrees with its routing, rows per rank, rows per
/// node) to every rank, then makes from all rows what the host makes
/// otherwise: the route table, rank_prefix_matrix and source_num_tokens. A
/// disagreeing layout is refused on every rank (every rank sees the flag), a
/// rank receiving more rows than num_worst_tokens is reported (the rows past
/// it are dropped). One block.
template <class T>
__global__ void __launch_bounds__(kThreads) exchange_kernel(DispatchParams<T> p) {
  const auto& t = p.t;
  const int R = t.num_ranks, N = p.off.num_nodes, L = p.off.ranks_per_node;
  const int ci = p.off.count_ints, me = t.rank, n = me / L, l = me % L;
  __shared__ uint64_t seq;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    seq = ++op_counts(t, p.off)[3];  // exchanges so far: the same on every rank
    ok = !barrier_failed(t, p.off);
  }
  __syncthreads();
  if (!ok) return;  // the send kernel's last block sees the failure
  auto* rows = reinterpret_cast<int*>(t.local_ptr(p.off.count_rows));  // [R + 1][ci]
  int* own = rows + static_cast<std::size_t>(R) * ci;
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int d = threadIdx.x; d < R; d += blockDim.x)
    if (p.caller_rank_counts[d] != p.route_counts[d]) bad = 1;
  __syncthreads();
  for (int i = threadIdx.x; i < ci; i += blockDim.x)
    own[i] = i == 0 ? p.num_tokens : (i == 1 ? bad : p.route_counts[i - 2]);
  __threadfence_system();  // before any put of it
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x)
    if (r != me)
      put_words_signal(t, r, p.off.count_rows + 4u * ci * static_cast<std::size_t>(me),
                       p.off.count_rows + 4u * ci * static_cast<std::size_t>(R), ci,
                       sig(t, HtNetSignal::kCounts, me));
  for (int i = threadIdx.x; i < ci; i += blockDim.x)
    rows[static_cast<std::size_t>(me) * ci + i] = own[i];
  if (!wait_peers(
          t, HtNetSignal::kCounts, R, [&](int r) { return r == me ? -1 : r; }, seq,
          OpId::kDispatch))
    ok = 0;
  __syncthreads();
  auto row = [&](int src, int i) {
    return static_cast<const volatile int*>(rows)[static_cast<std::size_t>(src) * ci + i];
  };
  for (int src = threadIdx.x; ok && src < R; src += blockDim.x)
    if (row(src, 1) != 0) {
      report_bad_shape(t.diag, me, src,
                       kHtNetShapeFields * static_cast<int>(HtNetOp::kDispatch) + 6, 0, 1);
      ok = 0;
    }
  __syncthreads();
  if (!ok) {
    if (threadIdx.x == 0) atomicOr(done_word(t, p.off, kFailed), 1u);
    return;
  }
  // rank_prefix_matrix [s][d]: rows sources 0..s send to d; each source's tokens
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    int acc = 0;
    for (int src = 0; src < R; ++src) {
      acc += row(src, 2 + d);
      p.rank_prefix_matrix[static_cast<std::size_t>(src) * R + d] = acc;
    }
  }
  for (int src = threadIdx.x; src < R; src += blockDim.x) p.source_num_tokens[src] = row(src, 0);
  __syncthreads();
  const HtNetTable tab = HtNetTable::make(N, L);
  const int* rpm = p.rank_prefix_matrix;
  for (int m = threadIdx.x; m < N; m += blockDim.x) {
    p.table_out[tab.fwd_rows + m] = row(m * L + l, 2 + R + n);  // node m's source to this node
    p.table_out[tab.node_rows + m] = row(me, 2 + R + m);
  }
  for (int i = threadIdx.x; i < L * N; i += blockDim.x) {
    const int d = i / N, m = i % N, src = m * L + l, dest = n * L + d;
    p.table_out[tab.stage_base + i] =
        src > 0 ? rpm[static_cast<std::size_t>(src - 1) * R + dest] : 0;
  }
  if (threadIdx.x == 0) {
    const int got = rpm[static_cast<std::size_t>(R - 1) * R + me];
    p.table_out[tab.recv_rows] = got;
    if (got > p.num_worst)
      dev::report(t.diag, DiagCode::kTooManyTokens, OpId::kDispatch, me, -1, -1,
                  static_cast<uint32_t>(p.num_worst), static_cast<uint32_t>(got - 1));
  }
}

/// Every warp takes tokens in turn and writes each one's record into the
/// send slot of every node it reaches (its own node's slot too: the records
/// this rank forwards itself). The last block puts each other node's slot to
/// the rank with this rank's local index there and signals it.
template <class T>
__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(DispatchParams<T> p) {
  const auto& t = p.t;
  const int lane = threadIdx.x % 32;
  const int L = p.off.ranks_per_node, N = p.off.num_nodes, R = t.num_ranks;
  const RecordFields f(p.hidden_bytes, p.num_scales, p.num_topk);
  for (int tok = blockIdx.x * kWarps + threadIdx.x / 32; tok < p.num_tokens;
       tok += gridDim.x * kWarps) {
    for (int m = 0; m < N; ++m) {
      const int j = p.send_pos[static_cast<int64_t>(tok) * N + m];
      if (j < 0) continue;
      uint8_t* rec = reinterpret_cast<uint8_t*>(t.local_ptr(p.off.send)) + m * p.off.slot_bytes +
                     static_cast<std::size_t>(j) * p.off.row_bytes;
      pack_record(p, f, rec, tok, m, j, t.rank, R, L, lane);
    }
  }
  if (!last_block_ok(t, p.off, kDoneSend, true)) return;
  put_node_slots(t, p.off, p.table + HtNetTable::make(N, L).node_rows, HtNetSignal::kDispatchNet,
                 p.split_puts);
}

/// The records of each node's source with this rank's local index (from the
/// network, or this rank's own for its node) go to each local rank they
/// reach, at the row the source computed (its running index there, plus
/// where that source's rows start); each record's mask is kept for the
/// combine. Every warp takes records in turn across all source nodes; every
/// block first waits for every source. The last block signals every local
/// rank.
template <class T>
__global__ void __launch_bounds__(kThreads) dispatch_forward_kernel(DispatchParams<T> p) {
  const auto& t = p.t;
  const int L = p.off.ranks_per_node, N = p.off.num_nodes;
  const int n = t.rank / L, l = t.rank % L, lane = threadIdx.x % 32;
  const HtNetTable tab = HtNetTable::make(N, L);
  const RecordFields f(p.hidden_bytes, p.num_scales, p.num_topk);
  // The sources of this rank's local index in the other nodes
  const bool ok = wait_peers(
      t, HtNetSignal::kDispatchNet, N, [&](int m) { return m == n ? -1 : m * L + l; },
      op_counts(t, p.off)[1], OpId::kDispatch);
  const int gw = blockIdx.x * kWarps + threadIdx.x / 32, nw = gridDim.x * kWarps;
  int first = 0;  // records of the nodes before m
  for (int m = 0; ok && m < N; ++m) {
    const int rows = p.table[tab.fwd_rows + m];
    const uint8_t* area =
        reinterpret_cast<const uint8_t*>(t.local_ptr(m == n ? p.off.send : p.off.recv)) +
        m * p.off.slot_bytes;
    for (int j = (gw - first % nw + nw) % nw; j < rows; j += nw) {
      const uint8_t* rec = area + static_cast<std::size_t>(j) * p.off.row_bytes;
      const int k = lane < L ? ld_int(rec + f.pos + 4 * lane) : -1;
      // Lane d: the row at local rank d, if the token goes there and the row
      // fits its stage (past num_worst_tokens it is dropped: reported by the
      // exchange, and the combine then counts it as zero).
      const int at_d = k >= 0 ? p.table[tab.stage_base + lane * N + m] + k : -1;
      const int mask = static_cast<int>(__ballot_sync(kFull, at_d >= 0 && at_d < p.off.stage_rows));
      if (lane == 0) {
        const int64_t at = static_cast<int64_t>(m) * p.off.slot_rows + j;
        p.fwd_mask[at] = mask;
        p.fwd_token[at] = ld_int(rec + f.token);
      }
      for (int d = 0; d < L; ++d) {
        if (!((mask >> d) & 1)) continue;
        const int row = __shfl_sync(kFull, at_d, d);
        uint8_t* dst = reinterpret_cast<uint8_t*>(
            t.lsa_ptr(n * L + d, p.off.stage + static_cast<std::size_t>(row) * p.off.row_bytes));
        warp_copy<true, 4>(dst, rec, static_cast<int>(p.off.row_bytes), lane);
      }
    }
    first += rows;
  }
  if (!last_block_ok(t, p.off, kDoneForward, ok)) return;
  for (int d = threadIdx.x; d < L; d += blockDim.x)
    signal_all_contexts(t, n * L + d, sig(t, HtNetSignal::kDispatchNvl, t.rank));
}

/// Waits for the node's forwarders, then unpacks the stage into the outputs
/// (top-k ids rebased to this rank's experts, -1 and weight 0 elsewhere).
template <class T>
__global__ void __launch_bounds__(kThreads) dispatch_recv_kernel(DispatchParams<T> p) {
  const auto& t = p.t;
  const int L = p.off.ranks_per_node, n = t.rank / L;
  const int lane = threadIdx.x % 32;
  const int S = p.num_scales, K = p.num_topk;
  const RecordFields f(p.hidden_bytes, S, K);
  // The node's forwarders
  if (!wait_peers(
          t, HtNetSignal::kDispatchNvl, L, [&](int d) { return n * L + d; }, op_counts(t, p.off)[1],
          OpId::kDispatch))
    return;
  const int epr = p.num_experts / t.num_ranks, lo = t.rank * epr;
  const uint8_t* stage = reinterpret_cast<const uint8_t*>(t.local_ptr(p.off.stage));
  const HtNetTable tab = HtNetTable::make(p.off.num_nodes, L);
  const int rows = min(p.num_recv_rows, p.table[tab.recv_rows]);  // num_worst_tokens: <= it
  for (int row = blockIdx.x * kWarps + threadIdx.x / 32; row < rows; row += gridDim.x * kWarps) {
    unpack_record(p, f, stage + static_cast<std::size_t>(row) * p.off.row_bytes, row, lo, epr,
                  lane);
  }
}

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

/// Thread 0 of a polling role, after a pass over its `inputs` (left[i]
/// records still to come from input i, peer(i) its rank): a pass that moved
/// something restarts the idle clock; otherwise false (after reporting
/// kTimeout naming the first input still owed) once nothing moved for the
/// transport's deadline, or when another wait of this launch already failed.
template <class T, class Peer>
__device__ __forceinline__ bool ring_pass_ok(const T& t, bool moved, uint64_t& idle_since,
                                             const int* left, int inputs, Peer peer, int channel,
                                             OpId op = OpId::kDispatch) {
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
/// tokens for node m in batches of up to one per warp (kRingBatch): the
/// batch's room in the send ring (after credits from forwarder(me, m)), each
/// warp writing one record, then a put to the forwarder's ring every
/// net_chunk records (split where the ring wraps) with a tail add.
template <class T>
__device__ bool ring_send(const DispatchParams<T>& p, const T& t, int c, uint64_t op) {
  const plan::HtRingRegion& g = p.ring;
  const int L = g.ranks_per_node, N = g.num_nodes(), R = t.num_ranks, me = t.rank;
  const int n = me / L, l = me % L, S = p.num_scales, K = p.num_topk;
  const plan::ChannelSplit split{p.num_tokens, g.geometry.channels};
  const int first = split.first(c), end = split.end(c);
  const RecordFields f(p.hidden_bytes, S, K);
  const uint32_t slots = static_cast<uint32_t>(g.geometry.net_slots);
  const int batch_max = min(kRingBatch, g.geometry.net_slots);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  __shared__ int cnt_node[kMaxRanks], cnt_rank[kMaxRanks];
  __shared__ int ok, s_wait, b_n, b_scan, b_tok[kRingBatch], b_j[kRingBatch];
  __shared__ uint64_t sent, pending;
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
  __syncthreads();
  for (int m = 0; m < N; ++m) {
    const int fwd = m * L + l;
    const int credit = ring_sig(t, HtRingSignal::kNetCredit, c, fwd);
    if (threadIdx.x == 0) {
      sent = pending = *ring_base(t, g, HtRingBase::kNetSent, c, m);
      b_scan = first;
    }
    __syncthreads();
    const uint64_t base = sent;
    // The records written since `pending` go out (block-uniform: shared)
    auto flush = [&] {
      const uint64_t to = sent;
      if (pending == to) return;
      ring_put_records(t, g, c, m, fwd, pending, to);
      if (threadIdx.x == 0) pending = to;
      __syncthreads();
    };
    while (ok) {
      // Warp 0 collects the next batch: the first tokens from b_scan on
      // that go to node m, in token order, at most batch_max and no more
      // than the current put has left (a put carries at most net_chunk;
      // sent - pending < net_chunk here, the last batch's flush saw to it).
      if (warp == 0) {
        const int cap = min(batch_max, g.geometry.net_chunk - static_cast<int>(sent - pending));
        int got = 0, pos = b_scan;
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
          b_scan = min(pos, end);
        }
      }
      __syncthreads();
      const int k = b_n;
      if (k == 0) break;
      if (threadIdx.x == 0)
        s_wait = sent + k > slots && t.read_signal(credit, fwd) < sent + k - slots;
      __syncthreads();
      if (s_wait) {
        // A full ring: what is written but not yet put goes first (the
        // forwarder frees slots only for records it got), then wait for room
        // for a whole put (or the rest), not just this batch: freeing a few
        // slots at a time would make every later put a small one.
        flush();
        if (threadIdx.x == 0) {
          const uint64_t rest = static_cast<uint64_t>(cnt_node[m]) - (sent - base);
          uint64_t room = min(rest, static_cast<uint64_t>(g.geometry.net_chunk));
          room = min(max(room, static_cast<uint64_t>(k)), static_cast<uint64_t>(slots));
          if (!t.wait_signal(credit, sent + room - slots, OpId::kDispatch, fwd)) ok = 0;
        }
        __syncthreads();
        if (!ok) break;
      }
      if (warp < k) {
        const int tok = b_tok[warp];
        // (this node's records straight into its own ring: no copy to put)
        uint8_t* rec = reinterpret_cast<uint8_t*>(t.local_ptr(
            m == n ? g.net_slot(c, n, sent + warp) : g.net_send_slot(c, m, sent + warp)));
        pack_record<kRingCopy>(p, f, rec, tok, m, b_j[warp], me, R, L, lane);
      }
      __syncthreads();
      if (threadIdx.x == 0) sent += k;
      __syncthreads();
      if (sent - pending >= static_cast<uint64_t>(g.geometry.net_chunk)) flush();
    }
    if (ok) flush();
    if (threadIdx.x == 0) *ring_base(t, g, HtRingBase::kNetSent, c, m) = sent;
    __syncthreads();
    if (!ok) return false;
  }
  return true;
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
  // Every block counts; the last clears the barrier's failure word.
  last_block_ok(p.t, p.off, kDoneSend, done);
}

template <class T>
void dispatch_for(const T& t, const HtNetDispatchArgs& a, cudaStream_t stream) {
  DispatchParams<T> p{};
  static_cast<HtNetDispatchArgs&>(p) = a;
  p.t = t;
  launch_barrier(t, a.off, HtNetOp::kDispatch,
                 {static_cast<int>(HtNetOp::kDispatch), a.hidden_bytes, a.num_scales, a.num_topk,
                  a.num_worst, 1, 0, a.use_rings ? a.ring.layout_word() : 0},
                 a.route_counts ? a.route_counts + t.num_ranks : nullptr, stream);
  if (a.route_counts) {
    exchange_kernel<T><<<1, kThreads, 0, stream>>>(p);
    EPX_CUDA_CHECK(cudaGetLastError());
  }
  if (a.use_rings) {
    launch_ring_kernel(ring_dispatch_kernel<T>, p, a.ring.geometry.channels, stream);
    return;
  }
  dispatch_send_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
  if (a.split_puts)
    launch_node_put(t, a.off,
                    a.table + HtNetTable::make(a.off.num_nodes, a.off.ranks_per_node).node_rows,
                    HtNetSignal::kDispatchNet, a.num_blocks, stream);
  dispatch_forward_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
  dispatch_recv_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

// ---- combine -------------------------------------------------------------------

template <class T>
struct CombineParams : HtNetCombineArgs {
  T t;
};

/// Warp-wide: a combine record of rows summed as sum_rows sums them
/// (`row(i)`: record i's start, a BF16 row of H then K float weights, or
/// nullptr), into dst_x, and the weights' float32 sums in the same order
/// into dst_w (nullable).
template <bool kPairs = true, class Row>
__device__ __forceinline__ void sum_records(int4* dst_x, float* dst_w, int n, Row row,
                                            const int4* bias0, const int4* bias1, int H, int K,
                                            int lane) {
  sum_rows<kPairs>(
      dst_x, H / 8, n, [&](int i) { return reinterpret_cast<const int4*>(row(i)); }, bias0, bias1,
      lane);
  if (dst_w == nullptr) return;
  for (int k = lane; k < K; k += 32) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i)
      if (const uint8_t* r = row(i)) acc += ld_float(reinterpret_cast<const float*>(r + 2 * H) + k);
    dst_w[k] = acc;
  }
}

/// Warp-wide: received row `row` of the combine's x and its weights into
/// `dst` (a combine record), zeros past x's rows. kU as warp_copy's.
template <int kU>
__device__ __forceinline__ void return_row(const HtNetCombineArgs& p, uint8_t* dst, int row,
                                           int lane) {
  const int H = p.hidden, K = p.num_topk;
  if (row < p.num_x_rows) {
    warp_copy<false, kU>(dst, reinterpret_cast<const uint8_t*>(p.x + static_cast<int64_t>(row) * H),
                         2 * H, lane);
  } else {
    for (int i = lane; i < 2 * H / 16; i += 32)
      dev::st_na(reinterpret_cast<int4*>(dst) + i, make_int4(0, 0, 0, 0));
  }
  for (int k = lane; k < K; k += 32)
    reinterpret_cast<float*>(dst + 2 * H)[k] =
        p.topk_weights && row < p.num_x_rows ? p.topk_weights[static_cast<int64_t>(row) * K + k]
                                             : 0.0f;
}

/// Each received row goes back over NVLink to the forwarder it came
/// through, into its stage slot (this rank, the source's node) at the
/// record's index; the last block signals every local rank.
template <class T>
__global__ void __launch_bounds__(kThreads) combine_return_kernel(CombineParams<T> p) {
  const auto& t = p.t;
  const int L = p.off.ranks_per_node, N = p.off.num_nodes, n = t.rank / L, me_l = t.rank % L;
  const int lane = threadIdx.x % 32;
  // No store into a peer when the op failed; with num_worst_tokens the rows
  // that arrived (at most the outputs' rows).
  const int rows = barrier_failed(t, p.off)
                       ? 0
                       : min(p.num_recv_rows, p.table[HtNetTable::make(N, L).recv_rows]);
  for (int row = blockIdx.x * kWarps + threadIdx.x / 32; row < rows; row += gridDim.x * kWarps) {
    const int src = p.recv_meta[3 * row], j = p.recv_meta[3 * row + 1];
    const int fwd = n * L + src % L, m = src / L;
    auto* dst = reinterpret_cast<uint8_t*>(
        t.lsa_ptr(fwd, p.off.stage + (static_cast<std::size_t>(me_l) * N + m) * p.off.slot_bytes +
                           static_cast<std::size_t>(j) * p.off.row_bytes));
    return_row<4>(p, dst, row, lane);
  }
  if (!last_block_ok(t, p.off, kDoneReturn, true)) return;
  for (int d = threadIdx.x; d < L; d += blockDim.x)
    signal_all_contexts(t, n * L + d, sig(t, HtNetSignal::kCombineReturn, t.rank));
}

/// Waits for the node's ranks, then sums each forwarded record's rows (the
/// ranks in its mask, ascending) in float32, rounds to BF16 and writes the
/// row to its source's send slot (or, for this rank's own records, straight
/// to its receive slot). The last block puts each other node's slot to its
/// source and signals it.
template <class T>
__global__ void __launch_bounds__(kThreads) combine_node_sum_kernel(CombineParams<T> p) {
  const auto& t = p.t;
  const int L = p.off.ranks_per_node, N = p.off.num_nodes;
  const int n = t.rank / L, l = t.rank % L;
  const int lane = threadIdx.x % 32, H = p.hidden, K = p.num_topk;
  const HtNetTable tab = HtNetTable::make(N, L);
  const int slot_rows = p.off.slot_rows;
  // The node's ranks
  const bool ok = wait_peers(
      t, HtNetSignal::kCombineReturn, L, [&](int d) { return n * L + d; }, op_counts(t, p.off)[2],
      OpId::kCombine);
  const uint8_t* stage = reinterpret_cast<const uint8_t*>(t.local_ptr(p.off.stage));
  int first = 0;  // rows of the nodes before m
  const int gw = blockIdx.x * kWarps + threadIdx.x / 32, nw = gridDim.x * kWarps;
  for (int m = 0; ok && m < N; ++m) {
    const int rows = p.table[tab.fwd_rows + m];
    auto* out = reinterpret_cast<uint8_t*>(t.local_ptr(m == n ? p.off.recv : p.off.send)) +
                m * p.off.slot_bytes;
    // Rows are numbered across the nodes so that every warp has work.
    for (int w = (gw - first % nw + nw) % nw; w < rows; w += nw) {
      const int mask = p.fwd_mask[static_cast<int64_t>(m) * slot_rows + w];
      const std::size_t at = static_cast<std::size_t>(w) * p.off.row_bytes;
      sum_records(
          reinterpret_cast<int4*>(out + at), reinterpret_cast<float*>(out + at + 2 * H), L,
          [&](int d) -> const uint8_t* {
            return (mask >> d) & 1
                       ? stage + (static_cast<std::size_t>(d) * N + m) * p.off.slot_bytes + at
                       : nullptr;
          },
          nullptr, nullptr, H, K, lane);
    }
    first += rows;
  }
  if (!last_block_ok(t, p.off, kDoneNodeSum, ok)) return;
  put_node_slots(t, p.off, p.table + tab.fwd_rows, HtNetSignal::kCombineNet, p.split_puts);
}

/// Waits for every other node's sums, then adds, per token, the rows of the
/// nodes it reached in ascending node order in float32, then the biases, and
/// rounds to BF16; the weights follow in float32.
template <class T>
__global__ void __launch_bounds__(kThreads) combine_finish_kernel(CombineParams<T> p) {
  const auto& t = p.t;
  const int L = p.off.ranks_per_node, N = p.off.num_nodes;
  const int n = t.rank / L, l = t.rank % L;
  const int lane = threadIdx.x % 32, H = p.hidden, K = p.num_topk;
  // The forwarders of this rank's local index in the other nodes
  if (!wait_peers(
          t, HtNetSignal::kCombineNet, N, [&](int m) { return m == n ? -1 : m * L + l; },
          op_counts(t, p.off)[2], OpId::kCombine))
    return;
  const uint8_t* recv = reinterpret_cast<const uint8_t*>(t.local_ptr(p.off.recv));
  for (int tok = blockIdx.x * kWarps + threadIdx.x / 32; tok < p.num_tokens;
       tok += gridDim.x * kWarps) {
    const int* pos = p.send_pos + static_cast<int64_t>(tok) * N;
    auto bias = [&](const uint16_t* b) {
      return b ? reinterpret_cast<const int4*>(b + static_cast<int64_t>(tok) * H) : nullptr;
    };
    sum_records(
        reinterpret_cast<int4*>(p.combined_x + static_cast<int64_t>(tok) * H),
        p.combined_topk_weights ? p.combined_topk_weights + static_cast<int64_t>(tok) * K : nullptr,
        N,
        [&](int m) -> const uint8_t* {
          const int j = pos[m];
          return j >= 0
                     ? recv + m * p.off.slot_bytes + static_cast<std::size_t>(j) * p.off.row_bytes
                     : nullptr;
        },
        bias(p.bias0), bias(p.bias1), H, K, lane);
  }
}

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
  if (threadIdx.x == 0) ok = barrier_failed(p.t, p.off) ? 0 : 1;
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
  // Every block counts; the last clears the barrier's failure word.
  last_block_ok(p.t, p.off, kDoneReturn, done);
}

/// A cooperative launch of 3 channels blocks (every block resident, or the
/// launch fails naming the SM count: roles wait on each other across ranks).
template <class P>
void launch_ring_kernel(void (*kernel)(P), const P& p, int channels, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(3 * channels));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  EPX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

template <class T>
void combine_for(const T& t, const HtNetCombineArgs& a, cudaStream_t stream) {
  CombineParams<T> p{};
  static_cast<HtNetCombineArgs&>(p) = a;
  p.t = t;
  launch_barrier(t, a.off, HtNetOp::kCombine,
                 {static_cast<int>(HtNetOp::kCombine), a.hidden, a.num_topk, 0, a.num_worst, 1, 0,
                  a.use_rings ? a.ring.layout_word() : 0},
                 nullptr, stream);
  if (a.use_rings) {
    launch_ring_kernel(ring_combine_kernel<T>, p, a.ring.geometry.channels, stream);
    return;
  }
  combine_return_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
  combine_node_sum_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
  if (a.split_puts)
    launch_node_put(t, a.off,
                    a.table + HtNetTable::make(a.off.num_nodes, a.off.ranks_per_node).fwd_rows,
                    HtNetSignal::kCombineNet, a.num_blocks, stream);
  combine_finish_kernel<T><<<a.num_blocks, kThreads, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::kernels::internode

namespace epx::kernels {

/// The barrier, then send, forward and receive, for transport type T.
template <class T>
void launch_ht_net_dispatch_for(const T& t, const HtNetDispatchArgs& a, cudaStream_t stream) {
  internode::dispatch_for(t, a, stream);
}
/// The barrier, then return, node sum and finish.
template <class T>
void launch_ht_net_combine_for(const T& t, const HtNetCombineArgs& a, cudaStream_t stream) {
  internode::combine_for(t, a, stream);
}
/// Loads the kernels of transport type T now (cudaFuncGetAttributes).
template <class T>
void preload_ht_net_kernels_of() {
  using namespace internode;
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, barrier_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, exchange_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_send_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_forward_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_recv_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ring_dispatch_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ring_combine_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_return_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_node_sum_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_finish_kernel<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, node_put_kernel<T>));
}

}  // namespace epx::kernels
