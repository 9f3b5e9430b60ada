// transport/nccl/credit.hpp - the arithmetic of the NCCL GIN credit gate
// (dev::gin_credit in transport/nccl/device.cuh), without NCCL or CUDA
// headers, so that tests/unit/test_gin_credit.cpp checks it on the host.
#pragma once

#include <cstdint>

#include "common/device.cuh"

namespace epx::gin_credit {

/// Whether the descriptor holding ticket `ticket` may be posted to a peer
/// whose GIN proxy queue of `queue_size` slots has consumed `consumed`
/// descriptors: fewer than queue_size tickets since the consumed index.
/// Both indices roll over 32 bits; the distance is signed, so a consumed
/// index past the ticket (it cannot be while every post is gated) passes.
EPX_HD inline bool may_post(uint32_t ticket, uint32_t consumed, int32_t queue_size) {
  return static_cast<int32_t>(ticket - consumed) < queue_size;
}

/// What NCCL's postGfd (nccl_device/gin/proxy/gin_proxy.h) spins on after
/// it claimed slot `claimed`: the queue is full for it.
EPX_HD inline bool nccl_would_wait(uint32_t claimed, uint32_t consumed, uint32_t queue_size) {
  return queue_size <= claimed - consumed;
}

}  // namespace epx::gin_credit
