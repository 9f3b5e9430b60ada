// Host side of get_dispatch_layout, dispatch and combine.
#include <cstring>

#include "common/plan.hpp"
#include "core/buffer_impl.hpp"
#include "core/dispatch_rows.hpp"
#include "core/validate.hpp"
#include "kernels/kernels.hpp"

namespace epx {
namespace {

static_assert(kernels::kLayoutMaxTopK == validate::kMaxTopK,
              "the layout kernel keeps every top-k entry a call may pass");

kernels::HtOffsets offsets_of(const plan::HtRegion& r) {
  kernels::HtOffsets o{};
  o.barrier = r.barrier_offset();
  o.counts[0] = r.counts_offset(0);
  o.counts[1] = r.counts_offset(1);
  o.flags = r.flags_offset();
  o.credits = r.credits_offset();
  o.consumed = r.consumed_offset();
  o.config = r.config_offset();
  o.exports = r.export_offset();
  o.staging = r.staging_offset();
  o.row_bytes = r.row_bytes;
  o.capacity = r.capacity;
  o.chunk = r.chunk;
  o.max_chunks = r.max_chunks();
  o.count_row_ints = r.count_row_ints();
  return o;
}

/// Plans the region for a call and checks that the buffer holds it.
plan::HtRegion plan_region(const char* op, const Buffer::Impl& d, const Config& cfg,
                           int num_experts, std::size_t row_bytes, int num_tokens) {
  plan::HtRegion r;
  r.num_ranks = d.comm->num_ranks();
  r.num_experts = num_experts;
  r.capacity = cfg.num_max_recv_tokens;
  r.chunk = cfg.num_max_send_tokens;
  r.row_bytes = row_bytes;
  require(num_experts / r.num_ranks <= plan::kMaxLocalExperts, "num_experts",
          "at most " + std::to_string(plan::kMaxLocalExperts) + " experts per rank");
  // Any token count goes through the rings (they lap); only the chunk index
  // of a pair is bounded, by the flag area.
  require(plan::ht_num_chunks(num_tokens, r.chunk) < plan::kMaxChunks, op,
          "x has " + std::to_string(num_tokens) + " tokens, more than " +
              std::to_string(plan::kMaxChunks - 1) + " chunks of config.num_max_send_tokens (" +
              std::to_string(r.chunk) + ") rows; raise num_max_send_tokens or send fewer tokens");
  if (cfg.pull_dispatch && r.num_ranks > 1) {  // (a combine's config has it off)
    const int batch = plan::ht_pull_batch(r.staged_rows());
    require(plan::ht_num_chunks(num_tokens, batch) < plan::kMaxChunks, op,
            "x has " + std::to_string(num_tokens) + " tokens, more than the pull dispatch's " +
                std::to_string(plan::kMaxChunks - 1) + " batches of " + std::to_string(batch) +
                (batch < plan::kPullBatch ? "; raise config.num_max_recv_tokens," : ";") +
                " send fewer tokens or use the push dispatch");
  }
  if (r.total_bytes() > d.ht.bytes)
    throw Error(ErrorCode::kBufferTooSmall,
                std::string(op) + ": num_nvl_bytes: the call needs " +
                    std::to_string(r.total_bytes()) + " bytes of NVLink buffer (" +
                    std::to_string(r.capacity) + " ring rows of " + std::to_string(row_bytes) +
                    " B per peer rank) but the buffer has " + std::to_string(d.ht.bytes) +
                    "; use Config::get_nvl_buffer_size_hint");
  return r;
}

}  // namespace

Layout Buffer::get_dispatch_layout(const TensorView& topk_idx, int num_experts,
                                   const StreamArgs& s) {
  auto& d = *impl_;
  d.check_alive("get_dispatch_layout");
  const int R = d.comm->num_ranks();
  validate::dispatch_layout(topk_idx, num_experts, R, d.device);
  d.enter(s);
  const int T = static_cast<int>(topk_idx.shape[0]);
  Layout out;
  out.num_tokens_per_rank = d.make(DType::kI32, {R}, s);
  if (d.networked())
    out.num_tokens_per_rdma_rank = d.make(DType::kI32, {d.topology.num_nodes()}, s);
  out.num_tokens_per_expert = d.make(DType::kI32, {num_experts}, s);
  out.is_token_in_rank = d.make(DType::kBool, {T, R}, s);
  d.ordered_after_allocs(s);
  kernels::LayoutParams p{};
  p.topk_idx = topk_idx.ptr<int64_t>();
  p.num_tokens = T;
  p.num_topk = static_cast<int>(topk_idx.shape[1]);
  p.num_experts = num_experts;
  p.num_ranks = R;
  p.rank = d.comm->rank();
  p.ranks_per_node = d.topology.ranks_per_node;
  p.num_tokens_per_rank = out.num_tokens_per_rank.ptr<int>();
  p.num_tokens_per_node = d.networked() ? out.num_tokens_per_rdma_rank.ptr<int>() : nullptr;
  p.num_tokens_per_expert = out.num_tokens_per_expert.ptr<int>();
  p.is_token_in_rank = out.is_token_in_rank.ptr<bool>();
  p.diag = d.diag_dev;
  kernels::launch_layout(p, d.comm_stream);
  out.event = d.leave(s);
  return out;
}

DispatchResult Buffer::dispatch(const DispatchArgs& a) {
  auto& d = *impl_;
  d.check_alive("dispatch");
  const int R = d.comm->num_ranks();
  validate::dispatch(a, R, d.device);
  if (d.networked()) return d.net_dispatch(a);
  const Config cfg = a.config.value_or(get_dispatch_config(R));
  cfg.validate(R, d.num_sms_device);

  // Scales (FP8) travel with their rows as 4-byte words, float32 or int32 alike.
  const bool scaled = a.x_scales.has_value();
  const int T = static_cast<int>(a.x.shape[0]);
  const int H = static_cast<int>(a.x.shape[1]);
  const int hidden_bytes = H * static_cast<int>(element_size(a.x.dtype));
  const int num_scales = scaled ? static_cast<int>(a.x_scales->shape[1]) : 0;
  const int K = a.topk_idx ? static_cast<int>(a.topk_idx->shape[1]) : 0;
  const int E = a.handle ? 0 : static_cast<int>(a.num_tokens_per_expert->shape[0]);
  const plan::HtRegion region =
      plan_region("dispatch", d, cfg, a.handle ? R : E,
                  plan::ht_dispatch_row_bytes(hidden_bytes, num_scales, K), T);
  auto off = offsets_of(region);
  // What both ends of every pair derive the ring and chunk layout from, and the
  // row layout: ranks whose calls differ would read each other's rows at the
  // wrong places (the kernels refuse them).
  off.config_fp =
      plan::fingerprint({1, cfg.num_max_recv_tokens, cfg.num_max_send_tokens, cfg.send_sms(),
                         hidden_bytes, num_scales, K, E, cfg.pull_dispatch ? 1 : 0});
  const auto tr = d.transport(d.ht);

  d.enter(a.streams);
  auto handle = std::make_shared<DispatchHandle>();
  handle->num_ranks = R;
  handle->num_tokens = T;
  handle->hidden = H;

  if (a.handle) {
    // No count exchange: the main kernel is its own barrier (no notify kernel).
    *handle = *a.handle;
  } else {
    // The handle's routing state: one allocation, carved.
    auto parts = d.make_parts({{DType::kBool, {T, R}},
                               {DType::kI32, {T, R}},
                               {DType::kI32, {R, std::max(T, 1)}},
                               {DType::kI32, {R}},
                               {DType::kI32, {R + 1}},
                               {DType::kI32, {R, R}},
                               {DType::kI32, {R}}},
                              a.streams);
    d.ordered_after_allocs(a.streams);
    handle->is_token_in_rank = parts[0];
    handle->send_slot = parts[1];
    handle->send_list = parts[2];
    handle->send_counts = parts[3];
    handle->recv_offsets = parts[4];
    handle->rank_prefix_matrix = parts[5];
    handle->source_num_tokens = parts[6];
    const TensorView& src = *a.is_token_in_rank;
    if (src.nbytes() > 0)
      EPX_CUDA_CHECK(cudaMemcpyAsync(handle->is_token_in_rank.view.data, src.data, src.nbytes(),
                                     cudaMemcpyDeviceToDevice, d.comm_stream));
    kernels::HtNotifyArgs np{};
    np.off = off;
    np.op_counter = d.ht_op_counter;
    np.done_blocks = d.ht_done_blocks + 1;
    np.timeout_ns = d.timeout_ns();
    np.diag = d.diag_dev;
    np.op = OpId::kDispatchNotify;
    np.num_tokens_per_rank = a.num_tokens_per_rank->ptr<int>();
    np.num_tokens_per_expert = a.num_tokens_per_expert->ptr<int>();
    np.is_token_in_rank = handle->is_token_in_rank.ptr<bool>();
    np.num_tokens = T;
    np.num_experts = E;
    np.expert_alignment = a.expert_alignment;
    np.send_slot = handle->send_slot.ptr<int>();
    np.send_list = handle->send_list.ptr<int>();
    np.send_counts = handle->send_counts.ptr<int>();
    np.recv_offsets = handle->recv_offsets.ptr<int>();
    np.rank_prefix_matrix = handle->rank_prefix_matrix.ptr<int>();
    np.source_num_tokens = handle->source_num_tokens.ptr<int>();
    const int epr = E / R;
    require(2 + R + epr <= Buffer::Impl::kCountsInts, "num_experts", "too many local experts");
    // The host reads the counts only without num_worst_tokens, and waits for
    // this dispatch's own sequence number: a queued num_worst_tokens dispatch
    // (no host wait) never writes the counts, and an earlier notify cannot
    // pass for this one.
    const bool host_waits = a.num_worst_tokens <= 0;
    np.host_counts = host_waits ? d.counts_dev : nullptr;
    np.host_seq = host_waits ? d.next_host_seq() : 0;
    kernels::launch_ht_notify(tr, np, d.comm_stream);
    if (!host_waits) {
      handle->num_recv_tokens = a.num_worst_tokens;
    } else {
      d.wait_host_flag(reinterpret_cast<volatile int*>(d.counts_host), np.host_seq, "dispatch");
      d.raise_if_failed("dispatch");  // a layout mismatch, before any data moves
      volatile int* c = d.counts_host;
      handle->num_recv_tokens = c[1];
      handle->recv_counts.assign(R, 0);
      for (int s2 = 0; s2 < R; ++s2) handle->recv_counts[s2] = c[2 + s2];
      handle->num_recv_tokens_per_expert.assign(epr, 0);
      for (int j = 0; j < epr; ++j) handle->num_recv_tokens_per_expert[j] = c[2 + R + j];
    }
  }
  const int N = handle->num_recv_tokens;

  DispatchResult res;
  res.recv_x = d.make(a.x.dtype, {N, H}, a.streams);
  if (scaled) res.recv_x_scales = d.make(a.x_scales->dtype, {N, num_scales}, a.streams);
  if (a.topk_idx && !a.handle) res.recv_topk_idx = d.make(DType::kI64, {N, K}, a.streams);
  if (a.topk_weights && !a.handle) res.recv_topk_weights = d.make(DType::kF32, {N, K}, a.streams);
  Tensor recv_src_idx = d.make(DType::kI32, {N}, a.streams);
  d.ordered_after_allocs(a.streams);
  if (res.recv_topk_idx && a.num_worst_tokens > 0 && N > 0)
    EPX_CUDA_CHECK(cudaMemsetAsync(res.recv_topk_idx->view.data, 0xff,
                                   res.recv_topk_idx->view.nbytes(), d.comm_stream));

  kernels::HtDispatchArgs p{};
  p.off = off;
  p.op_counter = d.ht_op_counter;
  p.done_blocks = d.ht_done_blocks;
  p.own_barrier = a.handle != nullptr;
  set_dispatch_rows(p, a);
  p.num_tokens = T;
  p.hidden_bytes = hidden_bytes;
  p.num_scales = num_scales;
  p.num_topk = (a.handle || !a.topk_idx) ? 0 : K;
  p.num_experts = a.handle ? R : E;
  p.send_list = handle->send_list.ptr<int>();
  p.send_slot = handle->send_slot.ptr<int>();
  p.send_counts = handle->send_counts.ptr<int>();
  p.recv_offsets = handle->recv_offsets.ptr<int>();
  p.pull = cfg.pull_dispatch && R > 1;  // one rank has no peer to pull from (nor staging)
  p.recv_x = static_cast<uint8_t*>(res.recv_x.view.data);
  p.recv_scales = scaled ? static_cast<float*>(res.recv_x_scales->view.data) : nullptr;
  p.recv_topk_idx = res.recv_topk_idx ? res.recv_topk_idx->ptr<int64_t>() : nullptr;
  p.recv_topk_weights = res.recv_topk_weights ? res.recv_topk_weights->ptr<float>() : nullptr;
  p.recv_src_idx = recv_src_idx.ptr<int>();
  p.max_recv_rows = N;
  p.num_send_blocks = cfg.send_sms();
  p.timeout_ns = d.timeout_ns();
  p.diag = d.diag_dev;
  kernels::launch_ht_dispatch(tr, p, cfg.num_sms, d.comm_stream);
  if (!a.handle) handle->recv_src_idx = recv_src_idx;
  res.num_recv_tokens_per_expert = handle->num_recv_tokens_per_expert;
  res.handle = handle;
  res.event = d.leave(a.streams);
  return res;
}

CombineResult Buffer::combine(const CombineArgs& a) {
  auto& d = *impl_;
  d.check_alive("combine");
  const int R = d.comm->num_ranks();
  validate::combine(a, R, d.device);
  if (d.networked()) return d.net_combine(a);
  Config cfg = a.config.value_or(get_combine_config(R));
  cfg.pull_dispatch = false;  // a dispatch-only choice (and its send share)
  cfg.validate(R, d.num_sms_device);
  const auto& h = *a.handle;
  const int T = h.num_tokens, H = static_cast<int>(a.x.shape[1]);
  const int K = a.topk_weights ? static_cast<int>(a.topk_weights->shape[1]) : 0;
  const plan::HtRegion region =
      plan_region("combine", d, cfg, R, plan::ht_combine_row_bytes(H, K), T);
  auto off = offsets_of(region);
  off.config_fp = plan::fingerprint(  // as in dispatch
      {2, cfg.num_max_recv_tokens, cfg.num_max_send_tokens, cfg.send_sms(), H, K});
  const auto tr = d.transport(d.ht);

  d.enter(a.streams);

  CombineResult res;
  res.combined_x = d.make(DType::kBF16, {T, H}, a.streams);
  if (a.topk_weights) res.combined_topk_weights = d.make(DType::kF32, {T, K}, a.streams);
  d.ordered_after_allocs(a.streams);
  // The combine kernel is its own barrier (no notify kernel).
  kernels::HtCombineArgs p{};
  p.off = off;
  p.op_counter = d.ht_op_counter;
  p.done_blocks = d.ht_done_blocks;
  p.own_barrier = true;
  p.x = a.x.ptr<uint16_t>();
  p.num_x_rows = static_cast<int>(a.x.shape[0]);
  p.topk_weights = a.topk_weights ? a.topk_weights->ptr<float>() : nullptr;
  p.bias0 = a.bias_0 ? a.bias_0->ptr<uint16_t>() : nullptr;
  p.bias1 = a.bias_1 ? a.bias_1->ptr<uint16_t>() : nullptr;
  p.num_tokens = T;
  p.hidden = H;
  p.num_topk = K;
  p.is_token_in_rank = h.is_token_in_rank.ptr<bool>();
  p.send_slot = h.send_slot.ptr<int>();
  p.send_counts = h.send_counts.ptr<int>();
  p.recv_offsets = h.recv_offsets.ptr<int>();
  p.combined_x = res.combined_x.ptr<uint16_t>();
  p.combined_topk_weights =
      res.combined_topk_weights ? res.combined_topk_weights->ptr<float>() : nullptr;
  p.num_send_blocks = cfg.send_sms();
  p.timeout_ns = d.timeout_ns();
  p.diag = d.diag_dev;
  kernels::launch_ht_combine(tr, p, cfg.num_sms, d.comm_stream);
  res.event = d.leave(a.streams);
  return res;
}

}  // namespace epx
