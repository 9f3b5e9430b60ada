// epx-bench fifo: the CPU proxy's command path on this machine. Every rank is
// its own node (ranks_per_node = 1), so every peer is reached through posted
// commands, proxy threads and the engine (CUDA IPC copies on one host: the
// figures are this host's copy engine and CPU, not a NIC's).
//   rate:    rank 0's GPU posts N commands (signal-only, and 4 KiB puts) to
//            rank 1 on channel 0 from 32 threads, then waits for their
//            completion: commands per second of one proxy thread, post to done.
//   latency: ping-pong of a 1 KiB put with a signal between ranks 0 and 1;
//            one way = the median round trip / 2 (post, proxy, copy, signal,
//            the peer's poll).
// Set beside what a low-latency dispatch needs: at EP16 a rank sends about
// 1000 messages (128 tokens x ~8 remote ranks) in tens of microseconds.
// --engine / --provider pick the proxy backend's engine (libfabric: pinned
// host regions over loopback; that pairing not GPU-run yet); --host is the
// variant without a GPU (fifo_host.cpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <variant>
#include <vector>

#include "bench/common.hpp"
#include "common/check.hpp"
#include "transport/backend.hpp"

namespace epx::bench {
namespace {

constexpr std::size_t kSrc = 0, kDst = 1 << 20, kSignals = 2 << 20;

template <class T>
__global__ void post_many(T t, int peer, int n, std::size_t bytes, unsigned long long* ns) {
  const uint64_t t0 = dev::globaltimer_ns();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (bytes == 0)
      t.template signal_add<dev::Thread>(0, peer, 2 + t.rank, 1);  // not the ping-pong ids
    else
      t.template put<dev::Thread>(0, peer, kDst + (i % 64) * bytes, kSrc, bytes);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    t.quiet(0);
    *ns = dev::globaltimer_ns() - t0;
  }
}

/// Rank 0 (ping) and 1 (pong) bounce a put with a signal `iters` times.
template <class T>
__global__ void ping_pong(T t, int iters, std::size_t bytes, unsigned long long* ns) {
  if (threadIdx.x != 0) return;
  const int me = t.rank, peer = 1 - me;
  const uint64_t t0 = dev::globaltimer_ns();
  for (int i = 1; i <= iters; ++i) {
    if (me == 1 && !t.wait_signal(0, static_cast<uint64_t>(i), OpId::kNone, peer)) return;
    t.template put_signal<dev::Thread>(0, peer, kDst, kSrc, bytes, me, 1);
    if (me == 0 && !t.wait_signal(1, static_cast<uint64_t>(i), OpId::kNone, peer)) return;
  }
  *ns = dev::globaltimer_ns() - t0;
  t.quiet(0);
}

}  // namespace

void run_fifo(World& w, const Options& o, nlohmann::json& result) {
  if (w.num_ranks != 2) throw Error(ErrorCode::kInvalidArgument, "epx-bench fifo: needs 2 ranks");
  transport::BackendOptions bo;
  bo.num_contexts = 1;
  bo.proxy_engine = o.proxy_engine;  // --engine / --provider
  bo.fabric_provider = o.fabric_provider;
  auto backend = transport::make_backend("proxy", *w.comm, Topology{2, 1}, bo);
  auto region = backend->alloc(kSignals + 8u * kMaxContexts * 4);
  backend->start();
  auto t = backend->device(region);
  auto& base = dev::base_of(t);
  const auto& pt = std::get<dev::ProxyTransport>(t);  // the proxy's FIFO is what is measured
  base.signals = kSignals;
  base.num_contexts = 1;
  base.timeout_ns = 60'000'000'000ull;
  unsigned long long* d_ns = nullptr;
  EPX_CUDA_CHECK(cudaMalloc(&d_ns, sizeof(unsigned long long)));
  auto elapsed = [&] {
    unsigned long long v = 0;
    EPX_CUDA_CHECK(cudaMemcpy(&v, d_ns, sizeof(v), cudaMemcpyDeviceToHost));
    return static_cast<double>(v);
  };
  nlohmann::json rate = nlohmann::json::array();
  const int n = std::max(o.iters * 200, 1000);
  for (std::size_t bytes : {std::size_t{0}, std::size_t{4096}}) {
    double cmds_per_s = 0, ns = 0;
    if (w.rank == 0) {
      post_many<<<1, 32, 0, w.stream>>>(pt, 1, n / 10, bytes, d_ns);  // warm-up
      EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
      post_many<<<1, 32, 0, w.stream>>>(pt, 1, n, bytes, d_ns);
      EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
      backend->check_health();
      ns = elapsed();
      cmds_per_s = n / (ns * 1e-9);
    }
    backend->barrier();
    if (w.rank == 0) {
      rate.push_back(
          {{"bytes", bytes}, {"commands", n}, {"ns", ns}, {"commands_per_s", cmds_per_s}});
      std::printf("fifo rate, %s: %d commands in %.1f us: %.0f commands/s per proxy thread\n",
                  bytes ? "4 KiB puts" : "signals", n, ns * 1e-3, cmds_per_s);
    }
  }
  // Ping-pong latency (the signals start at 0: a fresh region).
  const int iters = std::max(o.iters * 20, 200);
  ping_pong<<<1, 32, 0, w.stream>>>(pt, iters, 1024, d_ns);
  EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  backend->check_health();
  const double one_way_us = elapsed() / iters / 2 * 1e-3;
  backend->barrier();
  if (w.rank == 0)
    std::printf(
        "fifo latency: 1 KiB put + signal, post to the peer seeing it: %.2f us one way "
        "(mean of %d round trips / 2)\n",
        one_way_us, iters);
  const double need = 1000.0 / 20e-6;  // EP16 LL dispatch: ~1000 messages in ~20 us
  const std::string engine = backend->engine_name();
  const bool ipc = engine == "cuda_ipc";
  if (w.rank == 0)
    std::printf(
        "an EP16 low-latency dispatch needs about %.0f messages/s per rank (1000 in "
        "20 us); these are %s on one host, not a NIC\n",
        need, ipc ? "CUDA IPC copies" : ("engine " + engine + " over loopback").c_str());
  result["backend"] = "proxy";  // this family's own backend, one rank per node
  result["ranks_per_node"] = 1;
  result["fifo"] = {{"rate", rate},
                    {"one_way_latency_us", one_way_us},
                    {"round_trips", iters},
                    {"ll_dispatch_ep16_needs_messages_per_s", need},
                    {"engine", ipc ? "cuda_ipc (cudaMemcpyAsync + cuStreamWriteValue64), one host"
                                   : engine + " (pinned host regions), one host"}};
  EPX_CUDA_CHECK(cudaFree(d_ns));
  backend->free(region);
}

}  // namespace epx::bench
