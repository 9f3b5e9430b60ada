// core/signal_needs.hpp - what the kernel families need from a backend whose
// signals are a pool (NCCL GIN), for BackendOptions: the core adds it up, so
// no backend reads the families' plans.
#pragma once

#include "common/internode_rings.hpp"
#include "common/internode_route.hpp"
#include "common/plan.hpp"
#include "transport/backend.hpp"

namespace epx::detail {

/// Signal ids: the low-latency ops' (a source's dispatch, combine weights and
/// combine rows, reset when their region is cleared), then the
/// high-throughput ones' across nodes (plan::ht_net_signal), then, where the
/// rings may run (`ht_rings`), theirs (plan::ht_ring_signal).
inline void set_signal_needs(transport::BackendOptions& bo, int num_ranks, bool ht_rings) {
  bo.num_signals =
      ht_rings ? plan::ht_ring_signal_count(num_ranks) : plan::kSignalKindsAll * num_ranks;
  bo.num_cleared_signals = plan::LlRegion::kNetSignalKinds * num_ranks;
}

}  // namespace epx::detail
