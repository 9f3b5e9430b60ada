// kernels/internode/combine.cuh - the whole-call combine kernels: return, node sum and
// finish.
#pragma once

#include "kernels/internode/dispatch_launch.cuh"

namespace epx::kernels::internode {

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

}  // namespace epx::kernels::internode
