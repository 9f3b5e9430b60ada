// LogFMT on the GPU gives the same bits as the CPU reference: the arithmetic
// (src/reference/logfmt_math.hpp) evaluated on the device, and the combine
// kernels' wire codec (kernels::logfmt_store / logfmt_load / logfmt_decode,
// src/kernels/logfmt.cuh) against ref::logfmt_decode(ref::logfmt_encode(.)).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "epx/reference.hpp"
#include "gpu/harness.hpp"
#include "kernels/logfmt.cuh"
#include "reference/logfmt_math.hpp"

namespace {

namespace lm = epx::logfmt_math;
using epx::test::to_device;
using epx::test::to_host;

__global__ void log2_exp2_kernel(const float* a, const float* x, float* log2_out, float* exp2_out,
                                 int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    log2_out[i] = lm::log2_approx(a[i]);
    exp2_out[i] = lm::exp2_approx(x[i]);
  }
}

// The combine kernels' wire codec, laid out as they hold a row: lane l of a
// warp has the 8 values [8 l, 8 l + 8) of a 256-value stretch, so lanes 0-15
// and 16-31 each hold one 128-value group. Each group is coded into its 168
// wire bytes, then read back and decoded. With an odd count the last warp's
// upper half has no group: it must neither read nor store.
__global__ void wire_kernel(const float* in, float* out, uint8_t* wire, int groups) {
  const int lane = threadIdx.x % 32, li = lane % 16;
  const int warps = gridDim.x * blockDim.x / 32;
  for (int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32; 2 * w < groups; w += warps) {
    const int g = 2 * w + lane / 16;
    const bool valid = g < groups;
    const size_t base = static_cast<size_t>(w) * 2 * lm::kGroup + 8 * lane;
    uint8_t* group = wire + static_cast<size_t>(g) * epx::kernels::kLogFmtGroupBytes;
    float v[8];
    for (int i = 0; i < 8; ++i) v[i] = valid ? in[base + i] : 0.0f;
    epx::kernels::logfmt_store(v, group, li, valid);
    __syncwarp();
    __threadfence_block();
    if (!valid) continue;
    float d[8];
    epx::kernels::logfmt_decode(epx::kernels::logfmt_load(group, li), d);
    for (int i = 0; i < 8; ++i) out[base + i] = d[i];
  }
}

using lm::bits_of;

TEST(Logfmt, DeviceMatchesReferenceBitForBit) {
  std::mt19937_64 rng(907);
  const int n = 1 << 22;
  std::vector<float> a(n), x(n);
  std::uniform_int_distribution<uint32_t> normal_bits(0x00800000u, 0x7F7FFFFFu);
  std::uniform_real_distribution<double> exponent(-160.0, 130.0);
  for (int i = 0; i < n; ++i) {
    uint32_t u = normal_bits(rng);
    std::memcpy(&a[i], &u, 4);
    x[i] = static_cast<float>(exponent(rng));
  }
  const auto da = to_device(a), dx = to_device(x);
  const auto dl = to_device(std::vector<float>(n, NAN)), de = to_device(std::vector<float>(n, NAN));
  log2_exp2_kernel<<<264, 256>>>(da.get(), dx.get(), dl.get(), de.get(), n);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_l = to_host(dl), got_e = to_host(de);
  std::size_t bad_l = 0, bad_e = 0;
  for (int i = 0; i < n; ++i) {
    if (bits_of(got_l[i]) != bits_of(lm::log2_approx(a[i])) && bad_l++ < 3)
      ADD_FAILURE() << "log2_approx(" << a[i] << "): device " << got_l[i] << ", host "
                    << lm::log2_approx(a[i]);
    if (bits_of(got_e[i]) != bits_of(lm::exp2_approx(x[i])) && bad_e++ < 3)
      ADD_FAILURE() << "exp2_approx(" << x[i] << "): device " << got_e[i] << ", host "
                    << lm::exp2_approx(x[i]);
  }
  EXPECT_EQ(bad_l, 0u);
  EXPECT_EQ(bad_e, 0u);

  // Whole groups against ref::logfmt_decode(ref::logfmt_encode(.)): narrow,
  // clamped, constant, near FLT_MAX and near FLT_MIN groups, float subnormals
  // (coded as zero), zeros of both signs.
  const int groups = 4095;  // odd: the last warp's upper half has no group
  std::vector<float> v(static_cast<std::size_t>(groups) * lm::kGroup);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (int g = 0; g < groups; ++g) {
    const double center = -100.0 + 200.0 * u01(rng);
    for (int i = 0; i < lm::kGroup; ++i) {
      double l = center;
      switch (g % 7) {
        case 0:
          l += 4.0 * u01(rng) - 2.0;
          break;
        case 1:
          l += 30.0 * u01(rng) - 15.0;
          break;
        case 2:
          break;
        case 3:
          l = 120.0 + 7.99 * u01(rng);
          break;
        case 4:
          l = -126.0 + 16.0 * u01(rng);
          break;
        case 5:
          l = -149.0 + 30.0 * u01(rng);
          break;  // subnormals beside small normals
        default:
          l += 2.0 * u01(rng) - 1.0;
          break;
      }
      float f = static_cast<float>(std::exp2(l));
      if (u01(rng) < 0.05) f = 0.0f;
      v[static_cast<std::size_t>(g) * lm::kGroup + i] = u01(rng) < 0.5 ? -f : f;
    }
  }
  const auto dv = to_device(v), dout = to_device(std::vector<float>(v.size(), NAN));
  ASSERT_EQ(epx::kernels::logfmt_wire_bytes(static_cast<int>(v.size())),
            epx::ref::logfmt_bytes(static_cast<int>(v.size())));
  const std::size_t wire_bytes = epx::kernels::logfmt_wire_bytes(static_cast<int>(v.size()));
  // Poisoned, with one group more than the row: nothing may land there.
  const auto dwire =
      to_device(std::vector<uint8_t>(wire_bytes + epx::kernels::kLogFmtGroupBytes, 0xAB));
  wire_kernel<<<64, 256>>>(dv.get(), dout.get(), dwire.get(), groups);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = to_host(dout);
  const auto code = epx::ref::logfmt_encode(v);
  const auto want = epx::ref::logfmt_decode(code, static_cast<int>(v.size()));
  // The wire bytes are the reference's code, reordered: lane i's 80-bit word
  // (8 bytes at 8 + 8 i, then 2 at 136 + 2 i) is bytes [10 i, 10 i + 10) of
  // the group's payload (code 8 i + j at bit 10 j of the word is code 8 i + j
  // at bit 80 i + 10 j of the payload).
  const auto wire = to_host(dwire);
  std::size_t bad_bytes = 0;
  for (int g = 0; g < groups; ++g) {
    const uint8_t* w = wire.data() + static_cast<std::size_t>(g) * 168;
    uint8_t as_ref[168];
    std::memcpy(as_ref, w, 8);
    for (int i = 0; i < 16; ++i) {
      std::memcpy(as_ref + 8 + 10 * i, w + 8 + 8 * i, 8);
      std::memcpy(as_ref + 8 + 10 * i + 8, w + 136 + 2 * i, 2);
    }
    if (std::memcmp(as_ref, code.data() + static_cast<std::size_t>(g) * 168, 168) != 0 &&
        bad_bytes++ < 3)
      ADD_FAILURE() << "group " << g << ": the wire bytes are not the reference's code";
  }
  EXPECT_EQ(bad_bytes, 0u);
  for (std::size_t i = wire_bytes; i < wire.size(); ++i)
    ASSERT_EQ(wire[i], 0xAB) << "a store past the last group, byte " << i - wire_bytes;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i]) && bad++ < 3)
      ADD_FAILURE() << "value " << i << " = " << v[i] << ": device " << got[i] << ", reference "
                    << want[i];
  EXPECT_EQ(bad, 0u);
}

}  // namespace
