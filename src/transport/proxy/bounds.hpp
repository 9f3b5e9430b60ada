// transport/proxy/bounds.hpp - the range checks engines make before a copy
// or a mapping, as pure functions (no GPU, no engine): offsets and sizes come
// from device commands and from peers, so every sum is checked for overflow
// instead of computed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "epx/error.hpp"
#include "transport/proxy/command.hpp"

namespace epx::proxy {

/// Whether [off, off + bytes) lies within [0, size), without computing off + bytes.
constexpr bool in_bounds(uint64_t off, uint64_t bytes, uint64_t size) {
  return off <= size && bytes <= size - off;
}

/// `a + b`, or false when it does not fit 64 bits.
constexpr bool add_fits(uint64_t a, uint64_t b, uint64_t* sum) {
  return !__builtin_add_overflow(a, b, sum);
}

/// The bytes from a strided copy's first row start to its last row end,
/// (rows - 1) * pitch + width (rows >= 1), or false when that overflows.
constexpr bool strided_span(uint64_t pitch, uint64_t width, uint64_t rows, uint64_t* span) {
  uint64_t tail = 0;
  return rows >= 1 && !__builtin_mul_overflow(rows - 1, pitch, &tail) &&
         !__builtin_add_overflow(tail, width, span);
}

/// Throws Error(kInvalidArgument) unless [off, off + bytes) lies in `owner`'s
/// region `region` of `size` bytes: "<engine> engine: <what>: <side> [...) is
/// out of bounds of rank <owner>'s region <region> (<size> bytes)".
inline void check_range(const char* engine, const char* what, const char* side, int owner,
                        int region, uint64_t off, uint64_t bytes, uint64_t size) {
  if (in_bounds(off, bytes, size)) return;
  throw Error(ErrorCode::kInvalidArgument,
              std::string(engine) + " engine: " + what + ": " + side + " [" + std::to_string(off) +
                  ", " + std::to_string(off) + " + " + std::to_string(bytes) +
                  " bytes) is out of bounds of rank " + std::to_string(owner) + "'s region " +
                  std::to_string(region) + " (" + std::to_string(size) + " bytes)");
}

/// A put of `bytes` from this rank's (`rank`) region at `src_off` (`src_size`
/// bytes) to `peer`'s at `dst_off` (`dst_size` bytes): throws as check_range,
/// destination first.
inline void check_put_range(const char* engine, const char* what, int rank, int peer, int region,
                            uint64_t dst_off, uint64_t src_off, uint64_t bytes, uint64_t dst_size,
                            uint64_t src_size) {
  check_range(engine, what, "destination", peer, region, dst_off, bytes, dst_size);
  check_range(engine, what, "source", rank, region, src_off, bytes, src_size);
}

/// The span a strided put covers on one side; throws Error(kInvalidArgument)
/// naming the peer when (rows - 1) * pitch + width overflows.
inline uint64_t checked_strided_span(const char* engine, int peer, const char* side, uint64_t pitch,
                                     uint64_t width, uint64_t rows) {
  uint64_t span = 0;
  if (!strided_span(pitch, width, rows, &span))
    throw Error(ErrorCode::kInvalidArgument, std::string(engine) + " engine: put_strided to rank " +
                                                 std::to_string(peer) + ": the " + side +
                                                 " span of " + std::to_string(rows) + " rows of " +
                                                 std::to_string(width) + " bytes at pitch " +
                                                 std::to_string(pitch) + " overflows 64 bits");
  return span;
}

/// A strided put (rows of `width` bytes at pitches >= width; rows >= 1):
/// throws Error(kInvalidArgument) on a pitch below the width, a span that
/// overflows, or a span out of bounds of either region, destination first.
inline void check_strided_put_range(const char* engine, int rank, int peer, int region,
                                    uint64_t dst_off, uint64_t dst_pitch, uint64_t src_off,
                                    uint64_t src_pitch, uint64_t width, uint64_t rows,
                                    uint64_t dst_size, uint64_t src_size) {
  if (dst_pitch < width || src_pitch < width)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(engine) + " engine: put_strided to rank " + std::to_string(peer) +
                    ": pitches (" + std::to_string(dst_pitch) + ", " + std::to_string(src_pitch) +
                    ") must be >= the width " + std::to_string(width));
  check_range(engine, "put_strided", "destination", peer, region, dst_off,
              checked_strided_span(engine, peer, "destination", dst_pitch, width, rows), dst_size);
  check_range(engine, "put_strided", "source", rank, region, src_off,
              checked_strided_span(engine, peer, "source", src_pitch, width, rows), src_size);
}

/// What a peer says of its registered region: `bytes` at `offset` into an
/// allocation of `alloc_bytes` (what this rank maps). Throws
/// Error(kInvalidArgument) naming the rank and the values unless the region
/// lies inside the allocation.
inline void check_peer_region(const std::string& where, int rank, uint64_t bytes, uint64_t offset,
                              uint64_t alloc_bytes) {
  if (bytes > 0 && in_bounds(offset, bytes, alloc_bytes)) return;
  throw Error(ErrorCode::kInvalidArgument,
              where + ": rank " + std::to_string(rank) + " describes its region as " +
                  std::to_string(bytes) + " bytes at offset " + std::to_string(offset) +
                  " of an allocation of " + std::to_string(alloc_bytes) +
                  " bytes, which does not hold it");
}

/// A region id of a command or a registration: in [0, kMaxRegions), else
/// Error(kInvalidArgument) naming `what` (the engine call).
inline void check_region_id(int id, const char* what) {
  require(
      id >= 0 && id < kMaxRegions, what,
      "region id must be in [0, " + std::to_string(kMaxRegions) + "), got " + std::to_string(id));
}

/// What every engine's register_region checks once the id is valid
/// (check_region_id first: `registered` is read by the id): a base and a size,
/// and an id that `rank` has not registered yet.
inline void check_new_region(int id, const void* base, std::size_t bytes, bool registered,
                             int rank) {
  require(base != nullptr && bytes > 0, "register_region",
          "region " + std::to_string(id) + " needs a base and bytes > 0");
  require(
      !registered, "register_region",
      "region " + std::to_string(id) + " is already registered on rank " + std::to_string(rank));
}

}  // namespace epx::proxy
