#include "common/topology.hpp"

#include <unistd.h>

#include <fstream>
#include <map>

#include "epx/error.hpp"

namespace epx {

std::vector<int> host_ids(const std::vector<std::string>& identities) {
  std::map<std::string, int> seen;
  std::vector<int> ids;
  ids.reserve(identities.size());
  for (const auto& s : identities) {
    auto it = seen.emplace(s, static_cast<int>(seen.size())).first;
    ids.push_back(it->second);
  }
  return ids;
}

std::string hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

std::string boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

Topology make_topology(int num_ranks, int requested, int env_value,
                       const std::vector<int>& host_of) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw Error(ErrorCode::kInvalidArgument, "num_ranks: must be in [1, " +
                                                 std::to_string(kMaxRanks) + "], got " +
                                                 std::to_string(num_ranks));
  if (static_cast<int>(host_of.size()) != num_ranks)
    throw Error(ErrorCode::kInternal, "make_topology: one host id per rank expected");
  // The host layout: contiguous, equal blocks of ranks per host.
  int per_host = 0;
  while (per_host < num_ranks && host_of[per_host] == host_of[0]) ++per_host;
  for (int r = 0; r < num_ranks; ++r)
    if (host_of[r] != host_of[r / per_host * per_host])
      throw Error(ErrorCode::kUnsupported,
                  "ranks: every host must hold an equal, contiguous block of ranks (rank " +
                      std::to_string(r) + " is on another host than rank " +
                      std::to_string(r / per_host * per_host) + ")");
  for (int a = 0; a < num_ranks; a += per_host)
    for (int b = a + per_host; b < num_ranks; b += per_host)
      if (host_of[a] == host_of[b])
        throw Error(ErrorCode::kUnsupported,
                    "ranks: every host must hold one contiguous block of ranks (ranks " +
                        std::to_string(a) + " and " + std::to_string(b) +
                        " are on one host, ranks between them on another)");
  if (num_ranks % per_host != 0)
    throw Error(ErrorCode::kUnsupported, "ranks: the hosts hold unequal numbers of ranks (" +
                                             std::to_string(per_host) + " on the first, " +
                                             std::to_string(num_ranks) + " in all)");
  const char* what = requested > 0 ? "ranks_per_node" : "EPX_RANKS_PER_NODE";
  int rpn = requested > 0 ? requested : env_value;
  if (requested < 0)
    throw Error(ErrorCode::kInvalidArgument,
                "ranks_per_node: must be >= 0 (0: the host), got " + std::to_string(requested));
  if (rpn < 0)
    throw Error(ErrorCode::kInvalidArgument,
                "EPX_RANKS_PER_NODE: must be >= 1, got " + std::to_string(env_value));
  if (rpn == 0) {
    what = "ranks per host";
    rpn = per_host;
  }
  if (rpn > kMaxRanksPerNode)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(what) + ": a node holds at most " + std::to_string(kMaxRanksPerNode) +
                    " ranks, got " + std::to_string(rpn) +
                    (requested > 0 || env_value > 0
                         ? ""
                         : " (split the host into virtual nodes with ranks_per_node)"));
  if (num_ranks % rpn != 0)
    throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": must divide the rank count " +
                                                 std::to_string(num_ranks) + ", got " +
                                                 std::to_string(rpn));
  if (per_host % rpn != 0)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(what) + ": a node must not span two hosts; " + std::to_string(rpn) +
                    " does not divide the " + std::to_string(per_host) + " ranks of a host");
  return Topology{num_ranks, rpn};
}

}  // namespace epx
