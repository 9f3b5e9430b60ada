// epx-nvlink-probe: how fast the copy loop of the high-throughput kernels
// (kernels/copy.cuh) moves bytes between the local GPUs, per SM count:
//   write: every GPU stores into every peer (the push dispatch and combine),
//   read:  every GPU loads from every peer into its own memory (the pull dispatch),
//   local: every GPU copies within its own memory (the pull dispatch's export).
//   write+local: write on the listed SMs while --local-sms more SMs copy within
//          the GPU's memory, as the push dispatch's receivers do beside its
//          senders: whether local traffic slows the NVLink stores.
// All GPUs run at once (one process, peer access), as in an all-to-all. The
// figure per GPU is the bytes it moved / the slowest GPU's kernel time; for
// write and read those bytes all cross NVLink.
//   epx-nvlink-probe [--mb 256] [--sms 4,8,16,24,32,0] [--local-sms 16] [--iters 10] [--json F]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/plan.hpp"
#include "epx_git_commit.h"  // generated at every build (bench/CMakeLists.txt)
#include "kernels/copy.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kMaxPairs = 8;
constexpr int kRowBytes = 14336;  // one BF16 row of hidden 7168, as the benchmark workload

struct Pairs {
  const uint8_t* src[kMaxPairs];
  uint8_t* dst[kMaxPairs];
  int num_pairs;
  long long rows;  ///< rows per pair
};

/// Warp w takes rows w, w + warps, ... of the pairs interleaved (row i of
/// pair i % num_pairs), so every peer is served at once, as in the kernels.
template <bool kCoherent, int kU>
__global__ void __launch_bounds__(kThreads, 1) copy_kernel(Pairs p) {
  const int lane = threadIdx.x % 32;
  const long long warps = static_cast<long long>(gridDim.x) * (kThreads / 32);
  const long long total = p.rows * p.num_pairs;
  for (long long i = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; i < total; i += warps) {
    const int k = static_cast<int>(i % p.num_pairs);
    const long long row = i / p.num_pairs;
    epx::kernels::warp_copy<kCoherent, kU>(p.dst[k] + row * kRowBytes, p.src[k] + row * kRowBytes,
                                           kRowBytes, lane);
  }
}

// Bulk copies (the copy engine, no registers): each warp's lane 0 moves its
// rows in kTmaChunk pieces through two shared-memory buffers, global ->
// shared (completing on an mbarrier) -> global: the load of piece k is issued
// before piece k - 1 is waited for and stored, so two loads are in flight.
constexpr int kTmaChunk = 7168;
constexpr int kTmaSmem = (kThreads / 32) * 2 * kTmaChunk + (kThreads / 32) * 2 * 8;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst_smem, const void* src, int bytes,
                                          uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst_smem)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra wait_%=;\n}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src_smem, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src_smem)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
/// Waits until at most `n` store groups still read shared memory.
template <int n>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(n) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1) tma_copy_kernel(Pairs p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* buf = smem + warp * 2 * kTmaChunk;
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + (kThreads / 32) * 2 * kTmaChunk) + warp * 2;
  if (lane == 0) {
    mbar_init(bar);
    mbar_init(bar + 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  if (lane != 0) return;
  const long long warps = static_cast<long long>(gridDim.x) * (kThreads / 32);
  const long long total = p.rows * p.num_pairs;
  constexpr int pieces = kRowBytes / kTmaChunk;
  uint32_t phase[2] = {0, 0};
  long long k = 0;  // pieces issued by this warp
  uint8_t* prev_dst = nullptr;
  for (long long i = blockIdx.x * (kThreads / 32) + warp; i < total; i += warps) {
    const int pair = static_cast<int>(i % p.num_pairs);
    const long long row = i / p.num_pairs;
    for (int c = 0; c < pieces; ++c, ++k) {
      const int s = static_cast<int>(k & 1);
      bulk_wait_read<0>();  // the store of piece k - 2, the last to read buf[s], has read it
      bulk_load(buf + s * kTmaChunk, p.src[pair] + row * kRowBytes + c * kTmaChunk, kTmaChunk,
                bar + s);
      if (k > 0) {  // store the previous piece while this one loads
        const int q = s ^ 1;
        mbar_wait(bar + q, phase[q]);
        phase[q] ^= 1;
        bulk_store(prev_dst, buf + q * kTmaChunk, kTmaChunk);
      }
      prev_dst = p.dst[pair] + row * kRowBytes + c * kTmaChunk;
    }
  }
  if (k > 0) {
    const int q = static_cast<int>((k - 1) & 1);
    mbar_wait(bar + q, phase[q]);
    bulk_store(prev_dst, buf + q * kTmaChunk, kTmaChunk);
  }
  bulk_wait_read<0>();
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

using Kernel = void (*)(Pairs);

/// The write+local mode's local side: copies the rows of its pairs over and
/// over (warp w: rows w, w + warps, ...) until *stop is set, then adds the
/// bytes it moved to *moved. Checked once per row.
__global__ void __launch_bounds__(kThreads, 1)
    copy_until_kernel(Pairs p, const volatile int* stop, unsigned long long* moved) {
  const int lane = threadIdx.x % 32;
  const long long warps = static_cast<long long>(gridDim.x) * (kThreads / 32);
  const long long total = p.rows * p.num_pairs;
  long long rows = 0;
  for (long long i = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; *stop == 0; i += warps) {
    const long long j = i % total;
    const int k = static_cast<int>(j % p.num_pairs);
    const long long row = j / p.num_pairs;
    epx::kernels::warp_copy<false, 8>(p.dst[k] + row * kRowBytes, p.src[k] + row * kRowBytes,
                                      kRowBytes, lane);
    ++rows;
  }
  if (lane == 0) atomicAdd(moved, static_cast<unsigned long long>(rows) * kRowBytes);
}

__global__ void set_flag_kernel(int* flag, int v) {
  *flag = v;
}

__global__ void fill_kernel(uint32_t* p, std::size_t n, uint32_t seed) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint32_t>(i * 2654435761u) ^ seed;
}

__global__ void diff_kernel(const uint32_t* a, const uint32_t* b, std::size_t n,
                            unsigned long long* bad) {
  unsigned long long mine = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    mine += a[i] != b[i];
  if (mine) atomicAdd(bad, mine);
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"NVLink store/load and local copy ceilings of EPX's copy loop"};
  int mb = 256, iters = 10, local_sms = 16;
  std::vector<int> sms_list{4, 8, 16, 24, 32, 0};
  std::string json_path;
  app.add_option("--mb", mb, "MB per (GPU, peer) pair")->capture_default_str();
  app.add_option("--sms", sms_list, "SM counts (0 = all)")->delimiter(',');
  app.add_option("--iters", iters, "timed runs (median reported)")->capture_default_str();
  app.add_option("--local-sms", local_sms,
                 "write+local: SMs copying locally beside the writers (0: skip the mode)")
      ->capture_default_str();
  app.add_option("--json", json_path, "write results here");
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a pipe as they are printed

  int n = 0;
  EPX_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (n < 1) {
    std::fprintf(stderr, "no GPU\n");
    return 1;
  }
  n = std::min(n, kMaxPairs);
  int gpu_sms = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&gpu_sms, cudaDevAttrMultiProcessorCount, 0));
  bool peers = n > 1;
  for (int g = 0; g < n && peers; ++g) {
    EPX_CUDA_CHECK(cudaSetDevice(g));
    for (int h = 0; h < n; ++h) {
      if (h == g) continue;
      int ok = 0;
      EPX_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, g, h));
      if (!ok) {
        std::printf("GPU %d cannot access GPU %d: write/read skipped\n", g, h);
        peers = false;
        break;
      }
      const cudaError_t e = cudaDeviceEnablePeerAccess(h, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) EPX_CUDA_CHECK(e);
      (void)cudaGetLastError();
    }
  }
  const int slots = std::max(1, n - 1);
  const long long rows = static_cast<long long>(mb) * (1 << 20) / kRowBytes;
  const std::size_t bytes = static_cast<std::size_t>(rows) * kRowBytes * slots;
  std::vector<uint8_t*> src(n), dst(n), lsrc(n), ldst(n);
  std::vector<cudaStream_t> stream(n), lstream(n);
  std::vector<int*> stop(n);
  std::vector<unsigned long long*> moved(n);
  std::vector<cudaEvent_t> ev0(n), ev1(n);
  for (int g = 0; g < n; ++g) {
    EPX_CUDA_CHECK(cudaSetDevice(g));
    EPX_CUDA_CHECK(cudaMalloc(&src[g], bytes));
    EPX_CUDA_CHECK(cudaMalloc(&dst[g], bytes));
    fill_kernel<<<264, 512>>>(reinterpret_cast<uint32_t*>(src[g]), bytes / 4,
                              0x9e3779b9u * (g + 1));
    EPX_CUDA_CHECK(cudaGetLastError());
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream[g], cudaStreamNonBlocking));
    if (local_sms > 0) {  // the write+local mode's own local rows and control words
      EPX_CUDA_CHECK(cudaMalloc(&lsrc[g], bytes));
      EPX_CUDA_CHECK(cudaMalloc(&ldst[g], bytes));
      EPX_CUDA_CHECK(cudaMemset(lsrc[g], 0x5a, bytes));
      EPX_CUDA_CHECK(cudaMalloc(&stop[g], sizeof(int)));
      EPX_CUDA_CHECK(cudaMalloc(&moved[g], sizeof(unsigned long long)));
      EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&lstream[g], cudaStreamNonBlocking));
    }
    EPX_CUDA_CHECK(cudaEventCreate(&ev0[g]));
    EPX_CUDA_CHECK(cudaEventCreate(&ev1[g]));
  }
  // Slot of peer h in g's buffers: g's own skipped, as in the staging.
  auto slot = [](int g, int h) { return epx::plan::HtRegion::staging_index(h, g); };
  const std::size_t area = static_cast<std::size_t>(rows) * kRowBytes;
  // Local copies from buffer `from` to buffer `to` of one GPU, one pair per slot.
  auto local_pairs = [&](uint8_t* from, uint8_t* to) {
    Pairs p{};
    p.rows = rows;
    for (int k = 0; k < slots; ++k) {
      p.src[k] = from + k * area;
      p.dst[k] = to + k * area;
    }
    p.num_pairs = slots;
    return p;
  };
  auto pairs_of = [&](const std::string& mode, int g) {
    if (mode == "local" || n == 1) return local_pairs(src[g], dst[g]);
    Pairs p{};
    p.rows = rows;
    for (int h = 0; h < n; ++h) {
      if (h == g) continue;
      const int k = p.num_pairs++;
      if (mode == "write") {  // mine -> h's memory
        p.src[k] = src[g] + slot(g, h) * area;
        p.dst[k] = dst[h] + slot(h, g) * area;
      } else {  // h's memory -> mine
        p.src[k] = src[h] + slot(h, g) * area;
        p.dst[k] = dst[g] + slot(g, h) * area;
      }
    }
    return p;
  };

  struct Variant {
    const char* name;
    Kernel kernel;
    int u;  ///< vectors per lane in flight; 0: bulk copies
    int smem = 0;
  };
  // Loads from memory peers write during the kernel use the coherent path
  // (as the receivers do); the rest the read-only path (as the senders do).
  const Variant variants[] = {{"nc", copy_kernel<false, 8>, 8},
                              {"nc", copy_kernel<false, 16>, 16},
                              {"coherent", copy_kernel<true, 16>, 16},
                              {"tma", tma_copy_kernel, 0, kTmaSmem}};
  for (int g = 0; g < n; ++g) {
    EPX_CUDA_CHECK(cudaSetDevice(g));
    EPX_CUDA_CHECK(cudaFuncSetAttribute(tma_copy_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaSmem));
  }
  nlohmann::json rows_json = nlohmann::json::array();
  unsigned long long* bad = nullptr;
  EPX_CUDA_CHECK(cudaMallocManaged(&bad, sizeof(*bad)));
  bool all_ok = true;
  // Runs `v` once on every GPU into zeroed outputs and compares every pair's
  // output with its input: a variant that moves the wrong bytes fails here.
  auto verify = [&](const std::string& mode, const Variant& v, int blocks) {
    for (int g = 0; g < n; ++g) {
      EPX_CUDA_CHECK(cudaSetDevice(g));
      EPX_CUDA_CHECK(cudaMemset(dst[g], 0, bytes));
      EPX_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int g = 0; g < n; ++g) {
      EPX_CUDA_CHECK(cudaSetDevice(g));
      v.kernel<<<blocks, kThreads, v.smem, stream[g]>>>(pairs_of(mode, g));
      EPX_CUDA_CHECK(cudaGetLastError());
    }
    *bad = 0;
    for (int g = 0; g < n; ++g) {
      EPX_CUDA_CHECK(cudaSetDevice(g));
      EPX_CUDA_CHECK(cudaStreamSynchronize(stream[g]));
      const Pairs pr = pairs_of(mode, g);
      for (int k = 0; k < pr.num_pairs; ++k)
        diff_kernel<<<264, 512>>>(reinterpret_cast<const uint32_t*>(pr.src[k]),
                                  reinterpret_cast<const uint32_t*>(pr.dst[k]),
                                  static_cast<std::size_t>(rows) * kRowBytes / 4, bad);
      EPX_CUDA_CHECK(cudaGetLastError());
      EPX_CUDA_CHECK(cudaDeviceSynchronize());
    }
    if (*bad != 0) {
      std::printf(
          "%s %s U=%d: %llu words differ from the input: figures of this variant are void\n",
          mode.c_str(), v.name, v.u, *bad);
      all_ok = false;
    }
    return *bad == 0;
  };
  std::printf("%d GPU(s) of %d SMs, %d MB per pair, rows of %d B\n", n, gpu_sms, mb, kRowBytes);
  std::printf("%-6s %-9s %3s %5s %12s %12s\n", "mode", "loads", "U", "SMs", "us", "GB/s per GPU");
  std::printf(
      "(U 0: bulk copies through shared memory; each variant's output checked once first)\n");
  for (const std::string mode : {"write", "read", "local"}) {
    if (mode != "local" && !peers) continue;
    for (const Variant& v : variants) {
      const bool ok = verify(mode, v, gpu_sms);
      for (int sms : sms_list) {
        const int blocks = sms <= 0 || sms > gpu_sms ? gpu_sms : sms;
        std::vector<float> t;
        for (int it = 0; it < iters + 2; ++it) {
          for (int g = 0; g < n; ++g) {
            EPX_CUDA_CHECK(cudaSetDevice(g));
            EPX_CUDA_CHECK(cudaDeviceSynchronize());
          }
          for (int g = 0; g < n; ++g) {
            EPX_CUDA_CHECK(cudaSetDevice(g));
            EPX_CUDA_CHECK(cudaEventRecord(ev0[g], stream[g]));
            v.kernel<<<blocks, kThreads, v.smem, stream[g]>>>(pairs_of(mode, g));
            EPX_CUDA_CHECK(cudaGetLastError());
            EPX_CUDA_CHECK(cudaEventRecord(ev1[g], stream[g]));
          }
          float worst = 0;
          for (int g = 0; g < n; ++g) {
            EPX_CUDA_CHECK(cudaSetDevice(g));
            EPX_CUDA_CHECK(cudaEventSynchronize(ev1[g]));
            float ms = 0;
            EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0[g], ev1[g]));
            worst = std::max(worst, ms);
          }
          if (it >= 2) t.push_back(worst);
        }
        std::sort(t.begin(), t.end());
        const double us = t[t.size() / 2] * 1e3;
        const double gbps = static_cast<double>(bytes) / us / 1e3;
        std::printf("%-6s %-9s %3d %5d %12.1f %12.1f\n", mode.c_str(), v.name, v.u, blocks, us,
                    gbps);
        rows_json.push_back({{"mode", mode},
                             {"loads", v.name},
                             {"vectors_per_lane", v.u},
                             {"sms", blocks},
                             {"verified", ok},
                             {"us", us},
                             {"gbps_per_gpu", gbps}});
      }
    }
  }
  // write+local: the senders' loop (nc, 8 vectors per lane) writing on the
  // listed SMs while local_sms more SMs copy locally until the writers are
  // done (one GPU, no peer: local on both sides, which checks the mechanics).
  if (local_sms > 0 && local_sms < gpu_sms) {
    // Loaded now: a first launch (CUDA loads kernels lazily) may wait for
    // the spinning local kernel to finish, which waits for the flag.
    for (int g = 0; g < n; ++g) {
      EPX_CUDA_CHECK(cudaSetDevice(g));
      cudaFuncAttributes fa{};
      EPX_CUDA_CHECK(cudaFuncGetAttributes(&fa, copy_until_kernel));
      EPX_CUDA_CHECK(cudaFuncGetAttributes(&fa, set_flag_kernel));
    }
    const std::string wmode = peers ? "write" : "local";
    const bool ok = verify(wmode, variants[0], gpu_sms);
    std::printf("write+local: the writers' figure, with %d SMs copying locally beside them\n",
                local_sms);
    std::printf("%-12s %5s %5s %12s %12s %12s\n", "mode", "SMs", "local", "us", "GB/s per GPU",
                "local GB/s");
    for (int sms : sms_list) {
      const int blocks = std::min(sms <= 0 ? gpu_sms : sms, gpu_sms - local_sms);
      std::vector<float> t;
      std::vector<double> local_gbps;
      for (int it = 0; it < iters + 2; ++it) {
        for (int g = 0; g < n; ++g) {
          EPX_CUDA_CHECK(cudaSetDevice(g));
          EPX_CUDA_CHECK(cudaDeviceSynchronize());
          EPX_CUDA_CHECK(cudaMemset(stop[g], 0, sizeof(int)));
          EPX_CUDA_CHECK(cudaMemset(moved[g], 0, sizeof(unsigned long long)));
          EPX_CUDA_CHECK(cudaDeviceSynchronize());
        }
        for (int g = 0; g < n; ++g) {
          EPX_CUDA_CHECK(cudaSetDevice(g));
          copy_until_kernel<<<local_sms, kThreads, 0, lstream[g]>>>(local_pairs(lsrc[g], ldst[g]),
                                                                    stop[g], moved[g]);
          EPX_CUDA_CHECK(cudaGetLastError());
        }
        for (int g = 0; g < n; ++g) {
          EPX_CUDA_CHECK(cudaSetDevice(g));
          EPX_CUDA_CHECK(cudaEventRecord(ev0[g], stream[g]));
          variants[0].kernel<<<blocks, kThreads, 0, stream[g]>>>(pairs_of(wmode, g));
          EPX_CUDA_CHECK(cudaGetLastError());
          EPX_CUDA_CHECK(cudaEventRecord(ev1[g], stream[g]));
          set_flag_kernel<<<1, 1, 0, stream[g]>>>(stop[g], 1);
          EPX_CUDA_CHECK(cudaGetLastError());
        }
        float worst = 0;
        double local_bytes = 0;
        for (int g = 0; g < n; ++g) {
          EPX_CUDA_CHECK(cudaSetDevice(g));
          EPX_CUDA_CHECK(cudaDeviceSynchronize());
          float ms = 0;
          EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0[g], ev1[g]));
          worst = std::max(worst, ms);
          unsigned long long m = 0;
          EPX_CUDA_CHECK(cudaMemcpy(&m, moved[g], sizeof(m), cudaMemcpyDeviceToHost));
          local_bytes += static_cast<double>(m);
        }
        if (it >= 2) {
          t.push_back(worst);
          local_gbps.push_back(local_bytes / n / (worst * 1e3) / 1e3);
        }
      }
      std::sort(t.begin(), t.end());
      std::sort(local_gbps.begin(), local_gbps.end());
      const double us = t[t.size() / 2] * 1e3;
      const double gbps = static_cast<double>(bytes) / us / 1e3;
      const double lg = local_gbps[local_gbps.size() / 2];
      std::printf("%-12s %5d %5d %12.1f %12.1f %12.1f\n", "write+local", blocks, local_sms, us,
                  gbps, lg);
      rows_json.push_back({{"mode", "write+local"},
                           {"writes_to", wmode},
                           {"loads", variants[0].name},
                           {"vectors_per_lane", variants[0].u},
                           {"sms", blocks},
                           {"local_sms", local_sms},
                           {"verified", ok},
                           {"us", us},
                           {"gbps_per_gpu", gbps},
                           {"local_gbps_per_gpu", lg}});
    }
  }
  if (!json_path.empty()) {
    nlohmann::json j{{"gpus", n},
                     {"mb_per_pair", mb},
                     {"row_bytes", kRowBytes},
                     {"commit", EPX_GIT_COMMIT},
                     {"timing", "median of iters; all GPUs at once; slowest GPU's kernel time"},
                     {"rows", rows_json}};
    std::ofstream(json_path) << j.dump(2) << "\n";
    std::printf("wrote %s\n", json_path.c_str());
  }
  for (int g = 0; g < n; ++g) {
    EPX_CUDA_CHECK(cudaSetDevice(g));
    EPX_CUDA_CHECK(cudaFree(src[g]));
    EPX_CUDA_CHECK(cudaFree(dst[g]));
    if (local_sms > 0) {
      EPX_CUDA_CHECK(cudaFree(lsrc[g]));
      EPX_CUDA_CHECK(cudaFree(ldst[g]));
      EPX_CUDA_CHECK(cudaFree(stop[g]));
      EPX_CUDA_CHECK(cudaFree(moved[g]));
      EPX_CUDA_CHECK(cudaStreamDestroy(lstream[g]));
    }
  }
  EPX_CUDA_CHECK(cudaFree(bad));
  return all_ok ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-nvlink-probe: %s\n", e.what());
    return 1;
  }
}
