// transport/backend.hpp - the host side of a communication backend.
//
// A backend owns symmetric memory (same size on every rank) and knows which
// peers are load/store reachable. Kernels never see this class: they get the
// backend's device struct (transport/device.cuh) by value.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <string>

#include "common/plan.hpp"

namespace epx {
class Communicator;
}

namespace epx::transport {

/// One symmetric allocation: this rank's pointer plus every peer's mapping of
/// its copy (nullptr where the peer is not load/store reachable).
struct SymmetricRegion {
  void* local = nullptr;
  std::array<void*, plan::kMaxRanks> peers{};
  std::size_t bytes = 0;
  void* handle = nullptr;  ///< backend-private (e.g. an NCCL window)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  /// Collective: every rank allocates `bytes`, zero-filled.
  virtual SymmetricRegion alloc(std::size_t bytes) = 0;
  /// Collective: releases a region from alloc().
  virtual void free(SymmetricRegion& region) = 0;
  /// Host-blocking barrier over all ranks.
  virtual void barrier() = 0;
};

/// `name`: "auto" | "nvlink" | "in_process" (EPX_BACKEND overrides "auto").
/// "auto" is "in_process" for a communicator from create_in_process, else
/// "nvlink". Throws epx::Error(kUnsupported) when the machine or the
/// communicator cannot serve the choice.
std::unique_ptr<Backend> make_backend(const std::string& name, Communicator& comm);

/// The NVLink backend: NCCL symmetric windows, peers reached by load/store.
std::unique_ptr<Backend> make_nvlink_backend(Communicator& comm);

/// Ranks that are threads of one process: cudaMalloc'd memory reached by pointer.
std::unique_ptr<Backend> make_in_process_backend(Communicator& comm);

}  // namespace epx::transport
