// core/internode_handle.hpp - what a dispatch handle across nodes holds for
// its combine and its cached dispatches (docs/internode_ht.md): the route of
// the count exchange and the kernels' per-token state. Kernel internals, so
// the public DispatchHandle holds them behind an opaque pointer; the core,
// the validation and the in-tree binding read them through across().
#pragma once

#include <memory>
#include <vector>

#include "epx/buffer.hpp"
#include "epx/error.hpp"

namespace epx {

struct DispatchHandle::Internode {
  /// The count exchange's numbers (host), from which every rank derives the
  /// same route: [R][R] tokens of each source per rank, [R][N] per node.
  std::vector<int> net_tokens_to_rank, net_tokens_to_node;
  Tensor net_send_pos;   ///< [T, N] i32: token t's index in this rank's stream to node m, or -1
  Tensor net_rank_pos;   ///< [T, R] i32: token t's index among this rank's tokens for rank r, or -1
  Tensor net_fwd_mask;   ///< [N, rows] i32: local ranks each record this rank forwarded reached
  Tensor net_fwd_token;  ///< [N, rows] i32: each forwarded record's token index at its source
  /// [N_recv, 3] i32: each received row's source rank, record index, and the
  /// mask of this node's ranks its token reached (DeepEP's recv_src_meta)
  Tensor net_recv_meta;
  Tensor net_table;  ///< i32: the kernels' route table (kernels::HtNetTable)
  /// num_worst_tokens across nodes (0: the host count exchange sized the
  /// areas and net_tokens_* hold its numbers): the areas are fixed by the
  /// buffer, with slots of net_slot_rows rows (plan::HtNetRegion::fixed_*).
  int net_worst = 0, net_slot_rows = 0;
  /// Whether this dispatch, and so its combine and the cached dispatches of
  /// this handle, went through the fixed rings instead of the whole-call
  /// areas (EPX_HT_RINGS; by default the rings where those areas would not
  /// fit num_nvl_bytes).
  bool net_rings = false;
};

/// The handle's state across nodes, made on first use (a dispatch filling a
/// new handle).
inline DispatchHandle::Internode& across(DispatchHandle& h) {
  if (!h.internode) h.internode = std::make_shared<DispatchHandle::Internode>();
  return *h.internode;
}
/// The state of a handle across nodes; a handle with ranks_per_node but none
/// (not made by a dispatch) is refused naming `op`'s handle.
inline const DispatchHandle::Internode& across(const DispatchHandle& h, const char* op) {
  if (!h.internode)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) +
                    ": handle: has ranks_per_node but no state across nodes (pass the handle a "
                    "dispatch across nodes returned)");
  return *h.internode;
}

}  // namespace epx
