// gpu/harness.hpp - shared state and helpers of the multi-rank GPU tests.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "gpu/shared_reference.hpp"

namespace epx::test {

/// One rank's communicator and the buffer shared by all tests.
struct World {
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<Buffer> buffer;
  int rank = 0, num_ranks = 1;
  cudaStream_t stream = nullptr;  ///< the "compute" stream tests call from
};
/// The calling thread's rank: the process's one rank, or with in-process
/// ranks (--in-process=R) the rank whose thread runs the test body.
World& world();

/// In-process mode: the R ranks' worlds (main.cpp fills them). Empty when
/// the process is one rank.
std::vector<World>& in_process_worlds();

/// Runs a test body once per rank: directly when the process is one rank,
/// else on one thread per in-process rank (each with its device and world;
/// failures carry the rank). A body that throws fails the test on that rank.
void on_every_rank(void (*body)());

/// SMs a rank of `comm` may use: the GPU's, split among the in-process ranks
/// on it (as Buffer splits them).
int sm_share(const Communicator& comm);
/// sm_share of the calling thread's rank.
int sm_budget();

/// A multi-rank GPU test: TEST whose body runs on every rank (on_every_rank).
#define EPX_GPU_TEST(suite, name)                                                      \
  static void epx_gpu_body_##suite##_##name();                                         \
  TEST(suite, name) {                                                                  \
    if (const char* why = ::epx::test::suite_skip_reason(#suite)) GTEST_SKIP() << why; \
    ::epx::test::on_every_rank(&epx_gpu_body_##suite##_##name);                        \
  }                                                                                    \
  static void epx_gpu_body_##suite##_##name()

/// Why a suite cannot run in this world (nullptr: it can): the
/// high-throughput kernels run within one node, so with virtual nodes
/// (EPX_RANKS_PER_NODE) the HighThroughput suite is skipped.
const char* suite_skip_reason(const char* suite);
/// Whether ranks a and b are in one node of the shared buffer's topology.
bool same_node(int a, int b);

/// Allocator that fills every output with 0xFF bytes (NaN in bf16/f32, -1 in
/// ints) so unwritten outputs are caught.
/// capture_arena: under stream capture, outputs come from an arena allocated
/// up front (as torch's graph pool does) instead of cudaMallocAsync, whose
/// graph memory nodes CUDA may back with the same physical memory in the
/// graphs of different ranks on one GPU and then serialize those graphs'
/// launches; a rank's replay then waits for a peer's, which waits for it,
/// until the deadline. For in-process ranks.
Allocator poisoning_allocator(bool capture_arena = false);
/// poisoning_allocator whose int32 outputs have only the 4-byte alignment an
/// allocator promises for int32 (they start 4 bytes past a 256-byte
/// boundary): EPX must not assume more, e.g. for the parts it carves out of them.
Allocator int32_unaligned_allocator();

/// Owning device copy of host data.
template <class T>
struct DeviceArray {
  std::shared_ptr<void> mem;
  std::size_t n = 0;
  T* get() const { return static_cast<T*>(mem.get()); }
};
DeviceArray<uint8_t> to_device_bytes(const void* data, std::size_t bytes);
template <class T>
DeviceArray<T> to_device(const std::vector<T>& v) {
  auto d = to_device_bytes(v.data(), v.size() * sizeof(T));
  return {d.mem, v.size()};
}
/// Host copy of n elements of device memory at p (once the work that writes it is done).
template <class T>
std::vector<T> to_host(const void* p, std::size_t n) {
  std::vector<T> v(n);
  if (!v.empty()) {
    cudaError_t e = cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) throw Error(ErrorCode::kCuda, cudaGetErrorString(e));
  }
  return v;
}
template <class T>
std::vector<T> to_host(const DeviceArray<T>& d) {
  return to_host<T>(d.get(), d.n);
}
template <class T>
std::vector<T> to_host(const Tensor& t) {
  return to_host<T>(t.view.data, static_cast<std::size_t>(t.view.numel()));
}
TensorView view(void* p, DType dtype, std::initializer_list<int64_t> shape);

/// Random routing of `T` tokens over `E` experts, top-`K` distinct experts per
/// token, with a fraction of slots masked to -1. Deterministic in `seed`.
std::vector<int64_t> random_topk(int T, int K, int E, double masked, uint64_t seed);
std::vector<uint16_t> random_bf16(std::size_t n, uint64_t seed, float scale = 1.0f);
std::vector<float> random_f32(std::size_t n, uint64_t seed);

/// Seeded draws for the fuzzed valid sets: ranks that seed it alike draw the
/// same sets.
struct Draws {
  std::mt19937_64 rng;
  explicit Draws(uint64_t seed) : rng(seed) {}
  int between(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng) < p; }
};

/// Runs f(0) .. f(n-1) on n threads and waits for all of them. Every rank
/// builds every rank's inputs, so at EP8 one thread per rank keeps the CPU
/// side of a test from growing with the square of the rank count. The
/// threads see the caller's world().
void for_each_rank(int n, const std::function<void(int)>& f);

/// Whether this rank has failed in the current test: with in-process ranks,
/// the failures its own thread reported (gtest's Test::HasFailure() is shared
/// by the rank threads, and reading it while another thread reports is a data
/// race); otherwise the process's.
bool rank_failed();
/// The gtest listener behind rank_failed(); main() appends it.
::testing::TestEventListener* new_rank_failure_listener();

/// All ranks agree (logical AND over ranks).
bool all_ranks(bool ok);

/// Holds a stream until open(): what is enqueued behind it meanwhile starts
/// only then, so every rank can enqueue a sequence of ops before the first
/// of them runs (a GPU-side failure of one op is then seen by no rank's
/// host before the sequence is enqueued). The hold is a host function on the
/// stream that waits for open() or, as every spin-wait, a deadline
/// (`timeout_s`; held() then says it ran out). Destruction opens it.
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream, double timeout_s = 60.0);
  ~StreamGate();
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  void open();
  /// True when the hold ran out before open() (read after the stream ran past it).
  bool held_too_long() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// Tests that end the run (a killed process, a stalled network; the device
// script runs each on its own, one process per rank): they print one verdict
// line the script reads and leave at once, since tearing down would wait for
// the dead or stalled peer.

/// Prints "KILL-TEST rank N: PASS|FAIL after S s[ (not named)]: <msg>" and
/// exits (0 on PASS). PASS: a kTimeout within 30 s whose message names rank
/// `victim` (any message when !names_rank).
[[noreturn]] void kill_test_verdict(int victim, bool names_rank, const std::string& msg,
                                    ErrorCode code, double secs);

/// EPX_GIN_LOOP_STALL_AFTER_S (when the loopback GIN plugin stops completing
/// puts) for a stalled-network test, or nullopt where one cannot run: unset,
/// or ranks in one process (the test ends the run); kStallTestSkip says so.
std::optional<double> stall_after_s();
inline constexpr const char* kStallTestSkip =
    "set EPX_GIN_LOOP_STALL_AFTER_S (nccl backend through the loopback plugin), one process "
    "per rank (it ends the run)";

/// Runs `pair` (one op pair: "" or the error it raised, with `code` set)
/// until it fails or `stall_after_s` + 60 s pass, then prints "STALL-TEST rank
/// N: PASS|FAIL after S s (P pairs before; KIND): <msg>" and exits (0 when
/// named). Named: the message holds one of `kinds`' texts; KIND is the label
/// of the first it holds ("a wait" when none). PASS: named, a kTimeout, and
/// raised within 30 s of the last pair that went through.
[[noreturn]] void run_stall_test(double stall_after_s,
                                 const std::function<std::string(ErrorCode&)>& pair,
                                 const std::vector<std::pair<std::string, std::string>>& kinds);

/// Instantiates `graph` (auto-free on launch) and uploads it on `stream`, then
/// waits until every rank has done so: with in-process ranks, instantiating
/// or uploading a graph may wait for the work running on the shared GPU,
/// which a peer's first replay can make wait for this rank. False on failure.
bool instantiate_on_every_rank(cudaGraph_t graph, cudaGraphExec_t* exec, cudaStream_t stream);

/// Runs `fn`, expecting an epx::Error of `code` whose text holds each of
/// `parts` (`what` names the call in failure messages). Nothing escapes, so
/// every rank still reaches the test's later collective steps.
template <class Fn>
void expect_error(const std::string& what, Fn&& fn, std::initializer_list<const char*> parts,
                  ErrorCode code = ErrorCode::kInvalidArgument) {
  try {
    fn();
    ADD_FAILURE() << what << ": expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << what << ": " << e.what();
    for (const char* p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << what << ": " << e.what() << " lacks '" << p << "'";
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": unexpected error: " << e.what();
  }
}

}  // namespace epx::test
