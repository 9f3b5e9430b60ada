// transport/proxy/host_engine.hpp - an engine over plain host memory: the
// simulated ranks of one process share a HostFabric, a put is a memcpy and a
// signal an atomic add. Everything is synchronous, so a command is complete
// when the engine returns from it. For the CPU tests of the proxy (no GPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "common/host_group.hpp"
#include "transport/proxy/engine.hpp"

namespace epx::proxy {

/// What the simulated ranks of one process share: which region each rank
/// registered, and a barrier (with a deadline) for the engines' collectives.
class HostFabric {
 public:
  /// `timeout_s`: how long a collective waits for the other ranks.
  explicit HostFabric(int num_ranks, double timeout_s = 30.0);

  int num_ranks() const { return num_ranks_; }

  struct Region {
    void* base = nullptr;
    std::size_t bytes = 0;
  };
  /// Region `id` of `rank` as it registered it ({nullptr, 0}: not registered).
  Region region(int rank, int id) const;

  /// Records (or, with base == nullptr, erases) `rank`'s region `id`.
  void set_region(int rank, int id, Region r);
  /// Returns once every rank has entered this barrier. Throws
  /// epx::Error(kTimeout) naming the ranks that did not arrive; after a
  /// timeout every later call throws at once.
  void barrier(int rank);

 private:
  const int num_ranks_;
  detail::InProcessGroup group_;  ///< the barrier
  mutable std::mutex m_;
  std::vector<Region> regions_;  ///< [rank * kMaxRegions + id]
};

/// Rank `rank`'s engine over `fabric` (num_ranks must be the fabric's).
/// register_region / deregister_region are collective over the fabric's ranks
/// (call them from one thread per rank). put throws epx::Error(kInvalidArgument)
/// naming the region, offsets, bytes and sizes when a range is out of bounds.
std::unique_ptr<Engine> make_host_engine(std::shared_ptr<HostFabric> fabric, int rank,
                                         int num_ranks, int num_channels);

}  // namespace epx::proxy
