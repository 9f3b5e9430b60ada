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
#include "kernels/intranode/combine.cuh"
#include "kernels/intranode/dispatch.cuh"
#include "kernels/intranode/pull_dispatch.cuh"

namespace epx::kernels {

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
