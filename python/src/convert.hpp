// python/src/convert.hpp - the binding's conversions between Python and
// EPX's types: streams as integers, DLPack dtypes and tensors to TensorView,
// EPX Tensors back to the objects a Python allocator returned, the allocator
// and the receive hooks.
#pragma once

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "epx/epx.hpp"

namespace epx::binding {

inline cudaStream_t to_stream(uintptr_t s) {
  return reinterpret_cast<cudaStream_t>(s);
}
inline uintptr_t from_stream(cudaStream_t s) {
  return reinterpret_cast<uintptr_t>(s);
}

/// DLPack dtype -> DType. uint8 maps to float8_e4m3fn: the fallback for
/// frameworks whose DLPack export lacks float8 (pass `t.view(torch.uint8)`).
std::optional<DType> dtype_from_dlpack(nanobind::dlpack::dtype t);
nanobind::dlpack::dtype dtype_to_dlpack(DType t);

/// Any DLPack producer (or capsule) -> TensorView. `name` is used in messages;
/// `as` reinterprets the elements as another dtype of the same size.
TensorView view_of(nanobind::handle obj, const char* name, std::optional<DType> as = std::nullopt);

/// Whether the interpreter still runs (a deleter at shutdown must not touch it).
bool python_alive();

/// (v[0], ..., v[n - 1]) as a Python tuple of ints.
nanobind::tuple int_tuple(const int64_t* v, int n);

/// A view EPX owns (or that `base` keeps alive) as a DLPack-exporting array.
nanobind::object export_view(const TensorView& v, nanobind::handle base,
                             std::shared_ptr<void> owner = {},
                             std::optional<nanobind::dlpack::dtype> dtype = std::nullopt);

/// Tensor -> Python. The object the allocator returned when the view is all
/// of it; (object, shape, strides, element offset) when the view is a part of
/// it (epx.buffer rebuilds it with as_strided); otherwise a DLPack array.
nanobind::object to_py(const Tensor& t);
template <class T>
nanobind::object to_py(const std::optional<T>& t) {
  return t ? to_py(*t) : nanobind::none();
}

/// BufferOptions::allocator that calls `fn(dtype:int, shape:tuple, stream:int)`.
/// fn returns a tensor, or (tensor, dlpack_source) when the DLPack export should
/// come from another object (say a capsule made without stream synchronization).
struct PyAllocator {
  std::shared_ptr<PyObject> fn;

  explicit PyAllocator(nanobind::callable f)
      : fn(f.release().ptr(), [](PyObject* p) {
          if (!python_alive()) return;
          PyGILState_STATE s = PyGILState_Ensure();
          Py_DECREF(p);
          PyGILState_Release(s);
        }) {}

  Tensor operator()(DType dtype, const std::vector<int64_t>& shape, cudaStream_t stream) const;
};

/// A receive hook (return_recv_hook); runs with the GIL released.
struct Hook {
  std::function<void()> fn;
};
nanobind::object hook_of(const std::function<void()>& fn);

}  // namespace epx::binding
