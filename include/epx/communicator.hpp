// epx/communicator.hpp - the rank group EPX runs on (an NCCL communicator,
// or ranks that are threads of one process).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "epx/error.hpp"

namespace epx {

namespace detail {
class InProcessGroup;
}

inline constexpr int kUniqueIdBytes = 128;
using UniqueId = std::array<uint8_t, kUniqueIdBytes>;

/// The rank group EPX runs on: an NCCL communicator over R ranks, one GPU
/// each (create, from_env), or R ranks that are threads of one process
/// (create_in_process).
class Communicator {
 public:
  /// A fresh id; rank 0 makes it and every rank passes the same bytes to create().
  static UniqueId new_unique_id();
  /// Joins the group (collective over all ranks). Uses the current CUDA device.
  /// A host collective (barrier, allgather: Buffer construction, destroy,
  /// clean_low_latency_buffer) that waits longer than `timeout_s` for the
  /// other ranks aborts the NCCL communicator and throws kTimeout; every later
  /// collective on it throws too (make a new one).
  static std::shared_ptr<Communicator> create(const UniqueId& id, int rank, int num_ranks,
                                              double timeout_s = 300.0);
  /// Ranks from the environment: torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
  /// MASTER_ADDR, MASTER_PORT) or mpirun (OMPI_COMM_WORLD_*). Selects the CUDA
  /// device LOCAL_RANK. The id travels through NCCL's own bootstrap root
  /// (NCCL_COMM_ID = MASTER_ADDR:MASTER_PORT+1 unless already set).
  static std::shared_ptr<Communicator> from_env();
  /// R ranks in this process, one thread each: element r is rank r, on CUDA
  /// device `devices[r]` (default: every rank on the current device). Each
  /// rank's thread makes that device current and then uses its communicator
  /// as it would use one from create(); every collective (barrier, Buffer
  /// construction, ops) needs all R threads. Buffers over it use the
  /// "in_process" backend: each rank's symmetric memory is a cudaMalloc that
  /// the others reach by pointer (peer access is enabled between distinct
  /// devices). Ranks sharing a device split its SMs: Buffer's SM budget per
  /// rank is the device's SMs / the ranks on it, so that every rank's kernels
  /// can be resident at once. Meant for tests and development on one GPU:
  /// every rank's traffic stays in that GPU's memory, so its speed says
  /// nothing about NVLink. A barrier that waits longer than `timeout_s`
  /// throws kTimeout naming the ranks that did not arrive.
  static std::vector<std::shared_ptr<Communicator>> create_in_process(int num_ranks,
                                                                      std::vector<int> devices = {},
                                                                      double timeout_s = 300.0);

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  void* nccl_comm() const { return comm_; }  ///< ncclComm_t; nullptr when in_process()
  /// True for ranks from create_in_process().
  bool in_process() const { return group_ != nullptr; }
  /// How many of the group's ranks share this rank's GPU (1 unless in_process()).
  int ranks_on_device() const { return ranks_on_device_; }
  /// Host-blocking barrier over all ranks (an NCCL all-reduce of one int),
  /// with the deadline of create() / create_in_process().
  void barrier();
  /// All-gather of `bytes` bytes from every rank (host memory in and out),
  /// with the same deadline, or `timeout_s` seconds where given (> 0: a
  /// Buffer's count exchange waits its own deadline, not the communicator's;
  /// ranks from create_in_process() keep their group's deadline).
  std::vector<uint8_t> allgather(const void* data, std::size_t bytes, double timeout_s = 0.0);
  /// allgather of one trivially copyable value: every rank's, by rank.
  template <class T>
  std::vector<T> allgather_value(const T& value, double timeout_s = 0.0) {
    static_assert(std::is_trivially_copyable_v<T>);
    const std::vector<uint8_t> bytes = allgather(&value, sizeof(T), timeout_s);
    std::vector<T> out(bytes.size() / sizeof(T));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
    return out;
  }
  /// Whether a collective passed its deadline (or NCCL reported an
  /// asynchronous error) and the NCCL communicator was aborted; nccl_comm()
  /// is then nullptr.
  bool aborted() const { return aborted_; }
  /// Why it was aborted ("" when it was not).
  const std::string& abort_reason() const { return abort_reason_; }

 private:
  Communicator() = default;
  /// Waits for this rank's part of an NCCL collective on stream_ until the
  /// deadline; past it (or on an asynchronous NCCL error) aborts and throws.
  void wait_collective(const char* what, double timeout_s);
  void throw_if_aborted(const char* what) const;
  void* comm_ = nullptr;
  double timeout_s_ = 300.0;
  bool aborted_ = false;
  std::string abort_reason_;
  int rank_ = 0, num_ranks_ = 1, device_ = 0, ranks_on_device_ = 1;
  std::shared_ptr<detail::InProcessGroup> group_;  // set for in-process ranks
  void* scratch_ = nullptr;                        // device scratch for host collectives
  cudaStream_t stream_ = nullptr;
};

}  // namespace epx
