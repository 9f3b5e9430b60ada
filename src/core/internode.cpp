// Host side of dispatch and combine when the ranks form several nodes
// (issue 25, docs/internode_ht.md "A first version"): a host count exchange
// over the communicator, the route (plan::InternodeRoute) every rank derives
// from it, whole-call areas in the num_nvl_bytes region, then the kernels of
// kernels/internode.cu.
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/env.hpp"
#include "common/internode_rings.hpp"
#include "common/internode_route.hpp"
#include "core/buffer_impl.hpp"
#include "core/dispatch_rows.hpp"
#include "core/internode_handle.hpp"
#include "core/stream_wait.hpp"
#include "core/validate.hpp"
#include "kernels/kernels.hpp"

namespace epx {
namespace {

kernels::HtNetOffsets offsets_of(const plan::HtNetRegion& r) {
  kernels::HtNetOffsets o{};
  o.counts = plan::HtNetRegion::kCounts;
  o.done = plan::HtNetRegion::kDone;
  o.shapes = plan::HtNetRegion::shapes(r.num_nodes * r.ranks_per_node);
  o.recv = r.recv;
  o.send = r.send;
  o.stage = r.stage;
  o.row_bytes = r.row_bytes;
  o.slot_bytes = r.slot_bytes();
  o.slot_rows = r.slot_rows;
  o.num_nodes = r.num_nodes;
  o.ranks_per_node = r.ranks_per_node;
  o.stage_rows = r.stage_rows;
  o.count_rows = r.count_rows;
  o.count_ints = r.count_ints;
  return o;
}

}  // namespace

std::size_t Buffer::Impl::ht_capacity() const {
  if (ht_rings == 0) return ht.bytes;  // no rings: no state block
  const std::size_t state = plan::HtRingRegion::state_bytes(topology);
  return ht.bytes > state ? ht.bytes - state : 0;
}

namespace {

/// Every rank computes the same region from the same counts, so all of them
/// raise here together when it does not fit.
void check_fits(const char* op, const plan::HtNetRegion& r, std::size_t capacity, int worst) {
  if (worst > 0 && (r.slot_rows < 1 || r.total > capacity))
    throw Error(ErrorCode::kBufferTooSmall,
                std::string(op) + ": num_nvl_bytes: with num_worst_tokens (" +
                    std::to_string(worst) +
                    ") the areas are fixed by the buffer: a stage of that many rows of " +
                    std::to_string(r.row_bytes) +
                    " B and at least one row per node's slot, but the buffer has " +
                    std::to_string(capacity) + " bytes for them; raise num_nvl_bytes");
  if (r.total <= capacity) return;
  throw Error(ErrorCode::kBufferTooSmall,
              std::string(op) + ": num_nvl_bytes: the call needs " + std::to_string(r.total) +
                  " bytes (across nodes the first version sizes its areas for the whole call: " +
                  std::to_string(r.num_nodes) + " slots of " + std::to_string(r.slot_rows) +
                  " rows of " + std::to_string(r.row_bytes) +
                  " B each way, and the rows this rank receives) but the buffer has " +
                  std::to_string(capacity) +
                  " bytes for them; raise num_nvl_bytes or send fewer tokens");
}

/// The SMs of the send, receive and sum kernels: the config's; without a
/// config, the default's within this rank's share of the GPU (in-process
/// ranks split it).
int net_blocks(const char* op, const std::optional<Config>& given, const Config& cfg,
               int sms_device) {
  if (!given) return std::max(1, std::min(cfg.num_sms, sms_device));
  cfg.validate_rdma_fields();
  require(cfg.num_sms >= 1 && cfg.num_sms <= sms_device, "config.num_sms",
          std::string(op) + ": must be in [1, " + std::to_string(sms_device) +
              "] (the SMs this rank may use), got " + std::to_string(cfg.num_sms));
  return cfg.num_sms;
}

/// The rings' geometry of an op whose records are `record_bytes` long
/// (plan::HtRingGeometry::of): EPX_HT_RINGS's records per ring where it gives
/// them (> 1), else the default sizes, halved where they do not fit the
/// region of `region_bytes` (plan::HtRingRegion::fit; the config's
/// num_max_rdma_recv_tokens / _send_tokens are kept where set).
plan::HtRingGeometry ring_geometry(int ht_rings, int blocks, const Config& cfg,
                                   std::size_t record_bytes, const Topology& topology,
                                   std::size_t region_bytes, bool combine) {
  const plan::HtRingGeometry g =
      plan::HtRingGeometry::of(std::max(ht_rings, 1), blocks, cfg.num_max_rdma_send_tokens,
                               cfg.num_max_rdma_recv_tokens, record_bytes);
  if (ht_rings > 1) return g;
  return plan::HtRingRegion::fit(
      topology, g, record_bytes, plan::HtNetRegion::body(topology.num_ranks), region_bytes, combine,
      cfg.num_max_rdma_recv_tokens > 0, cfg.num_max_rdma_send_tokens == 0);
}

plan::InternodeRoute route_of(const DispatchHandle& h, const Topology& topology, const char* op) {
  const DispatchHandle::Internode& hn = across(h, op);
  plan::InternodeCounts c;
  c.topology = topology;
  c.tokens_to_rank = hn.net_tokens_to_rank;
  c.tokens_to_node = hn.net_tokens_to_node;
  return plan::InternodeRoute(std::move(c));
}

/// Orders stream x after the allocations make() did for `s` (x is the
/// caller's stream or the comm stream, as ll_enter chose).
void after_allocs(Buffer::Impl& d, const StreamArgs& s, cudaStream_t x) {
  if (x == d.comm_stream)
    d.ordered_after_allocs(s);
  else if (s.allocate_on_comm_stream)
    Event::record(d.comm_stream).stream_wait(x);
}

void upload(const Tensor& dst, const std::vector<int>& src, cudaStream_t stream) {
  if (src.empty()) return;
  EPX_CUDA_CHECK(cudaMemcpyAsync(dst.view.data, src.data(), src.size() * sizeof(int),
                                 cudaMemcpyHostToDevice, stream));
}

}  // namespace

DispatchResult Buffer::Impl::net_dispatch(const DispatchArgs& a) {
  const char* op = "dispatch";
  const int R = comm->num_ranks(), me = comm->rank();
  const int L = topology.ranks_per_node, N = topology.num_nodes();
  if (a.handle && a.handle->ranks_per_node != L)
    throw Error(ErrorCode::kInvalidArgument,
                "dispatch: handle: was made by a dispatch within one node or with another "
                "ranks_per_node (" +
                    std::to_string(a.handle->ranks_per_node) + ", this buffer has " +
                    std::to_string(L) + ")");
  const Config cfg = a.config.value_or(get_dispatch_config(R));
  const int blocks = net_blocks(op, a.config, cfg, num_sms_device);

  const bool scaled = a.x_scales.has_value();
  const int T = static_cast<int>(a.x.shape[0]);
  const int H = static_cast<int>(a.x.shape[1]);
  const int hidden_bytes = H * static_cast<int>(element_size(a.x.dtype));
  const int S = scaled ? static_cast<int>(a.x_scales->shape[1]) : 0;
  const int K = (a.handle || !a.topk_idx) ? 0 : static_cast<int>(a.topk_idx->shape[1]);
  const int E = a.handle ? R : static_cast<int>(a.num_tokens_per_expert->shape[0]);
  // num_worst_tokens: no host wait; the areas are fixed by the buffer and
  // the counts are exchanged on the GPU (a cached dispatch follows its handle).
  const int worst = a.handle ? across(*a.handle, op).net_worst : std::max(0, a.num_worst_tokens);
  const std::size_t record = plan::ht_net_record_bytes(hidden_bytes, S, K, L);

  // As the low-latency ops: without async_finish the kernels run on the
  // caller's stream itself. With in-process ranks sharing a GPU this keeps
  // the comm streams idle: the ranks' busy streams and the proxy's then fit
  // the GPU's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS), where a proxy
  // copy queued behind a kernel that waits for it would stall until the
  // deadline (4x4 in-process ranks: 48 busy streams on 32 queues did).
  const cudaStream_t x = ll_enter(a.streams, op);
  auto handle = std::make_shared<DispatchHandle>();
  if (a.handle) {
    *handle = *a.handle;
    // Its own copy of the state across nodes: this dispatch's results must
    // not reach the handle it was given (a caller may still use it).
    handle->internode = std::make_shared<DispatchHandle::Internode>(across(*a.handle, op));
  }
  DispatchHandle::Internode& net = across(*handle);  // this dispatch's state across nodes
  Tensor route_counts;  // [R + N]: this rank's rows per rank and per node (a new route)
  if (!a.handle) {
    handle->num_ranks = R;
    handle->num_tokens = T;
    handle->hidden = H;
    handle->ranks_per_node = L;
    const int E_ints =
        R + N + E + R;  // rank counts, node counts, experts, the caller's rank counts
    require(E_ints <= kCountsInts, "num_experts",
            "dispatch: too many experts for the count exchange (" + std::to_string(E) + ")");
    auto parts = make_parts({{DType::kBool, {T, R}},
                             {DType::kI32, {T, N}},
                             {DType::kI32, {T, R}},
                             {DType::kI32, {R + N}},
                             {DType::kI32, {R, R}},
                             {DType::kI32, {R}}},
                            a.streams);
    after_allocs(*this, a.streams, x);
    handle->is_token_in_rank = parts[0];
    net.net_send_pos = parts[1];
    net.net_rank_pos = parts[2];
    const Tensor counts = parts[3];
    handle->rank_prefix_matrix = parts[4];
    handle->source_num_tokens = parts[5];
    const TensorView& src = *a.is_token_in_rank;
    if (src.nbytes() > 0)
      EPX_CUDA_CHECK(cudaMemcpyAsync(handle->is_token_in_rank.view.data, src.data, src.nbytes(),
                                     cudaMemcpyDeviceToDevice, x));
    kernels::HtNetRouteArgs ra{};
    ra.is_token_in_rank = handle->is_token_in_rank.ptr<bool>();
    ra.num_tokens = T;
    ra.num_ranks = R;
    ra.ranks_per_node = L;
    ra.send_pos = net.net_send_pos.ptr<int>();
    ra.rank_pos = net.net_rank_pos.ptr<int>();
    ra.rank_counts = counts.ptr<int>();
    ra.node_counts = counts.ptr<int>() + R;
    kernels::launch_ht_net_route(ra, x);
    route_counts = counts;
  }
  if (!a.handle && worst > 0) {
    handle->num_recv_tokens = worst;
    net.net_worst = worst;
    net.net_slot_rows = plan::HtNetRegion::fixed_slot_rows(
        topology, worst, record, plan::ht_combine_row_bytes(H, K), ht_capacity());
  } else if (!a.handle) {
    const Tensor& counts = route_counts;
    // The counts to the host: the route's, the caller's per expert and per rank.
    int* host = counts_host;
    EPX_CUDA_CHECK(
        cudaMemcpyAsync(host, counts.view.data, sizeof(int) * (R + N), cudaMemcpyDeviceToHost, x));
    EPX_CUDA_CHECK(cudaMemcpyAsync(host + R + N, a.num_tokens_per_expert->data, sizeof(int) * E,
                                   cudaMemcpyDeviceToHost, x));
    EPX_CUDA_CHECK(cudaMemcpyAsync(host + R + N + E, a.num_tokens_per_rank->data, sizeof(int) * R,
                                   cudaMemcpyDeviceToHost, x));
    if (!detail::wait_stream_for(x, timeout_s))
      throw Error(ErrorCode::kTimeout, "dispatch: the count exchange's copies did not finish in " +
                                           std::to_string(timeout_s) + " s");
    raise_if_failed(op);
    // One row per rank: T, whether its layout disagrees, rank counts, node
    // counts, expert counts. A rank whose layout is bad still takes part, so
    // that every rank raises instead of waiting.
    // The row's shapes too: every rank derives the areas' offsets from its own
    // record size, so ranks whose rows differ would misplace each other's.
    constexpr int kHead = 5;  // T, bad layout, hidden bytes, scales, top-k
    std::vector<int> row(kHead + R + N + E);
    row[0] = T;
    row[1] = std::memcmp(host, host + R + N + E, sizeof(int) * R) != 0 ? 1 : 0;
    row[2] = hidden_bytes;
    row[3] = S;
    row[4] = K;
    std::memcpy(row.data() + kHead, host, sizeof(int) * (R + N + E));
    // The buffer's deadline (a dead rank: the communicator is aborted).
    const auto all = comm->allgather(row.data(), row.size() * sizeof(int), timeout_s);
    auto at = [&](int s, int i) {
      int v;
      std::memcpy(&v, all.data() + (static_cast<std::size_t>(s) * row.size() + i) * sizeof(int),
                  sizeof(int));
      return v;
    };
    static constexpr const char* kShapeNames[] = {"x (hidden bytes)", "x_scales (scales per token)",
                                                  "topk_idx (top-k)"};
    for (int s = 0; s < R; ++s)
      for (int i = 0; i < 3; ++i)
        if (at(s, 2 + i) != row[2 + i])
          throw Error(ErrorCode::kInvalidArgument,
                      std::string("dispatch: ") + kShapeNames[i] + ": rank " + std::to_string(s) +
                          " passed " + std::to_string(at(s, 2 + i)) + ", rank " +
                          std::to_string(me) + " " + std::to_string(row[2 + i]) +
                          "; every rank must dispatch rows of one shape");
    for (int s = 0; s < R; ++s)
      if (at(s, 1) != 0)
        throw Error(ErrorCode::kInvalidArgument,
                    "dispatch: num_tokens_per_rank: rank " + std::to_string(s) +
                        "'s disagrees with its is_token_in_rank (pass the tensors of one "
                        "get_dispatch_layout call)");
    net.net_tokens_to_rank.assign(static_cast<std::size_t>(R) * R, 0);
    net.net_tokens_to_node.assign(static_cast<std::size_t>(R) * N, 0);
    std::vector<int> prefix(static_cast<std::size_t>(R) * R), source_tokens(R);
    for (int s = 0; s < R; ++s) {
      source_tokens[s] = at(s, 0);
      for (int d2 = 0; d2 < R; ++d2) {
        net.net_tokens_to_rank[static_cast<std::size_t>(s) * R + d2] = at(s, kHead + d2);
        prefix[static_cast<std::size_t>(s) * R + d2] =
            at(s, kHead + d2) + (s > 0 ? prefix[static_cast<std::size_t>(s - 1) * R + d2] : 0);
      }
      for (int m = 0; m < N; ++m)
        net.net_tokens_to_node[static_cast<std::size_t>(s) * N + m] = at(s, kHead + R + m);
    }
    const int epr = E / R;
    handle->num_recv_tokens_per_expert.assign(epr, 0);
    for (int j = 0; j < epr; ++j) {
      long long sum = 0;
      for (int s = 0; s < R; ++s) sum += at(s, kHead + R + N + me * epr + j);
      const long long al = a.expert_alignment;
      handle->num_recv_tokens_per_expert[j] = static_cast<int>((sum + al - 1) / al * al);
    }
    handle->recv_counts.assign(R, 0);
    for (int s = 0; s < R; ++s) handle->recv_counts[s] = at(s, kHead + me);
    upload(handle->rank_prefix_matrix, prefix, x);
    upload(handle->source_num_tokens, source_tokens, x);
  }

  std::optional<plan::InternodeRoute> route;
  if (worst == 0) route.emplace(route_of(*handle, topology, op));
  const plan::HtNetRegion region =
      worst > 0 ? plan::HtNetRegion::fixed_dispatch(topology, worst, record, net.net_slot_rows)
                : plan::HtNetRegion::dispatch(*route, record);
  // The rings (EPX_HT_RINGS): fixed rings instead of the whole-call areas.
  // They carry their counts in-band, so num_worst_tokens takes them too: the
  // exchange kernel still runs first (the receivers' rank_prefix_matrix and
  // the table the combine reads), with its count rows in the rings' state
  // block, and the fixed slots still bound a rank's rows per node (the
  // barrier refuses more) and size the combine.
  //
  // Which kernels: a cached dispatch follows the dispatch that made its
  // handle (and the combine follows it too); EPX_HT_RINGS=0 / >= 1 forces
  // them; by default the whole-call kernels where their areas for this
  // dispatch and for its combine fit the buffer, the rings where not, so any
  // token count runs on a buffer of any size the rings fit. Every rank
  // decides from the same exchanged counts (and the barrier compares the
  // ring layouts). num_worst_tokens fixes the areas, which must fit: the
  // whole-call kernels, unless forced.
  bool rings = false;
  if (a.handle)
    rings = across(*a.handle, op).net_rings;
  else if (ht_rings > 0)
    rings = true;
  else if (ht_rings < 0 && worst == 0)
    rings =
        region.total > ht_capacity() ||
        plan::HtNetRegion::combine(*route, plan::ht_combine_row_bytes(H, K)).total > ht_capacity();
  net.net_rings = rings;
  std::optional<plan::HtRingRegion> ring;
  if (rings)
    ring = plan::HtRingRegion::make(
        topology, ring_geometry(ht_rings, blocks, cfg, record, topology, ht.bytes, false), record,
        plan::HtNetRegion::body(R), ht.bytes);
  if (!rings || worst > 0) check_fits(op, region, ht_capacity(), worst);
  const int Nr = worst > 0 ? worst : route->recv_rows(me);
  if (!a.handle) {
    handle->num_recv_tokens = Nr;
    const kernels::HtNetTable tab = kernels::HtNetTable::make(N, L);
    std::vector<int> table;  // with num_worst_tokens the exchange kernel makes it
    if (worst == 0) {
      table.assign(tab.ints, 0);
      for (int m = 0; m < N; ++m) {
        const int src = m * L + topology.local_of(me);
        table[tab.fwd_rows + m] = route->forwarded_rows(me, src);
        table[tab.node_rows + m] = route->tokens_to_node(me, m);
        for (int d2 = 0; d2 < L; ++d2)
          table[tab.stage_base + d2 * N + m] =
              route->recv_offset(topology.node_of(me) * L + d2, src);
      }
      table[tab.recv_rows] = Nr;
    }
    auto parts = make_parts({{DType::kI32, {tab.ints}},
                             {DType::kI32, {N, std::max(region.slot_rows, 1)}},
                             {DType::kI32, {N, std::max(region.slot_rows, 1)}},
                             {DType::kI32, {Nr, 3}}},
                            a.streams);
    after_allocs(*this, a.streams, x);
    net.net_table = parts[0];
    net.net_fwd_mask = parts[1];
    net.net_fwd_token = parts[2];
    net.net_recv_meta = parts[3];
    upload(net.net_table, table, x);
  }

  DispatchResult res;
  res.recv_x = make(a.x.dtype, {Nr, H}, a.streams);
  if (scaled) res.recv_x_scales = make(a.x_scales->dtype, {Nr, S}, a.streams);
  if (K > 0) res.recv_topk_idx = make(DType::kI64, {Nr, K}, a.streams);
  if (K > 0 && a.topk_weights) res.recv_topk_weights = make(DType::kF32, {Nr, K}, a.streams);
  Tensor recv_src_idx = make(DType::kI32, {Nr}, a.streams);
  after_allocs(*this, a.streams, x);
  // Rows past what arrives (num_worst_tokens) name no expert, as within a node.
  if (worst > 0 && res.recv_topk_idx && Nr > 0)
    EPX_CUDA_CHECK(
        cudaMemsetAsync(res.recv_topk_idx->view.data, 0xff, res.recv_topk_idx->view.nbytes(), x));

  kernels::HtNetDispatchArgs p{};
  p.off = offsets_of(region);
  p.table = net.net_table.ptr<int>();
  set_dispatch_rows(p, a);
  p.send_pos = net.net_send_pos.ptr<int>();
  p.rank_pos = net.net_rank_pos.ptr<int>();
  p.num_tokens = T;
  p.hidden_bytes = hidden_bytes;
  p.num_scales = S;
  p.num_topk = K;
  p.num_experts = E;
  p.fwd_mask = net.net_fwd_mask.ptr<int>();
  p.fwd_token = net.net_fwd_token.ptr<int>();
  p.num_recv_rows = Nr;
  p.recv_x = static_cast<uint8_t*>(res.recv_x.view.data);
  p.recv_scales = scaled ? static_cast<float*>(res.recv_x_scales->view.data) : nullptr;
  p.recv_topk_idx = res.recv_topk_idx ? res.recv_topk_idx->ptr<int64_t>() : nullptr;
  p.recv_topk_weights = res.recv_topk_weights ? res.recv_topk_weights->ptr<float>() : nullptr;
  p.recv_src_idx = recv_src_idx.ptr<int>();
  p.recv_meta = net.net_recv_meta.ptr<int>();
  p.num_blocks = blocks;
  p.split_puts = split_puts();
  p.num_worst = worst;
  if (!a.handle && worst > 0) {
    p.route_counts = route_counts.ptr<int>();
    p.caller_rank_counts = a.num_tokens_per_rank->ptr<int>();
    p.table_out = net.net_table.ptr<int>();
    p.rank_prefix_matrix = handle->rank_prefix_matrix.ptr<int>();
    p.source_num_tokens = handle->source_num_tokens.ptr<int>();
  }
  p.use_rings = rings;
  if (rings) {
    p.ring = *ring;
    p.ring_trace = ring_trace_dev;
    p.ring_rpm = handle->rank_prefix_matrix.ptr<int>();
    if (worst > 0) p.off.count_rows = ring->count_rows;
  }
  const std::size_t signals = plan::HtNetRegion::kSignals;
  kernels::launch_ht_net_dispatch(transport(ht, signals), p, x);
  if (!a.handle) handle->recv_src_idx = recv_src_idx;
  res.num_recv_tokens_per_expert = handle->num_recv_tokens_per_expert;
  res.handle = handle;
  res.event = ll_leave(a.streams, x);
  return res;
}

CombineResult Buffer::Impl::net_combine(const CombineArgs& a) {
  const char* op = "combine";
  const auto& h = *a.handle;
  const int L = topology.ranks_per_node;
  if (h.ranks_per_node != L)
    throw Error(ErrorCode::kInvalidArgument,
                "combine: handle: was made by a dispatch within one node or with another "
                "ranks_per_node (" +
                    std::to_string(h.ranks_per_node) + ", this buffer has " + std::to_string(L) +
                    ")");
  const DispatchHandle::Internode& hn = across(h, op);
  Config cfg = a.config.value_or(get_combine_config(comm->num_ranks()));
  const int blocks = net_blocks(op, a.config, cfg, num_sms_device);
  const int T = h.num_tokens, H = static_cast<int>(a.x.shape[1]);
  const int K = a.topk_weights ? static_cast<int>(a.topk_weights->shape[1]) : 0;
  const std::size_t row = plan::ht_combine_row_bytes(H, K);
  const plan::HtNetRegion region =
      hn.net_worst > 0 ? plan::HtNetRegion::fixed_combine(topology, hn.net_slot_rows, row)
                       : plan::HtNetRegion::combine(route_of(h, topology, op), row);
  // The rings (EPX_HT_RINGS): fixed rings instead of the whole-call areas
  // (whose header, the barrier's words, both share).
  const bool rings = hn.net_rings;  // the dispatch's choice (net_dispatch)
  std::optional<plan::HtRingRegion> ring;
  if (rings)
    ring = plan::HtRingRegion::make_combine(
        topology, ring_geometry(ht_rings, blocks, cfg, row, topology, ht.bytes, true), row,
        plan::HtNetRegion::body(comm->num_ranks()), ht.bytes);
  else
    check_fits(op, region, ht_capacity(), hn.net_worst);

  const cudaStream_t x = ll_enter(a.streams, op);  // as dispatch
  CombineResult res;
  res.combined_x = make(DType::kBF16, {T, H}, a.streams);
  if (a.topk_weights) res.combined_topk_weights = make(DType::kF32, {T, K}, a.streams);
  after_allocs(*this, a.streams, x);
  kernels::HtNetCombineArgs p{};
  p.off = offsets_of(region);
  p.table = hn.net_table.ptr<int>();
  p.x = a.x.ptr<uint16_t>();
  p.num_x_rows = static_cast<int>(a.x.shape[0]);
  p.topk_weights = a.topk_weights ? a.topk_weights->ptr<float>() : nullptr;
  p.bias0 = a.bias_0 ? a.bias_0->ptr<uint16_t>() : nullptr;
  p.bias1 = a.bias_1 ? a.bias_1->ptr<uint16_t>() : nullptr;
  p.send_pos = hn.net_send_pos.ptr<int>();
  p.fwd_mask = hn.net_fwd_mask.ptr<int>();
  p.recv_meta = hn.net_recv_meta.ptr<int>();
  p.num_recv_rows = h.num_recv_tokens;
  p.num_tokens = T;
  p.hidden = H;
  p.num_topk = K;
  p.combined_x = res.combined_x.ptr<uint16_t>();
  p.combined_topk_weights =
      res.combined_topk_weights ? res.combined_topk_weights->ptr<float>() : nullptr;
  p.num_blocks = blocks;
  p.split_puts = split_puts();
  p.num_worst = hn.net_worst;
  p.use_rings = rings;
  if (rings) {
    p.ring = *ring;
    p.ring_trace = ring_trace_dev ? ring_trace_dev + kRingTraceU64 : nullptr;
    p.fwd_token = hn.net_fwd_token.ptr<int>();
    p.recv_src_idx = h.recv_src_idx.ptr<int>();
    p.rank_prefix_matrix = h.rank_prefix_matrix.ptr<int>();
    p.source_num_tokens = h.source_num_tokens.ptr<int>();
  }
  kernels::launch_ht_net_combine(transport(ht, plan::HtNetRegion::kSignals), p, x);
  res.event = ll_leave(a.streams, x);
  return res;
}

std::size_t Buffer::get_internode_nvl_size_hint(int num_max_tokens, int hidden, int num_ranks,
                                                int ranks_per_node, int num_topk,
                                                std::optional<int> ht_rings_option) {
  require(num_max_tokens >= 0, "num_max_tokens",
          "must be >= 0, got " + std::to_string(num_max_tokens));
  require(hidden > 0 && hidden % 8 == 0, "hidden",
          "must be a positive multiple of 8 (16-byte BF16 rows), got " + std::to_string(hidden));
  require(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks",
          "must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(num_ranks));
  require(
      ranks_per_node >= 1 && ranks_per_node <= kMaxRanksPerNode && num_ranks % ranks_per_node == 0,
      "ranks_per_node",
      "must be in [1, " + std::to_string(kMaxRanksPerNode) + "] and divide num_ranks (" +
          std::to_string(num_ranks) + "), got " + std::to_string(ranks_per_node));
  require(num_topk >= 0 && num_topk <= 16, "num_topk",
          "must be in [0, 16], got " + std::to_string(num_topk));
  const std::size_t record = plan::ht_net_record_bytes(2u * hidden, 0, num_topk, ranks_per_node);
  const std::size_t row = plan::ht_combine_row_bytes(hidden, num_topk);
  const Topology topology{num_ranks, ranks_per_node};
  const std::size_t bytes = plan::HtNetRegion::worst_case(topology, num_max_tokens, record, row);
  // As the Buffer resolves it: the field, else EPX_HT_RINGS, else -1.
  if (ht_rings_option) validate::ht_rings(*ht_rings_option);
  const int ht_rings = ht_rings_option ? *ht_rings_option : env::ht_rings();
  if (ht_rings == 0) return bytes;
  // Unless the rings are off, the dispatch's and the combine's rings share
  // the area after the header with the whole-call areas (by default the
  // rings take only the calls that do not fit those; a num_worst_tokens
  // dispatch must fit them), each sized for its default config's SMs (more
  // SMs, more channels), and the state block sits at the region's end.
  const Config dcfg = get_dispatch_config(num_ranks), ccfg = get_combine_config(num_ranks);
  const plan::HtRingRegion rings = plan::HtRingRegion::make(
      topology,
      ring_geometry(ht_rings, dcfg.num_sms, dcfg, record, topology, std::size_t{1} << 46, false),
      record, plan::HtNetRegion::body(num_ranks), std::size_t{1} << 46);
  const plan::HtRingRegion combine_rings = plan::HtRingRegion::make_combine(
      topology,
      ring_geometry(ht_rings, ccfg.num_sms, ccfg, row, topology, std::size_t{1} << 46, true), row,
      plan::HtNetRegion::body(num_ranks), std::size_t{1} << 46);
  return std::max({bytes, rings.rings_end, combine_rings.rings_end}) +
         plan::HtRingRegion::state_bytes(topology);
}

bool DispatchHandle::took_rings() const {
  return internode && internode->net_rings;
}

}  // namespace epx
