// kernels/low_latency/common.cuh - what every low-latency kernel shares: constants, the
// timeline, the network transports' helpers (quiet, failure words, contexts),
// BF16/FP8 packing, and the combine send's finish and the combine flags' wait.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cfloat>
#include <type_traits>
#include <utility>
#include <variant>

#include "common/check.hpp"
#include "kernels/kernels.hpp"
#include "kernels/logfmt.cuh"

namespace epx::kernels {
namespace {

constexpr int kThreads = kLlThreads;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kDispatchChunk = kLlDispatchChunk;  ///< 16 elements per lane
static_assert(kDispatchChunk == 32 * 16 && kLlCombineSendChunk % 256 == 0 &&
              kLlCombineSendChunkLogFmt % 256 == 0 && kLlCombineRecvChunk % 256 == 0);
// Flag words of a half: [kFlagCombine][source] is the combine's; row 0 held the
// dispatch's flags before its per-chunk arrival flags and is unused (kept, so
// the layout does not move).
constexpr int kFlagCombine = 1;
// Ops of the phase timeline.
constexpr int kTlDispatch = 0, kTlCombine = 1;
// Local completion counters in the control area.
constexpr int kDoneDispatch = 0, kDoneCombine = 1;

// ---- optional phase timeline (build with -DEPX_LL_TIMELINE=1) -----------------
// Thread 0 of each block stamps %globaltimer at phase marks; the last receive
// block of an op prints one line per rank ("TL ...", ns after the first send
// block started, this GPU's clock only) and clears the marks. Off by default:
// it adds barriers and atomics to the timed path.
#ifndef EPX_LL_TIMELINE
#define EPX_LL_TIMELINE 0
#endif
enum TlMark : int {
  kTlSendStart,     // first send block started (min)
  kTlSendStartMax,  // last send block started
  kTlSendItems,     // last send block done with its items
  kTlSendCounted,   // last send block fenced and counted
  kTlSendSignal,    // flags stored to every rank
  kTlSendMasksIn,   // dispatch: last mask unit has its routing loaded
  kTlSendMasks,     // dispatch: last mask unit stored its words
  kTlRecvStart,     // first receive block started (min)
  kTlRecvGo,        // first receive block past griddepcontrol.wait (min)
  kTlRecvFlags,     // last receive block saw every flag
  kTlRecvMid,       // dispatch: last block done with its scan
  kTlRecvEnd,       // last receive block done
  kTlRecvEndMin,    // dispatch: first receiving block done with its units (min)
  kTlMarks
};
struct Timeline {
  unsigned long long m[2][kTlMarks];  // min marks hold ~t
  unsigned int done[2];
  unsigned long long recv_end_sum, recv_end_n;  // dispatch: receiving blocks' ends, for the mean
};
__device__ Timeline g_timeline;

/// Marks that keep the earliest time (stored as ~t under atomicMax).
__device__ __forceinline__ bool tl_is_min(int mark) {
  return mark == kTlSendStart || mark == kTlRecvStart || mark == kTlRecvGo || mark == kTlRecvEndMin;
}

/// Any thread; after `dep` is computed (so after the loads it depends on).
__device__ __forceinline__ void tl_mark_any(int kind, int mark, uint32_t dep = 0) {
  if constexpr (EPX_LL_TIMELINE != 0) {
    asm volatile("" ::"r"(dep));
    atomicMax(&g_timeline.m[kind][mark], dev::globaltimer_ns());
  }
}

__device__ __forceinline__ void tl_mark(int kind, int mark) {
  if constexpr (EPX_LL_TIMELINE != 0) {
    if (threadIdx.x != 0) return;
    const unsigned long long t = dev::globaltimer_ns();
    atomicMax(&g_timeline.m[kind][mark], tl_is_min(mark) ? ~t : t);
  }
}

/// The last receive block prints the op's marks and clears them.
__device__ __forceinline__ void tl_finish(int kind, int rank) {
  if constexpr (EPX_LL_TIMELINE != 0) {
    __syncthreads();
    tl_mark(kind, kTlRecvEnd);
    if (threadIdx.x != 0) return;
    __threadfence();
    if (atomicAdd(&g_timeline.done[kind], 1u) != gridDim.x - 1) return;
    __threadfence();
    unsigned long long v[kTlMarks];
    for (int i = 0; i < kTlMarks; ++i) {
      v[i] = atomicExch(&g_timeline.m[kind][i], 0ull);
      if (tl_is_min(i)) v[i] = ~v[i];
    }
    const unsigned long long end_sum = atomicExch(&g_timeline.recv_end_sum, 0ull);
    const unsigned long long end_n = atomicExch(&g_timeline.recv_end_n, 0ull);
    g_timeline.done[kind] = 0u;
    const long long t0 = static_cast<long long>(v[kTlSendStart]);
    auto at = [&](int i) { return static_cast<long long>(v[i]) - t0; };
    printf(
        "TL rank=%d op=%s send_start_max=%lld masks_in=%lld masks=%lld items=%lld counted=%lld "
        "signal=%lld recv_start=%lld recv_go=%lld flags=%lld mid=%lld end_min=%lld end_mean=%lld "
        "end=%lld\n",
        rank, kind == 0 ? "dispatch" : "combine", at(kTlSendStartMax), at(kTlSendMasksIn),
        at(kTlSendMasks), at(kTlSendItems), at(kTlSendCounted), at(kTlSendSignal), at(kTlRecvStart),
        at(kTlRecvGo), at(kTlRecvFlags), at(kTlRecvMid), at(kTlRecvEndMin),
        end_n ? static_cast<long long>(end_sum / end_n) : 0LL, at(kTlRecvEnd));
  }
}
#define EPX_TL(kind, mark)                \
  do {                                    \
    if constexpr (EPX_LL_TIMELINE != 0) { \
      __syncthreads();                    \
      tl_mark(kind, mark);                \
    }                                     \
  } while (0)

__device__ __forceinline__ int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

/// Whether transport T may have peers in other nodes: the kernels then send
/// to those peers with put / signal (from send areas in this rank's region)
/// and handle up to T::kCaps.max_ranks ranks; otherwise every peer is stored
/// to directly, with the load/store protocol alone.
template <class T>
inline constexpr bool kNet = T::kCaps.network;

/// Network transports: before a send kernel rewrites its send areas, the
/// puts of earlier ops that read them are complete (one thread per context).
/// False for the whole block when a quiet failed (reported): the block must
/// not rewrite its send areas, and the op must not signal its peers.
template <class T>
__device__ __forceinline__ bool quiet_send_areas(const T& t) {
  bool ok = true;
  if (static_cast<int>(threadIdx.x) < t.num_contexts) ok = t.quiet(threadIdx.x);
  return __syncthreads_and(ok ? 1 : 0) != 0;
}

/// Network transports: a send kernel's blocks raise these words (in the
/// region's net_done area: [1] dispatch, [2] combine) when their part of the
/// op failed (a failed quiet or wait, already reported here); the last block
/// then sends no signal, so the peers time out naming this rank instead of
/// taking an incomplete op, and clears the word for the next op.
constexpr int kNetFailedDispatch = 1, kNetFailedCombine = 2;
template <class T>
__device__ __forceinline__ uint32_t* net_failed_word(const T& t, const LlOffsets& o, int which) {
  return reinterpret_cast<uint32_t*>(t.local_ptr(o.net_done)) + which;
}

/// Network transports: the context of token t's puts (the send args' ctx_tokens).
__device__ __forceinline__ int put_context(int ctx_tokens, int t, int contexts) {
  return ctx_tokens > 0 ? min(t / ctx_tokens, contexts - 1) : t % contexts;
}

/// Network transports: adds 1 to signal `sig` at rank `r` on contexts
/// [first, num_contexts), each after that context's earlier puts to r (a
/// receiver waits until every context's word counts the op).
template <class T>
__device__ __forceinline__ void signal_contexts(const T& t, int r, int sig, int first = 0) {
  for (int c = first; c < t.num_contexts; ++c) t.template signal_add<dev::Thread>(c, r, sig, 1);
}

/// Network transports: counts the calls of the `n` warps that wrote parts of
/// one send slot (counter `*done`, zero between ops; every part increments
/// it once); true for the warp that completes it, which then puts the slot
/// (all of the warp's lanes get the answer). The system-scope fences order
/// every part's stores before the put the proxy or NIC reads.
__device__ __forceinline__ bool last_part(uint32_t* done, int n) {
  int last = 0;
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    dev::fence_acq_rel_sys();
    last = atomicAdd(done, 1u) == static_cast<uint32_t>(n - 1) ? 1 : 0;
    if (last) {
      *done = 0u;
      dev::fence_acq_rel_sys();
    }
  }
  return __shfl_sync(0xffffffffu, last, 0) != 0;
}

__device__ __forceinline__ std::size_t flag_offset(std::size_t half, const LlOffsets& o, int kind,
                                                   int src) {
  // Flags sit at a fixed place outside the halves (see plan::LlRegion).
  const std::size_t parity = half == o.half0 ? 0u : 1u;
  return o.flags + parity * o.flags_half_bytes +
         4u * (static_cast<std::size_t>(kind) * plan::kLlMaxRanks + src);
}

// ---- numeric helpers (each mirrors the CPU reference bit for bit) -------------

__device__ __forceinline__ void unpack_bf16x8(const int4& v, float* f) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                         static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

/// ref::float_to_bf16: round to nearest even; NaN keeps sign and payload, quiet.
__device__ __forceinline__ uint32_t bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x0040u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ int4 pack_bf16x8(const float* f) {
  int4 o;
  o.x = static_cast<int>(bf16_bits(f[0]) | (bf16_bits(f[1]) << 16));
  o.y = static_cast<int>(bf16_bits(f[2]) | (bf16_bits(f[3]) << 16));
  o.z = static_cast<int>(bf16_bits(f[4]) | (bf16_bits(f[5]) << 16));
  o.w = static_cast<int>(bf16_bits(f[6]) | (bf16_bits(f[7]) << 16));
  return o;
}

/// ref::float_to_fp8_e4m3 of two values, as bytes {lo, hi}: the hardware
/// conversion (round to nearest even, saturating to +-448, also for +-inf) is
/// the reference bit for bit except for NaN, which the reference maps to
/// sign | 0x7F.
__device__ __forceinline__ uint32_t fp8x2_e4m3_bits(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  uint32_t r = d;
  if (isnan(lo)) r = (r & 0xff00u) | ((__float_as_uint(lo) >> 24) & 0x80u) | 0x7fu;
  if (isnan(hi)) r = (r & 0x00ffu) | ((((__float_as_uint(hi) >> 24) & 0x80u) | 0x7fu) << 8);
  return r;
}

/// ref::quantize_row_fp8's scale of one group from its amax.
__device__ __forceinline__ float fp8_scale(float amax, bool round_scale) {
  float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
  if (round_scale) {
    const uint32_t u = __float_as_uint(scale);  // normal and positive here
    if ((u & 0x7fffffu) != 0u) scale = __uint_as_float(((u >> 23) + 1u) << 23);
  }
  return scale;
}

// ---- completion: the last block of a send kernel signals every rank ------------

/// Every block of a combine send calls this once at its end (also after a
/// failed wait, so the count stays right). The last block release-stores
/// `epoch` into the combine flag [me] of every rank, resets the counter and
/// publishes the epoch. One fence per block, not per thread: the barrier
/// orders every thread's peer stores before thread 0's system-scope release
/// fence, and release is cumulative (PTX memory model), so the count carries
/// them all. Network transports: `failed` (this thread's part failed) keeps
/// the last block from signalling anyone (net_failed_word).
template <class T>
__device__ __forceinline__ void finish_combine_send(const T& t, const LlOffsets& o,
                                                    std::size_t half, uint32_t* op_counter,
                                                    uint32_t epoch, uint64_t* seq_counter,
                                                    uint64_t seq, bool failed = false) {
  __shared__ int is_last;
  EPX_TL(kTlCombine, kTlSendItems);
  [[maybe_unused]] int block_failed = 0;
  if constexpr (kNet<T>)
    block_failed = __syncthreads_or(failed ? 1 : 0);
  else
    __syncthreads();
  uint32_t* control = reinterpret_cast<uint32_t*>(t.local_ptr(o.control));
  if (threadIdx.x == 0) {
    if constexpr (kNet<T>)
      if (block_failed) atomicOr(net_failed_word(t, o, kNetFailedCombine), 1u);
    dev::fence_acq_rel_sys();  // release: the block's peer stores before the count
    is_last = atomicAdd(control + kDoneCombine, 1u) == gridDim.x - 1 ? 1 : 0;
    if (is_last) dev::fence_acq_rel_sys();  // acquire: every block's stores before the flags
  }
  __syncthreads();
  tl_mark(kTlCombine, kTlSendCounted);
  if (!is_last) return;
  if constexpr (!kNet<T>) {
    if (static_cast<int>(threadIdx.x) < t.num_ranks && !t.masked(threadIdx.x))
      t.lsa_flag(threadIdx.x, flag_offset(half, o, kFlagCombine, t.rank), epoch);
  } else if (*static_cast<volatile uint32_t*>(net_failed_word(t, o, kNetFailedCombine)) == 0u) {
    // (A block's part failed: no signal, the peers time out naming this rank.)
    // Peers in other nodes: one signal per context, after that context's row puts.
    for (int r = threadIdx.x; r < t.num_ranks; r += blockDim.x) {
      if (t.masked(r)) continue;
      if (t.same_node(r)) {
        t.lsa_flag(r, flag_offset(half, o, kFlagCombine, t.rank), epoch);
      } else {
        signal_contexts(t, r, ll_sig_combine(t.num_ranks, t.rank));
      }
    }
  }
  if constexpr (kNet<T>) __syncthreads();  // every thread read the failed word
  if (threadIdx.x == 0) {
    control[kDoneCombine] = 0u;
    *op_counter = epoch;
    if constexpr (kNet<T>) {
      *seq_counter = seq;
      *net_failed_word(t, o, kNetFailedCombine) = 0u;
    }
  }
  tl_mark(kTlCombine, kTlSendSignal);
}

/// Block-wide wait for the combine flag of every source that is not masked;
/// false when any timed out. `live` gets the ranks whose rows to sum (those
/// not masked after the wait: one view for the whole block).
/// With wait_stats, block 0 adds to wait_stats[s] the send's wait for s's first
/// weight word (send_wait_first[s] - 1), or where s sent no token here (0) the
/// wait for its flag, in ns.
template <class T>
__device__ __forceinline__ bool wait_combine_flags(const T& t, const LlOffsets& o, std::size_t half,
                                                   uint32_t epoch, uint64_t seq,
                                                   uint64_t timeout_ns, DeviceDiag* diag,
                                                   int64_t* wait_stats,
                                                   const unsigned long long* send_wait_first,
                                                   uint32_t& live) {
  __shared__ int failed;
  __shared__ uint32_t s_live;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < t.num_ranks) {
    const int s = threadIdx.x;
    // Shrink: the mask is read beside the flag, not before it (no added
    // latency); a masked source is left out whether its flag came or not.
    const bool was_masked = t.masked(s);
    const uint64_t t0 = wait_stats != nullptr ? dev::globaltimer_ns() : 0;
    bool came;
    if constexpr (kNet<T>) {
      came = t.same_node(s) ? t.wait_flag(flag_offset(half, o, kFlagCombine, s), epoch, timeout_ns,
                                          diag, OpId::kLowLatencyCombineRecv, s, -1)
                            : t.wait_signal(ll_sig_combine(t.num_ranks, s), seq,
                                            OpId::kLowLatencyCombineRecv, s);
    } else {
      came = t.wait_flag(flag_offset(half, o, kFlagCombine, s), epoch, timeout_ns, diag,
                         OpId::kLowLatencyCombineRecv, s, -1);
    }
    if (!came) {
      if (!was_masked && !t.masked(s)) {
        atomicExch(&failed, 1);
        // The receive leaves its output unwritten: a report must say so and
        // name s. A wait that gave up has reported already, or found an
        // earlier report of this rank (first reporter wins, so this one
        // then changes nothing); this keeps a wait that gave up silently
        // from making the op look complete.
        if constexpr (kNet<T>) {
          const bool by_flag = t.same_node(s);
          dev::report(diag, DiagCode::kTimeout, OpId::kLowLatencyCombineRecv, t.rank, s,
                      by_flag ? -1 : kDiagSignalChannel + ll_sig_combine(t.num_ranks, s),
                      by_flag ? epoch : static_cast<uint32_t>(seq), 0u);
        }
      }
    } else if (wait_stats != nullptr && blockIdx.x == 0 && !was_masked) {
      const unsigned long long first = send_wait_first[s];
      atomicAdd(reinterpret_cast<unsigned long long*>(wait_stats + s),
                first != 0ull ? first - 1ull
                              : static_cast<unsigned long long>(dev::globaltimer_ns() - t0));
    }
  }
  __syncthreads();
  if constexpr (!kNet<T>) {  // network transports read each rank's mask word where they need it
    if (threadIdx.x == 0) s_live = t.live_ranks();
    __syncthreads();
    live = s_live;
  } else {
    live = 0;
  }
  return failed == 0;
}

}  // namespace
}  // namespace epx::kernels
