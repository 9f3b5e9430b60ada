#include "common/internode_rings.hpp"

#include <string>

#include "epx/error.hpp"

namespace epx::plan {

void HtRingGeometry::validate() const {
  require(channels >= 1, "num_sms",
          "gives " + std::to_string(channels) + " ring channels; needs at least 3 SMs (a send, " +
              "a forward and a receive block per channel)");
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
                                std::size_t record_bytes) {
  geometry.validate();
  require(topology.num_ranks >= 1 && topology.ranks_per_node >= 1 &&
              topology.num_ranks % topology.ranks_per_node == 0,
          "topology", "ranks_per_node must divide the rank count");
  require(record_bytes > 0 && record_bytes % 16 == 0, "record_bytes",
          "must be a positive multiple of 16, got " + std::to_string(record_bytes));
  HtRingRegion r;
  r.topology = topology;
  r.geometry = geometry;
  r.record_bytes = record_bytes;
  const std::size_t R = static_cast<std::size_t>(topology.num_ranks);
  const std::size_t N = static_cast<std::size_t>(topology.num_nodes());
  const std::size_t L = static_cast<std::size_t>(topology.ranks_per_node);
  const std::size_t C = static_cast<std::size_t>(geometry.channels);
  r.signals = HtNetRegion::kSignals;
  r.shapes = align_up(r.signals + 8u *
                                      static_cast<std::size_t>(ht_ring_signal_count(
                                          topology.num_ranks, geometry.channels)) *
                                      kMaxContexts,
                      kAlign);
  r.bases = align_up(r.shapes + HtNetRegion::kShapeBytes * (2u * R + 2u), kAlign);
  r.nvl_tails = align_up(r.bases + 8u * static_cast<std::size_t>(HtRingBase::kKinds) * C *
                                       static_cast<std::size_t>(r.width()),
                         kAlign);
  r.nvl_heads = align_up(r.nvl_tails + 8u * C * L, kAlign);
  const std::size_t header_bytes = 8u * C * N * (1u + L);
  r.net_headers = align_up(r.nvl_heads + 8u * C * L, kAlign);
  r.nvl_headers = align_up(r.net_headers + header_bytes, kAlign);
  r.header_send = align_up(r.nvl_headers + 8u * C * L, kAlign);
  r.net_rings = align_up(r.header_send + header_bytes, kAlign);
  const std::size_t net_bytes = C * N * static_cast<std::size_t>(geometry.net_slots) * record_bytes;
  r.net_send = align_up(r.net_rings + net_bytes, kAlign);
  r.nvl_rings = align_up(r.net_send + net_bytes, kAlign);
  r.total = align_up(
      r.nvl_rings + C * L * static_cast<std::size_t>(geometry.nvl_slots) * record_bytes, kAlign);
  return r;
}

std::size_t HtRingRegion::base_word(HtRingBase kind, int channel, int index) const {
  return bases + 8u * ((static_cast<std::size_t>(kind) * geometry.channels + channel) *
                           static_cast<std::size_t>(width()) +
                       index);
}

std::size_t HtRingRegion::nvl_tail(int channel, int forwarder_local) const {
  return nvl_tails +
         8u * (static_cast<std::size_t>(channel) * topology.ranks_per_node + forwarder_local);
}

std::size_t HtRingRegion::nvl_head(int channel, int receiver_local) const {
  return nvl_heads +
         8u * (static_cast<std::size_t>(channel) * topology.ranks_per_node + receiver_local);
}

std::size_t HtRingRegion::net_header(int channel, int node, int word) const {
  const std::size_t L = static_cast<std::size_t>(topology.ranks_per_node);
  return net_headers +
         8u * ((static_cast<std::size_t>(channel) * topology.num_nodes() + node) * (1u + L) + word);
}

std::size_t HtRingRegion::header_send_word(int channel, int node, int word) const {
  return net_header(channel, node, word) - net_headers + header_send;
}

std::size_t HtRingRegion::nvl_header(int channel, int forwarder_local) const {
  return nvl_headers +
         8u * (static_cast<std::size_t>(channel) * topology.ranks_per_node + forwarder_local);
}

std::size_t HtRingRegion::net_slot(int channel, int node, uint64_t index) const {
  const std::size_t ring = static_cast<std::size_t>(channel) * topology.num_nodes() + node;
  const std::size_t slots = static_cast<std::size_t>(geometry.net_slots);
  return net_rings + (ring * slots + index % slots) * record_bytes;
}

std::size_t HtRingRegion::net_send_slot(int channel, int node, uint64_t index) const {
  return net_slot(channel, node, index) - net_rings + net_send;
}

std::size_t HtRingRegion::nvl_slot(int channel, int forwarder_local, uint64_t index) const {
  const std::size_t ring =
      static_cast<std::size_t>(channel) * topology.ranks_per_node + forwarder_local;
  const std::size_t slots = static_cast<std::size_t>(geometry.nvl_slots);
  return nvl_rings + (ring * slots + index % slots) * record_bytes;
}

}  // namespace epx::plan
