// epx/config.hpp - kernel launch and buffer configuration (DeepEP's Config).
#pragma once

#include <cstddef>
#include <cstdint>

namespace epx {

/// Tuning knobs of the high-throughput kernels and the buffer sizes they imply.
///
/// `num_sms`: SMs (thread blocks) the kernel occupies; a third send, the rest
///   receive (receivers also copy the rows a rank sends itself), unless
///   `num_send_sms` says otherwise.
/// `num_max_send_tokens`: tokens a sender warp moves between two progress
///   signals (the chunk size).
/// Every rank must pass the same Config to an op (as in DeepEP): both ends of
/// a (sender, receiver) pair derive its chunk size from it
/// (`num_max_send_tokens` caps it; pairs with few rows use smaller chunks).
/// `num_max_recv_tokens`: rows of the receive ring per peer rank (the buffer
///   size); a call may send any number of tokens: a pair with more rows than
///   its ring reuses slots as the receiver frees them (a credit per chunk).
///   Must be >= num_max_send_tokens.
/// `pull_dispatch` (not in DeepEP; dispatch only, default off, or on for
///   get_dispatch_config's configs with EPX_HT_PULL=1): each rank copies a
///   token once into its own buffer and the ranks that take it read it from
///   there (NVLink loads) straight into recv_x, instead of the sender storing
///   it into every taker's ring and the taker copying it out. The buffer
///   holds (R - 1) * num_max_recv_tokens rows of a rank's tokens at once
///   (more tokens reuse it as a ring). Its default send share is a sixth.
/// `num_max_rdma_send_tokens` / `num_max_rdma_recv_tokens` (DeepEP's
///   num_max_rdma_chunked_send_tokens / _recv_tokens): across nodes, the
///   ring dispatch's (EPX_HT_RINGS) records per network put and records per
///   network ring (per channel and source node); 0 keeps EPX's defaults
///   (puts of about 1 MiB of records, at most half the ring, and rings of
///   256; or EPX_HT_RINGS's ring size). The whole-call kernels (the default
///   where the call fits) size their network areas per call and do not read
///   them.
struct Config {
  int num_sms = 24;
  int num_max_send_tokens = 8;
  int num_max_recv_tokens = 4096;
  int num_send_sms = 0;  ///< 0 = max(1, num_sms / 3), pull_dispatch: max(1, num_sms / 6)
  bool pull_dispatch = false;
  int num_max_rdma_send_tokens = 0;
  int num_max_rdma_recv_tokens = 0;

  Config() = default;
  Config(int sms, int send_tokens, int recv_tokens, int send_sms = 0)
      : num_sms(sms),
        num_max_send_tokens(send_tokens),
        num_max_recv_tokens(recv_tokens),
        num_send_sms(send_sms) {}

  int send_sms() const {
    if (num_send_sms > 0) return num_send_sms;
    const int share = num_sms / (pull_dispatch ? 6 : 3);
    return share >= 1 ? share : 1;
  }
  int recv_sms() const { return num_sms - send_sms(); }

  /// Bytes of NVLink-reachable buffer a rank needs for tokens of
  /// `hidden_bytes` payload (hidden * element size of the widest dtype used)
  /// with up to `num_topk` picks, among `num_ranks` ranks. More than 8 ranks
  /// are nodes of 8 (as DeepEP assumes): the internode ops' worst case for
  /// kInternodeHintTokens tokens per rank (Buffer::get_internode_nvl_size_hint
  /// sizes for other counts and node sizes).
  std::size_t get_nvl_buffer_size_hint(std::size_t hidden_bytes, int num_ranks,
                                       int num_topk = 16) const;
  /// Tokens per rank the hint across nodes is sized for (DeepEP's pretraining batch).
  static constexpr int kInternodeHintTokens = 4096;
  /// Bytes of RDMA buffer (0 for intranode).
  std::size_t get_rdma_buffer_size_hint(std::size_t hidden_bytes, int num_ranks) const;

  /// Throws epx::Error naming the field when a value is out of range.
  void validate(int num_ranks, int device_sm_count) const;
  /// validate's rules for the fields alone (no rank count: across nodes the
  /// count has its own rules).
  void validate_fields(int device_sm_count) const;
  /// The network fields' rules alone (the ops across nodes check these).
  void validate_rdma_fields() const;
};

/// Default configs per rank count (tuned on H200, see docs/benchmarks.md).
Config get_dispatch_config(int num_ranks);
Config get_combine_config(int num_ranks);

}  // namespace epx
