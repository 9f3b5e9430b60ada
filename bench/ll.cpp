// epx-bench ll: low-latency dispatch (FP8, BF16) and combine (BF16), counted
// like DeepEP's tests: bytes per valid (token, top-k) selection, FP8
// H + H/128*4 + 16, BF16 2H. Hook mode splits each op into its send and
// receive phases, timed separately (the ranks are lined up between them, so
// the receive time is the receive phase alone).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "bench/common.hpp"
#include "common/check.hpp"
#include "common/plan.hpp"
#include "epx/reference.hpp"

namespace epx::bench {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Hook mode: median send-phase and receive-phase times. Per run: L2 flush,
/// line up, time `send()`, line up (every rank's send is done), L2 flush,
/// time the hook it returned.
std::pair<double, double> split_us(World& w, const std::function<std::function<void()>()>& send,
                                   int warmup, int iters) {
  cudaEvent_t ev[4];
  for (auto& e : ev) EPX_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<double> ts, tr;
  for (int i = 0; i < warmup + iters; ++i) {
    EPX_CUDA_CHECK(cudaMemsetAsync(w.flush, i & 0xff, w.flush_bytes, w.stream));
    line_up(w);
    EPX_CUDA_CHECK(cudaEventRecord(ev[0], w.stream));
    std::function<void()> hook = send();
    EPX_CUDA_CHECK(cudaEventRecord(ev[1], w.stream));
    line_up(w);
    EPX_CUDA_CHECK(cudaMemsetAsync(w.flush, (i + 1) & 0xff, w.flush_bytes, w.stream));
    EPX_CUDA_CHECK(cudaEventRecord(ev[2], w.stream));
    hook();
    EPX_CUDA_CHECK(cudaEventRecord(ev[3], w.stream));
    EPX_CUDA_CHECK(cudaEventSynchronize(ev[3]));
    float a = 0, b = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&a, ev[0], ev[1]));
    EPX_CUDA_CHECK(cudaEventElapsedTime(&b, ev[2], ev[3]));
    if (i >= warmup) {
      ts.push_back(a * 1e3);
      tr.push_back(b * 1e3);
    }
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return {median(ts), median(tr)};
}

/// Median host time of one call of `fn` (the C++ API's own per-call work; the
/// stream is drained before each call so the GPU never holds it back).
double host_us(World& w, const std::function<void()>& fn, int iters) {
  std::vector<double> v;
  for (int i = 0; i < iters; ++i) {
    EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    v.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  return median(v);
}

/// Mean time of one `fn` over `iters` calls back to back: one line-up, then
/// no host wait between calls (a model's layers run that way), stalls and
/// all; `fn` should be a dispatch and its combine.
double back_to_back_us(World& w, const std::function<void()>& fn, int warmup, int iters,
                       bool pair_sync, bool pair_lineup) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  EPX_CUDA_CHECK(cudaEventCreate(&a));
  EPX_CUDA_CHECK(cudaEventCreate(&b));
  line_up(w);
  EPX_CUDA_CHECK(cudaEventRecord(a, w.stream));
  for (int i = 0; i < iters; ++i) {
    if (pair_lineup && i > 0) line_up(w);
    fn();
    if (pair_sync) EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  }
  EPX_CUDA_CHECK(cudaEventRecord(b, w.stream));
  EPX_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return iters > 0 ? ms * 1e3 / iters : 0.0;
}

/// `fn` captured once into a CUDA graph, then timed like time_us (L2 flush,
/// line-up, events) per replay: the GPU time without the host's per-call work.
double graph_us(World& w, const std::function<void()>& fn, int warmup, int iters) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPX_CUDA_CHECK(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeRelaxed));
  fn();  // its outputs are allocated and released inside the capture
  EPX_CUDA_CHECK(cudaStreamEndCapture(w.stream, &graph));
  EPX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // Uploaded (and the stream drained) before the first line-up: an upload at
  // the first launch may wait for the GPU, where in-process peers' replays
  // may already wait for this rank.
  EPX_CUDA_CHECK(cudaGraphUpload(exec, w.stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  const double t = time_us(
      w, [&] { EPX_CUDA_CHECK(cudaGraphLaunch(exec, w.stream)); }, warmup, iters);
  EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  EPX_CUDA_CHECK(cudaGraphExecDestroy(exec));
  EPX_CUDA_CHECK(cudaGraphDestroy(graph));
  return t;
}

/// DeepEP V1's get_low_latency_rdma_size_hint, recomputed from its documented
/// layout (csrc/config.hpp LowLatencyLayout, deepseek-ai/DeepEP @030cdf0):
/// two halves, each a send buffer, a receive buffer and a signaling area.
std::size_t deepep_ll_hint(int max_tokens, int hidden, int num_ranks, int num_experts) {
  const std::size_t scales = hidden / 128;
  const std::size_t dispatch_msg = 16 + std::max<std::size_t>(2u * hidden, hidden + 4 * scales);
  const std::size_t combine_msg = 4 * scales + 2u * hidden;
  const std::size_t slots = static_cast<std::size_t>(num_experts) * max_tokens;
  const std::size_t send = std::max<std::size_t>(max_tokens * dispatch_msg, slots * combine_msg);
  const std::size_t recv = std::max<std::size_t>(slots * dispatch_msg, slots * combine_msg);
  const std::size_t signal = 8u * num_experts + 4u * (num_experts / num_ranks);
  const std::size_t signal_aligned = (signal + 127) / 128 * 128;
  const std::size_t total = 2 * send + 2 * recv + 2 * signal_aligned;
  return (total + 128) / 128 * 128;
}

}  // namespace

void run_ll(World& w, const Options& o, nlohmann::json& result) {
  const int T = o.tokens, H = o.hidden, K = o.topk, E = o.experts, R = w.num_ranks;
  const int maxT = T;
  auto topk = ref::random_topk(T, K, E, 0.0, 1000 + w.rank);
  auto xb = ref::random_bf16(static_cast<std::size_t>(T) * H, 2000 + w.rank);
  std::vector<float> weights(static_cast<std::size_t>(T) * K);
  for (std::size_t i = 0; i < weights.size(); ++i)
    weights[i] = 0.5f + 0.5f * static_cast<float>(i % 7) / 7.0f;
  auto d_topk = upload(topk), d_x = upload(xb), d_w = upload(weights);
  int64_t selections = 0;
  for (int64_t e : topk) selections += e >= 0;

  LowLatencyDispatchArgs dfp8;
  dfp8.x = tv(d_x.get(), DType::kBF16, {T, H});
  dfp8.topk_idx = tv(d_topk.get(), DType::kI64, {T, K});
  dfp8.num_max_dispatch_tokens_per_rank = maxT;
  dfp8.num_experts = E;
  dfp8.use_fp8 = true;
  dfp8.stream = w.stream;
  LowLatencyDispatchArgs dbf16 = dfp8;
  dbf16.use_fp8 = false;

  // One BF16 dispatch gives the handle and real expert inputs; its recv_x
  // (BF16 [E_local, R*maxT, H]) serves as the combine's expert outputs.
  auto first = w.buffer->low_latency_dispatch(dbf16);
  EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  LowLatencyCombineArgs comb;
  comb.x = first.recv_x.view;
  comb.topk_idx = dfp8.topk_idx;
  comb.topk_weights = tv(d_w.get(), DType::kF32, {T, K});
  comb.handle = first.handle;
  comb.stream = w.stream;
  LowLatencyCombineArgs comb_logfmt = comb;
  comb_logfmt.use_logfmt = true;

  const double t_dfp8 = time_us(
      w, [&] { w.buffer->low_latency_dispatch(dfp8); }, o.warmup, o.iters);
  const double t_dbf16 = time_us(
      w, [&] { w.buffer->low_latency_dispatch(dbf16); }, o.warmup, o.iters);
  const double t_comb = time_us(
      w, [&] { w.buffer->low_latency_combine(comb); }, o.warmup, o.iters);
  const double t_comb_lf = time_us(
      w, [&] { w.buffer->low_latency_combine(comb_logfmt); }, o.warmup, o.iters);

  // The same calls without the host: replayed from a CUDA graph; and the host
  // time of one call.
  const double t_dfp8_graph = graph_us(
      w, [&] { w.buffer->low_latency_dispatch(dfp8); }, o.warmup, o.iters);
  const double t_comb_graph = graph_us(
      w, [&] { w.buffer->low_latency_combine(comb); }, o.warmup, o.iters);
  const double h_dfp8 = host_us(
      w, [&] { w.buffer->low_latency_dispatch(dfp8); }, o.iters);
  const double h_comb = host_us(
      w, [&] { w.buffer->low_latency_combine(comb); }, o.iters);

  // Pairs of an FP8 dispatch and its combine, back to back.
  const double t_pair = back_to_back_us(
      w,
      [&] {
        LowLatencyCombineArgs c = comb;
        c.handle = w.buffer->low_latency_dispatch(dfp8).handle;
        w.buffer->low_latency_combine(c);
      },
      o.warmup, o.iters, o.pair_sync, o.pair_lineup);

  // Hook mode: send and receive phases apart.
  LowLatencyDispatchArgs dhook = dfp8;
  dhook.return_recv_hook = true;
  LowLatencyDispatchResult keep_d;  // outputs must outlive the hook
  LowLatencyCombineResult keep_c;
  const auto [t_ds, t_dr] = split_us(
      w,
      [&] {
        keep_d = w.buffer->low_latency_dispatch(dhook);
        return keep_d.hook;
      },
      o.warmup, o.iters);
  auto combine_split = [&](bool logfmt) {
    LowLatencyCombineArgs chook = comb;
    chook.return_recv_hook = true;
    chook.use_logfmt = logfmt;
    return split_us(
        w,
        [&] {
          keep_c = w.buffer->low_latency_combine(chook);
          return keep_c.hook;
        },
        o.warmup, o.iters);
  };
  const auto [t_cs, t_cr] = combine_split(false);
  const auto [t_cs_lf, t_cr_lf] = combine_split(true);
  EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));

  const double fp8_bytes = static_cast<double>(selections) * (H + H / 128 * 4 + 16);
  const double bf16_bytes = static_cast<double>(selections) * 2.0 * H;
  const double us_dfp8 = mean_over_ranks(w, t_dfp8), us_dbf16 = mean_over_ranks(w, t_dbf16);
  const double us_comb = mean_over_ranks(w, t_comb), us_comb_lf = mean_over_ranks(w, t_comb_lf);
  const double us_ds = mean_over_ranks(w, t_ds), us_dr = mean_over_ranks(w, t_dr);
  const double us_cs = mean_over_ranks(w, t_cs), us_cr = mean_over_ranks(w, t_cr);
  const double us_cs_lf = mean_over_ranks(w, t_cs_lf), us_cr_lf = mean_over_ranks(w, t_cr_lf);
  const double g_dfp8 = mean_over_ranks(w, fp8_bytes / t_dfp8 / 1e3);
  const double g_dbf16 = mean_over_ranks(w, bf16_bytes / t_dbf16 / 1e3);
  const double g_comb = mean_over_ranks(w, bf16_bytes / t_comb / 1e3);
  const double max_dfp8 = max_over_ranks(w, t_dfp8), max_comb = max_over_ranks(w, t_comb);
  const std::size_t hint = Buffer::get_low_latency_rdma_size_hint(maxT, H, R, E);
  const std::size_t deepep_hint = deepep_ll_hint(maxT, H, R, E);
  plan::LlRegion region;
  region.num_ranks = R;
  region.max_tokens = maxT;
  region.hidden = H;
  region.num_experts = E;

  int num_sms = 0;
  EPX_CUDA_CHECK(
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, w.comm->device()));
  result["family"] = "ll";
  result["enable_shrink"] = w.buffer->shrink_enabled();
  result["num_sms"] = num_sms;
  result["num_max_dispatch_tokens_per_rank"] = maxT;
  result["num_valid_selections"] = mean_over_ranks(w, static_cast<double>(selections));
  result["dispatch_us"] = us_dfp8;  // FP8
  result["dispatch_gbps"] = g_dfp8;
  result["dispatch_bf16_us"] = us_dbf16;
  result["dispatch_bf16_gbps"] = g_dbf16;
  result["combine_us"] = us_comb;  // BF16
  result["combine_gbps"] = g_comb;
  result["combine_logfmt_us"] = us_comb_lf;
  result["dispatch_send_us"] = us_ds;
  result["dispatch_recv_us"] = us_dr;
  result["combine_send_us"] = us_cs;
  result["combine_recv_us"] = us_cr;
  result["combine_logfmt_send_us"] = us_cs_lf;
  result["combine_logfmt_recv_us"] = us_cr_lf;
  result["dispatch_graph_us"] = mean_over_ranks(w, t_dfp8_graph);
  result["combine_graph_us"] = mean_over_ranks(w, t_comb_graph);
  result["pair_back_to_back_us"] = mean_over_ranks(w, t_pair);
  result["pair_sync"] = o.pair_sync;
  result["pair_lineup"] = o.pair_lineup;
  result["dispatch_host_us"] = mean_over_ranks(w, h_dfp8);
  result["combine_host_us"] = mean_over_ranks(w, h_comb);
  result["max_rank_us"] = {{"dispatch", max_dfp8}, {"combine", max_comb}};
  result["rdma_bytes_per_rank"] = hint;
  result["rdma_bytes_core_per_rank"] = region.core_bytes();  // without the zero-copy inputs
  result["deepep_rdma_size_hint"] = deepep_hint;
  result["deepep_rdma_size_hint_source"] =
      "recomputed from DeepEP csrc/config.hpp LowLatencyLayout (commit 030cdf0)";
  result["timing"] =
      "median of iters per rank (L2 flushed, ranks aligned by an all-reduce), mean over ranks; "
      "hook split: ranks aligned again (and L2 flushed) between send and receive";
  if (w.rank == 0) {
    std::printf("\nEPX low-latency, %d ranks%s, %d tokens, hidden %d, top-%d, %d experts%s\n", R,
                ranks_note(w).c_str(), T, H, K, E,
                w.buffer->shrink_enabled() ? ", enable_shrink (no rank masked)" : "");
    std::printf("%-26s %10s %10s %10s %10s\n", "op", "us", "GB/s", "send us", "recv us");
    std::printf("%-26s %10.1f %10.1f %10.1f %10.1f\n", "dispatch FP8", us_dfp8, g_dfp8, us_ds,
                us_dr);
    std::printf("%-26s %10.1f %10.1f %10s %10s\n", "dispatch BF16", us_dbf16, g_dbf16, "-", "-");
    std::printf("%-26s %10.1f %10.1f %10.1f %10.1f\n", "combine BF16", us_comb, g_comb, us_cs,
                us_cr);
    std::printf("%-26s %10.1f %10s %10.1f %10.1f\n", "combine BF16 + LogFMT", us_comb_lf, "-",
                us_cs_lf, us_cr_lf);
    std::printf(
        "replayed from a CUDA graph: dispatch FP8 %.1f us, combine %.1f us; host time per call: "
        "dispatch %.1f us, combine %.1f us\n",
        static_cast<double>(result["dispatch_graph_us"]),
        static_cast<double>(result["combine_graph_us"]),
        static_cast<double>(result["dispatch_host_us"]),
        static_cast<double>(result["combine_host_us"]));
    std::printf("back to back (%s): %.1f us per FP8 dispatch + combine\n",
                o.pair_sync     ? "the host waits after each pair"
                : o.pair_lineup ? "ranks lined up on the GPU before each pair"
                                : "no host wait between calls",
                static_cast<double>(result["pair_back_to_back_us"]));
    std::printf(
        "buffer bytes per rank: %zu (hint %zu = %zu for the ops + %zu combine row sends + %zu "
        "zero-copy inputs); DeepEP's hint: %zu\n",
        w.buffer->buffer_bytes(), hint, region.core_bytes(), region.net_end() - region.core_bytes(),
        2 * region.zero_copy_bytes(), deepep_hint);
  }
}

}  // namespace epx::bench
