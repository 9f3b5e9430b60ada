#include "transport/proxy/proxy.hpp"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "common/check.hpp"
#include "common/env.hpp"
#include "epx/error.hpp"
#include "transport/proxy/coalesce.hpp"

namespace epx::proxy {
namespace {

using Clock = std::chrono::steady_clock;

/// Commands taken between two marks while the ring stays busy (a mark
/// issues the queued puts: more commands between marks, longer runs).
constexpr uint64_t kMarkEvery = 256;
/// Idle backoff: spin this many polls, then yield for kYieldFor, then sleep
/// kSleep between polls. A channel that keeps getting commands never sleeps;
/// the sleeps keep dozens of idle proxy threads from starving the threads
/// that launch the GPU work on a host with fewer cores than threads.
constexpr int kSpins = 256;
constexpr auto kYieldFor = std::chrono::milliseconds(20);
constexpr auto kSleep = std::chrono::microseconds(20);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

class Backoff {
 public:
  void reset() { polls_ = 0; }
  void pause() {
    if (polls_ < kSpins) {
      ++polls_;
      cpu_relax();
      return;
    }
    const auto now = Clock::now();
    if (polls_ == kSpins) {
      ++polls_;
      idle_since_ = now;
    }
    if (now - idle_since_ < kYieldFor)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(kSleep);
  }

 private:
  int polls_ = 0;
  Clock::time_point idle_since_;
};

/// EPX_DEBUG_PROXY=stats: where a channel's time goes, printed when its
/// thread ends: how long the engine's calls took on this thread (CUDA calls
/// that block show here) and how long marked work took to complete.
class ChannelStats {
 public:
  /// Times one engine call (or flush) that started at `t0`.
  void call(Clock::time_point t0) {
    const double us = since_us(t0);
    ++calls_;
    call_us_ += us;
    call_max_us_ = std::max(call_max_us_, us);
  }
  void marked(uint64_t token) { marks_.emplace_back(token, Clock::now()); }
  /// Commands [0, done) are complete: the marks up to `done` finished now.
  void completed(uint64_t done) {
    while (!marks_.empty() && marks_.front().first <= done) {
      const double us = since_us(marks_.front().second);
      marks_.pop_front();
      ++done_;
      done_us_ += us;
      done_max_us_ = std::max(done_max_us_, us);
      int b = 0;
      while (b < kBuckets - 1 && us >= kEdges[b]) ++b;
      ++hist_[b];
    }
  }
  void print(int rank, int channel, uint64_t commands) const {
    std::fprintf(
        stderr,
        "epx proxy rank %d channel %d stats: %llu commands; %llu engine calls, %.1f us "
        "mean, %.1f us max; %llu marks completed, %.1f us mean, %.1f us max after the "
        "mark (<50us %llu, <200us %llu, <1ms %llu, <5ms %llu, <20ms %llu, more %llu)\n",
        rank, channel, static_cast<unsigned long long>(commands),
        static_cast<unsigned long long>(calls_), calls_ ? call_us_ / calls_ : 0.0, call_max_us_,
        static_cast<unsigned long long>(done_), done_ ? done_us_ / done_ : 0.0, done_max_us_,
        static_cast<unsigned long long>(hist_[0]), static_cast<unsigned long long>(hist_[1]),
        static_cast<unsigned long long>(hist_[2]), static_cast<unsigned long long>(hist_[3]),
        static_cast<unsigned long long>(hist_[4]), static_cast<unsigned long long>(hist_[5]));
  }

 private:
  static constexpr int kBuckets = 6;
  static constexpr double kEdges[kBuckets - 1] = {50, 200, 1000, 5000, 20000};
  static double since_us(Clock::time_point t0) {
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  }
  std::deque<std::pair<uint64_t, Clock::time_point>> marks_;
  uint64_t calls_ = 0, done_ = 0, hist_[kBuckets] = {};
  double call_us_ = 0, call_max_us_ = 0, done_us_ = 0, done_max_us_ = 0;
};

template <class T>
T load_acquire(T& x) {
  return std::atomic_ref<T>(x).load(std::memory_order_acquire);
}
template <class T>
void store_release(T& x, T v) {
  std::atomic_ref<T>(x).store(v, std::memory_order_release);
}

/// The op's name, or nullptr for a value that is none of them.
const char* op_name(Op op) {
  switch (op) {
    case Op::kNone:
      return "none";
    case Op::kPut:
      return "put";
    case Op::kPutSignal:
      return "put_signal";
    case Op::kSignal:
      return "signal";
    case Op::kFence:
      return "fence";
  }
  return nullptr;
}

/// "slot 17 (op put_signal, peer 1, region 2, dst_off 4096, ...)".
std::string describe(uint64_t slot, uint64_t header, const Command& c) {
  std::ostringstream os;
  const Op op = op_of(header);
  os << "slot " << slot << " (op ";
  if (const char* name = op_name(op))
    os << name;
  else
    os << static_cast<uint32_t>(op);
  os << ", peer " << c.peer << ", region " << region_of(header) << ", dst_off " << c.dst_off
     << ", src_off " << c.src_off << ", bytes " << c.bytes << ", sig_off " << c.sig_off << ", add "
     << c.add << ")";
  return os.str();
}

/// Deadline `timeout_s` from now; capped (about 31 years) so that an infinite
/// timeout cannot overflow the clock.
Clock::time_point deadline_after(double timeout_s) {
  const auto wait = std::chrono::duration<double>(std::clamp(timeout_s, 0.0, 1e9));
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(wait);
}

/// Frees what it holds with `free_fn` (never throws: it runs in destructors).
struct Allocation {
  void* ptr = nullptr;
  void (*free_fn)(void*) = nullptr;
  Allocation() = default;
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  ~Allocation() {
    if (ptr && free_fn) free_fn(ptr);
  }
};

void free_host(void* p) {
  std::free(p);
}
void free_pinned(void* p) {
  cudaFreeHost(p);
}
void free_device(void* p) {
  cudaFree(p);
}

/// Zeroed host memory aligned to 128 bytes (the counters' lines).
void alloc_host(Allocation& a, std::size_t bytes) {
  bytes = (bytes + 127) / 128 * 128;
  a.ptr = std::aligned_alloc(128, bytes);
  if (!a.ptr)
    throw Error(ErrorCode::kInternal,
                "proxy: cannot allocate " + std::to_string(bytes) + " bytes of host memory");
  a.free_fn = free_host;
  std::memset(a.ptr, 0, bytes);
}

/// The current CUDA device again when it goes out of scope.
struct RestoreDevice {
  int device = -1;
  ~RestoreDevice() {
    if (device >= 0) cudaSetDevice(device);
  }
};

}  // namespace

struct Proxy::Impl {
  struct Channel {
    mutable std::mutex m;
    ChannelHealth::State state = ChannelHealth::State::kRunning;
    std::string message;
    ErrorCode code = ErrorCode::kInternal;
    /// The longest engine step of at least kSlowEngineCallS not yet taken
    /// (ns; 0: none) and which kind it was (kSlowStepNames).
    mutable std::atomic<uint64_t> slow_ns{0};
    mutable std::atomic<int> slow_what{0};
    /// traffic()'s fields, written by the channel's thread alone.
    std::atomic<uint64_t> commands{0}, puts{0}, put_bytes{0}, signals{0}, writes{0};
  };
  static constexpr const char* kSlowStepNames[] = {"a command's puts and signal", "a mark",
                                                   "a completion poll"};
  /// A coarse monotonic clock (a few ns to read; ms resolution is plenty for
  /// steps of a second).
  static uint64_t coarse_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  }
  /// Keeps a step of channel c that took `ns` if it is slow and the longest.
  void note_step(int c, uint64_t ns, int what) const {
    if (ns < static_cast<uint64_t>(kSlowEngineCallS * 1e9)) return;
    Channel& ch = channels[c];
    uint64_t prev = ch.slow_ns.load(std::memory_order_relaxed);
    while (ns > prev && !ch.slow_ns.compare_exchange_weak(prev, ns, std::memory_order_relaxed)) {
    }
    if (ns >= prev) ch.slow_what.store(what, std::memory_order_relaxed);
  }

  Engine& engine;
  const ProxyOptions options;
  const uint32_t capacity;
  const int num_channels;
  const env::ProxyDebug debug;  ///< EPX_DEBUG_PROXY, read once per proxy

  Allocation rings, hosts, devs, views_mem;
  Command* ring_host = nullptr;  ///< what the threads read (host addresses)
  ChannelHost* host_host = nullptr;
  std::vector<ChannelView> views;  ///< device addresses (host ones when device == -1)

  std::unique_ptr<Channel[]> channels;
  std::atomic<bool> stop_flag{false};
  std::mutex stop_mutex;
  std::vector<std::thread> threads;

  Impl(Engine& e, const ProxyOptions& o);
  ~Impl() {
    try {
      stop();
    } catch (...) {
      // Destructors do not throw; stop() only joins and records states.
    }
  }

  void allocate();
  void serve(int c);
  void run(int c);
  void finish(int c, ChannelHealth::State state, ErrorCode code, std::string message);
  void stop();
};

Proxy::Impl::Impl(Engine& e, const ProxyOptions& o)
    : engine(e),
      options(o),
      capacity(o.capacity >= 1 && o.capacity <= (1u << 31) ? std::bit_ceil(o.capacity) : 0),
      num_channels(o.num_channels),
      debug(env::debug_proxy()) {
  require(o.num_channels >= 1 && o.num_channels <= e.num_channels(), "num_channels",
          "must be in [1, " + std::to_string(e.num_channels()) + "] (the engine's channels), got " +
              std::to_string(o.num_channels));
  require(capacity != 0, "capacity",
          "must be in [1, 2^31] commands, got " + std::to_string(o.capacity));
  require(o.stop_channel == -1 || (o.stop_channel >= 0 && o.stop_channel < o.num_channels),
          "stop_channel",
          "must be -1 or a channel in [0, " + std::to_string(o.num_channels) + "), got " +
              std::to_string(o.stop_channel));
  channels = std::make_unique<Channel[]>(static_cast<std::size_t>(num_channels));
  allocate();
  threads.reserve(static_cast<std::size_t>(num_channels));
  try {
    for (int c = 0; c < num_channels; ++c) threads.emplace_back([this, c] { serve(c); });
  } catch (...) {
    stop();  // ~Impl does not run for a constructor that throws: join the ones that started
    throw;
  }
}

void Proxy::Impl::allocate() {
  const std::size_t ring_bytes = sizeof(Command) * capacity * num_channels;
  const std::size_t host_bytes = sizeof(ChannelHost) * num_channels;
  const std::size_t dev_bytes = sizeof(ChannelDevice) * num_channels;
  views.resize(static_cast<std::size_t>(num_channels));
  if (options.device < 0) {
    alloc_host(rings, ring_bytes);
    alloc_host(hosts, host_bytes);
    alloc_host(devs, dev_bytes);
    ring_host = static_cast<Command*>(rings.ptr);
    host_host = static_cast<ChannelHost*>(hosts.ptr);
    for (int c = 0; c < num_channels; ++c)
      views[c] = {ring_host + static_cast<std::size_t>(c) * capacity, host_host + c,
                  static_cast<ChannelDevice*>(devs.ptr) + c, capacity};
    return;
  }
  RestoreDevice restore;
  EPX_CUDA_CHECK(cudaGetDevice(&restore.device));
  EPX_CUDA_CHECK(cudaSetDevice(options.device));
  // Pinned and mapped: the GPU writes the rings and reads the counters over
  // PCIe, the threads poll them in host memory.
  constexpr unsigned kFlags = cudaHostAllocMapped | cudaHostAllocPortable;
  EPX_CUDA_CHECK(cudaHostAlloc(&rings.ptr, ring_bytes, kFlags));
  rings.free_fn = free_pinned;
  EPX_CUDA_CHECK(cudaHostAlloc(&hosts.ptr, host_bytes, kFlags));
  hosts.free_fn = free_pinned;
  std::memset(rings.ptr, 0, ring_bytes);
  std::memset(hosts.ptr, 0, host_bytes);
  ring_host = static_cast<Command*>(rings.ptr);
  host_host = static_cast<ChannelHost*>(hosts.ptr);
  void* ring_dev = nullptr;
  void* host_dev = nullptr;
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(&ring_dev, rings.ptr, 0));
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(&host_dev, hosts.ptr, 0));
  EPX_CUDA_CHECK(cudaMalloc(&devs.ptr, dev_bytes));
  devs.free_fn = free_device;
  EPX_CUDA_CHECK(cudaMemset(devs.ptr, 0, dev_bytes));
  for (int c = 0; c < num_channels; ++c)
    views[c] = {static_cast<Command*>(ring_dev) + static_cast<std::size_t>(c) * capacity,
                static_cast<ChannelHost*>(host_dev) + c, static_cast<ChannelDevice*>(devs.ptr) + c,
                capacity};
  const std::size_t view_bytes = sizeof(ChannelView) * num_channels;
  EPX_CUDA_CHECK(cudaMalloc(&views_mem.ptr, view_bytes));
  views_mem.free_fn = free_device;
  EPX_CUDA_CHECK(cudaMemcpy(views_mem.ptr, views.data(), view_bytes, cudaMemcpyHostToDevice));
}

void Proxy::Impl::finish(int c, ChannelHealth::State state, ErrorCode code, std::string message) {
  {
    std::lock_guard lock(channels[c].m);
    if (channels[c].state != ChannelHealth::State::kRunning) return;
    channels[c].state = state;
    channels[c].code = code;
    channels[c].message = std::move(message);
  }
  // After the message is set: whoever sees `stopped` can read why.
  store_release(host_host[c].stopped, 1u);
}

void Proxy::Impl::serve(int c) {
  try {
    if (options.device >= 0) EPX_CUDA_CHECK(cudaSetDevice(options.device));
    run(c);
  } catch (const Error& e) {
    finish(c, ChannelHealth::State::kFailed, e.code(),
           "proxy channel " + std::to_string(c) + " failed: " + e.what());
  } catch (const std::exception& e) {
    finish(c, ChannelHealth::State::kFailed, ErrorCode::kInternal,
           "proxy channel " + std::to_string(c) + " failed: " + e.what());
  } catch (...) {
    finish(c, ChannelHealth::State::kFailed, ErrorCode::kInternal,
           "proxy channel " + std::to_string(c) + " failed: unknown exception");
  }
}

void Proxy::Impl::run(int c) {
  Command* ring = ring_host + static_cast<std::size_t>(c) * capacity;
  ChannelHost& host = host_host[c];
  const uint64_t mask = capacity - 1;
  const int num_ranks = engine.num_ranks();
  const bool stops = c == options.stop_channel;
  uint64_t tail = 0, marked = 0, completed = 0, since_mark = 0;
  // EPX_DEBUG_PROXY=1: every command on stderr as the thread takes it;
  // stats: ChannelStats, printed when the thread ends.
  const bool trace = debug == env::ProxyDebug::kTrace;
  const bool want_stats = debug == env::ProxyDebug::kStats;
  std::optional<ChannelStats> stats;
  if (want_stats) stats.emplace();
  Backoff backoff;
  Coalescer queue(engine, c, num_ranks);
  const auto t_start = Clock::now();
  auto trace_us = [&] {
    return std::chrono::duration<double, std::micro>(Clock::now() - t_start).count();
  };
  if (trace) {
    // Where the thread may run: a proxy that shares its CPUs with threads
    // that spin (a host waiting for the GPU) gets time slices, not latency.
    cpu_set_t set;
    CPU_ZERO(&set);
    std::ostringstream cpus;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      cpus << CPU_COUNT(&set) << " (first";
      for (int cpu = 0, shown = 0; cpu < CPU_SETSIZE && shown < 8; ++cpu)
        if (CPU_ISSET(cpu, &set)) {
          cpus << ' ' << cpu;
          ++shown;
        }
      cpus << ')';
    } else {
      cpus << "unknown";
    }
    std::fprintf(stderr, "epx proxy rank %d channel %d: thread started, CPUs allowed: %s\n",
                 engine.rank(), c, cpus.str().c_str());
  }

  auto fail = [&](ErrorCode code, const std::string& what) {
    finish(c, ChannelHealth::State::kFailed, code,
           "proxy channel " + std::to_string(c) + ": " + what);
  };
  auto fail_with = [&](const std::string& what, std::exception_ptr e) {
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      fail(err.code(), what + " failed: " + err.what());
    } catch (const std::exception& err) {
      fail(ErrorCode::kInternal, what + " failed: " + err.what());
    } catch (...) {
      fail(ErrorCode::kInternal, what + " failed: unknown exception");
    }
  };
  // Marks the commands taken so far / publishes the engine's progress.
  // False (the channel failed) when the engine throws.
  auto progress = [&](bool mark_now) {
    try {
      if (mark_now) {
        const auto t0 = Clock::now();
        const uint64_t s0 = coarse_ns();
        queue.flush_all();
        channels[c].writes.store(queue.engine_puts(), std::memory_order_relaxed);
        engine.mark(c, tail);
        note_step(c, coarse_ns() - s0, 1);
        if (stats) {
          stats->call(t0);
          stats->marked(tail);
        }
        marked = tail;
        since_mark = 0;
        if (trace)
          std::fprintf(stderr, "epx proxy rank %d channel %d at %.1f us: mark %llu\n",
                       engine.rank(), c, trace_us(), static_cast<unsigned long long>(tail));
      }
      if (completed < marked) {
        const uint64_t s0 = coarse_ns();
        const uint64_t done = engine.completed(c);
        note_step(c, coarse_ns() - s0, 2);
        if (stats) stats->completed(done);
        if (done > completed) {
          completed = done;
          store_release(host.completed, completed);
          if (trace)
            std::fprintf(stderr, "epx proxy rank %d channel %d at %.1f us: completed %llu\n",
                         engine.rank(), c, trace_us(), static_cast<unsigned long long>(done));
        }
      }
      return true;
    } catch (...) {
      fail_with("issuing queued puts or tracking completion (consumed " + std::to_string(tail) +
                    ", marked " + std::to_string(marked) + ", completed " +
                    std::to_string(completed) + ")",
                std::current_exception());
      return false;
    }
  };

  while (!stop_flag.load(std::memory_order_relaxed)) {
    if (stops && tail == options.stop_after) {
      // The commands taken so far reach the engine, as a dead thread's would have.
      try {
        queue.flush_all();
      } catch (...) {
      }
      finish(c, ChannelHealth::State::kStopped, ErrorCode::kInternal,
             "proxy channel " + std::to_string(c) + " stopped by EPX_DEBUG_PROXY_STOP after " +
                 std::to_string(tail) + " commands");
      return;
    }
    Command& slot = ring[tail & mask];
    const uint64_t header = load_acquire(slot.header);
    // The sequence number has 56 bits: compare modulo 2^56.
    const uint64_t want = (tail + 1) & kMaxSeq;
    const uint64_t seq = seq_of(header);
    if (seq != want) {
      // Anything but "not written yet" (0 on the first lap, the previous
      // lap's number later) means a poster wrote a slot it did not own.
      const uint64_t previous = tail >= capacity ? (tail + 1 - capacity) & kMaxSeq : 0;
      if (seq != previous) {
        fail(ErrorCode::kInternal, "malformed command at " + describe(tail, header, slot) +
                                       ": sequence number " + std::to_string(seq) + ", expected " +
                                       std::to_string(want) + " (or " + std::to_string(previous) +
                                       " while not written yet)");
        return;
      }
      // Idle: mark the last burst, and keep polling until it completes.
      if (!progress(marked < tail)) return;
      backoff.pause();
      continue;
    }
    backoff.reset();
    const Command cmd = slot;  // after the acquire of its header
    const Op op = op_of(header);
    const int region = region_of(header);
    std::string malformed;
    if (op != Op::kPut && op != Op::kPutSignal && op != Op::kSignal && op != Op::kFence)
      malformed = "unknown op";
    else if (op != Op::kFence && cmd.peer >= static_cast<uint32_t>(num_ranks))
      malformed = "peer is not a rank (num_ranks " + std::to_string(num_ranks) + ")";
    else if ((op == Op::kPut || op == Op::kPutSignal) && cmd.bytes == 0)
      malformed = "a put of 0 bytes";
    if (!malformed.empty()) {
      fail(ErrorCode::kInternal,
           "malformed command at " + describe(tail, header, cmd) + ": " + malformed);
      return;
    }
    if (trace)
      std::fprintf(stderr, "epx proxy rank %d channel %d at %.1f us: %s\n", engine.rank(), c,
                   trace_us(), describe(tail, header, cmd).c_str());
    try {
      const auto t0 = Clock::now();
      const uint64_t s0 = coarse_ns();
      const int peer = static_cast<int>(cmd.peer);
      if (op == Op::kFence) {
        queue.flush_all();  // what came before goes to the engine before what follows
      } else if (op != Op::kSignal) {
        queue.put(peer, region, cmd.dst_off, cmd.src_off, cmd.bytes);
      }
      if (op == Op::kPutSignal || op == Op::kSignal) {
        queue.flush(peer);  // the signal follows every put to the peer before it
        engine.signal_add(c, peer, region, cmd.sig_off, cmd.add);
      }
      if (stats && op != Op::kPut) stats->call(t0);
      note_step(c, coarse_ns() - s0, 0);
    } catch (...) {
      fail_with("command at " + describe(tail, header, cmd) +
                    (queue.queued() > 0 || op != Op::kPut
                         ? " (or a put to the same peer queued before it)"
                         : ""),
                std::current_exception());
      return;
    }
    {
      // The running totals (one writer: relaxed stores of its own counts)
      Channel& ch = channels[c];
      auto bump = [](std::atomic<uint64_t>& a, uint64_t by) {
        a.store(a.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
      };
      bump(ch.commands, 1);
      if (op == Op::kPut || op == Op::kPutSignal) {
        bump(ch.puts, 1);
        bump(ch.put_bytes, cmd.bytes);
      }
      if (op == Op::kPutSignal || op == Op::kSignal) bump(ch.signals, 1);
      ch.writes.store(queue.engine_puts(), std::memory_order_relaxed);
    }
    ++tail;
    store_release(host.consumed, tail);
    if (++since_mark == kMarkEvery && !progress(true)) return;
  }
  // Stopped: the puts already taken still reach the engine (a drain before
  // the stop leaves none; a stop without one should not lose them silently).
  try {
    queue.flush_all();
  } catch (...) {
  }
  if (stats) stats->print(engine.rank(), c, tail);
}

void Proxy::Impl::stop() {
  std::lock_guard lock(stop_mutex);
  stop_flag.store(true, std::memory_order_relaxed);
  for (auto& t : threads)
    if (t.joinable()) t.join();
  for (int c = 0; c < static_cast<int>(threads.size()); ++c) {
    const uint64_t consumed = load_acquire(host_host[c].consumed);
    finish(c, ChannelHealth::State::kStopped, ErrorCode::kInternal,
           "proxy channel " + std::to_string(c) + " stopped by Proxy::stop after " +
               std::to_string(consumed) + " commands");
  }
}

Proxy::Proxy(Engine& engine, const ProxyOptions& options)
    : impl_(std::make_unique<Impl>(engine, options)) {}

Proxy::~Proxy() {
  try {
    impl_->stop();
  } catch (...) {
    // A destructor does not throw; stop() only joins and records states.
  }
}

int Proxy::num_channels() const {
  return impl_->num_channels;
}

ChannelView Proxy::view(int c) const {
  require(c >= 0 && c < impl_->num_channels, "channel",
          "must be in [0, " + std::to_string(impl_->num_channels) + "), got " + std::to_string(c));
  return impl_->views[c];
}

const ChannelView* Proxy::views_device() const {
  return impl_->options.device < 0 ? impl_->views.data()
                                   : static_cast<const ChannelView*>(impl_->views_mem.ptr);
}

NetworkTraffic Proxy::traffic(int c) const {
  require(c >= 0 && c < impl_->num_channels, "channel",
          "must be in [0, " + std::to_string(impl_->num_channels) + "), got " + std::to_string(c));
  const Impl::Channel& ch = impl_->channels[c];
  constexpr auto kRelaxed = std::memory_order_relaxed;
  return {ch.commands.load(kRelaxed), ch.puts.load(kRelaxed), ch.put_bytes.load(kRelaxed),
          ch.signals.load(kRelaxed), ch.writes.load(kRelaxed)};
}

ChannelHealth Proxy::health(int c) const {
  require(c >= 0 && c < impl_->num_channels, "channel",
          "must be in [0, " + std::to_string(impl_->num_channels) + "), got " + std::to_string(c));
  ChannelHealth h;
  {
    std::lock_guard lock(impl_->channels[c].m);
    h.state = impl_->channels[c].state;
    h.message = impl_->channels[c].message;
    h.code = impl_->channels[c].code;
  }
  h.consumed = load_acquire(impl_->host_host[c].consumed);
  h.completed = load_acquire(impl_->host_host[c].completed);
  return h;
}

Proxy::SlowCall Proxy::take_slow_call(int c) const {
  require(c >= 0 && c < impl_->num_channels, "channel",
          "must be in [0, " + std::to_string(impl_->num_channels) + "), got " + std::to_string(c));
  auto& ch = impl_->channels[c];
  const uint64_t ns = ch.slow_ns.exchange(0, std::memory_order_relaxed);
  if (ns == 0) return {};
  const int what = ch.slow_what.load(std::memory_order_relaxed);
  return {static_cast<double>(ns) * 1e-9, Impl::kSlowStepNames[what >= 0 && what < 3 ? what : 0]};
}

void Proxy::check() const {
  for (int c = 0; c < impl_->num_channels; ++c) {
    std::lock_guard lock(impl_->channels[c].m);
    if (impl_->channels[c].state != ChannelHealth::State::kRunning)
      throw Error(impl_->channels[c].code, impl_->channels[c].message);
  }
}

void Proxy::drain(double timeout_s) {
  auto& d = *impl_;
  for (int c = 0; c < d.num_channels; ++c) {
    uint64_t reserved = 0;
    if (d.options.device >= 0) {
      // (cudaMemcpy: the caller made sure no kernel runs.)
      EPX_CUDA_CHECK(cudaMemcpy(&reserved, &static_cast<ChannelDevice*>(d.devs.ptr)[c].reserved,
                                sizeof(reserved), cudaMemcpyDeviceToHost));
    } else {
      reserved = load_acquire(static_cast<ChannelDevice*>(d.devs.ptr)[c].reserved);
    }
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (load_acquire(d.host_host[c].completed) < reserved) {
      if (load_acquire(d.host_host[c].stopped) != 0u) check();
      if (Clock::now() > deadline)
        throw Error(ErrorCode::kTimeout,
                    "proxy channel " + std::to_string(c) + ": " +
                        std::to_string(load_acquire(d.host_host[c].completed)) + " of " +
                        std::to_string(reserved) + " commands complete after " +
                        std::to_string(timeout_s) + " s (draining before a clean)");
      std::this_thread::yield();
    }
  }
}

void Proxy::stop() {
  impl_->stop();
}

uint64_t post_from_host(const ChannelView& v, Command cmd, Op op, int region, double timeout_s,
                        int channel) {
  require(v.ring && v.host && v.dev, "view", "must point at a ring and its counters");
  require(v.capacity >= 1 && std::has_single_bit(v.capacity), "view.capacity",
          "must be a power of two, got " + std::to_string(v.capacity));
  require(region >= 0 && region < kMaxRegions, "region",
          "must be in [0, " + std::to_string(kMaxRegions) + "), got " + std::to_string(region));
  const std::string name = "post_from_host: proxy channel " + std::to_string(channel);
  auto stopped = [&](const std::string& what) {
    return Error(ErrorCode::kInternal,
                 name + " has stopped (its proxy failed or was stopped; Proxy::health(" +
                     std::to_string(channel) + ") says why): " + what);
  };
  // A dead channel refuses at once, even where a slot would be free.
  if (load_acquire(v.host->stopped)) throw stopped("nothing posted");
  const uint64_t slot =
      std::atomic_ref<unsigned long long>(v.dev->reserved).fetch_add(1, std::memory_order_relaxed);
  const auto deadline = deadline_after(timeout_s);
  Backoff backoff;
  for (;;) {
    if (slot < load_acquire(v.host->consumed) + v.capacity) break;
    if (load_acquire(v.host->stopped))
      throw stopped("slot " + std::to_string(slot) + " not posted");
    if (Clock::now() >= deadline) {
      std::ostringstream os;
      os << name << ": slot " << slot << " still not free after " << timeout_s
         << " s (the proxy consumed " << load_acquire(v.host->consumed) << " commands of "
         << load_acquire(v.dev->reserved) << " reserved, ring capacity " << v.capacity
         << "); the channel has a hole at this slot now and cannot be used any more";
      throw Error(ErrorCode::kTimeout, os.str());
    }
    backoff.pause();
  }
  // The proxy reads the body only after it sees this slot's header (acquire).
  Command& dst = v.ring[slot & (v.capacity - 1)];
  dst.dst_off = cmd.dst_off;
  dst.src_off = cmd.src_off;
  dst.bytes = cmd.bytes;
  dst.sig_off = cmd.sig_off;
  dst.add = cmd.add;
  dst.peer = cmd.peer;
  dst.reserved0 = 0;
  dst.reserved1 = 0;
  store_release(dst.header, make_header(slot + 1, op, region));
  return slot;
}

}  // namespace epx::proxy
