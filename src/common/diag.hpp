// common/diag.hpp - what a kernel reports when a wait passes its deadline or an
// input is out of range. Lives in host-mapped memory; the host turns it into
// an epx::Error naming the op, rank, peer and what was awaited.
#pragma once

#include <cstdint>
#include <string>

namespace epx {

enum class OpId : uint32_t {
  kNone = 0,
  kLayout = 1,
  kDispatchNotify = 2,
  kDispatch = 3,
  kCombineNotify = 4,
  kCombine = 5,
  kLowLatencyDispatchSend = 6,
  kLowLatencyDispatchRecv = 7,
  kLowLatencyCombineSend = 8,
  kLowLatencyCombineRecv = 9,
  kBarrier = 10,
  kDispatchSlot = 11,  ///< a dispatch sender waiting for a ring slot (the peer's credit)
  kCombineSlot = 12,   ///< a combine sender waiting for a ring slot
  kProxyPost = 13,     ///< a GPU thread waiting for a free slot in a proxy channel's ring
  kProxyQuiet = 14,    ///< a GPU thread waiting for a proxy channel's commands to complete
  kNetQuiet = 15,      ///< a GPU thread waiting for its network puts to leave (channel: context)
  kNetCredit = 16,     ///< a GPU thread waiting for a free slot in a network queue to a peer
                       ///< (channel: context)
};

enum class DiagCode : uint32_t {
  kOk = 0,
  kTimeout = 1,
  kBadExpert = 2,
  kTooManyTokens = 3,
  kBadLayout = 4,     ///< num_tokens_per_rank disagrees with is_token_in_rank
  kBadConfig = 5,     ///< a peer's config or row layout differs from this rank's (no data moved)
  kProxyStopped = 6,  ///< a proxy channel's thread stopped or died (channel = the channel)
};

struct DeviceDiag {
  uint32_t code;      ///< DiagCode; the first reporter wins (atomicCAS from 0)
  uint32_t op;        ///< OpId
  int32_t rank;       ///< who waited
  int32_t peer;       ///< whom it waited for (-1: n/a)
  int32_t channel;    ///< chunk / slot / expert index
  uint32_t expected;  ///< value awaited
  uint32_t seen;      ///< value last read
  int32_t token;      ///< for kBadExpert: token index; value in `seen`
};

const char* op_name(OpId op);

/// The message of a kBadConfig from the internode barrier (OpId::kBarrier): a
/// peer's op or row shape differs from this rank's, or a rank's rows do not
/// fit or its layout disagrees. `channel`: kInternodeShapeFields * this
/// rank's op (1 dispatch, 2 combine) + the field (kernels::HtNetShape: 0 the
/// op, 1-3 the op's row fields, 4 num_worst_tokens, 5 whether the rows fit,
/// 6 the caller's layout, 7 the rings' layout).
inline constexpr int kInternodeShapeFields = 8;
std::string internode_shape_message(int channel, int rank, int peer, int mine, int theirs);

/// DeviceDiag::channel of a wait for a signal (a network peer's puts): this
/// plus the signal id.
inline constexpr int32_t kDiagSignalChannel = 1 << 24;

}  // namespace epx
