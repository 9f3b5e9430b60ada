// transport/nvshmem/nvshmem_backend.hpp - the NVSHMEM backend (docs/nvshmem.md).
#pragma once

#include <memory>

#include "transport/backend.hpp"

namespace epx::nvshmem_module {
struct Api;
}

namespace epx::transport {

/// The NVSHMEM module's table (module.hpp), loaded on first use: from
/// EPX_NVSHMEM_MODULE if set, else beside the code that holds libepx, one
/// directory above it, or the loader's path. Throws epx::Error(kUnsupported)
/// saying whether the build has no module or the module could not load (and
/// why: NVSHMEM's library missing, a module of another build).
const nvshmem_module::Api& load_nvshmem_module();

/// Loads the NVSHMEM module and starts NVSHMEM over `comm` (one process per
/// rank). Throws epx::Error(kUnsupported) naming what is missing: the module
/// (EPX_WITH_NVSHMEM), NVSHMEM's library, or one process per rank.
std::unique_ptr<Backend> make_nvshmem_backend(Communicator& comm, const Topology& topology,
                                              const BackendOptions& options);

}  // namespace epx::transport
