// python/src/testing.cpp - the extension module epx._testing, for the
// Python tests only: handles of the shapes a dispatch makes, whose tensors
// are views of memory that does not exist, so that argument validation can be
// driven without a GPU. Built with EPX_PYTHON_TESTING=ON (scripts/test.sh
// does), never into the package a user installs: a handle whose pointers lead
// nowhere must not be constructible from production code. Import epx._core
// first (it registers the handle types these functions return).
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/internode_handle.hpp"
#include "epx/buffer.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using epx::DType;
using epx::Tensor;

/// A dense view of `shape` at a fake, 256-byte aligned address on `device`.
Tensor fake_tensor(DType dtype, std::initializer_list<int64_t> shape, int device, uintptr_t& next) {
  Tensor t;
  t.view.data = reinterpret_cast<void*>(next);
  next += 1 << 20;
  t.view.dtype = dtype;
  t.view.ndim = static_cast<int>(shape.size());
  t.view.device = device;
  int d = 0;
  for (int64_t e : shape) t.view.shape[d++] = e;
  int64_t stride = 1;
  for (int i = t.view.ndim - 1; i >= 0; --i) {
    t.view.strides[i] = stride;
    stride *= std::max<int64_t>(t.view.shape[i], 1);
  }
  return t;
}

/// A high-throughput handle as a dispatch of these sizes makes it, within one
/// node (ranks_per_node 0) or across nodes; `drop` names a routing tensor to
/// leave out (a handle rebuilt by hand), "all" every one.
std::shared_ptr<const epx::DispatchHandle> dispatch_handle(int num_ranks, int num_tokens,
                                                           int num_recv_tokens, int hidden,
                                                           int device, int ranks_per_node,
                                                           const std::string& drop) {
  if (num_ranks < 1 || num_tokens < 0 || num_recv_tokens < 0 || ranks_per_node < 0 ||
      (ranks_per_node > 0 && num_ranks % ranks_per_node != 0))
    throw std::invalid_argument("dispatch_handle: impossible sizes");
  auto h = std::make_shared<epx::DispatchHandle>();
  h->num_ranks = num_ranks;
  h->num_tokens = num_tokens;
  h->num_recv_tokens = num_recv_tokens;
  h->hidden = hidden;
  h->ranks_per_node = ranks_per_node;
  if (drop == "all") return h;
  const int64_t T = num_tokens, R = num_ranks, N = num_recv_tokens;
  uintptr_t next = uintptr_t{0x7e0000000000};
  bool dropped = drop.empty();
  const auto set = [&](const char* name, Tensor& t, DType d, std::initializer_list<int64_t> s) {
    if (drop == name) {
      dropped = true;
      return;
    }
    t = fake_tensor(d, s, device, next);
  };
  set("is_token_in_rank", h->is_token_in_rank, DType::kBool, {T, R});
  set("recv_src_idx", h->recv_src_idx, DType::kI32, {N});
  if (ranks_per_node == 0) {
    set("send_slot", h->send_slot, DType::kI32, {T, R});
    set("send_list", h->send_list, DType::kI32, {R, std::max<int64_t>(T, 1)});
    set("send_counts", h->send_counts, DType::kI32, {R});
    set("recv_offsets", h->recv_offsets, DType::kI32, {R + 1});
    set("rank_prefix_matrix", h->rank_prefix_matrix, DType::kI32, {R, R});
    set("source_num_tokens", h->source_num_tokens, DType::kI32, {R});
  } else {
    const int64_t nodes = R / ranks_per_node;
    set("net_send_pos", epx::across(*h).net_send_pos, DType::kI32, {T, nodes});
    set("net_rank_pos", epx::across(*h).net_rank_pos, DType::kI32, {T, R});
    set("net_table", epx::across(*h).net_table, DType::kI32, {64});
    set("net_fwd_mask", epx::across(*h).net_fwd_mask, DType::kI32, {nodes, 16});
    set("net_fwd_token", epx::across(*h).net_fwd_token, DType::kI32, {nodes, 16});
    set("net_recv_meta", epx::across(*h).net_recv_meta, DType::kI32, {N, 3});
    set("rank_prefix_matrix", h->rank_prefix_matrix, DType::kI32, {R, R});
    set("source_num_tokens", h->source_num_tokens, DType::kI32, {R});
  }
  if (!dropped) throw std::invalid_argument("dispatch_handle: no routing tensor named " + drop);
  return h;
}

/// A low-latency handle of these sizes without its tensors (the low-latency
/// combine refuses it once past argument validation).
std::shared_ptr<const epx::LowLatencyHandle> low_latency_handle(int num_ranks, int num_experts,
                                                                int max_tokens, int hidden,
                                                                int num_tokens, int num_topk) {
  auto h = std::make_shared<epx::LowLatencyHandle>();
  h->num_ranks = num_ranks;
  h->num_experts = num_experts;
  h->num_max_dispatch_tokens_per_rank = max_tokens;
  h->hidden = hidden;
  h->num_tokens = num_tokens;
  h->num_topk = num_topk;
  return h;
}

}  // namespace

NB_MODULE(_testing, m) {
  nb::module_::import_("epx._core");
  m.def("dispatch_handle", &dispatch_handle, "num_ranks"_a, "num_tokens"_a, "num_recv_tokens"_a,
        "hidden"_a, "device"_a = 0, "ranks_per_node"_a = 0, "drop"_a = "",
        "A high-throughput handle with fake routing tensors (tests of argument validation).");
  m.def("low_latency_handle", &low_latency_handle, "num_ranks"_a, "num_experts"_a,
        "num_max_dispatch_tokens_per_rank"_a, "hidden"_a, "num_tokens"_a, "num_topk"_a,
        "A tensor-less low-latency handle (tests of argument validation).");
}
