// transport/concept.cuh - what kernels see of a transport.
//
// Kernels are templates over a device transport T (a trivially copyable
// struct the backend builds and passes by value) that satisfies
// DeviceTransport below: exactly the operations the kernels call. Every
// backend implements every one. Each verb's ordering contract is what the
// kernels may rely on, no more (EFA and several QPs per peer reorder writes):
//
//   lsa_ptr(r, off)     load/store pointer to peer r's region at `off` when r is
//                       in this rank's node (NVLink domain), else nullptr: the
//                       kernel then uses the network operations. Stores through
//                       it follow the CUDA memory model (system scope); the
//                       word protocols of LsaWords (lsa.cuh: release-stored
//                       flags, tagged words and their waits) are the only ones
//                       the kernels use on them.
//   local_ptr(off)      this rank's own region
//   put<Coop>(ctx, r, dst_off, src_off, bytes)
//                       copy from this rank's registered region (a send area:
//                       data computed in registers is written there first) to
//                       r's region, on context `ctx`; one call per cooperating
//                       group (Thread, Warp or Block: every member calls it).
//                       Ordered with nothing: the bytes may land in any order
//                       with the context's other puts, and r may read them
//                       only after a later signal of the same context to r.
//                       The source's earlier stores of the calling group are
//                       visible to the copy.
//   put_signal<Coop>(ctx, r, dst_off, src_off, bytes, sig, add)
//                       put, then `add` to signal `sig` at r; the add is
//                       visible at r only after these bytes and every earlier
//                       put of ctx to r have landed (release at r)
//   signal_add<Coop>(ctx, r, sig, add)
//                       `add` to signal `sig` at r, visible only after every
//                       earlier put of this context to r has landed; no order
//                       with other contexts or other peers
//   wait_signal(sig, value, op, peer)  spin until every context's word of
//                       this rank's signal `sig` is >= value, with a deadline
//                       and a diagnostic naming `op` and `peer`; false on
//                       timeout. Acquire: what the signals published is
//                       visible after it returns true
//   read_signal(sig, peer)  the least of those words now, without waiting
//                       (acquire: what the senders' signals published up to
//                       it is visible after); for a consumer that serves
//                       whichever of several inputs has something
//   quiet(ctx)          every put of ctx issued so far is complete at the source
//                       (its send area may be rewritten); false past the
//                       deadline after reporting it. Says nothing of arrival
//
// No verb orders puts among themselves (there is no fence): a put that must
// land after another is separated from it by a signal the receiver waits for.
//
// Signals are 64-bit counters that only add (NCCL GIN offers add and inc,
// not set); receivers wait for >= an expected count derived from how many
// ops ran. A signal id names one source rank and has one word per context
// (so several contexts of one source signal it without sharing a word). A
// sender adds 1 to every context's word per op, each after that context's
// puts; a receiver waits until every word reaches the op's count. (A sum
// over the contexts would let a sender that runs an op ahead, with two
// dispatches in flight, make up with one context's next signal for another
// context's missing one.) Contexts are queue pairs / GIN contexts / proxy
// channels used in parallel.
//
// Capability flags (T::kCaps): whether some peers need the network, whether
// peer loads work (pull dispatch), how many contexts at most.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/device.cuh"
#include "common/topology.hpp"

namespace epx::dev {

/// Cooperative groups of the put / signal calls.
struct Thread {};
struct Warp {};
struct Block {};

struct TransportCaps {
  bool network;      ///< some peers may be in other nodes (lsa_ptr null for them)
  bool peer_loads;   ///< same-node peers' memory may be read (pull dispatch)
  int max_contexts;  ///< contexts (channels, QPs) per peer at most
  int max_ranks;     ///< ranks the transport's kernels handle
};

/// Signal words per signal id: one per context.
using epx::kMaxContexts;

/// The members every device transport shares: who this rank is, the node
/// layout, the shrink mask, the signal area, and the deadline and diagnostic
/// of its waits (the core fills them; kernels read them).
struct TransportBase {
  int rank = 0;
  int num_ranks = 1;
  int ranks_per_node = 1;
  int node_first = 0;    ///< first rank of this rank's node
  int num_contexts = 1;  ///< contexts in use (<= kMaxContexts)
  /// Offset of the signal words in the region: u64 [signals][kMaxContexts]
  /// (the region's plan places them; 0 and no signals when a kernel family
  /// uses none).
  std::size_t signals = 0;
  /// Shrink mode: this rank's mask of peers, int32 [num_ranks] in its own
  /// memory, nonzero = left out (no store to it, no wait for it; a wait that
  /// passes its deadline masks the peer). nullptr: every peer takes part.
  int* peer_mask = nullptr;
  uint64_t timeout_ns = 0;
  DeviceDiag* diag = nullptr;

  /// Offset of the word of signal `sig`, context `ctx`.
  EPX_HD std::size_t signal_word(int sig, int ctx) const {
    return signals + 8u * (static_cast<std::size_t>(sig) * kMaxContexts + ctx);
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ bool same_node(int r) const {
    return static_cast<unsigned>(r - node_first) < static_cast<unsigned>(ranks_per_node);
  }
  /// Whether peer `r` is left out now (shrink mode).
  __device__ __forceinline__ bool masked(int r) const {
    return peer_mask != nullptr && mask_set(peer_mask + r);
  }
  /// Bit r set for every rank r that takes part (num_ranks <= 32 only).
  __device__ __forceinline__ uint32_t live_ranks() const {
    uint32_t live = num_ranks >= 32 ? ~0u : (1u << num_ranks) - 1u;
    if (peer_mask != nullptr)
      for (int r = 0; r < num_ranks; ++r)
        if (masked(r)) live &= ~(1u << r);
    return live;
  }
  /// The mask word a wait for `peer` gives up on (nullptr without shrink mode).
  __device__ __forceinline__ int* mask_word(int peer) const {
    return peer_mask != nullptr && peer >= 0 && peer < num_ranks ? peer_mask + peer : nullptr;
  }
#endif
};

#if defined(__CUDACC__)
/// Whether the calling thread is the one of its group that posts.
template <class Coop>
__device__ __forceinline__ bool coop_leader() {
  if constexpr (std::is_same_v<Coop, Thread>) {
    return true;
  } else if constexpr (std::is_same_v<Coop, Warp>) {
    return (threadIdx.x & 31) == 0;
  } else {
    return threadIdx.x == 0;
  }
}
template <class Coop>
__device__ __forceinline__ void coop_sync() {
  if constexpr (std::is_same_v<Coop, Warp>) {
    __syncwarp();
  } else if constexpr (std::is_same_v<Coop, Block>) {
    __syncthreads();
  }
}
/// Rank and size of the calling thread in its group.
template <class Coop>
__device__ __forceinline__ int coop_index() {
  if constexpr (std::is_same_v<Coop, Thread>) {
    return 0;
  } else if constexpr (std::is_same_v<Coop, Warp>) {
    return threadIdx.x & 31;
  } else {
    return threadIdx.x;
  }
}
template <class Coop>
__device__ __forceinline__ int coop_size() {
  if constexpr (std::is_same_v<Coop, Thread>) {
    return 1;
  } else if constexpr (std::is_same_v<Coop, Warp>) {
    return 32;
  } else {
    return blockDim.x;
  }
}

/// Spins until every context's word of signal `sig` of this rank is >=
/// `value` (their minimum is). Shrink: gives up (false, no report) when
/// `peer` is masked; at the deadline masks the peer (shrink) or reports
/// kTimeout naming `op`, `peer` and, as the channel, kDiagSignalChannel + the
/// signal id (seen: the lowest word).
__device__ __forceinline__ bool wait_signal_words(const TransportBase& t, const char* local,
                                                  int sig, uint64_t value, OpId op, int peer) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(local + t.signal_word(sig, 0));
  uint32_t polls = 0;
  auto lowest = [&] {
    network_poll_pause(polls);
    uint64_t m = ~0ull;
    for (int c = 0; c < t.num_contexts; ++c) m = min(m, ld_relaxed_sys_u64(w + c));
    return m;
  };
  const bool ok = spin_until(
      lowest, [&](uint64_t v) { return v >= value; },
      [](uint64_t v) { return static_cast<uint32_t>(v); }, static_cast<uint32_t>(value),
      t.timeout_ns, t.diag, op, t.rank, peer, kDiagSignalChannel + sig, t.mask_word(peer));
  if (ok) fence_acq_rel_sys();  // acquire: what the sender's signal published
  return ok;
}
/// The least of every context's word of signal `sig` of this rank, now
/// (read_signal of the transports whose signals are region words).
__device__ __forceinline__ uint64_t read_signal_words(const TransportBase& t, const char* local,
                                                      int sig) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(local + t.signal_word(sig, 0));
  uint64_t m = ~0ull;
  for (int c = 0; c < t.num_contexts; ++c) m = min(m, ld_relaxed_sys_u64(w + c));
  fence_acq_rel_sys();  // acquire: what the senders' signals published up to it
  return m;
}
#endif  // __CUDACC__

/// A device transport: see the top of this file.
template <class T>
struct LsaWords;  // lsa.cuh: the same-node word protocols every transport inherits

template <class T>
concept DeviceTransport = std::is_trivially_copyable_v<T> && std::is_base_of_v<TransportBase, T> &&
    std::is_base_of_v<LsaWords<T>, T> &&
    std::same_as<std::remove_cv_t<decltype(T::kCaps)>, TransportCaps>
#if defined(__CUDA_ARCH__)
    && requires(const T& t, int r, int ctx, std::size_t off, uint64_t v) {
  { t.lsa_ptr(r, off) } -> std::same_as<char*>;
  { t.local_ptr(off) } -> std::same_as<char*>;
  { t.template put<Warp>(ctx, r, off, off, off) } -> std::same_as<void>;
  { t.template put_signal<Thread>(ctx, r, off, off, off, r, v) } -> std::same_as<void>;
  { t.template signal_add<Thread>(ctx, r, r, v) } -> std::same_as<void>;
  { t.wait_signal(r, v, OpId::kNone, r) } -> std::same_as<bool>;
  { t.read_signal(r, r) } -> std::same_as<uint64_t>;
  { t.quiet(ctx) } -> std::same_as<bool>;
}
#endif
;

}  // namespace epx::dev
