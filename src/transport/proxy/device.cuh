// transport/proxy/device.cuh - ProxyTransport: the device half of the CPU-proxy
// backend. Peers in this rank's node are reached by load/store (LsaWords);
// the others through commands posted into per-channel rings that proxy
// threads carry out (command.hpp describes the protocol). A context is a
// channel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/device.cuh"
#include "transport/concept.cuh"
#include "transport/lsa.cuh"
#include "transport/proxy/command.hpp"

namespace epx::dev {

struct ProxyTransport : NetworkTransportBase, LsaWords<ProxyTransport> {
  static constexpr TransportCaps kCaps{/*network=*/true, /*peer_loads=*/true, kMaxContexts,
                                       kMaxRanks};
  int region;                          ///< the engine's id of this region
  const proxy::ChannelView* channels;  ///< [num_contexts], device memory

#if defined(__CUDACC__)

  __device__ static bool stopped(const proxy::ChannelView& ch) {
    return *static_cast<volatile uint32_t*>(&ch.host->stopped) != 0u;
  }

  /// Waits until host counter `counter` of channel `ch` (mirrored in device
  /// memory at `seen`) reaches `need`; the value read (~0: the proxy thread
  /// stopped). The waiters poll the mirror and take turns reading the host
  /// word, about one host read per round of all of them (command.hpp says
  /// why). A stop is checked at those turns too.
  __device__ static unsigned long long wait_counter(const proxy::ChannelView& ch,
                                                    const uint64_t* counter,
                                                    unsigned long long* seen,
                                                    unsigned long long need, uint64_t timeout_ns,
                                                    DeviceDiag* diag, OpId op, int rank, int peer,
                                                    int ctx, uint32_t expected) {
    unsigned long long v = *static_cast<volatile unsigned long long*>(seen);
    if (v >= need) return v;
    atomicAdd(&ch.dev->waiters, 1u);
    uint32_t turn = 0, share = 1;
    uint32_t polls = 0;
    spin_until<true>(
        [&] {
          network_poll_pause(polls);
          v = *static_cast<volatile unsigned long long*>(seen);
          if (v >= need) return v;
          if ((turn & 31u) == 0)  // how many take turns now
            share = max(1u, *static_cast<volatile unsigned int*>(&ch.dev->waiters));
          if (turn++ % share != 0) return v;
          if (stopped(ch)) return v = ~0ull;
          const unsigned long long h = ld_volatile_u64(counter);
          if (h > v) {
            atomicMax(seen, h);
            v = h;
          }
          return v;
        },
        [&](unsigned long long x) { return x >= need; },
        [&](unsigned long long x) { return static_cast<uint32_t>(x); }, expected, timeout_ns, diag,
        op, rank, peer, ctx);
    atomicSub(&ch.dev->waiters, 1u);
    return v;
  }

  /// Posts one command into channel `ctx` (one thread). False, after a
  /// report, when no slot freed up before the deadline or the channel's
  /// proxy thread stopped.
  __device__ bool post(int ctx, proxy::Op op, int peer, uint64_t dst_off, uint64_t src_off,
                       uint64_t bytes, uint64_t sig_off, uint64_t add) const {
    const proxy::ChannelView ch = channels[ctx];
    const unsigned long long slot = atomicAdd(&ch.dev->reserved, 1ull);
    if (slot >= *static_cast<volatile unsigned long long*>(&ch.dev->consumed_seen) + ch.capacity) {
      // A free slot: consumed > slot - capacity.
      const unsigned long long v = wait_counter(
          ch, &ch.host->consumed, &ch.dev->consumed_seen, slot - ch.capacity + 1, timeout_ns, diag,
          OpId::kProxyPost, rank, peer, ctx, static_cast<uint32_t>(slot));
      if (v == ~0ull || v + ch.capacity <= slot) {  // stopped, or the deadline passed
        report(diag, DiagCode::kProxyStopped, OpId::kProxyPost, rank, peer, ctx,
               static_cast<uint32_t>(slot),
               static_cast<uint32_t>(ld_volatile_u64(&ch.host->consumed)));
        return false;
      }
    }
    proxy::Command* c = ch.ring + (slot & (ch.capacity - 1));
    volatile uint64_t* w = reinterpret_cast<volatile uint64_t*>(c);
    w[1] = dst_off;
    w[2] = src_off;
    w[3] = bytes;
    w[4] = sig_off;
    w[5] = add;
    w[6] = static_cast<uint64_t>(static_cast<uint32_t>(peer));
    st_release_sys_u64(&c->header, proxy::make_header(slot + 1, op, region));
    return true;
  }

  template <class Coop>
  __device__ __forceinline__ void put(int ctx, int r, std::size_t dst_off, std::size_t src_off,
                                      std::size_t bytes) const {
    if (same_node(r)) {
      lsa_copy<Coop>(r, dst_off, src_off, bytes);
      return;
    }
    coop_sync<Coop>();  // the group's writes of the send area before the post's release
    if (coop_leader<Coop>()) post(ctx, proxy::Op::kPut, r, dst_off, src_off, bytes, 0, 0);
    coop_sync<Coop>();
  }
  template <class Coop>
  __device__ __forceinline__ void signal_add(int ctx, int r, int sig, uint64_t add) const {
    coop_sync<Coop>();
    if (!coop_leader<Coop>()) return;
    if (same_node(r))
      lsa_signal_add(ctx, r, sig, add);
    else
      post(ctx, proxy::Op::kSignal, r, 0, 0, 0, signal_word(sig, ctx), add);
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
    coop_sync<Coop>();
    if (coop_leader<Coop>())
      post(ctx, proxy::Op::kPutSignal, r, dst_off, src_off, bytes, signal_word(sig, ctx), add);
    coop_sync<Coop>();
  }
  __device__ __forceinline__ bool wait_signal(int sig, uint64_t value, OpId op, int peer) const {
    return wait_signal_words(*this, local, sig, value, op, peer);
  }
  __device__ __forceinline__ uint64_t read_signal(int sig, int) const {
    return read_signal_words(*this, local, sig);
  }
  /// Waits until every command of channel `ctx` reserved so far is complete.
  __device__ bool quiet(int ctx) const {
    const proxy::ChannelView ch = channels[ctx];
    const unsigned long long target = *static_cast<volatile unsigned long long*>(&ch.dev->reserved);
    const unsigned long long v =
        wait_counter(ch, &ch.host->completed, &ch.dev->completed_seen, target, timeout_ns, diag,
                     OpId::kProxyQuiet, rank, -1, ctx, static_cast<uint32_t>(target));
    if (v == ~0ull && ld_volatile_u64(&ch.host->completed) < target) {  // stopped first
      report(diag, DiagCode::kProxyStopped, OpId::kProxyQuiet, rank, -1, ctx,
             static_cast<uint32_t>(target),
             static_cast<uint32_t>(ld_volatile_u64(&ch.host->completed)));
      return false;
    }
    return v >= target;
  }
#endif  // __CUDACC__
};

}  // namespace epx::dev
