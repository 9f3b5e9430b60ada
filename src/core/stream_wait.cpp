#include "core/stream_wait.hpp"

#include <cstdio>

#include "common/check.hpp"

namespace epx::detail {

namespace {
/// A query's result: done, not yet, or an error (thrown, and not left for a
/// later error check).
bool query_done(cudaError_t e) {
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  EPX_CUDA_CHECK(e);
  return true;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}
}  // namespace

bool stream_done(cudaStream_t stream) {
  return query_done(cudaStreamQuery(stream));
}

bool event_done(cudaEvent_t event) {
  return event == nullptr || query_done(cudaEventQuery(event));
}

bool wait_stream_for(cudaStream_t stream, double timeout_s, const std::function<void()>& poll) {
  return poll_until([&] { return stream_done(stream); }, timeout_s,
                    [&] {
                      if (poll) poll();
                    });
}

std::string wait_timeout_message(const WaitSite& site, double timeout_s, const std::string& note) {
  std::string m = site.op + ": rank " + (site.rank >= 0 ? std::to_string(site.rank) : "?") +
                  " waited more than " + seconds_text(timeout_s) + " s for " + site.what +
                  " (the GPU work queued there did not finish: a kernel waits for a peer that "
                  "is stalled or dead, or for work before it on the stream; set EPX_TIMEOUT_S "
                  "to wait longer)";
  if (!note.empty()) m += "; " + note;
  return m;
}

void wait_until(const std::function<bool()>& ready, const WaitSite& site, double timeout_s,
                const std::function<std::string()>& note, const std::function<void()>& tick) {
  if (poll_until(ready, timeout_s, [&] {
        if (tick) tick();
      }))
    return;
  throw Error(ErrorCode::kTimeout, wait_timeout_message(site, timeout_s, note ? note() : ""));
}

void wait_stream(cudaStream_t stream, const WaitSite& site, double timeout_s,
                 const std::function<std::string()>& note) {
  wait_until([&] { return stream_done(stream); }, site, timeout_s, note);
}

void wait_event(cudaEvent_t event, const WaitSite& site, double timeout_s,
                const std::function<std::string()>& note) {
  wait_until([&] { return event_done(event); }, site, timeout_s, note);
}

void device_synchronize_watched(const WaitSite& site, double timeout_s) {
  Watchdog watch(site.op + ": rank " + std::to_string(site.rank) + ": cudaDeviceSynchronize (for " +
                     site.what +
                     ") has not returned: it waits for every stream of the GPU, work EPX does "
                     "not own included, and CUDA offers no way to bound it",
                 timeout_s);
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace epx::detail
