// epx-bench ht: high-throughput dispatch (BF16, FP8) and combine, counted like
// DeepEP's tests: bytes = recv_x.numel() * element size (+ FP8 scales).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/common.hpp"
#include "common/check.hpp"
#include "epx/reference.hpp"

namespace epx::bench {
namespace {

/// This rank's inputs and the calls every variant times: the layout, the
/// uncached dispatch with it (the count exchange each time), and a first
/// dispatch whose handle the cached dispatches and the combines take.
struct HtCalls {
  World& w;
  int T, H;
  std::shared_ptr<void> d_x, d_xq, d_xs;
  StreamArgs s;
  Layout layout;
  DispatchArgs full;
  DispatchResult first;

  HtCalls(World& w_, const Options& o, const std::shared_ptr<void>& d_topk, std::shared_ptr<void> x,
          std::shared_ptr<void> xq, std::shared_ptr<void> xs, const std::shared_ptr<void>& d_w,
          const Config& base)
      : w(w_),
        T(o.tokens),
        H(o.hidden),
        d_x(std::move(x)),
        d_xq(std::move(xq)),
        d_xs(std::move(xs)) {
    const int K = o.topk;
    s.stream = w.stream;
    layout = w.buffer->get_dispatch_layout(tv(d_topk.get(), DType::kI64, {T, K}), o.experts, s);
    full.x = tv(d_x.get(), DType::kBF16, {T, H});
    full.topk_idx = tv(d_topk.get(), DType::kI64, {T, K});
    full.topk_weights = tv(d_w.get(), DType::kF32, {T, K});
    full.set_layout(layout);
    full.streams = s;
    full.config = base;
    first = w.buffer->dispatch(full);
    EPX_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  }
  DispatchResult cached(const Config& c, bool fp8) const {
    DispatchArgs a;
    a.x = fp8 ? tv(d_xq.get(), DType::kFP8E4M3, {T, H}) : tv(d_x.get(), DType::kBF16, {T, H});
    if (fp8) a.x_scales = tv(d_xs.get(), DType::kF32, {T, H / 128});
    a.handle = first.handle;
    a.config = c;
    a.streams = s;
    return w.buffer->dispatch(a);
  }
  CombineResult combine(const Config& c) const {
    CombineArgs a;
    a.x = first.recv_x.view;
    a.handle = first.handle;
    a.config = c;
    a.streams = s;
    return w.buffer->combine(a);
  }
};

/// Across (virtual) nodes: the two-level kernels have no chunk or split to
/// sweep yet; each op is timed at --sms, and the bandwidths are given with
/// DeepEP's two figures: network ("RDMA") bytes per GPU, as DeepEP's
/// test_internode.py counts them (each token once per node it reaches, its
/// own node included, hidden x 2 bytes), and NVLink bytes (the rows
/// received, recv_x's bytes). `net_cross_bytes` is what actually crosses
/// between nodes (other nodes only).
void run_ht_internode(World& w, const Options& o, nlohmann::json& result,
                      const std::vector<int64_t>& topk, const HtCalls& calls) {
  const int T = o.tokens, H = o.hidden, K = o.topk, E = o.experts, R = w.num_ranks;
  const int L = w.buffer->num_nvl_ranks(), N = R / L, me_node = w.rank / L;
  const Config cfg = *calls.full.config;
  const int64_t Nr = calls.first.recv_x.size(0);
  // Nodes each token reaches (experts spread evenly over the ranks).
  int64_t node_tokens = 0, cross_tokens = 0;
  for (int t = 0; t < T; ++t) {
    std::vector<char> hit(N, 0);
    for (int k = 0; k < K; ++k) {
      const int64_t e = topk[static_cast<std::size_t>(t) * K + k];
      if (e >= 0) hit[static_cast<int>(e / (E / R)) / L] = 1;
    }
    for (int m = 0; m < N; ++m)
      if (hit[m]) {
        ++node_tokens;
        if (m != me_node) ++cross_tokens;
      }
  }
  const double net_bytes = static_cast<double>(node_tokens) * H * 2;
  const double cross_bytes = static_cast<double>(cross_tokens) * H * 2;
  const double nvl_bytes = static_cast<double>(Nr) * H * 2;
  // Each op's timing, with what the network engine carried per op over those
  // runs where the backend counts it (the proxy): a NIC or a proxy thread
  // pays per request, so a ring op should post a few large puts.
  nlohmann::json traffic = nlohmann::json::object();
  auto timed = [&](const char* name, const std::function<void()>& fn) {
    const auto before = w.buffer->network_traffic();
    const double us = time_us(w, fn, o.warmup, o.iters);
    w.comm->barrier();  // every rank's op done: what it posted was taken
    const auto after = w.buffer->network_traffic();
    if (before && after) {
      const double ops = o.warmup + o.iters;
      const double puts = static_cast<double>(after->puts - before->puts);
      const double bytes = static_cast<double>(after->put_bytes - before->put_bytes);
      traffic[name] = {
          {"commands_per_op", mean_over_ranks(w, (after->commands - before->commands) / ops)},
          {"puts_per_op", mean_over_ranks(w, puts / ops)},
          {"bytes_per_put", mean_over_ranks(w, puts > 0 ? bytes / puts : 0.0)},
          {"writes_per_op", mean_over_ranks(w, (after->writes - before->writes) / ops)},
          {"signals_per_op", mean_over_ranks(w, (after->signals - before->signals) / ops)}};
    }
    return us;
  };
  const double t_full = timed("dispatch_bf16_uncached", [&] { w.buffer->dispatch(calls.full); });
  const double t_bf16 = timed("dispatch_bf16", [&] { calls.cached(cfg, false); });
  const double t_fp8 = timed("dispatch_fp8", [&] { calls.cached(cfg, true); });
  const double t_comb = timed("combine", [&] { calls.combine(cfg); });
  // FP8 rows are H bytes plus H / 128 scales of 4 bytes.
  const double fp8_scale = (H + 4.0 * (H / 128)) / (2.0 * H);
  auto rates = [&](double us, double scale) {
    return nlohmann::json{{"us", mean_over_ranks(w, us)},
                          {"net_gbps", mean_over_ranks(w, scale * net_bytes / us / 1e3)},
                          {"net_cross_gbps", mean_over_ranks(w, scale * cross_bytes / us / 1e3)},
                          {"nvl_gbps", mean_over_ranks(w, scale * nvl_bytes / us / 1e3)},
                          {"min_rank_net_gbps", min_over_ranks(w, scale * net_bytes / us / 1e3)}};
  };
  result["family"] = "ht";
  result["internode"] = true;
  // Which kernels the ops took (DispatchHandle::took_rings): the whole-call
  // ones where their areas fit num_nvl_bytes, else (or with EPX_HT_RINGS) the rings.
  const bool rings = calls.first.handle->took_rings();
  result["kernels"] = rings ? "rings" : "whole-call";
  result["num_sms"] = cfg.num_sms;
  result["nodes"] = N;
  result["dispatch_bf16"] = rates(t_bf16, 1.0);
  result["dispatch_fp8"] = rates(t_fp8, fp8_scale);
  result["combine"] = rates(t_comb, 1.0);
  result["dispatch_bf16_uncached"] = rates(t_full, 1.0);
  result["traffic"] = traffic;
  result["bytes_rank0"] = {{"net", net_bytes}, {"net_cross", cross_bytes}, {"nvl", nvl_bytes}};
  result["recv_tokens_rank0"] = Nr;
  result["counting"] =
      "net: tokens x nodes reached (own node included, as DeepEP's test_internode.py) x H x 2; "
      "net_cross: other nodes only; nvl: received rows x H x 2 (FP8: H + 4 H / 128 per row)";
  result["timing"] =
      "median of iters per rank (L2 flushed, ranks aligned by an all-reduce), mean over ranks";
  // SMs: the cached BF16 dispatch and the combine at other block counts (the
  // kernels' one knob across nodes so far), for the default configs.
  nlohmann::json sweep = nlohmann::json::array();
  if (o.sweep) {
    for (int sms : {4, 6, 8, 12, 16, 24, 32, 48}) {
      if (sms > sm_share(w)) continue;
      Config c = cfg;
      c.num_sms = sms;
      double td = 0, tc = 0;
      try {
        td = mean_over_ranks(w, time_us(
                                    w, [&] { calls.cached(c, false); }, 2, 10));
        tc = mean_over_ranks(w, time_us(
                                    w, [&] { calls.combine(c); }, 2, 10));
      } catch (const Error& e) {
        // More SMs, more rings: the buffer may not hold them (every rank
        // refuses alike, before any kernel). The sweep ends there.
        if (e.code() != ErrorCode::kBufferTooSmall) throw;
        sweep.push_back({{"num_sms", sms}, {"error", e.what()}});
        if (w.rank == 0) std::printf("sweep sms=%d: %s\n", sms, e.what());
        break;
      }
      sweep.push_back({{"num_sms", sms}, {"dispatch_bf16_us", td}, {"combine_us", tc}});
      if (w.rank == 0)
        std::printf("sweep sms=%d: dispatch BF16 (cached) %.1f us, combine %.1f us\n", sms, td, tc);
    }
  }
  result["sweep"] = sweep;
  // Through the rings, their records per network put: the one-host engines
  // pay per put, a NIC much less.
  nlohmann::json chunks = nlohmann::json::array();
  if (o.sweep && rings) {
    const char* env = std::getenv("EPX_HT_RINGS");
    const int records = env != nullptr ? std::atoi(env) : 0;
    const int slots = cfg.num_max_rdma_recv_tokens > 0 ? cfg.num_max_rdma_recv_tokens
                      : records > 1                    ? records
                                                       : 256;
    for (int chunk : {6, 12, 24, 48, 96}) {
      if (chunk > slots) continue;
      Config c = cfg;
      c.num_max_rdma_send_tokens = chunk;
      const double td = mean_over_ranks(w, time_us(
                                               w, [&] { calls.cached(c, false); }, 2, 10));
      chunks.push_back({{"rdma_send_tokens", chunk}, {"dispatch_bf16_us", td}});
      if (w.rank == 0)
        std::printf("sweep rdma_send_tokens=%d: dispatch BF16 (cached) %.1f us\n", chunk, td);
    }
  }
  result["rdma_chunk_sweep"] = chunks;
  if (w.rank == 0) {
    std::printf(
        "\nEPX high-throughput across nodes, %d ranks%s, %d tokens, hidden %d, top-%d, %d experts, "
        "%d SMs, %s kernels\n",
        R, ranks_note(w).c_str(), T, H, K, E, cfg.num_sms, rings ? "ring" : "whole-call");
    std::printf("%-30s %10s %12s %12s %12s\n", "op", "us", "net GB/s", "cross GB/s", "NVL GB/s");
    auto row = [&](const char* name, const char* key) {
      const auto& r = result[key];
      std::printf("%-30s %10.1f %12.1f %12.1f %12.1f\n", name, r["us"].get<double>(),
                  r["net_gbps"].get<double>(), r["net_cross_gbps"].get<double>(),
                  r["nvl_gbps"].get<double>());
    };
    row("dispatch BF16 (cached)", "dispatch_bf16");
    row("dispatch FP8 (cached)", "dispatch_fp8");
    row("combine BF16", "combine");
    row("dispatch BF16 (count exchange)", "dispatch_bf16_uncached");
    std::printf("buffer bytes per rank: %zu\n", w.buffer->buffer_bytes());
    for (const auto& [name, t] : traffic.items())
      std::printf("%-30s %.1f puts per op of %.0f bytes each, %.1f engine writes, %.1f signals\n",
                  name.c_str(), t["puts_per_op"].get<double>(), t["bytes_per_put"].get<double>(),
                  t["writes_per_op"].get<double>(), t["signals_per_op"].get<double>());
  }
}

}  // namespace

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
  const Config base = ht_base_config(o, R);
  const HtCalls calls(w, o, d_topk, d_x, d_xq, d_xs, d_w, base);
  if (w.buffer->num_rdma_ranks() > 1) return run_ht_internode(w, o, result, topk, calls);
  const int64_t N = calls.first.recv_x.size(0);
  const double bytes_bf16 = static_cast<double>(N) * H * 2;
  const double bytes_fp8 = static_cast<double>(N) * H + static_cast<double>(N) * (H / 128) * 4;

  // Sweep chunk sizes and the send/receive split at the given SM count.
  Config best_d = base, best_c = base;
  nlohmann::json sweep = nlohmann::json::array();
  auto measure = [&](const Config& c, double& td, double& tc) {
    td = max_over_ranks(w, time_us(
                               w, [&] { calls.cached(c, false); }, 2, 10));
    tc = max_over_ranks(w, time_us(
                               w, [&] { calls.combine(c); }, 2, 10));
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
    for (int sms : {32, 48, 64}) {
      if (sms > sm_share(w)) continue;  // in-process ranks share a GPU
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
                                             w, [&] { calls.cached(c, false); }, 2, 10));
      sweep.push_back(
          {{"num_sms", c.num_sms}, {"pull", true}, {"send_sms", c.send_sms()}, {"dispatch_us", t}});
      if (w.rank == 0)
        std::printf("sweep pull sms=%d send=%d: dispatch %.1f us\n", c.num_sms, c.send_sms(), t);
      if (t < bp) bp = t, best_p = c;
    }
  }

  const double t_full = time_us(
      w, [&] { w.buffer->dispatch(calls.full); }, o.warmup, o.iters);
  const double t_bf16 = time_us(
      w, [&] { calls.cached(best_d, false); }, o.warmup, o.iters);
  const double t_fp8 = time_us(
      w, [&] { calls.cached(best_d, true); }, o.warmup, o.iters);
  const double t_comb = time_us(
      w, [&] { calls.combine(best_c); }, o.warmup, o.iters);

  double t_pull_bf16 = 0, t_pull_fp8 = 0;
  if (R > 1) {
    t_pull_bf16 = time_us(
        w, [&] { calls.cached(best_p, false); }, o.warmup, o.iters);
    t_pull_fp8 = time_us(
        w, [&] { calls.cached(best_p, true); }, o.warmup, o.iters);
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
