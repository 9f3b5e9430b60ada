// epx/event.hpp - CUDA events and the allocator hook for outputs.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <vector>

#include "epx/tensor.hpp"

namespace epx {

/// A recorded CUDA event (shared, destroyed with its last copy).
class Event {
 public:
  Event() = default;
  /// Records a new event on `stream`.
  static Event record(cudaStream_t stream);
  /// Makes `stream` wait for this event (no host block).
  void stream_wait(cudaStream_t stream) const;
  /// Blocks the host until the event completes.
  void synchronize() const;
  /// True once the event has completed (or when there is none); no block.
  bool done() const;
  bool valid() const { return static_cast<bool>(ev_); }
  cudaEvent_t get() const { return ev_ ? *ev_ : nullptr; }

 private:
  std::shared_ptr<cudaEvent_t> ev_;
};

/// Allocates an output tensor of `dtype` and `shape` for use on `stream`.
/// C++ default: stream-ordered cudaMallocAsync; Python: torch.empty on the
/// right stream (caching allocator).
using Allocator =
    std::function<Tensor(DType dtype, const std::vector<int64_t>& shape, cudaStream_t stream)>;

/// The default allocator: cudaMallocAsync from the device's default pool on
/// `stream`, freed with cudaFreeAsync on the same stream when the last copy of
/// the Tensor dies (the user keeps it alive while other streams read it).
Allocator default_allocator();

}  // namespace epx
