// transport/lsa.cuh - load/store access to the peers of this rank's node
// (NVLink, or one GPU's memory for in-process ranks), shared by every device
// transport, and LsaTransport: the transport whose peers are all in the node
// (backends nvlink and in_process).
//
// LsaWords<T> are the word-level protocols that only work through a peer's
// mapped memory: epoch flags release-stored into a peer, 64-bit tagged words
// (a value and its epoch stored as one single-copy-atomic word, so the reader
// needs no flag and the writer no fence), and waits on them. A kernel uses
// them only for peers whose lsa_ptr is non-null; for the others it uses the
// transport's put / signal operations.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/device.cuh"
#include "transport/concept.cuh"

namespace epx::dev {

template <class T>
struct LsaWords {
#if defined(__CUDACC__)
  __device__ __forceinline__ const T& self() const {
    return *static_cast<const T*>(this);
  }

  /// Release-stores a 32-bit flag into same-node peer `r` at `offset`.
  __device__ __forceinline__ void lsa_flag(int r, std::size_t offset, uint32_t value) const {
    st_release_sys(reinterpret_cast<uint32_t*>(self().lsa_ptr(r, offset)), value);
  }
  /// 32-bit value and epoch as one tagged word at same-node peer `r`
  /// (8-byte aligned `offset`): the reader needs no flag and the writer no fence.
  __device__ __forceinline__ void lsa_tagged(int r, std::size_t offset, uint32_t value,
                                             uint32_t epoch) const {
    st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(self().lsa_ptr(r, offset)),
                       (static_cast<uint64_t>(epoch) << 32) | value);
  }
  /// As lsa_tagged, with release semantics: the word also publishes the
  /// stores before it (a warp's, after a warp barrier).
  __device__ __forceinline__ void lsa_tagged_release(int r, std::size_t offset, uint32_t value,
                                                     uint32_t epoch) const {
    st_release_sys_u64(reinterpret_cast<uint64_t*>(self().lsa_ptr(r, offset)),
                       (static_cast<uint64_t>(epoch) << 32) | value);
  }
  /// Waits for the tagged word of `epoch` at same-node peer `r`'s `offset`,
  /// with acquire semantics: a pull of what `r` published with lsa_tagged_release.
  __device__ __forceinline__ bool wait_tagged_at(int r, std::size_t offset, uint32_t epoch,
                                                 uint32_t& value, uint64_t timeout_ns,
                                                 DeviceDiag* diag, OpId op, int channel) const {
    return dev::wait_tagged<true>(reinterpret_cast<const uint64_t*>(self().lsa_ptr(r, offset)),
                                  epoch, value, timeout_ns, diag, op, self().rank, r, channel,
                                  self().mask_word(r));
  }
  /// Waits for the tagged word of `epoch` at local `offset`.
  __device__ __forceinline__ bool wait_tagged(std::size_t offset, uint32_t epoch, uint32_t& value,
                                              uint64_t timeout_ns, DeviceDiag* diag, OpId op,
                                              int peer, int channel) const {
    return dev::wait_tagged(reinterpret_cast<const uint64_t*>(self().local_ptr(offset)), epoch,
                            value, timeout_ns, diag, op, self().rank, peer, channel,
                            self().mask_word(peer));
  }
  /// Waits until the local flag at `offset` holds exactly `value`.
  __device__ __forceinline__ bool wait_flag_eq(std::size_t offset, uint32_t value,
                                               uint64_t timeout_ns, DeviceDiag* diag, OpId op,
                                               int peer, int channel) const {
    return dev::wait_eq(reinterpret_cast<const uint32_t*>(self().local_ptr(offset)), value,
                        timeout_ns, diag, op, self().rank, peer, channel, self().mask_word(peer));
  }
  /// Waits until the local flag at `offset` is >= `value` (wrap-safe).
  __device__ __forceinline__ bool wait_flag(std::size_t offset, uint32_t value, uint64_t timeout_ns,
                                            DeviceDiag* diag, OpId op, int peer,
                                            int channel) const {
    return wait_ge(reinterpret_cast<const uint32_t*>(self().local_ptr(offset)), value, timeout_ns,
                   diag, op, self().rank, peer, channel, self().mask_word(peer));
  }
  /// Warp-wide wait until the local flag at `offset` holds exactly `value`:
  /// lane 0 polls, the warp continues together (the warp barrier orders the
  /// other lanes' later loads after lane 0's acquire). Exact, not >=: a chunk
  /// flag holds the epoch of the last op that used its slot, and no sender
  /// can store a later epoch before this rank has left the op (each op starts
  /// with a barrier over the ranks), so only this op's store matches; a >=
  /// (even wrap-safe) would take a flag left unwritten for 2^31 ops.
  __device__ __forceinline__ bool wait_flag_warp(std::size_t offset, uint32_t value,
                                                 uint64_t timeout_ns, DeviceDiag* diag, OpId op,
                                                 int peer, int channel) const {
    int ok = 1;
    if ((threadIdx.x & 31) == 0)
      ok = wait_flag_eq(offset, value, timeout_ns, diag, op, peer, channel);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();
    return ok != 0;
  }

  /// Cooperative copy of `bytes` (a multiple of 16) from this rank's region at
  /// `src_off` to same-node peer `r`'s at `dst_off`.
  template <class Coop>
  __device__ __forceinline__ void lsa_copy(int r, std::size_t dst_off, std::size_t src_off,
                                           std::size_t bytes) const {
    auto* d = reinterpret_cast<int4*>(self().lsa_ptr(r, dst_off));
    auto* s = reinterpret_cast<const int4*>(self().local_ptr(src_off));
    for (std::size_t i = coop_index<Coop>(); i < bytes / 16; i += coop_size<Coop>())
      st_na(d + i, ld_l2(s + i));
  }
  /// Adds to same-node peer `r`'s word of signal `sig`, context `ctx`, after
  /// this thread's earlier stores (the group's, after its barrier).
  __device__ __forceinline__ void lsa_signal_add(int ctx, int r, int sig, uint64_t add) const {
    red_release_sys_add_u64(
        reinterpret_cast<uint64_t*>(self().lsa_ptr(r, self().signal_word(sig, ctx))), add);
  }
#endif  // __CUDACC__
};

/// What the transports with peers in other nodes share: the node's copies of
/// the region by local index (nullptr from lsa_ptr for other nodes' ranks).
struct NetworkTransportBase : TransportBase {
  char* base[kMaxRanksPerNode];  ///< the node's copies of the region, by local index
  char* local;                   ///< this rank's copy

#if defined(__CUDACC__)
  __device__ __forceinline__ char* lsa_ptr(int r, std::size_t offset) const {
    return same_node(r) ? base[r - node_first] + offset : nullptr;
  }
  __device__ __forceinline__ char* local_ptr(std::size_t offset) const {
    return local + offset;
  }
#endif
};

/// Every peer in the node: the NVLink backend (NCCL symmetric window
/// mappings) and in-process ranks (pointers into one GPU's memory). put is a
/// copy by stores, a signal an atomic add, wait a poll of local memory.
struct LsaTransport : TransportBase, LsaWords<LsaTransport> {
  static constexpr TransportCaps kCaps{/*network=*/false, /*peer_loads=*/true, kMaxContexts,
                                       kMaxRanksPerNode};
  char* base[kMaxRanksPerNode];  ///< each rank's copy of the region, as mapped here

#if defined(__CUDACC__)
  __device__ __forceinline__ char* lsa_ptr(int r, std::size_t offset) const {
    return base[r] + offset;
  }
  __device__ __forceinline__ char* local_ptr(std::size_t offset) const {
    return base[rank] + offset;
  }
  template <class Coop>
  __device__ __forceinline__ void put(int, int r, std::size_t dst_off, std::size_t src_off,
                                      std::size_t bytes) const {
    lsa_copy<Coop>(r, dst_off, src_off, bytes);
  }
  template <class Coop>
  __device__ __forceinline__ void signal_add(int ctx, int r, int sig, uint64_t add) const {
    coop_sync<Coop>();
    if (coop_leader<Coop>()) lsa_signal_add(ctx, r, sig, add);
  }
  template <class Coop>
  __device__ __forceinline__ void put_signal(int ctx, int r, std::size_t dst_off,
                                             std::size_t src_off, std::size_t bytes, int sig,
                                             uint64_t add) const {
    lsa_copy<Coop>(r, dst_off, src_off, bytes);
    signal_add<Coop>(ctx, r, sig, add);
  }
  __device__ __forceinline__ bool wait_signal(int sig, uint64_t value, OpId op, int peer) const {
    return wait_signal_words(*this, local_ptr(0), sig, value, op, peer);
  }
  __device__ __forceinline__ uint64_t read_signal(int sig, int) const {
    return read_signal_words(*this, local_ptr(0), sig);
  }
  __device__ __forceinline__ bool quiet(int) const {
    __threadfence_system();
    return true;
  }
#endif  // __CUDACC__
};

}  // namespace epx::dev
