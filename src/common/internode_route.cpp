#include "common/internode_route.hpp"

#include <string>
#include <utility>

#include "epx/error.hpp"

namespace epx::plan {

InternodeRoute::InternodeRoute(InternodeCounts counts) : c_(std::move(counts)) {
  const Topology& t = c_.topology;
  require(t.ranks_per_node >= 1 && t.num_ranks >= 1 && t.num_ranks % t.ranks_per_node == 0,
          "topology", "ranks_per_node must divide the rank count");
  R_ = t.num_ranks;
  N_ = t.num_nodes();
  require(c_.tokens_to_rank.size() == static_cast<std::size_t>(R_) * R_, "tokens_to_rank",
          "must be [R][R] = " + std::to_string(R_ * R_) + " counts, got " +
              std::to_string(c_.tokens_to_rank.size()));
  require(c_.tokens_to_node.size() == static_cast<std::size_t>(R_) * N_, "tokens_to_node",
          "must be [R][N] = " + std::to_string(R_ * N_) + " counts, got " +
              std::to_string(c_.tokens_to_node.size()));
  for (int s = 0; s < R_; ++s)
    for (int m = 0; m < N_; ++m) {
      // A token with an expert in node m reaches at least one and at most
      // all of its ranks.
      int most = 0, sum = 0;
      for (int l = 0; l < t.ranks_per_node; ++l) {
        const int v = at(s, m * t.ranks_per_node + l);
        require(v >= 0, "tokens_to_rank", "counts must be >= 0");
        most = v > most ? v : most;
        sum += v;
      }
      const int node = c_.tokens_to_node[static_cast<std::size_t>(s) * N_ + m];
      require(node >= most && node <= sum, "tokens_to_node",
              "rank " + std::to_string(s) + "'s count for node " + std::to_string(m) + " (" +
                  std::to_string(node) + ") must lie between its largest count for one rank of " +
                  "that node (" + std::to_string(most) + ") and their sum (" + std::to_string(sum) +
                  ")");
    }
  recv_offset_.assign(static_cast<std::size_t>(R_) * R_, 0);
  recv_rows_.assign(R_, 0);
  for (int d = 0; d < R_; ++d)
    for (int s = 0; s < R_; ++s) {
      recv_offset_[static_cast<std::size_t>(d) * R_ + s] = recv_rows_[d];
      recv_rows_[d] += at(s, d);
    }
}

int InternodeRoute::network_rows(int s, int m) const {
  if (m == c_.topology.node_of(s)) return 0;
  return c_.tokens_to_node[static_cast<std::size_t>(s) * N_ + m];
}

int InternodeRoute::forwarded_rows(int f, int s) const {
  const Topology& t = c_.topology;
  if (t.local_of(f) != t.local_of(s)) return 0;  // f forwards only its own local index
  if (f == s) {
    // Its own tokens for its own node: those with an expert there.
    return c_.tokens_to_node[static_cast<std::size_t>(s) * N_ + t.node_of(s)];
  }
  return network_rows(s, t.node_of(f));
}

int InternodeRoute::recv_rows(int d) const {
  return recv_rows_[d];
}

int InternodeRoute::recv_offset(int d, int s) const {
  return recv_offset_[static_cast<std::size_t>(d) * R_ + s];
}

int InternodeRoute::network_rows_sent(int s) const {
  int rows = 0;
  for (int m = 0; m < N_; ++m) rows += network_rows(s, m);
  return rows;
}

int InternodeRoute::network_rows_received(int f) const {
  int rows = 0;
  for (int s = 0; s < R_; ++s)
    if (s != f) rows += forwarded_rows(f, s);
  return rows;
}

int InternodeRoute::max_node_rows() const {
  int most = 0;
  for (int v : c_.tokens_to_node) most = v > most ? v : most;
  return most;
}

int InternodeRoute::max_recv_rows() const {
  int most = 0;
  for (int v : recv_rows_) most = v > most ? v : most;
  return most;
}

HtNetRegion HtNetRegion::slots_of(const InternodeRoute& route, std::size_t row_bytes) {
  const Topology& t = route.topology();
  HtNetRegion r;
  r.row_bytes = row_bytes;
  r.slot_rows = route.max_node_rows();
  r.num_nodes = t.num_nodes();
  r.ranks_per_node = t.ranks_per_node;
  return r;
}

void HtNetRegion::place_dispatch(HtNetRegion& r, int num_ranks) {
  const std::size_t slots = r.slot_bytes() * static_cast<std::size_t>(r.num_nodes);
  r.recv = body(num_ranks);
  r.send = align_up(r.recv + slots, kAlign);
  r.stage = align_up(r.send + slots, kAlign);
  r.total = align_up(r.stage + r.row_bytes * static_cast<std::size_t>(r.stage_rows), kAlign);
  if (r.count_ints > 0) {
    // [R] rows from the sources, then this rank's own (what its puts send)
    r.count_rows = r.total;
    r.total = align_up(r.count_rows + 4u * r.count_ints * (num_ranks + 1u), kAlign);
  }
}

void HtNetRegion::place_combine(HtNetRegion& r, int num_ranks) {
  const std::size_t slots = r.slot_bytes() * static_cast<std::size_t>(r.num_nodes);
  r.stage = body(num_ranks);
  r.send = align_up(r.stage + slots * static_cast<std::size_t>(r.ranks_per_node), kAlign);
  r.recv = align_up(r.send + slots, kAlign);
  r.total = align_up(r.recv + slots, kAlign);
}

HtNetRegion HtNetRegion::dispatch(const InternodeRoute& route, std::size_t record_bytes) {
  HtNetRegion r = slots_of(route, record_bytes);
  r.stage_rows = route.max_recv_rows();
  place_dispatch(r, route.topology().num_ranks);
  return r;
}

HtNetRegion HtNetRegion::combine(const InternodeRoute& route, std::size_t row_bytes) {
  HtNetRegion r = slots_of(route, row_bytes);
  place_combine(r, route.topology().num_ranks);
  return r;
}

HtNetRegion HtNetRegion::fixed_combine(const Topology& topology, int slot_rows,
                                       std::size_t row_bytes) {
  HtNetRegion r;
  r.row_bytes = row_bytes;
  r.slot_rows = slot_rows;
  r.num_nodes = topology.num_nodes();
  r.ranks_per_node = topology.ranks_per_node;
  place_combine(r, topology.num_ranks);
  return r;
}

HtNetRegion HtNetRegion::fixed_dispatch(const Topology& topology, int worst,
                                        std::size_t record_bytes, int slot_rows) {
  HtNetRegion r;
  r.row_bytes = record_bytes;
  r.num_nodes = topology.num_nodes();
  r.ranks_per_node = topology.ranks_per_node;
  r.stage_rows = worst;
  r.count_ints = count_row_ints(topology.num_ranks, r.num_nodes);
  r.slot_rows = slot_rows;
  place_dispatch(r, topology.num_ranks);
  return r;
}

int HtNetRegion::fixed_slot_rows(const Topology& topology, int worst, std::size_t record_bytes,
                                 std::size_t combine_row_bytes, std::size_t capacity) {
  // The areas with no slot rows, then the rows that fit beside them (each
  // area is aligned: leave kAlign per area for that).
  const std::size_t N = static_cast<std::size_t>(topology.num_nodes());
  const std::size_t L = static_cast<std::size_t>(topology.ranks_per_node);
  const std::size_t fixed = fixed_dispatch(topology, worst, record_bytes, 0).total + 4 * kAlign;
  const std::size_t combine_fixed = body(topology.num_ranks) + 4 * kAlign;
  if (capacity <= fixed || capacity <= combine_fixed) return 0;
  const std::size_t d = (capacity - fixed) / (2 * N * record_bytes);
  const std::size_t k = (capacity - combine_fixed) / ((L + 2) * N * combine_row_bytes);
  constexpr std::size_t kMaxRows = 1u << 24;  // keeps every offset well inside int
  const std::size_t rows = d < k ? d : k;
  return static_cast<int>(rows < kMaxRows ? rows : kMaxRows);
}

std::size_t HtNetRegion::worst_case(const Topology& topology, int tokens, std::size_t record_bytes,
                                    std::size_t combine_row_bytes) {
  // The counts of a routing that sends every token everywhere.
  const int R = topology.num_ranks, N = topology.num_nodes();
  InternodeCounts c;
  c.topology = topology;
  c.tokens_to_rank.assign(static_cast<std::size_t>(R) * R, tokens);
  c.tokens_to_node.assign(static_cast<std::size_t>(R) * N, tokens);
  const InternodeRoute route(std::move(c));
  const std::size_t d = dispatch(route, record_bytes).total;
  const std::size_t k = combine(route, combine_row_bytes).total;
  return d > k ? d : k;
}

}  // namespace epx::plan
