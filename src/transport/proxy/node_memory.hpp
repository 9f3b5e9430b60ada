// transport/proxy/node_memory.hpp - host memory that the processes of one
// node map into each other, for engines whose regions must be host memory
// (libfabric without FI_HMEM) while same-node peers reach those regions by
// load/store (the kernels' same-node path).
//
// Each region of each rank is a memfd, mapped shared into its own process;
// its descriptor travels to the other ranks of the node over a host mesh
// (common/host_mesh.hpp: same uid, a per-job secret), and each of them maps
// it too. What a peer says about its region (its size) is checked against the
// descriptor's real size before it is mapped. The memory is zeroed (a fresh
// memfd is). CUDA registration of the mappings is the caller's: this file
// makes no CUDA call, so the CPU tests run it between forked processes.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace epx::proxy {

class Exchange;

class NodeMemory {
 public:
  /// Collective over every rank of `ex` (they allgather mesh handles once):
  /// `node` lists the ranks of this rank's node in ascending order, this
  /// rank among them; every rank of that node must pass the same list.
  /// Waits at most `timeout_s` for the node's ranks.
  NodeMemory(Exchange& ex, std::vector<int> node, double timeout_s);
  ~NodeMemory();
  NodeMemory(const NodeMemory&) = delete;
  NodeMemory& operator=(const NodeMemory&) = delete;

  struct Region {
    void* local = nullptr;     ///< this rank's region
    std::size_t bytes = 0;     ///< rounded up to whole pages
    std::vector<void*> peers;  ///< per rank of `ex`: its region mapped here (this rank's: local;
                               ///< ranks outside the node: nullptr)
  };
  /// Collective over the node's ranks (in the same order on each): a zeroed
  /// region of `bytes` on every rank, mapped into every other rank of the
  /// node. Every rank of the node must ask for the same size.
  Region alloc(std::size_t bytes);
  /// Unmaps what alloc mapped (not collective: the caller makes sure no peer
  /// still writes it).
  void free(Region& r);

  const std::vector<int>& node() const { return node_; }

 private:
  struct Mesh;
  std::vector<int> node_;
  int rank_ = 0;
  int num_ranks_ = 0;
  std::unique_ptr<Mesh> mesh_;
};

}  // namespace epx::proxy
