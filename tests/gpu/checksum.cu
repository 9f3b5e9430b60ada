// gpu/checksum.cu - the device side of gpu/checksum.hpp.
#include "gpu/checksum.hpp"

namespace epx::test {
namespace {

/// A bijection of 64-bit words (the splitmix64 finalizer: an added
/// constant, xor-shifts and multiplications by odd numbers, each invertible)
/// applied to (index << 16 | word), which is itself one-to-one for indices
/// below 2^48.
__host__ __device__ inline unsigned long long mix(unsigned long long i, uint16_t v) {
  unsigned long long z = (i << 16) | v;
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 64;  // a few MiB per call: a small grid is enough

__global__ void __launch_bounds__(kThreads)
    pair_digest(const uint16_t* v, std::size_t n, const int* counts, int n_counts,
                unsigned long long* sum, int* counts_out) {
  unsigned long long acc = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    acc += mix(i, v[i]);
  // Warp sum, then one atomic add per warp: wrap-around addition is
  // associative and commutative, so any order gives the same bits.
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) atomicAdd(sum, acc);
  if (blockIdx.x == 0)
    for (int j = static_cast<int>(threadIdx.x); j < n_counts; j += blockDim.x)
      counts_out[j] = counts[j];
}

}  // namespace

uint64_t bf16_checksum_host(const uint16_t* v, std::size_t n) {
  unsigned long long acc = 0;
  for (std::size_t i = 0; i < n; ++i) acc += mix(i, v[i]);
  return acc;
}

cudaError_t launch_pair_digest(const uint16_t* v, std::size_t n, const int* counts, int n_counts,
                               unsigned long long* sum, int* counts_out, cudaStream_t stream) {
  const std::size_t want = (n + kThreads - 1) / kThreads;
  const int blocks = want == 0 ? 1 : want < kMaxBlocks ? static_cast<int>(want) : kMaxBlocks;
  pair_digest<<<blocks, kThreads, 0, stream>>>(v, n, counts, n_counts, sum, counts_out);
  return cudaGetLastError();
}

}  // namespace epx::test
