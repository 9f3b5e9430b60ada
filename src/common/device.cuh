// common/device.cuh - device primitives every layer above uses: timers,
// memory-model accesses, programmatic launch control, the diagnostic report,
// and the deadline-bounded spin that every wait goes through.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/diag.hpp"

/// Functions both host and device code call.
#if defined(__CUDACC__)
#define EPX_HD __host__ __device__
#else
#define EPX_HD
#endif

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

/// Adds `v` to a 64-bit word at system scope, ordered after this thread's
/// earlier accesses (and, after a barrier, the block's: release is cumulative).
__device__ __forceinline__ void red_release_sys_add_u64(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/// 64-bit load that bypasses the caches (pinned host memory a CPU thread writes).
__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  return *static_cast<const volatile uint64_t*>(p);
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

/// Block-wide, every thread once its work is done: counts the block in
/// `*done` (last_block_done); true in every thread of the block that counted
/// last. System-scope fences around the count carry every block's earlier
/// writes and posts before what the last block does next.
__device__ __forceinline__ bool block_counted_last(uint32_t* done) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();  // release: this block's writes
    is_last = last_block_done(done) ? 1 : 0;
    if (is_last) fence_acq_rel_sys();  // acquire: every block's
  }
  __syncthreads();
  return is_last != 0;
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
/// kOwnDeadline: give up only at this wait's own deadline, not when another
/// thread reported (a proxy post that already took a ring slot must fill it,
/// or the channel stalls for good; a quiet must not let a send area be
/// rewritten early).
/// A network wait lasts microseconds at least: after its first 64 polls a
/// waiting thread sleeps 128 ns between them (`polls` counts them). A GPU full
/// of threads spinning on their words delayed the proxy's copies (back-to-back
/// pairs over the proxy: 15.0 ms spinning, 8.7 ms with every wait sleeping
/// 200 ns, 4x H200).
__device__ __forceinline__ void network_poll_pause(uint32_t& polls) {
  if (++polls > 64) __nanosleep(128);
}

/// EPX_SPIN_SLEEP_NS (build-time, default 0: none): a waiting thread sleeps
/// this long between polls after its first 64, to measure what spinning
/// threads cost the rest of the GPU (its copies, incoming peer writes).
#ifndef EPX_SPIN_SLEEP_NS
#define EPX_SPIN_SLEEP_NS 0
#endif
template <bool kOwnDeadline = false, class Load, class Done, class Seen>
__device__ __forceinline__ bool spin_until(Load load, Done done, Seen seen, uint32_t expected,
                                           uint64_t timeout_ns, DeviceDiag* diag, OpId op, int rank,
                                           int peer, int channel, int* peer_masked = nullptr) {
  auto v = load();
  if (done(v)) return true;
  if (peer_masked != nullptr && mask_set(peer_masked)) return false;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (true) {
    if constexpr (EPX_SPIN_SLEEP_NS > 0)
      if (spins >= 64) __nanosleep(EPX_SPIN_SLEEP_NS);
    v = load();
    if (done(v)) return true;
    if ((++spins & 1023u) == 0) {
      if (peer_masked != nullptr && mask_set(peer_masked)) return false;
      if (!kOwnDeadline && diag) {
        // A timeout or a config mismatch anywhere in this launch ends every wait.
        const uint32_t code = *static_cast<volatile uint32_t*>(&diag->code);
        if (code == static_cast<uint32_t>(DiagCode::kTimeout) ||
            code == static_cast<uint32_t>(DiagCode::kBadConfig) ||
            code == static_cast<uint32_t>(DiagCode::kProxyStopped))
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
}  // namespace epx::dev
