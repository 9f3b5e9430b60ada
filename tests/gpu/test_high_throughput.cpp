// High-throughput dispatch/combine on all local GPUs vs the CPU reference.
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

/// Across (virtual) nodes: get_dispatch_layout also counts, per node, the
/// tokens with an expert there (DeepEP's num_tokens_per_rdma_rank), with top-k
/// picks of one node's ranks counted once, -1 slots and empty tokens; the
/// per-rank outputs as within a node.
EPX_GPU_TEST(Network, DispatchLayoutPerNode) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  const int rpn = R / w.buffer->num_rdma_ranks();
  if (w.buffer->num_rdma_ranks() < 2) GTEST_SKIP() << "needs ranks in several nodes";
  StreamArgs s;
  s.stream = w.stream;
  for (const auto& [T, K, E] :
       {std::tuple{300, 8, 16 * R}, {1, 4, 4 * R}, {0, 2, 2 * R}, {700, 16, 64 * R}}) {
    HtCase c{T, 128, K, E, false, 0.2, false, 1, false};
    auto in = make_inputs(c, R, 4242 + T);
    const auto& mine = in[me];
    auto d_topk = to_device(mine.topk_idx);
    auto layout =
        w.buffer->get_dispatch_layout(view(d_topk.get(), DType::kI64, {mine.num_tokens, K}), E, s);
    ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    auto rl = ref::get_dispatch_layout(mine.topk_idx, mine.num_tokens, K, E, R, rpn);
    ASSERT_TRUE(layout.num_tokens_per_rdma_rank.defined());
    ASSERT_EQ(to_host<int>(layout.num_tokens_per_rdma_rank), rl.num_tokens_per_node)
        << "T=" << T << " K=" << K;
    ASSERT_EQ(to_host<int>(layout.num_tokens_per_rank), rl.num_tokens_per_rank);
    ASSERT_EQ(to_host<int>(layout.num_tokens_per_expert), rl.num_tokens_per_expert);
    ASSERT_EQ(to_host<uint8_t>(layout.is_token_in_rank), rl.is_token_in_rank);
  }
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

EPX_GPU_TEST(HighThroughput, Bf16Hidden7168) {
  run_case({512, 7168, 8, 256, false, 0.1, true, 1, false}, 2, 11);
}
EPX_GPU_TEST(HighThroughput, Fp8Hidden7168) {
  run_case({512, 7168, 8, 256, true, 0.1, true, 1, false}, 2, 12);
}
EPX_GPU_TEST(HighThroughput, HiddenSizes) {
  for (int h : {256, 1024, 2048, 2880, 4096, 8192})
    run_case({300, h, 8, 64, false, 0.05, true, 1, false}, 1, 100 + h);
  for (int h : {2048, 4096, 8192})
    run_case({300, h, 8, 64, true, 0.05, false, 1, false}, 1, 200 + h);
}
/// The Python suite's HT case: a fresh buffer of the size hint, hidden 256.
EPX_GPU_TEST(HighThroughput, FreshHintSizedBuffer) {
  const int R = world().num_ranks;
  const HtCase c{64, 256, 4, 8 * R, false, 0.1, true, 1, false};
  BufferOptions o;
  o.num_nvl_bytes =
      static_cast<int64_t>(get_dispatch_config(R).get_nvl_buffer_size_hint(2u * c.hidden, R));
  o.timeout_s = 20;
  o.allocator = poisoning_allocator();
  Buffer b(world().comm, o);
  run_case(c, 3, 31, std::nullopt, &b);
  b.destroy();
}
/// An allocator that aligns int32 outputs to 4 bytes only: the handle's parts
/// (carved from one int32 allocation) and the int32 outputs still work.
EPX_GPU_TEST(HighThroughput, Int32AlignedAllocator) {
  const int R = world().num_ranks;
  const HtCase c{64, 1024, 4, 8 * R, true, 0.1, true, 1, false};
  Buffer b(world().comm, hint_sized_options(c, R, 20, int32_unaligned_allocator()));
  run_case(c, 2, 91, std::nullopt, &b);
  b.destroy();
}
/// Buffers whose sizes differ between ranks are refused on every rank (no
/// rank waits for the others), and a buffer of equal sizes works after that.
EPX_GPU_TEST(HighThroughput, UnequalBufferSizesAreRefused) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  if (R < 2) GTEST_SKIP() << "needs a peer";
  for (const char* field : {"num_nvl_bytes", "num_rdma_bytes"}) {
    BufferOptions o;
    o.num_nvl_bytes = 1 << 22;
    o.num_rdma_bytes = 1 << 22;
    (std::string(field) == "num_nvl_bytes" ? o.num_nvl_bytes : o.num_rdma_bytes) +=
        me == R - 1 ? 4096 : 0;
    o.timeout_s = 20;
    expect_error(std::string(field) + " unequal",
                 [&] {
                   Buffer b(w.comm, o);
                   b.destroy();
                 },
                 {field, "same on every rank"});
  }
  EXPECT_TRUE(all_ranks(!rank_failed()));
  const HtCase c{64, 256, 4, 8 * R, false, 0.1, true, 1, false};
  BufferOptions o;
  o.num_nvl_bytes =
      static_cast<int64_t>(get_dispatch_config(R).get_nvl_buffer_size_hint(2u * c.hidden, R));
  o.timeout_s = 20;
  Buffer b(w.comm, o);
  run_case(c, 1, 41, std::nullopt, &b);
  b.destroy();
}
EPX_GPU_TEST(HighThroughput, RankReceivesNothing) {
  run_case({256, 2048, 4, 32, false, 0.0, true, 1, true}, 1, 13);
}
EPX_GPU_TEST(HighThroughput, OneAndZeroTokens) {
  run_case({1, 2048, 8, 64, false, 0.0, true, 1, false}, 1, 14);
  run_case({0, 2048, 8, 64, false, 0.0, true, 1, false}, 1, 15);
}
EPX_GPU_TEST(HighThroughput, ExpertAlignmentAndMaskedRows) {
  run_case({333, 4096, 6, 48, false, 0.5, true, 128, false}, 1, 16);
}
/// Chunks of 1 row, of more rows than a warp batches at once (32), and of an
/// odd size; few and many send SMs.
EPX_GPU_TEST(HighThroughput, ChunkSizesAndSmSplits) {
  struct Split {
    int chunk, sms, send;
  };
  for (const Split sp : {Split{1, 3, 1}, Split{48, 6, 2}, Split{37, 24, 20}, Split{8, 40, 8}}) {
    Config cfg = get_dispatch_config(world().num_ranks);
    cfg.num_max_send_tokens = sp.chunk;
    cfg.num_sms = std::min(sp.sms, sm_budget());  // in-process ranks split a GPU
    cfg.num_send_sms = std::min(sp.send, cfg.num_sms - 1);
    run_case({700, 4096, 8, 64, false, 0.1, true, 1, false}, 1, 300 + sp.chunk, cfg);
    run_case({300, 2048, 8, 64, true, 0.1, true, 1, false}, 1, 400 + sp.chunk, cfg);
  }
}
/// Rings smaller than a pair's rows: every pair laps, senders wait for the
/// receivers' credits (one slot: every chunk after the first waits), in
/// dispatch, cached dispatch and combine, BF16 and FP8, with chunks that do
/// and do not divide the ring.
EPX_GPU_TEST(HighThroughput, RingsLap) {
  struct Ring {
    int rows, chunk;
  };
  for (const Ring rg : {Ring{64, 8}, Ring{20, 8}, Ring{8, 8}, Ring{5, 1}}) {
    Config cfg = shared_gpu_config(rg.rows);
    cfg.num_max_send_tokens = rg.chunk;
    run_case({900, 2048, 8, 64, false, 0.1, true, 1, false}, 1, 500 + rg.rows, cfg);
    run_case({300, 4096, 8, 64, true, 0.1, true, 1, false}, 1, 600 + rg.rows, cfg);
  }
  // The standard call through a ring of a quarter of its rows.
  Config cfg = shared_gpu_config(1024);
  run_case({4095, 7168, 8, 256, false, 0.0, true, 1, false}, 1, 700, cfg);
}
/// The pull dispatch (Config::pull_dispatch: receivers read the rows from the
/// sender's export ring): BF16 and FP8, cached, few and many send SMs, export
/// rings that do not lap and that lap (64 and 8 rows per peer; 5 rows at EP2:
/// a ring of one 5-token batch, so every batch waits for its readers'
/// credits), with runs of tokens no peer takes, then the 4096-token workload
/// with the default pull config.
EPX_GPU_TEST(HighThroughput, PullDispatch) {
  struct Ring {
    int rows, send;
  };
  for (const Ring rg : {Ring{4096, 0}, Ring{64, 1}, Ring{8, 2}, Ring{5, 1}}) {
    Config cfg = shared_gpu_config(rg.rows);
    cfg.pull_dispatch = true;
    cfg.num_max_send_tokens = std::min(cfg.num_max_send_tokens, rg.rows);
    cfg.num_send_sms = std::min(rg.send, cfg.num_sms - 1);
    run_case({900, 2048, 8, 64, false, 0.1, true, 1, false}, 1, 800 + rg.rows, cfg);
    run_case({300, 4096, 8, 64, true, 0.1, true, 1, false}, 1, 900 + rg.rows, cfg);
    // Batches no peer takes, in rings that lap: a slot's next writer must
    // still wait for the readers of its earlier batches.
    run_case({1000, 2048, 8, 64, false, 0.0, true, 1, false, true}, 1, 1100 + rg.rows, cfg);
  }
  Config cfg = shared_gpu_config();
  cfg.pull_dispatch = true;
  run_case({4095, 7168, 8, 256, false, 0.0, true, 1, false}, 1, 1000, cfg);
}
EPX_GPU_TEST(HighThroughput, FullWorkload4096) {
  run_case({4095, 7168, 8, 256, false, 0.0, true, 1, false}, 1, 17);
}  // ranks hold 4095 or 4096 tokens

EPX_GPU_TEST(HighThroughput, Stress200Calls) {
  stress_calls(200, std::nullopt);
}
/// The same through rings of 16 rows (chunks of 4): every call laps.
EPX_GPU_TEST(HighThroughput, Stress200CallsLapping) {
  Config cfg = shared_gpu_config(16);
  cfg.num_max_send_tokens = 4;
  stress_calls(200, cfg);
}

EPX_GPU_TEST(HighThroughput, FuzzedValidSets) {
  fuzzed_valid_sets(16, 20261127, false);
}

/// num_worst_tokens: no host sync; outputs sized to the worst case, then
/// captured in a CUDA graph and replayed with the routing unchanged.
// The num_worst_tokens tests: 200 tokens (201 on odd ranks), hidden 2048,
// top-8 of 64 experts, bf16 with weights; DispatchArgs with the layout and
// `worst` output rows, on the world's stream.
constexpr int kWorstTokens = 200, kWorstHidden = 2048, kWorstTopK = 8, kWorstExperts = 64;
struct WorstTokenSetup {
  std::vector<ref::HtInput> in;           ///< every rank's inputs
  std::vector<ref::HtDispatchOutput> ro;  ///< the reference dispatch, every rank
  DeviceInput dev;                        ///< this rank's, with `worst` output rows
};

WorstTokenSetup worst_token_setup(uint64_t seed, int worst) {
  auto& w = world();
  const int R = w.num_ranks, H = kWorstHidden, K = kWorstTopK, E = kWorstExperts;
  HtCase c{kWorstTokens, H, K, E, false, 0.1, true, 1, false};
  auto in = make_inputs(c, R, seed);
  StreamArgs s;
  s.stream = w.stream;
  DeviceInput dev(*w.buffer, in[w.rank], H, K, E, s);
  dev.a.num_worst_tokens = worst;
  auto ro = ref::ht_dispatch(in, H, K, E, 1);
  return WorstTokenSetup{std::move(in), std::move(ro), std::move(dev)};
}

EPX_GPU_TEST(HighThroughput, WorstTokensAndGraphReplay) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank, H = kWorstHidden, K = kWorstTopK;
  const int worst = (kWorstTokens + 1) * R;
  auto st = worst_token_setup(77, worst);
  const auto& ro = st.ro;
  const auto& a = st.dev.a;
  const StreamArgs& s = st.dev.a.streams;
  auto res = w.buffer->dispatch(a);
  cudaStreamSynchronize(w.stream);
  ASSERT_EQ(res.recv_x.size(0), worst);
  const int N = ro[me].num_recv_tokens;
  auto gx = to_host<uint16_t>(res.recv_x);
  gx.resize(static_cast<std::size_t>(N) * H);
  ASSERT_EQ(gx, ro[me].recv_x_bf16);
  auto gi = to_host<int64_t>(*res.recv_topk_idx);
  for (std::size_t i = static_cast<std::size_t>(N) * K; i < gi.size(); ++i)
    ASSERT_EQ(gi[i], -1) << "tail row " << i / K;

  // Graph capture of dispatch (worst-token mode) + combine, then replays.
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  Tensor gx_out, gc_out;
  {
    auto r1 = w.buffer->dispatch(a);
    CombineArgs ca;
    ca.x = r1.recv_x.view;
    ca.handle = r1.handle;
    ca.streams = s;
    auto r2 = w.buffer->combine(ca);
    gx_out = r1.recv_x;
    gc_out = r2.combined_x;
  }
  ASSERT_EQ(cudaStreamEndCapture(w.stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_TRUE(instantiate_on_every_rank(graph, &exec, w.stream));
  for (int i = 0; i < 20; ++i) {
    // Graph-owned outputs exist once the graph has run: poison them between
    // replays (the addresses stay fixed across launches).
    if (i > 0)
      ASSERT_EQ(cudaMemsetAsync(gx_out.view.data, 0xff, gx_out.view.nbytes(), w.stream),
                cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, w.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
    auto g = to_host<uint16_t>(gx_out);
    g.resize(static_cast<std::size_t>(N) * H);
    ASSERT_EQ(g, ro[me].recv_x_bf16) << "replay " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

// num_worst_tokens smaller than what arrives: rows past it are dropped and
// reported at the next call. Under graph replay nothing checks in between, so
// the combine captured with the dispatch must stay inside x (rows the routing
// names past it count as zero) and still write every output row.
EPX_GPU_TEST(HighThroughput, TruncatedWorstTokensStayInBounds) {
  auto& w = world();
  const int me = w.rank, K = kWorstTopK, E = kWorstExperts, worst = 16;
  auto st = worst_token_setup(91, worst);
  ASSERT_GT(st.ro[me].num_recv_tokens, worst);
  const int T = st.dev.T;
  const auto& a = st.dev.a;
  const StreamArgs& s = st.dev.a.streams;
  const DeviceArray<int64_t>& d_topk = st.dev.topk;

  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  Tensor combined, combined_w;
  {
    auto r1 = w.buffer->dispatch(a);
    CombineArgs ca;
    ca.x = r1.recv_x.view;
    ca.topk_weights = r1.recv_topk_weights->view;
    ca.handle = r1.handle;
    ca.streams = s;
    auto r2 = w.buffer->combine(ca);
    combined = r2.combined_x;
    combined_w = *r2.combined_topk_weights;
  }
  ASSERT_EQ(cudaStreamEndCapture(w.stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_TRUE(instantiate_on_every_rank(graph, &exec, w.stream));
  ASSERT_EQ(cudaGraphLaunch(exec, w.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  // Outputs are poisoned (NaN) when allocated. The combine gets x = recv_x,
  // the first `worst` rows each rank received: rows the dispatch dropped
  // contribute nothing (neither their row nor their weights), so the
  // reference is the combine of the reference rows with those rows zeroed.
  const int R = w.num_ranks, H = kWorstHidden;
  std::vector<ref::HtCombineInput> cin(R);
  for (int r = 0; r < R; ++r) {
    const std::size_t kept = std::min(worst, st.ro[r].num_recv_tokens);
    cin[r].x = st.ro[r].recv_x_bf16;
    std::fill(cin[r].x.begin() + kept * H, cin[r].x.end(), uint16_t{0});
    cin[r].topk_weights = st.ro[r].recv_topk_weights;
    std::fill(cin[r].topk_weights.begin() + kept * K, cin[r].topk_weights.end(), 0.0f);
  }
  const auto rc = ref::ht_combine(st.in, cin, H, K, E);
  const auto got = to_host<uint16_t>(combined);
  const auto got_w = to_host<float>(combined_w);
  ASSERT_EQ(got.size(), rc[me].combined_x.size());
  ASSERT_EQ(got_w.size(), rc[me].combined_topk_weights.size());
  std::size_t bad = 0, bad_w = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float g = bf(got[i]), r = bf(rc[me].combined_x[i]);
    if (!(std::fabs(g - r) <= 1e-2f * std::fabs(r) + 1e-2f)) ++bad;
  }
  for (std::size_t i = 0; i < got_w.size(); ++i)
    if (!(std::fabs(got_w[i] - rc[me].combined_topk_weights[i]) <= 1e-5f)) ++bad_w;
  EXPECT_EQ(bad, 0u) << "combined_x differs from the truncated reference in " << bad << " values";
  EXPECT_EQ(bad_w, 0u) << "combined_topk_weights differ in " << bad_w << " values";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  // The truncation is reported by the next call on this buffer.
  try {
    w.buffer->get_dispatch_layout(view(d_topk.get(), DType::kI64, {T, K}), E, s);
    ADD_FAILURE() << "the truncated dispatch was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_worst_tokens"), std::string::npos) << e.what();
  }
  cudaStreamSynchronize(w.stream);
  EXPECT_TRUE(all_ranks(!rank_failed()));
}

EPX_GPU_TEST(HighThroughput, BadInputsThrowBeforeAnyKernel) {
  auto& w = world();
  StreamArgs s;
  s.stream = w.stream;
  auto d = to_device(std::vector<int64_t>(64, 0));
  if (w.num_ranks > 1)  // 4R+1 experts cannot be spread evenly
    EXPECT_THROW(
        w.buffer->get_dispatch_layout(view(d.get(), DType::kI64, {8, 8}), 4 * w.num_ranks + 1, s),
        Error);
  EXPECT_THROW(w.buffer->get_dispatch_layout(view(d.get(), DType::kI32, {8, 8}), 64, s), Error);
  if (w.comm->ranks_on_device() > 1) {  // in-process ranks: the shared legacy stream is refused
    expect_error(
        "legacy default stream",
        [&] {
          w.buffer->get_dispatch_layout(view(d.get(), DType::kI64, {8, 8}), 64, StreamArgs{});
        },
        {"streams.stream"});
  }
  EXPECT_THROW(w.buffer->get_dispatch_layout(view(d.get(), DType::kI64, {8, 32}), 64, s), Error);
  // Out-of-range expert ids are caught by the layout kernel and raised.
  std::vector<int64_t> bad(64, 1);
  bad[13] = 999;
  auto db = to_device(bad);
  w.buffer->get_dispatch_layout(view(db.get(), DType::kI64, {8, 8}), 64, s);
  cudaStreamSynchronize(w.stream);
  try {
    w.buffer->get_dispatch_layout(view(d.get(), DType::kI64, {8, 8}), 64, s);
    ADD_FAILURE() << "expected an error for expert 999";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx"), std::string::npos) << e.what();
  }
  cudaStreamSynchronize(w.stream);
}

/// Rank `me`'s BF16 inputs of case c on the device, a layout from `buf` and
/// dispatch arguments made from them.
struct Bf16Dispatch {
  DeviceArray<int64_t> topk;
  DeviceArray<uint8_t> x;
  Layout layout;
  DispatchArgs args;
};
Bf16Dispatch bf16_dispatch(Buffer& buf, const HtCase& c, const ref::HtInput& mine,
                           const StreamArgs& s) {
  const int T = mine.num_tokens, H = c.hidden, K = c.num_topk;
  Bf16Dispatch d{to_device(mine.topk_idx),
                 to_device_bytes(mine.x_bf16.data(), mine.x_bf16.size() * 2),
                 {},
                 {}};
  d.layout = buf.get_dispatch_layout(view(d.topk.get(), DType::kI64, {T, K}), c.num_experts, s);
  d.args.x = view(d.x.get(), DType::kBF16, {T, H});
  d.args.topk_idx = view(d.topk.get(), DType::kI64, {T, K});
  d.args.set_layout(d.layout);
  d.args.streams = s;
  return d;
}

/// Only rank 0 combines. The combine kernel is its own barrier: its senders
/// wait for the peers to reach the op and its receivers for their rows; all
/// of them give up at the deadline, and the next call raises kTimeout naming
/// the op and the silent peer. (Afterwards the ranks' epochs differ: the
/// buffer is destroyed, as the docs say.) Every rank reaches every collective
/// step whatever fails on rank 0, so a failure cannot hang the suite.
EPX_GPU_TEST(HighThroughput, TimeoutIsReported) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  if (R < 2) GTEST_SKIP() << "needs a peer that stays silent";
  const HtCase c{64, 1024, 4, 8 * R, false, 0.0, false, 1, false};
  Buffer b(w.comm, hint_sized_options(c, R, 1.0, poisoning_allocator()));
  StreamArgs s;
  s.stream = w.stream;
  auto in = make_inputs(c, R, 5);
  auto d = bf16_dispatch(b, c, in[me], s);
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  all_ranks(true);                // line up: the 1 s deadline also covers this dispatch
  auto res = b.dispatch(d.args);  // every rank: the handle
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  if (all_ranks(!rank_failed()) && me == 0) {
    CombineArgs ca;
    ca.x = res.recv_x.view;
    ca.handle = res.handle;
    ca.streams = s;
    expect_error(
        "combine without peers",
        [&] {
          b.combine(ca);  // no peer takes part: every wait runs into the deadline
          EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
          b.combine(ca);
        },
        {"combine", "rank 0 waited"}, ErrorCode::kTimeout);
  }
  EXPECT_TRUE(all_ranks(!rank_failed()));
  b.destroy();
}

/// Layout tensors that disagree (num_tokens_per_rank not the count of
/// is_token_in_rank) are refused with an error naming the argument before any
/// row moves; with every rank's layout off, every rank refuses, and the buffer
/// keeps working.
EPX_GPU_TEST(HighThroughput, MismatchedLayoutIsRefused) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  const HtCase c{96, 1024, 4, 8 * R, false, 0.0, false, 1, false};
  StreamArgs s;
  s.stream = w.stream;
  auto in = make_inputs(c, R, 9);
  auto d = bf16_dispatch(*w.buffer, c, in[me], s);
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  auto counts = to_host<int>(d.layout.num_tokens_per_rank);
  for (auto& v : counts) v += 1;  // one token too many for every rank
  auto d_counts = to_device(counts);
  d.args.num_tokens_per_rank = view(d_counts.get(), DType::kI32, {R});
  expect_error("mismatched layout", [&] { w.buffer->dispatch(d.args); }, {"num_tokens_per_rank"});
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  EXPECT_TRUE(all_ranks(!rank_failed()));
  // The same buffer still dispatches and combines correctly.
  run_case({128, 1024, 4, 8 * R, false, 0.1, true, 1, false}, 1, 21);
}

/// Rank 0 passes a config with another ring size. Every rank must refuse the
/// op (each compares its peers' config fingerprints before sending): the
/// dispatch with a layout raises at once (its count exchange sees the
/// fingerprints), a cached dispatch or a combine at the next call. No rank
/// hangs, and the buffer works afterwards.
EPX_GPU_TEST(HighThroughput, MismatchedConfigIsRefused) {
  auto& w = world();
  const int R = w.num_ranks, me = w.rank;
  if (R < 2) GTEST_SKIP() << "needs a peer";
  const HtCase c{96, 1024, 4, 8 * R, false, 0.0, false, 1, false};
  StreamArgs s;
  s.stream = w.stream;
  auto in = make_inputs(c, R, 19);
  auto d = bf16_dispatch(*w.buffer, c, in[me], s);
  auto res = w.buffer->dispatch(d.args);  // same config everywhere: the handle
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  Config odd = shared_gpu_config();
  if (me == 0) odd.num_max_recv_tokens = 2048;
  auto expect_refused = [&](const char* what, const std::function<void()>& call) {
    expect_error(what, call, {"different configs"});
    EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  };
  // With a layout: the dispatch itself raises.
  DispatchArgs a = d.args;
  a.config = odd;
  expect_refused("dispatch", [&] { w.buffer->dispatch(a); });
  // Cached dispatch and combine: the kernel refuses, the next call raises.
  DispatchArgs cached;
  cached.x = d.args.x;
  cached.handle = res.handle;
  cached.streams = s;
  cached.config = odd;
  auto then_next_call = [&](const std::function<void()>& op) {
    return [&, op] {
      op();
      EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
      w.buffer->get_dispatch_layout(d.args.topk_idx.value(), c.num_experts, s);
    };
  };
  expect_refused("cached dispatch", then_next_call([&] { w.buffer->dispatch(cached); }));
  CombineArgs ca;
  ca.x = res.recv_x.view;
  ca.handle = res.handle;
  ca.streams = s;
  ca.config = odd;
  expect_refused("combine", then_next_call([&] { w.buffer->combine(ca); }));
  EXPECT_TRUE(all_ranks(!rank_failed()));
  // The same buffer still dispatches and combines correctly.
  run_case({128, 1024, 4, 8 * R, false, 0.1, true, 1, false}, 1, 22);
}

}  // namespace
}  // namespace epx::test
