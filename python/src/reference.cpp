// python/src/reference.cpp - epx._core.ref: the CPU reference model
// (include/epx/reference.hpp) on flat numpy arrays, for the tests and the
// Python package's checks. Conversions only, as the rest of the binding.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "binding.hpp"
#include "epx/reference.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace epx::binding {
namespace {

// ---- reference model: std::vector <-> numpy -----------------------------------------

template <class T>
using HostArray = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;

template <class T>
std::vector<T> vec_of(const HostArray<T>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

template <class T>
nb::object np_of(std::vector<T> v) {
  auto* held = new std::vector<T>(std::move(v));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  size_t shape[1] = {held->size()};
  return nb::ndarray<nb::numpy, T>(held->data(), 1, shape, owner).cast();
}

/// Binds a std::vector<T> member as a flat numpy array property.
template <class C, class T>
void vec_field(nb::class_<C>& cls, const char* name, std::vector<T> C::*m) {
  cls.def_prop_rw(
      name, [m](const C& c) { return np_of(c.*m); },
      [m](C& c, const HostArray<T>& a) { c.*m = vec_of(a); });
}

template <class T>
std::vector<std::vector<T>> vecs_of(const std::vector<HostArray<T>>& as) {
  std::vector<std::vector<T>> out;
  out.reserve(as.size());
  for (const auto& a : as) out.push_back(vec_of(a));
  return out;
}

}  // namespace

void bind_reference(nb::module_& m) {
  namespace ref = epx::ref;
  nb::module_ r =
      m.def_submodule("ref", "CPU reference model (epx/reference.hpp); flat numpy arrays.");

  r.def("bf16_to_float", &ref::bf16_to_float, "bits"_a);
  r.def("float_to_bf16", &ref::float_to_bf16, "value"_a);
  r.def("fp8_e4m3_to_float", &ref::fp8_e4m3_to_float, "bits"_a);
  r.def("float_to_fp8_e4m3", &ref::float_to_fp8_e4m3, "value"_a);
  r.def("scale_to_ue8m0", &ref::scale_to_ue8m0, "scale"_a);
  r.def("ue8m0_to_scale", &ref::ue8m0_to_scale, "exponent"_a);
  r.def(
      "quantize_row_fp8",
      [](const HostArray<float>& x, bool round_scale) {
        const int hidden = static_cast<int>(x.size());
        if (hidden % 128 != 0)
          invalid("x: hidden must be a multiple of 128 (got " + std::to_string(hidden) + ")");
        std::vector<uint8_t> q(hidden);
        std::vector<float> scales(hidden / 128);
        ref::quantize_row_fp8(x.data(), hidden, round_scale, q.data(), scales.data());
        return nb::make_tuple(np_of(std::move(q)), np_of(std::move(scales)));
      },
      "x"_a, "round_scale"_a = false,
      "One row [hidden] f32 -> (q [hidden] u8, scales [hidden/128] f32).");
  r.def(
      "quantize_rows_fp8",
      [](const HostArray<float>& x, int hidden, bool round_scale) {
        if (hidden <= 0 || hidden % 128 != 0)
          invalid("hidden: must be a positive multiple of 128 (got " + std::to_string(hidden) +
                  ")");
        if (x.size() % static_cast<std::size_t>(hidden) != 0)
          invalid("x: its size (" + std::to_string(x.size()) + ") must be rows x hidden (" +
                  std::to_string(hidden) + ")");
        const std::size_t rows = x.size() / static_cast<std::size_t>(hidden);
        std::vector<uint8_t> q(x.size());
        std::vector<float> scales(rows * static_cast<std::size_t>(hidden / 128));
        for (std::size_t t = 0; t < rows; ++t)
          ref::quantize_row_fp8(x.data() + t * hidden, hidden, round_scale, q.data() + t * hidden,
                                scales.data() + t * (hidden / 128));
        return nb::make_tuple(np_of(std::move(q)), np_of(std::move(scales)));
      },
      "x"_a, "hidden"_a, "round_scale"_a = false,
      "Rows [T * hidden] f32, flat -> (q [T * hidden] u8, scales [T * hidden/128] f32): "
      "quantize_row_fp8 per row, in one call.");
  r.def(
      "logfmt_encode",
      [](const HostArray<float>& row) { return np_of(ref::logfmt_encode(vec_of(row))); }, "row"_a);
  r.def(
      "logfmt_decode",
      [](const HostArray<uint8_t>& code, int hidden) {
        return np_of(ref::logfmt_decode(vec_of(code), hidden));
      },
      "code"_a, "hidden"_a);
  r.def("logfmt_bytes", &ref::logfmt_bytes, "hidden"_a);
  r.def("logfmt_max_rel_error", &ref::logfmt_max_rel_error);

  nb::class_<ref::Layout> layout(r, "Layout");
  vec_field(layout, "num_tokens_per_rank", &ref::Layout::num_tokens_per_rank);
  vec_field(layout, "num_tokens_per_expert", &ref::Layout::num_tokens_per_expert);
  vec_field(layout, "is_token_in_rank", &ref::Layout::is_token_in_rank);
  vec_field(layout, "num_tokens_per_node", &ref::Layout::num_tokens_per_node);
  r.def(
      "get_dispatch_layout",
      [](const HostArray<int64_t>& topk_idx, int num_tokens, int num_topk, int num_experts,
         int num_ranks, int ranks_per_node) {
        return ref::get_dispatch_layout(vec_of(topk_idx), num_tokens, num_topk, num_experts,
                                        num_ranks, ranks_per_node);
      },
      "topk_idx"_a, "num_tokens"_a, "num_topk"_a, "num_experts"_a, "num_ranks"_a,
      "ranks_per_node"_a = 0);

  nb::class_<ref::HtInput> in(r, "HtInput");
  in.def(nb::init<>())
      .def_rw("num_tokens", &ref::HtInput::num_tokens)
      .def_rw("fp8", &ref::HtInput::fp8);
  vec_field(in, "x_bf16", &ref::HtInput::x_bf16);
  vec_field(in, "x_fp8", &ref::HtInput::x_fp8);
  vec_field(in, "x_scales", &ref::HtInput::x_scales);
  vec_field(in, "topk_idx", &ref::HtInput::topk_idx);
  vec_field(in, "topk_weights", &ref::HtInput::topk_weights);

  nb::class_<ref::HtDispatchOutput> hd(r, "HtDispatchOutput");
  hd.def_ro("num_recv_tokens", &ref::HtDispatchOutput::num_recv_tokens);
  vec_field(hd, "recv_x_bf16", &ref::HtDispatchOutput::recv_x_bf16);
  vec_field(hd, "recv_x_fp8", &ref::HtDispatchOutput::recv_x_fp8);
  vec_field(hd, "recv_x_scales", &ref::HtDispatchOutput::recv_x_scales);
  vec_field(hd, "recv_topk_idx", &ref::HtDispatchOutput::recv_topk_idx);
  vec_field(hd, "recv_topk_weights", &ref::HtDispatchOutput::recv_topk_weights);
  vec_field(hd, "num_recv_tokens_per_expert", &ref::HtDispatchOutput::num_recv_tokens_per_expert);
  vec_field(hd, "recv_src_rank", &ref::HtDispatchOutput::recv_src_rank);
  vec_field(hd, "recv_src_idx", &ref::HtDispatchOutput::recv_src_idx);
  vec_field(hd, "rank_prefix_matrix", &ref::HtDispatchOutput::rank_prefix_matrix);
  vec_field(hd, "source_num_tokens", &ref::HtDispatchOutput::source_num_tokens);
  r.def("ht_dispatch", &ref::ht_dispatch, "inputs"_a, "hidden"_a, "num_topk"_a, "num_experts"_a,
        "expert_alignment"_a);

  nb::class_<ref::HtCombineInput> ci(r, "HtCombineInput");
  ci.def(nb::init<>());
  vec_field(ci, "x", &ref::HtCombineInput::x);
  vec_field(ci, "topk_weights", &ref::HtCombineInput::topk_weights);
  vec_field(ci, "bias_0", &ref::HtCombineInput::bias_0);
  vec_field(ci, "bias_1", &ref::HtCombineInput::bias_1);
  nb::class_<ref::HtCombineOutput> co(r, "HtCombineOutput");
  vec_field(co, "combined_x", &ref::HtCombineOutput::combined_x);
  vec_field(co, "combined_topk_weights", &ref::HtCombineOutput::combined_topk_weights);
  r.def("ht_combine", &ref::ht_combine, "routing"_a, "inputs"_a, "hidden"_a, "num_topk"_a,
        "num_experts"_a, "ranks_per_node"_a = 0);

  nb::class_<ref::LlDispatchOutput> ld(r, "LlDispatchOutput");
  vec_field(ld, "recv_x_bf16", &ref::LlDispatchOutput::recv_x_bf16);
  vec_field(ld, "recv_x_fp8", &ref::LlDispatchOutput::recv_x_fp8);
  vec_field(ld, "recv_x_scales", &ref::LlDispatchOutput::recv_x_scales);
  vec_field(ld, "recv_count", &ref::LlDispatchOutput::recv_count);
  vec_field(ld, "src_info", &ref::LlDispatchOutput::src_info);
  vec_field(ld, "recv_src_rank", &ref::LlDispatchOutput::recv_src_rank);
  vec_field(ld, "layout_range", &ref::LlDispatchOutput::layout_range);
  r.def(
      "ll_dispatch",
      [](const std::vector<HostArray<uint16_t>>& x, const std::vector<HostArray<int64_t>>& topk_idx,
         const std::vector<int>& num_tokens, int hidden, int num_topk, int num_experts,
         int max_tokens, bool use_fp8, bool round_scale) {
        return ref::ll_dispatch(vecs_of(x), vecs_of(topk_idx), num_tokens, hidden, num_topk,
                                num_experts, max_tokens, use_fp8, round_scale);
      },
      "x"_a, "topk_idx"_a, "num_tokens"_a, "hidden"_a, "num_topk"_a, "num_experts"_a,
      "max_tokens"_a, "use_fp8"_a, "round_scale"_a);
  r.def(
      "ll_combine",
      [](const std::vector<HostArray<uint16_t>>& expert_out,
         const std::vector<HostArray<int64_t>>& topk_idx,
         const std::vector<HostArray<float>>& topk_weights, const std::vector<int>& num_tokens,
         int hidden, int num_topk, int num_experts, int max_tokens, bool use_logfmt) {
        auto out =
            ref::ll_combine(vecs_of(expert_out), vecs_of(topk_idx), vecs_of(topk_weights),
                            num_tokens, hidden, num_topk, num_experts, max_tokens, use_logfmt);
        nb::list l;
        for (auto& o : out) l.append(np_of(std::move(o)));
        return l;
      },
      "expert_out"_a, "topk_idx"_a, "topk_weights"_a, "num_tokens"_a, "hidden"_a, "num_topk"_a,
      "num_experts"_a, "max_tokens"_a, "use_logfmt"_a);
}

}  // namespace epx::binding
