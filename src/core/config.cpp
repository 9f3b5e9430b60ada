#include "epx/config.hpp"

#include <atomic>
#include <string>

#include "common/env.hpp"
#include "common/plan.hpp"
#include "epx/buffer.hpp"
#include "epx/error.hpp"

namespace epx {

namespace detail {
std::atomic<int>& default_num_sms() {
  static std::atomic<int> n{24};
  return n;
}
}  // namespace detail

std::size_t Config::get_nvl_buffer_size_hint(std::size_t hidden_bytes, int num_ranks,
                                             int num_topk) const {
  if (num_ranks > plan::kHtMaxRanks) {
    // More ranks than one NVLink domain holds: nodes of 8, as DeepEP assumes
    // there. The internode kernels' areas are sized for the whole call; this
    // is their worst case for kInternodeHintTokens tokens per rank (a larger
    // call raises kBufferTooSmall naming num_nvl_bytes).
    validate_fields(0);
    require(num_ranks % kMaxRanksPerNode == 0 && num_ranks <= kMaxRanks, "num_ranks",
            "across nodes must be a multiple of " + std::to_string(kMaxRanksPerNode) +
                " (nodes of 8) up to " + std::to_string(kMaxRanks) + ", got " +
                std::to_string(num_ranks));
    require(hidden_bytes > 0 && hidden_bytes <= (std::size_t{1} << 30), "hidden_bytes",
            "across nodes must be in [1, 2^30], got " + std::to_string(hidden_bytes));
    require(num_topk >= 1 && num_topk <= 16, "num_topk",
            "must be in [1, 16], got " + std::to_string(num_topk));
    const int hidden = static_cast<int>(plan::align_up((hidden_bytes + 1) / 2, 8));
    return Buffer::get_internode_nvl_size_hint(kInternodeHintTokens, hidden, num_ranks,
                                               kMaxRanksPerNode, num_topk);
  }
  validate(num_ranks, 0);  // a size for a config no op accepts would mislead
  require(hidden_bytes > 0 && hidden_bytes <= (std::size_t{1} << 32), "hidden_bytes",
          "must be in [1, 2^32], got " + std::to_string(hidden_bytes));
  require(num_topk >= 1 && num_topk <= 16, "num_topk",
          "must be in [1, 16], got " + std::to_string(num_topk));
  // Dispatch rows are the larger of the two (they carry ids and FP8 scales);
  // the layout holds up to 1024 experts' counts.
  plan::HtRegion r;
  r.num_ranks = num_ranks;
  r.num_experts = num_ranks;
  r.capacity = num_max_recv_tokens;
  r.chunk = num_max_send_tokens;
  const std::size_t scales = hidden_bytes / 128 + 1;
  r.row_bytes = plan::ht_dispatch_row_bytes(hidden_bytes, static_cast<int>(scales), num_topk);
  return plan::align_up(r.total_bytes(), plan::kAlign);
}

std::size_t Config::get_rdma_buffer_size_hint(std::size_t, int) const {
  return 0;
}

void Config::validate(int num_ranks, int device_sm_count) const {
  validate_fields(device_sm_count);
  require(num_ranks >= 1 && num_ranks <= plan::kHtMaxRanks, "num_ranks",
          "must be in [1, 8] for the NVLink backend, got " + std::to_string(num_ranks));
}

void Config::validate_fields(int device_sm_count) const {
  require(num_sms >= 2, "config.num_sms",
          "must be >= 2 (one send and one receive SM), got " + std::to_string(num_sms));
  require(device_sm_count <= 0 || num_sms <= device_sm_count, "config.num_sms",
          "must not exceed the " + std::to_string(device_sm_count) +
              " SMs this rank may use (the GPU's, split among in-process ranks sharing it), "
              "got " +
              std::to_string(num_sms));
  require(num_send_sms >= 0 && send_sms() >= 1 && recv_sms() >= 1, "config.num_send_sms",
          "must leave at least one receive SM (0 < num_send_sms < num_sms), got " +
              std::to_string(num_send_sms));
  require(num_max_send_tokens >= 1 && num_max_send_tokens <= 1024, "config.num_max_send_tokens",
          "must be in [1, 1024], got " + std::to_string(num_max_send_tokens));
  require(num_max_recv_tokens >= num_max_send_tokens, "config.num_max_recv_tokens",
          "must be >= num_max_send_tokens (" + std::to_string(num_max_send_tokens) + "), got " +
              std::to_string(num_max_recv_tokens));
  validate_rdma_fields();
}

void Config::validate_rdma_fields() const {
  // Each alone; their relation (a put no larger than the ring) is the ring
  // geometry's rule, checked where the rings are made, since 0 stands for a
  // size the config does not know.
  constexpr int kMaxRing = 1 << 20;
  require(num_max_rdma_recv_tokens >= 0 && num_max_rdma_recv_tokens <= kMaxRing,
          "config.num_max_rdma_recv_tokens",
          "must be 0 (EPX's ring size) or in [1, 2^20], got " +
              std::to_string(num_max_rdma_recv_tokens));
  require(num_max_rdma_send_tokens >= 0 && num_max_rdma_send_tokens <= kMaxRing,
          "config.num_max_rdma_send_tokens",
          "must be 0 (EPX's put size) or in [1, 2^20], got " +
              std::to_string(num_max_rdma_send_tokens));
}

// Chunk sizes from epx-bench's sweep at 24 SMs (8 sending): EP2 (nvidia-h200-x2,
// 2026-11-24) chunk 4: dispatch 244 us, combine 298 us, against 264 / 362 us at
// chunk 16 (finer chunks spread the receivers' items more evenly); EP4 and EP8
// chunk 8.
//
// Ring rows per peer: 4096 up to EP4, so the standard 4096-token call never
// laps (EP4: 183 MB per rank against DeepEP's 201 MB hint). At EP8 4096 rows
// would take 427 MB (DeepEP: 403 MB); 3584 rows take 375 MB and still hold a
// pair's share of that call (about 2/3 of 4096 tokens at top-8 of 256
// experts), so it does not lap there either. Larger calls lap.
namespace {
int default_ring_rows(int num_ranks) {
  return num_ranks <= 4 ? 4096 : 3584;
}
}  // namespace

Config get_dispatch_config(int num_ranks) {
  Config c;
  c.num_sms = detail::default_num_sms().load();
  c.num_max_send_tokens = num_ranks <= 2 ? 4 : 8;
  c.num_max_recv_tokens = default_ring_rows(num_ranks);
  c.pull_dispatch = env::ht_pull();
  return c;
}

Config get_combine_config(int num_ranks) {
  Config c;
  c.num_sms = detail::default_num_sms().load();
  c.num_max_send_tokens = num_ranks <= 2 ? 4 : 8;
  c.num_max_recv_tokens = default_ring_rows(num_ranks);
  return c;
}

}  // namespace epx
