// epx-bench ht: high-throughput dispatch (BF16, FP8) and combine, counted like
// DeepEP's tests: bytes = recv_x.numel() * element size (+ FP8 scales).
#include <cstdio>
#include <string>

#include "bench/common.hpp"
#include "common/check.hpp"
#include "epx/reference.hpp"

namespace epx::bench {
void run_ht(World& w, const Options& o, nlohmann::json& result) {
  const int T = o.tokens, H = o.hidden, K = o.topk, E = o.experts, R = w.num_ranks;
  auto topk = ref::random_topk(T, K, E, 0.0, 1000 + w.rank);
  auto xb = ref::random_bf16(static_cast<std::size_t>(T) * H, 2000 + w.rank);
  std::vector<uint8_t> xq(static_cast<std::size_t>(T) * H);
  std::vector<float> xs(static_cast<std::size_t>(T) * (H / 128));
  {
    std::vector<float> row(H);
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < H; ++h)
        row[h] = ref::bf16_to_float(xb[static_cast<std::size_t>(t) * H + h]);
      ref::quantize_row_fp8(row.data(), H, false, xq.data() + static_cast<std::size_t>(t) * H,
                            xs.data() + static_cast<std::size_t>(t) * (H / 128));
    }
  }
  std::vector<float> weights(static_cast<std::size_t>(T) * K, 0.125f);
  auto d_topk = upload(topk), d_x = upload(xb), d_xq = upload(xq), d_xs = upload(xs),
       d_w = upload(weights);

  StreamArgs s;
  s.stream = w.stream;
  auto layout = w.buffer->get_dispatch_layout(tv(d_topk.get(), DType::kI64, {T, K}), E, s);
  DispatchArgs full;
  full.x = tv(d_x.get(), DType::kBF16, {T, H});
  full.topk_idx = tv(d_topk.get(), DType::kI64, {T, K});
  full.topk_weights = tv(d_w.get(), DType::kF32, {T, K});
  full.set_layout(layout);
  full.streams = s;
  const Config base = ht_base_config(o, R);
  full.config = base;
  auto first = w.buffer->dispatch(full);
  EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  const int64_t N = first.recv_x.size(0);
  const double bytes_bf16 = static_cast<double>(N) * H * 2;
  const double bytes_fp8 = static_cast<double>(N) * H + static_cast<double>(N) * (H / 128) * 4;

  auto dispatch_cached = [&](const Config& c, bool fp8) {
    DispatchArgs a;
    a.x = fp8 ? tv(d_xq.get(), DType::kFP8E4M3, {T, H}) : tv(d_x.get(), DType::kBF16, {T, H});
    if (fp8) a.x_scales = tv(d_xs.get(), DType::kF32, {T, H / 128});
    a.handle = first.handle;
    a.config = c;
    a.streams = s;
    return w.buffer->dispatch(a);
  };
  auto combine = [&](const Config& c) {
    CombineArgs a;
    a.x = first.recv_x.view;
    a.handle = first.handle;
    a.config = c;
    a.streams = s;
    return w.buffer->combine(a);
  };

  // Sweep chunk sizes and the send/receive split at the given SM count.
  Config best_d = base, best_c = base;
  nlohmann::json sweep = nlohmann::json::array();
  auto measure = [&](const Config& c, double& td, double& tc) {
    td = max_over_ranks(w, time_us(
                               w, [&] { dispatch_cached(c, false); }, 2, 10));
    tc = max_over_ranks(w, time_us(
                               w, [&] { combine(c); }, 2, 10));
    sweep.push_back({{"num_sms", c.num_sms},
                     {"chunk", c.num_max_send_tokens},
                     {"send_sms", c.send_sms()},
                     {"dispatch_us", td},
                     {"combine_us", tc}});
    if (w.rank == 0)
      std::printf("sweep sms=%d send=%d chunk=%d: dispatch %.1f us, combine %.1f us\n", c.num_sms,
                  c.send_sms(), c.num_max_send_tokens, td, tc);
  };
  if (o.sweep) {
    double bd = 1e30, bc = 1e30;
    for (int chunk : {1, 2, 4, 8, 16}) {
      // Fewer senders than a third: at EP2 (2026-11-24) the receivers were the
      // bottleneck (8 -> 16 of 24 SMs sending cost 50-95%).
      for (int send : {o.num_sms / 6, o.num_sms / 4, o.num_sms / 3, o.num_sms / 2}) {
        if (send < 1) continue;
        Config c = base;
        c.num_max_send_tokens = chunk;
        c.num_send_sms = send;
        double td, tc;
        measure(c, td, tc);
        if (td < bd) bd = td, best_d = c;
        if (tc < bc) bc = tc, best_c = c;
      }
    }
    // Scaling beyond the SM budget, for the record (not the reported figure).
    int gpu_sms = 0;
    EPX_CUDA_CHECK(
        cudaDeviceGetAttribute(&gpu_sms, cudaDevAttrMultiProcessorCount, w.comm->device()));
    for (int sms : {32, 48, 64}) {
      if (sms > gpu_sms / w.comm->ranks_on_device()) continue;  // in-process ranks share a GPU
      Config c = best_d;
      c.num_sms = sms;
      c.num_send_sms = sms / 3;
      double td, tc;
      measure(c, td, tc);
    }
  }

  // The pull dispatch (Config::pull_dispatch): same workload; with the sweep,
  // its send share (the SMs that fill the export ring) is swept too.
  Config best_p = best_d;
  best_p.pull_dispatch = true;
  best_p.num_send_sms = 0;
  if (R > 1 && o.sweep) {
    double bp = 1e30;
    for (int send : {o.num_sms / 12, o.num_sms / 8, o.num_sms / 6, o.num_sms / 4, o.num_sms / 3}) {
      if (send < 1) continue;
      Config c = best_p;
      c.num_send_sms = send;
      const double t = max_over_ranks(w, time_us(
                                             w, [&] { dispatch_cached(c, false); }, 2, 10));
      sweep.push_back(
          {{"num_sms", c.num_sms}, {"pull", true}, {"send_sms", c.send_sms()}, {"dispatch_us", t}});
      if (w.rank == 0)
        std::printf("sweep pull sms=%d send=%d: dispatch %.1f us\n", c.num_sms, c.send_sms(), t);
      if (t < bp) bp = t, best_p = c;
    }
  }

  const double t_full = time_us(
      w, [&] { w.buffer->dispatch(full); }, o.warmup, o.iters);
  const double t_bf16 = time_us(
      w, [&] { dispatch_cached(best_d, false); }, o.warmup, o.iters);
  const double t_fp8 = time_us(
      w, [&] { dispatch_cached(best_d, true); }, o.warmup, o.iters);
  const double t_comb = time_us(
      w, [&] { combine(best_c); }, o.warmup, o.iters);

  double t_pull_bf16 = 0, t_pull_fp8 = 0;
  if (R > 1) {
    t_pull_bf16 = time_us(
        w, [&] { dispatch_cached(best_p, false); }, o.warmup, o.iters);
    t_pull_fp8 = time_us(
        w, [&] { dispatch_cached(best_p, true); }, o.warmup, o.iters);
  }

  const double g_bf16 = mean_over_ranks(w, bytes_bf16 / t_bf16 / 1e3);
  const double g_fp8 = mean_over_ranks(w, bytes_fp8 / t_fp8 / 1e3);
  const double g_comb = mean_over_ranks(w, bytes_bf16 / t_comb / 1e3);
  const double g_full = mean_over_ranks(w, bytes_bf16 / t_full / 1e3);
  const double us_bf16 = mean_over_ranks(w, t_bf16), us_fp8 = mean_over_ranks(w, t_fp8);
  const double us_comb = mean_over_ranks(w, t_comb), us_full = mean_over_ranks(w, t_full);
  const double min_bf16 = min_over_ranks(w, bytes_bf16 / t_bf16 / 1e3);
  const double min_fp8 = min_over_ranks(w, bytes_fp8 / t_fp8 / 1e3);
  const double min_comb = min_over_ranks(w, bytes_bf16 / t_comb / 1e3);

  result["family"] = "ht";
  result["num_sms"] = o.num_sms;
  result["dispatch_config"] = {{"num_sms", best_d.num_sms},
                               {"send_sms", best_d.send_sms()},
                               {"chunk", best_d.num_max_send_tokens}};
  result["combine_config"] = {{"num_sms", best_c.num_sms},
                              {"send_sms", best_c.send_sms()},
                              {"chunk", best_c.num_max_send_tokens}};
  result["dispatch_bf16_gbps"] = g_bf16;
  result["dispatch_fp8_gbps"] = g_fp8;
  result["combine_gbps"] = g_comb;
  result["dispatch_bf16_us"] = us_bf16;
  result["dispatch_fp8_us"] = us_fp8;
  result["combine_us"] = us_comb;
  result["dispatch_bf16_uncached_us"] = us_full;
  result["dispatch_bf16_uncached_gbps"] = g_full;
  result["min_rank_gbps"] = {
      {"dispatch_bf16", min_bf16}, {"dispatch_fp8", min_fp8}, {"combine", min_comb}};
  if (R > 1) {
    const double us_pb = mean_over_ranks(w, t_pull_bf16), us_pf = mean_over_ranks(w, t_pull_fp8);
    result["pull_dispatch_config"] = {{"num_sms", best_p.num_sms}, {"send_sms", best_p.send_sms()}};
    result["pull_dispatch_bf16_us"] = us_pb;
    result["pull_dispatch_fp8_us"] = us_pf;
    result["pull_dispatch_bf16_gbps"] = mean_over_ranks(w, bytes_bf16 / t_pull_bf16 / 1e3);
    result["pull_dispatch_fp8_gbps"] = mean_over_ranks(w, bytes_fp8 / t_pull_fp8 / 1e3);
  }
  result["recv_tokens_rank0"] = N;
  result["ring_rows_per_peer"] = base.num_max_recv_tokens;
  result["timing"] =
      "median of iters per rank (L2 flushed, ranks aligned by an all-reduce), mean over ranks";
  result["sweep"] = sweep;
  if (w.rank == 0) {
    std::printf(
        "\nEPX high-throughput, %d ranks%s, %d tokens, hidden %d, top-%d, %d experts, %d SMs\n", R,
        ranks_note(w).c_str(), T, H, K, E, o.num_sms);
    std::printf("%-28s %10s %10s\n", "op", "us", "GB/s");
    std::printf("%-28s %10.1f %10.1f\n", "dispatch BF16 (cached)", us_bf16, g_bf16);
    std::printf("%-28s %10.1f %10.1f\n", "dispatch FP8 (cached)", us_fp8, g_fp8);
    std::printf("%-28s %10.1f %10.1f\n", "combine BF16", us_comb, g_comb);
    std::printf("%-28s %10.1f %10.1f\n", "dispatch BF16 (with layout sync)", us_full, g_full);
    if (R > 1) {
      std::printf("%-28s %10.1f %10.1f   (%d of %d SMs fill the export ring)\n",
                  "pull dispatch BF16 (cached)", result["pull_dispatch_bf16_us"].get<double>(),
                  result["pull_dispatch_bf16_gbps"].get<double>(), best_p.send_sms(),
                  best_p.num_sms);
      std::printf("%-28s %10.1f %10.1f\n", "pull dispatch FP8 (cached)",
                  result["pull_dispatch_fp8_us"].get<double>(),
                  result["pull_dispatch_fp8_gbps"].get<double>());
    }
    std::printf("buffer bytes per rank: %zu (ring of %d rows per peer)\n", w.buffer->buffer_bytes(),
                base.num_max_recv_tokens);
  }
}

}  // namespace epx::bench
