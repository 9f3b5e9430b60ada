// transport/proxy/proxy.hpp - the CPU proxy: one thread per channel polls its
// ring (command.hpp) and drives an engine (engine.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/buffer.hpp"
#include "epx/error.hpp"
#include "transport/proxy/command.hpp"
#include "transport/proxy/engine.hpp"

namespace epx::proxy {

struct ProxyOptions {
  int num_channels = 1;
  uint32_t capacity = 4096;  ///< commands per ring (rounded up to a power of two)
  /// CUDA device the threads make current (the rings and counters are pinned
  /// host memory mapped into it, and ChannelDevice lives in its memory); -1:
  /// no CUDA at all (CPU tests: everything in host memory).
  int device = -1;
  /// Test knob (EPX_DEBUG_PROXY_STOP): the thread of channel `stop_channel`
  /// stops after `stop_after` commands, as a proxy thread that died would.
  int stop_channel = -1;
  uint64_t stop_after = 0;
};

/// What the proxy knows about a channel's thread.
struct ChannelHealth {
  enum class State { kRunning, kStopped, kFailed } state = State::kRunning;
  uint64_t consumed = 0, completed = 0;
  /// kFailed / kStopped: what happened, naming the channel, the command
  /// (op, peer, region, offsets, bytes) and the engine's error.
  std::string message;
  /// kFailed / kStopped: the code check() raises with `message` (a failed
  /// engine call keeps the engine's code: kTimeout for a peer that died).
  ErrorCode code = ErrorCode::kInternal;
};

class Proxy {
 public:
  /// Allocates the rings and counters and starts one thread per channel.
  Proxy(Engine& engine, const ProxyOptions& options);
  /// Stops and joins the threads (commands still in the rings are dropped).
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  int num_channels() const;
  /// Device-usable pointers of channel `c` (host pointers when device == -1).
  ChannelView view(int c) const;
  /// Views of every channel, in one array in device memory (host memory when
  /// device == -1): what the device transport holds.
  const ChannelView* views_device() const;
  ChannelHealth health(int c) const;
  /// What channel `c`'s thread has carried over the proxy's life: the
  /// commands it took, the puts among them and their bytes, the signals, and
  /// the engine calls (`writes`) the puts became after coalescing. Read while
  /// the thread runs, each field is current; the set may straddle a command.
  NetworkTraffic traffic(int c) const;
  /// The longest single step of channel `c`'s thread in its engine (a
  /// command's puts and signal, a mark, a completion poll) that took at least
  /// kSlowEngineCallS since the last call of this, then forgets it. A step
  /// that long is the engine held, not working: the CUDA IPC engine's CUDA
  /// calls wait while another thread of the process is blocked in a
  /// primary-context call (docs/limitations.md).
  struct SlowCall {
    double seconds = 0;  ///< 0: none
    const char* what = "";
  };
  SlowCall take_slow_call(int c) const;
  static constexpr double kSlowEngineCallS = 1.0;
  /// Throws epx::Error naming the first channel that failed or stopped
  /// (its ChannelHealth::message).
  void check() const;
  /// Waits until every command the GPU reserved so far on any channel is
  /// complete (no kernel may post meanwhile: call it once the streams that
  /// post are idle). Throws epx::Error(kTimeout) after `timeout_s` naming the
  /// channel, or the channel's failure when it stopped.
  void drain(double timeout_s);
  /// Stops the threads (idempotent; the destructor calls it).
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Posts `cmd` (header set here) into channel `v` from host code, as a GPU
/// thread does from device code: reserve a slot, wait for it to be free,
/// write the body, release the header. For CPU tests and host-side posting.
/// Returns the slot; throws epx::Error(kTimeout) after `timeout_s` without a
/// free slot (naming the channel and the slot).
uint64_t post_from_host(const ChannelView& v, Command cmd, Op op, int region, double timeout_s,
                        int channel = 0);

}  // namespace epx::proxy
