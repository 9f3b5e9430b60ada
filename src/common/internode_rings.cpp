#include "common/internode_rings.hpp"

#include <string>

#include "epx/error.hpp"

namespace epx::plan {

void HtRingGeometry::validate() const {
  require(channels >= 1 && channels <= kMaxRingChannels, "num_sms",
          "gives " + std::to_string(channels) + " ring channels; needs 3 to " +
              std::to_string(3 * kMaxRingChannels) +
              " SMs (a send, a forward and a receive block per channel)");
  require(net_slots >= 1, "num_max_rdma_chunked_recv_tokens",
          "must be >= 1, got " + std::to_string(net_slots));
  require(net_chunk >= 1 && net_chunk <= net_slots, "num_max_rdma_chunked_send_tokens",
          "must be in [1, num_max_rdma_chunked_recv_tokens = " + std::to_string(net_slots) +
              "], got " + std::to_string(net_chunk));
  require(nvl_slots >= 1, "num_max_nvl_chunked_recv_tokens",
          "must be >= 1, got " + std::to_string(nvl_slots));
  require(nvl_chunk >= 1 && nvl_chunk <= nvl_slots, "num_max_nvl_chunked_send_tokens",
          "must be in [1, num_max_nvl_chunked_recv_tokens = " + std::to_string(nvl_slots) +
              "], got " + std::to_string(nvl_chunk));
}

HtRingRegion HtRingRegion::make(const Topology& topology, const HtRingGeometry& geometry,
                                std::size_t record_bytes, std::size_t header_bytes) {
  geometry.validate();
  require(topology.num_ranks >= 1 && topology.ranks_per_node >= 1 &&
              topology.num_ranks % topology.ranks_per_node == 0,
          "topology", "ranks_per_node must divide the rank count");
  require(record_bytes > 0 && record_bytes % 16 == 0, "record_bytes",
          "must be a positive multiple of 16, got " + std::to_string(record_bytes));
  HtRingRegion r;
  r.num_ranks = topology.num_ranks;
  r.ranks_per_node = topology.ranks_per_node;
  r.geometry = geometry;
  r.record_bytes = record_bytes;
  const std::size_t R = static_cast<std::size_t>(topology.num_ranks);
  const std::size_t N = static_cast<std::size_t>(topology.num_nodes());
  const std::size_t L = static_cast<std::size_t>(topology.ranks_per_node);
  const std::size_t C = static_cast<std::size_t>(geometry.channels);
  const std::size_t word_set = 8u * kMaxContexts;  // one signal id's words
  const std::size_t first_id = static_cast<std::size_t>(kSignalKindsAll) * R;
  r.ring_signals = align_up(header_bytes, kAlign);
  r.signals = r.ring_signals - first_id * word_set;  // ids below first_id are never used here
  r.bases =
      align_up(r.ring_signals +
                   (static_cast<std::size_t>(ht_ring_signal_count(topology.num_ranks)) - first_id) *
                       word_set,
               kAlign);
  r.nvl_tails = align_up(r.bases + 8u * static_cast<std::size_t>(HtRingBase::kKinds) * C *
                                       static_cast<std::size_t>(r.width()),
                         kAlign);
  r.nvl_heads = align_up(r.nvl_tails + 8u * C * L, kAlign);
  const std::size_t header_words = 8u * C * N * (1u + L);
  r.net_headers = align_up(r.nvl_heads + 8u * C * L, kAlign);
  r.nvl_headers = align_up(r.net_headers + header_words, kAlign);
  r.header_send = align_up(r.nvl_headers + 8u * C * L, kAlign);
  r.net_rings = align_up(r.header_send + header_words, kAlign);
  const std::size_t net_bytes = C * N * static_cast<std::size_t>(geometry.net_slots) * record_bytes;
  r.net_send = align_up(r.net_rings + net_bytes, kAlign);
  r.nvl_rings = align_up(r.net_send + net_bytes, kAlign);
  r.total = align_up(
      r.nvl_rings + C * L * static_cast<std::size_t>(geometry.nvl_slots) * record_bytes, kAlign);
  return r;
}

}  // namespace epx::plan
