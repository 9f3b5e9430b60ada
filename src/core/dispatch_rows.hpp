// core/dispatch_rows.hpp - the caller's tokens as the high-throughput
// dispatch kernels read them (kernels::DispatchRowArgs), within a node and
// across nodes.
#pragma once

#include <cstdint>

#include "epx/buffer.hpp"
#include "kernels/kernels.hpp"

namespace epx {

/// x's rows (any dtype, moved as bytes, with x's row stride), its scales
/// with their strides, and the top-k ids and weights (none for a cached
/// dispatch, whose routing is the handle's).
inline void set_dispatch_rows(kernels::DispatchRowArgs& r, const DispatchArgs& a) {
  r.x = static_cast<const uint8_t*>(a.x.data);
  r.x_row_bytes = a.x.strides[0] * static_cast<int64_t>(element_size(a.x.dtype));
  if (a.x_scales) {
    r.x_scales = static_cast<const float*>(a.x_scales->data);
    r.scale_stride_token = a.x_scales->strides[0];
    r.scale_stride_channel = a.x_scales->strides[1];
  }
  const bool routed = !a.handle && a.topk_idx;
  r.topk_idx = routed ? a.topk_idx->ptr<int64_t>() : nullptr;
  r.topk_weights = routed && a.topk_weights ? a.topk_weights->ptr<float>() : nullptr;
}

}  // namespace epx
