// Choosing a backend by name (registry.hpp).
#include "transport/registry.hpp"

#include <algorithm>

#include "common/env.hpp"
#include "epx/communicator.hpp"
#include "epx/error.hpp"

namespace epx::transport {

const BackendInfo& choose_backend(const std::string& requested, bool in_process,
                                  const Topology& topology) {
  std::string name = requested.empty() ? "auto" : requested;
  std::string from = "backend";
  if (name == "auto") {
    name = env::get("EPX_BACKEND").value_or("auto");
    if (name != "auto") from = "EPX_BACKEND";
  }
  if (name == "auto") {
    std::vector<const BackendInfo*> order;
    for (const BackendInfo* b : backends())
      if (b->auto_order >= 0) order.push_back(b);
    std::stable_sort(order.begin(), order.end(), [](const BackendInfo* a, const BackendInfo* b) {
      return a->auto_order < b->auto_order;
    });
    std::string why;
    for (const BackendInfo* b : order) {
      const std::string no = b->cannot_serve ? b->cannot_serve(from, in_process, topology) : "";
      if (no.empty()) return *b;
      why += "; " + no;
    }
    throw Error(ErrorCode::kUnsupported, from + " auto: no backend serves these ranks" + why);
  }
  std::string names = "auto";
  for (const BackendInfo* b : backends()) {
    names += std::string("|") + b->name;
    if (name != b->name) continue;
    if (b->cannot_serve)
      if (const std::string no = b->cannot_serve(from, in_process, topology); !no.empty())
        throw Error(ErrorCode::kUnsupported, no);
    return *b;
  }
  throw Error(ErrorCode::kInvalidArgument,
              from + ": must be one of " + names + ", got '" + name + "'");
}

std::unique_ptr<Backend> make_backend(const std::string& requested, Communicator& comm,
                                      const Topology& topology, const BackendOptions& options) {
  return choose_backend(requested, comm.in_process(), topology).make(comm, topology, options);
}

std::string single_node_only(const std::string& from, const char* name, const Topology& topology) {
  if (topology.single_node()) return "";
  return from + ": '" + name + "' reaches only peers of this rank's node, and the " +
         std::to_string(topology.num_ranks) + " ranks form " +
         std::to_string(topology.num_nodes()) + " nodes of " +
         std::to_string(topology.ranks_per_node) +
         " ranks (ranks_per_node / EPX_RANKS_PER_NODE); use backend 'proxy'";
}

}  // namespace epx::transport
