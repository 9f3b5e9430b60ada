// common/diag.cpp - names of the ops a kernel diagnostic can report.
#include "common/diag.hpp"

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
  }
  return "?";
}

}  // namespace epx
