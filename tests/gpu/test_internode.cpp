// High-throughput dispatch and combine across (virtual) nodes on the local
// GPUs vs the CPU reference: the two-level route through the whole-call
// kernels and the rings, worst-token dispatches and graphs, refusals and
// faults named.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/internode_rings.hpp"
#include "common/internode_route.hpp"
#include "epx/reference.hpp"
#include "gpu/harness.hpp"
#include "gpu/ht_cases.hpp"

namespace epx::test {
namespace {

using namespace ht;  // NOLINT(build/namespaces): the shared cases and checks

// ---- across (virtual) nodes: the two-level dispatch and combine ----------------
// The same cases through the network and NVLink forwarding, against the same
// reference; the combine must match the reference's node-grouped sums bit
// for bit (run_case).

EPX_GPU_TEST(Internode, Bf16Hidden7168) {
  run_case({512, 7168, 8, 256, false, 0.1, true, 1, false}, 2, 311);
}
EPX_GPU_TEST(Internode, Fp8Hidden7168) {
  run_case({512, 7168, 8, 256, true, 0.1, true, 1, false}, 2, 312);
}
EPX_GPU_TEST(Internode, HiddenSizesNoWeights) {
  for (int h : {256, 2880}) run_case({300, h, 8, 64, false, 0.05, false, 1, false}, 1, 313 + h);
}
EPX_GPU_TEST(Internode, NodeReceivesNothing) {
  HtCase c{256, 2048, 4, 64, false, 0.0, true, 1, false};
  c.starve_node1 = true;
  run_case(c, 1, 314);
}
EPX_GPU_TEST(Internode, RankReceivesNothing) {
  run_case({256, 2048, 4, 64, false, 0.0, true, 1, true}, 1, 315);
}
EPX_GPU_TEST(Internode, OneAndZeroTokens) {
  run_case({1, 2048, 8, 64, false, 0.0, true, 1, false}, 1, 316);
  run_case({0, 2048, 8, 64, false, 0.0, true, 1, false}, 1, 317);
}
EPX_GPU_TEST(Internode, ExpertAlignmentAndMaskedRows) {
  run_case({333, 4096, 6, 48, false, 0.5, true, 128, false}, 1, 318);
}
EPX_GPU_TEST(Internode, Stress200Calls) {
  stress_calls(200, std::nullopt);
}
/// The fuzzed valid sets across nodes (fuzzed_valid_sets).
EPX_GPU_TEST(Internode, FuzzedValidSets) {
  fuzzed_valid_sets(12, 20261128, true);
}
/// DeepEP users' calls as the Python suite makes them, with no host wait
/// between the ops (run_case waits after each): dispatch, cached dispatch,
/// then three combines of the dispatched rows (identity experts) on the same
/// handle: with weights and two biases, plain, with weights only; every
/// output against the reference, for three fresh sets of routing and rows.
/// With a process per rank the three sets run again on the legacy default
/// stream, which is where PyTorch's current stream sends them. The Python
/// suite's 4 processes as 2x2 got a plain combine after a weighted one wrong
/// on one pair of ranks (4x H200, proxy).
EPX_GPU_TEST(Internode, OpSequenceWithoutHostWaits) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, rpn = w.buffer->num_nvl_ranks();
  if (rpn == R) GTEST_SKIP() << "needs ranks in several nodes";
  const int H = 512, K = 4, E = 8 * R;
  // (in-process ranks may not share the legacy stream: Buffer refuses it)
  const int sets = in_process_worlds().empty() ? 6 : 3;
  for (int rep = 0; rep < sets; ++rep) {
    StreamArgs s;
    s.stream = rep < 3 ? w.stream : cudaStreamLegacy;
    const HtCase c{80 + 13 * (rep % 3), H, K, E, false, 0.1, true, 1, false};
    const auto in = make_inputs(c, R, 400 + rep % 3);
    const auto ro = ref::ht_dispatch(in, H, K, E, 1);
    DeviceInput d(*w.buffer, in[me], H, K, E, s);
    const int T = d.T;
    auto res = w.buffer->dispatch(d.a);
    DispatchArgs cached;
    cached.x = d.a.x;
    cached.handle = res.handle;
    cached.streams = s;
    auto again = w.buffer->dispatch(cached);

    // The combines' inputs on every rank: [0] weights and biases, [1] plain, [2] weights.
    std::vector<ref::HtCombineInput> cin[3];
    for (auto& v : cin) v.resize(R);
    for_each_rank(R, [&](int r) {
      for (auto& v : cin) v[r].x = ro[r].recv_x_bf16;
      cin[0][r].topk_weights = cin[2][r].topk_weights = ro[r].recv_topk_weights;
      const auto n = static_cast<std::size_t>(in[r].num_tokens) * H;
      cin[0][r].bias_0 = random_bf16(n, 500 + rep * 16 + r);
      cin[0][r].bias_1 = random_bf16(n, 600 + rep * 16 + r);
    });
    auto d_b0 = to_device(cin[0][me].bias_0);
    auto d_b1 = to_device(cin[0][me].bias_1);
    std::vector<CombineResult> out;
    for (int k = 0; k < 3; ++k) {
      CombineArgs ca;
      ca.x = res.recv_x.view;
      ca.handle = res.handle;
      if (k != 1) ca.topk_weights = res.recv_topk_weights->view;
      if (k == 0) {
        ca.bias_0 = view(d_b0.get(), DType::kBF16, {T, H});
        ca.bias_1 = view(d_b1.get(), DType::kBF16, {T, H});
      }
      ca.streams = s;
      out.push_back(w.buffer->combine(ca));
    }
    ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
    const std::string at = "set " + std::to_string(rep % 3) +
                           (rep < 3 ? " on the test's stream" : " on the legacy default stream");
    EXPECT_EQ(to_host<uint16_t>(res.recv_x), ro[me].recv_x_bf16) << at << ": dispatch";
    EXPECT_EQ(to_host<uint16_t>(again.recv_x), ro[me].recv_x_bf16) << at << ": cached dispatch";
    static constexpr const char* kNames[] = {"weights and biases", "plain", "weights"};
    for (int k = 0; k < 3; ++k) {
      const auto want = ref::ht_combine(in, cin[k], H, K, E, rpn)[me];
      EXPECT_EQ(to_host<uint16_t>(out[k].combined_x), want.combined_x)
          << at << ": combine with " << kNames[k] << " (combined_x not bit-exact)";
      if (k == 1) continue;
      const auto gw = to_host<float>(*out[k].combined_topk_weights);
      ASSERT_EQ(gw.size(), want.combined_topk_weights.size());
      for (std::size_t i = 0; i < gw.size(); ++i)
        ASSERT_NEAR(gw[i], want.combined_topk_weights[i], 1e-5f) << at << " weight " << i;
    }
    ASSERT_TRUE(all_ranks(!rank_failed())) << "another rank failed, " << at;
  }
}
/// The combine's inputs with identity experts: each rank's x is the rows it
/// received.
std::vector<ref::HtCombineInput> received_rows_as_x(const std::vector<ref::HtDispatchOutput>& ro) {
  std::vector<ref::HtCombineInput> cin(ro.size());
  for (std::size_t r = 0; r < ro.size(); ++r) cin[r].x = ro[r].recv_x_bf16;
  return cin;
}

/// A buffer for num_worst_tokens across nodes, whose areas the buffer fixes:
/// slots with room for every token of a rank, a 20 s deadline, outputs
/// poisoned.
BufferOptions worst_tokens_options(const HtCase& c) {
  const auto& w = world();
  BufferOptions o;
  o.num_nvl_bytes = static_cast<int64_t>(Buffer::get_internode_nvl_size_hint(
      c.num_tokens + 16, c.hidden, w.num_ranks, w.buffer->num_nvl_ranks(), c.num_topk));
  o.timeout_s = 20.0;
  o.allocator = poisoning_allocator(w.comm->in_process());
  return o;
}

/// EPX_HT_RINGS as the buffers read it: -1 unset (the rings where a call
/// does not fit), 0 never the rings, N >= 1 always.
int ht_rings_mode() {
  const char* rings = std::getenv("EPX_HT_RINGS");
  return rings != nullptr ? std::atoi(rings) : -1;
}

/// Whether every high-throughput op across nodes takes the rings.
bool through_rings() {
  return ht_rings_mode() > 0;
}

/// A call whose whole-call areas do not fit num_nvl_bytes raises
/// kBufferTooSmall naming it on every rank, before any kernel; so does one
/// with num_worst_tokens whose stage does not fit (or, through the rings,
/// whose rings do not); the buffer
/// works afterwards.
EPX_GPU_TEST(Internode, RefusedCallsAreNamed) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  BufferOptions o;
  o.num_nvl_bytes = 1 << 20;
  o.timeout_s = 20;
  o.allocator = poisoning_allocator(w.comm->in_process());
  Buffer b(w.comm, o);
  StreamArgs s;
  s.stream = w.stream;
  const HtCase c{256, 7168, 8, 64, false, 0.0, false, 1, false};
  auto in = make_inputs(c, R, 319);
  const auto& mine = in[me];
  auto d_topk = to_device(mine.topk_idx);
  auto d_x = to_device(mine.x_bf16);
  auto layout = b.get_dispatch_layout(view(d_topk.get(), DType::kI64, {mine.num_tokens, 8}), 64, s);
  DispatchArgs a;
  a.x = view(d_x.get(), DType::kBF16, {mine.num_tokens, c.hidden});
  a.topk_idx = view(d_topk.get(), DType::kI64, {mine.num_tokens, 8});
  a.set_layout(layout);
  a.streams = s;
  Config cfg = shared_gpu_config();
  // Network rings of 64 records (only the rings read it): never within the
  // buffer's 1.5 MB here, as rings of 4 (EPX_HT_RINGS=4) of 2 channels at
  // 4x4 are (1.4 MB), which rightly take the call instead of refusing it.
  cfg.num_max_rdma_recv_tokens = 64;
  a.config = cfg;
  expect_error(
      "whole call in 1 MiB", [&] { b.dispatch(a); }, {"num_nvl_bytes", "bytes"},
      ErrorCode::kBufferTooSmall);
  a.num_worst_tokens = 4096;  // a stage of 4096 rows does not fit 1 MiB either
  // Through the rings (EPX_HT_RINGS) the rings themselves do not fit first,
  // and the error names them instead of num_worst_tokens.
  expect_error(
      "num_worst_tokens in 1 MiB", [&] { b.dispatch(a); },
      {"num_nvl_bytes", through_rings() ? "rings" : "num_worst_tokens"},
      ErrorCode::kBufferTooSmall);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
  run_case({64, 256, 4, 8 * R, false, 0.1, true, 1, false}, 1, 320);
}

/// By default (EPX_HT_RINGS unset) a dispatch whose whole-call areas, or
/// its combine's, do not fit num_nvl_bytes takes the rings instead: on a
/// buffer just large enough for the rings (6 SMs: 2 channels; network rings
/// of 64 records) and their state block, 64 tokens per rank take the
/// whole-call kernels and 4096 the rings (dispatch, cached dispatch and
/// combine against the reference each time). With EPX_HT_RINGS = 0 the 4096
/// raise kBufferTooSmall naming num_nvl_bytes; with it forced on both take
/// the rings.
EPX_GPU_TEST(Internode, CallsThatDoNotFitTakeTheRings) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, L = w.buffer->num_nvl_ranks();
  const int mode = ht_rings_mode();
  const HtCase few{64, 512, 4, 8 * R, false, 0.1, true, 1, false};
  HtCase many = few;
  many.num_tokens = 4096;
  Config cfg = shared_gpu_config();
  cfg.num_sms = 6;
  cfg.num_max_rdma_recv_tokens = 64;
  cfg.num_max_rdma_send_tokens = 16;
  const plan::HtRingGeometry g = plan::HtRingGeometry::of(
      std::max(mode, 1), cfg.num_sms, cfg.num_max_rdma_send_tokens, cfg.num_max_rdma_recv_tokens);
  const Topology topo{R, L};
  const std::size_t record = plan::ht_net_record_bytes(2 * few.hidden, 0, few.num_topk, L);
  const std::size_t row = plan::ht_combine_row_bytes(few.hidden, few.num_topk);
  const std::size_t head = plan::HtNetRegion::body(R), huge = std::size_t{1} << 46;
  const std::size_t rings_end =
      std::max(plan::HtRingRegion::make(topo, g, record, head, huge).rings_end,
               plan::HtRingRegion::make_combine(topo, g, row, head, huge).rings_end);
  BufferOptions o;
  o.num_nvl_bytes = static_cast<int64_t>(plan::align_up(
      rings_end + plan::HtRingRegion::state_bytes(topo) + plan::kAlign, plan::kAlign));
  o.timeout_s = 30;
  o.allocator = poisoning_allocator(w.comm->in_process());
  Buffer b(w.comm, o);
  int rings = 0;
  run_case(few, 1, 907, cfg, &b, &rings);
  EXPECT_EQ(rings, mode > 0 ? 1 : 0) << "64 tokens, EPX_HT_RINGS mode " << mode;
  if (mode == 0) {
    StreamArgs s;
    s.stream = w.stream;
    const auto in = make_inputs(many, R, 908);
    DeviceInput d(b, in[me], many.hidden, many.num_topk, many.num_experts, s);
    d.a.config = cfg;
    expect_error(
        "4096 tokens without the rings", [&] { b.dispatch(d.a); }, {"num_nvl_bytes"},
        ErrorCode::kBufferTooSmall);
    EXPECT_TRUE(all_ranks(!rank_failed()));
    return;
  }
  rings = 0;
  run_case(many, 2, 909, cfg, &b, &rings);
  EXPECT_EQ(rings, 2) << "4096 tokens";
}

/// num_worst_tokens across nodes: no host wait (the counts are exchanged on
/// the GPU), outputs of num_worst_tokens rows whose tail names no expert.
/// Then dispatch + combine captured in a CUDA graph and replayed with other
/// routing and rows copied into the captured inputs: each replay matches the
/// reference of its own inputs, the combine bit for bit (the count exchange
/// and the route run on the GPU at every replay).
EPX_GPU_TEST(Internode, WorstTokensAndGraphReplay) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, L = w.buffer->num_nvl_ranks();
  const HtCase c{96, 512, 4, 8 * R, false, 0.1, true, 1, false};
  const int H = c.hidden, K = c.num_topk, E = c.num_experts;
  const int worst = (c.num_tokens + 1) * R;
  constexpr int kSets = 3;
  std::vector<std::vector<ref::HtInput>> ins;
  std::vector<std::vector<ref::HtDispatchOutput>> ros;
  std::vector<std::vector<ref::HtCombineInput>> cins;
  for (int i = 0; i < kSets; ++i) {
    ins.push_back(make_inputs(c, R, 400 + i));
    ros.push_back(ref::ht_dispatch(ins[i], H, K, E, 1));
    cins.push_back(received_rows_as_x(ros[i]));
  }
  const int T = ins[0][me].num_tokens;
  // The areas are fixed by the buffer: a stage of `worst` rows, and slots
  // with room for every token of a rank.
  Buffer b(w.comm, worst_tokens_options(c));
  StreamArgs s;
  s.stream = w.stream;
  DeviceInput d(b, ins[0][me], H, K, E, s);
  DispatchArgs& a = d.a;
  a.num_worst_tokens = worst;
  a.config = shared_gpu_config();
  // Checks set i's outputs: the first N rows (and the tail's top-k), the combine.
  auto check = [&](int i, const Tensor& recv_x, const Tensor& recv_idx, const Tensor& combined,
                   const char* what) {
    const auto& ro = ros[i][me];
    const int N = ro.num_recv_tokens;
    ASSERT_EQ(recv_x.size(0), worst) << what;
    auto gx = to_host<uint16_t>(recv_x);
    gx.resize(static_cast<std::size_t>(N) * H);
    ASSERT_EQ(gx, ro.recv_x_bf16) << what << ": set " << i;
    auto gi = to_host<int64_t>(recv_idx);
    std::vector<int64_t> head(gi.begin(), gi.begin() + static_cast<std::ptrdiff_t>(N) * K);
    ASSERT_EQ(head, ro.recv_topk_idx) << what << ": set " << i;
    for (std::size_t j = static_cast<std::size_t>(N) * K; j < gi.size(); ++j)
      ASSERT_EQ(gi[j], -1) << what << ": tail row " << j / K;
    const auto rc = ref::ht_combine(ins[i], cins[i], H, K, E, L);
    ASSERT_EQ(to_host<uint16_t>(combined), rc[me].combined_x) << what << ": set " << i;
  };
  auto pair = [&](Tensor& rx, Tensor& ri, Tensor& cx) {
    auto r1 = b.dispatch(a);
    CombineArgs ca;
    ca.x = r1.recv_x.view;  // identity experts: the received rows, the tail unused
    ca.handle = r1.handle;
    ca.streams = s;
    ca.config = a.config;
    auto r2 = b.combine(ca);
    rx = r1.recv_x;
    ri = *r1.recv_topk_idx;
    cx = r2.combined_x;
    EXPECT_TRUE(r1.num_recv_tokens_per_expert.empty()) << "no host counts without a host wait";
  };
  Tensor ex, ei, ec;  // the eager pair's outputs (freed after the capture, not during it)
  pair(ex, ei, ec);
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  b.check();
  check(0, ex, ei, ec, "eager");

  Tensor rx, ri, cx;
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  pair(rx, ri, cx);
  ASSERT_EQ(cudaStreamEndCapture(w.stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_TRUE(instantiate_on_every_rank(graph, &exec, w.stream));
  for (int rep = 0; rep < 6; ++rep) {
    const int i = (rep + 1) % kSets;
    // New inputs into the captured ones: rows, routing, and its layout.
    const auto& mine = ins[i][me];
    auto cp = [&](void* dst, const void* src, std::size_t bytes) {
      ASSERT_EQ(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, w.stream), cudaSuccess);
    };
    cp(d.x.get(), mine.x_bf16.data(), mine.x_bf16.size() * 2);
    cp(d.topk.get(), mine.topk_idx.data(), mine.topk_idx.size() * 8);
    cp(d.w.get(), mine.topk_weights.data(), mine.topk_weights.size() * 4);
    auto rl = ref::get_dispatch_layout(mine.topk_idx, T, K, E, R);
    cp(d.layout.num_tokens_per_rank.view.data, rl.num_tokens_per_rank.data(), R * 4);
    cp(d.layout.num_tokens_per_expert.view.data, rl.num_tokens_per_expert.data(), E * 4);
    cp(d.layout.is_token_in_rank.view.data, rl.is_token_in_rank.data(), rl.is_token_in_rank.size());
    // Poison the graph's outputs (fixed addresses across launches; graph-owned
    // memory exists once the graph has run, and the allocator poisoned it then).
    if (rep > 0)
      for (const Tensor* t : {&rx, &ri, &cx})
        ASSERT_EQ(cudaMemsetAsync(t->view.data, 0xff, t->view.nbytes(), w.stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, w.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    b.check();
    check(i, rx, ri, cx, "replay");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// num_worst_tokens below what a rank receives: the rows past it are dropped
/// and reported (Buffer::check names num_worst_tokens), the combine after it
/// still finishes, through the rings too (their combine must not wait for the
/// dropped rows' returns), and the buffer's next pair with a large enough
/// num_worst_tokens matches the reference bit for bit (the rings' running
/// counts stayed in step).
EPX_GPU_TEST(Internode, WorstTokensOverflowIsNamedAndCombineFinishes) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, L = w.buffer->num_nvl_ranks();
  const HtCase c{96, 512, 4, 8 * R, false, 0.1, true, 1, false};
  const int H = c.hidden, K = c.num_topk, E = c.num_experts;
  const auto in = make_inputs(c, R, 333);
  const auto ro = ref::ht_dispatch(in, H, K, E, 1);
  const auto rc = ref::ht_combine(in, received_rows_as_x(ro), H, K, E, L);
  Buffer b(w.comm, worst_tokens_options(c));
  StreamArgs s;
  s.stream = w.stream;
  DeviceInput d(b, in[me], H, K, E, s);
  d.a.config = shared_gpu_config();
  // The pair is enqueued behind a gate that every rank opens only when all
  // have enqueued it: otherwise a rank whose host sees the dispatch's
  // overflow before it calls combine raises it there ("previous op", as the
  // API says), skips the combine, and its peers' combine times out (4
  // in-process ranks on one GPU did, at f3bfc92). The gate makes every rank
  // reach the case this test is about: a combine enqueued behind an
  // overflowed dispatch.
  auto pair = [&](int worst) {
    StreamGate gate(w.stream);
    d.a.num_worst_tokens = worst;
    auto r1 = b.dispatch(d.a);
    CombineArgs ca;
    ca.x = r1.recv_x.view;
    ca.handle = r1.handle;
    ca.streams = s;
    ca.config = d.a.config;
    auto r2 = b.combine(ca);
    EXPECT_TRUE(all_ranks(true));
    gate.open();
    EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    EXPECT_FALSE(gate.held_too_long()) << "the ranks took more than 60 s to enqueue the pair";
    return r2.combined_x;
  };
  const int small = 4;  // every rank receives far more rows than this
  ASSERT_GT(ro[me].num_recv_tokens, small);
  pair(small);
  expect_error(
      "check after num_worst_tokens overflowed", [&] { b.check(); }, {"num_worst_tokens"},
      ErrorCode::kInvalidArgument);
  ASSERT_TRUE(all_ranks(!rank_failed())) << "the overflow was not reported on every rank";
  const Tensor combined = pair((c.num_tokens + 1) * R);
  b.check();
  EXPECT_EQ(to_host<uint16_t>(combined), rc[me].combined_x)
      << "the pair after the overflow differs from the reference";
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

/// A buffer across nodes for case c (its deadline `timeout_s`), this rank's
/// inputs on the device, and a first dispatch with weights, synchronized.
struct NetFirstDispatch {
  std::unique_ptr<Buffer> b;
  std::optional<DeviceInput> in;  ///< this rank's input and DispatchArgs over it
  DispatchResult res;
  NetFirstDispatch(const HtCase& c, double timeout_s, uint64_t seed) {
    auto& w_ = world();
    const int R = w_.num_ranks;
    const auto all = make_inputs(c, R, seed);
    int most = 0;  // every rank sizes its buffer alike
    for (const auto& r : all) most = std::max(most, r.num_tokens);
    BufferOptions o;
    o.num_nvl_bytes = static_cast<int64_t>(Buffer::get_internode_nvl_size_hint(
        most, c.hidden, R, w_.buffer->num_nvl_ranks(), c.num_topk));
    o.timeout_s = timeout_s;
    o.allocator = poisoning_allocator(w_.comm->in_process());
    b = std::make_unique<Buffer>(w_.comm, o);
    StreamArgs s;
    s.stream = w_.stream;
    in.emplace(*b, all[w_.rank], c.hidden, c.num_topk, c.num_experts, s);
    in->a.config = shared_gpu_config();
    res = b->dispatch(in->a);
    EXPECT_EQ(cudaStreamSynchronize(w_.stream), cudaSuccess);
  }
  /// A cached dispatch of `x` (the first dispatch's rows by default).
  DispatchResult cached(std::optional<TensorView> rows = std::nullopt) {
    DispatchArgs d;
    d.x = rows.value_or(in->a.x);
    d.handle = res.handle;
    d.streams = in->a.streams;
    d.config = in->a.config;
    return b->dispatch(d);
  }
  /// A combine of the received rows, with their weights or without.
  CombineResult combine(bool weights) {
    CombineArgs ca;
    ca.x = res.recv_x.view;
    ca.handle = res.handle;
    if (weights) ca.topk_weights = res.recv_topk_weights->view;
    ca.streams = in->a.streams;
    ca.config = in->a.config;
    return b->combine(ca);
  }
};

/// A rank that does not come to an op is named by the others within the
/// deadline, never a hang: rank 0 alone makes a cached dispatch; its barrier
/// waits for every other rank and reports one of them.
EPX_GPU_TEST(Internode, SilentPeerIsNamed) {
  auto& w = world();
  const HtCase c{64, 256, 4, 8 * w.num_ranks, false, 0.1, true, 1, false};
  NetFirstDispatch f(c, 1.0, 321);
  if (w.rank == 0) {
    try {
      f.cached();
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      f.b->check();
      ADD_FAILURE() << "expected a timeout";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      const std::string m = e.what();
      bool named = false;
      for (int r = 1; r < w.num_ranks; ++r)
        named |= m.find("for rank " + std::to_string(r)) != std::string::npos;
      EXPECT_TRUE(named) << m;
      EXPECT_NE(m.find("arrival at the op"), std::string::npos) << m;
    }
  }
  EXPECT_TRUE(all_ranks(!rank_failed()));
  f.b->destroy();
}

/// Ranks whose rows differ in shape are refused by name on every rank, and
/// nothing moves: the barrier compares each op's shape. A cached dispatch
/// (no count exchange) where the last rank passes half the hidden size, then
/// (on a fresh buffer: a refused op leaves the first one unusable, as a
/// timeout does) a combine where the last rank passes no topk_weights.
EPX_GPU_TEST(Internode, ShapeMismatchIsNamed) {
  auto& w = world();
  const int me = w.rank, odd = w.num_ranks - 1;
  const HtCase c{64, 256, 4, 8 * w.num_ranks, false, 0.1, true, 1, false};
  for (const bool combine : {false, true}) {
    NetFirstDispatch f(c, 5.0, 322);
    auto half =
        to_device(std::vector<uint16_t>(static_cast<std::size_t>(f.in->T) * c.hidden / 2, 0));
    const char* field = combine ? "topk_weights (top-k)" : "x (hidden bytes)";
    try {
      if (combine)
        f.combine(me != odd);
      else  // rows half as wide on the last rank
        f.cached(me == odd ? view(half.get(), DType::kBF16, {f.in->T, c.hidden / 2}) : f.in->a.x);
      ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      f.b->check();
      ADD_FAILURE() << field << ": expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      const std::string m = e.what();
      EXPECT_NE(m.find(field), std::string::npos) << m;
      // The others name the last rank; it names whichever of them it saw first.
      bool named = false;
      for (int r = 0; r < w.num_ranks; ++r)
        if ((me == odd) != (r == odd))
          named |= m.find("rank " + std::to_string(r) + " passed") != std::string::npos;
      EXPECT_TRUE(named) << m;
    }
    EXPECT_TRUE(all_ranks(!rank_failed()));
    f.b->destroy();
  }
}

/// Runs a killed-process test (EPX_TEST_KILL_RANK=r, one process per rank;
/// run on its own by the device script): a dispatch and a combine across
/// nodes, then rank r SIGKILLs itself and every other rank runs `after` (ops
/// that need the dead rank), which must raise a timeout within 30 s, naming
/// it where `names_rank` (a collective of the communicator cannot tell who
/// did not come). The survivors print "KILL-TEST rank N: PASS ..." and leave
/// at once (their collectives would wait for the dead rank), so the device
/// script reads the lines.
void killed_rank_test(const std::function<void(NetFirstDispatch&)>& after, bool names_rank) {
  auto& w = world();
  const char* kill = std::getenv("EPX_TEST_KILL_RANK");
  if (kill == nullptr || w.comm->in_process())
    GTEST_SKIP() << "set EPX_TEST_KILL_RANK, one process per rank (it ends the run)";
  const int victim = std::atoi(kill);
  const HtCase c{128, 1024, 4, 8 * w.num_ranks, false, 0.1, true, 1, false};
  NetFirstDispatch f(c, 3.0, 323);
  f.combine(true);
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  f.b->check();
  ASSERT_TRUE(all_ranks(true));
  if (w.rank == victim) ::raise(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg = "no error";
  ErrorCode code = ErrorCode::kInternal;
  try {
    after(f);
    cudaStreamSynchronize(w.stream);
    f.b->check();
  } catch (const Error& e) {
    msg = e.what();
    code = e.code();
  }
  kill_test_verdict(victim, names_rank, msg, code,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

/// After the kill, a cached dispatch and a combine (the kernels' waits).
EPX_GPU_TEST(Internode, KilledRankIsNamed) {
  killed_rank_test(
      [](NetFirstDispatch& f) {
        f.cached();
        f.combine(true);
      },
      true);
}

/// After the kill, a dispatch with its host count exchange: the
/// communicator's allgather must give up at its deadline (EPX_TIMEOUT_S;
/// with NCCL it aborts the communicator), which cannot say who is missing.
EPX_GPU_TEST(Internode, KilledRankInCountExchange) {
  killed_rank_test([](NetFirstDispatch& f) { f.b->dispatch(f.in->a); }, false);
}

/// A network that stops completing puts (the loopback GIN plugin's
/// EPX_GIN_LOOP_STALL_AFTER_S, nccl backend, one process per rank; run on its
/// own by the device script): ops go on until the stall, then the next op's
/// quiet must raise within its deadline naming the stalled context, where
/// NCCL's flush would hang. Prints "STALL-TEST rank N: PASS|FAIL ..." and
/// leaves at once (tearing down waits for the network too).
EPX_GPU_TEST(Internode, StalledNetworkIsNamed) {
  auto& w = world();
  const auto stall = stall_after_s();
  if (!stall) GTEST_SKIP() << kStallTestSkip;
  const HtCase c{64, 256, 4, 8 * w.num_ranks, false, 0.1, true, 1, false};
  NetFirstDispatch f(c, 3.0, 324);
  run_stall_test(*stall,
                 [&](ErrorCode& code) -> std::string {
                   try {
                     f.cached();
                     f.combine(true);
                     cudaStreamSynchronize(w.stream);
                     f.b->check();
                     return "";
                   } catch (const Error& e) {
                     code = e.code();
                     return e.what();
                   }
                 },
                 {{"network quiet", "its quiet"}, {"for rank ", "a wait"}});
}

}  // namespace
}  // namespace epx::test
