// Topology: ranks_per_node, its environment variable and the host layout
// (common/topology.hpp); the low-latency region's network areas (plan).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/plan.hpp"
#include "common/topology.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

std::string error_of(int R, int requested, int env, const std::vector<int>& hosts) {
  try {
    make_topology(R, requested, env, hosts);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<int> one_host(int R) {
  return std::vector<int>(R, 0);
}

TEST(Topology, DefaultIsTheHost) {
  const Topology t = make_topology(4, 0, 0, one_host(4));
  EXPECT_EQ(t.ranks_per_node, 4);
  EXPECT_EQ(t.num_nodes(), 1);
  EXPECT_TRUE(t.single_node());
  // Two hosts of 8: two nodes of 8.
  std::vector<int> hosts(16);
  for (int r = 0; r < 16; ++r) hosts[r] = r / 8;
  const Topology u = make_topology(16, 0, 0, hosts);
  EXPECT_EQ(u.ranks_per_node, 8);
  EXPECT_EQ(u.num_nodes(), 2);
  EXPECT_EQ(u.node_of(9), 1);
  EXPECT_EQ(u.local_of(9), 1);
  EXPECT_TRUE(u.same_node(8, 15));
  EXPECT_FALSE(u.same_node(7, 8));
}

TEST(Topology, VirtualNodesSplitAHost) {
  const Topology t = make_topology(4, 2, 0, one_host(4));
  EXPECT_EQ(t.num_nodes(), 2);
  EXPECT_FALSE(t.single_node());
  EXPECT_FALSE(t.same_node(1, 2));
  EXPECT_TRUE(t.same_node(2, 3));
  // The variable when the option is not set; the option wins over it.
  EXPECT_EQ(make_topology(16, 0, 4, one_host(16)).num_nodes(), 4);
  EXPECT_EQ(make_topology(8, 2, 4, one_host(8)).ranks_per_node, 2);
  // 160 ranks: DeepEP's 20 nodes of 8.
  std::vector<int> hosts(160);
  for (int r = 0; r < 160; ++r) hosts[r] = r / 8;
  EXPECT_EQ(make_topology(160, 0, 0, hosts).num_nodes(), 20);
}

TEST(Topology, BadCombinationsNameTheOption) {
  EXPECT_NE(error_of(4, 3, 0, one_host(4)).find("ranks_per_node: must divide"), std::string::npos);
  EXPECT_NE(error_of(4, 0, 3, one_host(4)).find("EPX_RANKS_PER_NODE: must divide"),
            std::string::npos);
  EXPECT_NE(error_of(16, 16, 0, one_host(16)).find("ranks_per_node: a node holds at most 8"),
            std::string::npos);
  // 16 ranks on one host with no split: the host is too big for one node.
  EXPECT_NE(error_of(16, 0, 0, one_host(16)).find("at most 8"), std::string::npos);
  EXPECT_NE(error_of(4, -1, 0, one_host(4)).find("ranks_per_node: must be >= 0"),
            std::string::npos);
  EXPECT_NE(error_of(4, 0, -2, one_host(4)).find("EPX_RANKS_PER_NODE"), std::string::npos);
  EXPECT_NE(error_of(161, 0, 0, one_host(161)).find("num_ranks"), std::string::npos);
  // A node may not span two hosts (two hosts of 2, nodes of 4).
  EXPECT_NE(error_of(4, 4, 0, {0, 0, 1, 1}).find("must not span two hosts"), std::string::npos);
  // Hosts must hold contiguous, equal blocks of ranks.
  EXPECT_NE(error_of(4, 0, 0, {0, 1, 0, 1}).find("contiguous"), std::string::npos);
  EXPECT_NE(error_of(3, 0, 0, {0, 0, 1}).find("ranks"), std::string::npos);
}

TEST(Topology, HostIdsAreDenseInOrder) {
  EXPECT_EQ(host_ids({"b", "b", "a", "a", "c"}), (std::vector<int>{0, 0, 1, 1, 2}));
}

TEST(Topology, LowLatencyNetworkAreas) {
  for (int R : {2, 4, 16, 160}) {
    plan::LlRegion r;
    r.num_ranks = R;
    r.max_tokens = 128;
    r.hidden = 7168;
    r.num_experts = 320 % R == 0 ? 320 : 160;
    // Control (fixed for a buffer): the signals after the dispatch tags.
    EXPECT_EQ(r.signals_offset(), r.dtags_base() + 2 * r.dtags_half_bytes());
    EXPECT_GE(r.tok_done_offset(), r.signals_offset() + 8u * 3 * plan::kLlMaxRanks * kMaxContexts);
    EXPECT_GE(r.row_done_offset(), r.tok_done_offset() + 4u * plan::kLlMaxTokens);
    EXPECT_GE(r.net_done_offset(), r.row_done_offset() + 4u * R * plan::kLlMaxTokens);
    EXPECT_GE(r.control_bytes(), r.net_done_offset() + 16u);
    // The mask and weight sends after the control, then the halves; the
    // combine row sends after the halves, then the zero-copy inputs.
    EXPECT_EQ(r.net_masks_offset(), r.control_bytes());
    EXPECT_GE(r.net_weights_offset(),
              r.net_masks_offset() + 2u * 8u * plan::kLlMaxMaskWords * r.num_experts);
    EXPECT_GE(r.half_offset(0), r.net_weights_offset() + 2 * r.weights_half_bytes());
    EXPECT_EQ(r.net_comb_offset(), r.core_bytes());
    EXPECT_GE(r.net_comb_offset(), r.half_offset(1) + r.half_bytes());
    EXPECT_EQ(r.net_end(), r.net_comb_offset() + 2 * r.net_comb_half_bytes());
    EXPECT_GE(r.net_comb_half_bytes(), static_cast<std::size_t>(R) * 128 * 7168 * 2);
    EXPECT_EQ(r.zero_copy_offset(0), r.net_end());
    EXPECT_EQ(r.total_bytes(), r.net_end() + 2 * r.zero_copy_bytes());
    for (std::size_t o : {r.signals_offset(), r.tok_done_offset(), r.row_done_offset(),
                          r.net_done_offset(), r.control_bytes(), r.net_masks_offset(),
                          r.net_weights_offset(), r.net_comb_offset(), r.zero_copy_offset(0)})
      EXPECT_EQ(o % plan::kAlign, 0u) << o;
    EXPECT_LE(8u * R, plan::LlRegion::dtag_masks_offset());
    // The signals count every op of a buffer, whatever the op's shapes: their
    // place must not move when maxT, hidden or the experts change (it did,
    // and a 2x2 run stalled at the first op of a new shape).
    plan::LlRegion other = r;
    other.max_tokens = 64;
    other.hidden = 2048;
    other.num_experts = R * 2;
    EXPECT_EQ(other.signals_offset(), r.signals_offset());
    EXPECT_EQ(other.tok_done_offset(), r.tok_done_offset());
    EXPECT_EQ(other.row_done_offset(), r.row_done_offset());
    EXPECT_EQ(other.net_done_offset(), r.net_done_offset());
    // Nor the tagged words a rank sends (masks, weights): a peer with other
    // shapes puts its rows into this rank's halves, which must never cover them.
    EXPECT_EQ(other.net_masks_offset(), r.net_masks_offset());
    EXPECT_EQ(other.net_weights_offset(), r.net_weights_offset());
    EXPECT_EQ(other.fixed_bytes(), r.fixed_bytes());
    EXPECT_GE(std::min(other.half_offset(0), r.half_offset(0)), r.fixed_bytes());
  }
}

}  // namespace
}  // namespace epx
