// kernels/internode/node_put.cuh - split puts: node_put_kernel and its launcher.
#pragma once

#include "kernels/internode/common.cuh"

namespace epx::kernels::internode {

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

}  // namespace epx::kernels::internode
