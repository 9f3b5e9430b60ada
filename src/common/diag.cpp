// common/diag.cpp - names of the ops a kernel diagnostic can report, and the
// messages the host builds from some of its reports.
#include "common/diag.hpp"

#include <sstream>

namespace epx {

const char* op_name(OpId op) {
  switch (op) {
    case OpId::kNone:
      return "none";
    case OpId::kLayout:
      return "get_dispatch_layout";
    case OpId::kDispatchNotify:
      return "dispatch (notify)";
    case OpId::kDispatch:
      return "dispatch";
    case OpId::kCombineNotify:
      return "combine (notify)";
    case OpId::kCombine:
      return "combine";
    case OpId::kLowLatencyDispatchSend:
      return "low_latency_dispatch (send)";
    case OpId::kLowLatencyDispatchRecv:
      return "low_latency_dispatch (recv)";
    case OpId::kLowLatencyCombineSend:
      return "low_latency_combine (send)";
    case OpId::kLowLatencyCombineRecv:
      return "low_latency_combine (recv)";
    case OpId::kBarrier:
      return "barrier";
    case OpId::kDispatchSlot:
      return "dispatch (waiting for the peer to free a ring slot)";
    case OpId::kCombineSlot:
      return "combine (waiting for the peer to free a ring slot)";
    case OpId::kProxyPost:
      return "proxy post (waiting for a free slot in a channel's ring)";
    case OpId::kProxyQuiet:
      return "proxy quiet (waiting for a channel's commands to complete)";
    case OpId::kNetQuiet:
      return "network quiet (waiting for this rank's puts to leave)";
    case OpId::kNetCredit:
      return "network post (waiting for a free slot in the queue to a peer)";
  }
  return "?";
}

/// The barrier's report of a peer whose op or row shape across nodes differs
/// (kernels::HtNetShape: channel = 8 * this rank's op + the field).
std::string internode_shape_message(int channel, int rank, int peer, int mine, int theirs) {
  static const char* ops[] = {"?", "dispatch", "combine"};
  static const char* dispatch_fields[] = {"", "x (hidden bytes)", "x_scales (scales per token)",
                                          "topk_idx (top-k)"};
  static const char* combine_fields[] = {"", "x (hidden)", "topk_weights (top-k)", "?"};
  auto op_of = [&](int v) { return v >= 1 && v <= 2 ? ops[v] : ops[0]; };
  const int op = channel / kInternodeShapeFields, field = channel % kInternodeShapeFields;
  std::ostringstream os;
  if (field == 0) {
    os << op_of(mine) << " across nodes: rank " << rank << " called " << op_of(mine)
       << " while rank " << peer << " called " << op_of(theirs)
       << "; every rank must call the same op in the same order (nothing was sent)";
  } else if (field == 5) {
    os << op_of(op) << " across nodes: num_nvl_bytes: rank " << (mine == 0 ? rank : peer)
       << " has more tokens for one node than a slot of the buffer holds with "
          "num_worst_tokens (the areas are fixed by the buffer then: raise num_nvl_bytes or "
          "lower num_worst_tokens; nothing was sent)";
  } else if (field == 6) {
    os << op_of(op) << " across nodes: num_tokens_per_rank: rank " << peer
       << "'s disagrees with its is_token_in_rank (pass the tensors of one get_dispatch_layout "
          "call; nothing was sent)";
  } else if (field == 7) {
    os << op_of(op) << " across nodes: the rings (EPX_HT_RINGS): rank " << peer
       << "'s ring layout differs from rank " << rank
       << "'s; every rank must run with the same EPX_HT_RINGS, config.num_sms (the ring "
          "channels) and num_nvl_bytes (nothing was sent)";
  } else {
    const char* name = field == 4  ? "num_worst_tokens"
                       : field < 4 ? (op == 1 ? dispatch_fields[field] : combine_fields[field])
                                   : "?";
    os << op_of(op) << " across nodes: " << name << ": rank " << peer << " passed " << theirs
       << ", rank " << rank << " " << mine
       << "; every rank must pass rows of one shape (nothing was sent; this call's outputs are "
          "not valid)";
  }
  return os.str();
}

}  // namespace epx
