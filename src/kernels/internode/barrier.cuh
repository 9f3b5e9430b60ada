// kernels/internode/barrier.cuh - the barrier kernel every op begins with, and its launcher.
#pragma once

#include "kernels/internode/node_put.cuh"

namespace epx::kernels::internode {

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

}  // namespace epx::kernels::internode
