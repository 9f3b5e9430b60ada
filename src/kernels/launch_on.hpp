// kernels/launch_on.hpp - the one dispatch from a transport to the launchers
// of its kernels: libepx's own instantiations for its transports, the
// module's table for a module's transport (dev::ModuleTransport).
#pragma once

#include <string>
#include <type_traits>
#include <variant>

#include "epx/error.hpp"
#include "kernels/kernels.hpp"

namespace epx::kernels {

/// Runs `built_in(tt)` for libepx's own transports, `module(table, tt, err,
/// err_len)` for a module's, and raises what the module reported (prefixed
/// with `what`).
template <class BuiltIn, class Module>
void launch_on(const dev::AnyTransport& t, const char* what, BuiltIn&& built_in, Module&& module) {
  std::visit(
      [&](const auto& tt) {
        using T = std::decay_t<decltype(tt)>;
        if constexpr (dev::kBuiltIn<T>) {
          built_in(tt);
        } else {
          if (tt.kernels == nullptr)
            throw Error(ErrorCode::kInternal,
                        std::string(what) + ": the module transport has no launcher table");
          char err[1024] = {0};
          const int rc = module(*tt.kernels, static_cast<const dev::NetworkTransportBase&>(tt), err,
                                sizeof(err));
          if (rc != 0) throw Error(decode_module_error(rc), std::string(what) + ": " + err);
        }
      },
      t);
}

}  // namespace epx::kernels
