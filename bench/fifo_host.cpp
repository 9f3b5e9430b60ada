// epx-bench fifo --host: the CPU proxy's command path with the libfabric
// engine between 2 forked processes of this host, on host memory, no GPU.
// Each process has its own engine (--provider) and Proxy (ProxyOptions::
// device = -1); a host thread posts the commands with post_from_host, as a
// GPU thread posts them into the same rings.
//   rate:        rank 0 posts N commands (signal-only, then 4 KiB puts) to
//                rank 1 on channel 0 and waits until the proxy reports them
//                all complete: commands per second of one proxy thread, from
//                the first post to the last completion.
//   completion:  rank 0 posts one 1 KiB put+signal and waits until the
//                proxy's `completed` counter passes it (the engine's local
//                completion: delivery complete where the provider has it):
//                post-to-completion latency, median and p99.
//   one way:     ping-pong of a 1 KiB put+signal (the peer polls its signal
//                word): the mean round trip / 2, as the GPU fifo reports it,
//                and the median / 2.
// Each rank runs a poster, a proxy thread and the engine's progress thread:
// on a host with fewer cores than that, the figures measure the scheduler as
// much as the engine.
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "bench/common.hpp"
#include "epx/error.hpp"
#include "transport/proxy/libfabric_engine.hpp"
#include "transport/proxy/proxy.hpp"

namespace epx::bench {
namespace {

using Clock = std::chrono::steady_clock;
double since_s(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

constexpr uint64_t kSrc = 0, kDst = 1 << 20, kSignals = 2 << 20;
constexpr uint64_t kRegionBytes = kSignals + 4096;
// Signal words (each written by one rank): rank 0 -> rank 1's region.
constexpr uint64_t kRateSig = kSignals, kLatSig = kSignals + 8, kPingSig = kSignals + 16;
// rank 1 -> rank 0's region.
constexpr uint64_t kPongSig = kSignals + 24;
constexpr double kWaitS = 30;  ///< every wait of the bench gives up after this

/// Shared memory of the two ranks (mapped before the fork): the exchange and
/// rank 0's results.
struct HostShared {
  static constexpr std::size_t kSlot = 80 * 1024;  // one allgather contribution
  std::atomic<uint64_t> arrived[2];
  uint8_t data[2][kSlot];
  // Results (rank 0 writes them).
  double rate_ns[2];
  uint64_t rate_commands;
  double completion_median_us, completion_p99_us, completion_mean_us;
  int completion_samples;
  double one_way_mean_us, one_way_median_us;
  int round_trips;
  uint64_t signals_seen;  ///< rank 1: the rate signal word at the end
  int delivery_complete;
  char provider[64];
  char error[2][2048];
};

class ShmExchange final : public proxy::Exchange {
 public:
  ShmExchange(HostShared* s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int num_ranks() const override { return 2; }
  std::vector<uint8_t> allgather(const void* data, std::size_t bytes) override {
    if (bytes > HostShared::kSlot)
      throw Error(ErrorCode::kInternal, "epx-bench fifo --host: allgather of " +
                                            std::to_string(bytes) + " bytes is too large");
    std::memcpy(s_->data[rank_], data, bytes);
    barrier();
    std::vector<uint8_t> out(bytes * 2);
    for (int r = 0; r < 2; ++r) std::memcpy(out.data() + bytes * r, s_->data[r], bytes);
    barrier();  // nobody writes its slot again before both read
    return out;
  }
  void barrier() override {
    const uint64_t g = ++gen_;
    s_->arrived[rank_].store(g, std::memory_order_release);
    const auto t0 = Clock::now();
    while (s_->arrived[1 - rank_].load(std::memory_order_acquire) < g) {
      if (since_s(t0) > kWaitS)
        throw Error(ErrorCode::kTimeout, "epx-bench fifo --host: rank " + std::to_string(rank_) +
                                             " waited " + std::to_string(kWaitS) + " s for rank " +
                                             std::to_string(1 - rank_) + " at barrier " +
                                             std::to_string(g));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  HostShared* s_;
  int rank_;
  uint64_t gen_ = 0;
};

uint64_t load(const uint64_t& x) {
  return std::atomic_ref<const uint64_t>(x).load(std::memory_order_acquire);
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

void host_rank(int me, HostShared* sh, const Options& o, const std::string& provider) {
  ShmExchange ex(sh, me);
  proxy::LibfabricOptions lo;
  lo.provider = provider;
  lo.timeout_s = kWaitS;
  auto engine = proxy::make_libfabric_engine(
      std::shared_ptr<proxy::Exchange>(&ex, [](proxy::Exchange*) {}), 1, lo);
  auto* mem = static_cast<uint8_t*>(std::aligned_alloc(4096, kRegionBytes));
  if (!mem) throw Error(ErrorCode::kInternal, "epx-bench fifo --host: out of memory");
  std::unique_ptr<uint8_t, void (*)(void*)> hold(mem, std::free);
  std::memset(mem, 0, kRegionBytes);
  for (uint64_t i = 0; i < kDst; ++i) mem[i] = static_cast<uint8_t>(i * 131 + me);
  engine->register_region(0, mem, kRegionBytes);
  proxy::ProxyOptions po;
  po.num_channels = 1;
  po.capacity = 4096;
  po.device = -1;
  auto px = std::make_unique<proxy::Proxy>(*engine, po);
  const proxy::ChannelView v = px->view(0);
  const int peer = 1 - me;
  uint64_t posted = 0;  // commands this rank posted on channel 0
  auto post = [&](proxy::Op op, uint64_t dst, uint64_t bytes, uint64_t sig) {
    proxy::Command cmd{};
    cmd.peer = static_cast<uint32_t>(peer);
    cmd.dst_off = dst;
    cmd.src_off = kSrc;
    cmd.bytes = bytes;
    cmd.sig_off = sig;
    cmd.add = 1;
    proxy::post_from_host(v, cmd, op, 0, kWaitS, 0);
    ++posted;
  };
  // Until the proxy reports every command posted so far complete.
  auto wait_completed = [&] {
    const auto t0 = Clock::now();
    while (load(v.host->completed) < posted) {
      if (load(v.host->stopped)) px->check();
      if (since_s(t0) > kWaitS)
        throw Error(ErrorCode::kTimeout,
                    "epx-bench fifo --host: rank " + std::to_string(me) + ": " +
                        std::to_string(load(v.host->completed)) + " of " + std::to_string(posted) +
                        " commands complete after " + std::to_string(kWaitS) + " s");
      std::this_thread::yield();  // the proxy and progress threads may share this core
    }
  };
  // Until the signal word at `off` of this rank's region reaches `want`.
  auto wait_word = [&](uint64_t off, uint64_t want, const char* what) {
    const auto& w = *reinterpret_cast<const uint64_t*>(mem + off);
    const auto t0 = Clock::now();
    while (load(w) < want) {
      if (load(v.host->stopped)) px->check();
      if (since_s(t0) > kWaitS)
        throw Error(ErrorCode::kTimeout,
                    "epx-bench fifo --host: rank " + std::to_string(me) + ": " + what +
                        ": signal word reads " + std::to_string(load(w)) + ", want " +
                        std::to_string(want) + " after " + std::to_string(kWaitS) + " s");
      std::this_thread::yield();
    }
  };

  // Rate.
  const int n = std::max(o.iters * 200, 1000);
  for (int k = 0; k < 2; ++k) {
    const uint64_t bytes = k == 0 ? 0 : 4096;
    ex.barrier();
    if (me == 0) {
      for (int pass = 0; pass < 2; ++pass) {  // a warm-up of n / 10, then n timed
        const int count = pass == 0 ? n / 10 : n;
        const auto t0 = Clock::now();
        for (int i = 0; i < count; ++i) {
          if (bytes == 0)
            post(proxy::Op::kSignal, 0, 0, kRateSig);
          else
            post(proxy::Op::kPut, kDst + (i % 64) * bytes, bytes, 0);
        }
        wait_completed();
        if (pass == 1) sh->rate_ns[k] = since_s(t0) * 1e9;
      }
    }
    ex.barrier();
  }
  sh->rate_commands = static_cast<uint64_t>(n);
  if (me == 1) {
    // Every signal of the rate runs was applied here (once each).
    const uint64_t want = static_cast<uint64_t>(n / 10 + n);
    wait_word(kRateSig, want, "the rate runs' signals");
    sh->signals_seen = load(*reinterpret_cast<const uint64_t*>(mem + kRateSig));
    if (sh->signals_seen != want)
      throw Error(ErrorCode::kInternal, "epx-bench fifo --host: rank 1 saw " +
                                            std::to_string(sh->signals_seen) + " signals, " +
                                            std::to_string(want) + " were sent");
  }
  ex.barrier();

  // Post-to-completion latency of one 1 KiB put+signal.
  const int iters = std::max(o.iters * 20, 200);
  if (me == 0) {
    std::vector<double> us;
    us.reserve(static_cast<std::size_t>(iters));
    for (int i = 0; i < iters + iters / 10; ++i) {
      const auto t0 = Clock::now();
      post(proxy::Op::kPutSignal, kDst, 1024, kLatSig);
      wait_completed();
      if (i >= iters / 10) us.push_back(since_s(t0) * 1e6);
    }
    double sum = 0;
    for (double x : us) sum += x;
    sh->completion_mean_us = sum / static_cast<double>(us.size());
    sh->completion_median_us = percentile(us, 0.5);
    sh->completion_p99_us = percentile(us, 0.99);
    sh->completion_samples = static_cast<int>(us.size());
  }
  ex.barrier();

  // Ping-pong: rank 0 pings into rank 1's kPingSig, rank 1 answers into
  // rank 0's kPongSig.
  std::vector<double> rtt;
  rtt.reserve(static_cast<std::size_t>(iters));
  const auto t_pp = Clock::now();
  for (int i = 1; i <= iters; ++i) {
    if (me == 0) {
      const auto t0 = Clock::now();
      post(proxy::Op::kPutSignal, kDst + 4096, 1024, kPingSig);
      wait_word(kPongSig, static_cast<uint64_t>(i), "ping-pong (waiting for the pong)");
      rtt.push_back(since_s(t0) * 1e6);
    } else {
      wait_word(kPingSig, static_cast<uint64_t>(i), "ping-pong (waiting for the ping)");
      post(proxy::Op::kPutSignal, kDst + 4096, 1024, kPongSig);
    }
  }
  if (me == 0) {
    sh->one_way_mean_us = since_s(t_pp) * 1e6 / iters / 2;
    sh->one_way_median_us = percentile(rtt, 0.5) / 2;
    sh->round_trips = iters;
    const proxy::LibfabricStats st = proxy::libfabric_stats(*engine);
    std::snprintf(sh->provider, sizeof sh->provider, "%s", st.provider.c_str());
    sh->delivery_complete = st.delivery_complete ? 1 : 0;
  }
  px->drain(kWaitS);
  px->check();
  ex.barrier();  // both ranks are done before any endpoint closes
  px.reset();
  engine->deregister_region(0);
}

}  // namespace

int run_fifo_host(const Options& o) {
  if (o.proxy_engine != "libfabric") {
    std::fprintf(stderr,
                 "epx-bench fifo --host: --engine must be libfabric (the only engine that "
                 "reaches another process on host memory), got '%s'\n",
                 o.proxy_engine.c_str());
    return 2;
  }
  std::string provider = o.fabric_provider.empty() ? "tcp" : o.fabric_provider;
  if (provider == "tcp") provider = "tcp;ofi_rxm";
  if (provider.rfind("tcp", 0) == 0) setenv("FI_TCP_IFACE", "lo", 0);  // both ranks are here
  void* m =
      mmap(nullptr, sizeof(HostShared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    std::fprintf(stderr, "epx-bench fifo --host: mmap failed\n");
    return 1;
  }
  auto* sh = new (m) HostShared();
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pids[2] = {-1, -1};
  for (int r = 0; r < 2; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) {
      int rc = 0;
      try {
        host_rank(r, sh, o, provider);
      } catch (const std::exception& e) {
        std::snprintf(sh->error[r], sizeof sh->error[r], "%s", e.what());
        rc = 1;
      }
      _exit(rc);
    }
  }
  // Both ranks end within every wait's deadline and some; a rank still
  // running past it has hung and is killed.
  std::string failed;
  const auto t0 = Clock::now();
  const double limit = 4 * kWaitS + 60;
  for (int r = 0; r < 2; ++r) {
    int st = 0;
    pid_t got = 0;
    while ((got = waitpid(pids[r], &st, WNOHANG)) == 0 && since_s(t0) < limit)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (got == 0) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], &st, 0);
      failed += "rank " + std::to_string(r) + " still running after " + std::to_string(limit) +
                " s (killed); ";
    } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      failed += "rank " + std::to_string(r) + ": " +
                (sh->error[r][0] ? sh->error[r] : "exited with status " + std::to_string(st)) +
                "; ";
    }
  }
  if (!failed.empty()) {
    std::fprintf(stderr, "epx-bench fifo --host: %s\n", failed.c_str());
    munmap(m, sizeof(HostShared));
    return 1;
  }
  const uint64_t n = sh->rate_commands;
  nlohmann::json rate = nlohmann::json::array();
  for (int k = 0; k < 2; ++k) {
    const double ns = sh->rate_ns[k];
    const double per_s = static_cast<double>(n) / (ns * 1e-9);
    rate.push_back(
        {{"bytes", k ? 4096 : 0}, {"commands", n}, {"ns", ns}, {"commands_per_s", per_s}});
    std::printf(
        "fifo --host rate, %s: %llu commands in %.1f us: %.0f commands/s per proxy thread\n",
        k ? "4 KiB puts" : "signals", static_cast<unsigned long long>(n), ns * 1e-3, per_s);
  }
  std::printf(
      "fifo --host post to completion: 1 KiB put + signal: median %.2f us, p99 %.2f us, mean "
      "%.2f us (%d samples)\n",
      sh->completion_median_us, sh->completion_p99_us, sh->completion_mean_us,
      sh->completion_samples);
  std::printf(
      "fifo --host latency: 1 KiB put + signal, post to the peer seeing it: %.2f us one way "
      "(mean of %d round trips / 2; median %.2f us)\n",
      sh->one_way_mean_us, sh->round_trips, sh->one_way_median_us);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int ncpu = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
  const std::string engine = std::string("libfabric ") + sh->provider + " (" +
                             (sh->delivery_complete ? "delivery complete" : "transmit complete") +
                             "), 2 forked processes on this host, host memory";
  std::printf("engine: %s; %d CPUs allowed\n", engine.c_str(), ncpu);
  nlohmann::json result;
  result["device"] = "host CPU, no GPU (" + std::to_string(ncpu) + " CPUs allowed)";
  result["commit"] = git_commit();
  result["command"] = o.command;
  result["num_ranks"] = 2;
  result["in_process"] = false;
  result["backend"] = "proxy";
  result["ranks_per_node"] = 1;
  result["proxy_engine"] = std::string("libfabric ") + sh->provider;
  result["host_cpus_allowed"] = ncpu;
  result["fifo"] = {{"host", true},
                    {"rate", rate},
                    {"signals_applied_at_rank_1", sh->signals_seen},
                    {"post_to_completion_us",
                     {{"median", sh->completion_median_us},
                      {"p99", sh->completion_p99_us},
                      {"mean", sh->completion_mean_us},
                      {"samples", sh->completion_samples}}},
                    {"one_way_latency_us", sh->one_way_mean_us},
                    {"one_way_latency_median_us", sh->one_way_median_us},
                    {"round_trips", sh->round_trips},
                    {"engine", engine}};
  if (!o.json_path.empty()) {
    std::ofstream(o.json_path) << result.dump(2) << "\n";
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  munmap(m, sizeof(HostShared));
  return 0;
}

}  // namespace epx::bench
