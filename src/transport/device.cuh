// transport/device.cuh - what kernels see of a transport.
//
// Kernels are templates over a transport type with this surface:
//   peer_ptr(rank, offset)       -> char* (non-null when load/store reachable)
//   put(rank, offset, src, bytes, lane, width)  cooperative copy into a peer
//   signal(rank, offset, value)  release-store a 32-bit flag in a peer
//   wait(offset, value, ...)     acquire-spin on a local flag until >= value (with deadline)
//   wait_eq(offset, value, ...)  the same until == value (words that only hold epochs)
//   put_tagged / wait_tagged     a 32-bit value with its epoch in one 64-bit word
//   flush()                      make prior puts visible before a signal
//   masked(rank) / live_ranks()  shrink mode: peers this rank leaves out
// NvlinkTransport is the one whose put is a plain store.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/diag.hpp"
#include "common/plan.hpp"

namespace epx::dev {

#if defined(__CUDACC__)
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/// Release/acquire fence at system scope (lighter than __threadfence_system's
/// fence.sc); with a barrier before it, it covers the whole block's stores.
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

/// 64-bit relaxed system-scope accesses: single-copy atomic, so a value and
/// the epoch packed beside it in one word arrive together (no fence, no flag).
__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/// 64-bit acquire/release system-scope accesses: a tagged word that also
/// publishes data stored before it (the pull dispatch's batch words).
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/// Programmatic dependent launch: let the next kernel in the stream start its
/// blocks now / wait until the previous kernel has finished and its writes are
/// visible. Both are no-ops when the launch was not a dependent one.
__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void wait_prerequisite_grid() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

/// Read-only 16-byte load that skips L1 (memory no one writes during the kernel).
__device__ __forceinline__ int4 ld_nc(const int4* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

/// 16-byte load coherent at L2 (data peers write during the kernel), no L1
/// allocation. Volatile: never hoisted above the flag wait that precedes it.
__device__ __forceinline__ int4 ld_l2(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void st_na(int4* p, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

/// Records the first diagnostic of a launch (later ones are dropped).
__device__ __forceinline__ void report(DeviceDiag* diag, DiagCode code, OpId op, int rank, int peer,
                                       int channel, uint32_t expected, uint32_t seen,
                                       int token = -1) {
  if (diag == nullptr) return;
  if (atomicCAS(&diag->code, 0u, static_cast<uint32_t>(code)) == 0u) {
    diag->op = static_cast<uint32_t>(op);
    diag->rank = rank;
    diag->peer = peer;
    diag->channel = channel;
    diag->expected = expected;
    diag->seen = seen;
    diag->token = token;
    __threadfence_system();
  }
}

/// Shrink mode: whether a word of a peer mask is set (volatile: the kernels'
/// own deadlines and the host's mask calls change it while they run).
__device__ __forceinline__ bool mask_set(const int* word) {
  return *static_cast<const volatile int*>(word) != 0;
}

/// Thread 0 of each block of a launch, once, as the block finishes: true for
/// the last block to count in, which also resets the count for the next launch.
__device__ __forceinline__ bool last_block_done(uint32_t* done) {
  if (atomicAdd(done, 1u) != gridDim.x - 1) return false;
  *done = 0u;
  return true;
}

/// Spins until `done(v)` holds for v = load(); false (after reporting
/// `seen(v)` against `expected`) when the deadline passes or another thread
/// already reported a timeout or a peer's differing config (kBadConfig: its
/// senders stored nothing), so every waiter gives up instead of hanging.
/// Other reports (a truncated num_worst_tokens dispatch, a bad expert id)
/// leave the protocol intact: waits go on, and the host raises the report
/// at the next call.
/// Shrink mode (`peer_masked`: the waited-for peer's word of this rank's
/// mask): false, without a report, when the peer is masked (checked when the
/// first load does not satisfy `done`, then every 1024 polls); at the deadline
/// the peer is masked (DeepEP's enable_shrink), not reported, so this op and
/// the later ones go on without it.
template <class Load, class Done, class Seen>
__device__ __forceinline__ bool spin_until(Load load, Done done, Seen seen, uint32_t expected,
                                           uint64_t timeout_ns, DeviceDiag* diag, OpId op, int rank,
                                           int peer, int channel, int* peer_masked = nullptr) {
  auto v = load();
  if (done(v)) return true;
  if (peer_masked != nullptr && mask_set(peer_masked)) return false;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (true) {
    v = load();
    if (done(v)) return true;
    if ((++spins & 1023u) == 0) {
      if (peer_masked != nullptr && mask_set(peer_masked)) return false;
      if (diag) {
        // A timeout or a config mismatch anywhere in this launch ends every wait.
        const uint32_t code = *static_cast<volatile uint32_t*>(&diag->code);
        if (code == static_cast<uint32_t>(DiagCode::kTimeout) ||
            code == static_cast<uint32_t>(DiagCode::kBadConfig))
          return false;
      }
      if (globaltimer_ns() - start > timeout_ns) {
        if (peer_masked != nullptr)
          atomicExch(peer_masked, 1);
        else
          report(diag, DiagCode::kTimeout, op, rank, peer, channel, expected, seen(v));
        return false;
      }
    }
  }
}

/// Spins until *flag >= value (wrap-safe compare of epochs).
__device__ __forceinline__ bool wait_ge(const uint32_t* flag, uint32_t value, uint64_t timeout_ns,
                                        DeviceDiag* diag, OpId op, int rank, int peer, int channel,
                                        int* peer_masked = nullptr) {
  return spin_until([&] { return ld_acquire_sys(flag); },
                    [&](uint32_t v) { return static_cast<int32_t>(v - value) >= 0; },
                    [](uint32_t v) { return v; }, value, timeout_ns, diag, op, rank, peer, channel,
                    peer_masked);
}

/// Spins until *flag == value exactly: for words that only ever hold epochs
/// and are rewritten only when their slot is used (a wrap-safe >= would take
/// a word left 2^31 ops ago).
__device__ __forceinline__ bool wait_eq(const uint32_t* flag, uint32_t value, uint64_t timeout_ns,
                                        DeviceDiag* diag, OpId op, int rank, int peer, int channel,
                                        int* peer_masked = nullptr) {
  return spin_until([&] { return ld_acquire_sys(flag); }, [&](uint32_t v) { return v == value; },
                    [](uint32_t v) { return v; }, value, timeout_ns, diag, op, rank, peer, channel,
                    peer_masked);
}

/// Spins until the high half (an epoch) of the tagged word *p equals `epoch`
/// and returns its low half in `value`. Exact match, as wait_eq. kAcquire:
/// the word also publishes data stored before it.
template <bool kAcquire = false>
__device__ __forceinline__ bool wait_tagged(const uint64_t* p, uint32_t epoch, uint32_t& value,
                                            uint64_t timeout_ns, DeviceDiag* diag, OpId op,
                                            int rank, int peer, int channel,
                                            int* peer_masked = nullptr) {
  uint64_t last = 0;
  const bool ok =
      spin_until([&] { return last = kAcquire ? ld_acquire_sys_u64(p) : ld_relaxed_sys_u64(p); },
                 [&](uint64_t w) { return static_cast<uint32_t>(w >> 32) == epoch; },
                 [](uint64_t w) { return static_cast<uint32_t>(w >> 32); }, epoch, timeout_ns, diag,
                 op, rank, peer, channel, peer_masked);
  value = static_cast<uint32_t>(last);
  return ok;
}

#endif  // __CUDACC__

/// Load/store transport over NVLink (NCCL symmetric window mappings). Host
/// code fills the fields; the methods exist in device code only.
struct NvlinkTransport {
  char* base[plan::kMaxRanks];  ///< each rank's copy of the region, as mapped here
  int rank;
  int num_ranks;
  /// Shrink mode: this rank's mask of peers, int32 [kMaxRanks] in its own
  /// memory, nonzero = left out (no store to it, no wait for it; a wait that
  /// passes its deadline masks the peer). nullptr: every peer takes part.
  int* peer_mask;
#if defined(__CUDACC__)

  /// Whether peer `r` is left out now (shrink mode).
  __device__ __forceinline__ bool masked(int r) const {
    return peer_mask != nullptr && mask_set(peer_mask + r);
  }
  /// Bit r set for every rank r that takes part (all ranks without shrink mode).
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

  __device__ __forceinline__ char* peer_ptr(int r, std::size_t offset) const {
    return base[r] + offset;
  }
  __device__ __forceinline__ char* local_ptr(std::size_t offset) const {
    return base[rank] + offset;
  }

  /// Cooperative copy of `bytes` (multiple of 16) from local `src` to peer
  /// `r` at `offset`; `lane` of `width` threads take part.
  __device__ __forceinline__ void put(int r, std::size_t offset, const void* src, std::size_t bytes,
                                      int lane, int width) const {
    auto* d = reinterpret_cast<int4*>(peer_ptr(r, offset));
    auto* s = reinterpret_cast<const int4*>(src);
    for (std::size_t i = lane; i < bytes / 16; i += width) st_na(d + i, ld_nc(s + i));
  }
  __device__ __forceinline__ void flush() const {
    __threadfence_system();
  }
  __device__ __forceinline__ void signal(int r, std::size_t offset, uint32_t value) const {
    st_release_sys(reinterpret_cast<uint32_t*>(peer_ptr(r, offset)), value);
  }
  /// 32-bit value and epoch as one tagged word at peer `r` (8-byte aligned
  /// `offset`): the reader needs no flag and the writer no fence.
  __device__ __forceinline__ void put_tagged(int r, std::size_t offset, uint32_t value,
                                             uint32_t epoch) const {
    st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(peer_ptr(r, offset)),
                       (static_cast<uint64_t>(epoch) << 32) | value);
  }
  /// As put_tagged, with release semantics: the word also publishes the
  /// stores before it (a warp's, after a warp barrier).
  __device__ __forceinline__ void put_tagged_release(int r, std::size_t offset, uint32_t value,
                                                     uint32_t epoch) const {
    st_release_sys_u64(reinterpret_cast<uint64_t*>(peer_ptr(r, offset)),
                       (static_cast<uint64_t>(epoch) << 32) | value);
  }
  /// Waits for the tagged word of `epoch` at peer `r`'s `offset`, with
  /// acquire semantics: a pull of what `r` published with put_tagged_release.
  __device__ __forceinline__ bool wait_tagged_at(int r, std::size_t offset, uint32_t epoch,
                                                 uint32_t& value, uint64_t timeout_ns,
                                                 DeviceDiag* diag, OpId op, int channel) const {
    return dev::wait_tagged<true>(reinterpret_cast<const uint64_t*>(peer_ptr(r, offset)), epoch,
                                  value, timeout_ns, diag, op, rank, r, channel, mask_word(r));
  }
  /// Waits for the tagged word of `epoch` at local `offset`.
  __device__ __forceinline__ bool wait_tagged(std::size_t offset, uint32_t epoch, uint32_t& value,
                                              uint64_t timeout_ns, DeviceDiag* diag, OpId op,
                                              int peer, int channel) const {
    return dev::wait_tagged(reinterpret_cast<const uint64_t*>(local_ptr(offset)), epoch, value,
                            timeout_ns, diag, op, rank, peer, channel, mask_word(peer));
  }
  /// Waits until the local flag at `offset` holds exactly `value`.
  __device__ __forceinline__ bool wait_eq(std::size_t offset, uint32_t value, uint64_t timeout_ns,
                                          DeviceDiag* diag, OpId op, int peer, int channel) const {
    return dev::wait_eq(reinterpret_cast<const uint32_t*>(local_ptr(offset)), value, timeout_ns,
                        diag, op, rank, peer, channel, mask_word(peer));
  }
  __device__ __forceinline__ bool wait(std::size_t offset, uint32_t value, uint64_t timeout_ns,
                                       DeviceDiag* diag, OpId op, int peer, int channel) const {
    return wait_ge(reinterpret_cast<const uint32_t*>(local_ptr(offset)), value, timeout_ns, diag,
                   op, rank, peer, channel, mask_word(peer));
  }
  /// Warp-wide wait until the local flag at `offset` holds exactly `value`:
  /// lane 0 polls, the warp continues together (the warp barrier orders the
  /// other lanes' later loads after lane 0's acquire). Exact, not >=: a chunk
  /// flag holds the epoch of the last op that used its slot, and no sender
  /// can store a later epoch before this rank has left the op (each op starts
  /// with a barrier over the ranks), so only this op's store matches; a >=
  /// (even wrap-safe) would take a flag left unwritten for 2^31 ops.
  __device__ __forceinline__ bool wait_warp(std::size_t offset, uint32_t value, uint64_t timeout_ns,
                                            DeviceDiag* diag, OpId op, int peer,
                                            int channel) const {
    int ok = 1;
    if ((threadIdx.x & 31) == 0) ok = wait_eq(offset, value, timeout_ns, diag, op, peer, channel);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();
    return ok != 0;
  }
#endif  // __CUDACC__
};

}  // namespace epx::dev
