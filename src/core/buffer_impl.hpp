// core/buffer_impl.hpp - Buffer's private state, shared by the op files.
#pragma once

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/diag.hpp"
#include "core/stream_wait.hpp"
#include "epx/buffer.hpp"
#include "kernels/kernels.hpp"
#include "transport/any.hpp"
#include "transport/backend.hpp"

namespace epx {

struct Buffer::Impl {
  std::shared_ptr<Communicator> comm;
  BufferOptions opts;
  std::unique_ptr<transport::Backend> backend;
  Topology topology;
  transport::SymmetricRegion ht;  ///< high-throughput region (num_nvl_bytes)
  transport::SymmetricRegion ll;  ///< low-latency region (num_rdma_bytes)
  cudaStream_t comm_stream = nullptr;
  int device = 0;
  int num_sms_device = 0;  ///< SMs this rank may use: the GPU's, split among in-process ranks on it
  int ll_sms = 0;          ///< of those, what the low-latency kernels use (BufferOptions::ll_sms)
  int num_sms_gpu = 0;     ///< SMs of the whole GPU
  /// Block budget of one low-latency launch that `per_sm` blocks per SM would
  /// fill on this rank's SMs. With in-process ranks sharing the GPU, the
  /// hardware does not keep a rank's blocks on its share, and a block may
  /// take a whole SM: every rank's (at most two) resident LL kernels must fit
  /// at one block per SM, so each gets SMs / (2 x ranks on the GPU) blocks.
  int ll_blocks(int per_sm) const {
    const int sharing = comm->ranks_on_device();
    return sharing > 1 ? std::max(1, num_sms_gpu / (2 * sharing)) : per_sm * ll_sms;
  }
  double timeout_s = 60;
  Allocator alloc;
  bool destroyed = false;

  // Local device state.
  uint32_t* ht_op_counter = nullptr;  ///< epochs of high-throughput ops
  uint32_t* ll_op_counter = nullptr;  ///< epochs of low-latency ops
  /// Low-latency ops over a network transport: [0] dispatches, [1] combines so
  /// far (what a source's signal counts; reset by clean_low_latency_buffer).
  uint64_t* ll_seq = nullptr;
  int* ll_mask = nullptr;  ///< enable_shrink: int32 [plan::kLlMaxRanks], 1 = rank left out (LL ops)
  /// BufferOptions::ll_arrival_order, resolved when the buffer was made
  /// (LlDispatchRecvParams::arrival_order).
  bool ll_arrival_order = false;
  /// BufferOptions::ll_context_ranges, resolved when the buffer was made (the
  /// send kernels' ctx_tokens).
  bool ll_context_ranges = false;
  /// The LL send kernels' ctx_tokens for `max_tokens` per rank: 0 (token t on
  /// context t % contexts) unless ll_context_ranges, then ceil(max_tokens / contexts).
  int ll_ctx_tokens(int max_tokens) const {
    const int contexts = backend->num_contexts();
    return ll_context_ranges && contexts > 1 ? (max_tokens + contexts - 1) / contexts : 0;
  }
  /// BufferOptions::net_split_puts, resolved when the buffer was made (unset:
  /// the backend's puts_copy_on_sms decides at each op).
  std::optional<bool> net_split_puts;
  /// BufferOptions::ht_rings, resolved: -1 (default) the rings where the whole-call areas do not
  /// fit, 0 never, 1 always with the default ring sizes, N always with N records
  int ht_rings = -1;
  /// EPX_DEBUG_LL_DISPATCH_STOP naming this rank when the buffer was made: its
  /// LL dispatch sends the rows of this many tokens only (a rank dying mid-op).
  int ll_dispatch_stop_tokens = std::numeric_limits<int>::max();
  /// [0] HT main kernels with their own barrier, [1] notify kernels: blocks done.
  uint32_t* ht_done_blocks = nullptr;
  // Host-mapped memory the kernels write: diagnostics and dispatch counts.
  DeviceDiag* diag_host = nullptr;
  DeviceDiag* diag_dev = nullptr;
  int* counts_host = nullptr;
  int* counts_dev = nullptr;
  /// EPX_RING_TRACE: [op kind: dispatch, combine][kernels' ring trace]
  /// (kernels::kRingTraceWords per role and channel), mapped; else nullptr.
  unsigned long long* ring_trace_host = nullptr;
  unsigned long long* ring_trace_dev = nullptr;
  static constexpr std::size_t kRingTraceU64 = static_cast<std::size_t>(kernels::kRingTraceRoles) *
                                               plan::kMaxRingChannels * kernels::kRingTraceWords;
  /// Prints the ring trace (destroy; EPX_RING_TRACE).
  void print_ring_trace() const;
  static constexpr int kCountsInts = 4096;
  int ll_parity = 0;  ///< which half of the low-latency double buffer is next
  /// The last low-latency op (not under capture): the event after it and the
  /// stream it ran on. An op on another stream waits for it first, so LL ops
  /// stay in call order whichever stream each one runs on.
  std::optional<Event> ll_tail;
  cudaStream_t ll_tail_stream = nullptr;
  /// Events after receive kernels launched by hooks (not under capture), which
  /// run whenever the caller calls them; completed ones are dropped as new
  /// ones come. ll_sync waits for them too.
  std::vector<Event> ll_hook_events;
  /// BufferOptions::max_ops_in_flight, resolved (0: no bound), and the
  /// events after the ops ll_leave saw launched (not under capture) that may
  /// not have finished yet, oldest first.
  int max_in_flight = 0;
  std::deque<Event> ops_in_flight;

  /// The kernels' view of `region`: the backend's device struct, with the
  /// members the core owns (signal area, deadline, diagnostic) filled in.
  dev::AnyTransport transport(const transport::SymmetricRegion& region,
                              std::size_t signals = 0) const {
    dev::AnyTransport t = backend->device(region);
    dev::TransportBase& b = dev::base_of(t);
    b.signals = signals;
    b.num_contexts = backend->num_contexts();
    b.timeout_ns = timeout_ns();
    b.diag = diag_dev;
    return t;
  }
  /// The low-latency region's transport, with the shrink mask.
  dev::AnyTransport ll_transport(std::size_t signals) const {
    dev::AnyTransport t = transport(ll, signals);
    dev::base_of(t).peer_mask = ll_mask;
    return t;
  }
  /// Whether the backend reaches some peers over the network (not by load/store).
  bool networked() const { return !topology.single_node(); }
  /// HtNetDispatchArgs::split_puts
  bool split_puts() const { return net_split_puts.value_or(backend->puts_copy_on_sms()); }
  /// Bytes of the internode region the whole-call ops may use: all of it, or
  /// with the rings on all but their state block at its end.
  std::size_t ht_capacity() const;
  uint64_t timeout_ns() const {
    return static_cast<uint64_t>(detail::capped_wait_seconds(timeout_s) * 1e9);
  }

  void check_alive(const char* op) const {
    if (destroyed)
      throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": buffer was destroyed");
    // An aborted NCCL communicator took the symmetric windows with it: the
    // peer pointers no longer map anything.
    if (comm && comm->aborted())
      throw Error(ErrorCode::kTimeout,
                  std::string(op) + ": the buffer's communicator was aborted (" +
                      comm->abort_reason() + "); make a new communicator and buffer");
  }
  /// Throws the first diagnostic a kernel recorded (and clears it).
  void raise_if_failed(const char* op);
  /// Host wait with deadline on a flag a kernel sets in mapped memory.
  /// Waits (with a deadline) until the mapped word *flag holds `expected`.
  void wait_host_flag(volatile int* flag, int expected, const char* op);
  /// Sequence numbers of the dispatches whose counts the host waits for (> 0).
  int host_seq = 0;
  int next_host_seq() {
    host_seq = host_seq >= (1 << 30) ? 1 : host_seq + 1;
    return host_seq;
  }
  /// Order the comm stream after the caller (previous_event or stream).
  /// The caller's stream is usable: not the legacy default stream when
  /// in-process ranks share the GPU. enter() checks it; the LL ops check it
  /// themselves first, before they change any state.
  void check_stream(const StreamArgs& s) const;
  void enter(const StreamArgs& s);
  /// Finish: event for async_finish, or make the caller's stream wait.
  std::optional<Event> leave(const StreamArgs& s);
  /// Low-latency ops, and the high-throughput ones across nodes: the stream to launch on. Without
  /// async_finish that is the caller's stream itself (DeepEP does the same in hook mode): no event
  /// hop to the comm stream and back, the same order for the caller.
  cudaStream_t ll_enter(const StreamArgs& s, const char* op);
  /// Pairs with ll_enter: records the tail; event / caller wait as leave().
  std::optional<Event> ll_leave(const StreamArgs& s, cudaStream_t launched);
  /// Waits (host, host_wait_s()) for the last low-latency op, wherever it
  /// ran, and for the receive kernels hooks launched; past the deadline
  /// throws kTimeout naming `op` and the event.
  void ll_sync(const char* op);
  /// Deadline of a host wait for this buffer's GPU work: the kernels' own
  /// deadline (timeout_s) and a grace for the work queued around them; a
  /// kernel whose wait expires reports before the host gives up.
  double host_wait_s() const { return timeout_s + 5.0; }
  /// What a host wait that passed its deadline adds to its error: the
  /// device's report of a kernel that gave up (raise_if_failed's message;
  /// it is cleared), or a failed part of the backend, and the backend's
  /// stall note; "" when there is none.
  std::string stall_diagnosis(const char* op);
  /// Host wait for `stream`'s work with host_wait_s(): kTimeout names `op`,
  /// this rank, `what` and stall_diagnosis().
  void wait_stream(cudaStream_t stream, const char* op, const std::string& what);
  /// EPX_DEBUG_EPOCH_START: both op counters at `start`, and the words
  /// compared with a wrap-safe >= (HT barrier flags, LL combine flags) at
  /// `start` too, as if `start` ops had run; collective (a barrier after).
  void start_epochs_at(uint32_t start);
  /// After a hook launched a receive kernel on `stream`.
  /// `owner`: where the hook's buffers were allocated (they are freed there):
  /// it waits for the hook's kernel when it is another stream.
  void ll_hook_launched(cudaStream_t stream, cudaStream_t owner);
  /// An output tensor, allocated in the caller's stream order (or the comm
  /// stream's with allocate_on_comm_stream). The comm stream must not touch
  /// it before ordered_after_allocs(s) (one event for all of an op's tensors).
  Tensor make(DType dtype, const std::vector<int64_t>& shape, const StreamArgs& s);
  /// Several small tensors carved from one allocation (parts 256-byte
  /// aligned whatever the allocator's alignment, sharing ownership): one
  /// allocator call instead of one each.
  using Part = std::pair<DType, std::vector<int64_t>>;
  std::vector<Tensor> make_parts(const std::vector<Part>& parts, cudaStream_t stream);
  std::vector<Tensor> make_parts(const std::vector<Part>& parts, const StreamArgs& s);
  /// Orders the comm stream after the allocations make() did for `s`.
  void ordered_after_allocs(const StreamArgs& s);

  /// dispatch / combine when the ranks form several nodes (core/internode.cpp).
  DispatchResult net_dispatch(const DispatchArgs& a);
  CombineResult net_combine(const CombineArgs& a);
};

}  // namespace epx
