// tests/unit/forked_ranks.hpp - ranks of a CPU test as forked processes: a
// Board of shared memory mapped before the fork, an Exchange (allgather,
// barrier with a deadline) over it, and Ranks, which forks them and collects
// their verdicts (a rank exits 0, or 1 with its failure in the board).
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.hpp"
#include "transport/proxy/libfabric_engine.hpp"  // Exchange

namespace epx::proxy::forked {

using Clock = std::chrono::steady_clock;
inline double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

inline constexpr int kMaxRanks = 4;

/// Removes /dev/shm/<pid>:* (what libfabric's shm provider made for `pid`).
inline void remove_shm_files(pid_t pid) {
  const std::string prefix = std::to_string(pid) + ":";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) == 0) std::filesystem::remove(e.path(), ec);
  }
}

/// Shared memory of the ranks of one test (mapped before the fork).
struct Board {
  static constexpr std::size_t kSlot = 80 * 1024;  // one allgather contribution
  std::atomic<uint64_t> arrived[kMaxRanks];
  std::atomic<int> stage[kMaxRanks];
  std::atomic<int> code[kMaxRanks];  ///< the ErrorCode a rank caught, + 1 (0: none)
  std::atomic<uint64_t> stat[kMaxRanks][4];
  char message[kMaxRanks][4096];
  uint8_t data[kMaxRanks][kSlot];
};

class ShmExchange final : public Exchange {
 public:
  ShmExchange(Board* b, int rank, int n, double timeout_s)
      : b_(b), rank_(rank), n_(n), timeout_s_(timeout_s) {}
  int rank() const override { return rank_; }
  int num_ranks() const override { return n_; }
  std::vector<uint8_t> allgather(const void* data, std::size_t bytes) override {
    if (bytes > Board::kSlot)
      throw Error(ErrorCode::kInvalidArgument,
                  "test exchange: allgather of " + std::to_string(bytes) + " bytes is too large");
    std::memcpy(b_->data[rank_], data, bytes);
    barrier();
    std::vector<uint8_t> out(bytes * n_);
    for (int r = 0; r < n_; ++r) std::memcpy(out.data() + bytes * r, b_->data[r], bytes);
    barrier();  // nobody writes its slot again before everyone read
    return out;
  }
  void barrier() override {
    const uint64_t g = ++gen_;
    b_->arrived[rank_].store(g, std::memory_order_release);
    const auto t0 = Clock::now();
    for (;;) {
      std::string missing;
      for (int r = 0; r < n_; ++r)
        if (b_->arrived[r].load(std::memory_order_acquire) < g) missing += " " + std::to_string(r);
      if (missing.empty()) return;
      if (since(t0) > timeout_s_)
        throw Error(ErrorCode::kTimeout, "test exchange: barrier " + std::to_string(g) +
                                             " on rank " + std::to_string(rank_) + ": ranks" +
                                             missing + " did not arrive");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  Board* b_;
  int rank_, n_;
  double timeout_s_;
  uint64_t gen_ = 0;
};

/// A failed check inside a rank.
inline void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

struct Ranks {
  Board* board = nullptr;
  std::vector<pid_t> pids;
  std::vector<int> status;
  Ranks() {
    void* p =
        mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    board = new (p) Board();
  }
  std::vector<pid_t> started;  ///< every rank forked, also those already reaped
  ~Ranks() {
    for (pid_t pid : pids)
      if (pid > 0) kill(pid, SIGKILL);
    for (pid_t pid : pids)
      if (pid > 0) waitpid(pid, nullptr, 0);
    // libfabric's shm provider names its endpoints' shared memory
    // /dev/shm/<pid>:<n>:<m>; a rank killed by a test leaves them behind, and
    // a later process given the same pid then fails fi_enable with EBUSY.
    for (pid_t pid : started) remove_shm_files(pid);
    munmap(board, sizeof(Board));
  }
  /// Forks n ranks running body(rank, exchange). A rank exits 0, or 1 with
  /// its failure in board->message (an epx::Error's code in board->code).
  void start(int n, const std::function<void(int, ShmExchange&)>& body, double exchange_s = 10) {
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < n; ++r) {
      const pid_t pid = fork();
      if (pid == 0) {
        int rc = 0;
        try {
          ShmExchange ex(board, r, n, exchange_s);
          body(r, ex);
        } catch (const Error& e) {
          board->code[r].store(static_cast<int>(e.code()) + 1);
          std::snprintf(board->message[r], sizeof board->message[r], "epx::Error: %s", e.what());
          rc = 1;
        } catch (const std::exception& e) {
          std::snprintf(board->message[r], sizeof board->message[r], "%s", e.what());
          rc = 1;
        }
        _exit(rc);
      }
      pids.push_back(pid);
      started.push_back(pid);
    }
    status.assign(n, -1);
  }
  /// Waits for every rank but `skip` until `deadline_s`; ranks still running
  /// are killed and reported. Returns "" when all exited 0, else what went
  /// wrong.
  std::string wait(double deadline_s, int skip = -1) {
    const auto t0 = Clock::now();
    std::string out;
    for (std::size_t r = 0; r < pids.size(); ++r) {
      if (pids[r] <= 0 || static_cast<int>(r) == skip) continue;
      int st = 0;
      pid_t got = 0;
      while ((got = waitpid(pids[r], &st, WNOHANG)) == 0 && since(t0) < deadline_s)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (got == 0) {
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &st, 0);
        out += "rank " + std::to_string(r) + " still running after " + std::to_string(deadline_s) +
               " s (killed); ";
      } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        out += "rank " + std::to_string(r) + " failed (status " + std::to_string(st) +
               "): " + board->message[r] + "; ";
      }
      status[r] = st;
      pids[r] = -1;
    }
    return out;
  }
  void wait_stage(int rank, int at_least, double timeout_s) {
    const auto t0 = Clock::now();
    while (board->stage[rank].load() < at_least && since(t0) < timeout_s)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
};

}  // namespace epx::proxy::forked
