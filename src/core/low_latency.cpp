// Host side of the low-latency ops: low_latency_dispatch / low_latency_combine,
// the zero-copy combine buffer, cleaning and the size hint. Kernels and the
// protocol: src/kernels/low_latency.cu, docs/low_latency.md.
//
// Nothing here waits for the GPU: outputs are fixed-size ([E_local, R*maxT, H]
// and friends), epochs live on the device, so every call can be captured in a
// CUDA graph and replayed with new routing.
#include <algorithm>
#include <string>

#include "common/plan.hpp"
#include "core/buffer_impl.hpp"
#include "core/validate.hpp"
#include "kernels/kernels.hpp"

namespace epx {
namespace {

constexpr int kWarpsPerBlock = kernels::kLlThreads / 32;
constexpr int kDispatchChunk = kernels::kLlDispatchChunk;
constexpr int kStateInts = kernels::kLlStateInts;

int ceil_div(int64_t a, int64_t b) {
  return static_cast<int>((a + b - 1) / b);
}

plan::LlRegion region_of(int num_ranks, int max_tokens, int hidden, int num_experts) {
  plan::LlRegion r;
  r.num_ranks = num_ranks;
  r.max_tokens = max_tokens;
  r.hidden = hidden;
  r.num_experts = num_experts;
  return r;
}

kernels::LlOffsets offsets_of(const plan::LlRegion& r) {
  kernels::LlOffsets o{};
  o.control = 0;
  o.half0 = r.half_offset(0);
  o.half_bytes = r.half_bytes();
  o.flags = plan::LlRegion::flags_base();
  o.flags_half_bytes = plan::LlRegion::flags_bytes();
  o.dtags = r.dtags_base();
  o.dtags_half_bytes = r.dtags_half_bytes();
  o.dtag_masks = plan::LlRegion::dtag_masks_offset();
  o.dtag_chunks = plan::LlRegion::dtag_chunks_offset();
  o.disp_rows = r.dispatch_rows_offset();
  o.weights = plan::LlRegion::weights_base();
  o.weights_stride = plan::LlRegion::weights_stride();
  o.weights_half_bytes = r.weights_half_bytes();
  o.comb_rows = r.combine_rows_offset();
  o.tok_done = r.tok_done_offset();
  o.row_done = r.row_done_offset();
  o.net_done = r.net_done_offset();
  o.net_masks = r.net_masks_offset();
  o.net_masks_half_bytes = r.net_masks_half_bytes();
  o.net_weights = r.net_weights_offset();
  o.net_comb = r.net_comb_offset();
  o.net_comb_half_bytes = r.net_comb_half_bytes();
  return o;
}

/// What the ops need of the region: the core areas, and with peers in other
/// nodes the network areas after them too.
std::size_t ll_bytes_needed(const Buffer::Impl& d, const plan::LlRegion& r) {
  return d.networked() ? r.net_end() : r.core_bytes();
}

std::string workload(const plan::LlRegion& r) {
  return "num_max_dispatch_tokens_per_rank=" + std::to_string(r.max_tokens) +
         ", hidden=" + std::to_string(r.hidden) + ", num_ranks=" + std::to_string(r.num_ranks) +
         ", num_experts=" + std::to_string(r.num_experts);
}

void check_fits(const char* op, const Buffer::Impl& d, const plan::LlRegion& r, std::size_t need,
                const char* what) {
  if (need <= d.ll.bytes) return;
  throw Error(ErrorCode::kBufferTooSmall,
              std::string(op) + ": num_rdma_bytes: " + what + " needs " + std::to_string(need) +
                  " bytes of low-latency buffer (" + workload(r) + ") but the buffer has " +
                  std::to_string(d.ll.bytes) +
                  "; size it with Buffer::get_low_latency_rdma_size_hint(" +
                  std::to_string(r.max_tokens) + ", " + std::to_string(r.hidden) + ", " +
                  std::to_string(r.num_ranks) + ", " + std::to_string(r.num_experts) +
                  ") = " + std::to_string(r.total_bytes()));
}

/// Column-major view over the last two dims of a tensor allocated as
/// [E_local, cols, rows]: logical [E_local, rows, cols], strides {rows*cols, 1, rows}.
void make_column_major(Tensor& t, int64_t e_local, int64_t rows, int64_t cols) {
  t.view.ndim = 3;
  t.view.shape = {e_local, rows, cols, 0};
  t.view.strides = {rows * cols, 1, rows, 0};
}

}  // namespace

LowLatencyDispatchResult Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& a) {
  static constexpr const char* op = "low_latency_dispatch";
  auto& d = *impl_;
  d.check_alive(op);
  const int R = d.comm->num_ranks();
  validate::low_latency_dispatch(a, R, d.device);
  const int T = static_cast<int>(a.x.shape[0]), H = static_cast<int>(a.x.shape[1]);
  const int K = static_cast<int>(a.topk_idx.shape[1]), E = a.num_experts;
  const int maxT = a.num_max_dispatch_tokens_per_rank;
  const int E_local = E / R, RT = R * maxT, G = H / 128, G4 = (G + 3) / 4;
  const plan::LlRegion region = region_of(R, maxT, H, E);
  check_fits(op, d, region, ll_bytes_needed(d, region), "the call");
  d.raise_if_failed(op);

  StreamArgs s;
  s.stream = a.stream;
  s.async_finish = a.async_finish;
  d.check_stream(s);  // before any state changes (the zero-copy slot below)

  auto handle = std::make_shared<LowLatencyHandle>();
  handle->num_ranks = R;
  handle->num_experts = E;
  handle->num_max_dispatch_tokens_per_rank = maxT;
  handle->hidden = H;
  handle->num_tokens = T;
  handle->num_topk = K;
  handle->use_fp8 = a.use_fp8;
  handle->buffer_slot = d.ll_parity;
  d.ll_parity ^= 1;

  // Outputs first, in the caller's stream order; enter() then orders the comm
  // stream after them with a single event.
  LowLatencyDispatchResult res;
  res.recv_x = d.alloc(a.use_fp8 ? DType::kFP8E4M3 : DType::kBF16, {E_local, RT, H}, a.stream);
  if (a.use_fp8) {
    const int cols = a.use_ue8m0 ? G4 : G;
    Tensor sc = d.alloc(a.use_ue8m0 ? DType::kI32 : DType::kF32, {E_local, cols, RT}, a.stream);
    make_column_major(sc, E_local, RT, cols);
    res.recv_x_scales = sc;
  }
  res.recv_count = d.alloc(DType::kI32, {E_local}, a.stream);
  {  // the handle's state: one allocation, carved
    auto parts = d.make_parts({{DType::kI32, {E_local, RT}},
                               {DType::kI64, {E_local, R}},
                               {DType::kI64, {T, K}},
                               {DType::kI32, {R, region.mask_words(), E_local, 2}},
                               {DType::kI32, {kStateInts}}},
                              a.stream);
    handle->src_info = parts[0];
    handle->layout_range = parts[1];
    handle->topk_idx = parts[2];
    handle->combine_plan = parts[3];
    handle->state = parts[4];
  }
  const cudaStream_t launch = d.ll_enter(s, op);

  const auto tr = d.ll_transport(region.signals_offset());
  auto off = offsets_of(region);
  // What a peer's rows and slots are laid out by: receivers refuse a sender whose differ.
  off.shape_fp = plan::fingerprint({maxT, H, E, a.use_fp8 ? 1 : 0}) >> plan::kLlCountBits;
  const int row_bytes = static_cast<int>(region.dispatch_row_bytes(a.use_fp8));

  kernels::LlDispatchSendArgs sp{};
  sp.off = off;
  sp.op_counter = d.ll_op_counter;
  sp.seq = d.ll_seq;
  sp.state = handle->state.ptr<int32_t>();
  sp.x = a.x.ptr<uint16_t>();
  sp.topk_idx = a.topk_idx.ptr<int64_t>();
  sp.topk_copy = T > 0 ? handle->topk_idx.ptr<int64_t>() : nullptr;
  sp.num_tokens = T;
  sp.row_tokens = std::min(T, d.ll_dispatch_stop_tokens);
  sp.hidden = H;
  sp.num_topk = K;
  sp.num_experts = E;
  sp.max_tokens = maxT;
  sp.ctx_tokens = d.ll_ctx_tokens(maxT);
  sp.row_bytes = row_bytes;
  sp.fp8 = a.use_fp8;
  sp.round_scale = a.round_scale;
  sp.diag = d.diag_dev;
  // One warp per work item where the SMs allow: the row items, then the
  // token-mask units (32 tokens of maxT x 32 experts each).
  const int64_t send_items = static_cast<int64_t>(T) * ceil_div(H, kDispatchChunk) +
                             static_cast<int64_t>(ceil_div(maxT, 32)) * ceil_div(E, 32);
  const int send_blocks_max = std::clamp(ceil_div(send_items, kWarpsPerBlock), 1, d.ll_blocks(2));

  kernels::LlDispatchRecvArgs rp{};
  rp.off = off;
  rp.state = handle->state.ptr<int32_t>();
  rp.hidden = H;
  rp.num_topk = K;
  rp.num_experts = E;
  rp.max_tokens = maxT;
  rp.row_bytes = row_bytes;
  rp.fp8 = a.use_fp8;
  rp.ue8m0 = a.use_ue8m0;
  rp.recv_x = static_cast<uint8_t*>(res.recv_x.view.data);
  rp.recv_scales = res.recv_x_scales ? res.recv_x_scales->view.data : nullptr;
  rp.recv_count = res.recv_count.ptr<int>();
  rp.src_info = handle->src_info.ptr<int>();
  rp.layout_range = handle->layout_range.ptr<int64_t>();
  rp.combine_plan = reinterpret_cast<int2*>(handle->combine_plan.ptr<int>());
  rp.stats = a.cumulative_local_expert_recv_stats ? a.cumulative_local_expert_recv_stats->ptr<int>()
                                                  : nullptr;
  rp.wait_stats =
      a.dispatch_wait_recv_cost_stats ? a.dispatch_wait_recv_cost_stats->ptr<int64_t>() : nullptr;
  rp.timeout_ns = d.timeout_ns();
  rp.diag = d.diag_dev;
  // Arrival order is a load/store protocol (experimental): rank order across nodes.
  rp.arrival_order = d.ll_arrival_order && !d.networked();

  if (!a.return_recv_hook) {
    // One kernel of 2 blocks per SM: up to half of them send (a warp per
    // item), the rest receive from the start.
    const int blocks = d.ll_blocks(2);
    const int senders = std::min(send_blocks_max, blocks / 2);
    rp.parts = rp.arrival_order ? 1 : std::clamp((blocks - senders) / E_local, 1, 8);
    kernels::launch_ll_dispatch(tr, sp, rp, blocks, senders, kernels::kLlBothPhases, launch);
    res.event = d.ll_leave(s, launch);
  } else {
    // The caller's stream is ordered after the send (or holds the event when
    // async_finish); the hook runs the receive phase on that stream.
    // Receive blocks per local expert: about two per SM in total (one wave at
    // 2 blocks/SM).
    rp.parts = rp.arrival_order ? 1 : std::clamp(d.ll_blocks(2) / E_local, 1, 8);
    // At most the budget (E_local can exceed it): blocks loop over the units.
    // With in-process ranks a grid past a rank's share of the SMs could hold
    // SMs a peer's send kernel needs while it waits for that send.
    const int recv_blocks = std::min(E_local * rp.parts, d.ll_blocks(2));
    kernels::launch_ll_dispatch(tr, sp, rp, send_blocks_max, send_blocks_max, kernels::kLlSendPhase,
                                launch);
    res.event = d.ll_leave(s, launch);
    Impl* impl = &d;
    res.hook = [impl, tr, rp, recv_blocks, stream = a.stream, sent = res.event, recv_x = res.recv_x,
                scales = res.recv_x_scales, count = res.recv_count, handle]() {
      impl->check_alive(op);
      impl->raise_if_failed(op);
      if (sent) sent->stream_wait(stream);
      kernels::launch_ll_dispatch(tr, kernels::LlDispatchSendArgs{}, rp, recv_blocks, 0,
                                  kernels::kLlRecvPhase, stream);
      impl->ll_hook_launched(stream, stream);
    };
  }
  res.handle = handle;
  return res;
}

LowLatencyCombineResult Buffer::low_latency_combine(const LowLatencyCombineArgs& a) {
  static constexpr const char* op = "low_latency_combine";
  auto& d = *impl_;
  d.check_alive(op);
  const int R = d.comm->num_ranks();
  validate::low_latency_combine(a, R, d.device);
  const auto handle = a.handle;
  const auto& h = *handle;
  require(h.combine_plan.defined() && h.state.defined(), "low_latency_combine: handle",
          "must come from low_latency_dispatch (this one carries no routing state)");
  const int T = h.num_tokens, H = h.hidden, K = h.num_topk, E = h.num_experts;
  const int maxT = h.num_max_dispatch_tokens_per_rank;
  const plan::LlRegion region = region_of(R, maxT, H, E);
  check_fits(op, d, region, ll_bytes_needed(d, region), "the call");
  d.raise_if_failed(op);

  StreamArgs s;
  s.stream = a.stream;
  s.async_finish = a.async_finish;
  d.check_stream(s);  // before the outputs are allocated

  LowLatencyCombineResult res;
  if (a.out) {
    res.combined_x.view = *a.out;
  } else {
    res.combined_x = d.alloc(DType::kBF16, {T, H}, a.stream);
  }
  const cudaStream_t launch = d.ll_enter(s, op);
  // 64-bit words (8-byte aligned from any allocator): int32 [0] the epoch;
  // with combine_wait_recv_cost_stats, words [2, 2 + R) the send's wait for
  // each source's first weight word (zeroed here). On the stream the kernels
  // run on: it is freed there, after them, when the call (or the hook) lets
  // go of it.
  const bool wait_stats = a.combine_wait_recv_cost_stats.has_value();
  Tensor state = d.alloc(DType::kI64, {wait_stats ? 2 + R : 2}, launch);
  auto* send_wait_first =
      wait_stats ? reinterpret_cast<unsigned long long*>(state.ptr<int64_t>() + 2) : nullptr;
  if (wait_stats)
    EPX_CUDA_CHECK(cudaMemsetAsync(send_wait_first, 0, sizeof(unsigned long long) * R, launch));

  const auto tr = d.ll_transport(region.signals_offset());
  const auto off = offsets_of(region);
  const int C =
      ceil_div(H, a.use_logfmt ? kernels::kLlCombineSendChunkLogFmt : kernels::kLlCombineSendChunk);
  const int C_recv = ceil_div(H, kernels::kLlCombineRecvChunk);

  kernels::LlCombineSendArgs sp{};
  sp.off = off;
  sp.op_counter = d.ll_op_counter;
  sp.seq = d.ll_seq;
  sp.state = state.ptr<int32_t>();
  sp.disp_state = h.state.ptr<int32_t>();
  sp.x = a.x.ptr<uint16_t>();  // zero_copy or not, the send reads x where it is
  sp.topk_idx = a.topk_idx.ptr<int64_t>();
  sp.topk_weights = a.topk_weights.ptr<float>();
  sp.combine_plan = reinterpret_cast<const int2*>(h.combine_plan.ptr<int>());
  sp.num_tokens = T;
  sp.hidden = H;
  sp.num_topk = K;
  sp.num_experts = E;
  sp.max_tokens = maxT;
  sp.ctx_tokens = d.ll_ctx_tokens(maxT);
  sp.logfmt = a.use_logfmt;
  sp.wait_first = send_wait_first;
  sp.timeout_ns = d.timeout_ns();
  sp.diag = d.diag_dev;
  const int send_blocks =
      std::clamp(ceil_div(static_cast<int64_t>(R) * maxT * C, kWarpsPerBlock), 1, d.ll_blocks(1));

  kernels::LlCombineRecvArgs rp{};
  rp.off = off;
  rp.state = state.ptr<int32_t>();
  rp.topk_idx = a.topk_idx.ptr<int64_t>();
  rp.topk_weights = a.topk_weights.ptr<float>();
  rp.out = res.combined_x.ptr<uint16_t>();
  rp.wait_stats =
      a.combine_wait_recv_cost_stats ? a.combine_wait_recv_cost_stats->ptr<int64_t>() : nullptr;
  rp.send_wait_first = send_wait_first;
  rp.num_tokens = T;
  rp.hidden = H;
  rp.num_topk = K;
  rp.num_experts = E;
  rp.max_tokens = maxT;
  rp.logfmt = a.use_logfmt;
  // A source's signal can come one deadline late and still be alive: its
  // send waits up to the deadline for every source's weights, a dead (shrink:
  // not yet masked) source's too. So the receive waits twice the deadline
  // before it gives a source up, and a live rank is not masked (or named)
  // for a dead one's silence.
  rp.timeout_ns = 2 * d.timeout_ns();
  rp.diag = d.diag_dev;
  // One kernel, one block per SM at most (the send's registers): the
  // receive's (token, chunk) items loop over the grid.
  const int recv_blocks =
      std::clamp(ceil_div(static_cast<int64_t>(T) * C_recv, kWarpsPerBlock), 1, d.ll_blocks(1));

  if (!a.return_recv_hook) {
    // Both phases in one cooperative launch: each block sends its items, then
    // receives. ll_blocks sizes the grid so that every rank's kernel on a
    // shared GPU is resident at once.
    kernels::launch_ll_combine(tr, sp, rp, std::max(send_blocks, recv_blocks),
                               kernels::kLlBothPhases, launch);
    res.event = d.ll_leave(s, launch);
  } else {
    kernels::launch_ll_combine(tr, sp, rp, send_blocks, kernels::kLlSendPhase, launch);
    res.event = d.ll_leave(s, launch);
    Impl* impl = &d;
    res.hook = [impl, tr, rp, recv_blocks, stream = a.stream, launch, sent = res.event,
                out = res.combined_x, state, handle]() {
      impl->check_alive(op);
      impl->raise_if_failed(op);
      if (sent) sent->stream_wait(stream);
      kernels::launch_ll_combine(tr, kernels::LlCombineSendArgs{}, rp, recv_blocks,
                                 kernels::kLlRecvPhase, stream);
      impl->ll_hook_launched(stream, launch);  // `state` lives on `launch`
    };
  }
  return res;
}

TensorView Buffer::get_next_low_latency_combine_buffer(const LowLatencyHandle& h) {
  static constexpr const char* op = "get_next_low_latency_combine_buffer";
  auto& d = *impl_;
  d.check_alive(op);
  const int R = d.comm->num_ranks();
  require(h.num_ranks == R, "get_next_low_latency_combine_buffer: handle",
          "was made by a buffer of another rank count");
  require(h.num_max_dispatch_tokens_per_rank > 0 && h.hidden > 0 && h.num_experts > 0,
          "get_next_low_latency_combine_buffer: handle", "must come from low_latency_dispatch");
  const plan::LlRegion region =
      region_of(R, h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts);
  check_fits(op, d, region, region.total_bytes(), "the zero-copy combine input");
  char* p = static_cast<char*>(d.ll.local) + region.zero_copy_offset(h.buffer_slot & 1);
  return TensorView::contiguous(
      p, DType::kBF16, {region.local_experts(), region.rows_per_expert(), h.hidden}, d.device);
}

void Buffer::clean_low_latency_buffer(int num_max_dispatch_tokens_per_rank, int hidden,
                                      int num_experts) {
  static constexpr const char* op = "clean_low_latency_buffer";
  auto& d = *impl_;
  d.check_alive(op);
  const int R = d.comm->num_ranks();
  validate::low_latency_sizes(op, num_max_dispatch_tokens_per_rank, hidden, num_experts, R);
  const plan::LlRegion region = region_of(R, num_max_dispatch_tokens_per_rank, hidden, num_experts);
  // Collective: nobody may still be writing into a peer's region while it is
  // zeroed, and nobody may start a new op before every region is clean.
  d.wait_stream(d.comm_stream, op, "the comm stream (the ops before the clean)");
  d.ll_sync(op);
  d.comm->barrier();
  // Network transports: what every rank sent has landed before anyone zeroes.
  d.backend->quiesce();
  d.comm->barrier();
  const std::size_t bytes = std::min(region.core_bytes(), d.ll.bytes);
  if (bytes > 0) EPX_CUDA_CHECK(cudaMemsetAsync(d.ll.local, 0, bytes, d.comm_stream));
  // (The core areas hold the network transports' signals and send counters
  // too; the op counts the signals are compared against restart with them.)
  EPX_CUDA_CHECK(cudaMemsetAsync(d.ll_op_counter, 0, sizeof(uint32_t), d.comm_stream));
  EPX_CUDA_CHECK(cudaMemsetAsync(d.ll_seq, 0, 2 * sizeof(uint64_t), d.comm_stream));
  d.wait_stream(d.comm_stream, op, "the comm stream's zero fill of the low-latency region");
  d.backend->region_cleared(d.ll);
  d.ll_parity = 0;
  d.comm->barrier();
}

namespace {
Buffer::Impl& shrink_impl(Buffer::Impl& d, const char* op) {
  d.check_alive(op);
  if (d.ll_mask == nullptr)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) +
                    ": enable_shrink: must be true when the buffer is made "
                    "(BufferOptions::enable_shrink)");
  return d;
}

/// Enqueues fn(launch stream) in the low-latency ops' stream order, as an LL
/// op would (the caller's `stream`, after the last LL op wherever it ran).
template <class Fn>
void in_ll_order(Buffer::Impl& d, const char* op, cudaStream_t stream, Fn&& fn) {
  StreamArgs s;
  s.stream = stream;
  d.check_stream(s);
  const cudaStream_t launch = d.ll_enter(s, op);
  fn(launch);
  d.ll_leave(s, launch);
}
}  // namespace

void Buffer::low_latency_update_mask_buffer(int rank_to_mask, bool mask, cudaStream_t stream) {
  static constexpr const char* op = "low_latency_update_mask_buffer";
  auto& d = shrink_impl(*impl_, op);
  validate::rank_in_group(op, "rank_to_mask", rank_to_mask, d.comm->num_ranks());
  in_ll_order(d, op, stream, [&](cudaStream_t launch) {
    // Words hold 0 or 1 only, so setting the low byte (little-endian) sets the word.
    EPX_CUDA_CHECK(cudaMemsetAsync(d.ll_mask + rank_to_mask, mask ? 1 : 0, 1, launch));
  });
}

void Buffer::low_latency_query_mask_buffer(const TensorView& mask_status, cudaStream_t stream) {
  static constexpr const char* op = "low_latency_query_mask_buffer";
  auto& d = shrink_impl(*impl_, op);
  const int R = d.comm->num_ranks();
  validate::tensor(op, "mask_status", mask_status, DType::kI32, {R}, d.device);
  in_ll_order(d, op, stream, [&](cudaStream_t launch) {
    EPX_CUDA_CHECK(cudaMemcpyAsync(mask_status.data, d.ll_mask, sizeof(int) * R,
                                   cudaMemcpyDeviceToDevice, launch));
  });
}

void Buffer::low_latency_clean_mask_buffer(cudaStream_t stream) {
  static constexpr const char* op = "low_latency_clean_mask_buffer";
  auto& d = shrink_impl(*impl_, op);
  in_ll_order(d, op, stream, [&](cudaStream_t launch) {
    EPX_CUDA_CHECK(cudaMemsetAsync(d.ll_mask, 0, sizeof(int) * plan::kLlMaxRanks, launch));
  });
}

bool Buffer::shrink_enabled() const {
  return impl_->ll_mask != nullptr;
}

std::size_t Buffer::get_low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, int hidden,
                                                   int num_ranks, int num_experts) {
  static constexpr const char* op = "get_low_latency_rdma_size_hint";
  require(num_ranks >= 1 && num_ranks <= plan::kLlMaxRanks, "num_ranks",
          "must be in [1, " + std::to_string(plan::kLlMaxRanks) + "], got " +
              std::to_string(num_ranks));
  validate::low_latency_sizes(op, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_ranks);
  return region_of(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts).total_bytes();
}

}  // namespace epx
