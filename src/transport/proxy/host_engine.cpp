#include "transport/proxy/host_engine.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "epx/error.hpp"
#include "transport/proxy/bounds.hpp"
#include "transport/proxy/command.hpp"

namespace epx::proxy {

// (The group checks num_ranks >= 1 and timeout_s > 0 first.)
HostFabric::HostFabric(int num_ranks, double timeout_s)
    : num_ranks_(num_ranks),
      group_(num_ranks, timeout_s, "host fabric barrier"),
      regions_(static_cast<std::size_t>(num_ranks) * kMaxRegions) {}

HostFabric::Region HostFabric::region(int rank, int id) const {
  require(rank >= 0 && rank < num_ranks_, "rank",
          "must be in [0, " + std::to_string(num_ranks_) + "), got " + std::to_string(rank));
  require(id >= 0 && id < kMaxRegions, "id",
          "must be in [0, " + std::to_string(kMaxRegions) + "), got " + std::to_string(id));
  std::lock_guard lock(m_);
  return regions_[static_cast<std::size_t>(rank) * kMaxRegions + id];
}

void HostFabric::set_region(int rank, int id, Region r) {
  require(rank >= 0 && rank < num_ranks_, "rank",
          "must be in [0, " + std::to_string(num_ranks_) + "), got " + std::to_string(rank));
  require(id >= 0 && id < kMaxRegions, "id",
          "must be in [0, " + std::to_string(kMaxRegions) + "), got " + std::to_string(id));
  std::lock_guard lock(m_);
  regions_[static_cast<std::size_t>(rank) * kMaxRegions + id] = r.base ? r : Region{};
}

void HostFabric::barrier(int rank) {
  group_.barrier(rank);
}

namespace {

class HostEngine final : public Engine {
 public:
  HostEngine(std::shared_ptr<HostFabric> fabric, int rank, int num_ranks, int num_channels)
      : fabric_(std::move(fabric)),
        rank_(rank),
        num_ranks_(num_ranks),
        num_channels_(num_channels) {
    require(fabric_ != nullptr, "fabric", "must not be null");
    require(num_ranks == fabric_->num_ranks(), "num_ranks",
            "must be the fabric's (" + std::to_string(fabric_->num_ranks()) + "), got " +
                std::to_string(num_ranks));
    require(rank >= 0 && rank < num_ranks, "rank",
            "must be in [0, " + std::to_string(num_ranks) + "), got " + std::to_string(rank));
    require(num_channels >= 1, "num_channels", "must be >= 1, got " + std::to_string(num_channels));
    for (auto& t : table_) t.assign(static_cast<std::size_t>(num_ranks), HostFabric::Region{});
    marks_ = std::make_unique<PaddedToken[]>(static_cast<std::size_t>(num_channels));
  }

  const char* name() const override { return "host"; }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  int num_channels() const override { return num_channels_; }

  void register_region(int id, void* base, std::size_t bytes) override {
    check_region_id(id, "register_region");
    check_new_region(id, base, bytes, registered_[id], rank_);
    fabric_->set_region(rank_, id, {base, bytes});
    collective("register_region", id);  // every rank's entry is in the fabric
    auto& t = table_[id];
    for (int r = 0; r < num_ranks_; ++r) t[r] = fabric_->region(r, id);
    for (int r = 0; r < num_ranks_; ++r)
      if (t[r].bytes != bytes)
        throw Error(ErrorCode::kInvalidArgument,
                    "host engine: register_region(" + std::to_string(id) +
                        "): every rank must register the same size: rank " + std::to_string(rank_) +
                        " gives " + std::to_string(bytes) + " bytes, rank " + std::to_string(r) +
                        " " + std::to_string(t[r].bytes));
    registered_[id] = true;
  }

  /// Signals are real atomic adds here: nothing to reset.
  void reset_signals(int /*id*/) override {}

  void deregister_region(int id) override {
    check_region_id(id, "deregister_region");
    require(registered_[id], "deregister_region",
            "region " + std::to_string(id) + " is not registered on rank " + std::to_string(rank_));
    // Every rank is done with the table of the last register_region (a rank
    // that reaches here has read it) before any entry goes away.
    collective("deregister_region", id);
    fabric_->set_region(rank_, id, {});
    registered_[id] = false;
    std::fill(table_[id].begin(), table_[id].end(), HostFabric::Region{});
  }

  bool reaches(int peer) const override { return peer >= 0 && peer < num_ranks_; }
  void* mapped(int id, int peer) const override {
    if (id < 0 || id >= kMaxRegions || !reaches(peer) || !registered_[id]) return nullptr;
    return table_[id][peer].base;
  }

  void check_put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
                 uint64_t bytes) const override {
    check_channel(channel);
    const auto& dst = target(peer, region, "put");
    check_put_range("host", "put", rank_, peer, region, dst_off, src_off, bytes, dst.bytes,
                    table_[region][rank_].bytes);
  }

  void put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
           uint64_t bytes) override {
    check_put(channel, peer, region, dst_off, src_off, bytes);
    const auto& dst = table_[region][peer];
    const auto& src = table_[region][rank_];
    std::memmove(static_cast<char*>(dst.base) + dst_off,
                 static_cast<const char*>(src.base) + src_off, bytes);
  }

  void signal_add(int channel, int peer, int region, uint64_t sig_off, uint64_t add) override {
    check_channel(channel);
    const auto& dst = target(peer, region, "signal_add");
    check_range("host", "signal_add", "signal word", peer, region, sig_off, 8, dst.bytes);
    if (sig_off % 8 != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  "host engine: signal_add to rank " + std::to_string(peer) + " region " +
                      std::to_string(region) + ": sig_off " + std::to_string(sig_off) +
                      " is not 8-byte aligned");
    auto* word = reinterpret_cast<uint64_t*>(static_cast<char*>(dst.base) + sig_off);
    // Release: whoever reads the new value (acquire) sees this channel's earlier puts.
    std::atomic_ref<uint64_t>(*word).fetch_add(add, std::memory_order_release);
  }

  // Synchronous: everything issued before a mark is complete once it is made.
  void mark(int channel, uint64_t token) override {
    check_channel(channel);
    marks_[channel].token = token;
  }
  uint64_t completed(int channel) override {
    check_channel(channel);
    return marks_[channel].token;
  }

 private:
  struct alignas(64) PaddedToken {
    uint64_t token = 0;
  };

  /// The fabric's barrier; a timeout names the call that waited.
  void collective(const char* what, int id) {
    try {
      fabric_->barrier(rank_);
    } catch (const Error& e) {
      throw Error(e.code(), std::string("host engine: ") + what + "(" + std::to_string(id) +
                                ") on rank " + std::to_string(rank_) + ": " + e.what());
    }
  }
  void check_channel(int c) const {
    require(c >= 0 && c < num_channels_, "channel",
            "must be in [0, " + std::to_string(num_channels_) + "), got " + std::to_string(c));
  }
  const HostFabric::Region& target(int peer, int region, const char* what) const {
    if (peer < 0 || peer >= num_ranks_)
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("host engine: ") + what + ": peer " + std::to_string(peer) +
                      " is not a rank (num_ranks " + std::to_string(num_ranks_) + ")");
    if (region < 0 || region >= kMaxRegions || !registered_[region])
      throw Error(ErrorCode::kInvalidArgument, std::string("host engine: ") + what + " to rank " +
                                                   std::to_string(peer) + ": region " +
                                                   std::to_string(region) + " is not registered");
    return table_[region][peer];
  }

  std::shared_ptr<HostFabric> fabric_;
  const int rank_, num_ranks_, num_channels_;
  // Written by the collectives only, while no proxy thread runs; read by all of them.
  std::array<std::vector<HostFabric::Region>, kMaxRegions> table_;
  std::array<bool, kMaxRegions> registered_{};
  std::unique_ptr<PaddedToken[]> marks_;  ///< per channel: the last mark
};

}  // namespace

std::unique_ptr<Engine> make_host_engine(std::shared_ptr<HostFabric> fabric, int rank,
                                         int num_ranks, int num_channels) {
  return std::make_unique<HostEngine>(std::move(fabric), rank, num_ranks, num_channels);
}

}  // namespace epx::proxy
