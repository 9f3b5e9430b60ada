// High-throughput intranode dispatch and combine.
//
// Every rank's receive staging holds `capacity` rows per source rank. Sender
// warps copy whole chunks of rows (num_max_send_tokens) straight into the
// destination's staging with NVLink stores, then release-store the chunk's
// flag there with the op's epoch. Receiver warps acquire flags and move rows
// out (dispatch: into recv_x in rank order; combine: reduce per token).
// Tokens a rank sends to itself skip the staging.
#include "core/check.hpp"
#include "kernels/kernels.hpp"

namespace epx::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

/// Warp-cooperative copy of `bytes` (multiple of 16). Software-pipelined: each
/// lane keeps 8 vectors in flight, loading the next batch's vector right after
/// storing the current one, so reads overlap the (NVLink or HBM) stores. kCoherent: the source is
/// written by peers during the kernel (L2-coherent loads, kept after the flag wait); otherwise
/// read-only loads.
template <bool kCoherent>
__device__ __forceinline__ int4 load16(const int4* p) {
  if constexpr (kCoherent) {
    return dev::ld_l2(p);
  } else {
    return dev::ld_nc(p);
  }
}

template <bool kCoherent>
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
  constexpr int kU = 8;
  auto* d = reinterpret_cast<int4*>(dst);
  auto* s = reinterpret_cast<const int4*>(src);
  const int n = bytes / 16;
  const int full = n / (32 * kU) * (32 * kU);
  int4 v[kU];
  if (full > 0) {
#pragma unroll
    for (int u = 0; u < kU; ++u) v[u] = load16<kCoherent>(s + lane + 32 * u);
  }
  for (int i = 0; i < full; i += 32 * kU) {
    const bool more = i + 32 * kU < full;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      dev::st_na(d + i + lane + 32 * u, v[u]);
      if (more) v[u] = load16<kCoherent>(s + i + 32 * kU + lane + 32 * u);
    }
  }
  for (int i = full + lane; i < n; i += 32) dev::st_na(d + i, load16<kCoherent>(s + i));
}

__device__ __forceinline__ int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

/// False (and reported once) when a received row lies past the outputs, which
/// happens only when num_worst_tokens was too small.
__device__ __forceinline__ bool row_fits(const HtDispatchParams& p, int64_t row, int src, int slot,
                                         int lane) {
  if (row < p.max_recv_rows) return true;
  if (lane == 0)
    dev::report(p.diag, DiagCode::kTooManyTokens, OpId::kDispatch, p.t.rank, src, slot,
                p.max_recv_rows, static_cast<uint32_t>(row));
  return false;
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(HtDispatchParams p) {
  const int R = p.t.num_ranks, me = p.t.rank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t epoch = *p.op_counter;
  const int K = p.num_topk, epr = p.num_experts > 0 ? p.num_experts / R : 0;
  const int extras = p.num_scales + 2 * K + 1;  // 4-byte words after the payload
  const int CH = p.off.chunk;

  if (static_cast<int>(blockIdx.x) < p.num_send_blocks) {
    // ---------------- send ----------------
    int max_chunks = 0;
    for (int r = 0; r < R; ++r) max_chunks = max(max_chunks, ceil_div(p.send_counts[r], CH));
    const int gw = blockIdx.x * kWarps + warp, nw = p.num_send_blocks * kWarps;
    for (int item = gw; item < max_chunks * R; item += nw) {
      const int j = item / R, dst = (me + 1 + item % R) % R;
      const int count = p.send_counts[dst];
      const int k0 = j * CH, k1 = min(count, k0 + CH);
      if (k0 >= k1) continue;
      const bool self = dst == me;
      const int lo_e = dst * epr;
      for (int k = k0; k < k1; ++k) {
        const int t = p.send_list[static_cast<int64_t>(dst) * p.num_tokens + k];
        const uint8_t* src = p.x + static_cast<int64_t>(t) * p.x_row_bytes;
        if (self) {
          const int64_t row = p.recv_offsets[me] + k;
          if (!row_fits(p, row, me, k, lane)) continue;
          warp_copy<false>(p.recv_x + row * p.hidden_bytes, src, p.hidden_bytes, lane);
          for (int i = lane; i < p.num_scales; i += 32)
            p.recv_scales[row * p.num_scales + i] =
                p.x_scales[t * p.scale_stride_token + i * p.scale_stride_channel];
          if (lane < K && p.topk_idx) {
            const int64_t e = p.topk_idx[static_cast<int64_t>(t) * K + lane];
            p.recv_topk_idx[row * K + lane] = (e >= lo_e && e < lo_e + epr) ? e - lo_e : -1;
            if (p.topk_weights)
              p.recv_topk_weights[row * K + lane] =
                  p.topk_weights[static_cast<int64_t>(t) * K + lane];
          }
          if (lane == 0) p.recv_src_idx[row] = t;
        } else {
          uint8_t* dst_row = reinterpret_cast<uint8_t*>(p.t.peer_ptr(dst, p.off.staging)) +
                             (static_cast<int64_t>(me) * p.off.capacity + k) * p.off.row_bytes;
          warp_copy<false>(dst_row, src, p.hidden_bytes, lane);
          auto* ext = reinterpret_cast<int*>(dst_row + p.hidden_bytes);
          for (int i = lane; i < extras; i += 32) {
            int v;
            if (i < p.num_scales) {
              v = __float_as_int(p.x_scales[t * p.scale_stride_token + i * p.scale_stride_channel]);
            } else if (i < p.num_scales + K) {
              const int kk = i - p.num_scales;
              const int64_t e = p.topk_idx ? p.topk_idx[static_cast<int64_t>(t) * K + kk] : -1;
              v = (e >= lo_e && e < lo_e + epr) ? static_cast<int>(e - lo_e) : -1;
            } else if (i < p.num_scales + 2 * K) {
              const int kk = i - p.num_scales - K;
              v = p.topk_weights ? __float_as_int(p.topk_weights[static_cast<int64_t>(t) * K + kk])
                                 : 0;
            } else {
              v = t;
            }
            ext[i] = v;
          }
        }
      }
      if (!self) {
        __threadfence_system();
        __syncwarp();
        if (lane == 0)
          p.t.signal(dst, p.off.flags + 4 * (static_cast<std::size_t>(me) * p.off.max_chunks + j),
                     epoch);
      }
    }
    return;
  }

  // ---------------- receive ----------------
  if (R == 1) return;
  int max_chunks = 0;
  for (int s = 0; s < R; ++s)
    if (s != me)
      max_chunks = max(max_chunks, ceil_div(p.recv_offsets[s + 1] - p.recv_offsets[s], CH));
  const int gw = (blockIdx.x - p.num_send_blocks) * kWarps + warp;
  const int nw = (gridDim.x - p.num_send_blocks) * kWarps;
  const uint8_t* staging = reinterpret_cast<const uint8_t*>(p.t.local_ptr(p.off.staging));
  for (int item = gw; item < max_chunks * (R - 1); item += nw) {
    const int j = item / (R - 1), src = (me + 1 + item % (R - 1)) % R;
    const int count = p.recv_offsets[src + 1] - p.recv_offsets[src];
    const int k0 = j * CH, k1 = min(count, k0 + CH);
    if (k0 >= k1) continue;
    if (!p.t.wait_warp(p.off.flags + 4 * (static_cast<std::size_t>(src) * p.off.max_chunks + j),
                       epoch, p.timeout_ns, p.diag, OpId::kDispatch, src, j))
      return;
    for (int k = k0; k < k1; ++k) {
      const uint8_t* row_in =
          staging + (static_cast<int64_t>(src) * p.off.capacity + k) * p.off.row_bytes;
      const int64_t row = p.recv_offsets[src] + k;
      if (!row_fits(p, row, src, k, lane)) continue;
      warp_copy<true>(p.recv_x + row * p.hidden_bytes, row_in, p.hidden_bytes, lane);
      const int* ext = reinterpret_cast<const int*>(row_in + p.hidden_bytes);
      for (int i = lane; i < extras; i += 32) {
        const int v = ext[i];
        if (i < p.num_scales) {
          p.recv_scales[row * p.num_scales + i] = __int_as_float(v);
        } else if (i < p.num_scales + K) {
          if (p.recv_topk_idx) p.recv_topk_idx[row * K + (i - p.num_scales)] = v;
        } else if (i < p.num_scales + 2 * K) {
          if (p.recv_topk_weights)
            p.recv_topk_weights[row * K + (i - p.num_scales - K)] = __int_as_float(v);
        } else {
          p.recv_src_idx[row] = v;
        }
      }
    }
  }
}

__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[8], const int4& v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                         static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += __uint_as_float(w[i] << 16);
    acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint32_t f32_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return u >> 16;
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  int4 o;
  o.x = static_cast<int>(f32_to_bf16_bits(acc[0]) | (f32_to_bf16_bits(acc[1]) << 16));
  o.y = static_cast<int>(f32_to_bf16_bits(acc[2]) | (f32_to_bf16_bits(acc[3]) << 16));
  o.z = static_cast<int>(f32_to_bf16_bits(acc[4]) | (f32_to_bf16_bits(acc[5]) << 16));
  o.w = static_cast<int>(f32_to_bf16_bits(acc[6]) | (f32_to_bf16_bits(acc[7]) << 16));
  return o;
}

__global__ void __launch_bounds__(kThreads, 1) combine_kernel(HtCombineParams p) {
  const int R = p.t.num_ranks, me = p.t.rank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t epoch = *p.op_counter;
  const int K = p.num_topk, H = p.hidden, CH = p.off.chunk;
  const int row_payload = 2 * H;

  if (static_cast<int>(blockIdx.x) < p.num_send_blocks) {
    // ---------------- send: my rows for source s go back to s ----------------
    if (R == 1) return;
    int max_chunks = 0;
    for (int s = 0; s < R; ++s)
      if (s != me)
        max_chunks = max(max_chunks, ceil_div(p.recv_offsets[s + 1] - p.recv_offsets[s], CH));
    const int gw = blockIdx.x * kWarps + warp, nw = p.num_send_blocks * kWarps;
    for (int item = gw; item < max_chunks * (R - 1); item += nw) {
      const int j = item / (R - 1), dst = (me + 1 + item % (R - 1)) % R;
      const int count = p.recv_offsets[dst + 1] - p.recv_offsets[dst];
      const int k0 = j * CH, k1 = min(count, k0 + CH);
      if (k0 >= k1) continue;
      for (int k = k0; k < k1; ++k) {
        const int64_t row = p.recv_offsets[dst] + k;
        uint8_t* dst_row = reinterpret_cast<uint8_t*>(p.t.peer_ptr(dst, p.off.staging)) +
                           (static_cast<int64_t>(me) * p.off.capacity + k) * p.off.row_bytes;
        warp_copy<false>(dst_row, reinterpret_cast<const uint8_t*>(p.x + row * H), row_payload,
                         lane);
        if (p.topk_weights && lane < K)
          reinterpret_cast<float*>(dst_row + row_payload)[lane] = p.topk_weights[row * K + lane];
      }
      __threadfence_system();
      __syncwarp();
      if (lane == 0)
        p.t.signal(dst, p.off.flags + 4 * (static_cast<std::size_t>(me) * p.off.max_chunks + j),
                   epoch);
    }
    return;
  }

  // ---------------- receive: reduce each token over the ranks it went to ----------------
  const int gw = (blockIdx.x - p.num_send_blocks) * kWarps + warp;
  const int nw = (gridDim.x - p.num_send_blocks) * kWarps;
  const uint8_t* staging = reinterpret_cast<const uint8_t*>(p.t.local_ptr(p.off.staging));
  int ready_chunk[plan::kMaxRanks];
#pragma unroll
  for (int r = 0; r < plan::kMaxRanks; ++r) ready_chunk[r] = -1;
  for (int t = gw; t < p.num_tokens; t += nw) {
    const uint8_t* rows[plan::kMaxRanks];
    const float* wrows[plan::kMaxRanks];
    int n = 0;
    bool ok = true;
    for (int r = 0; r < R; ++r) {
      if (!p.is_token_in_rank[static_cast<int64_t>(t) * R + r]) continue;
      const int k = p.send_slot[static_cast<int64_t>(t) * R + r];
      if (r == me) {
        const int64_t row = p.recv_offsets[me] + k;
        rows[n] = reinterpret_cast<const uint8_t*>(p.x + row * H);
        wrows[n] = p.topk_weights ? p.topk_weights + row * K : nullptr;
      } else {
        const int j = k / CH;
#pragma unroll
        for (int rr = 0; rr < plan::kMaxRanks; ++rr) {
          if (rr == r && ready_chunk[rr] < j) {
            ok = p.t.wait_warp(
                p.off.flags + 4 * (static_cast<std::size_t>(r) * p.off.max_chunks + j), epoch,
                p.timeout_ns, p.diag, OpId::kCombine, r, j);
            ready_chunk[rr] = j;
          }
        }
        const uint8_t* row_in =
            staging + (static_cast<int64_t>(r) * p.off.capacity + k) * p.off.row_bytes;
        rows[n] = row_in;
        wrows[n] = p.topk_weights ? reinterpret_cast<const float*>(row_in + row_payload) : nullptr;
      }
      ++n;
      if (!ok) return;
    }
    uint16_t* out = p.combined_x + static_cast<int64_t>(t) * H;
    const uint16_t* b0 = p.bias0 ? p.bias0 + static_cast<int64_t>(t) * H : nullptr;
    const uint16_t* b1 = p.bias1 ? p.bias1 + static_cast<int64_t>(t) * H : nullptr;
    // Two 8-channel segments per lane per pass; every contributing row's
    // loads are issued before the first add.
    for (int c0 = lane * 8; c0 < H; c0 += 2 * 32 * 8) {
      const int c1 = c0 + 32 * 8;
      const bool has1 = c1 < H;
      int4 v0[plan::kMaxRanks], v1[plan::kMaxRanks];
#pragma unroll
      for (int i = 0; i < plan::kMaxRanks; ++i) {
        if (i < n) {
          v0[i] = dev::ld_l2(reinterpret_cast<const int4*>(rows[i] + 2 * c0));
          if (has1) v1[i] = dev::ld_l2(reinterpret_cast<const int4*>(rows[i] + 2 * c1));
        }
      }
      float acc0[8] = {0, 0, 0, 0, 0, 0, 0, 0}, acc1[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < plan::kMaxRanks; ++i) {
        if (i < n) {
          accumulate_bf16x8(acc0, v0[i]);
          if (has1) accumulate_bf16x8(acc1, v1[i]);
        }
      }
      if (b0) accumulate_bf16x8(acc0, *reinterpret_cast<const int4*>(b0 + c0));
      if (b1) accumulate_bf16x8(acc0, *reinterpret_cast<const int4*>(b1 + c0));
      dev::st_na(reinterpret_cast<int4*>(out + c0), pack_bf16x8(acc0));
      if (has1) {
        if (b0) accumulate_bf16x8(acc1, *reinterpret_cast<const int4*>(b0 + c1));
        if (b1) accumulate_bf16x8(acc1, *reinterpret_cast<const int4*>(b1 + c1));
        dev::st_na(reinterpret_cast<int4*>(out + c1), pack_bf16x8(acc1));
      }
    }
    if (p.combined_topk_weights && lane < K) {
      float w = 0.f;
      for (int i = 0; i < n; ++i) w += wrows[i] ? wrows[i][lane] : 0.f;
      p.combined_topk_weights[static_cast<int64_t>(t) * K + lane] = w;
    }
  }
}

}  // namespace

void launch_ht_dispatch(const HtDispatchParams& p, int num_blocks, cudaStream_t stream) {
  dispatch_kernel<<<num_blocks, kThreads, 0, stream>>>(p);
  EPX_LAUNCH_CHECK();
}

void launch_ht_combine(const HtCombineParams& p, int num_blocks, cudaStream_t stream) {
  combine_kernel<<<num_blocks, kThreads, 0, stream>>>(p);
  EPX_LAUNCH_CHECK();
}

}  // namespace epx::kernels
