// common/topology.hpp - ranks = nodes x local ranks. A node is one NVLink
// (load/store) domain: peers in it are reached through their mapped memory,
// peers in other nodes only through a transport's network operations.
// Virtual nodes (BufferOptions::ranks_per_node, EPX_RANKS_PER_NODE) split a
// host into pretend nodes so that every cross-node path runs on one machine.
// Ranks are numbered node-major: node n holds ranks [n * rpn, (n + 1) * rpn).
#pragma once

#include <string>
#include <vector>

namespace epx {

inline constexpr int kMaxRanksPerNode = 8;  ///< DeepEP's NVLink domain limit
inline constexpr int kMaxRanks = 160;       ///< 20 nodes of 8 (DeepEP's limit)
/// Contexts (queue pairs, proxy channels) per peer a transport may use.
inline constexpr int kMaxContexts = 32;

struct Topology {
  int num_ranks = 1;
  int ranks_per_node = 1;

  int num_nodes() const { return ranks_per_node > 0 ? num_ranks / ranks_per_node : 0; }
  int node_of(int r) const { return r / ranks_per_node; }
  int local_of(int r) const { return r % ranks_per_node; }
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }
  bool single_node() const { return ranks_per_node == num_ranks; }
};

/// The topology a Buffer uses. `requested` (BufferOptions::ranks_per_node;
/// 0: not set) wins over `env_value` (EPX_RANKS_PER_NODE; 0: not set); with
/// neither, a node is the host: `host_of[r]` (one id per rank, equal for ranks
/// of one host) gives its size. Throws epx::Error(kInvalidArgument) naming the
/// option or the variable that broke a rule: ranks_per_node in [1, 8]; it
/// divides the rank count; a (virtual) node never spans two hosts; hosts
/// hold their ranks contiguously and equally (node-major numbering).
Topology make_topology(int num_ranks, int requested, int env_value,
                       const std::vector<int>& host_of);

/// Dense host ids (0, 1, ... in order of first appearance) from one identity
/// string per rank (hostname and boot id).
std::vector<int> host_ids(const std::vector<std::string>& identities);

/// This machine's hostname ("unknown-host" when it cannot be read).
std::string hostname();
/// /proc/sys/kernel/random/boot_id without its newline ("" when absent): tells
/// apart hosts that share a name.
std::string boot_id();

}  // namespace epx
