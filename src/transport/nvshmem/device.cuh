// transport/nvshmem/device.cuh - NvshmemTransport: the device half of the
// NVSHMEM backend (docs/nvshmem.md). Peers in this rank's node are reached by
// load/store (LsaWords, as on the other transports); the others through
// NVSHMEM's generic device API: put, put with a signal add, signal add, fence,
// quiet. Generic calls only, so every NVSHMEM remote transport (IBRC, IBGDA,
// libfabric, UCX) carries them.
//
// The region is a block of NVSHMEM's symmetric heap: the same offsets on every
// PE, and EPX's rank r is PE r. The signal words are the region's own (an
// NVSHMEM signal is a uint64 in symmetric memory), so a wait polls local
// memory for every peer, with EPX's deadline and diagnostic
// (nvshmem_signal_wait_until has none). NVSHMEM 3.4.5's device API has no
// contexts: every context index maps to the one stream of operations, and
// queue pairs per peer are NVSHMEM's environment.
//
// Needs NVSHMEM's headers and relocatable device code: only the NVSHMEM
// module's translation units include it (not transport/any.hpp's list).
// Nothing of it has run on a GPU yet.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

#include "common/device.cuh"
#include "transport/concept.cuh"
#include "transport/lsa.cuh"

namespace epx::dev {

struct NvshmemTransport : NetworkTransportBase, LsaWords<NvshmemTransport> {
  static constexpr TransportCaps kCaps{/*network=*/true, /*peer_loads=*/true, kMaxContexts,
                                       kMaxRanks};

#if defined(__CUDACC__)
  /// Peer r's copy of this rank's region offset `off`: the same symmetric
  /// address (NVSHMEM translates it for the PE).
  __device__ __forceinline__ char* sym(std::size_t off) const {
    return local + off;
  }
  __device__ __forceinline__ uint64_t* sig_addr(int sig, int ctx) const {
    return reinterpret_cast<uint64_t*>(local + signal_word(sig, ctx));
  }
  template <class Coop>
  __device__ __forceinline__ void put(int, int r, std::size_t dst_off, std::size_t src_off,
                                      std::size_t bytes) const {
    if (same_node(r)) {
      lsa_copy<Coop>(r, dst_off, src_off, bytes);
    } else if constexpr (std::is_same_v<Coop, Thread>) {
      nvshmem_putmem_nbi(sym(dst_off), sym(src_off), bytes, r);
    } else if constexpr (std::is_same_v<Coop, Warp>) {
      nvshmemx_putmem_nbi_warp(sym(dst_off), sym(src_off), bytes, r);
    } else {
      nvshmemx_putmem_nbi_block(sym(dst_off), sym(src_off), bytes, r);
    }
  }
  /// `add` to r's word of signal `sig`, context `ctx`, after this group's
  /// earlier puts to r: nvshmem_fence orders them before the signal.
  template <class Coop>
  __device__ __forceinline__ void signal_add(int ctx, int r, int sig, uint64_t add) const {
    coop_sync<Coop>();
    if (!coop_leader<Coop>()) return;
    if (same_node(r)) {
      lsa_signal_add(ctx, r, sig, add);
      return;
    }
    nvshmem_fence();
    nvshmemx_signal_op(sig_addr(sig, ctx), add, NVSHMEM_SIGNAL_ADD, r);
  }
  template <class Coop>
  __device__ __forceinline__ void put_signal(int ctx, int r, std::size_t dst_off,
                                             std::size_t src_off, std::size_t bytes, int sig,
                                             uint64_t add) const {
    if (same_node(r)) {
      lsa_copy<Coop>(r, dst_off, src_off, bytes);
      signal_add<Coop>(ctx, r, sig, add);
    } else if constexpr (std::is_same_v<Coop, Thread>) {
      nvshmem_putmem_signal_nbi(sym(dst_off), sym(src_off), bytes, sig_addr(sig, ctx), add,
                                NVSHMEM_SIGNAL_ADD, r);
    } else if constexpr (std::is_same_v<Coop, Warp>) {
      nvshmemx_putmem_signal_nbi_warp(sym(dst_off), sym(src_off), bytes, sig_addr(sig, ctx), add,
                                      NVSHMEM_SIGNAL_ADD, r);
    } else {
      nvshmemx_putmem_signal_nbi_block(sym(dst_off), sym(src_off), bytes, sig_addr(sig, ctx), add,
                                       NVSHMEM_SIGNAL_ADD, r);
    }
  }
  /// The region's words, written by same-node peers' atomics and by NVSHMEM's
  /// signal operations alike.
  __device__ __forceinline__ bool wait_signal(int sig, uint64_t value, OpId op, int peer) const {
    return wait_signal_words(*this, local, sig, value, op, peer);
  }
  __device__ __forceinline__ uint64_t read_signal(int sig, int) const {
    return read_signal_words(*this, local, sig);
  }
  /// Every put this PE issued has completed (NVSHMEM's quiet covers all of
  /// them, not one context's). It has no deadline: a dead network hangs here.
  __device__ __forceinline__ bool quiet(int) const {
    nvshmem_quiet();
    return true;
  }
#endif  // __CUDACC__
};

static_assert(DeviceTransport<NvshmemTransport>);

/// The module's device struct from the transport data the core filled
/// (dev::ModuleTransport holds no more than a NetworkTransportBase).
inline NvshmemTransport nvshmem_device_of(const NetworkTransportBase& base) {
  NvshmemTransport t{};
  static_cast<NetworkTransportBase&>(t) = base;
  return t;
}

}  // namespace epx::dev
