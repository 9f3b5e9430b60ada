// python/src/binding.hpp - what the extension module's source files share.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "epx/error.hpp"

namespace epx::binding {

/// A bad argument from Python: EPXValueError with `msg`.
[[noreturn]] inline void invalid(const std::string& msg) {
  throw epx::Error(epx::ErrorCode::kInvalidArgument, msg);
}

/// The submodule `ref`: the CPU reference model on flat numpy arrays (reference.cpp).
void bind_reference(nanobind::module_& m);

}  // namespace epx::binding
