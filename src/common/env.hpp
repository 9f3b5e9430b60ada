// common/env.hpp - environment variables EPX reads, every one of them here.
//
// Deployment settings (deadlines, backend, node size, caps, paths) are read
// from the environment. Algorithm choices are BufferOptions / Config fields;
// their variables stay as the defaults of those fields (read only when the
// field is unset). Debug and test knobs are listed in docs/developer.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace epx::env {

std::optional<std::string> get(const char* name);
/// Integer variable; throws epx::Error(kInvalidArgument) naming it when malformed.
std::optional<long> get_int(const char* name);
/// Integer variable in [lo, hi]; out of range: epx::Error naming it, the range
/// and the value (checked before any narrowing).
std::optional<int64_t> get_int_in(const char* name, int64_t lo, int64_t hi);
std::optional<double> get_double(const char* name);

/// Default deadline of every wait, seconds: EPX_TIMEOUT_S or 60.
double timeout_seconds();

/// Test knob EPX_DEBUG_EPOCH_START: the op counters of every new buffer start
/// there instead of 0, so that a few ops cross the 2^32 wrap of the epochs
/// (plan::next_epoch). Must be in [0, 2^32); unset: nullopt.
std::optional<uint32_t> debug_epoch_start();

/// Test knob EPX_DEBUG_LL_DISPATCH_STOP=RANK:TOKENS: the low-latency dispatch
/// send of rank RANK stores its token count and token masks, but the rows of
/// its first TOKENS tokens only, as a rank that dies in the middle of a
/// dispatch would leave it (peers in shrink mode mask it at their deadline;
/// without shrink mode they raise kTimeout). Read when a Buffer is made;
/// unset: nullopt; malformed: epx::Error naming the variable.
struct LlDispatchStop {
  int rank = 0, tokens = 0;
};
std::optional<LlDispatchStop> debug_ll_dispatch_stop();

/// Test knob EPX_DEBUG_PROXY_STOP=RANK:CHANNEL:COMMANDS: that rank's proxy
/// channel stops after COMMANDS commands, as a proxy thread that died would.
/// Unset: nullopt; malformed: epx::Error naming the variable.
struct ProxyStop {
  int rank = 0, channel = 0, commands = 0;
};
std::optional<ProxyStop> debug_proxy_stop();

/// EPX_HT_PULL (0 or 1, default 0): the value of Config::pull_dispatch in
/// get_dispatch_config's configs (a Config's own field decides per call).
bool ht_pull();

/// EPX_NET_SPLIT_PUTS, where BufferOptions::net_split_puts is unset
/// (0 or 1; unset: the backend decides, see
/// Backend::puts_copy_on_sms): whether the high-throughput kernels across
/// nodes share each node slot's put among the blocks of a kernel of its own
/// (1) or leave it to the last block of the kernel that filled the slots (0).
std::optional<bool> net_split_puts();

/// EPX_HT_RINGS, where BufferOptions::ht_rings is unset (same values): which
/// kernels the high-throughput ops across nodes take
/// (docs/internode_ht.md). Unset (returns -1): the whole-call kernels where
/// their areas fit num_nvl_bytes, else the fixed rings of HtRingGeometry's
/// default sizes (any token count). 0: the whole-call kernels only (a call
/// that does not fit raises kBufferTooSmall). 1: always the rings, default
/// sizes; N >= 2: always rings of N records (chunks at most N; small ones
/// test the credits), also with num_worst_tokens. Read when a Buffer is made.
int ht_rings();

/// EPX_PROXY_ROW_COPIES (0 or 1, default 0): the proxy's CUDA IPC engine
/// copies a strided put row by row (one 1-D copy per row) with a process per
/// rank too, instead of one pitched copy (in-process ranks always copy rows).
/// A diagnostic switch (docs/developer.md): whether a pitched peer copy
/// queues behind kernels that hold every SM. Read when the engine is made.
bool proxy_row_copies();
/// EPX_PROXY_CUMEM, where BufferOptions::proxy_cumem is unset (0 or 1;
/// unset: nullopt, the default proxy::cumem_regions picks): 1: the proxy
/// backend's regions are cuMem
/// allocations (with a process per rank exported as POSIX file descriptors
/// over a Unix socket), and the CUDA IPC engine's streams and calls live in a
/// CUDA context of its own (one per device shared by in-process ranks), so
/// that a blocking primary-context call of another thread (a pageable copy
/// behind an op) does not hold its copies, nor do the kernels' hardware
/// queues (docs/limitations.md, docs/low_latency.md). 0: cudaMalloc regions
/// (legacy CUDA IPC with a process per rank) in the primary context. Read
/// when the engine is made.
std::optional<bool> proxy_cumem();

/// EPX_LL_CONTEXT_RANGES, where BufferOptions::ll_context_ranges is unset (0
/// or 1, default 0): across nodes, the low-latency
/// ops put token t's rows on context min(t / ceil(maxT / contexts),
/// contexts - 1) (each context a contiguous range of tokens, so a proxy
/// channel's puts to a peer merge into plain copies) instead of on context
/// t % contexts (strided). Read when a Buffer is made.
bool ll_context_ranges();

/// EPX_LL_ARRIVAL_ORDER, where BufferOptions::ll_arrival_order is unset (0
/// or 1, default 0; experimental): the low-latency
/// dispatch packs each local expert's rows by source in the order the
/// sources' token masks arrive (as DeepEP) instead of in rank order, so no
/// receive waits for every source. Read when a Buffer is made.
bool ll_arrival_order();

/// EPX_LL_SMS, where BufferOptions::ll_sms is unset (>= 1; default: every
/// SM): the low-latency kernels of a rank
/// use at most this many SMs, leaving the others to other work (copies that
/// the driver runs on SMs). Read when a Buffer is made; malformed: epx::Error.
std::optional<int> ll_sms();
/// EPX_MAX_OPS_IN_FLIGHT, where BufferOptions::max_ops_in_flight is
/// unset (in [0, 2^20], 0: no bound; unset: the backend's default): the
/// low-latency ops of a Buffer, and its high-throughput ones across nodes,
/// queued on the GPU at most when another is called. Read when a Buffer is made; malformed:
/// epx::Error.
std::optional<int> max_ops_in_flight();

/// EPX_RANKS_PER_NODE (>= 0; unset: 0, the host is the node): virtual nodes
/// of this many ranks (make_topology checks that it divides the ranks).
int ranks_per_node();
/// EPX_GIN_CONTEXTS in [1, max_contexts] (default 4): backend nccl's GIN
/// contexts per peer at most.
int gin_contexts(int max_contexts);
/// EPX_PROXY_CHANNELS in [1, max_channels] (default 4): proxy channels
/// (threads) per rank at most.
int proxy_channels(int max_channels);
/// EPX_PROXY_RING in [16, 2^22]: commands per proxy channel ring (unset:
/// the proxy's default).
std::optional<uint32_t> proxy_ring();
/// EPX_DEBUG_PROXY: 0 or unset (off), 1 (every command a proxy thread takes,
/// on stderr) or stats (per-channel statistics when the thread ends).
enum class ProxyDebug { kOff, kTrace, kStats };
ProxyDebug debug_proxy();
/// EPX_PROXY_ENGINE (auto, cuda_ipc or libfabric; unset: "auto"): the proxy
/// backend's engine where BufferOptions::proxy_engine is "auto".
std::string proxy_engine();
/// EPX_FABRIC_PROVIDER: the libfabric engine's provider where
/// BufferOptions::fabric_provider is empty (unset: "tcp;ofi_rxm").
std::string fabric_provider();
/// EPX_FABRIC_DOMAINS: the libfabric engine's domains (rails, comma-separated)
/// where BufferOptions::fabric_domains is empty (unset: "", the provider's
/// first domain). The engine parses and checks the names.
std::string fabric_domains();
/// EPX_NVSHMEM_TRACE (0 or 1, default 0): the NVSHMEM module says when each
/// of its host calls starts and ends.
bool nvshmem_trace();
/// EPX_RING_TRACE (0 or 1, default 0): each Buffer adds up where its ring
/// kernels' blocks spend the op (per role and channel: ops, time, time of
/// passes that moved nothing) and prints it on stderr when destroyed.
bool ring_trace();

struct RankInfo {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr;
  int master_port = 0;
  const char* launcher = "none";  ///< "torchrun" | "mpirun" | "none"
};
/// Reads torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or
/// Open MPI (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK) variables; each is
/// range-checked as it is read (a rank of 2^32 is an error, not rank 0).
RankInfo rank_info();

}  // namespace epx::env
