// transport/nvshmem/module.hpp - the boundary of the NVSHMEM module
// (libepx_nvshmem.so, docs/nvshmem.md). The core dlopens the module and calls
// its one extern "C" function for this table; everything crosses as plain
// functions and data. Each function returns 0, or an encoded ErrorCode
// (code + 1) with its message in `err`; no exception crosses. Core and module
// come from one build (kAbiVersion guards against a stale module).
// No NVSHMEM header here: libepx includes it.
#pragma once

#include <cstddef>
#include <cstdio>
#include <exception>

#include "epx/error.hpp"
#include "kernels/kernels.hpp"

namespace epx::nvshmem_module {

// 2: the table has the HT launchers; 3: their args record the forwarded
// tokens; 4: and say whether the node slots' puts are split; 5: one launcher per LL op
// (ll_dispatch, ll_combine), given the phases to run
inline constexpr int kAbiVersion = 5;

/// What the core lends the module for its bootstrap.
struct Host {
  void* ctx = nullptr;
  int rank = 0, num_ranks = 1, device = 0;
  /// Every rank's `bytes` from `in`, rank-major into `out` (num_ranks * bytes).
  int (*allgather)(void* ctx, const void* in, std::size_t bytes, void* out, char* err,
                   std::size_t err_len) = nullptr;
};

struct Api {
  int abi_version;
  /// The NVSHMEM the module was built against ("3.4.5").
  const char* nvshmem_version;
  /// Collective: NVSHMEM up on this process (unique-id bootstrap over
  /// host.allgather), with a heap of at least `heap_bytes` when this call
  /// starts it. Counted: each init needs one finalize.
  int (*init)(const Host& host, std::size_t heap_bytes, char* err, std::size_t n);
  /// Collective: the last finalize ends NVSHMEM on this process.
  int (*finalize)(char* err, std::size_t n);
  /// Collective: `bytes` of the symmetric heap, zero-filled on every rank.
  int (*alloc)(std::size_t bytes, void** out, char* err, std::size_t n);
  /// Collective: frees a block from alloc.
  int (*free)(void* p, char* err, std::size_t n);
  /// PE `pe`'s copy of `local` as mapped here (nullptr: not load/store reachable).
  void* (*peer_ptr)(void* local, int pe);
  /// Collective: every put this PE issued has completed (nvshmem_quiet), then
  /// a barrier of all PEs.
  int (*quiesce)(char* err, std::size_t n);
  /// Collective, host-blocking barrier of all PEs.
  int (*barrier)(char* err, std::size_t n);
  /// Loads every kernel of the module now (none lazily while peers wait).
  int (*preload)(char* err, std::size_t n);
  /// The launchers, low-latency and high-throughput across nodes
  /// (dev::ModuleTransport::kernels).
  const kernels::ModuleKernels* kernels;
};

/// An ErrorCode as a return value: 0 is success, so code + 1.
inline int encode(ErrorCode c) {
  return static_cast<int>(c) + 1;
}
inline ErrorCode decode(int rc) {
  return kernels::decode_module_error(rc);
}

/// Runs `f`; an exception becomes its encoded ErrorCode and its message in
/// `err` (nothing is thrown across the module boundary).
template <class F>
int guarded(char* err, std::size_t n, F&& f) {
  try {
    f();
    return 0;
  } catch (const Error& e) {
    std::snprintf(err, n, "%s", e.what());
    return encode(e.code());
  } catch (const std::exception& e) {
    std::snprintf(err, n, "%s", e.what());
  } catch (...) {
    std::snprintf(err, n, "unknown exception");
  }
  return encode(ErrorCode::kInternal);
}

}  // namespace epx::nvshmem_module

/// The module's one entry point (dlsym name "epx_nvshmem_module_api").
extern "C" const epx::nvshmem_module::Api* epx_nvshmem_module_api();
