// core/stream_wait.hpp - host waits for EPX's GPU work (a stream, an event)
// with a deadline, and the error a wait that passes it throws.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>

#include "common/host_group.hpp"  // kMaxWaitSeconds, capped_wait_seconds
#include "common/poll.hpp"

namespace epx::detail {

/// Polls `stream` (cudaStreamQuery, yielding the CPU between polls) until its
/// work is done: true; or until `timeout_s` seconds have passed: false, with
/// the work still queued or running. `poll` runs between polls, e.g. to check
/// a library's asynchronous error and throw. A CUDA error other than "not
/// ready" throws epx::Error.
bool wait_stream_for(cudaStream_t stream, double timeout_s, const std::function<void()>& poll = {});

/// What a host wait names when it passes its deadline.
struct WaitSite {
  std::string op;    ///< the EPX call that waits: "destroy", "clean_low_latency_buffer"
  int rank = -1;     ///< the rank that waits (-1: not known)
  std::string what;  ///< what it waits for: "the comm stream", "the last low-latency op's event"
};

/// The message of a host wait that passed its deadline: op, rank, what was
/// awaited, the deadline, and `note` (the backend's or the device's
/// diagnosis of the stall, "" when there is none).
std::string wait_timeout_message(const WaitSite& site, double timeout_s, const std::string& note);

/// Polls `ready` (true: done; it throws on a failure) until it is done, or
/// throws epx::Error(kTimeout, wait_timeout_message(site, timeout_s, note()))
/// once `timeout_s` seconds have passed (`note` is asked only then). `tick`
/// runs between polls. The work awaited is left queued or running.
void wait_until(const std::function<bool()>& ready, const WaitSite& site, double timeout_s,
                const std::function<std::string()>& note = {},
                const std::function<void()>& tick = {});

/// Whether the work queued on `stream` is done (cudaStreamQuery); throws
/// epx::Error on a CUDA error other than "not ready".
bool stream_done(cudaStream_t stream);
/// Whether `event` has completed (cudaEventQuery; nullptr: true); throws as stream_done.
bool event_done(cudaEvent_t event);

/// wait_until for a stream's work / an event.
void wait_stream(cudaStream_t stream, const WaitSite& site, double timeout_s,
                 const std::function<std::string()>& note = {});
void wait_event(cudaEvent_t event, const WaitSite& site, double timeout_s,
                const std::function<std::string()>& note = {});

/// cudaDeviceSynchronize, for the few places that must wait for every
/// stream of the device (work EPX does not track: CUDA graph replays of its
/// ops). CUDA offers no way to bound it: a Watchdog names `site` on stderr
/// at each `timeout_s` while it has not returned.
void device_synchronize_watched(const WaitSite& site, double timeout_s);

}  // namespace epx::detail
