// Low-latency dispatch and combine (decode). See docs/low_latency.md.
//
// Every op has a send phase and a receive phase; with return_recv_hook they
// are two kernels and the hook launches the receive one later, so nothing
// holds SMs in between.
//
// Epochs: the send takes epoch = plan::next_epoch(*op_counter) (+ 1, never 0;
// the last block to finish stores it back), picks the half (epoch & 1) of the
// double buffer, and writes the epoch into the op's state word, from which a
// hook's receive kernel reads it. Nothing is reset between calls, so graph replays keep counting.
//
// Dispatch: one message per (token, destination rank) at slot [me][token] of
// the destination's receive area (FP8 quantized by the sender). Every
// 512-column chunk of a message is followed by a release-stored arrival flag
// (the epoch) for (me, token, chunk); token masks (one 32-token word per local
// expert) and token counts travel as epoch-tagged 64-bit words. The receiver
// waits for the masks, packs rows per local expert in the canonical order
// (source rank, then token), and copies each 2 KiB segment as soon as its
// chunks' flags are there. Without a hook, send and receive are one
// cooperative kernel whose first blocks send and the others receive.
//
// Combine: the expert rank sums the weighted outputs of a token's experts that
// it hosts and sends one row per (token, rank) back; a rank that hosts a
// single pick of the token sends the raw expert row (the source applies the
// weight, exactly). Weights travel from the source as epoch-tagged 64-bit
// words, one per (token, distinct expert), so they need no flag of their own.
// The last send block release-stores one flag per rank; the receive kernel is
// a programmatic dependent launch without a hook.
//
// Shrink mode (the transport's peer mask): nothing is stored to a masked rank
// and nothing is awaited from it; its picks count as masked (-1) and it
// counts as a source without tokens. A wait that passes its deadline masks
// its peer instead of failing the op (the transport does it).
//
// This header holds the kernels and a launch helper per op for one transport
// type T (launch_*_for). low_latency.cu instantiates them for the built-in
// transports (dev::AnyTransport); a backend module with a transport of its own
// includes this header and instantiates them for that type (docs/nvshmem.md).
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

// ============================================================================
// dispatch: send. Warps take (token, 512-column chunk) row items and
// (32-token word, 32-expert group) mask units. A row item stores its chunk
// into slot [me][token] of every rank that hosts one of the token's picks
// (in the order me + 1, me + 2, ...: ranks start on different peers, so no
// rank's ingress takes everyone's first stores), then release-stores this op's epoch into that
// rank's arrival flag of (me, token, chunk). A mask unit sends one tagged word {mask, epoch} per
// expert to the expert's rank, for every word of maxT (zero past the token
// count), so a receiver needs no count to know which words to wait for.
// ============================================================================
__device__ __forceinline__ std::size_t tags_of(const LlOffsets& o, uint32_t epoch) {
  return o.dtags + (epoch & 1u) * o.dtags_half_bytes;
}

__device__ __forceinline__ std::size_t mask_word_offset(const LlOffsets& o, std::size_t tags,
                                                        int src, int w, int le, int E_local) {
  return tags + o.dtag_masks +
         8u * ((static_cast<std::size_t>(src) * plan::kLlMaxMaskWords + w) * E_local + le);
}

__device__ __forceinline__ std::size_t chunk_flag_offset(const LlOffsets& o, std::size_t tags,
                                                         int src, int t, int c) {
  return tags + o.dtag_chunks +
         4u * ((static_cast<std::size_t>(src) * plan::kLlMaxTokens + t) * plan::kLlMaxChunks + c);
}

/// Network transports: offset of the tagged mask word for (rank r, word w,
/// local expert le) in this rank's mask send area of the op's half.
__device__ __forceinline__ std::size_t net_mask_offset(const LlOffsets& o, uint32_t epoch, int r,
                                                       int w, int le, int E_local) {
  return o.net_masks + (epoch & 1u) * o.net_masks_half_bytes +
         8u * ((static_cast<std::size_t>(r) * plan::kLlMaxMaskWords + w) * E_local + le);
}

/// The op's epoch (next_epoch of the op counter); block 0 records it in the handle state
/// and sends this rank's token count to every rank (in this rank's node; the
/// others get it with the op's last puts). Network transports: a block that
/// sends (`sends`) first waits until the puts that read its send areas are done.
template <class T>
__device__ __forceinline__ uint32_t dispatch_begin(const LlDispatchSendParams<T>& p, uint64_t seq,
                                                   bool sends, bool& send_ok) {
  const uint32_t epoch = plan::next_epoch(*p.op_counter);
  send_ok = true;
  if constexpr (kNet<T>)
    if (sends) send_ok = quiet_send_areas(p.t);
  if (blockIdx.x == 0) {
    const std::size_t tags = tags_of(p.off, epoch);
    if (static_cast<int>(threadIdx.x) < p.t.num_ranks && !p.t.masked(threadIdx.x)) {
      bool direct = true;
      if constexpr (kNet<T>) direct = p.t.same_node(threadIdx.x);
      if (direct)
        p.t.lsa_tagged(threadIdx.x, tags + 8u * static_cast<std::size_t>(p.t.rank),
                       plan::ll_count_word(p.num_tokens, p.off.shape_fp), epoch);
    }
    if (threadIdx.x == 0) {
      p.state[0] = static_cast<int32_t>(epoch);
      if constexpr (kNet<T>) *reinterpret_cast<uint64_t*>(p.state + 2) = seq;
    }
  }
  return epoch;
}

/// FP8 of one lane's 16 elements (a, b) with the scale of its 128-element
/// group (8 lanes): ref::quantize_row_fp8.
__device__ __forceinline__ int4 fp8_quantize16(const int4& a, const int4& b, bool round_scale,
                                               float& scale) {
  float f[16];
  unpack_bf16x8(a, f);
  unpack_bf16x8(b, f + 8);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 4));
  scale = fp8_scale(amax, round_scale);
  // x / scale, correctly rounded; a power-of-two scale (round_scale) has an
  // exact reciprocal, and x * (1 / scale) is then the same number.
  const float inv = 1.0f / scale;
#pragma unroll
  for (int i = 0; i < 16; ++i) f[i] = round_scale ? f[i] * inv : __fdiv_rn(f[i], scale);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = fp8x2_e4m3_bits(f[4 * i], f[4 * i + 1]) |
           (fp8x2_e4m3_bits(f[4 * i + 2], f[4 * i + 3]) << 16);
  return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                   static_cast<int>(w[3]));
}

/// Network transports: one (token t, 512-column chunk c) row item, with the
/// lane's 16 elements in a, b. The chunk goes to every rank of this node that
/// hosts one of the token's picks (stores, then an arrival flag, as without a
/// network) and, when some picks are on ranks of other nodes, into this
/// rank's own slot [me][t] (the same bytes every destination gets); the warp
/// that writes the token's last chunk there puts the whole row to each of
/// those ranks (one message per (token, rank)).
template <class T>
__device__ __forceinline__ void net_send_chunk(const LlDispatchSendParams<T>& p, uint32_t epoch,
                                               int t, int c, int64_t e, const int4& a,
                                               const int4& b) {
  const int R = p.t.num_ranks, me = p.t.rank, lane = threadIdx.x % 32;
  const int H = p.hidden, E = p.num_experts, E_local = E / R;
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  const std::size_t tags = tags_of(p.off, epoch);
  const int r_k = e >= 0 && e < E ? static_cast<int>(e / E_local) : -1;  // rank of pick `lane`
  const uint32_t same_rank = __match_any_sync(kFull, r_k);       // every lane (not after an &&)
  const bool leader = r_k >= 0 && lane == __ffs(same_rank) - 1;  // one lane per rank
  // Shrink: nothing is stored or put to a masked rank. Whether the row goes
  // through the send slot (and counts in tok_done) does not look at the mask,
  // which may change between two chunks of the token: every chunk counts.
  const bool live = leader && !p.t.masked(r_k);
  const bool remote = leader && !p.t.same_node(r_k);
  const uint32_t lives = __ballot_sync(kFull, live), remotes = __ballot_sync(kFull, remote);
  if (lives == 0u && remotes == 0u) return;
  const bool to_self = __any_sync(kFull, live && r_k == me);
  const int h0 = c * kDispatchChunk + lane * 16;
  const bool active = h0 < H;
  const std::size_t slot =
      half + p.off.disp_rows + (static_cast<std::size_t>(me) * p.max_tokens + t) * p.row_bytes;
  float scale = 0.0f;
  const int4 q = p.fp8 ? fp8_quantize16(a, b, p.round_scale, scale) : a;
  auto store = [&](char* row) {
    if (!active) return;
    if (p.fp8) {
      dev::st_na(reinterpret_cast<int4*>(row + h0), q);
      if ((lane & 7) == 0) reinterpret_cast<float*>(row + H)[h0 / 128] = scale;
    } else {
      dev::st_na(reinterpret_cast<int4*>(row + 2 * h0), a);
      dev::st_na(reinterpret_cast<int4*>(row + 2 * h0) + 1, b);
    }
  };
  for (uint32_t m = lives & ~remotes; m != 0u; m &= m - 1u)
    store(p.t.lsa_ptr(__shfl_sync(kFull, r_k, __ffs(m) - 1), slot));
  if (remotes != 0u && !to_self) store(p.t.local_ptr(slot));
  __syncwarp();  // every lane's stores before the arrival flags (release, cumulative)
  if (live && !remote) p.t.lsa_flag(r_k, chunk_flag_offset(p.off, tags, me, t, c), epoch);
  if (remotes == 0u) return;
  const int C = ceil_div(H, kDispatchChunk);
  if (!last_part(reinterpret_cast<uint32_t*>(p.t.local_ptr(p.off.tok_done)) + t, C)) return;
  const int ctx = put_context(p.ctx_tokens, t, p.t.num_contexts);
  const uint32_t to_put = __ballot_sync(kFull, remote && !p.t.masked(r_k));  // mask at put time
  for (uint32_t m = to_put; m != 0u; m &= m - 1u)
    p.t.template put<dev::Warp>(ctx, __shfl_sync(kFull, r_k, __ffs(m) - 1), slot, slot,
                                p.row_bytes);
}

/// Send work of warps gw = first, first + stride, ...
template <class T>
__device__ __forceinline__ void dispatch_send_items(const LlDispatchSendParams<T>& p,
                                                    uint32_t epoch, int first, int stride) {
  const int R = p.t.num_ranks, me = p.t.rank;
  const int lane = threadIdx.x % 32;
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  const std::size_t tags = tags_of(p.off, epoch);
  const int H = p.hidden, K = p.num_topk, E = p.num_experts, E_local = E / R;
  const int C = ceil_div(H, kDispatchChunk);
  uint32_t live = 0;  // shrink: no store to a masked rank (network transports ask per rank)
  if constexpr (!kNet<T>) live = p.t.live_ranks();
  // The mask units come first: receivers need them before any row.
  const int groups = ceil_div(E, 32), W = ceil_div(p.max_tokens, 32);
  const int mask_units = W * groups;
  const int items = mask_units + p.row_tokens * C;  // row_tokens: num_tokens but in a test
  for (int item = first; item < items; item += stride) {
    if (item < mask_units) {
      const int w = item / groups, g = item % groups;
      const int t = w * 32 + lane;
      uint32_t mine = 0;  // bit j: token t picks expert 32 g + j
      if (t < p.num_tokens) {
        int64_t v[plan::kLlMaxTopK];
#pragma unroll
        for (int k = 0; k < plan::kLlMaxTopK; ++k)
          v[k] = k < K ? p.topk_idx[static_cast<int64_t>(t) * K + k] : -1;
#pragma unroll
        for (int k = 0; k < plan::kLlMaxTopK; ++k) {
          const int64_t j = v[k] - 32 * g;
          if (v[k] >= 0 && v[k] < E && j >= 0 && j < 32) mine |= 1u << static_cast<int>(j);
        }
      }
      if (lane == 0) tl_mark_any(kTlDispatch, kTlSendMasksIn, mine);
      uint32_t word = 0;  // lane j: the tokens that pick expert 32 g + j
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const uint32_t b = __ballot_sync(kFull, (mine >> j) & 1u);
        if (lane == j) word = b;
      }
      const int e = 32 * g + lane;
      if constexpr (!kNet<T>) {
        if (e < E && ((live >> (e / E_local)) & 1u))
          p.t.lsa_tagged(e / E_local, mask_word_offset(p.off, tags, me, w, e % E_local, E_local),
                         word, epoch);
      } else if (e < E && !p.t.masked(e / E_local)) {
        const int r = e / E_local, le = e % E_local;
        if (p.t.same_node(r))
          p.t.lsa_tagged(r, mask_word_offset(p.off, tags, me, w, le, E_local), word, epoch);
        else  // into the send area; the op's last block puts it
          dev::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(p.t.local_ptr(
                                      net_mask_offset(p.off, epoch, r, w, le, E_local))),
                                  (static_cast<uint64_t>(epoch) << 32) | word);
      }
      if (lane == 0) tl_mark_any(kTlDispatch, kTlSendMasks);
      continue;
    }
    const int t = (item - mask_units) / C, c = (item - mask_units) % C;
    // The row's loads go out before the routing's (both in flight at once).
    const int h0 = c * kDispatchChunk + lane * 16;  // this lane's 16 elements
    const bool active = h0 < H;                     // H % 128 == 0: whole groups of 8 lanes
    int4 a = make_int4(0, 0, 0, 0), b = a;
    if (active) {
      const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(t) * H + h0);
      a = dev::ld_nc(src);
      b = dev::ld_nc(src + 1);
    }
    const int64_t e = lane < K ? p.topk_idx[static_cast<int64_t>(t) * K + lane] : -1;
    const bool valid = e >= 0 && e < E;
    if constexpr (kNet<T>) {
      if (c == 0 && lane < K) {
        if (!valid && e != -1)
          dev::report(p.diag, DiagCode::kBadExpert, OpId::kLowLatencyDispatchSend, me, -1, lane, 0,
                      static_cast<uint32_t>(e), t);
        if (p.topk_copy) p.topk_copy[static_cast<int64_t>(t) * K + lane] = e;
      }
      net_send_chunk(p, epoch, t, c, e, a, b);
      continue;
    }
    const uint32_t dst_mask =
        __reduce_or_sync(kFull, valid ? (1u << static_cast<int>(e / E_local)) : 0u) & live;
    if (c == 0 && lane < K) {
      if (!valid && e != -1)
        dev::report(p.diag, DiagCode::kBadExpert, OpId::kLowLatencyDispatchSend, me, -1, lane, 0,
                    static_cast<uint32_t>(e), t);
      if (p.topk_copy) p.topk_copy[static_cast<int64_t>(t) * K + lane] = e;
    }
    if (dst_mask == 0u) continue;

    const std::size_t slot =
        half + p.off.disp_rows + (static_cast<std::size_t>(me) * p.max_tokens + t) * p.row_bytes;
    if (p.fp8) {
      float f[16];
      unpack_bf16x8(a, f);
      unpack_bf16x8(b, f + 8);
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
      amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 4));
      const float scale = fp8_scale(amax, p.round_scale);
      // x / scale, correctly rounded; a power-of-two scale (round_scale) has an
      // exact reciprocal, and x * (1 / scale) is then the same number.
      const float inv = 1.0f / scale;
#pragma unroll
      for (int i = 0; i < 16; ++i) f[i] = p.round_scale ? f[i] * inv : __fdiv_rn(f[i], scale);
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = fp8x2_e4m3_bits(f[4 * i], f[4 * i + 1]) |
               (fp8x2_e4m3_bits(f[4 * i + 2], f[4 * i + 3]) << 16);
      const int4 q = make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]),
                               static_cast<int>(w[2]), static_cast<int>(w[3]));
      if (active) {
        for (int i = 1; i <= R; ++i) {
          const int r = (me + i) % R;  // rotated, see kernel comment
          if (!((dst_mask >> r) & 1u)) continue;
          char* row = p.t.lsa_ptr(r, slot);
          dev::st_na(reinterpret_cast<int4*>(row + h0), q);
          if ((lane & 7) == 0) reinterpret_cast<float*>(row + H)[h0 / 128] = scale;
        }
      }
    } else if (active) {
      for (int i = 1; i <= R; ++i) {
        const int r = (me + i) % R;
        if (!((dst_mask >> r) & 1u)) continue;
        int4* row = reinterpret_cast<int4*>(p.t.lsa_ptr(r, slot) + 2 * h0);
        dev::st_na(row, a);
        dev::st_na(row + 1, b);
      }
    }
    // Arrival of this chunk: the warp barrier orders every lane's stores
    // before lane r's release store (cumulative), which the receiver acquires.
    __syncwarp();
    if (lane < R && ((dst_mask >> lane) & 1u))
      p.t.lsa_flag(lane, chunk_flag_offset(p.off, tags, me, t, c), epoch);
  }
}

/// Every block calls this once after its send work; the last one resets the
/// count and publishes the epoch to the next op. Nothing waits for it.
/// Network transports: the last block, once every block's sends are posted,
/// puts this rank's token masks and count to each rank of another node and
/// then adds 1 to that rank's dispatch signal on every context (after the
/// context's row puts). A rank that dies mid-dispatch (the test knob) sends
/// none of it, as a dead rank would: its rows without a signal are no message.
template <class T>
__device__ __forceinline__ void net_dispatch_finish(const LlDispatchSendParams<T>& p,
                                                    uint32_t epoch) {
  if (p.row_tokens < p.num_tokens) return;
  const int R = p.t.num_ranks, me = p.t.rank, E_local = p.num_experts / R;
  const int W = ceil_div(p.max_tokens, 32);
  const std::size_t tags = tags_of(p.off, epoch);
  const std::size_t count = tags + 8u * static_cast<std::size_t>(me);
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    if (p.t.same_node(r) || p.t.masked(r)) continue;
    p.t.template put<dev::Thread>(0, r, mask_word_offset(p.off, tags, me, 0, 0, E_local),
                                  net_mask_offset(p.off, epoch, r, 0, 0, E_local),
                                  8u * W * E_local);
    p.t.template put<dev::Thread>(0, r, count, count, 8u);
    signal_contexts(p.t, r, ll_sig_dispatch(R, me));
  }
}

/// Every block calls this once after its send work; the last one resets the
/// count and publishes the epoch to the next op (network transports: after
/// sending what needs every block's work). Nothing waits for it.
template <class T>
__device__ __forceinline__ void dispatch_count_done(const LlDispatchSendParams<T>& p,
                                                    uint32_t epoch, uint64_t seq,
                                                    bool failed = false) {
  EPX_TL(kTlDispatch, kTlSendItems);
  __syncthreads();
  uint32_t* control = reinterpret_cast<uint32_t*>(p.t.local_ptr(p.off.control));
  if constexpr (!kNet<T>) {
    if (threadIdx.x == 0 && dev::last_block_done(control + kDoneDispatch)) *p.op_counter = epoch;
  } else {
    uint32_t* fail = net_failed_word(p.t, p.off, kNetFailedDispatch);
    if (failed && threadIdx.x == 0) atomicOr(fail, 1u);  // before the count's release
    if (dev::block_counted_last(control + kDoneDispatch)) {
      if (*static_cast<volatile uint32_t*>(fail) == 0u) net_dispatch_finish(p, epoch);
      __syncthreads();
      if (threadIdx.x == 0) {
        *fail = 0u;
        *p.op_counter = epoch;
        p.seq[0] = seq;
      }
    }
  }
  tl_mark(kTlDispatch, kTlSendCounted);
}

/// Network transports: this op's count of its kind (dispatches: [0],
/// combines: [1]), what the receivers' signals reach; 0 otherwise.
template <class T>
__device__ __forceinline__ uint64_t next_seq(const uint64_t* counter) {
  if constexpr (kNet<T>) return *counter + 1;
  return 0;
}

template <class T>
__global__ void __launch_bounds__(kThreads, 2) ll_dispatch_send(LlDispatchSendParams<T> p) {
  tl_mark(kTlDispatch, kTlSendStart);
  tl_mark(kTlDispatch, kTlSendStartMax);
  const uint64_t seq = next_seq<T>(p.seq);
  bool send_ok = true;
  const uint32_t epoch = dispatch_begin(p, seq, true, send_ok);
  if (send_ok)
    dispatch_send_items(p, epoch, blockIdx.x * kWarps + threadIdx.x / 32, gridDim.x * kWarps);
  dispatch_count_done(p, epoch, seq, !send_ok);
}

/// The receive's row copies: rows i in [0, n_rows) of local expert le, row_of(i)
/// = {packed row j, source s, token t}, in units of (row, 2 KiB segment), each
/// after the arrival flags of its chunks. False (for this thread) when a wait
/// failed (reported); the caller combines the block's answers.
/// Warps first_warp, first_warp + warp_stride, ... take the units.
template <class RowOf, class T>
__device__ __forceinline__ bool copy_rows(const LlDispatchRecvParams<T>& p, uint32_t epoch, int le,
                                          int n_rows, RowOf row_of, int first_warp = -1,
                                          int warp_stride = kWarps) {
  const int lane = threadIdx.x % 32;
  const int warp = first_warp >= 0 ? first_warp : static_cast<int>(threadIdx.x / 32);
  const int R = p.t.num_ranks, RT = R * p.max_tokens, H = p.hidden;
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  const std::size_t tags = tags_of(p.off, epoch);
  // Rows: work units of (row, 2 KiB segment = 128 int4, 4 per lane), so that
  // the few rows of an expert spread over all warps of its blocks. A segment
  // holds 4 FP8 chunks (512 B each, with their 16 scales) or 2 BF16 chunks.
  const int out_row_bytes = p.fp8 ? H : 2 * H;
  const int n16 = out_row_bytes / 16;
  const int segs = ceil_div(n16, 128);
  const int C = ceil_div(H, kDispatchChunk);
  const int seg_chunks = p.fp8 ? 4 : 2;
  const int G = H / 128, G4 = (G + 3) / 4;
  bool all_ok = true;
  for (int u = warp; u < n_rows * segs; u += warp_stride) {
    const int i = u / segs, seg = u % segs;
    const int3 row = row_of(i);
    const int j = row.x, s = row.y, t = row.z;
    const int c = seg * seg_chunks + lane;
    bool arrived = true;
    // A source in another node sent no chunk flags: its dispatch signal,
    // awaited before its token masks, covers its rows.
    bool flagged = true;
    if constexpr (kNet<T>) flagged = p.t.same_node(s);
    if (lane < seg_chunks && c < C && flagged)
      arrived = p.t.wait_flag_eq(chunk_flag_offset(p.off, tags, s, t, c), epoch, p.timeout_ns,
                                 p.diag, OpId::kLowLatencyDispatchRecv, s, le);
    // Shrink: a source masked after its token mask came (it stopped mid-op)
    // leaves zeros in its rows.
    const bool gone = !__all_sync(kFull, arrived) && __any_sync(kFull, p.t.masked(s));
    if (!gone && !__all_sync(kFull, arrived)) {
      all_ok = false;
      break;
    }
    __syncwarp();  // the waiting lanes' acquires before every lane's loads
    const char* src = p.t.local_ptr(half + p.off.disp_rows +
                                    (static_cast<std::size_t>(s) * p.max_tokens + t) * p.row_bytes);
    uint8_t* dst = p.recv_x + (static_cast<int64_t>(le) * RT + j) * out_row_bytes;
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    const int c0 = seg * 128 + lane;
    int4 v4[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      v4[q] = c0 + 32 * q < n16 && !gone ? dev::ld_l2(s4 + c0 + 32 * q) : make_int4(0, 0, 0, 0);
    // The scales of this segment's 16 groups load with its data.
    const float* sc = reinterpret_cast<const float*>(src + H);
    const int g = 16 * seg + lane;
    float s1 = 0.0f;
    if (p.fp8 && !p.ue8m0 && lane < 16 && g < G && !gone) s1 = __ldcg(sc + g);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (c0 + 32 * q < n16) d4[c0 + 32 * q] = v4[q];
    if (p.fp8 && !p.ue8m0) {
      if (lane < 16 && g < G)
        static_cast<float*>(p.recv_scales)[(static_cast<int64_t>(le) * G + g) * RT + j] = s1;
    } else if (p.fp8) {
      const int q = 4 * seg + lane;  // packed word q holds groups 4q .. 4q+3
      if (lane < 4 && q < G4) {
        uint32_t packed = 0;
        for (int b = 0; b < 4; ++b) {
          const int gg = 4 * q + b;
          const uint32_t byte =
              gg < G && !gone ? (__float_as_uint(__ldcg(sc + gg)) >> 23) & 0xffu : 0u;
          packed |= byte << (8 * b);
        }
        static_cast<int32_t*>(p.recv_scales)[(static_cast<int64_t>(le) * G4 + q) * RT + j] =
            static_cast<int32_t>(packed);
      }
    }
  }
  return all_ok;
}

// ============================================================================
// dispatch: receive. Unit (le, part): waits for the token masks of every
// source for local expert le (tagged words, one per thread) and for the token
// counts, takes one block-wide scan of the masks (the canonical packed order,
// the same in each of le's `parts` units), then moves the rows j with
// j % parts == part, 2 KiB segments at a time, each after the arrival flags of
// its chunks: rows are copied as they arrive, not after the slowest sender.
// Returns false when a wait failed (reported).
// ============================================================================
/// Network transports, shrink: the sources that were masked when this block
/// began receiving (bit r of word r / 32). A block takes its units one after
/// another, so a source masked meanwhile (its deadline passed in an earlier
/// unit) would otherwise count for some local experts and not for others,
/// depending on the grid; with the snapshot, words that came are counted
/// in every unit alike. (The NVLink path reads the mask live, as before.)
__shared__ uint32_t s_masked_at_start[(plan::kLlMaxRanks + 31) / 32];

/// Every thread of a receiving block, before its first unit.
template <class T>
__device__ __forceinline__ void snapshot_mask(const T& t) {
  if constexpr (kNet<T>) {
    constexpr int kWords = (plan::kLlMaxRanks + 31) / 32;
    for (int w = threadIdx.x; w < kWords; w += blockDim.x) s_masked_at_start[w] = 0u;
    __syncthreads();
    for (int r = threadIdx.x; r < t.num_ranks; r += blockDim.x)
      if (t.masked(r)) atomicOr(&s_masked_at_start[r / 32], 1u << (r % 32));
    __syncthreads();
  }
}

/// Whether source s counts as masked from the start of this receive.
template <class T>
__device__ __forceinline__ bool masked_at_start(const T& t, int s) {
  if constexpr (kNet<T>)
    return ((s_masked_at_start[s / 32] >> (s % 32)) & 1u) != 0u;
  else
    return t.masked(s);
}

/// Word w of source s's token mask for local expert le, into `word`. Shrink:
/// the mask is read beside the wait, not before it (no added latency); a
/// masked source counts as sending nothing, whether its word came or not (a
/// wait for it returns at once, or when it gets masked). False: the wait failed.
template <class T>
__device__ __forceinline__ bool recv_mask_word(const LlDispatchRecvParams<T>& p, uint32_t epoch,
                                               uint64_t seq, std::size_t tags, int s, int w, int le,
                                               int E_local, uint32_t& word) {
  const bool was_masked = masked_at_start(p.t, s);
  bool ok = true;
  if constexpr (kNet<T>)  // a source in another node: its words land before its signal
    if (!was_masked && !p.t.same_node(s))
      ok =
          p.t.wait_signal(ll_sig_dispatch(p.t.num_ranks, s), seq, OpId::kLowLatencyDispatchRecv, s);
  if (ok)
    ok = p.t.wait_tagged(mask_word_offset(p.off, tags, s, w, le, E_local), epoch, word,
                         p.timeout_ns, p.diag, OpId::kLowLatencyDispatchRecv, s, le);
  if (was_masked || (!ok && p.t.masked(s))) {
    word = 0;
    return true;
  }
  return ok;
}

/// Source s's token count into the handle state (the combine reads it there);
/// 0 for a masked source. False: the wait failed, or the sender's shapes differ
/// (its rows sit elsewhere; kBadConfig is reported and ends every wait).
template <class T>
__device__ __forceinline__ bool recv_token_count(const LlDispatchRecvParams<T>& p, uint32_t epoch,
                                                 uint64_t seq, std::size_t tags, int s, int le) {
  uint32_t n = 0;
  const bool was_masked = masked_at_start(p.t, s);  // as in recv_mask_word
  bool came = true;
  if constexpr (kNet<T>)
    if (!was_masked && !p.t.same_node(s))
      came =
          p.t.wait_signal(ll_sig_dispatch(p.t.num_ranks, s), seq, OpId::kLowLatencyDispatchRecv, s);
  if (came)
    came = p.t.wait_tagged(tags + 8u * s, epoch, n, p.timeout_ns, p.diag,
                           OpId::kLowLatencyDispatchRecv, s, le);
  if (was_masked || (!came && p.t.masked(s))) {
    p.state[8 + s] = 0;
    return true;
  }
  if (!came) return false;
  if (plan::ll_shape_of(n) != p.off.shape_fp) {
    dev::report(p.diag, DiagCode::kBadConfig, OpId::kLowLatencyDispatchRecv, p.t.rank, s, -1,
                p.off.shape_fp, plan::ll_shape_of(n));
    return false;
  }
  p.state[8 + s] = min(plan::ll_count_of(n), p.max_tokens);
  return true;
}

template <class T>
__device__ __forceinline__ bool dispatch_recv_unit(const LlDispatchRecvParams<T>& p, uint32_t epoch,
                                                   int unit, int* s_list) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int s_begin[T::kCaps.max_ranks + 1];
  const int R = p.t.num_ranks;
  const int E_local = p.num_experts / R, RT = R * p.max_tokens;
  const int le = unit / p.parts, part = unit % p.parts;
  const std::size_t tags = tags_of(p.off, epoch);

  // Packed order: by source rank, then token; a token counts once however
  // often it picks le. Thread (s, w) waits for word w of source s's mask for
  // le; one scan over all R * W words gives each word its first packed row.
  const int W = ceil_div(p.max_tokens, 32);
  static_assert(T::kCaps.max_ranks * plan::kLlMaxMaskWords <= kThreads);
  const int pos = threadIdx.x, s = pos / W, w = pos % W;
  // wait_stats: the unit's wait for source s = its last mask word's arrival
  // after the unit's start (the block's clock, read once, kept in shared).
  __shared__ uint64_t s_t0;
  __shared__ unsigned long long s_wait[T::kCaps.max_ranks];
  if (p.wait_stats != nullptr) {
    if (threadIdx.x == 0) s_t0 = dev::globaltimer_ns();
    if (static_cast<int>(threadIdx.x) < R) s_wait[threadIdx.x] = 0ull;
  }
  uint32_t word = 0;
  bool ok = true;
  if (pos < R * W) ok = recv_mask_word(p, epoch, 0, tags, s, w, le, E_local, word);
  const uint64_t arrived = p.wait_stats != nullptr ? dev::globaltimer_ns() : 0;
  if (unit == 0 && static_cast<int>(threadIdx.x) < R &&
      !recv_token_count(p, epoch, 0, tags, threadIdx.x, le))
    ok = false;
  if (__syncthreads_or(ok ? 0 : 1) != 0) return false;
  tl_mark(kTlDispatch, kTlRecvFlags);
  if (p.wait_stats != nullptr && pos < R * W)
    atomicMax(&s_wait[s], static_cast<unsigned long long>(arrived > s_t0 ? arrived - s_t0 : 0));
  {
    int prefix = 0, total = 0;
    Scan(scan_tmp).ExclusiveSum(__popc(word), prefix, total);
    for (uint32_t m = word, i = prefix; m != 0u; m &= m - 1u, ++i)
      s_list[i] = (s << 16) | (32 * w + __ffs(m) - 1);
    if (pos < R * W && w == 0) s_begin[s] = prefix;
    if (pos == 0) s_begin[R] = total;
    // The combine's plan: {mask, first packed row} of (s, w, le).
    if (part == 0 && pos < R * W)
      p.combine_plan[static_cast<std::size_t>(pos) * E_local + le] =
          make_int2(static_cast<int>(word), prefix);
  }
  __syncthreads();
  tl_mark(kTlDispatch, kTlRecvMid);
  const int count = s_begin[R];

  if (part == 0) {
    if (threadIdx.x == 0) {
      p.recv_count[le] = count;
      if (p.stats) p.stats[le] += count;
    }
    if (p.wait_stats != nullptr && static_cast<int>(threadIdx.x) < R)
      atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + threadIdx.x),
                s_wait[threadIdx.x]);
    if (static_cast<int>(threadIdx.x) < R) {
      const int s = threadIdx.x;
      p.layout_range[static_cast<int64_t>(le) * R + s] =
          (static_cast<int64_t>(s_begin[s]) << 32) |
          static_cast<int64_t>(s_begin[s + 1] - s_begin[s]);
    }
  }
  // src_info of my rows (-1 past the count).
  for (int j = part + p.parts * static_cast<int>(threadIdx.x); j < RT; j += p.parts * kThreads)
    p.src_info[static_cast<int64_t>(le) * RT + j] = j < count ? (s_list[j] & 0xffff) : -1;

  const int my_rows = count > part ? ceil_div(count - part, p.parts) : 0;
  const bool all_ok = copy_rows(p, epoch, le, my_rows, [&](int i) {
    const int j = part + i * p.parts;
    const int v = s_list[j];
    return make_int3(j, v >> 16, v & 0xffff);
  });
  return __syncthreads_and(all_ok ? 1 : 0) != 0;
}

/// Network transports: dispatch_recv_unit for up to T::kCaps.max_ranks
/// ranks: each thread waits for ceil(R * W / threads) consecutive mask words
/// (a source in another node: after its dispatch signal), and one block scan
/// of the per-thread counts gives every word its first packed row.
template <class T>
__device__ __forceinline__ bool dispatch_recv_unit_net(const LlDispatchRecvParams<T>& p,
                                                       uint32_t epoch, uint64_t seq, int unit,
                                                       int* s_list) {
  using Scan = cub::BlockScan<int, kThreads>;
  constexpr int kMaxPerThread =
      (T::kCaps.max_ranks * plan::kLlMaxMaskWords + kThreads - 1) / kThreads;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int s_begin[T::kCaps.max_ranks + 1];
  __shared__ uint64_t s_t0;
  __shared__ unsigned long long s_wait[T::kCaps.max_ranks];
  const int R = p.t.num_ranks;
  const int E_local = p.num_experts / R, RT = R * p.max_tokens;
  const int le = unit / p.parts, part = unit % p.parts;
  const std::size_t tags = tags_of(p.off, epoch);
  const int W = ceil_div(p.max_tokens, 32), words = R * W;
  const int per = ceil_div(words, kThreads), first = static_cast<int>(threadIdx.x) * per;
  if (p.wait_stats != nullptr) {
    if (threadIdx.x == 0) s_t0 = dev::globaltimer_ns();
    for (int i = threadIdx.x; i < R; i += kThreads) s_wait[i] = 0ull;
  }
  uint32_t word[kMaxPerThread];
  uint64_t arrived[kMaxPerThread];
  bool ok = true;
  int count_mine = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerThread; ++i) {
    word[i] = 0;
    arrived[i] = 0;
    const int pos = first + i;
    if (i < per && pos < words) {
      ok = recv_mask_word(p, epoch, seq, tags, pos / W, pos % W, le, E_local, word[i]) && ok;
      if (p.wait_stats != nullptr) arrived[i] = dev::globaltimer_ns();
      count_mine += __popc(word[i]);
    }
  }
  if (unit == 0)
    for (int s = threadIdx.x; s < R; s += kThreads)
      ok = recv_token_count(p, epoch, seq, tags, s, le) && ok;
  if (__syncthreads_or(ok ? 0 : 1) != 0) return false;
  tl_mark(kTlDispatch, kTlRecvFlags);
  int prefix = 0, total = 0;
  Scan(scan_tmp).ExclusiveSum(count_mine, prefix, total);
#pragma unroll
  for (int i = 0; i < kMaxPerThread; ++i) {
    const int pos = first + i;
    if (i >= per || pos >= words) continue;
    const int s = pos / W, w = pos % W;
    if (p.wait_stats != nullptr)
      atomicMax(&s_wait[s],
                static_cast<unsigned long long>(arrived[i] > s_t0 ? arrived[i] - s_t0 : 0));
    for (uint32_t m = word[i], j = prefix; m != 0u; m &= m - 1u, ++j)
      s_list[j] = (s << 16) | (32 * w + __ffs(m) - 1);
    if (w == 0) s_begin[s] = prefix;
    if (part == 0)
      p.combine_plan[static_cast<std::size_t>(pos) * E_local + le] =
          make_int2(static_cast<int>(word[i]), prefix);
    prefix += __popc(word[i]);
  }
  if (threadIdx.x == 0) s_begin[R] = total;
  __syncthreads();
  tl_mark(kTlDispatch, kTlRecvMid);
  const int count = s_begin[R];
  if (part == 0) {
    if (threadIdx.x == 0) {
      p.recv_count[le] = count;
      if (p.stats) p.stats[le] += count;
    }
    for (int s = threadIdx.x; s < R; s += kThreads) {
      if (p.wait_stats != nullptr)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + s), s_wait[s]);
      p.layout_range[static_cast<int64_t>(le) * R + s] =
          (static_cast<int64_t>(s_begin[s]) << 32) |
          static_cast<int64_t>(s_begin[s + 1] - s_begin[s]);
    }
  }
  for (int j = part + p.parts * static_cast<int>(threadIdx.x); j < RT; j += p.parts * kThreads)
    p.src_info[static_cast<int64_t>(le) * RT + j] = j < count ? (s_list[j] & 0xffff) : -1;
  const int my_rows = count > part ? ceil_div(count - part, p.parts) : 0;
  const bool all_ok = copy_rows(p, epoch, le, my_rows, [&](int i) {
    const int j = part + i * p.parts;
    const int v = s_list[j];
    return make_int3(j, v >> 16, v & 0xffff);
  });
  return __syncthreads_and(all_ok ? 1 : 0) != 0;
}

// ============================================================================
// dispatch: receive in arrival order (experimental, LlDispatchRecvParams::
// arrival_order). Unit = local expert le, one block; its warps form R groups
// (warp % R == s for source s) that do not wait for each other: the first
// warp of group s waits for s's token masks for le, reserves s's rows with a
// shared-memory atomic (so the sources' blocks of rows come in the order their
// masks did), records the combine plan, layout_range[le][s] and src_info of
// those rows, and the group copies them. recv_count after all groups.
// ============================================================================
template <class T>
__device__ __forceinline__ bool dispatch_recv_unit_arrival(const LlDispatchRecvParams<T>& p,
                                                           uint32_t epoch, int le, int* s_list) {
  __shared__ int s_rows;                       // rows reserved so far
  __shared__ int s_begin[T::kCaps.max_ranks];  // first row of each source's block
  __shared__ int s_total[T::kCaps.max_ranks];  // rows of each source
  __shared__ int s_failed;
  const int R = p.t.num_ranks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int E_local = p.num_experts / R, RT = R * p.max_tokens;
  const std::size_t tags = tags_of(p.off, epoch);
  const int W = ceil_div(p.max_tokens, 32);
  static_assert(plan::kLlMaxMaskWords <= 32 && T::kCaps.max_ranks <= kWarps &&
                T::kCaps.max_ranks < 16);  // named barriers 1..R
  if (threadIdx.x == 0) {
    s_rows = 0;
    s_failed = 0;
  }
  __syncthreads();
  const int s = warp % R;  // this warp's source
  const int group_warps = (kWarps - s + R - 1) / R;
  int* const list = s_list + s * p.max_tokens;  // tokens of s's rows, in order
  if (warp == s) {                              // the group's first warp
    const uint64_t t0 = p.wait_stats != nullptr ? dev::globaltimer_ns() : 0;
    uint32_t word = 0;
    bool ok = true;
    if (lane < W) ok = recv_mask_word(p, epoch, 0, tags, s, lane, le, E_local, word);
    const bool words_ok = __all_sync(kFull, ok);
    const int n = __popc(word);
    int incl = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(kFull, incl, d);
      if (lane >= d) incl += v;
    }
    const int total = words_ok ? __shfl_sync(kFull, incl, 31) : 0;
    int begin = 0;
    if (lane == 0) begin = total > 0 ? atomicAdd(&s_rows, total) : 0;
    begin = __shfl_sync(kFull, begin, 0);
    const int prefix = incl - n;
    for (uint32_t m = word, i = prefix; m != 0u; m &= m - 1u, ++i)
      list[i] = 32 * lane + __ffs(m) - 1;
    if (lane < W)
      p.combine_plan[static_cast<std::size_t>(s * W + lane) * E_local + le] =
          make_int2(static_cast<int>(word), begin + prefix);
    if (lane == 0) {
      s_begin[s] = begin;
      s_total[s] = total;
      if (!words_ok) s_failed = 1;
      p.layout_range[static_cast<int64_t>(le) * R + s] =
          (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(total);
      if (p.wait_stats != nullptr)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + s),
                  static_cast<unsigned long long>(dev::globaltimer_ns() - t0));
      if (le == 0 && !recv_token_count(p, epoch, 0, tags, s, le)) s_failed = 1;
    }
  }
  // The group waits for its first warp only (named barrier s + 1).
  asm volatile("bar.sync %0, %1;" ::"r"(s + 1), "r"(group_warps * 32) : "memory");
  const int begin = s_begin[s], rows = s_total[s];
  for (int i = warp / R * 32 + lane; i < rows; i += group_warps * 32)
    p.src_info[static_cast<int64_t>(le) * RT + begin + i] = list[i];
  const bool copied = copy_rows(
      p, epoch, le, rows, [&](int i) { return make_int3(begin + i, s, list[i]); }, warp / R,
      group_warps);
  if (__syncthreads_or((copied && s_failed == 0) ? 0 : 1) != 0) return false;
  const int count = s_rows;
  if (threadIdx.x == 0) {
    p.recv_count[le] = count;
    if (p.stats) p.stats[le] += count;
  }
  for (int j = count + static_cast<int>(threadIdx.x); j < RT; j += kThreads)
    p.src_info[static_cast<int64_t>(le) * RT + j] = -1;
  return true;
}

/// Unit `unit` of the receive phase (kArrival: LlDispatchRecvParams::arrival_order;
/// a template parameter, so the rank-order kernels stay as they were).
template <bool kArrival, class T>
__device__ __forceinline__ bool dispatch_recv_any(const LlDispatchRecvParams<T>& p, uint32_t epoch,
                                                  uint64_t seq, int unit, int* s_list) {
  if constexpr (kArrival)
    return dispatch_recv_unit_arrival(p, epoch, unit, s_list);
  else if constexpr (kNet<T>)
    return dispatch_recv_unit_net(p, epoch, seq, unit, s_list);
  else
    return dispatch_recv_unit(p, epoch, unit, s_list);
}

/// Hook mode: the receive phase alone (epoch from the handle state).
template <bool kArrival, class T>
__global__ void __launch_bounds__(kThreads, 2) ll_dispatch_recv(LlDispatchRecvParams<T> p) {
  extern __shared__ int s_list[];  // [R * maxT]: (source << 16) | token of packed row j
  tl_mark(kTlDispatch, kTlRecvStart);
  tl_mark(kTlDispatch, kTlRecvGo);
  const uint32_t epoch = static_cast<uint32_t>(p.state[0]);
  uint64_t seq = 0;
  if constexpr (kNet<T>) seq = *reinterpret_cast<const uint64_t*>(p.state + 2);
  const int units = p.num_experts / p.t.num_ranks * p.parts;
  snapshot_mask(p.t);
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    if (!dispatch_recv_any<kArrival>(p, epoch, seq, unit, s_list)) break;
    __syncthreads();  // s_list and the scan storage are reused
  }
  tl_finish(kTlDispatch, p.t.rank);
}

/// Without a hook: send and receive in one cooperative launch (every block
/// resident). Blocks [0, send_blocks) send; the others receive from the
/// start, so no receiving block waits for its own stores to drain, and rows
/// are copied while later ones are still crossing.
template <bool kArrival, class T>
__global__ void __launch_bounds__(kThreads, 2)
    ll_dispatch_fused(LlDispatchSendParams<T> sp, LlDispatchRecvParams<T> rp, int send_blocks) {
  extern __shared__ int s_list[];
  tl_mark(kTlDispatch, kTlSendStart);
  tl_mark(kTlDispatch, kTlSendStartMax);
  const int b = static_cast<int>(blockIdx.x);
  const uint64_t seq = next_seq<T>(sp.seq);
  bool send_ok = true;
  const uint32_t epoch = dispatch_begin(sp, seq, /*sends=*/b < send_blocks, send_ok);
  if (b < send_blocks && send_ok)
    dispatch_send_items(sp, epoch, b * kWarps + threadIdx.x / 32, send_blocks * kWarps);
  dispatch_count_done(sp, epoch, seq, !send_ok);
  if (b < send_blocks) {
    tl_finish(kTlDispatch, rp.t.rank);  // (timeline builds count every block)
    return;
  }
  tl_mark(kTlDispatch, kTlRecvStart);
  tl_mark(kTlDispatch, kTlRecvGo);
  const int units = rp.num_experts / rp.t.num_ranks * rp.parts;
  snapshot_mask(rp.t);
  for (int unit = b - send_blocks; unit < units; unit += gridDim.x - send_blocks) {
    __syncthreads();  // s_list and the scan storage are reused
    if (!dispatch_recv_any<kArrival>(rp, epoch, seq, unit, s_list)) break;
  }
  if constexpr (EPX_LL_TIMELINE != 0) {
    __syncthreads();
    if (threadIdx.x == 0 && b - send_blocks < units) {  // blocks that had a unit
      const unsigned long long t = dev::globaltimer_ns();
      tl_mark(kTlDispatch, kTlRecvEndMin);
      // After the first send block's start (set long before): no overflow.
      atomicAdd(&g_timeline.recv_end_sum, t - ~g_timeline.m[kTlDispatch][kTlSendStart]);
      atomicAdd(&g_timeline.recv_end_n, 1ull);
    }
  }
  tl_finish(kTlDispatch, rp.t.rank);
}

/// The packed row of token t at local expert le from the combine plan entry
/// `ent` = {mask, first row} of t's 32-token word, or -1 when t did not pick le
/// (LowLatencyHandle::combine_plan).
__device__ __forceinline__ int plan_row(int2 ent, int le, int t, int rows_per_expert) {
  const uint32_t mask = static_cast<uint32_t>(ent.x), bit = static_cast<uint32_t>(t % 32);
  if (!((mask >> bit) & 1u)) return -1;
  return le * rows_per_expert + ent.y + __popc(mask & ((1u << bit) - 1u));
}

/// Offset of combine weight word [s][t][j] (source s, its token t, entry j)
/// in the weights area that starts at `weights` (this op's half).
__device__ __forceinline__ std::size_t weight_word(const LlOffsets& o, std::size_t weights, int s,
                                                   int t, int j) {
  return weights + static_cast<std::size_t>(s) * o.weights_stride +
         (static_cast<std::size_t>(t) * plan::kLlMaxTopK + j) * 8u;
}

/// Network transports: every block counts itself once its weights are in the
/// send area; the last one puts, to each rank of another node, this rank's
/// weight words for it ([me][t][j] for every token t, one message on context
/// 0) with an add of 1 to that rank's weights signal of this rank, and adds 1
/// on the other contexts (a receiver waits for every context's word). Not
/// when a block's part of the op failed (net_failed_word).
template <class T>
__device__ __forceinline__ void net_send_weights(const LlCombineSendParams<T>& p,
                                                 std::size_t net_weights, std::size_t weights,
                                                 bool failed) {
  uint32_t* fail = net_failed_word(p.t, p.off, kNetFailedCombine);
  if (failed && threadIdx.x == 0) atomicOr(fail, 1u);  // before the count's release
  if (!dev::block_counted_last(reinterpret_cast<uint32_t*>(p.t.local_ptr(p.off.net_done)))) return;
  if (*static_cast<volatile uint32_t*>(fail) != 0u) return;  // a block's part failed
  const int R = p.t.num_ranks, me = p.t.rank;
  const std::size_t bytes = 8u * plan::kLlMaxTopK * static_cast<std::size_t>(p.num_tokens);
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    if (p.t.same_node(r) || p.t.masked(r)) continue;
    if (bytes > 0)
      p.t.template put_signal<dev::Thread>(0, r, weight_word(p.off, weights, me, 0, 0),
                                           weight_word(p.off, net_weights, r, 0, 0), bytes,
                                           ll_sig_weights(R, me), 1);
    else
      p.t.template signal_add<dev::Thread>(0, r, ll_sig_weights(R, me), 1);
    signal_contexts(p.t, r, ll_sig_weights(R, me), /*first=*/1);  // context 0 signalled above
  }
}

/// combine_wait_recv_cost_stats: when source s began its combine, as seen
/// here. Every source writes its weight words before it waits for anything,
/// so a warp of block 0 times the wait for s's first word here (entry 0 of
/// the first token of s with an expert here) and stores it + 1 in
/// p.wait_first[s] (left 0 when s sent no token here). The receive's wait for
/// s's flag would also blame a source whose own send a late rank held up.
template <class T>
__device__ __forceinline__ void time_first_weight(const LlCombineSendParams<T>& p,
                                                  std::size_t weights, uint32_t epoch, int s) {
  const int lane = threadIdx.x % 32;
  const int E_local = p.num_experts / p.t.num_ranks, W = ceil_div(p.max_tokens, 32);
  if (p.t.masked(s)) return;  // shrink: no weights come from s
  const uint64_t t0 = dev::globaltimer_ns();
  int first = -1;
#pragma unroll 1
  for (int w = 0; w < W && first < 0; ++w) {
    uint32_t any = 0;
#pragma unroll 1
    for (int g = lane; g < E_local; g += 32)
      any |= static_cast<uint32_t>(
          __ldcg(p.combine_plan + static_cast<std::size_t>(s * W + w) * E_local + g).x);
    any = __reduce_or_sync(kFull, any);
    if (any != 0u) first = 32 * w + __ffs(static_cast<int>(any)) - 1;
  }
  uint32_t unused = 0;
  if (first >= 0 && lane == 0 &&
      p.t.wait_tagged(weight_word(p.off, weights, s, first, 0), epoch, unused, p.timeout_ns, p.diag,
                      OpId::kLowLatencyCombineSend, s, first))
    p.wait_first[s] = dev::globaltimer_ns() - t0 + 1u;
}

/// A combine row's bytes in the receive and send areas: BF16, or LogFMT's
/// wire form packed row after row (so the puts of consecutive rows stay
/// contiguous and a proxy can coalesce them).
template <bool kLogFmt>
__device__ __forceinline__ std::size_t combine_row_bytes(int hidden) {
  return kLogFmt ? logfmt_wire_bytes(hidden) : 2u * static_cast<std::size_t>(hidden);
}

// ============================================================================
// combine: send. The first warps send this rank's weights (one tagged word per
// (token, distinct expert) to the expert's rank); then each warp takes
// (source, token, chunk) items of the tokens it received (kLlCombineSendChunk
// columns, kLlCombineSendChunkLogFmt with LogFMT). An item
// with several local experts loads their rows before it waits for their
// weights, and sums them in ascending expert id. With LogFMT what crosses is
// coded (logfmt.cuh's wire form, 168 bytes per 128 values instead of 256): a
// raw row, or the float32 sum (coded once, not rounded to BF16 first).
// ============================================================================
template <bool kLogFmt, bool kWaitStats, class T>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_send(LlCombineSendParams<T> p) {
  __shared__ int s_tokens[T::kCaps.max_ranks + 1];  // [kMaxRanks]: the largest
  __shared__ int s_rows[kWarps][plan::kLlMaxTopK];  // per warp: rows of the item's experts
  dev::launch_dependents();
  tl_mark(kTlCombine, kTlSendStart);
  tl_mark(kTlCombine, kTlSendStartMax);
  const int R = p.t.num_ranks, me = p.t.rank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t epoch = plan::next_epoch(*p.op_counter);
  const uint64_t seq = next_seq<T>(p.seq + 1);
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  const std::size_t weights = p.off.weights + (epoch & 1u) * p.off.weights_half_bytes;
  const int H = p.hidden, K = p.num_topk, E = p.num_experts, maxT = p.max_tokens;
  const int H8 = H / 8, E_local = E / R;
  constexpr int kCombineChunk = kLogFmt ? kLlCombineSendChunkLogFmt : kLlCombineSendChunk;
  constexpr int kCombineSteps = kCombineChunk / 256;
  static_assert(!kLogFmt || kCombineChunk == 256, "LogFMT: one 128-column group per half-warp");
  const std::size_t row_bytes = combine_row_bytes<kLogFmt>(H);
  constexpr int kRowsAtOnce = kLlCombineSendRowsAtOnce;
  bool send_ok = true;  // false: this block must not touch its send areas
  if constexpr (kNet<T>) send_ok = quiet_send_areas(p.t);
  // Network transports: this rank's send areas of the op's half.
  [[maybe_unused]] const std::size_t net_weights =
      p.off.net_weights + (epoch & 1u) * p.off.weights_half_bytes;
  [[maybe_unused]] const std::size_t net_rows =
      p.off.net_comb + (epoch & 1u) * p.off.net_comb_half_bytes;

  // Shrink: a masked source gets nothing back (and sends no weights here).
  uint32_t live = 0;  // network transports ask per rank
  if constexpr (!kNet<T>) live = p.t.live_ranks();
  int n_src = 0;
  if constexpr (!kNet<T>) {
    n_src = static_cast<int>(threadIdx.x) < R && ((live >> threadIdx.x) & 1u)
                ? p.disp_state[8 + threadIdx.x]
                : 0;
  } else {
    n_src = static_cast<int>(threadIdx.x) < R && !p.t.masked(threadIdx.x)
                ? p.disp_state[8 + threadIdx.x]
                : 0;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.state[0] = static_cast<int32_t>(epoch);
    if constexpr (kNet<T>) reinterpret_cast<uint64_t*>(p.state)[1] = seq;
  }

  // Weights: warp gw takes tokens gw, gw + all warps, ... For each distinct
  // expert of token t (the sum of the weights of the picks naming it, in k
  // order), entry [me][t][j] at the expert's rank, j = the expert's place in
  // ascending id among t's experts on that rank (the receiver's order).
  // Branch-free around the shuffles: every lane loads (a clamped pick) and
  // every lane takes every step, so the warp never splits around them.
  for (int t = blockIdx.x * kWarps + warp; send_ok && t < p.num_tokens; t += gridDim.x * kWarps) {
    const int kk = min(lane, K - 1);
    const int64_t e64 = p.topk_idx[static_cast<int64_t>(t) * K + kk];
    const float w = p.topk_weights[static_cast<int64_t>(t) * K + kk];
    const int e = lane < K && e64 >= 0 && e64 < E ? static_cast<int>(e64) : -1;
    const int r = e >= 0 ? e / E_local : -1;
    float wsum = 0.0f;    // weights of the picks naming e, in k order
    bool first = e >= 0;  // no earlier pick names e
    for (int k = 0; k < K; ++k) {
      const int ek = __shfl_sync(kFull, e, k);
      const float wk = __shfl_sync(kFull, w, k);
      wsum += ek == e ? wk : 0.0f;
      first = first && !(ek == e && k < lane);
    }
    int j = 0;  // distinct experts of t on rank r with a smaller id
    for (int k = 0; k < K; ++k) {
      const int ek = __shfl_sync(kFull, e, k);
      const bool first_k = __shfl_sync(kFull, first ? 1 : 0, k) != 0;  // implies ek >= 0
      j += first_k && ek / E_local == r && ek < e ? 1 : 0;
    }
    if constexpr (!kNet<T>) {
      if (first && ((live >> r) & 1u))
        p.t.lsa_tagged(r, weight_word(p.off, weights, me, t, j), __float_as_uint(wsum), epoch);
    } else if (first && !p.t.masked(r)) {
      if (p.t.same_node(r))
        p.t.lsa_tagged(r, weight_word(p.off, weights, me, t, j), __float_as_uint(wsum), epoch);
      else  // into the send area [r][t][j]; put below once every block wrote its tokens'
        dev::st_relaxed_sys_u64(
            reinterpret_cast<uint64_t*>(p.t.local_ptr(weight_word(p.off, net_weights, r, t, j))),
            (static_cast<uint64_t>(epoch) << 32) | __float_as_uint(wsum));
    }
  }
  if constexpr (kNet<T>) net_send_weights(p, net_weights, weights, !send_ok);
  if (static_cast<int>(threadIdx.x) < R) s_tokens[threadIdx.x] = min(max(n_src, 0), maxT);
  __syncthreads();
  if (threadIdx.x == 0) {
    int t_max = 0;
    for (int s = 0; s < R; ++s) t_max = max(t_max, s_tokens[s]);
    s_tokens[T::kCaps.max_ranks] = t_max;
  }
  __syncthreads();

  // Its own instance: the loop below keeps its registers (no spill).
  if constexpr (kWaitStats) {
    if constexpr (kNet<T>) {
      if (blockIdx.x == 0)
        for (int s = warp; s < R; s += kWarps) time_first_weight(p, weights, epoch, s);
    } else if (blockIdx.x == 0 && warp < R) {
      time_first_weight(p, weights, epoch, /*s=*/warp);
    }
  }

  // Items token-major, the sources rotated from me + 1: at any moment every
  // rank's warps write to all sources at once, each from a different start,
  // instead of every rank writing to source 0 first (one hot ingress).
  const int C = ceil_div(H, kCombineChunk);
  const int items = send_ok ? R * s_tokens[T::kCaps.max_ranks] * C : 0;
  bool failed = !send_ok;  // a wait of this warp failed: the op must not be signalled
  const int W = ceil_div(maxT, 32), RT = R * maxT;
  for (int item = blockIdx.x * kWarps + warp; item < items; item += gridDim.x * kWarps) {
    const int pair = item / C, c = item % C;
    const int s = (me + 1 + pair % R) % R, t = pair / R;
    if (t >= s_tokens[s]) continue;
    const int2* plan_w = p.combine_plan + static_cast<std::size_t>(s * W + t / 32) * E_local;
    // The packed rows of the local experts token t of s picked, in ascending
    // id, to s_rows[warp][0, n).
    int n = 0;
#pragma unroll 2
    for (int g = 0; g < E_local; g += 32) {
      const int2 ent = g + lane < E_local ? __ldcg(plan_w + g + lane) : make_int2(0, 0);
      const int row = plan_row(ent, g + lane, t, RT);
      const uint32_t picks = __ballot_sync(kFull, row >= 0);
      const int j = n + __popc(picks & ((1u << lane) - 1u));
      if (row >= 0 && j < plan::kLlMaxTopK) s_rows[warp][j] = row;
      n += __popc(picks);
    }
    if (n == 0) continue;
    n = min(n, plan::kLlMaxTopK);  // at most K distinct experts
    __syncwarp();
    const int my_row = lane < n ? s_rows[warp][lane] : -1;
    __syncwarp();  // read before the next item writes
    // The row's place at s; for a source in another node (network
    // transports) it is written to the send area [s][t] first, and the warp
    // that writes its last chunk puts it to s.
    const std::size_t at_s =
        half + p.off.comb_rows + (static_cast<std::size_t>(me) * maxT + t) * row_bytes;
    bool remote_s = false;
    if constexpr (kNet<T>) remote_s = !p.t.same_node(s);
    [[maybe_unused]] const std::size_t here =
        net_rows + (static_cast<std::size_t>(s) * maxT + t) * row_bytes;
    int4* dst = reinterpret_cast<int4*>(remote_s ? p.t.local_ptr(here) : p.t.lsa_ptr(s, at_s));
    // Every chunk of (s, t) counts in row_done, also one skipped because s
    // was masked meanwhile (`send` false): the count must reach C and reset.
    auto chunk_written = [&](bool send) {
      if constexpr (kNet<T>) {
        uint32_t* done = reinterpret_cast<uint32_t*>(p.t.local_ptr(p.off.row_done)) +
                         static_cast<std::size_t>(s) * plan::kLlMaxTokens + t;
        if (remote_s && last_part(done, C) && send && !__any_sync(kFull, p.t.masked(s)))
          p.t.template put<dev::Warp>(put_context(p.ctx_tokens, t, p.t.num_contexts), s, at_s, here,
                                      row_bytes);
      }
    };
    const int col0 = c * (kCombineChunk / 8) + lane;

    // LogFMT: this lane's group on the wire (lanes 0-15 and 16-31 code one
    // 128-column group each of the item's 256 columns).
    [[maybe_unused]] uint8_t* group =
        reinterpret_cast<uint8_t*>(dst) +
        static_cast<std::size_t>(2 * c + lane / 16) * kLogFmtGroupBytes;

    if (n == 1) {
      // One expert here: its raw row; the source weights it.
      const int4* src = reinterpret_cast<const int4*>(
          p.x + static_cast<int64_t>(__shfl_sync(kFull, my_row, 0)) * H);
      int4 v[kCombineSteps];
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
        v[st] = col0 + 32 * st < H8 ? dev::ld_nc(src + col0 + 32 * st) : make_int4(0, 0, 0, 0);
      if constexpr (kLogFmt) {
        float f[8];
        unpack_bf16x8(v[0], f);
        logfmt_store(f, group, lane % 16, col0 < H8);
      } else {
#pragma unroll
        for (int st = 0; st < kCombineSteps; ++st)
          if (col0 + 32 * st < H8) dev::st_na(dst + col0 + 32 * st, v[st]);
      }
      chunk_written(true);
      continue;
    }

    // Several experts here: sum_j weight_j * row_j, rows kRowsAtOnce at a time;
    // the first rows are in flight while the weights are awaited.
    float acc[kCombineSteps][8];
#pragma unroll
    for (int st = 0; st < kCombineSteps; ++st)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[st][i] = 0.0f;
    uint32_t w_bits = 0;
    bool ok = true;
    for (int j0 = 0; j0 < n; j0 += kRowsAtOnce) {
      // Every load unconditional (rows past n repeat row n - 1 and are not
      // summed; columns past the row repeat its last vector and are not
      // stored): a load that may be skipped lands in a temporary that must be
      // moved out before the next load can reuse it, which held all but two
      // loads of a batch back behind the first ones' latency.
      int4 v[kRowsAtOnce][kCombineSteps];
#pragma unroll
      for (int jj = 0; jj < kRowsAtOnce; ++jj) {
        const int rj = __shfl_sync(kFull, my_row, min(j0 + jj, n - 1));
        const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(rj) * H);
#pragma unroll
        for (int st = 0; st < kCombineSteps; ++st)
          v[jj][st] = dev::ld_nc(src + min(col0 + 32 * st, H8 - 1));
      }
      if (j0 == 0) {
        if (lane < n) {
          if constexpr (kNet<T>)  // a source in another node: its weights land before its signal
            if (remote_s)
              ok = p.t.wait_signal(ll_sig_weights(R, s), seq, OpId::kLowLatencyCombineSend, s);
          if (ok)
            ok = p.t.wait_tagged(weight_word(p.off, weights, s, t, lane), epoch, w_bits,
                                 p.timeout_ns, p.diag, OpId::kLowLatencyCombineSend, s, t);
        }
        if (!__all_sync(kFull, ok)) break;  // reported, or s masked (shrink): see below
      }
#pragma unroll
      for (int jj = 0; jj < kRowsAtOnce; ++jj) {
        if (j0 + jj >= n) break;  // warp-uniform
        const float wj = __uint_as_float(__shfl_sync(kFull, w_bits, j0 + jj));
#pragma unroll
        for (int st = 0; st < kCombineSteps; ++st) {
          float f[8];
          unpack_bf16x8(v[jj][st], f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[st][i] = fmaf(wj, f[i], acc[st][i]);
        }
      }
    }
    if (!__all_sync(kFull, ok)) {
      if (__any_sync(kFull, p.t.masked(s))) {  // s masked meanwhile (shrink)
        chunk_written(false);
        continue;
      }
      failed = true;
      break;
    }
    if constexpr (kLogFmt) {
      logfmt_store(acc[0], group, lane % 16, col0 < H8);  // the float32 sum, coded once
    } else {
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
        if (col0 + 32 * st < H8) dev::st_na(dst + col0 + 32 * st, pack_bf16x8(acc[st]));
    }
    chunk_written(true);
  }
  finish_combine_send(p.t, p.off, half, p.op_counter, epoch, p.seq + 1, seq, failed);
}

/// A lane's part of one rank's row in a combine-receive item: kSteps BF16
/// vectors, or with LogFMT its codes of one 128-value group (kSteps == 1).
template <bool kLogFmt, int kSteps>
struct RowPart {
  int4 v[kSteps];
};
template <int kSteps>
struct RowPart<true, kSteps> {
  static_assert(kSteps == 1, "a LogFMT item is 256 columns: one group per half-warp");
  LogFmtLane w;
};

/// Loads lane `lane`'s part of item chunk `c` of the row at `row` (a
/// source's row of 2H bytes); `use` false (or columns past the row) gives a
/// part of zeros.
template <bool kLogFmt, int kSteps>
__device__ __forceinline__ RowPart<kLogFmt, kSteps> load_row_part(const uint8_t* row, int c,
                                                                  int lane, int H8, bool use) {
  RowPart<kLogFmt, kSteps> part;
  const int col0 = c * (kSteps * 256 / 8) + lane;
  if constexpr (kLogFmt) {
    if (use && col0 < H8) {
      part.w = logfmt_load(row + static_cast<std::size_t>(2 * c + lane / 16) * kLogFmtGroupBytes,
                           lane % 16);
    } else {
      part.w = LogFmtLane{0u, 0u, 0.0f, 0.0f};
    }
  } else {
#pragma unroll
    for (int st = 0; st < kSteps; ++st)
      part.v[st] = use && col0 + 32 * st < H8
                       ? __ldcg(reinterpret_cast<const int4*>(row) + col0 + 32 * st)
                       : make_int4(0, 0, 0, 0);
  }
  return part;
}

/// Adds one rank's row of a combine-receive item (`part`) to `acc`: a raw
/// row (the rank hosts a single expert of the token), weighted here by each
/// of the picks naming it (`picks`: their lanes, `w` the lane's weight), in
/// lane order; or a sum the rank already weighted (several experts there),
/// as it is. LogFMT rows are decoded first.
template <bool kLogFmt, int kSteps>
__device__ __forceinline__ void add_rank_row(float (&acc)[kSteps][8],
                                             const RowPart<kLogFmt, kSteps>& part, uint32_t picks,
                                             bool raw, float w) {
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    float f[8];
    if constexpr (kLogFmt)
      logfmt_decode(part.w, f);
    else
      unpack_bf16x8(part.v[st], f);
    if (raw) {
      for (uint32_t m = picks; m != 0u; m &= m - 1u) {
        const float wk = __shfl_sync(kFull, w, __ffs(m) - 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[st][i] = fmaf(wk, f[i], acc[st][i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[st][i] += f[i];
    }
  }
}

// ============================================================================
// combine: receive. Each warp takes (token, 256-column chunk) items and sums
// the rows of the ranks the token reached, in rank order; a rank that hosts one
// of the token's experts sent its raw row, weighted here. The rows of up to
// kRanksAtOnce ranks load together, before the token's routing is known (most
// (token, rank) pairs carry a row), and the first item's routing loads
// before the wait for the send kernel (it is input, not the send's output).
// ============================================================================
template <bool kLogFmt, class T>
__global__ void __launch_bounds__(kThreads, kLlCombineRecvBlocksPerSm)
    ll_combine_recv(LlCombineRecvParams<T> p) {
  const int R = p.t.num_ranks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int H = p.hidden, K = p.num_topk, E = p.num_experts, E_local = E / R;
  const int H8 = H / 8;
  constexpr int kCombineChunk = kLlCombineRecvChunk, kCombineSteps = kCombineChunk / 256;
  constexpr int kRanksAtOnce = kLogFmt ? 2 : kLlCombineRecvRanksAtOnce;  // LogFMT: registers
  const std::size_t row_bytes = combine_row_bytes<kLogFmt>(H);
  const int C = ceil_div(H, kCombineChunk);
  const int items = p.num_tokens * C;
  int item = blockIdx.x * kWarps + warp;
  auto pick_of = [&](int it, int64_t& e, float& w) {
    const int64_t at = static_cast<int64_t>(it / C) * K + min(lane, K - 1);
    e = lane < K ? p.topk_idx[at] : -1;
    w = lane < K ? p.topk_weights[at] : 0.0f;
  };
  int64_t e = -1;
  float w = 0.0f;
  if (item < items) pick_of(item, e, w);

  tl_mark(kTlCombine, kTlRecvStart);
  dev::wait_prerequisite_grid();  // the send kernel (a no-op in hook mode)
  tl_mark(kTlCombine, kTlRecvGo);
  const uint32_t epoch = static_cast<uint32_t>(p.state[0]);
  const std::size_t half = p.off.half0 + (epoch & 1u) * p.off.half_bytes;
  uint64_t seq = 0;
  if constexpr (kNet<T>) seq = reinterpret_cast<const uint64_t*>(p.state)[1];

  uint32_t live = 0;  // shrink: the ranks whose rows count
  if (!wait_combine_flags(p.t, p.off, half, epoch, seq, p.timeout_ns, p.diag, p.wait_stats,
                          p.send_wait_first, live)) {
    tl_finish(kTlCombine, p.t.rank);
    return;
  }
  tl_mark(kTlCombine, kTlRecvFlags);

  if constexpr (kNet<T>) {
    // Up to T::kCaps.max_ranks ranks: only the (at most K) ranks the token's
    // picks name are read, in ascending rank order, kRanksAtOnce rows at a time.
    for (bool first_item = true; item < items; item += gridDim.x * kWarps, first_item = false) {
      const int t = item / C, c = item % C;
      const int col0 = c * (kCombineChunk / 8) + lane;
      const uint8_t* rows = reinterpret_cast<const uint8_t*>(
          p.t.local_ptr(half + p.off.comb_rows + static_cast<std::size_t>(t) * row_bytes));
      const std::size_t rank_stride = static_cast<std::size_t>(p.max_tokens) * row_bytes;
      if (!first_item) pick_of(item, e, w);
      int rank_of = (e >= 0 && e < E) ? static_cast<int>(e / E_local) : -1;
      if (rank_of >= 0 && p.t.masked(rank_of)) rank_of = -1;  // a masked rank's pick
      const bool first = lane == __ffs(__match_any_sync(kFull, e)) - 1;
      // One lane per distinct rank; lane i of `sorted` holds the i-th smallest.
      const uint32_t same_rank = __match_any_sync(kFull, rank_of);  // every lane
      const bool rank_lead = rank_of >= 0 && lane == __ffs(same_rank) - 1;
      const uint32_t leads = __ballot_sync(kFull, rank_lead);
      const int n_ranks = __popc(leads);
      int sorted = -1;
      for (uint32_t m = leads; m != 0u; m &= m - 1u) {
        const int r = __shfl_sync(kFull, rank_of, __ffs(m) - 1);
        const int below = __popc(__ballot_sync(kFull, rank_lead && rank_of < r));
        if (lane == below) sorted = r;
      }
      float acc[kCombineSteps][8];
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[st][i] = 0.0f;
      for (int i0 = 0; i0 < n_ranks; i0 += kRanksAtOnce) {
        RowPart<kLogFmt, kCombineSteps> v[kRanksAtOnce];
#pragma unroll
        for (int rr = 0; rr < kRanksAtOnce; ++rr) {
          const int r = __shfl_sync(kFull, sorted, min(i0 + rr, n_ranks - 1));
          v[rr] = load_row_part<kLogFmt, kCombineSteps>(rows + r * rank_stride, c, lane, H8, true);
        }
#pragma unroll
        for (int rr = 0; rr < kRanksAtOnce; ++rr) {
          if (i0 + rr >= n_ranks) break;  // warp-uniform
          const int r = __shfl_sync(kFull, sorted, i0 + rr);
          const uint32_t picks = __ballot_sync(kFull, rank_of == r);
          add_rank_row<kLogFmt>(acc, v[rr], picks,
                                __popc(__ballot_sync(kFull, rank_of == r && first)) == 1, w);
        }
      }
      int4* out = reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * H);
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
        if (col0 + 32 * st < H8) out[col0 + 32 * st] = pack_bf16x8(acc[st]);
    }
  } else {
    for (bool first_item = true; item < items; item += gridDim.x * kWarps, first_item = false) {
      const int t = item / C, c = item % C;
      const int col0 = c * (kCombineChunk / 8) + lane;
      const uint8_t* rows = reinterpret_cast<const uint8_t*>(
          p.t.local_ptr(half + p.off.comb_rows + static_cast<std::size_t>(t) * row_bytes));
      const std::size_t rank_stride = static_cast<std::size_t>(p.max_tokens) * row_bytes;
      float acc[kCombineSteps][8];
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[st][i] = 0.0f;
      RowPart<kLogFmt, kCombineSteps> v[kRanksAtOnce];
      auto load_rows = [&](int r0) {
#pragma unroll
        for (int rr = 0; rr < kRanksAtOnce; ++rr)
          v[rr] = load_row_part<kLogFmt, kCombineSteps>(rows + (r0 + rr) * rank_stride, c, lane, H8,
                                                        r0 + rr < R);
      };
      load_rows(0);  // before the routing: one memory latency, not two
      if (!first_item) pick_of(item, e, w);
      int rank_of = (e >= 0 && e < E) ? static_cast<int>(e / E_local) : -1;
      if (rank_of >= 0 && !((live >> rank_of) & 1u)) rank_of = -1;  // a masked rank's pick
      // First pick of each distinct expert (a repeated expert id counts once).
      const bool first = lane == __ffs(__match_any_sync(kFull, e)) - 1;
      for (int r0 = 0; r0 < R; r0 += kRanksAtOnce) {
        if (r0 > 0) load_rows(r0);
#pragma unroll
        for (int rr = 0; rr < kRanksAtOnce; ++rr) {
          const int r = r0 + rr;
          const uint32_t picks = __ballot_sync(kFull, rank_of == r);  // none when r >= R
          if (picks == 0u) continue;
          add_rank_row<kLogFmt>(acc, v[rr], picks,
                                __popc(__ballot_sync(kFull, rank_of == r && first)) == 1, w);
        }
      }
      int4* out = reinterpret_cast<int4*>(p.out + static_cast<int64_t>(t) * H);
#pragma unroll
      for (int st = 0; st < kCombineSteps; ++st)
        if (col0 + 32 * st < H8) out[col0 + 32 * st] = pack_bf16x8(acc[st]);
    }
  }
  tl_finish(kTlCombine, p.t.rank);
}

enum class Launch { kPlain, kDependent, kCooperative };

/// cudaLaunchKernelEx with at most one attribute: kDependent = programmatic
/// stream serialization (the previous kernel in the stream is this op's send
/// kernel), kCooperative = every block resident at once or the launch fails.
template <class... Params, class... Args>
void launch_ex(void (*kernel)(Params...), int blocks, int threads, std::size_t smem,
               cudaStream_t stream, Launch how, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  if (how == Launch::kDependent) {
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
  } else if (how == Launch::kCooperative) {
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
  }
  cfg.attrs = &attr;
  cfg.numAttrs = how == Launch::kPlain ? 0u : 1u;
  EPX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

std::size_t dispatch_recv_smem(int num_ranks, int max_tokens) {
  return sizeof(int) * static_cast<std::size_t>(num_ranks) * max_tokens;
}
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t smem) {
  if (smem > 48 * 1024)
    EPX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
}
/// The params struct of transport type T: the call's arguments and the transport.
template <template <class> class Params, class T, class Args>
Params<T> params_of(const T& t, const Args& a) {
  Params<T> p{};
  static_cast<Args&>(p) = a;
  p.t = t;
  return p;
}
/// Arrival order is a load/store protocol: network transports pack in rank order.
template <class T>
constexpr bool kArrivalCapable = !T::kCaps.network;

template <class T>
void launch_ll_dispatch_send_for(const T& tt, const LlDispatchSendArgs& a, int num_blocks,
                                 cudaStream_t stream) {
  ll_dispatch_send<T><<<num_blocks, kThreads, 0, stream>>>(params_of<LlDispatchSendParams>(tt, a));
  EPX_LAUNCH_CHECK();
}

template <class T>
void launch_ll_dispatch_recv_for(const T& tt, const LlDispatchRecvArgs& a, int num_blocks,
                                 cudaStream_t stream) {
  const std::size_t smem = dispatch_recv_smem(tt.num_ranks, a.max_tokens);
  auto* kernel = a.arrival_order && kArrivalCapable<T> ? ll_dispatch_recv<kArrivalCapable<T>, T>
                                                       : ll_dispatch_recv<false, T>;
  allow_smem(kernel, smem);
  launch_ex(kernel, num_blocks, kThreads, smem, stream, Launch::kPlain,
            params_of<LlDispatchRecvParams>(tt, a));
}

template <class T>
void launch_ll_dispatch_fused_for(const T& tt, const LlDispatchSendArgs& sa,
                                  const LlDispatchRecvArgs& ra, int num_blocks, int send_blocks,
                                  cudaStream_t stream) {
  const std::size_t smem = dispatch_recv_smem(tt.num_ranks, ra.max_tokens);
  auto* kernel = ra.arrival_order && kArrivalCapable<T> ? ll_dispatch_fused<kArrivalCapable<T>, T>
                                                        : ll_dispatch_fused<false, T>;
  allow_smem(kernel, smem);
  launch_ex(kernel, num_blocks, kThreads, smem, stream, Launch::kCooperative,
            params_of<LlDispatchSendParams>(tt, sa), params_of<LlDispatchRecvParams>(tt, ra),
            send_blocks);
}

/// A cooperative launch: every block is resident at once or the launch fails.
/// Items of one rank's combine send wait for weight words that blocks of the
/// other ranks' sends produce; with part of a grid kept off the SMs (by other
/// work) until the rest ends, ranks could wait on each other until the
/// deadline.
template <class T>
void launch_ll_combine_send_for(const T& tt, const LlCombineSendArgs& a, int num_blocks,
                                cudaStream_t stream) {
  const bool stats = a.wait_first != nullptr;
  auto* kernel = a.logfmt
                     ? (stats ? ll_combine_send<true, true, T> : ll_combine_send<true, false, T>)
                     : (stats ? ll_combine_send<false, true, T> : ll_combine_send<false, false, T>);
  launch_ex(kernel, num_blocks, kThreads, 0, stream, Launch::kCooperative,
            params_of<LlCombineSendParams>(tt, a));
}

template <class T>
void launch_ll_combine_recv_for(const T& tt, const LlCombineRecvArgs& a, int num_blocks,
                                cudaStream_t stream, bool dependent) {
  launch_ex(a.logfmt ? ll_combine_recv<true, T> : ll_combine_recv<false, T>, num_blocks, kThreads,
            0, stream, dependent ? Launch::kDependent : Launch::kPlain,
            params_of<LlCombineRecvParams>(tt, a));
}

/// Loads every kernel of transport T (cudaFuncGetAttributes), so that none is
/// loaded lazily while other ranks' kernels wait.
template <class T>
void preload_ll_kernels_of() {
  cudaFuncAttributes a{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_send<T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_recv<false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_recv<kArrivalCapable<T>, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_fused<false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_dispatch_fused<kArrivalCapable<T>, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_send<false, false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_send<true, false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_send<false, true, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_send<true, true, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_recv<false, T>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&a, ll_combine_recv<true, T>));
}

}  // namespace
}  // namespace epx::kernels
