// Low-latency ops' shrink mode (enable_shrink: masked ranks, deadlines that
// mask, a rank that stops or dies), and the low-latency ops across virtual
// nodes over a network backend: a dying proxy thread, a silent, killed or
// stalled peer named on every rank, and the soak. CPU reference as in
// test_low_latency.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "common/env.hpp"
#include "epx/reference.hpp"
#include "gpu/checksum.hpp"
#include "gpu/device_sleep.hpp"
#include "gpu/harness.hpp"
#include "gpu/ll_cases.hpp"

namespace epx::test {
namespace {

using namespace ll;  // NOLINT(build/namespaces): the shared cases and checks

// ---- shrink mode (enable_shrink) ------------------------------------------------

/// This rank's mask, read back with low_latency_query_mask_buffer.
std::vector<int> query_mask(Buffer& b) {
  const int R = world().num_ranks;
  auto d = to_device(std::vector<int>(R, -7));
  b.low_latency_query_mask_buffer(view(d.get(), DType::kI32, {R}), world().stream);
  std::vector<int> got(R);
  EXPECT_EQ(cudaStreamSynchronize(world().stream), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(got.data(), d.get(), R * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  return got;
}

std::vector<int> only_masked(int R, int r) {
  std::vector<int> m(R, 0);
  if (r >= 0) m[r] = 1;
  return m;
}

/// The shrink tests' small case, rank R/2 the one left out.
LlCase shrink_case(int R) {
  LlCase c;
  c.max_tokens = 32;
  c.hidden = 1024;
  c.num_experts = 8 * R;
  c.dead_rank = R / 2;
  return c;
}

/// A buffer of c's size hint with enable_shrink and this deadline.
std::unique_ptr<Buffer> shrink_buffer(const LlCase& c, double deadline_s) {
  BufferOptions o = hint_sized_options(c, world().num_ranks, deadline_s, poisoning_allocator());
  o.enable_shrink = true;
  return std::make_unique<Buffer>(world().comm, o);
}

/// Every rank back in step: every rank cleans its mask (the others unmask
/// the dead rank; one that died mid-dispatch may have masked itself, waiting
/// for its own rows), then all clean the low-latency buffer (collective; it
/// resets the epochs the dead rank missed).
void bring_back(Buffer& b, const LlCase& c) {
  b.low_latency_clean_mask_buffer(world().stream);
  EXPECT_EQ(query_mask(b), only_masked(world().num_ranks, -1));
  b.clean_low_latency_buffer(c.max_tokens, c.hidden, c.num_experts);
}

/// Every other rank masks rank R/2, which then makes no call: dispatch and
/// combine (BF16, FP8, with and without hooks) give the ops without it, and
/// nothing waits for it.
EPX_GPU_TEST(LowLatency, ShrinkLeavesOutAMaskedRank) {
  auto& w = world();
  if (w.num_ranks < 2) GTEST_SKIP() << "needs a peer";
  const int R = w.num_ranks, dead = R / 2;
  LlCase c = shrink_case(R);
  c.masked = 0.1;
  auto bp = shrink_buffer(c, 20);
  Buffer& b = *bp;
  EXPECT_TRUE(b.shrink_enabled());
  // First all ranks together: the dead rank's slots then hold rows of
  // earlier ops, which must not be read.
  c.dead_rank = -1;
  run_case(c, 90, true, &b);
  c.dead_rank = dead;
  if (w.rank != dead) {
    EXPECT_EQ(query_mask(b), only_masked(R, -1));
    b.low_latency_update_mask_buffer(dead, true, w.stream);
    EXPECT_EQ(query_mask(b), only_masked(R, dead));
  }
  run_case(c, 91, true, &b);
  c.fp8 = true;
  c.hook = true;
  run_case(c, 92, true, &b);
  c.stats = true;
  c.hook = false;
  run_case(c, 93, true, &b);
  if (w.rank != dead) {
    // Unmask and mask again: the update writes what it is told.
    b.low_latency_update_mask_buffer(dead, false, w.stream);
    EXPECT_EQ(query_mask(b), only_masked(R, -1));
    b.low_latency_update_mask_buffer(dead, true, w.stream);
  }
  run_case(c, 94, true, &b);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// Nobody masks rank R/2, which makes no call: the first dispatch's waits for
/// it pass their deadline, mask it and complete without it (no error); the
/// ops after that do not wait for it. Then every rank cleans the mask and the
/// low-latency buffer, and all ranks, R/2 again too, run together.
EPX_GPU_TEST(LowLatency, ShrinkMasksARankAtItsDeadlineAndCleanBringsItBack) {
  auto& w = world();
  if (w.num_ranks < 2) GTEST_SKIP() << "needs a peer";
  const int R = w.num_ranks, dead = R / 2;
  constexpr double kDeadline = 2.0;
  LlCase c = shrink_case(R);
  c.fp8 = true;
  auto bp = shrink_buffer(c, kDeadline);
  Buffer& b = *bp;
  auto timed_case = [&](uint64_t seed) {  // seconds
    const auto t0 = std::chrono::steady_clock::now();
    run_case(c, seed, true, &b);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const double first_s = timed_case(95);
  if (w.rank != dead) {
    EXPECT_EQ(query_mask(b), only_masked(R, dead));
    EXPECT_GE(first_s, kDeadline) << "the first dispatch waited for the dead rank's deadline";
  }
  c.hook = true;
  const double second_s = timed_case(96);
  if (w.rank != dead) {
    EXPECT_LT(second_s, kDeadline / 2) << "a masked rank is not waited for";
    EXPECT_EQ(query_mask(b), only_masked(R, dead));
  }
  bring_back(b, c);
  c.dead_rank = -1;
  c.hook = false;
  run_case(c, 97, true, &b);
  EXPECT_EQ(query_mask(b), only_masked(R, -1));
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// Rank R/2 runs the dispatch, then stops: the others' combine finds it gone
/// at the deadline (the send's wait for its weights, the receive's for its
/// flag), masks it and completes with the sum over the experts left.
EPX_GPU_TEST(LowLatency, ShrinkARankThatStopsAfterTheDispatch) {
  auto& w = world();
  if (w.num_ranks < 2) GTEST_SKIP() << "needs a peer";
  const int R = w.num_ranks, dead = R / 2;
  LlCase c = shrink_case(R);
  auto bp = shrink_buffer(c, 2.0);
  Buffer& b = *bp;
  // First all ranks together (the dead rank's slots then hold older rows).
  c.dead_rank = -1;
  run_case(c, 97, true, &b);
  c.dead_rank = dead;
  c.dead_after_dispatch = true;
  run_case(c, 98, true, &b);
  if (w.rank != dead) EXPECT_EQ(query_mask(b), only_masked(R, dead));
  bring_back(b, c);
  c.dead_rank = -1;
  c.dead_after_dispatch = false;
  run_case(c, 99, true, &b);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// Sets (value) or unsets (nullptr) an environment variable on every rank:
/// in-process ranks share the environment, so the ranks set it one at a
/// time, between barriers that keep every rank out of EPX meanwhile.
void set_env_on_all_ranks(const char* name, const char* value) {
  static std::mutex m;
  ASSERT_TRUE(all_ranks(true));
  {
    std::lock_guard<std::mutex> lock(m);
    if (value != nullptr)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ASSERT_TRUE(all_ranks(true));
}

/// Rank R/2 dies in the middle of a dispatch: its token count, its token
/// masks and the rows of its first 5 tokens went out, its other rows did not
/// (EPX_DEBUG_LL_DISPATCH_STOP). The others wait for those rows until the
/// deadline, mask it and complete: in its node the rows that came are exact,
/// the others zero with their scales; in other nodes (virtual nodes) nothing
/// of it counts, its signal never came. The combine leaves its experts out. FP8 in one
/// kernel, then BF16 in hook mode (the dying rank runs no hook).
EPX_GPU_TEST(LowLatency, ShrinkARankThatDiesMidDispatch) {
  auto& w = world();
  if (w.num_ranks < 2) GTEST_SKIP() << "needs a peer";
  const int R = w.num_ranks, dead = R / 2;
  constexpr int kRowsSent = 5;
  LlCase c = shrink_case(R);
  c.dead_mid_dispatch = kRowsSent;
  const std::string stop = std::to_string(dead) + ":" + std::to_string(kRowsSent);
  std::unique_ptr<Buffer> bp;
  {
    // Unset again however this block ends, so no later buffer takes the knob.
    struct Unset {
      ~Unset() { ::unsetenv("EPX_DEBUG_LL_DISPATCH_STOP"); }
    } unset;
    ASSERT_NO_FATAL_FAILURE(set_env_on_all_ranks("EPX_DEBUG_LL_DISPATCH_STOP", stop.c_str()));
    bp = shrink_buffer(c, 2.0);  // reads it
    ASSERT_NO_FATAL_FAILURE(set_env_on_all_ranks("EPX_DEBUG_LL_DISPATCH_STOP", nullptr));
  }
  Buffer& b = *bp;
  c.fp8 = true;
  run_case(c, 100, true, &b);
  if (w.rank != dead) EXPECT_EQ(query_mask(b), only_masked(R, dead));
  bring_back(b, c);
  c.fp8 = false;
  c.hook = true;
  run_case(c, 101, true, &b);
  if (w.rank != dead) EXPECT_EQ(query_mask(b), only_masked(R, dead));
  bring_back(b, c);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// The mask calls need enable_shrink, a rank of the group and an int32 [R]
/// tensor on this GPU.
EPX_GPU_TEST(LowLatency, ShrinkArgumentsAreChecked) {
  auto& w = world();
  const int R = w.num_ranks;
  EXPECT_FALSE(w.buffer->shrink_enabled());
  expect_error("update without enable_shrink",
               [&] { w.buffer->low_latency_update_mask_buffer(0, true, w.stream); },
               {"low_latency_update_mask_buffer", "enable_shrink"});
  expect_error("clean without enable_shrink",
               [&] { w.buffer->low_latency_clean_mask_buffer(w.stream); },
               {"low_latency_clean_mask_buffer", "enable_shrink"});
  auto bp = shrink_buffer(shrink_case(R), 20);
  Buffer& b = *bp;
  const std::string got_r = "got " + std::to_string(R);
  expect_error("rank out of range", [&] { b.low_latency_update_mask_buffer(R, true, w.stream); },
               {"rank_to_mask", got_r.c_str()});
  expect_error("negative rank", [&] { b.low_latency_update_mask_buffer(-1, true, w.stream); },
               {"rank_to_mask", "got -1"});
  auto d64 = to_device(std::vector<int64_t>(R, 0));
  expect_error(
      "int64 mask_status",
      [&] { b.low_latency_query_mask_buffer(view(d64.get(), DType::kI64, {R}), w.stream); },
      {"low_latency_query_mask_buffer: mask_status", "int32"});
  auto d32 = to_device(std::vector<int>(R + 1, 0));
  expect_error(
      "mask_status of R + 1",
      [&] { b.low_latency_query_mask_buffer(view(d32.get(), DType::kI32, {R + 1}), w.stream); },
      {"mask_status", "must have shape"});
  EXPECT_EQ(query_mask(b), only_masked(R, -1));
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// The last rank starts its dispatch and its combine test_late_ms() after the others,
/// with and without hooks (see check_waits). The results are checked as always.
EPX_GPU_TEST(LowLatency, WaitCostStatsNameTheSlowRank) {
  if (world().num_ranks < 2) GTEST_SKIP() << "needs a peer";
  LlCase c;
  c.max_tokens = 32;
  c.hidden = 1024;
  c.fp8 = true;
  c.late_ms = test_late_ms();
  run_case(c, 21);
  c.hook = true;
  run_case(c, 22);
}

// ---- across nodes (virtual nodes over a network backend) -------------------------

/// Whether this world's buffer has peers in other nodes (EPX_RANKS_PER_NODE).
bool across_nodes() {
  return world().buffer->num_rdma_ranks() > 1;
}

/// Runs one LL dispatch and combine on `b`, returning the first epx::Error's
/// text ("" when both completed) and its code.
std::string ll_pair_error(Buffer& b, const LlCase& c, const LlInputs& in, ErrorCode& code) {
  auto& w = world();
  const int T = in.num_tokens[w.rank];
  auto d_x = to_device(in.x[w.rank]);
  auto d_topk = to_device(in.topk[w.rank]);
  auto d_w = to_device(in.weights[w.rank]);
  try {
    auto res = b.low_latency_dispatch(dispatch_args(c, d_x.get(), d_topk.get(), T));
    if (cudaStreamSynchronize(w.stream) != cudaSuccess) return "stream error";
    const int E_local = c.num_experts / w.num_ranks, RT = w.num_ranks * c.max_tokens;
    auto d_eo = to_device(std::vector<uint16_t>(static_cast<std::size_t>(E_local) * RT * c.hidden));
    LowLatencyCombineArgs ca;
    ca.x = view(d_eo.get(), DType::kBF16, {E_local, RT, c.hidden});
    ca.topk_idx = view(d_topk.get(), DType::kI64, {T, c.num_topk});
    ca.topk_weights = view(d_w.get(), DType::kF32, {T, c.num_topk});
    ca.handle = res.handle;
    ca.stream = w.stream;
    b.low_latency_combine(ca);
    if (cudaStreamSynchronize(w.stream) != cudaSuccess) return "stream error";
    b.low_latency_dispatch(dispatch_args(c, d_x.get(), d_topk.get(), T));  // raises a late error
    if (cudaStreamSynchronize(w.stream) != cudaSuccess) return "stream error";
  } catch (const Error& e) {
    code = e.code();
    return e.what();
  }
  return "";
}

/// A proxy thread that dies: rank R-1's proxy channel 0 stops after 3
/// commands (EPX_DEBUG_PROXY_STOP). Every rank raises within its deadline:
/// rank R-1 naming its proxy channel, ranks of other nodes naming rank R-1.
EPX_GPU_TEST(Network, ProxyThreadThatDiesIsNamedOnEveryRank) {
  auto& w = world();
  if (!across_nodes()) GTEST_SKIP() << "needs virtual nodes over a network backend";
  const int R = w.num_ranks, dying = R - 1;
  LlCase c;
  c.max_tokens = 16;
  c.hidden = 1024;
  c.num_experts = 4 * R;
  const std::string knob = std::to_string(dying) + ":0:3";
  std::unique_ptr<Buffer> bp;
  {
    struct Unset {
      ~Unset() { ::unsetenv("EPX_DEBUG_PROXY_STOP"); }
    } unset;
    ASSERT_NO_FATAL_FAILURE(set_env_on_all_ranks("EPX_DEBUG_PROXY_STOP", knob.c_str()));
    BufferOptions o = hint_sized_options(c, R, 2.0, poisoning_allocator());
    o.backend = "proxy";
    bp = std::make_unique<Buffer>(w.comm, o);
    ASSERT_NO_FATAL_FAILURE(set_env_on_all_ranks("EPX_DEBUG_PROXY_STOP", nullptr));
  }
  auto in = make_inputs(c, R, 900);
  const auto t0 = std::chrono::steady_clock::now();
  ErrorCode code = ErrorCode::kInternal;
  const std::string msg = ll_pair_error(*bp, c, in, code);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(msg.empty()) << "rank " << w.rank << ": no error although rank " << dying
                            << "'s proxy channel 0 stopped";
  EXPECT_LT(secs, 20.0) << msg;
  if (w.rank == dying) {
    EXPECT_NE(msg.find("proxy channel 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("EPX_DEBUG_PROXY_STOP"), std::string::npos) << msg;
  } else if (!same_node(w.rank, dying)) {
    // Only the dying rank's signals are missing here.
    EXPECT_NE(msg.find("rank " + std::to_string(dying)), std::string::npos) << msg;
  } else {
    // Its node-mates get its dispatch by load/store; their combine then waits
    // for ranks that all raised already, and names whichever deadline came first.
    EXPECT_NE(msg.find("rank "), std::string::npos) << msg;
  }
  ASSERT_TRUE(all_ranks(true));
  bp->destroy();
}

/// A rank that stops calling: rank 0 dispatches alone; the wait for a peer
/// of another node ends at the deadline with an error naming that peer and
/// the network signal awaited.
EPX_GPU_TEST(Network, SilentPeerOfAnotherNodeIsNamed) {
  auto& w = world();
  if (!across_nodes()) GTEST_SKIP() << "needs virtual nodes over a network backend";
  LlCase c;
  c.max_tokens = 16;
  c.hidden = 1024;
  c.num_experts = 4 * w.num_ranks;
  Buffer b(w.comm, hint_sized_options(c, w.num_ranks, 1.0, poisoning_allocator()));
  auto in = make_inputs(c, w.num_ranks, 901);
  auto d_x = to_device(in.x[w.rank]);
  auto d_topk = to_device(in.topk[w.rank]);
  if (w.rank == 0) {
    try {
      b.low_latency_dispatch(dispatch_args(c, d_x.get(), d_topk.get(), in.num_tokens[0]));
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      b.low_latency_dispatch(dispatch_args(c, d_x.get(), d_topk.get(), in.num_tokens[0]));
      ADD_FAILURE() << "expected a timeout";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      const std::string m = e.what();
      // Whoever it names, the wait it reports matches where that rank lives.
      const bool net = m.find("over the network") != std::string::npos;
      bool named = false;
      for (int r = 1; r < w.num_ranks; ++r)
        if (m.find("for rank " + std::to_string(r)) != std::string::npos) {
          named = true;
          EXPECT_EQ(net, !same_node(0, r)) << m;
        }
      EXPECT_TRUE(named) << m;
    }
  }
  ASSERT_TRUE(all_ranks(true));
  b.clean_low_latency_buffer(c.max_tokens, c.hidden, c.num_experts);
  // Every rank back in step: a full dispatch is right again.
  auto res =
      b.low_latency_dispatch(dispatch_args(c, d_x.get(), d_topk.get(), in.num_tokens[w.rank]));
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  auto ro = ref::ll_dispatch(in.x, in.topk, in.num_tokens, c.hidden, c.num_topk, c.num_experts,
                             c.max_tokens, false, false);
  EXPECT_EQ(to_host<int>(res.recv_count), ro[w.rank].recv_count);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// A killed process (one rank per process; EPX_TEST_KILL_RANK=r, run on its
/// own by the device script): rank r SIGKILLs itself before its second
/// dispatch; every other rank must raise within the deadline, naming it.
/// The survivors print "KILL-TEST rank N: PASS ..." and leave at once (their
/// collectives would wait for the dead rank), so the script reads the lines.
EPX_GPU_TEST(Network, KilledRankIsNamed) {
  auto& w = world();
  const char* kill = std::getenv("EPX_TEST_KILL_RANK");
  if (kill == nullptr || w.comm->in_process())
    GTEST_SKIP() << "set EPX_TEST_KILL_RANK, one process per rank (it ends the run)";
  const int victim = std::atoi(kill);
  LlCase c;
  c.max_tokens = 16;
  c.hidden = 1024;
  c.num_experts = 4 * w.num_ranks;
  Buffer b(w.comm, hint_sized_options(c, w.num_ranks, 3.0, poisoning_allocator()));
  auto in = make_inputs(c, w.num_ranks, 902);
  ErrorCode code = ErrorCode::kInternal;
  ASSERT_EQ(ll_pair_error(b, c, in, code), "");
  ASSERT_TRUE(all_ranks(true));
  if (w.rank == victim) ::raise(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = ll_pair_error(b, c, in, code);
  kill_test_verdict(victim, true, msg, code,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

/// A network that stops completing puts (the loopback GIN plugin's
/// EPX_GIN_LOOP_STALL_AFTER_S, nccl backend, one process per rank; run on
/// its own by the device script), for the low-latency ops: a dispatch of 128
/// tokens posts more descriptors to a peer than NCCL's GIN proxy queue holds
/// when it is 32 deep (the device script sets NCCL_GIN_PROXY_QUEUE_SIZE=32;
/// the loopback plugin's default depth gives 512), so after the stall a post
/// finds the queue full. The ranks must raise
/// within their deadline (the post's credit wait, a quiet or a signal wait,
/// whichever comes first), where NCCL's own wait for a queue slot would
/// hang. Prints "STALL-TEST rank N: PASS|FAIL ..." and leaves at once.
EPX_GPU_TEST(Network, StalledNetworkIsNamed) {
  auto& w = world();
  const auto stall = stall_after_s();
  if (!stall) GTEST_SKIP() << kStallTestSkip;
  LlCase c;
  c.max_tokens = 128;
  c.hidden = 2048;
  c.num_experts = 8 * w.num_ranks;
  Buffer b(w.comm, hint_sized_options(c, w.num_ranks, 3.0, poisoning_allocator()));
  const auto in = make_inputs(c, w.num_ranks, 903);
  run_stall_test(
      *stall, [&](ErrorCode& code) { return ll_pair_error(b, c, in, code); },
      {{"no free slot", "a queue credit"}, {"network quiet", "a wait"}, {"for rank ", "a wait"}});
}

/// The device checksum kernel against the host's: equal on random data of
/// several lengths (0, 1, not a multiple of the grid), different after a
/// swap or one changed bit, and the counts copied.
EPX_GPU_TEST(Network, SoakChecksum) {
  auto& w = world();
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1000003}}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    auto v = random_bf16(n, 77 + n);
    const std::vector<int> counts = {3, -1, 0, 1 << 30};
    auto dv = to_device(v);
    auto dc = to_device(counts);
    auto d_sum = to_device(std::vector<unsigned long long>(1, 0));
    auto d_out = to_device(std::vector<int>(counts.size(), 7));
    ASSERT_EQ(launch_pair_digest(dv.get(), n, dc.get(), static_cast<int>(counts.size()),
                                 d_sum.get(), d_out.get(), w.stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    const uint64_t sum = to_host(d_sum)[0];
    EXPECT_EQ(sum, bf16_checksum_host(v.data(), n));
    EXPECT_EQ(to_host(d_out), counts);
    if (n > 1) {
      std::swap(v[0], v[n - 1]);  // a moved value counts (unless the two are equal)
      if (v[0] != v[n - 1]) EXPECT_NE(bf16_checksum_host(v.data(), n), sum);
      std::swap(v[0], v[n - 1]);
      v[n / 2] ^= 1;
      EXPECT_NE(bf16_checksum_host(v.data(), n), sum);
    }
  }
}

/// A soak variable: unset gives nullopt; a decimal integer in [lo, hi] gives
/// it; anything else (empty, a sign, spaces, other characters, out of range)
/// fails the test naming the variable and the value, and sets `ok` false.
/// Every rank reads the same environment, so all of them fail alike, before
/// any collective step.
std::optional<long> soak_variable(const char* name, long lo, long hi, bool& ok) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  const std::string s(v);
  long x = -1;  // below every lo: anything unparsed fails the range check
  if (!s.empty() && s.size() <= 12 && s.find_first_not_of("0123456789") == std::string::npos)
    x = std::stol(s);
  if (x < lo || x > hi) {
    ADD_FAILURE() << name << "='" << s << "': must be a decimal integer in [" << lo << ", " << hi
                  << "]";
    ok = false;
    return std::nullopt;
  }
  return x;
}

/// A soak of more pairs than this would run for days: a typo, not a plan.
constexpr long kSoakMaxPairs = 100'000'000;
constexpr int kSoakSets = 16;
/// The set pair i uses: every set once in pairs 0 .. kSoakSets - 1 (7 is
/// prime to 16), then in a changing order.
int soak_set(long i) {
  return static_cast<int>((i * 7 + 3) % kSoakSets);
}
uint64_t soak_seed(int set) {
  return 7000 + static_cast<uint64_t>(set);
}

/// EPX_TEST_SOAK=N: N low-latency dispatch + combine pairs (fp8, the standard
/// decode shape) cycling over 16 seeded input sets (tokens, routing, weights
/// and expert outputs all differ between sets), checking data, not just the
/// absence of errors:
///  - the first pair of each set (pairs 0-15) is checked in full on the host:
///    the dispatch against ref::ll_dispatch (check_dispatch), the combined
///    output against ref::ll_combine (check_combine's tolerance), and the
///    device checksum of that output against the host's;
///  - every pair: a device kernel right behind the combine writes the
///    checksum of its combined output and a copy of its recv_count into
///    per-pair slots; every 500 pairs and at the end the host compares each
///    slot with its set's first pair (checksum) and the reference (counts),
///    naming the pair, the set and both values where they differ;
///  - neither device nor host memory grows after the first 500 pairs (each by
///    at most 64 MiB; with at least 1000 pairs).
/// A pair's checksum may be compared with its set's first one because the
/// LL combine is deterministic for identical inputs: the same routing,
/// weights and expert outputs give the same bits, whatever order the ranks'
/// rows arrive in (lines of src/kernels/low_latency/: dispatch_recv.cuh,
/// combine_send.cuh, combine_recv.cuh):
///  - the dispatch packs in rank order: an exclusive scan of the token masks
///    in (source, token) order gives every row and the combine plan's
///    {mask, first row} (dispatch_recv.cuh:229-243), a function of the
///    routing alone. check_dispatch proves it equal to the reference's on a
///    set's first pair; a later pair packed otherwise reads other expert rows and changes
///    the checksum;
///  - ll_combine_send collects the rows of a token's experts on this rank in
///    ascending local expert id (combine_send.cuh:224-230, plan_row :13) and
///    sums them with fmaf in that order (:331), with per-expert weights the
///    token's rank summed in k order (:167); a token with one expert there
///    gets the raw row (:266);
///  - ll_combine_recv waits for every source's combine flag before it reads
///    a row (combine_recv.cuh:115); then one lane per output column adds the
///    ranks' rows in ascending rank order (:197 within a node; across nodes
///    the sorted ranks, :140-151) and a raw row's picks in lane (k) order
///    (add_rank_row :64), and stores the column once (:170, :211): no
///    atomics, nothing in arrival order.
/// Under EPX_LL_ARRIVAL_ORDER=1 that packing follows arrival, while the
/// expert outputs are uploaded once in the reference's packing, so the
/// combined output is no function of the inputs: the combine checks are off
/// then (as in back_to_back), the dispatch and recv_count checks stay.
/// EPX_TEST_SOAK_SYNC=N: the host also waits for the stream every N pairs
/// (0, the default: only at the checks, so the host runs far ahead).
/// EPX_TEST_SOAK_LINEUP=1: before each pair the host waits for the stream and
/// the ranks meet in a barrier, so every pair starts together (over the
/// proxy, pairs of ranks that drift apart took 10-40 ms each on one host).
/// Progress every 10 s at most.
EPX_GPU_TEST(Network, Soak) {
  auto& w = world();
  if (std::getenv("EPX_TEST_SOAK") == nullptr) GTEST_SKIP() << "set EPX_TEST_SOAK=N pairs";
  bool env_ok = true;
  const auto pairs_env = soak_variable("EPX_TEST_SOAK", 1, kSoakMaxPairs, env_ok);
  const auto sync_env = soak_variable("EPX_TEST_SOAK_SYNC", 0, kSoakMaxPairs, env_ok);
  if (!env_ok) return;  // failed above, on every rank
  const long pairs = *pairs_env;
  const long sync_every = sync_env.value_or(0);
  const char* lineup_env = std::getenv("EPX_TEST_SOAK_LINEUP");
  const bool lineup = lineup_env != nullptr && lineup_env[0] == '1';
  const int R = w.num_ranks, me = w.rank;
  LlCase c;
  c.max_tokens = 128;
  c.hidden = 7168;
  c.num_experts = 256 % R == 0 ? 256 : 16 * R;
  c.fp8 = true;
  const int E_local = c.num_experts / R, RT = R * c.max_tokens, H = c.hidden, K = c.num_topk;
  const bool check_combined = !arrival_order();
  if (me == 0 && !check_combined)
    std::printf("soak: EPX_LL_ARRIVAL_ORDER=1: combined outputs not checked\n");
  std::vector<LlInputs> sets;
  std::vector<DeviceArray<uint16_t>> dx, d_eo(kSoakSets);
  std::vector<DeviceArray<int64_t>> dt;
  std::vector<DeviceArray<float>> dw;
  for (int k = 0; k < kSoakSets; ++k) {
    sets.push_back(make_inputs(c, R, soak_seed(k)));
    dx.push_back(to_device(sets[k].x[me]));
    dt.push_back(to_device(sets[k].topk[me]));
    dw.push_back(to_device(sets[k].weights[me]));
  }
  // Per set, from its first pair: the reference's recv_count and the
  // checksum of the combined output that was checked against the reference.
  std::vector<std::vector<int>> want_count(kSoakSets);
  std::vector<unsigned long long> want_sum(kSoakSets, 0);
  std::vector<char> seen(kSoakSets, 0);
  // Per pair since the last check point: [kCheckEvery] checksums (0 before
  // the pair's kernel adds to it) and [kCheckEvery, E_local] recv_count
  // copies (-1 before: a pair whose kernel never ran cannot match).
  constexpr long kCheckEvery = 500;
  auto d_sums = to_device(std::vector<unsigned long long>(kCheckEvery, 0));
  auto d_counts = to_device(std::vector<int>(static_cast<std::size_t>(kCheckEvery) * E_local, -1));
  auto reset_slots = [&] {
    return cudaMemsetAsync(d_sums.get(), 0, d_sums.n * sizeof(unsigned long long), w.stream) ==
               cudaSuccess &&
           cudaMemsetAsync(d_counts.get(), 0xff, d_counts.n * sizeof(int), w.stream) == cudaSuccess;
  };
  auto rss = [] {
    long pages = 0, resident = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
      std::fclose(f);
    }
    return resident * 4096;
  };
  std::size_t free0 = 0, total = 0;
  long rss0 = 0;
  long window = 0;             // the first pair whose slots are not checked yet
  long bad_pairs = 0;          // pairs whose checksum or recv_count differed
  constexpr long kShown = 10;  // of those, the first this many are reported one by one
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  w.comm->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  double next_report_s = 0.0;
  for (long i = 0; i < pairs; ++i) {
    const int k = soak_set(i);
    const int T = sets[k].num_tokens[me];
    const bool first = !seen[k];
    // The first pair of a set: its reference, made once for all in-process
    // ranks and held for this pair only (every rank's expert outputs of one
    // set are R x 470 MB on the host); this rank's expert outputs go up once.
    std::shared_ptr<const std::vector<ref::LlDispatchOutput>> ro;
    std::shared_ptr<const std::vector<std::vector<uint16_t>>> eo, rc;
    if (first) {
      const std::string key = "soak set " + std::to_string(k) + " " + c.key();
      const LlInputs& in = sets[k];
      ro = shared_reference<std::vector<ref::LlDispatchOutput>>("ll_dispatch " + key, [&] {
        return ref::ll_dispatch(in.x, in.topk, in.num_tokens, H, K, c.num_experts, c.max_tokens,
                                c.fp8, c.round_scale);
      });
      eo = shared_reference<std::vector<std::vector<uint16_t>>>(
          "expert_out " + key, [&] { return make_expert_out(c, R, *ro, soak_seed(k)); });
      rc = shared_reference<std::vector<std::vector<uint16_t>>>("ll_combine " + key, [&] {
        return ref::ll_combine(*eo, in.topk, in.weights, in.num_tokens, H, K, c.num_experts,
                               c.max_tokens, false);
      });
      want_count[k] = (*ro)[me].recv_count;
      ASSERT_EQ(want_count[k].size(), static_cast<std::size_t>(E_local));
      d_eo[k] = to_device((*eo)[me]);
    }
    // The first pairs line up too: the ranks' reference work ends seconds
    // apart, and a rank whose op waits that long for a peer reaches the deadline.
    if (lineup || first) {
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      w.comm->barrier();
    }
    auto res = w.buffer->low_latency_dispatch(dispatch_args(c, dx[k].get(), dt[k].get(), T));
    LowLatencyCombineArgs ca;
    ca.x = view(d_eo[k].get(), DType::kBF16, {E_local, RT, H});
    ca.topk_idx = view(dt[k].get(), DType::kI64, {T, K});
    ca.topk_weights = view(dw[k].get(), DType::kF32, {T, K});
    ca.handle = res.handle;
    ca.stream = w.stream;
    auto cres = w.buffer->low_latency_combine(ca);
    // The pair's digest, queued behind the combine on the same stream (no
    // host wait): its checksum and recv_count into the pair's slots.
    const long slot = i - window;
    ASSERT_EQ(launch_pair_digest(static_cast<const uint16_t*>(cres.combined_x.view.data),
                                 static_cast<std::size_t>(T) * H,
                                 static_cast<const int*>(res.recv_count.view.data), E_local,
                                 d_sums.get() + slot, d_counts.get() + slot * E_local, w.stream),
              cudaSuccess);
    if (first) {
      seen[k] = 1;
      SCOPED_TRACE("pair " + std::to_string(i) + ", the first of set " + std::to_string(k));
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      check_dispatch(c, sets[k], res, (*ro)[me]);
      const auto got = to_host<uint16_t>(cres.combined_x);
      if (check_combined) check_combine(c, sets[k], *ro, *eo, got, (*rc)[me]);
      want_sum[k] = to_host<unsigned long long>(d_sums.get() + slot, 1)[0];
      EXPECT_EQ(want_sum[k], bf16_checksum_host(got.data(), got.size()))
          << "the device's checksum of the combined output against the host's";
      // Every rank stops here if any failed (the later pairs would compare
      // against a wrong first combine).
      ASSERT_TRUE(all_ranks(!rank_failed()));
    }
    if (sync_every > 0 && i % sync_every == sync_every - 1)
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    if (slot + 1 == kCheckEvery || i + 1 == pairs) {
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      const auto n = static_cast<std::size_t>(slot + 1);
      const auto sums = to_host<unsigned long long>(d_sums.get(), n);
      const auto counts = to_host<int>(d_counts.get(), n * E_local);
      for (std::size_t s = 0; s < n; ++s) {
        const long j = window + static_cast<long>(s);
        const int kj = soak_set(j);
        const bool sum_ok = !check_combined || sums[s] == want_sum[kj];
        const auto at = counts.begin() + static_cast<std::ptrdiff_t>(s * E_local);
        const auto diff = std::mismatch(at, at + E_local, want_count[kj].begin());
        const bool count_ok = diff.first == at + E_local;
        if (sum_ok && count_ok) continue;
        if (++bad_pairs > kShown) continue;
        if (!sum_ok)
          ADD_FAILURE() << "pair " << j << " (set " << kj << "): combined output checksum 0x"
                        << std::hex << sums[s] << ", the set's first combine (checked against "
                        << "the reference) 0x" << want_sum[kj] << std::dec;
        if (!count_ok)
          ADD_FAILURE() << "pair " << j << " (set " << kj << "): recv_count[" << (diff.first - at)
                        << "] = " << *diff.first << ", reference " << *diff.second;
      }
      ASSERT_TRUE(reset_slots());
      window = i + 1;
      if (i + 1 == kCheckEvery) {  // the baseline of the memory checks
        ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
        rss0 = rss();
      }
      // Progress on rank 0, every 10 s at most (flushed: a log cut by a
      // timeout still shows how far it got).
      const double sec =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (me == 0 && (sec >= next_report_s || i + 1 == pairs)) {
        std::printf("soak: %ld / %ld pairs, %.1f s, %ld bad\n", i + 1, pairs, sec, bad_pairs);
        std::fflush(stdout);
        next_report_s = sec + 10.0;
      }
    }
  }
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  ASSERT_NO_THROW(w.buffer->check());
  EXPECT_EQ(bad_pairs, 0) << "pairs of " << pairs << " whose combined output or recv_count "
                          << "differed (the first " << kShown << " are named above)";
  std::size_t free1 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  const long rss1 = rss();
  if (pairs >= 2 * kCheckEvery) {
    EXPECT_LE(static_cast<long long>(free0) - static_cast<long long>(free1), 64ll << 20)
        << "device memory grew";
    EXPECT_LE(rss1 - rss0, 64l << 20) << "host memory grew";
  }
  if (me == 0)
    std::printf("soak: %ld pairs in %.1f s; device free %zu -> %zu, host RSS %ld -> %ld\n", pairs,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), free0,
                free1, rss0, rss1);
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

TEST(LowLatency, SizeHint) {
  // Standard decode workload: 128 tokens, hidden 7168, 256 experts.
  for (int R : {2, 4, 8}) {
    const std::size_t core_and_zero_copy =
        Buffer::get_low_latency_rdma_size_hint(128, 7168, R, 256);
    // The zero-copy inputs alone are 2 x [E_local, R*maxT, H] bf16.
    EXPECT_GE(core_and_zero_copy, 2ull * (256 / R) * R * 128 * 7168 * 2);
  }
  EXPECT_THROW(Buffer::get_low_latency_rdma_size_hint(128, 7168, 4, 255), Error);
}

}  // namespace
}  // namespace epx::test
