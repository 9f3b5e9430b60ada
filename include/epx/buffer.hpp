// epx/buffer.hpp - the communication buffer and every EP operation.
//
// Semantics follow DeepEP V1 (see docs/api.md): dispatch sends each token to
// every rank hosting one of its top-k experts; combine sums the expert outputs
// back. Shapes in comments: T tokens on this rank, H hidden, K top-k,
// R ranks, E experts (E_local = E / R), N tokens received.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epx/communicator.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "epx/event.hpp"
#include "epx/tensor.hpp"

namespace epx {

struct BufferOptions {
  int64_t num_nvl_bytes = 0;   ///< high-throughput buffer (NVLink)
  int64_t num_rdma_bytes = 0;  ///< low-latency buffer
  bool low_latency_mode = false;
  /// Contexts per peer (queue pairs, proxy channels) the network backends use in
  /// parallel (the proxy backend: one thread each, at most 32).
  int num_qps_per_rank = 1;
  bool allow_nvlink_for_low_latency_mode = true;
  bool allow_mnnvl = false;
  /// auto | nvlink | in_process | proxy (EPX_BACKEND overrides "auto"). "auto":
  /// "proxy" when the ranks form several nodes, else "nvlink" ("in_process"
  /// for ranks from Communicator::create_in_process).
  std::string backend = "auto";
  /// Ranks per node (NVLink domain), 1..8, dividing the rank count. 0: the
  /// EPX_RANKS_PER_NODE variable, else the ranks of a host. Less than a host
  /// holds makes virtual nodes: peers in another node are reached only
  /// through the backend's network operations, even where NVLink could.
  int ranks_per_node = 0;
  double timeout_s = 0;  ///< 0: EPX_TIMEOUT_S or 60 s
  Allocator allocator;   ///< empty: default_allocator()
  /// DeepEP's enable_shrink: low-latency ops leave out the ranks of this
  /// rank's mask (low_latency_update_mask_buffer), and a low-latency wait that
  /// passes `timeout_s` masks its peer instead of failing the op.
  bool enable_shrink = false;
  /// The proxy backend's engine, what carries its puts to other nodes:
  /// auto | cuda_ipc | libfabric (EPX_PROXY_ENGINE overrides "auto"). "auto":
  /// cuda_ipc (copy engines, one host) when every rank is on this host, else
  /// libfabric. docs/transport.md says what each needs.
  std::string proxy_engine = "auto";
  /// libfabric's provider for the libfabric engine, as `fi_info -l` names it:
  /// "tcp;ofi_rxm", "shm", "verbs;ofi_rxm", "efa". Empty: EPX_FABRIC_PROVIDER,
  /// else "tcp;ofi_rxm".
  std::string fabric_provider;
  /// The libfabric engine's rails: libfabric domain names (NICs, or the
  /// ports of one NIC) as `fi_info -p <provider>` prints them after
  /// "domain:", comma-separated ("mlx5_0,mlx5_1"); proxy channel c uses
  /// domain c % n. Empty: EPX_FABRIC_DOMAINS, else the provider's first
  /// domain. Every rank must name as many domains, at most one per channel.
  std::string fabric_domains;

  // Algorithm choices. Each is unset by default: the buffer then takes its
  // environment variable's value (kept for compatibility, read when the
  // Buffer is made), else the built-in default named here. A value set here
  // wins over the variable. validate() checks the values set.

  /// Which kernels the high-throughput ops across nodes take
  /// (docs/internode_ht.md): -1 the whole-call kernels where their areas fit
  /// num_nvl_bytes, else the fixed rings with credits (default); 0 the
  /// whole-call kernels only (a call that does not fit raises
  /// kBufferTooSmall); 1 always the rings, default sizes; N in [2, 2^20]
  /// always rings of N records. Unset: EPX_HT_RINGS, else -1.
  std::optional<int> ht_rings;
  /// Across nodes, whether the high-throughput kernels share each node slot's
  /// put among the blocks of a kernel of its own (true) or leave it to the
  /// last block of the kernel that filled the slots (false). Unset:
  /// EPX_NET_SPLIT_PUTS, else the backend decides (split where the SMs copy
  /// the bytes themselves, Backend::puts_copy_on_sms).
  std::optional<bool> net_split_puts;
  /// Whether the low-latency dispatch packs each local expert's rows by source
  /// in the order the sources' token masks arrive (as DeepEP; experimental)
  /// instead of in rank order. Unset: EPX_LL_ARRIVAL_ORDER, else false.
  std::optional<bool> ll_arrival_order;
  /// Across nodes with several contexts per peer, whether the low-latency ops
  /// put token t's rows on context min(t / ceil(maxT / contexts), contexts - 1)
  /// (a contiguous range of tokens per context, so a proxy channel's puts to
  /// a peer merge into plain copies) instead of on context t % contexts.
  /// Unset: EPX_LL_CONTEXT_RANGES, else false.
  std::optional<bool> ll_context_ranges;
  /// SMs the low-latency kernels of this rank use at most, >= 1 (capped at
  /// the SMs the rank may use), leaving the others to other work. Unset:
  /// EPX_LL_SMS, else every SM the rank may use.
  std::optional<int> ll_sms;
  /// How many ops of this Buffer may be queued on the GPU and not yet
  /// finished when another one is called, >= 0 (0: no bound): the
  /// low-latency ops, and the high-throughput ones across nodes. At the
  /// bound the call first waits, with the deadline, for the oldest of them:
  /// a host far ahead of the GPU fills CUDA's launch queue, and a thread
  /// blocked in a launch there can hold up the CUDA calls of the proxy's
  /// threads that the queued kernels wait for. CUDA graph replays are not
  /// counted. Unset: EPX_MAX_OPS_IN_FLIGHT, else the backend's default
  /// (Backend::default_ops_in_flight).
  std::optional<int> max_ops_in_flight;
  /// The proxy backend's CUDA IPC engine: whether its regions are cuMem
  /// allocations (exported as POSIX file descriptors with a process per rank)
  /// and its streams live in a CUDA context of its own (true), so that a
  /// blocking primary-context call of another thread does not hold its
  /// copies; false: cudaMalloc regions with legacy CUDA IPC in the primary
  /// context (docs/limitations.md). Unset: EPX_PROXY_CUMEM, else true with a
  /// process per rank and with more than 4 in-process ranks on a device, false
  /// with up to 4 (the own context is time-sliced with the kernels': slower).
  std::optional<bool> proxy_cumem;

  /// Throws epx::Error(kInvalidArgument) naming the first field whose value
  /// breaks its rule (the Buffer constructor calls it before anything else).
  void validate() const;
};

/// What a backend's network engine has carried for this rank since the
/// Buffer was made (Buffer::network_traffic): the requests its kernels posted
/// (commands), the puts among them and their bytes, the signals, and the
/// writes the engine issued for the puts after merging neighbours (what a NIC
/// would see). Running totals: an op's figures are the difference around it.
struct NetworkTraffic {
  uint64_t commands = 0, puts = 0, put_bytes = 0, signals = 0, writes = 0;
};

/// Per-call stream arguments (DeepEP's previous_event / async_finish /
/// allocate_on_comm_stream). `stream` is the caller's (compute) stream.
struct StreamArgs {
  cudaStream_t stream = nullptr;
  const Event* previous_event = nullptr;
  bool async_finish = false;
  bool allocate_on_comm_stream = false;
};

struct Layout {
  Tensor num_tokens_per_rank;  ///< [R] i32
  /// [num_nodes] i32, tokens with an expert in each node (DeepEP's "RDMA rank");
  /// undefined when the buffer's ranks form one node, as DeepEP returns None.
  Tensor num_tokens_per_rdma_rank;
  Tensor num_tokens_per_expert;  ///< [E] i32
  Tensor is_token_in_rank;       ///< [T, R] bool
  std::optional<Event> event;
};

/// What a dispatch learned about routing; pass it to combine or to a cached
/// dispatch. Device tensors stay valid as long as the handle lives.
struct DispatchHandle {
  int num_ranks = 0, num_tokens = 0, num_recv_tokens = 0, hidden = 0;
  Tensor send_counts;       ///< [R] i32: tokens this rank sends to each rank
  Tensor recv_offsets;      ///< [R + 1] i32: first received row of each source rank, then N
  Tensor is_token_in_rank;  ///< [T, R] bool
  Tensor send_slot;         ///< [T, R] i32: position of token t among those sent to r, or -1
  Tensor send_list;         ///< [R, T] i32: the tokens sent to r, in slot order
  Tensor recv_src_idx;      ///< [N] i32: source token index of each received row
  /// [R, R] i32: [i][j] = tokens ranks 0..i send to rank j (DeepEP's
  /// rank_prefix_matrix; column `rank` ends each source's received rows).
  Tensor rank_prefix_matrix;
  Tensor source_num_tokens;  ///< [R] i32: each rank's number of tokens in this dispatch
  std::vector<int> num_recv_tokens_per_expert;
  std::vector<int> recv_counts;  ///< host copy: rows received from each source

  int ranks_per_node = 0;  ///< > 0: the handle of a dispatch across nodes
  /// Across nodes: the route and the kernels' per-token state its combine and
  /// cached dispatches use (kernel internals, defined in the library's
  /// src/core/internode_handle.hpp); null within a node.
  struct Internode;
  std::shared_ptr<Internode> internode;
  /// Whether this dispatch across nodes, and so its combine and the cached
  /// dispatches of this handle, went through the fixed rings instead of the
  /// whole-call areas (docs/internode_ht.md); false within a node.
  bool took_rings() const;
};

struct DispatchArgs {
  /// [T, H] rows of any dtype, each a multiple of 16 bytes (moved as bytes)
  TensorView x;
  /// With 1-byte x only (FP8): [T, S >= 1] f32 or i32 (packed UE8M0), any
  /// strides (per 128 channels, per token, ...); received as [N, S] of its dtype.
  std::optional<TensorView> x_scales;
  std::optional<TensorView> topk_idx;               ///< [T, K] i64, -1 = unused slot
  std::optional<TensorView> topk_weights;           ///< [T, K] f32
  std::optional<TensorView> num_tokens_per_rank;    ///< [R] i32 (from get_dispatch_layout)
  std::optional<TensorView> is_token_in_rank;       ///< [T, R] bool
  std::optional<TensorView> num_tokens_per_expert;  ///< [E] i32
  std::shared_ptr<const DispatchHandle> handle;     ///< cached dispatch when set
  int expert_alignment = 1;
  int num_worst_tokens = 0;  ///< >0: no host sync; outputs sized to this many rows
  std::optional<Config> config;
  StreamArgs streams;

  /// Takes the three layout tensors of a get_dispatch_layout result.
  DispatchArgs& set_layout(const Layout& l) {
    num_tokens_per_rank = l.num_tokens_per_rank.view;
    is_token_in_rank = l.is_token_in_rank.view;
    num_tokens_per_expert = l.num_tokens_per_expert.view;
    return *this;
  }
};

struct DispatchResult {
  Tensor recv_x;                            ///< [N, H] same dtype as x
  std::optional<Tensor> recv_x_scales;      ///< [N, S], x_scales' dtype
  std::optional<Tensor> recv_topk_idx;      ///< [N, K] i64, rebased to local experts, -1 elsewhere
  std::optional<Tensor> recv_topk_weights;  ///< [N, K] f32
  std::vector<int> num_recv_tokens_per_expert;  ///< empty when num_worst_tokens > 0
  std::shared_ptr<const DispatchHandle> handle;
  std::optional<Event> event;
};

struct CombineArgs {
  TensorView x;  ///< [N, H] bf16, rows in dispatch receive order
  std::shared_ptr<const DispatchHandle> handle;
  std::optional<TensorView> topk_weights;  ///< [N, K] f32
  std::optional<TensorView> bias_0;        ///< [T, H] bf16
  std::optional<TensorView> bias_1;        ///< [T, H] bf16
  std::optional<Config> config;
  StreamArgs streams;
};

struct CombineResult {
  Tensor combined_x;                            ///< [T, H] bf16
  std::optional<Tensor> combined_topk_weights;  ///< [T, K] f32
  std::optional<Event> event;
};

/// Routing state of a low-latency dispatch, consumed by low_latency_combine.
struct LowLatencyHandle {
  int num_ranks = 0, num_experts = 0, num_max_dispatch_tokens_per_rank = 0, hidden = 0;
  int num_tokens = 0, num_topk = 0;
  Tensor src_info;      ///< [E_local, R*maxT] i32: source token index of each packed row
  Tensor layout_range;  ///< [E_local, R] i64: (begin << 32) | count per source rank
  Tensor topk_idx;      ///< [T, K] i64 copy of the routing (kept for combine)
  int buffer_slot = 0;  ///< which half of the double buffer the call used
  // Low-latency path internals (issue 4):
  /// [R, ceil(maxT / 32), E_local, 2] i32 on this (expert) rank, the combine's reduction
  /// plan: for source s, token word w and local expert le, {mask, j0}: bit b of mask is
  /// set when token 32 w + b of s picked le, whose packed row is then
  /// le * R*maxT + j0 + (set bits of mask below b).
  Tensor combine_plan;
  /// [16] i32: [0] the dispatch's epoch (set by the send phase), [8 + s] tokens source s sent.
  Tensor state;
  bool use_fp8 = false;  ///< dispatched in FP8
};

struct LowLatencyDispatchArgs {
  TensorView x;         ///< [T, H] bf16, T <= num_max_dispatch_tokens_per_rank
  TensorView topk_idx;  ///< [T, K] i64
  int num_max_dispatch_tokens_per_rank = 0;
  int num_experts = 0;
  std::optional<TensorView> cumulative_local_expert_recv_stats;  ///< [E_local] i32, added to
  /// [R] i64: entry s gets the nanoseconds the receive waited for source s's
  /// token masks, summed over this rank's local experts (nullable; for finding a slow rank)
  std::optional<TensorView> dispatch_wait_recv_cost_stats;
  bool use_fp8 = true;
  bool round_scale = false;
  bool use_ue8m0 = false;
  bool async_finish = false;
  bool return_recv_hook = false;
  cudaStream_t stream = nullptr;
};

struct LowLatencyDispatchResult {
  Tensor recv_x;  ///< [E_local, R*maxT, H] bf16 or fp8
  /// fp8: [E_local, R*maxT, H/128] f32, or i32 [.., H/512] with ue8m0; both
  /// column-major over the last two dims (strides {.., 1, R*maxT}).
  std::optional<Tensor> recv_x_scales;
  Tensor recv_count;  ///< [E_local] i32
  std::shared_ptr<const LowLatencyHandle> handle;
  std::optional<Event> event;
  std::function<void()> hook;  ///< set when return_recv_hook: runs the receive phase
};

struct LowLatencyCombineArgs {
  TensorView x;             ///< [E_local, R*maxT, H] bf16
  TensorView topk_idx;      ///< [T, K] i64
  TensorView topk_weights;  ///< [T, K] f32
  std::shared_ptr<const LowLatencyHandle> handle;
  /// What crosses from each rank in EPX's LogFMT (168 bytes per 128 values): a raw
  /// expert row, or the rank's float32 weighted sum of several experts, coded
  /// once (ref::ll_combine does the same).
  bool use_logfmt = false;
  bool zero_copy = false;  ///< x already lives in get_next_low_latency_combine_buffer()
  bool async_finish = false;
  bool return_recv_hook = false;
  std::optional<TensorView> out;  ///< [T, H] bf16
  /// [R] i64: entry s gets, once per call, the nanoseconds until rank s was seen
  /// to begin its combine (its first weight word here; its combine flag where it
  /// sent no token here). Nullable; for finding a slow rank.
  std::optional<TensorView> combine_wait_recv_cost_stats;
  cudaStream_t stream = nullptr;
};

struct LowLatencyCombineResult {
  Tensor combined_x;  ///< [T, H] bf16
  std::optional<Event> event;
  std::function<void()> hook;
};

class Buffer {
 public:
  Buffer(std::shared_ptr<Communicator> comm, BufferOptions options);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  int rank() const;
  int num_ranks() const;
  /// DeepEP's topology queries: an "RDMA rank" is a node (NVLink domain, or a
  /// virtual node), an "NVL rank" a rank's index in its node.
  int device() const;
  int num_rdma_ranks() const;
  int rdma_rank() const;
  int num_nvl_ranks() const;
  int nvl_rank() const;
  /// DeepEP's get_root_rdma_rank: this rank's index in its node (global), or 0.
  int root_rdma_rank(bool global) const;
  cudaStream_t comm_stream() const;
  const char* backend_name() const;
  /// Contexts per peer the network backend posts on (proxy channels, NCCL GIN
  /// contexts across its communicators); 1 within one NVLink domain.
  int num_network_contexts() const;
  /// What carries the backend's network operations, where it has a choice:
  /// the proxy's engine ("cuda_ipc, own CUDA context" or "cuda_ipc, primary
  /// context": where its copies run, BufferOptions::proxy_cumem;
  /// "libfabric <provider>, domain <name>" or
  /// with several rails "libfabric <provider>, domains <a>,<b> (channel c on
  /// domain c % 2)"); "" otherwise.
  std::string network_engine() const;
  /// The network engine's traffic so far where the backend counts it (the
  /// proxy: every channel's commands, summed); nullopt otherwise. Read it
  /// with no op in flight for exact figures (a proxy still serving an op
  /// counts what it took so far).
  std::optional<NetworkTraffic> network_traffic() const;
  /// Symmetric bytes this rank holds (both regions).
  std::size_t buffer_bytes() const;

  /// Host-visible view of the high-throughput buffer as [bytes] (DeepEP's
  /// get_local_buffer_tensor works on top of this).
  TensorView local_buffer(bool low_latency) const;

  // ---- high-throughput ----------------------------------------------------
  Layout get_dispatch_layout(const TensorView& topk_idx, int num_experts, const StreamArgs& s);
  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);

  // ---- low-latency --------------------------------------------------------
  LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args);
  LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args);
  /// [E_local, R*maxT, H] bf16 view where the next low_latency_combine with
  /// zero_copy expects its input.
  TensorView get_next_low_latency_combine_buffer(const LowLatencyHandle& handle);
  void clean_low_latency_buffer(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts);

  // Shrink mode (BufferOptions::enable_shrink; each throws kInvalidArgument
  // without it). The mask is this rank's own: int32 per rank, 1 = left out of
  // low-latency dispatch and combine (no store to it, no wait for it: its
  // picks count as -1, it counts as a source without tokens). Stream-ordered
  // with the low-latency ops (`stream` as theirs); CUDA-graph capturable.
  /// Masks (mask = true) or unmasks rank `rank_to_mask` in this rank's mask.
  /// A rank that missed ops while masked is out of step: bring it back with
  /// low_latency_clean_mask_buffer and clean_low_latency_buffer on every rank.
  void low_latency_update_mask_buffer(int rank_to_mask, bool mask, cudaStream_t stream = nullptr);
  /// Copies the mask to `mask_status`: int32 [R] on this rank's device.
  void low_latency_query_mask_buffer(const TensorView& mask_status, cudaStream_t stream = nullptr);
  /// Unmasks every rank.
  void low_latency_clean_mask_buffer(cudaStream_t stream = nullptr);
  bool shrink_enabled() const;
  static std::size_t get_low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank,
                                                    int hidden, int num_ranks, int num_experts);
  /// num_nvl_bytes that holds any high-throughput dispatch and combine across
  /// nodes (`num_ranks` ranks in nodes of `ranks_per_node`) of up to
  /// `num_max_tokens` tokens per rank of `hidden` BF16 channels (FP8 rows with
  /// scales are smaller) and top-`num_topk`: the first version of those
  /// kernels sizes its areas for the whole call, and this is its worst case
  /// (every token to every node and rank). Routing spread over the experts
  /// needs much less; a call that does not fit raises kBufferTooSmall.
  /// `ht_rings`: the buffer's BufferOptions::ht_rings (unset: EPX_HT_RINGS,
  /// else -1), which decides whether the rings' areas count too.
  static std::size_t get_internode_nvl_size_hint(int num_max_tokens, int hidden, int num_ranks,
                                                 int ranks_per_node, int num_topk,
                                                 std::optional<int> ht_rings = std::nullopt);

  /// Overrides Config::num_sms of the default configs (DeepEP's set_num_sms).
  static void set_num_sms(int num_sms);
  static int num_sms();

  /// Raises now what the next op would raise for ops already run: a device
  /// diagnostic (a wait past its deadline, a peer with other shapes, a dead
  /// proxy channel) or a proxy thread that died. Reads host memory only (no
  /// GPU sync): to cover every op enqueued so far, synchronize their streams
  /// first. Like ncclCommGetAsyncError, for loops that run many ops without
  /// looking at their results.
  void check();

  /// Frees the symmetric memory (collective); later calls throw.
  void destroy();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace epx
