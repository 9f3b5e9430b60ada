// get_dispatch_layout and the high-throughput notify step.
#include <cub/block/block_scan.cuh>

#include "common/check.hpp"
#include "kernels/kernels.hpp"

namespace epx::kernels {
namespace {

constexpr int kLayoutThreads = 256;

/// One thread per token: which ranks (and nodes) it reaches, and per-expert,
/// per-rank and per-node counts (shared-memory histograms flushed with one
/// atomic per bin). Any number of ranks: the token's distinct ranks are kept
/// in a list of at most K, not in a bit mask.
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(LayoutParams p) {
  extern __shared__ int smem[];
  const int num_nodes = p.num_tokens_per_node ? p.num_ranks / p.ranks_per_node : 0;
  int* expert_hist = smem;                   // [E]
  int* rank_hist = smem + p.num_experts;     // [R]
  int* node_hist = rank_hist + p.num_ranks;  // [nodes]
  for (int i = threadIdx.x; i < p.num_experts + p.num_ranks + num_nodes; i += blockDim.x)
    smem[i] = 0;
  __syncthreads();
  const int experts_per_rank = p.num_experts / p.num_ranks;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < p.num_tokens) {
    int ranks[kLayoutMaxTopK];
    int num_ranks_hit = 0;
    for (int k = 0; k < p.num_topk && k < kLayoutMaxTopK; ++k) {
      int64_t e = p.topk_idx[static_cast<int64_t>(t) * p.num_topk + k];
      if (e < 0 || e >= p.num_experts) {
        if (e != -1)
          dev::report(p.diag, DiagCode::kBadExpert, OpId::kLayout, p.rank, -1, k, 0,
                      static_cast<uint32_t>(e), t);
        continue;
      }
      atomicAdd(&expert_hist[e], 1);
      const int r = static_cast<int>(e) / experts_per_rank;
      bool seen = false;
      for (int i = 0; i < num_ranks_hit; ++i) seen = seen || ranks[i] == r;
      if (!seen) ranks[num_ranks_hit++] = r;
    }
    bool* row = p.is_token_in_rank + static_cast<int64_t>(t) * p.num_ranks;
    for (int r = 0; r < p.num_ranks; ++r) row[r] = false;
    for (int i = 0; i < num_ranks_hit; ++i) {
      row[ranks[i]] = true;
      atomicAdd(&rank_hist[ranks[i]], 1);
      if (num_nodes > 0) {  // once per node: the first of the token's ranks there
        const int n = ranks[i] / p.ranks_per_node;
        bool first = true;
        for (int j = 0; j < i; ++j) first = first && ranks[j] / p.ranks_per_node != n;
        if (first) atomicAdd(&node_hist[n], 1);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.num_experts; i += blockDim.x)
    if (expert_hist[i]) atomicAdd(&p.num_tokens_per_expert[i], expert_hist[i]);
  for (int i = threadIdx.x; i < p.num_ranks; i += blockDim.x)
    if (rank_hist[i]) atomicAdd(&p.num_tokens_per_rank[i], rank_hist[i]);
  for (int i = threadIdx.x; i < num_nodes; i += blockDim.x)
    if (node_hist[i]) atomicAdd(&p.num_tokens_per_node[i], node_hist[i]);
}

constexpr int kNotifyThreads = 512;

/// Block 0: barrier (+ count exchange). Blocks 1..R: scan is_token_in_rank
/// column r into send slots and the send list for rank r.
template <class T>
__device__ __forceinline__ void notify_body(const HtNotifyParams<T>& p) {
  const int R = p.t.num_ranks, me = p.t.rank;
  if (blockIdx.x > 0) {
    const int r = blockIdx.x - 1;
    using Scan = cub::BlockScan<int, kNotifyThreads>;
    __shared__ typename Scan::TempStorage tmp;
    __shared__ int carry;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int base = 0; base < p.num_tokens; base += kNotifyThreads) {
      const int t = base + threadIdx.x;
      const int in =
          t < p.num_tokens ? (p.is_token_in_rank[static_cast<int64_t>(t) * R + r] ? 1 : 0) : 0;
      int prefix = 0, total = 0;
      Scan(tmp).ExclusiveSum(in, prefix, total);
      if (t < p.num_tokens) {
        const int slot = in ? carry + prefix : -1;
        p.send_slot[static_cast<int64_t>(t) * R + r] = slot;
        if (in) p.send_list[static_cast<int64_t>(r) * p.num_tokens + slot] = t;
      }
      __syncthreads();
      if (threadIdx.x == 0) carry += total;
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      p.send_counts[r] = carry;
      // Peers size their receive side from num_tokens_per_rank, this rank's
      // sends from is_token_in_rank: they must agree.
      if (carry != p.num_tokens_per_rank[r])
        dev::report(p.diag, DiagCode::kBadLayout, p.op, me, r, -1,
                    static_cast<uint32_t>(p.num_tokens_per_rank[r]), static_cast<uint32_t>(carry));
    }
    return;
  }

  __shared__ uint32_t epoch;
  __shared__ int failed;
  if (threadIdx.x == 0) {
    epoch = plan::next_epoch(*p.op_counter);
    failed = 0;
  }
  __syncthreads();
  const int parity = epoch & 1;
  const int row_ints = p.off.count_row_ints;
  const int epr = p.num_experts / R;
  // My row in every peer (plan::HtRegion::count_row_ints): [tokens I send to
  // each rank, my number of tokens, my picks of each of your experts].
  const int row_used = R + 1 + epr;
  for (int i = threadIdx.x; i < R * row_used; i += blockDim.x) {
    const int dst = i / row_used, j = i % row_used;
    const int v = j < R    ? p.num_tokens_per_rank[j]
                  : j == R ? p.num_tokens
                           : p.num_tokens_per_expert[dst * epr + j - R - 1];
    int* row = reinterpret_cast<int*>(p.t.lsa_ptr(dst, p.off.counts[parity])) + me * row_ints;
    row[j] = v;
  }
  // The main kernel's config fingerprint, published by the barrier flag too.
  if (threadIdx.x < R) publish_config(p.t, p.off, threadIdx.x, epoch);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < R) p.t.lsa_flag(threadIdx.x, p.off.barrier + 4 * me, epoch);
  if (threadIdx.x < R) {
    if (!p.t.wait_flag(p.off.barrier + 4 * threadIdx.x, epoch, p.timeout_ns, p.diag, p.op,
                       threadIdx.x, -1)) {
      atomicExch(&failed, 1);
    } else if (static_cast<int>(threadIdx.x) != me) {
      // The peer's main kernel will use the config it stored: refuse it here, where the
      // host still waits (the dispatch raises before its main kernel runs; that kernel's
      // senders would find the same).
      config_matches(p.t, p.off, epoch, OpId::kDispatch, threadIdx.x, p.diag);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *p.op_counter = epoch;
  if (failed) return;
  const int* rows = reinterpret_cast<const int*>(p.t.local_ptr(p.off.counts[parity]));
  int* host = p.host_counts;  // null with num_worst_tokens: the host reads no counts
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      const int c = rows[s * row_ints + me];
      p.recv_offsets[s] = acc;
      if (host) host[2 + s] = c;
      acc += c;
    }
    p.recv_offsets[R] = acc;
    if (host) host[1] = acc;
  }
  // Column j of the prefix matrix: what ranks 0..s send to j, for each s.
  if (p.rank_prefix_matrix != nullptr && static_cast<int>(threadIdx.x) < R) {
    const int j = threadIdx.x;
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += rows[s * row_ints + j];
      p.rank_prefix_matrix[s * R + j] = acc;
    }
  }
  if (p.source_num_tokens != nullptr && static_cast<int>(threadIdx.x) < R)
    p.source_num_tokens[threadIdx.x] = rows[threadIdx.x * row_ints + R];
  if (host == nullptr) return;
  for (int j = threadIdx.x; j < epr; j += blockDim.x) {
    int c = 0;
    for (int s = 0; s < R; ++s) c += rows[s * row_ints + R + 1 + j];
    const int a = p.expert_alignment;
    host[2 + R + j] = (c + a - 1) / a * a;
  }
}

template <class T>
__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(HtNotifyParams<T> p) {
  notify_body(p);
  if (p.host_counts == nullptr) return;
  // The last block to finish tells the host: by then every count is written
  // and any layout mismatch or timeout is in the diagnostic record.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0 && dev::last_block_done(p.done_blocks)) {
    __threadfence_system();
    *reinterpret_cast<volatile int*>(p.host_counts) = p.host_seq;
  }
}

}  // namespace

void launch_layout(const LayoutParams& p, cudaStream_t stream) {
  const int num_nodes = p.num_tokens_per_node ? p.num_ranks / p.ranks_per_node : 0;
  EPX_CUDA_CHECK(cudaMemsetAsync(p.num_tokens_per_rank, 0, sizeof(int) * p.num_ranks, stream));
  EPX_CUDA_CHECK(cudaMemsetAsync(p.num_tokens_per_expert, 0, sizeof(int) * p.num_experts, stream));
  if (num_nodes > 0)
    EPX_CUDA_CHECK(cudaMemsetAsync(p.num_tokens_per_node, 0, sizeof(int) * num_nodes, stream));
  if (p.num_tokens == 0) return;
  const int blocks = (p.num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  const std::size_t smem = sizeof(int) * (p.num_experts + p.num_ranks + num_nodes);
  if (smem > 48 * 1024)
    EPX_CUDA_CHECK(cudaFuncSetAttribute(layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(p);
  EPX_LAUNCH_CHECK();
}

void launch_ht_notify(const dev::AnyTransport& t, const HtNotifyArgs& a, cudaStream_t stream) {
  HtNotifyParams<dev::LsaTransport> p{};
  static_cast<HtNotifyArgs&>(p) = a;
  p.t = dev::require_node_view(t, "high-throughput dispatch (notify)");
  const int blocks = 1 + p.t.num_ranks;
  notify_kernel<<<blocks, kNotifyThreads, 0, stream>>>(p);
  EPX_LAUNCH_CHECK();
}

void preload_layout_kernels() {
  cudaFuncAttributes a{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, layout_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, notify_kernel<dev::LsaTransport>));
}

}  // namespace epx::kernels
