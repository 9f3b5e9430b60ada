#include "common/host_group.hpp"

#include <execinfo.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "epx/error.hpp"

namespace epx::detail {

InProcessGroup::InProcessGroup(int num_ranks, double timeout_s, std::string what)
    : num_ranks_(num_ranks),
      timeout_s_(timeout_s),
      what_(std::move(what)),
      arrived_(static_cast<std::size_t>(num_ranks), 0),
      arrived_from_(static_cast<std::size_t>(num_ranks)),
      arrived_stack_(static_cast<std::size_t>(num_ranks)),
      arrived_depth_(static_cast<std::size_t>(num_ranks), 0),
      slots_(static_cast<std::size_t>(num_ranks)) {
  require(num_ranks >= 1, "num_ranks", "must be >= 1, got " + std::to_string(num_ranks));
  require(timeout_s > 0, "timeout_s", "must be > 0 seconds, got " + std::to_string(timeout_s));
}

void InProcessGroup::check_rank(int rank) const {
  require(rank >= 0 && rank < num_ranks_, "rank",
          "must be in [0, " + std::to_string(num_ranks_) + "), got " + std::to_string(rank));
}

void InProcessGroup::barrier(int rank) {
  check_rank(rank);
  // This thread's call stack, taken before the lock (the first backtrace()
  // loads the unwinder): kept as the rank's entry, or printed beside the
  // waiting thread's when the rank entered twice.
  std::array<void*, kFrames> here{};
  const int depth = ::backtrace(here.data(), kFrames);
  std::unique_lock lock(m_);
  if (broken_)
    throw Error(ErrorCode::kTimeout, what_ + ": rank " + std::to_string(rank) +
                                         " entered after an earlier barrier timed out");
  if (arrived_[rank]) {
    // Only another thread can be inside this barrier for the same rank (the
    // first entry blocks until the barrier completes or breaks).
    std::ostringstream os;
    os << what_ << ": rank " << rank << " entered twice: from thread " << std::this_thread::get_id()
       << " while thread " << arrived_from_[rank]
       << " waits in the same barrier for it (two threads use one rank's communicator at once)";
    // Both call stacks (module+offset: addr2line -e <module> resolves them).
    const auto print = [&os](const char* who, void* const* frames, int n) {
      os << "\n  " << who << ":";
      char** names = ::backtrace_symbols(frames, n);
      for (int i = 0; i < n; ++i) os << "\n    " << (names ? names[i] : "?");
      std::free(names);
    };
    print("this thread", here.data(), depth);
    print("the waiting thread, when it entered", arrived_stack_[rank].data(), arrived_depth_[rank]);
    throw Error(ErrorCode::kInternal, os.str());
  }
  arrived_[rank] = 1;
  arrived_from_[rank] = std::this_thread::get_id();
  arrived_stack_[rank] = here;
  arrived_depth_[rank] = depth;
  if (++num_arrived_ == num_ranks_) {
    std::fill(arrived_.begin(), arrived_.end(), 0);
    num_arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  const uint64_t mine = generation_;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(detail::capped_wait_seconds(timeout_s_)));
  const bool done = cv_.wait_until(lock, deadline, [&] { return generation_ != mine || broken_; });
  if (done && generation_ != mine) return;
  std::string missing;
  for (int r = 0; r < num_ranks_; ++r)
    if (!arrived_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  const bool first = !broken_;
  broken_ = true;
  cv_.notify_all();
  throw Error(ErrorCode::kTimeout, what_ + ": rank " + std::to_string(rank) +
                                       (first ? " waited " + std::to_string(timeout_s_) +
                                                    " s; rank(s) " + missing + " did not arrive"
                                              : " gave up: another rank's barrier timed out"));
}

std::vector<uint8_t> InProcessGroup::allgather(int rank, const void* data, std::size_t bytes) {
  check_rank(rank);
  {
    std::lock_guard lock(m_);
    auto& s = slots_[rank];
    s.resize(bytes);
    if (bytes) std::memcpy(s.data(), data, bytes);
  }
  barrier(rank);  // every slot is written
  std::vector<uint8_t> out;
  std::string mismatch;
  {
    std::lock_guard lock(m_);
    for (int r = 0; r < num_ranks_ && mismatch.empty(); ++r)
      if (slots_[r].size() != bytes)
        mismatch = "must be the same on every rank: rank " + std::to_string(rank) + " gives " +
                   std::to_string(bytes) + ", rank " + std::to_string(r) + " " +
                   std::to_string(slots_[r].size());
    if (mismatch.empty()) {
      out.reserve(bytes * num_ranks_);
      for (const auto& s : slots_) out.insert(out.end(), s.begin(), s.end());
    }
  }
  // Nobody overwrites a slot before every rank has read it, also when the
  // sizes disagree (every rank then raises, after this barrier).
  barrier(rank);
  require(mismatch.empty(), "bytes", mismatch);
  return out;
}

}  // namespace epx::detail
