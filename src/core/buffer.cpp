#include <cuda.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>
#include <vector>

#include "common/env.hpp"
#include "common/internode_route.hpp"
#include "common/plan.hpp"
#include "common/topology.hpp"
#include "core/algorithm_choices.hpp"
#include "core/buffer_impl.hpp"
#include "core/signal_needs.hpp"
#include "core/validate.hpp"
#include "kernels/kernels.hpp"

namespace epx {

namespace detail {
std::atomic<int>& default_num_sms();
}

namespace {
/// Once per process: a warning when CUDA loads modules lazily (its default
/// since 12.2) and a network backend runs, which can then stall until the
/// deadline when some library's kernel is loaded while EPX kernels wait.
void warn_if_lazy_loading(const char* backend, int rank) {
  static std::atomic<bool> warned{false};
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();
    return;
  }
  CUmoduleLoadingMode mode = CU_MODULE_EAGER_LOADING;
  if (reinterpret_cast<CUresult (*)(CUmoduleLoadingMode*)>(fn)(&mode) != CUDA_SUCCESS ||
      mode != CU_MODULE_LAZY_LOADING || warned.exchange(true))
    return;
  std::fprintf(stderr,
               "epx: rank %d: backend %s with lazy CUDA module loading: a kernel loaded at its "
               "first launch while EPX kernels wait for peers can stall every rank until the "
               "deadline; set CUDA_MODULE_LOADING=EAGER before CUDA starts (EPX's own kernels "
               "are loaded now)\n",
               rank, backend);
}

/// One id per rank, equal for ranks of one host (hostname and boot id).
std::vector<int> host_ids(int num_ranks, Communicator& comm) {
  constexpr std::size_t kBytes = 192;
  std::array<char, kBytes> mine{};
  const std::string id = comm.in_process() ? "in-process" : hostname() + "/" + boot_id();
  std::memcpy(mine.data(), id.data(), std::min(id.size(), kBytes - 1));
  const auto all = comm.allgather(mine.data(), kBytes);
  std::vector<std::string> ids(num_ranks);
  for (int r = 0; r < num_ranks; ++r)
    ids[r] = std::string(reinterpret_cast<const char*>(all.data()) + r * kBytes);
  return epx::host_ids(ids);
}
}  // namespace

void BufferOptions::validate() const {
  require(num_nvl_bytes >= 0, "num_nvl_bytes",
          "must be >= 0, got " + std::to_string(num_nvl_bytes));
  require(num_rdma_bytes >= 0, "num_rdma_bytes",
          "must be >= 0, got " + std::to_string(num_rdma_bytes));
  require(num_nvl_bytes > 0 || num_rdma_bytes > 0, "num_nvl_bytes",
          "num_nvl_bytes or num_rdma_bytes must be > 0");
  require(num_qps_per_rank >= 1, "num_qps_per_rank",
          "must be >= 1, got " + std::to_string(num_qps_per_rank));
  // The same rules as their variables' (common/env.cpp), named by the field.
  if (ht_rings) validate::ht_rings(*ht_rings);
  if (ll_sms)
    require(*ll_sms >= 1 && *ll_sms <= (1 << 20), "ll_sms",
            "must be in [1, 2^20] (capped at the SMs the rank may use), got " +
                std::to_string(*ll_sms));
  if (max_ops_in_flight)
    require(*max_ops_in_flight >= 0 && *max_ops_in_flight <= (1 << 20), "max_ops_in_flight",
            "must be in [0, 2^20] (0: no bound), got " + std::to_string(*max_ops_in_flight));
}

Buffer::Buffer(std::shared_ptr<Communicator> comm, BufferOptions options)
    : impl_(std::make_unique<Impl>()) {
  require(comm != nullptr, "comm", "must not be null");
  options.validate();
  auto& d = *impl_;
  d.comm = std::move(comm);
  d.opts = options;
  d.alloc = options.allocator ? options.allocator : default_allocator();
  d.timeout_s = options.timeout_s > 0 ? options.timeout_s : env::timeout_seconds();
  // Malformed variables (algorithm defaults, test knobs) throw before any allocation.
  const AlgorithmChoices choices = resolve_algorithm_choices(options);
  const auto epoch_start = env::debug_epoch_start();
  const auto dispatch_stop = env::debug_ll_dispatch_stop();
  EPX_CUDA_CHECK(cudaGetDevice(&d.device));
  require(d.device == d.comm->device(), "device",
          "the current CUDA device (" + std::to_string(d.device) +
              ") must be the communicator's (" + std::to_string(d.comm->device()) + ")");
  EPX_CUDA_CHECK(
      cudaDeviceGetAttribute(&d.num_sms_device, cudaDevAttrMultiProcessorCount, d.device));
  // In-process ranks that share a GPU share its SMs, so that all of their
  // kernels (which wait for each other) fit on it at once.
  d.num_sms_gpu = d.num_sms_device;
  d.num_sms_device = std::max(1, d.num_sms_device / d.comm->ranks_on_device());
  d.ll_sms = std::min(d.num_sms_device, choices.ll_sms.value_or(d.num_sms_device));
  if (d.comm->ranks_on_device() > 1) {
    // Ranks sharing a GPU share its CUDA context: no EPX kernel may be loaded
    // lazily at a first launch while a peer's kernel waits for this rank.
    kernels::preload_layout_kernels();
    kernels::preload_ht_kernels();
    kernels::preload_ht_net_kernels();
    kernels::preload_ll_kernels();
  }
  // Kernels address a peer's region with this rank's offsets, and the LL
  // send of a rank whose shapes differ stores before the receiver refuses the
  // op: every rank must have regions of the same size. (All ranks see every
  // rank's sizes, so all of them raise, none waits for the others.)
  {
    const int64_t mine[2] = {options.num_nvl_bytes, options.num_rdma_bytes};
    const auto all = d.comm->allgather(mine, sizeof(mine));
    for (int r = 0; r < d.comm->num_ranks(); ++r) {
      int64_t theirs[2];
      std::memcpy(theirs, all.data() + r * sizeof(mine), sizeof(mine));
      for (int i = 0; i < 2; ++i)
        require(theirs[i] == mine[i], i == 0 ? "num_nvl_bytes" : "num_rdma_bytes",
                "must be the same on every rank: rank " + std::to_string(r) + " passed " +
                    std::to_string(theirs[i]) + ", rank " + std::to_string(d.comm->rank()) + " " +
                    std::to_string(mine[i]));
    }
  }
  const std::vector<int> hosts = host_ids(d.comm->num_ranks(), *d.comm);
  d.topology =
      make_topology(d.comm->num_ranks(), options.ranks_per_node, env::ranks_per_node(), hosts);
  require(options.num_qps_per_rank <= dev::kMaxContexts, "num_qps_per_rank",
          "must be <= " + std::to_string(dev::kMaxContexts) + ", got " +
              std::to_string(options.num_qps_per_rank));
  d.ht_rings = choices.ht_rings;
  transport::BackendOptions bo;
  bo.num_contexts = options.num_qps_per_rank;
  bo.heap_bytes = static_cast<std::size_t>(options.num_nvl_bytes + options.num_rdma_bytes);
  detail::set_signal_needs(bo, d.comm->num_ranks(), d.ht_rings != 0);
  bo.proxy_engine = options.proxy_engine;
  bo.fabric_provider = options.fabric_provider;
  bo.fabric_domains = options.fabric_domains;
  bo.proxy_cumem = options.proxy_cumem;
  bo.num_hosts = 1 + *std::max_element(hosts.begin(), hosts.end());
  d.backend = transport::make_backend(options.backend, *d.comm, d.topology, bo);
  if (options.num_nvl_bytes > 0)
    d.ht = d.backend->alloc(static_cast<std::size_t>(options.num_nvl_bytes));
  if (options.num_rdma_bytes > 0)
    d.ll = d.backend->alloc(static_cast<std::size_t>(options.num_rdma_bytes));
  d.backend->start();
  d.max_in_flight = choices.max_ops_in_flight.value_or(d.backend->default_ops_in_flight());
  if (d.networked() && d.comm->ranks_on_device() == 1) {
    // A network backend's host side (the proxy's threads, NCCL's GIN proxy)
    // issues CUDA work in this context while EPX kernels wait for peers that
    // wait for that work. A kernel loaded lazily at its first launch in
    // between stalled every rank until the deadline (4 processes as 2x2 over
    // the proxy on 4x H100 and 4x H200, CUDA_MODULE_LOADING=LAZY): load EPX's
    // kernels now, and say that other code's kernels can do the same.
    kernels::preload_layout_kernels();
    kernels::preload_ht_kernels();
    kernels::preload_ht_net_kernels();
    kernels::preload_ll_kernels();
    warn_if_lazy_loading(d.backend->name(), d.comm->rank());
  }
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&d.comm_stream, cudaStreamNonBlocking));
  // [HT op counter, LL op counter, finished blocks of HT main kernels, of notify
  // kernels, LL network op counts (two u64)]
  EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d.ht_op_counter), 8 * sizeof(uint32_t)));
  EPX_CUDA_CHECK(cudaMemset(d.ht_op_counter, 0, 8 * sizeof(uint32_t)));
  d.ll_op_counter = d.ht_op_counter + 1;
  d.ht_done_blocks = d.ht_op_counter + 2;
  d.ll_seq = reinterpret_cast<uint64_t*>(d.ht_op_counter + 4);
  d.ll_arrival_order = choices.ll_arrival_order;
  d.ll_context_ranges = choices.ll_context_ranges;
  d.net_split_puts = choices.net_split_puts;
  if (dispatch_stop && dispatch_stop->rank == d.comm->rank()) {
    d.ll_dispatch_stop_tokens = dispatch_stop->tokens;
    std::fprintf(stderr,
                 "epx: EPX_DEBUG_LL_DISPATCH_STOP: rank %d's low-latency dispatches send the rows "
                 "of their first %d tokens only\n",
                 d.comm->rank(), dispatch_stop->tokens);
  }
  if (options.enable_shrink) {
    EPX_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&d.ll_mask), plan::kLlMaxRanks * sizeof(int)));
    EPX_CUDA_CHECK(cudaMemset(d.ll_mask, 0, plan::kLlMaxRanks * sizeof(int)));
  }
  if (epoch_start) d.start_epochs_at(*epoch_start);
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&d.diag_host), sizeof(DeviceDiag),
                               cudaHostAllocMapped));
  std::memset(d.diag_host, 0, sizeof(DeviceDiag));
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d.diag_dev), d.diag_host, 0));
  if (env::ring_trace()) {
    const std::size_t bytes = 2 * Impl::kRingTraceU64 * sizeof(unsigned long long);
    EPX_CUDA_CHECK(
        cudaHostAlloc(reinterpret_cast<void**>(&d.ring_trace_host), bytes, cudaHostAllocMapped));
    std::memset(d.ring_trace_host, 0, bytes);
    EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d.ring_trace_dev),
                                            d.ring_trace_host, 0));
  }
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&d.counts_host),
                               sizeof(int) * Impl::kCountsInts, cudaHostAllocMapped));
  std::memset(d.counts_host, 0, sizeof(int) * Impl::kCountsInts);
  EPX_CUDA_CHECK(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&d.counts_dev), d.counts_host, 0));
}

Buffer::~Buffer() {
  try {
    destroy();
  } catch (...) {
    // a destructor must not throw; destroy() reports errors to explicit callers
  }
}

void Buffer::destroy() {
  auto& d = *impl_;
  if (d.destroyed) return;
  d.destroyed = true;
  // Past the deadline these throw, and the regions stay allocated (kernels
  // still queued may write them); the peers' frees below give up at their
  // communicator's deadline.
  d.wait_stream(d.comm_stream, "destroy", "the comm stream (the buffer's last ops)");
  d.ll_sync("destroy");
  // A wait of the last ops that gave up (recorded by the kernels, raised by
  // the next call) has no next call when they are the last before destroy:
  // it is raised here, once the collective frees below are done, so that an
  // op whose outputs were left unwritten never goes unreported.
  // Only a report no call raised yet: a proxy channel that stopped stays
  // stopped (raise_if_failed's health check), and was raised by the op that
  // found it.
  std::exception_ptr failed;
  if (d.diag_host->code != 0) {
    try {
      d.raise_if_failed("destroy");
    } catch (const Error&) {
      failed = std::current_exception();
    }
  }
  // This rank's own memory first: its ops are done, and these frees may wait
  // for the whole device (other in-process ranks' kernels, which no longer
  // need this rank). The symmetric regions go last; the backend's final
  // barrier keeps every rank here until all have freed, so no rank's next
  // kernels can be waited for by a peer's free.
  cudaFree(d.ht_op_counter);
  if (d.ll_mask) cudaFree(d.ll_mask);
  cudaFreeHost(d.diag_host);
  cudaFreeHost(d.counts_host);
  if (d.ring_trace_host) {
    d.print_ring_trace();
    cudaFreeHost(d.ring_trace_host);
  }
  try {
    d.backend->free(d.ht);
  } catch (...) {
    d.backend->free(d.ll);  // still collective: the peers are freeing theirs
    throw;
  }
  d.backend->free(d.ll);
  if (failed) std::rethrow_exception(failed);
  // The comm stream is not destroyed: tensors used on it (torch's
  // record_stream, events users keep) may be freed after the buffer, and an
  // event recorded on a destroyed stream fails. One idle stream per buffer
  // lives until the process exits.
}

int Buffer::rank() const {
  return impl_->comm->rank();
}
int Buffer::num_ranks() const {
  return impl_->comm->num_ranks();
}
int Buffer::device() const {
  return impl_->device;
}
int Buffer::num_rdma_ranks() const {
  return impl_->topology.num_nodes();
}
int Buffer::rdma_rank() const {
  return impl_->topology.node_of(rank());
}
int Buffer::num_nvl_ranks() const {
  return impl_->topology.ranks_per_node;
}
int Buffer::nvl_rank() const {
  return impl_->topology.local_of(rank());
}
int Buffer::root_rdma_rank(bool global) const {
  return global ? impl_->topology.local_of(rank()) : 0;
}
cudaStream_t Buffer::comm_stream() const {
  return impl_->comm_stream;
}
const char* Buffer::backend_name() const {
  return impl_->backend->name();
}
std::string Buffer::network_engine() const {
  return impl_->backend->engine_name();
}

std::optional<NetworkTraffic> Buffer::network_traffic() const {
  return impl_->backend->network_traffic();
}

int Buffer::num_network_contexts() const {
  return impl_->backend->num_contexts();
}
std::size_t Buffer::buffer_bytes() const {
  return impl_->ht.bytes + impl_->ll.bytes;
}

TensorView Buffer::local_buffer(bool low_latency) const {
  const auto& r = low_latency ? impl_->ll : impl_->ht;
  return TensorView::contiguous(r.local, DType::kBF16, {static_cast<int64_t>(r.bytes / 2)},
                                impl_->device);
}

void Buffer::set_num_sms(int num_sms) {
  require(num_sms >= 2 && num_sms % 2 == 0, "num_sms",
          "must be an even number >= 2, got " + std::to_string(num_sms));
  detail::default_num_sms().store(num_sms);
}
int Buffer::num_sms() {
  return detail::default_num_sms().load();
}

void Buffer::Impl::start_epochs_at(uint32_t start) {
  const uint32_t counters[2] = {start, start};
  EPX_CUDA_CHECK(cudaMemcpy(ht_op_counter, counters, sizeof(counters), cudaMemcpyHostToDevice));
  auto fill = [&](void* region, std::size_t offset, std::size_t words) {
    const std::vector<uint32_t> v(words, start);
    EPX_CUDA_CHECK(cudaMemcpy(static_cast<char*>(region) + offset, v.data(), 4 * words,
                              cudaMemcpyHostToDevice));
  };
  // (Across nodes the ht region holds the internode ops' counts and signals,
  // which count ops from 0 and have no epoch to start.)
  if (!networked() && ht.bytes >= plan::HtRegion::flags_offset())
    fill(ht.local, plan::HtRegion::barrier_offset(), plan::kHtMaxRanks);
  if (ll.bytes >= plan::LlRegion::weights_base())
    fill(ll.local, plan::LlRegion::flags_base(), 2 * plan::LlRegion::flags_bytes() / 4);
  comm->barrier();  // no peer's first op may store before these words are set
  static std::atomic<bool> told{false};
  if (!told.exchange(true))
    std::fprintf(stderr, "epx: EPX_DEBUG_EPOCH_START: op counters of new buffers start at %u\n",
                 start);
}

void Buffer::check() {
  impl_->check_alive("check");
  impl_->raise_if_failed("check");
}

void Buffer::Impl::raise_if_failed(const char* op) {
  if (static_cast<volatile DeviceDiag*>(diag_host)->code == 0) {
    backend->check_health();  // a proxy thread that died, even if no GPU wait noticed yet
    return;
  }
  // The report is read once and cleared before anything below can raise (the
  // backend's health check may), so that the next call does not raise it again.
  DeviceDiag report{};
  std::memcpy(&report, const_cast<const DeviceDiag*>(diag_host), sizeof(DeviceDiag));
  std::memset(diag_host, 0, sizeof(DeviceDiag));
  const DeviceDiag* const g = &report;
  const auto code = static_cast<DiagCode>(g->code);
  const auto what = static_cast<OpId>(g->op);
  // A failure the backend's own device half reported (a proxy channel's, a
  // network queue's) is the backend's to word.
  if (auto own = backend->describe_failure(report, timeout_s))
    throw Error(ErrorCode::kTimeout, std::string(op) + ": " + *own);
  std::ostringstream os;
  // What held this rank's side of a timeout, if the backend saw it (a proxy
  // step held for seconds): the peer a wait names may be waiting for it.
  auto add_stall_note = [&] {
    const std::string note = backend->stall_note();
    if (!note.empty()) os << "; " << note;
  };
  if (code == DiagCode::kTimeout && g->channel >= kDiagSignalChannel) {
    const int sig = g->channel - kDiagSignalChannel, R = comm->num_ranks();
    // The signal kinds of the low-latency ops, and of the high-throughput
    // ones across nodes (plan::HtNetSignal).
    static const char* ll_kinds[] = {"dispatch", "combine weights", "combine rows"};
    static const char* ht_kinds[] = {"arrival at the op",       "dispatch rows",
                                     "forwarded dispatch rows", "returned combine rows",
                                     "combined node rows",      "count row"};
    const bool ll = what == OpId::kLowLatencyDispatchSend ||
                    what == OpId::kLowLatencyDispatchRecv || what == OpId::kLowLatencyCombineSend ||
                    what == OpId::kLowLatencyCombineRecv;
    const int kind = sig / R, ht_kind = kind - plan::kHtNetFirstSignalKind;
    const char* name = ll ? (kind < 3 ? ll_kinds[kind] : "signal")
                          : (ht_kind >= 0 && ht_kind < 6 ? ht_kinds[ht_kind] : "signal");
    // The low-latency ops signal only peers of other nodes; the
    // high-throughput ones across nodes signal every rank.
    os << op_name(what) << ": rank " << g->rank << " waited more than " << timeout_s
       << " s for rank " << g->peer << "'s " << name << (ll ? " over the network" : "")
       << " (signal " << sig << " at " << g->seen << ", expected " << g->expected << "); rank "
       << g->peer
       << " or its proxy / network is stalled or dead, or it called a different op (set "
          "EPX_TIMEOUT_S to wait longer)";
  } else if (code == DiagCode::kTimeout) {
    os << op_name(static_cast<OpId>(g->op)) << ": rank " << g->rank << " waited more than "
       << timeout_s << " s for rank " << g->peer << " (chunk/slot " << g->channel
       << ", expected epoch " << g->expected << ", saw " << g->seen
       << "); the peer is stalled, crashed, or called a different op (set EPX_TIMEOUT_S to wait "
          "longer)";
  } else if (code == DiagCode::kBadLayout) {
    os << op_name(static_cast<OpId>(g->op)) << ": num_tokens_per_rank[" << g->peer << "] is "
       << g->expected << " on rank " << g->rank << " but is_token_in_rank marks " << g->seen
       << " tokens for rank " << g->peer
       << "; pass the tensors of one get_dispatch_layout call unchanged";
  } else if (code == DiagCode::kBadConfig && static_cast<OpId>(g->op) == OpId::kBarrier) {
    os << internode_shape_message(g->channel, g->rank, g->peer, static_cast<int>(g->expected),
                                  static_cast<int>(g->seen));
  } else if (code == DiagCode::kBadConfig) {
    const bool ll = static_cast<OpId>(g->op) == OpId::kLowLatencyDispatchRecv;
    os << op_name(static_cast<OpId>(g->op)) << ": rank " << g->rank << " and rank " << g->peer
       << " called it with different configs or row layouts"
       << (ll ? " (every rank must pass the same num_max_dispatch_tokens_per_rank, hidden, "
                "num_experts and use_fp8); this dispatch's outputs are not valid"
              : " (every rank must pass the same config: num_max_send_tokens, "
                "num_max_recv_tokens, num_sms / num_send_sms; and the same hidden size, dtype, "
                "top-k and num_experts); no rows were sent");
  } else if (code == DiagCode::kTooManyTokens) {
    os << op_name(static_cast<OpId>(g->op)) << ": num_worst_tokens: rank " << g->rank
       << " received at least " << (g->seen + 1) << " tokens but the outputs hold only "
       << g->expected << " rows; raise num_worst_tokens (rows past it were dropped)";
  } else {
    os << op_name(static_cast<OpId>(g->op))
       << ": topk_idx: values must be -1 or in [0, num_experts); token " << g->token << " slot "
       << g->channel << " holds " << static_cast<int32_t>(g->seen);
  }
  if (code == DiagCode::kTimeout) add_stall_note();
  throw Error(code == DiagCode::kTimeout ? ErrorCode::kTimeout : ErrorCode::kInvalidArgument,
              std::string(op) + ": " + os.str());
}

void Buffer::Impl::wait_host_flag(volatile int* flag, int expected, const char* op) {
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::duration<double>(timeout_s + 5.0);
  uint32_t spins = 0;
  while (*flag != expected) {
    if (diag_host->code != 0) {
      // A kernel gave up: the report is complete once the stream is done;
      // past the deadline it is raised as it stands.
      (void)detail::wait_stream_for(comm_stream, host_wait_s());
      raise_if_failed(op);
    }
    if (++spins > 1000) std::this_thread::yield();
    if (std::chrono::steady_clock::now() - start > limit) {
      cudaError_t e = cudaStreamQuery(comm_stream);
      throw Error(ErrorCode::kTimeout, std::string(op) + ": rank " + std::to_string(comm->rank()) +
                                           ": the count exchange did not finish within " +
                                           std::to_string(timeout_s) +
                                           " s (comm stream: " + cudaGetErrorString(e) + ")");
    }
  }
}

void Buffer::Impl::check_stream(const StreamArgs& s) const {
  require(comm->ranks_on_device() == 1 || (s.stream != nullptr && s.stream != cudaStreamLegacy),
          "streams.stream",
          "must not be the legacy default stream while in-process ranks share this GPU: every "
          "rank's thread would order its waits behind the others' (give each rank a stream)");
}

void Buffer::Impl::enter(const StreamArgs& s) {
  check_stream(s);
  raise_if_failed("previous op");
  if (s.previous_event && s.previous_event->valid()) {
    s.previous_event->stream_wait(comm_stream);
  } else {
    Event::record(s.stream).stream_wait(comm_stream);
  }
}

namespace {
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
  return cap != cudaStreamCaptureStatusNone;
}
}  // namespace

cudaStream_t Buffer::Impl::ll_enter(const StreamArgs& s, const char* op) {
  const bool direct = !s.async_finish && !(s.previous_event && s.previous_event->valid());
  if (!direct)
    enter(s);
  else
    raise_if_failed("previous op");
  const cudaStream_t x = direct ? s.stream : comm_stream;
  // A capturing stream cannot wait for an event recorded outside the capture:
  // a captured op is ordered by the graph launch instead. Nor is it queued
  // now, so it waits for no earlier op either (and a capture in global mode
  // must not query events).
  if (capturing(x)) return x;
  if (max_in_flight > 0) {
    // The bound on ops queued on the GPU (BufferOptions::max_ops_in_flight).
    while (!ops_in_flight.empty() && ops_in_flight.front().done()) ops_in_flight.pop_front();
    if (static_cast<int>(ops_in_flight.size()) >= max_in_flight) {
      const std::string what = "the op " + std::to_string(ops_in_flight.size()) +
                               " calls earlier, the oldest still queued (max_ops_in_flight " +
                               std::to_string(max_in_flight) + ")";
      detail::wait_event(ops_in_flight.front().get(), {op, comm->rank(), what}, host_wait_s(),
                         [&] { return stall_diagnosis(op); });
      ops_in_flight.pop_front();
      raise_if_failed("previous op");
    }
  }
  if (ll_tail && ll_tail_stream != x) ll_tail->stream_wait(x);
  return x;
}

std::optional<Event> Buffer::Impl::ll_leave(const StreamArgs& s, cudaStream_t launched) {
  if (!capturing(launched)) {
    ll_tail = Event::record(launched);
    ll_tail_stream = launched;
    if (max_in_flight > 0) ops_in_flight.push_back(*ll_tail);
  }
  if (launched == comm_stream) return leave(s);
  return std::nullopt;
}

void Buffer::Impl::ll_sync(const char* op) {
  auto note = [&] { return stall_diagnosis(op); };
  const detail::WaitSite tail{op, comm->rank(), "the last low-latency op's event"};
  if (ll_tail) detail::wait_event(ll_tail->get(), tail, host_wait_s(), note);
  ll_tail.reset();
  ll_tail_stream = nullptr;
  ops_in_flight.clear();  // older than the tail
  const detail::WaitSite hooks{op, comm->rank(), "a receive hook's kernel"};
  for (const Event& e : ll_hook_events) detail::wait_event(e.get(), hooks, host_wait_s(), note);
  ll_hook_events.clear();
}

void Buffer::Impl::print_ring_trace() const {
  static constexpr const char* kOps[] = {"dispatch", "combine"};
  static constexpr const char* kRoles[2][kernels::kRingTraceRoles] = {
      {"send", "forward", "receive"}, {"return", "forward", "finish"}};
  for (int k = 0; k < 2; ++k)
    for (int role = 0; role < kernels::kRingTraceRoles; ++role) {
      // Means over the channels that ran, per op
      double ops = 0, us = 0, idle_us = 0;
      int channels = 0;
      for (int c = 0; c < plan::kMaxRingChannels; ++c) {
        const unsigned long long* w =
            ring_trace_host + k * kRingTraceU64 +
            (static_cast<std::size_t>(role) * plan::kMaxRingChannels + c) *
                kernels::kRingTraceWords;
        if (w[0] == 0) continue;
        ++channels;
        ops += static_cast<double>(w[0]);
        us += static_cast<double>(w[1]) / 1e3;
        idle_us += static_cast<double>(w[2]) / 1e3;
      }
      if (channels == 0) continue;
      std::fprintf(stderr,
                   "epx ring trace rank %d %s %s: %.0f ops on %d channels, %.1f us per op, "
                   "%.1f us of it in passes that moved nothing (%.0f%%)\n",
                   comm->rank(), kOps[k], kRoles[k][role], ops / channels, channels, us / ops,
                   idle_us / ops, us > 0 ? 100.0 * idle_us / us : 0.0);
    }
}

std::string Buffer::Impl::stall_diagnosis(const char* op) {
  std::string out;
  try {
    raise_if_failed(op);
  } catch (const Error& e) {
    out = std::string("the device reported: ") + e.what();
  }
  const std::string note = backend->stall_note();
  if (!note.empty()) out += (out.empty() ? "" : "; ") + note;
  return out;
}

void Buffer::Impl::wait_stream(cudaStream_t stream, const char* op, const std::string& what) {
  detail::wait_stream(stream, {op, comm->rank(), what}, host_wait_s(),
                      [&] { return stall_diagnosis(op); });
}

void Buffer::Impl::ll_hook_launched(cudaStream_t stream, cudaStream_t owner) {
  if (capturing(stream)) return;
  std::erase_if(ll_hook_events, [](const Event& e) { return e.done(); });
  Event e = Event::record(stream);
  if (owner != stream) e.stream_wait(owner);
  ll_hook_events.push_back(std::move(e));
}

std::optional<Event> Buffer::Impl::leave(const StreamArgs& s) {
  Event e = Event::record(comm_stream);
  if (s.async_finish) return e;
  e.stream_wait(s.stream);
  return std::nullopt;
}

Tensor Buffer::Impl::make(DType dtype, const std::vector<int64_t>& shape, const StreamArgs& s) {
  return alloc(dtype, shape, s.allocate_on_comm_stream ? comm_stream : s.stream);
}

std::vector<Tensor> Buffer::Impl::make_parts(const std::vector<Part>& parts, cudaStream_t stream) {
  constexpr std::size_t kAlign = 256;
  std::vector<std::size_t> offset(parts.size());
  std::size_t total = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    std::size_t n = element_size(parts[i].first);
    for (int64_t d : parts[i].second) n *= static_cast<std::size_t>(d);
    offset[i] = total;
    total += (n + kAlign - 1) / kAlign * kAlign;
  }
  // An allocator promises int32 alignment only: room to start at the next
  // 256-byte boundary (parts of 8 bytes, such as int64 and int2, need it).
  total += kAlign;
  const Tensor base = alloc(DType::kI32, {static_cast<int64_t>(total / 4)}, stream);
  const auto addr = reinterpret_cast<std::uintptr_t>(base.view.data);
  char* const first = reinterpret_cast<char*>((addr + kAlign - 1) / kAlign * kAlign);
  std::vector<Tensor> out(parts.size());
  for (std::size_t i = 0; i < parts.size(); ++i) {
    out[i].view = TensorView::contiguous(first + offset[i], parts[i].first, parts[i].second,
                                         base.view.device);
    out[i].owner = base.owner;
  }
  return out;
}

std::vector<Tensor> Buffer::Impl::make_parts(const std::vector<Part>& parts, const StreamArgs& s) {
  return make_parts(parts, s.allocate_on_comm_stream ? comm_stream : s.stream);
}

void Buffer::Impl::ordered_after_allocs(const StreamArgs& s) {
  // Memory allocated in another stream's order is used on the comm stream.
  if (!s.allocate_on_comm_stream && s.stream != comm_stream)
    Event::record(s.stream).stream_wait(comm_stream);
}

}  // namespace epx
