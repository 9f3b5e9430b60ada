#include "common/internode_rings.hpp"

#include <algorithm>
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

HtRingGeometry HtRingGeometry::of(int ht_rings, int blocks, int rdma_send, int rdma_recv,
                                  std::size_t record_bytes) {
  HtRingGeometry g;
  g.channels = channels_for_sms(blocks);
  if (ht_rings > 1) {
    g.net_slots = g.nvl_slots = ht_rings;
    g.net_chunk = g.net_chunk < ht_rings ? g.net_chunk : ht_rings;
    g.nvl_chunk = g.nvl_chunk < ht_rings ? g.nvl_chunk : ht_rings;
  }
  if (rdma_recv > 0) g.net_slots = rdma_recv;
  if (rdma_send > 0) {
    g.net_chunk = rdma_send;
  } else if (ht_rings <= 1 && record_bytes > 0) {
    const std::size_t most = g.net_slots >= 2 ? static_cast<std::size_t>(g.net_slots) / 2 : 1;
    const std::size_t by_bytes = kDefaultPutBytes / record_bytes;
    g.net_chunk = static_cast<int>(by_bytes < 1 ? 1 : (by_bytes > most ? most : by_bytes));
  } else if (g.net_chunk > g.net_slots) {
    g.net_chunk = g.net_slots;
  }
  return g;
}

void HtRingRegion::place_state(std::size_t start) {
  const std::size_t R = static_cast<std::size_t>(num_ranks);
  const std::size_t N = static_cast<std::size_t>(num_nodes());
  const std::size_t L = static_cast<std::size_t>(ranks_per_node);
  const std::size_t C = static_cast<std::size_t>(kMaxRingChannels);
  const std::size_t word_set = 8u * kMaxContexts;  // one signal id's words
  const std::size_t first_id = static_cast<std::size_t>(kSignalKindsAll) * R;
  ring_signals = start;
  signals = ring_signals - first_id * word_set;  // the words of ids below first_id: never used
  bases = align_up(
      ring_signals +
          (static_cast<std::size_t>(ht_ring_signal_count(num_ranks)) - first_id) * word_set,
      kAlign);
  nvl_tails = align_up(bases + 8u * static_cast<std::size_t>(HtRingBase::kKinds) * C *
                                   static_cast<std::size_t>(width()),
                       kAlign);
  nvl_heads = align_up(nvl_tails + 8u * C * L, kAlign);
  const std::size_t header_bytes = C * N * net_header_bytes();
  net_headers = align_up(nvl_heads + 8u * C * L, kAlign);
  nvl_headers = align_up(net_headers + header_bytes, kAlign);
  header_send = align_up(nvl_headers + 8u * C * L, kAlign);
  count_rows = align_up(header_send + header_bytes, kAlign);
  const std::size_t count_ints =
      static_cast<std::size_t>(HtNetRegion::count_row_ints(num_ranks, num_nodes()));
  const std::size_t ret_bytes = 8u * C * L * N;
  ret_tails = align_up(count_rows + 4u * count_ints * (R + 1u), kAlign);
  ret_heads = align_up(ret_tails + ret_bytes, kAlign);
  ret_sent = align_up(ret_heads + ret_bytes, kAlign);
  ret_taken = align_up(ret_sent + ret_bytes, kAlign);
  total = align_up(ret_taken + ret_bytes, kAlign);
}

std::size_t HtRingRegion::state_bytes(const Topology& topology) {
  HtRingRegion r;
  r.num_ranks = topology.num_ranks;
  r.ranks_per_node = topology.ranks_per_node;
  // Placed at an offset as large as any header, so that `signals` (below
  // ring_signals) stays non-negative; the size is what follows it.
  const std::size_t start = align_up(
      8u * kMaxContexts * static_cast<std::size_t>(kSignalKindsAll) * topology.num_ranks, kAlign);
  r.place_state(start);
  return r.total - start;
}

HtRingRegion HtRingRegion::make(const Topology& topology, const HtRingGeometry& geometry,
                                std::size_t record_bytes, std::size_t header_bytes,
                                std::size_t region_bytes) {
  return build(topology, geometry, record_bytes, header_bytes, region_bytes, false);
}

HtRingRegion HtRingRegion::make_combine(const Topology& topology, const HtRingGeometry& geometry,
                                        std::size_t record_bytes, std::size_t header_bytes,
                                        std::size_t region_bytes) {
  return build(topology, geometry, record_bytes, header_bytes, region_bytes, true);
}

void HtRingRegion::place_rings(HtRingRegion& r, std::size_t header_bytes) {
  const std::size_t N = static_cast<std::size_t>(r.num_nodes());
  const std::size_t L = static_cast<std::size_t>(r.ranks_per_node);
  const std::size_t C = static_cast<std::size_t>(r.geometry.channels);
  r.net_rings = align_up(header_bytes, kAlign);
  const std::size_t net_bytes =
      C * N * static_cast<std::size_t>(r.geometry.net_slots) * r.record_bytes;
  r.net_send = align_up(r.net_rings + net_bytes, kAlign);
  r.nvl_rings = align_up(r.net_send + net_bytes, kAlign);
  // NVLink rings: per (channel, forwarder), or for the combine a return ring
  // per (channel, local rank, node) of ret_slots() records.
  const std::size_t nvl_records = r.combine ? L * N * static_cast<std::size_t>(r.ret_slots())
                                            : L * static_cast<std::size_t>(r.geometry.nvl_slots);
  r.rings_end = align_up(r.nvl_rings + C * nvl_records * r.record_bytes, kAlign);
}

HtRingRegion HtRingRegion::laid_out(const Topology& topology, const HtRingGeometry& geometry,
                                    std::size_t record_bytes, std::size_t header_bytes,
                                    bool combine) {
  HtRingRegion r;
  r.num_ranks = topology.num_ranks;
  r.ranks_per_node = topology.ranks_per_node;
  r.geometry = geometry;
  r.record_bytes = record_bytes;
  r.combine = combine;
  place_rings(r, header_bytes);
  return r;
}

bool HtRingRegion::room_for(const HtRingRegion& r, std::size_t state, std::size_t region_bytes) {
  return region_bytes >= state && (region_bytes - state) / kAlign * kAlign >= r.rings_end;
}

HtRingGeometry HtRingRegion::fit(const Topology& topology, HtRingGeometry g,
                                 std::size_t record_bytes, std::size_t header_bytes,
                                 std::size_t region_bytes, bool combine, bool keep_net_slots,
                                 bool chunk_by_bytes) {
  if (topology.num_ranks < 1 || topology.ranks_per_node < 1 ||
      topology.num_ranks % topology.ranks_per_node != 0)
    return g;  // make names the topology
  const std::size_t state = state_bytes(topology);
  const auto fits = [&](const HtRingGeometry& x) {
    return room_for(laid_out(topology, x, record_bytes, header_bytes, combine), state,
                    region_bytes);
  };
  const int net_floor = std::max(kMinFitSlots, chunk_by_bytes ? 2 : g.net_chunk);
  const int nvl_floor = std::max(kMinFitSlots, g.nvl_chunk);
  while (!fits(g)) {
    const bool net = !keep_net_slots && g.net_slots / 2 >= net_floor;
    const bool nvl = g.nvl_slots / 2 >= nvl_floor;
    if (!net && !nvl) break;
    if (net) g.net_slots /= 2;
    if (nvl) g.nvl_slots /= 2;
    if (chunk_by_bytes && g.net_chunk > g.net_slots / 2) g.net_chunk = std::max(1, g.net_slots / 2);
  }
  return g;
}

HtRingRegion HtRingRegion::build(const Topology& topology, const HtRingGeometry& geometry,
                                 std::size_t record_bytes, std::size_t header_bytes,
                                 std::size_t region_bytes, bool combine) {
  geometry.validate();
  require(topology.num_ranks >= 1 && topology.ranks_per_node >= 1 &&
              topology.num_ranks % topology.ranks_per_node == 0,
          "topology", "ranks_per_node must divide the rank count");
  require(record_bytes > 0 && record_bytes % 16 == 0, "record_bytes",
          "must be a positive multiple of 16, got " + std::to_string(record_bytes));
  HtRingRegion r = laid_out(topology, geometry, record_bytes, header_bytes, combine);
  const std::size_t state = state_bytes(topology);
  if (!room_for(r, state, region_bytes))
    throw Error(ErrorCode::kBufferTooSmall,
                std::string(combine ? "combine" : "dispatch") + ": num_nvl_bytes: the rings need " +
                    std::to_string(r.rings_end + state) + " bytes (" +
                    std::to_string(geometry.channels) + " channels, network rings of " +
                    std::to_string(geometry.net_slots) + " and NVLink rings of " +
                    std::to_string(geometry.nvl_slots) + " records of " +
                    std::to_string(record_bytes) + " B, and " + std::to_string(state) +
                    " B of ring state) but the buffer has " + std::to_string(region_bytes) +
                    "; raise num_nvl_bytes or use smaller rings");
  r.state = (region_bytes - state) / kAlign * kAlign;
  r.place_state(r.state);
  return r;
}

}  // namespace epx::plan
