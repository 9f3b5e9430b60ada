// kernels/internode/common.cuh - constants, finished-block words and the node-slot put
// helpers shared by the high-throughput kernels across nodes.
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

}  // namespace epx::kernels::internode
