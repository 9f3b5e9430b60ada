#include <sstream>

#include <cuda_runtime_api.h>

#include "common/check.hpp"
#include "epx/tensor.hpp"

namespace epx {

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  int device) {
  return contiguous(data, dtype, std::vector<int64_t>(shape), device);
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  int device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < v.ndim; ++d) v.shape[d] = shape[d];
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "] " << dtype_name(dtype) << " ";
  if (device == kCpu) {
    os << "cpu";
  } else {
    os << "cuda:" << device;
  }
  if (!is_contiguous()) os << " (non-contiguous)";
  return os.str();
}

}  // namespace epx
