// transport/nccl/device.cuh - NcclGinTransport: the device half of the NCCL
// GIN backend (docs/nccl_gin.md). Peers in this rank's node are reached by
// load/store (LsaWords, NCCL's LSA pointers of the window); the others
// through NCCL's GPU-initiated networking: put, put with a signal add, signal
// add, flush. Context c is GIN context c % 4 of communicator c / 4 (NCCL
// 2.28.9 gives at most 4 contexts per communicator).
//
// Signals: a peer in another node adds to NCCL's signal `sig` of the context
// it used (NCCL keeps one word per context); a same-node peer adds to the
// region's signal words, as on the other transports. wait_signal reads the
// one or the other by the waited-for peer.
//
// In the kernels' list (transport/any.hpp); Smoke.TransportPutSignalNcclGin
// tests it alone. Nothing of it has run on a GPU yet.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#include <nccl.h>
#include <nccl_device.h>
#endif

#include "common/device.cuh"
#include "transport/concept.cuh"
#include "transport/lsa.cuh"
#include "transport/nccl/credit.hpp"

#if !defined(__CUDACC__)
struct ncclDevComm;
typedef struct ncclWindow_vidmem* ncclWindow_t;
#endif

namespace epx::dev {

/// GIN contexts per NCCL communicator in NCCL 2.28.9.
inline constexpr int kGinContextsPerComm = 4;
/// Communicators a transport spreads its contexts over.
inline constexpr int kMaxGinComms = (kMaxContexts + kGinContextsPerComm - 1) / kGinContextsPerComm;

#if defined(__CUDACC__)
/// NCCL's GIN proxy (the CPU-driven GIN type, the loopback plugin's) has a
/// queue of descriptors per (context, peer); a GPU thread that posts to a
/// full queue spins inside NCCL until the proxy frees a slot, with no
/// deadline, so a stalled network would hang it there. EPX posts nothing on
/// its GIN contexts but through this gate: every descriptor to `peer` first
/// takes a ticket k from `tickets[peer]`, then waits, with EPX's deadline,
/// until the proxy consumed all but queueSize - 1 of the descriptors before
/// it. Whatever order the gated threads then claim NCCL's slots in, none
/// finds the queue full (a thread holding the highest ticket passed so far
/// saw the consumed index past it minus queueSize). False after reporting
/// kNetCredit (peer, context `ctx_id`, ticket, consumed index), or without a
/// report when the wait gave up for another thread's report or the peer is
/// masked (shrink, `peer_masked`); true at once for other GIN types (GDAKI's
/// queues are the NIC's) or without tickets. A ticket whose wait failed
/// posts nothing: the tickets then run ahead of NCCL's produced index until
/// gin_sync_tickets sets them back (no op in flight).
/// NCCL's GIN proxy queues of context `context` (their produced and consumed
/// indices per peer), read as this build's NCCL headers lay them out; nullptr
/// for other GIN types. The one place EPX reads NCCL's private proxy state.
__device__ __forceinline__ const ncclGinProxyGpuCtx_t* gin_proxy_queues(const ncclDevComm& dc,
                                                                        int context) {
  return dc.ginTypes[context] == NCCL_NET_DEVICE_GIN_PROXY
             ? static_cast<const ncclGinProxyGpuCtx_t*>(dc.ginHandles[context])
             : nullptr;
}

__device__ __forceinline__ bool gin_credit(const ncclDevComm& dc, int context, unsigned* tickets,
                                           int peer, uint64_t timeout_ns, DeviceDiag* diag,
                                           int rank, int ctx_id, int* peer_masked = nullptr) {
  const ncclGinProxyGpuCtx_t* q = gin_proxy_queues(dc, context);
  if (tickets == nullptr || q == nullptr) return true;
  const int32_t size = static_cast<int32_t>(q->queueSize);
  const volatile uint32_t* ci = q->cis + peer;
  const uint32_t k = atomicAdd(tickets + peer, 1u);
  return spin_until([&] { return static_cast<uint32_t>(*ci); },
                    [&](uint32_t c) { return gin_credit::may_post(k, c, size); },
                    [](uint32_t c) { return c; }, k, timeout_ns, diag, OpId::kNetCredit, rank, peer,
                    ctx_id, peer_masked);
}
#endif

struct NcclGinTransport : NetworkTransportBase, LsaWords<NcclGinTransport> {
  static constexpr TransportCaps kCaps{/*network=*/true, /*peer_loads=*/true, kMaxContexts,
                                       kMaxRanks};
  const ncclDevComm* comms;        ///< [ceil(num_contexts / 4)] device communicators
  ncclWindow_t win[kMaxGinComms];  ///< the region's window in each communicator
  /// [kMaxContexts]: puts posted on each context so far (the backend's,
  /// shared by its regions); NCCL's counter of the context counts those whose
  /// source was read (quiet waits for the one to reach the other).
  unsigned long long* posted;
  /// [kMaxContexts][kMaxRanks]: descriptors posted to each peer on each
  /// context (gin_credit's tickets); nullptr: no credit gate (an NCCL other
  /// than the one EPX was built against, whose proxy queue may differ).
  unsigned* tickets;

#if defined(__CUDACC__)
  template <class Coop>
  static __device__ __forceinline__ auto nccl_coop() {
    if constexpr (std::is_same_v<Coop, Thread>) {
      return ncclCoopThread{};
    } else if constexpr (std::is_same_v<Coop, Warp>) {
      return ncclCoopWarp{};
    } else {
      return ncclCoopCta{};
    }
  }
  __device__ __forceinline__ const ncclDevComm& comm_of(int ctx) const {
    return comms[ctx / kGinContextsPerComm];
  }
  __device__ __forceinline__ ncclGin gin(int ctx) const {
    return ncclGin(comm_of(ctx), ctx % kGinContextsPerComm);
  }
  /// A put to a peer of another node, with `action` at the peer (ncclGin_None
  /// or a SignalAdd). Every member of the group calls it; ncclGin syncs the
  /// group and one thread posts after a release of the group's writes.
  /// NCCL's counter of context ctx (one per context index of its
  /// communicator): its puts whose source was read.
  static __device__ __forceinline__ ncclGinCounter_t counter_of(int ctx) {
    return static_cast<ncclGinCounter_t>(ctx % kGinContextsPerComm);
  }
  /// Whether the group may post one descriptor to peer r on context ctx
  /// (gin_credit by its leader; the group learns the answer).
  template <class Coop>
  __device__ __forceinline__ bool group_credit(int ctx, int r) const {
    const bool ok =
        !coop_leader<Coop>() || gin_credit(comm_of(ctx), ctx % kGinContextsPerComm,
                                           tickets ? tickets + ctx * kMaxRanks : nullptr, r,
                                           timeout_ns, diag, rank, ctx, mask_word(r));
    if constexpr (std::is_same_v<Coop, Thread>) {
      return ok;
    } else if constexpr (std::is_same_v<Coop, Warp>) {
      return __all_sync(0xffffffffu, ok);
    } else {
      return __syncthreads_and(ok) != 0;
    }
  }
  /// Counted in `posted` before it is posted, so that a quiet that reads
  /// `posted` after this put was issued waits for it. Not posted when the
  /// queue had no slot within the deadline (reported).
  template <class Coop, class Action>
  __device__ __forceinline__ void gin_put(int ctx, int r, std::size_t dst_off, std::size_t src_off,
                                          std::size_t bytes, Action action) const {
    if (!group_credit<Coop>(ctx, r)) return;
    const ncclWindow_t w = win[ctx / kGinContextsPerComm];
    if (coop_leader<Coop>()) atomicAdd(posted + ctx, 1ull);
    gin(ctx).put(ncclTeamWorld(comm_of(ctx)), r, w, dst_off, w, src_off, bytes, action,
                 ncclGin_CounterInc{counter_of(ctx)}, nccl_coop<Coop>());
  }
  static __device__ __forceinline__ ncclGin_SignalAdd signal_of(int sig, uint64_t add) {
    return ncclGin_SignalAdd{static_cast<ncclGinSignal_t>(sig), add};
  }

  template <class Coop>
  __device__ __forceinline__ void put(int ctx, int r, std::size_t dst_off, std::size_t src_off,
                                      std::size_t bytes) const {
    if (same_node(r))
      lsa_copy<Coop>(r, dst_off, src_off, bytes);
    else
      gin_put<Coop>(ctx, r, dst_off, src_off, bytes, ncclGin_None{});
  }
  template <class Coop>
  __device__ __forceinline__ void signal_add(int ctx, int r, int sig, uint64_t add) const {
    if (same_node(r)) {
      coop_sync<Coop>();
      if (coop_leader<Coop>()) lsa_signal_add(ctx, r, sig, add);
      return;
    }
    if (!group_credit<Coop>(ctx, r)) return;
    gin(ctx).signal(ncclTeamWorld(comm_of(ctx)), r, signal_of(sig, add), nccl_coop<Coop>());
  }
  template <class Coop>
  __device__ __forceinline__ void put_signal(int ctx, int r, std::size_t dst_off,
                                             std::size_t src_off, std::size_t bytes, int sig,
                                             uint64_t add) const {
    if (same_node(r)) {
      lsa_copy<Coop>(r, dst_off, src_off, bytes);
      signal_add<Coop>(ctx, r, sig, add);
      return;
    }
    gin_put<Coop>(ctx, r, dst_off, src_off, bytes, signal_of(sig, add));
  }
  /// Every context's word of signal `sig` >= value: NCCL's words for a peer
  /// in another node, the region's words for a same-node one; EPX's deadline
  /// and diagnostic either way (NCCL's own waits have none).
  __device__ __forceinline__ uint64_t gin_lowest_signal(int sig) const {
    uint64_t m = ~0ull;
    for (int c = 0; c < num_contexts; ++c)
      m = min(m, static_cast<uint64_t>(gin(c).readSignal(static_cast<ncclGinSignal_t>(sig))));
    return m;
  }
  __device__ __forceinline__ bool wait_signal(int sig, uint64_t value, OpId op, int peer) const {
    if (peer >= 0 && same_node(peer)) return wait_signal_words(*this, local, sig, value, op, peer);
    auto lowest = [&] { return gin_lowest_signal(sig); };
    const bool ok = spin_until(
        lowest, [&](uint64_t v) { return v >= value; },
        [](uint64_t v) { return static_cast<uint32_t>(v); }, static_cast<uint32_t>(value),
        timeout_ns, diag, op, rank, peer, kDiagSignalChannel + sig, mask_word(peer));
    if (ok) fence_acq_rel_sys();  // acquire: what the peer's signal published, as for words
    return ok;
  }
  /// wait_signal's least word now, without waiting.
  __device__ __forceinline__ uint64_t read_signal(int sig, int peer) const {
    if (peer >= 0 && same_node(peer)) return read_signal_words(*this, local, sig);
    const uint64_t m = gin_lowest_signal(sig);
    fence_acq_rel_sys();
    return m;
  }
  /// Every put of context `ctx` posted so far (by any thread) has read its
  /// source: NCCL's counter of the context reaches the puts posted on it,
  /// within EPX's deadline (NCCL's flush, which waits for the same, has
  /// none: a dead network would hang there). False after reporting the
  /// posted and completed counts.
  __device__ __forceinline__ bool quiet(int ctx) const {
    const uint64_t target = *static_cast<volatile unsigned long long*>(posted + ctx);
    const ncclGin g = gin(ctx);
    return spin_until<true>([&] { return static_cast<uint64_t>(g.readCounter(counter_of(ctx))); },
                            [&](uint64_t v) { return v >= target; },
                            [](uint64_t v) { return static_cast<uint32_t>(v); },
                            static_cast<uint32_t>(target), timeout_ns, diag, OpId::kNetQuiet, rank,
                            -1, ctx);
  }
#endif  // __CUDACC__
};

static_assert(DeviceTransport<NcclGinTransport>);

}  // namespace epx::dev
