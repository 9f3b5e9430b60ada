// High-throughput dispatch and combine across nodes (issue 25), the first
// version of docs/internode_ht.md: a token crosses the network once per
// destination node, to the rank with its source's local index there, which
// forwards it over NVLink to the ranks of its node that host its experts;
// the combine returns the rows the same way and sums each node's rows before
// they cross the network. Areas are sized for the whole call
// (plan::HtNetRegion), the offsets come from plan::InternodeRoute on the
// host (the route table), and a barrier opens every op. Kernels see the
// transport concept only: puts and signals to other nodes, lsa_ptr stores
// within the node.
#include "kernels/internode/kernels.cuh"
#include "kernels/launch_on.hpp"

namespace epx::kernels {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// ---- route ---------------------------------------------------------------------

/// One block per node m: token t's place among this rank's tokens with an
/// expert in m (send_pos) and among those sent to each rank of m
/// (rank_pos), block scans in token order; the counts per node and rank.
/// Column kL of the scans is the node, columns l < L its ranks.
__global__ void __launch_bounds__(1024) route_kernel(HtNetRouteArgs a) {
  const int m = blockIdx.x, L = a.ranks_per_node, R = a.num_ranks;
  const int N = R / L, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
  constexpr int kCols = kMaxRanksPerNode + 1;
  __shared__ int warp_sums[32][kCols];
  __shared__ int base[kCols];
  if (threadIdx.x < kCols) base[threadIdx.x] = 0;
  __syncthreads();
  for (int t0 = 0; t0 < a.num_tokens; t0 += blockDim.x) {
    const int t = t0 + threadIdx.x;
    int mask = 0;
    if (t < a.num_tokens)
      for (int l = 0; l < L; ++l)
        if (a.is_token_in_rank[static_cast<int64_t>(t) * R + m * L + l]) mask |= 1 << l;
    unsigned hit[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const bool in = c < L ? ((mask >> c) & 1) != 0 : c == kMaxRanksPerNode && mask != 0;
      hit[c] = __ballot_sync(kFull, in);
      if (lane == 0) warp_sums[warp][c] = __popc(hit[c]);
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (c >= L && c < kMaxRanksPerNode) continue;
      int before = base[c];
      for (int w = 0; w < warp; ++w) before += warp_sums[w][c];
      const bool in = (hit[c] >> lane) & 1;
      const int pos = in ? before + __popc(hit[c] & ((1u << lane) - 1u)) : -1;
      if (t < a.num_tokens) {
        if (c == kMaxRanksPerNode)
          a.send_pos[static_cast<int64_t>(t) * N + m] = pos;
        else
          a.rank_pos[static_cast<int64_t>(t) * R + m * L + c] = pos;
      }
    }
    __syncthreads();
    if (threadIdx.x < kCols)
      for (int w = 0; w < nwarps; ++w) base[threadIdx.x] += warp_sums[w][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.x < L) a.rank_counts[m * L + threadIdx.x] = base[threadIdx.x];
  if (threadIdx.x == 0) a.node_counts[m] = base[kMaxRanksPerNode];
}

}  // namespace

void launch_ht_net_route(const HtNetRouteArgs& a, cudaStream_t stream) {
  const int N = a.num_ranks / a.ranks_per_node;
  route_kernel<<<N, 1024, 0, stream>>>(a);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_ht_net_dispatch(const dev::AnyTransport& t, const HtNetDispatchArgs& a,
                            cudaStream_t stream) {
  launch_on(
      t, "dispatch", [&](const auto& tt) { launch_ht_net_dispatch_for(tt, a, stream); },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ht_net_dispatch(tt, a, stream, err, n);
      });
}

void launch_ht_net_combine(const dev::AnyTransport& t, const HtNetCombineArgs& a,
                           cudaStream_t stream) {
  launch_on(
      t, "combine", [&](const auto& tt) { launch_ht_net_combine_for(tt, a, stream); },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ht_net_combine(tt, a, stream, err, n);
      });
}

void preload_ht_net_kernels() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, route_kernel));
  // Across nodes the network transports run these.
  preload_ht_net_kernels_of<dev::ProxyTransport>();
  preload_ht_net_kernels_of<dev::NcclGinTransport>();
}

}  // namespace epx::kernels
