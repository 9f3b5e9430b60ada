// gpu/checksum.hpp - order-independent checksums of device data, computed on
// the device, so that a long run can check every op's output without copying
// it back or waiting for it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace epx::test {

/// Checksum of n 16-bit words (BF16 bit patterns): sum over i of
/// mix(i, v[i]) modulo 2^64, mix a bijection of (i << 16 | v[i]). A sum, so
/// the order the device adds the terms in does not matter (the result is
/// exact); position-dependent, so moved values count; any one changed word
/// changes it for certain, and several almost surely.
uint64_t bf16_checksum_host(const uint16_t* v, std::size_t n);

/// Enqueues on `stream` one kernel that adds the checksum of v[0, n) to
/// *sum (which must hold 0 before) and copies counts[0, n_counts) to
/// counts_out. Returns the launch's error (no sync).
cudaError_t launch_pair_digest(const uint16_t* v, std::size_t n, const int* counts, int n_counts,
                               unsigned long long* sum, int* counts_out, cudaStream_t stream);

}  // namespace epx::test
