// transport/registry.hpp - how the core finds a backend by name. Each
// backend describes itself once, beside its code (a BackendInfo: its name,
// whether `auto` may pick it and in which order, what it cannot serve, how to
// make it); transport/builtin.cpp lists those descriptions, one line per
// backend. The choice below names no backend: adding one is its folder and
// its line in builtin.cpp. (An explicit list rather than self-registering
// statics: a static library drops an object file nothing refers to, and its
// registration with it.)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/backend.hpp"

namespace epx::transport {

struct BackendInfo {
  const char* name;
  /// `auto` tries the backends with auto_order >= 0 in ascending order and
  /// takes the first that can serve; -1: chosen only by name.
  int auto_order = -1;
  /// Why this backend cannot serve ranks that are (`in_process`) or are not
  /// threads of one process, in `topology`; "" when it can. `from` names
  /// where the choice came from ("backend", "EPX_BACKEND") for the message.
  /// Pure: no CUDA or NCCL call. Null: it serves any ranks (what it needs
  /// beyond that, its make() checks).
  std::string (*cannot_serve)(const std::string& from, bool in_process,
                              const Topology& topology) = nullptr;
  std::unique_ptr<Backend> (*make)(Communicator& comm, const Topology& topology,
                                   const BackendOptions& options) = nullptr;
};

/// For backends that reach only the peers of this rank's node: "" when the
/// topology is one node, else the reason naming `from`, `name` and the nodes.
std::string single_node_only(const std::string& from, const char* name, const Topology& topology);

/// Every backend built into this library (builtin.cpp), in a fixed order.
const std::vector<const BackendInfo*>& backends();

/// The backend `requested` names: "auto" (or empty) is EPX_BACKEND where set,
/// else the first backend in auto order that can serve. A named backend that
/// cannot serve, or an unknown name, is epx::Error naming where the name came
/// from, the rule and the backends there are. No CUDA call.
const BackendInfo& choose_backend(const std::string& requested, bool in_process,
                                  const Topology& topology);

}  // namespace epx::transport
