// kernels/internode/dispatch.cuh - the whole-call dispatch kernels: exchange, send,
// forward and receive.
#pragma once

#include "kernels/internode/barrier.cuh"

namespace epx::kernels::internode {

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

}  // namespace epx::kernels::internode
