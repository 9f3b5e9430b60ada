// python/src/core.cpp - the extension module epx._core.
//
// A thin nanobind binding of include/epx/*.hpp: it converts types and does
// nothing else. Tensors come in through DLPack (any object with __dlpack__,
// or a DLPack capsule) and become epx::TensorView; outputs are made by a
// Python allocator and go back to Python as the very objects it returned.
// Streams cross as integers (cudaStream_t values). The Python package
// (python/epx) builds the DeepEP-compatible API on top of this module.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "binding.hpp"
#include "common/topology.hpp"
#include "convert.hpp"
#include "core/internode_handle.hpp"
#include "core/validate.hpp"
#include "epx/epx.hpp"
#include "epx/reference.hpp"
#include "transport/nvshmem/module.hpp"
#include "transport/nvshmem/nvshmem_backend.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using epx::DType;
using epx::Tensor;
using epx::TensorView;
using DlCode = nb::dlpack::dtype_code;
using epx::binding::invalid;
using namespace epx::binding;  // the conversions (convert.hpp)

// ---- errors -----------------------------------------------------------------------

PyObject* g_error = nullptr;              // EPXError(RuntimeError)
PyObject* g_value_error = nullptr;        // EPXValueError(EPXError, ValueError)
PyObject* g_timeout_error = nullptr;      // EPXTimeoutError(EPXError, TimeoutError)
PyObject* g_unsupported_error = nullptr;  // EPXUnsupportedError(EPXError, NotImplementedError)

PyObject* new_exception(nb::module_& m, const char* name, PyObject* base, PyObject* builtin) {
  std::string qual = std::string("epx.") + name;
  nb::object bases = builtin ? nb::make_tuple(nb::handle(base), nb::handle(builtin))
                             : nb::make_tuple(nb::handle(base));
  PyObject* cls = PyErr_NewException(qual.c_str(), bases.ptr(), nullptr);
  if (!cls) throw nb::python_error();
  m.attr(name) = nb::handle(cls);
  return cls;
}

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const epx::Error& e) {
    PyObject* cls = g_error;
    switch (e.code()) {
      case epx::ErrorCode::kInvalidArgument:
        cls = g_value_error;
        break;
      case epx::ErrorCode::kTimeout:
        cls = g_timeout_error;
        break;
      case epx::ErrorCode::kUnsupported:
        cls = g_unsupported_error;
        break;
      default:
        break;
    }
    nb::object exc = nb::steal(PyObject_CallFunction(cls, "s", e.what()));
    if (!exc.is_valid()) return;  // the call set an error already
    PyObject_SetAttrString(exc.ptr(), "code", nb::cast(e.code()).ptr());
    PyErr_SetObject(cls, exc.ptr());
  }
}

// ---- validators --------------------------------------------------------------------

void validate_tensor(const char* op, const char* name, const TensorView& t, DType dtype,
                     const std::vector<int64_t>& s, int device, bool contiguous) {
  namespace v = epx::validate;
  switch (s.size()) {  // validate::tensor takes an initializer_list
    case 0:
      return v::tensor(op, name, t, dtype, {}, device, contiguous);
    case 1:
      return v::tensor(op, name, t, dtype, {s[0]}, device, contiguous);
    case 2:
      return v::tensor(op, name, t, dtype, {s[0], s[1]}, device, contiguous);
    case 3:
      return v::tensor(op, name, t, dtype, {s[0], s[1], s[2]}, device, contiguous);
    case 4:
      return v::tensor(op, name, t, dtype, {s[0], s[1], s[2], s[3]}, device, contiguous);
    default:
      invalid(std::string(name) + ": at most 4 dimensions");
  }
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "EPX C++ core (nanobind). Use the epx package; this module is its implementation.";
  m.attr("__version__") = EPX_VERSION_STRING;
  // Python objects held by C++ (allocator, tensors in handles) may outlive the
  // module at interpreter exit; that is expected, not a leak to report.
  nb::set_leak_warnings(false);

  // ---- errors -----------------------------------------------------------------------
  nb::enum_<epx::ErrorCode>(m, "ErrorCode")
      .value("invalid_argument", epx::ErrorCode::kInvalidArgument)
      .value("buffer_too_small", epx::ErrorCode::kBufferTooSmall)
      .value("timeout", epx::ErrorCode::kTimeout)
      .value("cuda", epx::ErrorCode::kCuda)
      .value("nccl", epx::ErrorCode::kNccl)
      .value("bootstrap", epx::ErrorCode::kBootstrap)
      .value("unsupported", epx::ErrorCode::kUnsupported)
      .value("internal", epx::ErrorCode::kInternal);
  g_error = new_exception(m, "EPXError", PyExc_RuntimeError, nullptr);
  g_value_error = new_exception(m, "EPXValueError", g_error, PyExc_ValueError);
  g_timeout_error = new_exception(m, "EPXTimeoutError", g_error, PyExc_TimeoutError);
  g_unsupported_error = new_exception(m, "EPXUnsupportedError", g_error, PyExc_NotImplementedError);
  nb::register_exception_translator(translate_error);
  m.def(
      "_raise", [](epx::ErrorCode code, const std::string& msg) { throw epx::Error(code, msg); },
      "code"_a, "message"_a, "Throws epx::Error(code, message) (tests the exception mapping).");

  // ---- dtypes and tensors -------------------------------------------------------------
  nb::enum_<DType>(m, "DType")
      .value("bfloat16", DType::kBF16)
      .value("float8_e4m3fn", DType::kFP8E4M3)
      .value("float32", DType::kF32)
      .value("int32", DType::kI32)
      .value("int64", DType::kI64)
      .value("bool", DType::kBool);
  m.def(
      "element_size", [](DType t) { return epx::element_size(t); }, "dtype"_a);
  m.attr("CPU") = epx::kCpu;
  m.attr("MAX_DIMS") = epx::kMaxDims;

  nb::class_<TensorView>(m, "TensorView", "A non-owning strided view (strides in elements).")
      .def(
          "__init__",
          [](TensorView* v, uintptr_t data, DType dtype, const std::vector<int64_t>& shape,
             std::optional<std::vector<int64_t>> strides, int device) {
            if (shape.size() > static_cast<size_t>(epx::kMaxDims))
              invalid("shape: at most 4 dimensions");
            if (strides && strides->size() != shape.size())
              invalid("strides: must have one entry per dimension");
            new (v) TensorView();
            v->data = reinterpret_cast<void*>(data);
            v->dtype = dtype;
            v->device = device;
            v->ndim = static_cast<int>(shape.size());
            int64_t stride = 1;
            for (int d = v->ndim - 1; d >= 0; --d) {
              v->shape[d] = shape[d];
              v->strides[d] = strides ? (*strides)[d] : stride;
              stride *= shape[d];
            }
          },
          "data"_a, "dtype"_a, "shape"_a, "strides"_a = nb::none(), "device"_a = epx::kCpu,
          "A view of raw memory (tests and validation; nothing is checked).")
      .def_static(
          "from_dlpack",
          [](nb::handle obj, const char* name, std::optional<DType> dtype) {
            return view_of(obj, name, dtype);
          },
          "obj"_a.none(), "name"_a = "tensor", "dtype"_a = nb::none(),
          "View of any DLPack producer or capsule; `dtype` reinterprets same-size elements.")
      .def_prop_ro("data", [](const TensorView& v) { return reinterpret_cast<uintptr_t>(v.data); })
      .def_ro("dtype", &TensorView::dtype)
      .def_ro("ndim", &TensorView::ndim)
      .def_ro("device", &TensorView::device)
      .def_prop_ro("shape", [](const TensorView& v) { return int_tuple(v.shape.data(), v.ndim); })
      .def_prop_ro("strides",
                   [](const TensorView& v) { return int_tuple(v.strides.data(), v.ndim); })
      .def("numel", &TensorView::numel)
      .def("nbytes", &TensorView::nbytes)
      .def("is_contiguous", &TensorView::is_contiguous)
      .def("describe", &TensorView::describe)
      .def("__repr__", [](const TensorView& v) { return "TensorView(" + v.describe() + ")"; });

  // ---- CUDA device (EPX links its own CUDA runtime; keep it on the caller's device) ----
  m.def(
      "cuda_set_device",
      [](int device) {
        if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
          throw epx::Error(epx::ErrorCode::kCuda, std::string("cudaSetDevice(") +
                                                      std::to_string(device) +
                                                      "): " + cudaGetErrorString(e));
      },
      "device"_a);
  m.def("cuda_get_device", [] {
    int device = -1;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
      throw epx::Error(epx::ErrorCode::kCuda,
                       std::string("cudaGetDevice: ") + cudaGetErrorString(e));
    return device;
  });

  // ---- events and hooks --------------------------------------------------------------
  nb::class_<epx::Event>(m, "EventHandle", "A recorded CUDA event.")
      .def_static(
          "record", [](uintptr_t stream) { return epx::Event::record(to_stream(stream)); },
          "stream"_a, "Records a new event on `stream` (an integer cudaStream_t).")
      .def(
          "current_stream_wait",
          [](const epx::Event& e, uintptr_t stream) { e.stream_wait(to_stream(stream)); },
          "stream"_a, "Makes `stream` wait for the event (no host block).")
      .def("synchronize", &epx::Event::synchronize, nb::call_guard<nb::gil_scoped_release>(),
           "Blocks the host until the event completes.")
      .def_prop_ro("valid", &epx::Event::valid)
      .def_prop_ro("cuda_event",
                   [](const epx::Event& e) { return reinterpret_cast<uintptr_t>(e.get()); });

  nb::class_<Hook>(m, "Hook", "Runs the receive phase of a low-latency op (return_recv_hook=True).")
      .def("__call__", [](const Hook& h) {
        nb::gil_scoped_release release;
        h.fn();
      });

  // ---- config --------------------------------------------------------------------------
  nb::class_<epx::Config>(m, "Config")
      .def(nb::init<int, int, int, int>(), "num_sms"_a = 24, "num_max_send_tokens"_a = 8,
           "num_max_recv_tokens"_a = 4096, "num_send_sms"_a = 0)
      .def_rw("num_sms", &epx::Config::num_sms)
      .def_rw("num_max_send_tokens", &epx::Config::num_max_send_tokens)
      .def_rw("num_max_recv_tokens", &epx::Config::num_max_recv_tokens)
      .def_rw("num_send_sms", &epx::Config::num_send_sms)
      .def_rw("pull_dispatch", &epx::Config::pull_dispatch)
      .def_rw("num_max_rdma_send_tokens", &epx::Config::num_max_rdma_send_tokens)
      .def_rw("num_max_rdma_recv_tokens", &epx::Config::num_max_rdma_recv_tokens)
      .def("send_sms", &epx::Config::send_sms)
      .def("recv_sms", &epx::Config::recv_sms)
      .def("get_nvl_buffer_size_hint", &epx::Config::get_nvl_buffer_size_hint, "hidden_bytes"_a,
           "num_ranks"_a, "num_topk"_a = 16)
      .def("get_rdma_buffer_size_hint", &epx::Config::get_rdma_buffer_size_hint, "hidden_bytes"_a,
           "num_ranks"_a)
      .def("validate", &epx::Config::validate, "num_ranks"_a, "device_sm_count"_a)
      .def("__repr__", [](const epx::Config& c) {
        return "Config(num_sms=" + std::to_string(c.num_sms) +
               ", num_max_send_tokens=" + std::to_string(c.num_max_send_tokens) +
               ", num_max_recv_tokens=" + std::to_string(c.num_max_recv_tokens) +
               ", num_send_sms=" + std::to_string(c.num_send_sms) +
               ", num_max_rdma_send_tokens=" + std::to_string(c.num_max_rdma_send_tokens) +
               ", num_max_rdma_recv_tokens=" + std::to_string(c.num_max_rdma_recv_tokens) +
               (c.pull_dispatch ? ", pull_dispatch=True" : "") + ")";
      });
  m.def(
      "nvshmem_module_version",
      [] { return std::string(epx::transport::load_nvshmem_module().nvshmem_version); },
      "The NVSHMEM version of the nvshmem backend's module (loads it); raises "
      "EPXUnsupportedError saying why when it cannot be loaded.");
  m.def("get_dispatch_config", &epx::get_dispatch_config, "num_ranks"_a);
  m.def("get_combine_config", &epx::get_combine_config, "num_ranks"_a);

  // ---- communicator -----------------------------------------------------------------------
  m.def("new_unique_id", [] {
    const epx::UniqueId id = epx::Communicator::new_unique_id();
    return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
  });
  m.attr("UNIQUE_ID_BYTES") = epx::kUniqueIdBytes;
  m.attr("MAX_CONTEXTS") = epx::kMaxContexts;  // network contexts per peer (num_qps_per_rank)
  nb::class_<epx::Communicator>(m, "Communicator")
      .def_static(
          "create",
          [](nb::bytes id, int rank, int num_ranks, double timeout_s) {
            if (id.size() != static_cast<size_t>(epx::kUniqueIdBytes))
              invalid("id: must be " + std::to_string(epx::kUniqueIdBytes) +
                      " bytes from new_unique_id() (got " + std::to_string(id.size()) + ")");
            epx::UniqueId uid;
            std::memcpy(uid.data(), id.c_str(), uid.size());
            nb::gil_scoped_release release;
            return epx::Communicator::create(uid, rank, num_ranks, timeout_s);
          },
          "id"_a, "rank"_a, "num_ranks"_a, "timeout_s"_a = 300.0,
          "Joins the group (collective); uses the current CUDA device. A host collective "
          "that waits longer than timeout_s for the other ranks aborts the communicator and "
          "raises EPXTimeoutError.")
      .def_static("from_env", &epx::Communicator::from_env,
                  nb::call_guard<nb::gil_scoped_release>())
      .def_static("create_in_process", &epx::Communicator::create_in_process, "num_ranks"_a,
                  "devices"_a = std::vector<int>{}, "timeout_s"_a = 300.0,
                  nb::call_guard<nb::gil_scoped_release>(),
                  "num_ranks communicators whose ranks are threads of this process "
                  "(element r is rank r, on devices[r], default the current device).")
      .def_prop_ro("in_process", &epx::Communicator::in_process)
      .def_prop_ro("aborted", &epx::Communicator::aborted)
      .def_prop_ro("abort_reason", &epx::Communicator::abort_reason)
      .def_prop_ro("ranks_on_device", &epx::Communicator::ranks_on_device)
      .def_prop_ro("rank", &epx::Communicator::rank)
      .def_prop_ro("num_ranks", &epx::Communicator::num_ranks)
      .def_prop_ro("device", &epx::Communicator::device)
      .def("barrier", &epx::Communicator::barrier, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "allgather",
          [](epx::Communicator& c, nb::bytes data) {
            std::vector<uint8_t> out;
            {
              std::string in(data.c_str(), data.size());
              nb::gil_scoped_release release;
              out = c.allgather(in.data(), in.size());
            }
            return nb::bytes(reinterpret_cast<const char*>(out.data()), out.size());
          },
          "data"_a,
          "All-gather of equal-size byte strings; returns them concatenated in rank order.");

  // ---- buffer options and per-call arguments ------------------------------------------------
  nb::class_<epx::BufferOptions>(m, "BufferOptions")
      .def(nb::init<>())
      .def_rw("num_nvl_bytes", &epx::BufferOptions::num_nvl_bytes)
      .def_rw("num_rdma_bytes", &epx::BufferOptions::num_rdma_bytes)
      .def_rw("low_latency_mode", &epx::BufferOptions::low_latency_mode)
      .def_rw("num_qps_per_rank", &epx::BufferOptions::num_qps_per_rank)
      .def_rw("allow_nvlink_for_low_latency_mode",
              &epx::BufferOptions::allow_nvlink_for_low_latency_mode)
      .def_rw("allow_mnnvl", &epx::BufferOptions::allow_mnnvl)
      .def_rw("backend", &epx::BufferOptions::backend)
      .def_rw("ranks_per_node", &epx::BufferOptions::ranks_per_node)
      .def_rw("timeout_s", &epx::BufferOptions::timeout_s)
      .def_rw("enable_shrink", &epx::BufferOptions::enable_shrink)
      .def_rw("proxy_engine", &epx::BufferOptions::proxy_engine)
      .def_rw("fabric_provider", &epx::BufferOptions::fabric_provider)
      .def_rw("fabric_domains", &epx::BufferOptions::fabric_domains)
      .def_rw("ht_rings", &epx::BufferOptions::ht_rings)
      .def_rw("net_split_puts", &epx::BufferOptions::net_split_puts)
      .def_rw("ll_arrival_order", &epx::BufferOptions::ll_arrival_order)
      .def_rw("ll_context_ranges", &epx::BufferOptions::ll_context_ranges)
      .def_rw("ll_sms", &epx::BufferOptions::ll_sms)
      .def_rw("proxy_cumem", &epx::BufferOptions::proxy_cumem)
      .def_rw("max_ops_in_flight", &epx::BufferOptions::max_ops_in_flight)
      .def("validate", &epx::BufferOptions::validate,
           "Raises EPXError naming the first field whose value breaks its rule.")
      .def_prop_rw(
          "allocator",
          [](const epx::BufferOptions& o) -> nb::object {
            const auto* a = o.allocator.target<PyAllocator>();
            return a ? nb::borrow(a->fn.get()) : nb::none();
          },
          [](epx::BufferOptions& o, std::optional<nb::callable> fn) {
            o.allocator = fn ? epx::Allocator(PyAllocator(*fn)) : epx::Allocator();
          },
          "alloc(dtype: int, shape: tuple, stream: int) -> tensor, (tensor, dlpack_source), or "
          "(tensor, data_ptr: int) for a contiguous tensor of that dtype and shape; "
          "None: EPX's cudaMallocAsync allocator.");

  m.def(
      "_test_allocator",
      [](const epx::BufferOptions& o, DType dtype, const std::vector<int64_t>& shape,
         uintptr_t stream) {
        if (!o.allocator) invalid("options: no allocator set");
        Tensor whole;
        {
          nb::gil_scoped_release release;  // as inside Buffer calls
          whole = o.allocator(dtype, shape, to_stream(stream));
        }
        Tensor rest = whole;  // rows 1.. of it, as a kernel result might be
        if (rest.view.ndim > 0 && rest.view.shape[0] > 0) {
          rest.view.data = static_cast<char*>(rest.view.data) +
                           rest.view.strides[0] * static_cast<int64_t>(epx::element_size(dtype));
          rest.view.shape[0] -= 1;
        }
        return nb::make_tuple(to_py(whole), to_py(rest));
      },
      "options"_a, "dtype"_a, "shape"_a, "stream"_a = 0,
      "Calls options.allocator as Buffer ops do; returns (the tensor, its rows 1..) as Python "
      "sees results (tests the ownership round trip).");

  nb::class_<epx::NetworkTraffic>(m, "NetworkTraffic",
                                  "What the network engine carried for this rank since the "
                                  "Buffer was made (running totals).")
      .def(nb::init<>())
      .def_rw("commands", &epx::NetworkTraffic::commands)
      .def_rw("puts", &epx::NetworkTraffic::puts)
      .def_rw("put_bytes", &epx::NetworkTraffic::put_bytes)
      .def_rw("signals", &epx::NetworkTraffic::signals)
      .def_rw("writes", &epx::NetworkTraffic::writes);

  nb::class_<epx::StreamArgs>(m, "StreamArgs")
      .def(nb::init<>())
      .def_prop_rw(
          "stream", [](const epx::StreamArgs& s) { return from_stream(s.stream); },
          [](epx::StreamArgs& s, uintptr_t v) { s.stream = to_stream(v); })
      .def_prop_rw(
          "previous_event",
          [](const epx::StreamArgs& s) {
            return s.previous_event ? std::optional(*s.previous_event) : std::nullopt;
          },
          [](epx::StreamArgs& s, std::optional<const epx::Event*> e) {
            s.previous_event = e ? *e : nullptr;
          },
          "The event is referenced, not copied: keep it alive until the call returns.")
      .def_rw("async_finish", &epx::StreamArgs::async_finish)
      .def_rw("allocate_on_comm_stream", &epx::StreamArgs::allocate_on_comm_stream);

  nb::class_<epx::Layout>(m, "Layout")
      .def_prop_ro("num_tokens_per_rank",
                   [](const epx::Layout& l) { return to_py(l.num_tokens_per_rank); })
      .def_prop_ro("num_tokens_per_rdma_rank",  // None within one node
                   [](const epx::Layout& l) { return to_py(l.num_tokens_per_rdma_rank); })
      .def_prop_ro("num_tokens_per_expert",
                   [](const epx::Layout& l) { return to_py(l.num_tokens_per_expert); })
      .def_prop_ro("is_token_in_rank",
                   [](const epx::Layout& l) { return to_py(l.is_token_in_rank); })
      .def_prop_ro("event", [](const epx::Layout& l) { return l.event; });

  using DH = epx::DispatchHandle;
  nb::class_<DH>(m, "DispatchHandle",
                 "Routing of a dispatch (opaque; pass it to combine or dispatch).")
      .def_ro("num_ranks", &DH::num_ranks)
      .def_ro("num_tokens", &DH::num_tokens)
      .def_ro("num_recv_tokens", &DH::num_recv_tokens)
      .def_ro("hidden", &DH::hidden)
      .def_ro("num_recv_tokens_per_expert", &DH::num_recv_tokens_per_expert)
      .def_prop_ro("is_token_in_rank", [](const DH& h) { return to_py(h.is_token_in_rank); })
      .def_prop_ro("recv_src_idx", [](const DH& h) { return to_py(h.recv_src_idx); })
      .def_prop_ro("rank_prefix_matrix", [](const DH& h) { return to_py(h.rank_prefix_matrix); })
      .def_prop_ro("source_num_tokens", [](const DH& h) { return to_py(h.source_num_tokens); })
      // Across nodes (0 / empty within one node): what DeepEP's internode
      // handle elements are derived from (epx.handles).
      .def_ro("ranks_per_node", &DH::ranks_per_node)
      .def_prop_ro("net_tokens_to_node",
                   [](const DH& h) {
                     return h.internode ? h.internode->net_tokens_to_node : std::vector<int>{};
                   })
      .def_prop_ro("net_fwd_mask",
                   [](const DH& h) { return to_py(across(h, "handle").net_fwd_mask); })
      .def_prop_ro("net_fwd_token",
                   [](const DH& h) { return to_py(across(h, "handle").net_fwd_token); })
      .def_prop_ro("net_recv_meta",
                   [](const DH& h) { return to_py(across(h, "handle").net_recv_meta); })
      .def_prop_ro("net_table", [](const DH& h) { return to_py(across(h, "handle").net_table); })
      .def_prop_ro("net_worst",
                   [](const DH& h) { return h.internode ? h.internode->net_worst : 0; })
      .def_prop_ro("tensors", [](const DH& h) {
        nb::list l;
        for (const Tensor* t :
             {&h.send_counts, &h.recv_offsets, &h.is_token_in_rank, &h.send_slot, &h.send_list,
              &h.recv_src_idx, &h.rank_prefix_matrix, &h.source_num_tokens})
          if (t->defined()) l.append(to_py(*t));
        if (const auto& n = h.internode)
          for (const Tensor* t : {&n->net_send_pos, &n->net_rank_pos, &n->net_fwd_mask,
                                  &n->net_fwd_token, &n->net_recv_meta, &n->net_table})
            if (t->defined()) l.append(to_py(*t));
        return l;
      });

  nb::class_<epx::DispatchArgs>(m, "DispatchArgs")
      .def(nb::init<>())
      .def_rw("x", &epx::DispatchArgs::x)
      .def_rw("x_scales", &epx::DispatchArgs::x_scales)
      .def_rw("topk_idx", &epx::DispatchArgs::topk_idx)
      .def_rw("topk_weights", &epx::DispatchArgs::topk_weights)
      .def_rw("num_tokens_per_rank", &epx::DispatchArgs::num_tokens_per_rank)
      .def_rw("is_token_in_rank", &epx::DispatchArgs::is_token_in_rank)
      .def_rw("num_tokens_per_expert", &epx::DispatchArgs::num_tokens_per_expert)
      .def_rw("handle", &epx::DispatchArgs::handle, nb::for_setter(nb::arg("handle").none()))
      .def_rw("expert_alignment", &epx::DispatchArgs::expert_alignment)
      .def_rw("num_worst_tokens", &epx::DispatchArgs::num_worst_tokens)
      .def_rw("config", &epx::DispatchArgs::config)
      .def_rw("streams", &epx::DispatchArgs::streams);

  nb::class_<epx::DispatchResult>(m, "DispatchResult")
      .def_prop_ro("recv_x", [](const epx::DispatchResult& r) { return to_py(r.recv_x); })
      .def_prop_ro("recv_x_scales",
                   [](const epx::DispatchResult& r) { return to_py(r.recv_x_scales); })
      .def_prop_ro("recv_topk_idx",
                   [](const epx::DispatchResult& r) { return to_py(r.recv_topk_idx); })
      .def_prop_ro("recv_topk_weights",
                   [](const epx::DispatchResult& r) { return to_py(r.recv_topk_weights); })
      .def_ro("num_recv_tokens_per_expert", &epx::DispatchResult::num_recv_tokens_per_expert)
      .def_ro("handle", &epx::DispatchResult::handle)
      .def_prop_ro("event", [](const epx::DispatchResult& r) { return r.event; });

  nb::class_<epx::CombineArgs>(m, "CombineArgs")
      .def(nb::init<>())
      .def_rw("x", &epx::CombineArgs::x)
      .def_rw("handle", &epx::CombineArgs::handle, nb::for_setter(nb::arg("handle").none()))
      .def_rw("topk_weights", &epx::CombineArgs::topk_weights)
      .def_rw("bias_0", &epx::CombineArgs::bias_0)
      .def_rw("bias_1", &epx::CombineArgs::bias_1)
      .def_rw("config", &epx::CombineArgs::config)
      .def_rw("streams", &epx::CombineArgs::streams);

  nb::class_<epx::CombineResult>(m, "CombineResult")
      .def_prop_ro("combined_x", [](const epx::CombineResult& r) { return to_py(r.combined_x); })
      .def_prop_ro("combined_topk_weights",
                   [](const epx::CombineResult& r) { return to_py(r.combined_topk_weights); })
      .def_prop_ro("event", [](const epx::CombineResult& r) { return r.event; });

  using LH = epx::LowLatencyHandle;
  nb::class_<LH>(m, "LowLatencyHandle", "Routing of a low-latency dispatch (opaque).")
      .def_ro("num_ranks", &LH::num_ranks)
      .def_ro("num_experts", &LH::num_experts)
      .def_ro("num_max_dispatch_tokens_per_rank", &LH::num_max_dispatch_tokens_per_rank)
      .def_ro("hidden", &LH::hidden)
      .def_ro("num_tokens", &LH::num_tokens)
      .def_ro("num_topk", &LH::num_topk)
      .def_ro("buffer_slot", &LH::buffer_slot)
      .def_prop_ro("src_info", [](const LH& h) { return to_py(h.src_info); })
      .def_prop_ro("layout_range", [](const LH& h) { return to_py(h.layout_range); })
      .def_prop_ro("tensors", [](const LH& h) {
        nb::list l;
        for (const Tensor* t : {&h.src_info, &h.layout_range, &h.topk_idx})
          if (t->defined()) l.append(to_py(*t));
        return l;
      });

  using LDA = epx::LowLatencyDispatchArgs;
  nb::class_<LDA>(m, "LowLatencyDispatchArgs")
      .def(nb::init<>())
      .def_rw("x", &LDA::x)
      .def_rw("topk_idx", &LDA::topk_idx)
      .def_rw("num_max_dispatch_tokens_per_rank", &LDA::num_max_dispatch_tokens_per_rank)
      .def_rw("num_experts", &LDA::num_experts)
      .def_rw("cumulative_local_expert_recv_stats", &LDA::cumulative_local_expert_recv_stats)
      .def_rw("dispatch_wait_recv_cost_stats", &LDA::dispatch_wait_recv_cost_stats)
      .def_rw("use_fp8", &LDA::use_fp8)
      .def_rw("round_scale", &LDA::round_scale)
      .def_rw("use_ue8m0", &LDA::use_ue8m0)
      .def_rw("async_finish", &LDA::async_finish)
      .def_rw("return_recv_hook", &LDA::return_recv_hook)
      .def_prop_rw(
          "stream", [](const LDA& a) { return from_stream(a.stream); },
          [](LDA& a, uintptr_t s) { a.stream = to_stream(s); });

  using LDR = epx::LowLatencyDispatchResult;
  nb::class_<LDR>(m, "LowLatencyDispatchResult")
      .def_prop_ro("recv_x", [](const LDR& r) { return to_py(r.recv_x); })
      .def_prop_ro("recv_x_scales", [](const LDR& r) { return to_py(r.recv_x_scales); })
      .def_prop_ro("recv_count", [](const LDR& r) { return to_py(r.recv_count); })
      .def_ro("handle", &LDR::handle)
      .def_prop_ro("event", [](const LDR& r) { return r.event; })
      .def_prop_ro("hook", [](const LDR& r) { return hook_of(r.hook); });

  using LCA = epx::LowLatencyCombineArgs;
  nb::class_<LCA>(m, "LowLatencyCombineArgs")
      .def(nb::init<>())
      .def_rw("x", &LCA::x)
      .def_rw("topk_idx", &LCA::topk_idx)
      .def_rw("topk_weights", &LCA::topk_weights)
      .def_rw("handle", &LCA::handle, nb::for_setter(nb::arg("handle").none()))
      .def_rw("use_logfmt", &LCA::use_logfmt)
      .def_rw("zero_copy", &LCA::zero_copy)
      .def_rw("async_finish", &LCA::async_finish)
      .def_rw("return_recv_hook", &LCA::return_recv_hook)
      .def_rw("out", &LCA::out)
      .def_rw("combine_wait_recv_cost_stats", &LCA::combine_wait_recv_cost_stats)
      .def_prop_rw(
          "stream", [](const LCA& a) { return from_stream(a.stream); },
          [](LCA& a, uintptr_t s) { a.stream = to_stream(s); });

  using LCR = epx::LowLatencyCombineResult;
  nb::class_<LCR>(m, "LowLatencyCombineResult")
      .def_prop_ro("combined_x", [](const LCR& r) { return to_py(r.combined_x); })
      .def_prop_ro("event", [](const LCR& r) { return r.event; })
      .def_prop_ro("hook", [](const LCR& r) { return hook_of(r.hook); });

  // ---- buffer -------------------------------------------------------------------------------
  using epx::Buffer;
  nb::class_<Buffer>(m, "Buffer")
      .def(
          "__init__",
          [](Buffer* b, std::shared_ptr<epx::Communicator> comm,
             const epx::BufferOptions& options) {
            nb::gil_scoped_release release;
            new (b) Buffer(std::move(comm), options);
          },
          "comm"_a, "options"_a, "Allocates the symmetric buffers (collective over the group).")
      .def_prop_ro("rank", &Buffer::rank)
      .def_prop_ro("num_ranks", &Buffer::num_ranks)
      .def("get_local_device_id", &Buffer::device)
      .def("get_num_rdma_ranks", &Buffer::num_rdma_ranks)
      .def("get_rdma_rank", &Buffer::rdma_rank)
      .def("get_num_nvl_ranks", &Buffer::num_nvl_ranks)
      .def("get_nvl_rank", &Buffer::nvl_rank)
      .def("get_root_rdma_rank", &Buffer::root_rdma_rank, "global_"_a)
      .def_prop_ro("comm_stream", [](const Buffer& b) { return from_stream(b.comm_stream()); })
      .def_prop_ro("backend_name", &Buffer::backend_name)
      .def_prop_ro("buffer_bytes", &Buffer::buffer_bytes)
      .def(
          "local_buffer",
          [](nb::handle self, bool low_latency) {
            TensorView v = nb::cast<const Buffer&>(self).local_buffer(low_latency);
            TensorView bytes = TensorView::contiguous(v.data, DType::kFP8E4M3,
                                                      {static_cast<int64_t>(v.nbytes())}, v.device);
            return export_view(bytes, self, {}, nb::dtype<uint8_t>());
          },
          "low_latency"_a,
          "The local symmetric region as a flat uint8 DLPack array. Valid until destroy().")
      .def(
          "get_dispatch_layout",
          [](Buffer& b, const TensorView& topk_idx, int num_experts, const epx::StreamArgs& s) {
            nb::gil_scoped_release release;
            return b.get_dispatch_layout(topk_idx, num_experts, s);
          },
          "topk_idx"_a, "num_experts"_a, "streams"_a)
      .def("dispatch", &Buffer::dispatch, "args"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("combine", &Buffer::combine, "args"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("low_latency_dispatch", &Buffer::low_latency_dispatch, "args"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("low_latency_combine", &Buffer::low_latency_combine, "args"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "get_next_low_latency_combine_buffer",
          [](nb::handle self, const LH& handle) {
            TensorView v = nb::cast<Buffer&>(self).get_next_low_latency_combine_buffer(handle);
            return export_view(v, self);
          },
          "handle"_a)
      .def("clean_low_latency_buffer", &Buffer::clean_low_latency_buffer,
           "num_max_dispatch_tokens_per_rank"_a, "hidden"_a, "num_experts"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "low_latency_update_mask_buffer",
          [](Buffer& b, int rank_to_mask, bool mask, uintptr_t stream) {
            b.low_latency_update_mask_buffer(rank_to_mask, mask, to_stream(stream));
          },
          "rank_to_mask"_a, "mask"_a, "stream"_a)
      .def(
          "low_latency_query_mask_buffer",
          [](Buffer& b, const TensorView& mask_status, uintptr_t stream) {
            b.low_latency_query_mask_buffer(mask_status, to_stream(stream));
          },
          "mask_status"_a, "stream"_a)
      .def(
          "low_latency_clean_mask_buffer",
          [](Buffer& b, uintptr_t stream) { b.low_latency_clean_mask_buffer(to_stream(stream)); },
          "stream"_a)
      .def_prop_ro("shrink_enabled", &Buffer::shrink_enabled)
      .def_static("get_low_latency_rdma_size_hint", &Buffer::get_low_latency_rdma_size_hint,
                  "num_max_dispatch_tokens_per_rank"_a, "hidden"_a, "num_ranks"_a, "num_experts"_a)
      .def_static("get_internode_nvl_size_hint", &Buffer::get_internode_nvl_size_hint,
                  "num_max_tokens"_a, "hidden"_a, "num_ranks"_a, "ranks_per_node"_a, "num_topk"_a,
                  "ht_rings"_a = nb::none())
      .def_static("set_num_sms", &Buffer::set_num_sms, "num_sms"_a)
      .def_static("num_sms", &Buffer::num_sms)
      .def("network_traffic", &Buffer::network_traffic)
      .def("check", &Buffer::check)
      .def("destroy", &Buffer::destroy, nb::call_guard<nb::gil_scoped_release>());

  // ---- argument validators (src/core/validate.hpp) ---------------------------------------------
  m.attr("ANY") = epx::validate::kAny;
  m.attr("ANY_DEVICE") = epx::validate::kAnyDevice;
  m.attr("MAX_TOPK") = epx::validate::kMaxTopK;
  m.attr("MAX_RANKS") = epx::validate::kMaxRanks;
  m.attr("MAX_LOW_LATENCY_TOKENS") = epx::validate::kMaxLowLatencyTokens;
  m.def("validate_tensor", &validate_tensor, "op"_a, "name"_a, "t"_a, "dtype"_a, "shape"_a,
        "device"_a, "contiguous"_a = true);
  m.def("validate_num_experts", &epx::validate::num_experts, "op"_a, "num_experts"_a,
        "num_ranks"_a);
  m.def("validate_hidden", &epx::validate::hidden, "op"_a, "hidden"_a, "dtype"_a, "fp8_path"_a);
  m.def("validate_rank_in_group", &epx::validate::rank_in_group, "op"_a, "name"_a, "value"_a,
        "num_ranks"_a);
  m.def("validate_num_topk", &epx::validate::num_topk, "op"_a, "num_topk"_a, "name"_a = "topk_idx");
  m.def("validate_dispatch_layout", &epx::validate::dispatch_layout, "topk_idx"_a, "num_experts"_a,
        "num_ranks"_a, "device"_a);
  m.def("validate_low_latency_sizes", &epx::validate::low_latency_sizes, "op"_a,
        "num_max_dispatch_tokens_per_rank"_a, "hidden"_a, "num_experts"_a, "num_ranks"_a);
  m.def("validate_topk_idx_values", &epx::validate::topk_idx_values, "op"_a, "topk_idx"_a,
        "num_experts"_a);
  m.def("validate_dispatch", &epx::validate::dispatch, "args"_a, "num_ranks"_a, "device"_a);
  m.def("validate_combine", &epx::validate::combine, "args"_a, "num_ranks"_a, "device"_a);
  m.def("validate_low_latency_dispatch", &epx::validate::low_latency_dispatch, "args"_a,
        "num_ranks"_a, "device"_a);
  m.def("validate_low_latency_combine", &epx::validate::low_latency_combine, "args"_a,
        "num_ranks"_a, "device"_a);

  epx::binding::bind_reference(m);
}
