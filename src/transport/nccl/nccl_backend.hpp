// transport/nccl/nccl_backend.hpp - the host half of the NCCL GIN backend
// (docs/nccl_gin.md): communicators split from the user's for the GIN
// contexts (4 per communicator in NCCL 2.28.9), one ncclDevComm each with
// GIN forced on and every context connected at creation, the region as one
// ncclMemAlloc allocation registered as a symmetric window in each.
//
// make_backend("nccl") makes it (EPX_BACKEND=nccl); `auto` does not pick it
// yet. Nothing here has run on a GPU yet.
#pragma once

#include <memory>

#include "transport/backend.hpp"

namespace epx::transport {

/// `num_contexts` (num_qps_per_rank) GIN contexts per peer, 1 to 32;
/// `num_signals` signal ids per context, of which a cleared region resets
/// [0, `num_cleared_signals`) (the low-latency ops'; the others count on).
/// Throws epx::Error naming what is
/// missing: an NCCL communicator (not in-process ranks), GIN support (a GIN
/// net plugin: on one host, the loopback plugin, NCCL_NET_PLUGIN=epxloop).
std::unique_ptr<Backend> make_nccl_gin_backend(Communicator& comm, const Topology& topology,
                                               int num_contexts, int num_signals,
                                               int num_cleared_signals);

}  // namespace epx::transport
