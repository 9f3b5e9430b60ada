// epx/tensor.hpp - non-owning strided views and owning tensors; no PyTorch.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "epx/dtype.hpp"

namespace epx {

inline constexpr int kMaxDims = 4;
inline constexpr int kCpu = -1;  ///< TensorView::device for host memory

/// A strided view of memory someone else owns. Strides are in elements.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kBF16;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  int device = kCpu;  ///< CUDA ordinal, or kCpu

  /// Contiguous (row-major) view of `shape`.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               int device);
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               int device);

  int64_t size(int d) const { return shape[d]; }
  int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(dtype); }
  bool is_contiguous() const;
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  /// "[4096, 7168] bfloat16 cuda:0" - used in error messages.
  std::string describe() const;
};

/// A view plus whatever keeps its memory alive (a CUDA allocation, a Python
/// object). Copies share ownership.
struct Tensor {
  TensorView view;
  std::shared_ptr<void> owner;

  bool defined() const { return view.ndim > 0 && (view.data != nullptr || view.numel() == 0); }
  int64_t size(int d) const { return view.shape[d]; }
  int64_t numel() const { return view.numel(); }
  template <class T>
  T* ptr() const {
    return view.ptr<T>();
  }
};

}  // namespace epx
