// python/src/convert.cpp - convert.hpp's definitions.
#include "convert.hpp"

#include <nanobind/ndarray.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "binding.hpp"

namespace epx::binding {

namespace nb = nanobind;
using DlCode = nb::dlpack::dtype_code;

// ---- streams ---------------------------------------------------------------------

// ---- dtypes and devices ----------------------------------------------------------

/// DLPack dtype -> DType. uint8 maps to float8_e4m3fn: the fallback for
/// frameworks whose DLPack export lacks float8 (pass `t.view(torch.uint8)`).
std::optional<DType> dtype_from_dlpack(nb::dlpack::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  switch (static_cast<DlCode>(t.code)) {
    case DlCode::Bfloat:
      if (t.bits == 16) return DType::kBF16;
      break;
    case DlCode::Float8_E4M3FN:
      if (t.bits == 8) return DType::kFP8E4M3;
      break;
    case DlCode::UInt:
      if (t.bits == 8) return DType::kFP8E4M3;
      break;
    case DlCode::Float:
      if (t.bits == 32) return DType::kF32;
      break;
    case DlCode::Int:
      if (t.bits == 32) return DType::kI32;
      if (t.bits == 64) return DType::kI64;
      break;
    case DlCode::Bool:
      if (t.bits == 8) return DType::kBool;
      break;
    default:
      break;
  }
  return std::nullopt;
}

nb::dlpack::dtype dtype_to_dlpack(DType t) {
  auto make = [](DlCode c, int bits) {
    nb::dlpack::dtype d;
    d.code = static_cast<uint8_t>(c);
    d.bits = static_cast<uint8_t>(bits);
    d.lanes = 1;
    return d;
  };
  switch (t) {
    case DType::kBF16:
      return make(DlCode::Bfloat, 16);
    case DType::kFP8E4M3:
      return make(DlCode::Float8_E4M3FN, 8);
    case DType::kF32:
      return make(DlCode::Float, 32);
    case DType::kI32:
      return make(DlCode::Int, 32);
    case DType::kI64:
      return make(DlCode::Int, 64);
    case DType::kBool:
      return make(DlCode::Bool, 8);
  }
  return make(DlCode::UInt, 8);
}

/// Any DLPack producer (or capsule) -> TensorView. `name` is used in messages;
/// `as` reinterprets the elements as another dtype of the same size.
TensorView view_of(nb::handle obj, const char* name, std::optional<DType> as) {
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(obj, a)) {
    std::string msg = std::string(name) +
                      ": expected a tensor that supports DLPack (torch.Tensor, "
                      "numpy.ndarray), got " +
                      nb::inst_name(obj).c_str();
    throw nb::type_error(msg.c_str());
  }
  TensorView v;
  const nb::dlpack::dtype dt = a.dtype();
  const std::string code =
      "(DLPack type code " + std::to_string(dt.code) + ", " + std::to_string(dt.bits) + " bits)";
  if (as) {
    if (dt.lanes != 1 || dt.bits != 8 * epx::element_size(*as))
      invalid(std::string(name) + ": cannot view elements " + code + " as " + epx::dtype_name(*as));
    v.dtype = *as;
  } else if (auto d = dtype_from_dlpack(dt)) {
    v.dtype = *d;
  } else {
    throw nb::type_error(
        (std::string(name) + ": unsupported dtype " + code +
         "; EPX takes bfloat16, float8_e4m3fn (or uint8), float32, int32, int64, bool")
            .c_str());
  }
  if (a.ndim() > static_cast<size_t>(epx::kMaxDims))
    invalid(std::string(name) + ": has " + std::to_string(a.ndim()) + " dimensions; at most " +
            std::to_string(epx::kMaxDims) + " are supported");
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
      v.device = epx::kCpu;
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      v.device = a.device_id();
      break;
    default:
      invalid(std::string(name) + ": unsupported DLPack device type " +
              std::to_string(a.device_type()));
  }
  v.data = const_cast<void*>(a.data());
  v.ndim = static_cast<int>(a.ndim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = static_cast<int64_t>(a.shape(d));
    v.strides[d] = a.stride(d);
  }
  return v;
}

// ---- Python-owned tensors ---------------------------------------------------------

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

namespace {

/// Deleter of Tensor::owner for memory a Python allocator returned: holds the
/// Python object (and the view it had) and drops it under the GIL.
struct PyOwner {
  PyObject* obj;
  TensorView origin;
  void operator()(void*) const noexcept {
    if (!python_alive()) return;  // interpreter shutting down: leak, never crash
    PyGILState_STATE s = PyGILState_Ensure();
    Py_DECREF(obj);
    PyGILState_Release(s);
  }
};

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim || a.device != b.device)
    return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.strides[d] != b.strides[d])) return false;
  return true;
}

}  // namespace

nb::tuple int_tuple(const int64_t* v, int n) {
  nb::list l;
  for (int i = 0; i < n; ++i) l.append(v[i]);
  return nb::tuple(l);
}

/// A view EPX owns (or that `base` keeps alive) as a DLPack-exporting array.
nb::object export_view(const TensorView& v, nb::handle base, std::shared_ptr<void> owner,
                       std::optional<nb::dlpack::dtype> dtype) {
  nb::object keep;
  if (owner) {
    auto* held = new std::shared_ptr<void>(std::move(owner));
    keep =
        nb::capsule(held, [](void* p) noexcept { delete static_cast<std::shared_ptr<void>*>(p); });
  } else {
    keep = nb::borrow(base);
  }
  size_t shape[epx::kMaxDims];
  for (int d = 0; d < v.ndim; ++d) shape[d] = static_cast<size_t>(v.shape[d]);
  const bool cpu = v.device == epx::kCpu;
  nb::ndarray<> a(v.data, static_cast<size_t>(v.ndim), shape, keep, v.strides.data(),
                  dtype ? *dtype : dtype_to_dlpack(v.dtype),
                  cpu ? nb::device::cpu::value : nb::device::cuda::value, cpu ? 0 : v.device);
  return a.cast();
}

/// Tensor -> Python. The object the allocator returned when the view is all
/// of it; (object, shape, strides, element offset) when the view is a part of
/// it (epx.buffer rebuilds it with as_strided); otherwise a DLPack array.
nb::object to_py(const Tensor& t) {
  if (!t.defined()) return nb::none();
  if (const auto* o = std::get_deleter<PyOwner>(t.owner)) {
    if (same_view(t.view, o->origin)) return nb::borrow(o->obj);
    const auto delta =
        static_cast<const char*>(t.view.data) - static_cast<const char*>(o->origin.data);
    const auto size = static_cast<std::ptrdiff_t>(epx::element_size(t.view.dtype));
    if (t.view.dtype == o->origin.dtype && delta % size == 0)
      return nb::make_tuple(nb::borrow(o->obj), int_tuple(t.view.shape.data(), t.view.ndim),
                            int_tuple(t.view.strides.data(), t.view.ndim), delta / size);
  }
  return export_view(t.view, nb::none(), t.owner);
}

Tensor PyAllocator::operator()(DType dtype, const std::vector<int64_t>& shape,
                               cudaStream_t stream) const {
  nb::gil_scoped_acquire gil;
  nb::list dims;
  for (int64_t s : shape) dims.append(s);
  nb::object r = nb::borrow<nb::callable>(fn.get())(static_cast<int>(dtype), nb::tuple(dims),
                                                    from_stream(stream));
  nb::object keep = r, src = r;
  bool pair = false;
  if (nb::isinstance<nb::tuple>(r) && nb::len(r) == 2) {
    keep = r[0];
    src = r[1];
    pair = true;
  }
  Tensor t;
  if (pair && nb::isinstance<nb::int_>(src)) {
    // (tensor, data pointer): a contiguous tensor of the requested dtype
    // and shape on the current device at that address (epx.buffer's
    // allocator), so no DLPack export is needed.
    t.view = TensorView::contiguous(reinterpret_cast<void*>(nb::cast<uintptr_t>(src)), dtype, shape,
                                    epx::kCpu);
    if (t.view.numel() > 0) {
      cudaPointerAttributes attr{};
      const cudaError_t e =
          t.view.data == nullptr ? cudaSuccess : cudaPointerGetAttributes(&attr, t.view.data);
      if (e != cudaSuccess) (void)cudaGetLastError();  // not left for a later launch check
      if (t.view.data == nullptr || e != cudaSuccess || attr.type != cudaMemoryTypeDevice)
        throw epx::Error(epx::ErrorCode::kInternal,
                         "the Python allocator returned a data pointer that is not CUDA "
                         "device memory");
      t.view.device = attr.device;
    } else if (cudaGetDevice(&t.view.device) != cudaSuccess) {
      throw epx::Error(epx::ErrorCode::kCuda, "allocator: cudaGetDevice failed");
    }
  } else {
    t.view = view_of(src, "allocator result");
  }
  bool ok = t.view.dtype == dtype && t.view.ndim == static_cast<int>(shape.size());
  for (int d = 0; ok && d < t.view.ndim; ++d) ok = t.view.shape[d] == shape[d];
  if (!ok || !t.view.is_contiguous())
    throw epx::Error(epx::ErrorCode::kInternal, "the Python allocator returned " +
                                                    t.view.describe() + ", expected a contiguous " +
                                                    epx::dtype_name(dtype) + " tensor of " +
                                                    std::to_string(shape.size()) + " dims");
  PyObject* obj = keep.release().ptr();
  t.owner = std::shared_ptr<void>(static_cast<void*>(obj), PyOwner{obj, t.view});
  return t;
}

nb::object hook_of(const std::function<void()>& fn) {
  return fn ? nb::cast(Hook{fn}) : nb::none();
}

}  // namespace epx::binding
