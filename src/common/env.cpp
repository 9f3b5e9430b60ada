#include "common/env.hpp"

#include <cerrno>
#include <cstdlib>
#include <string>

#include "epx/error.hpp"

namespace epx::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<long> get_int(const char* name) {
  auto v = get(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v->c_str(), &end, 10);
  if (errno != 0 || end == v->c_str() || *end != '\0')
    throw Error(ErrorCode::kInvalidArgument,
                std::string(name) + ": must be an integer, got '" + *v + "'");
  return x;
}

std::optional<int64_t> get_int_in(const char* name, int64_t lo, int64_t hi) {
  const auto v = get_int(name);
  if (v && (*v < lo || *v > hi))
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": must be in [" +
                                                 std::to_string(lo) + ", " + std::to_string(hi) +
                                                 "], got " + std::to_string(*v));
  return v;
}

std::optional<double> get_double(const char* name) {
  auto v = get(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(v->c_str(), &end);
  if (errno != 0 || end == v->c_str() || *end != '\0')
    throw Error(ErrorCode::kInvalidArgument,
                std::string(name) + ": must be a number, got '" + *v + "'");
  return x;
}

std::optional<uint32_t> debug_epoch_start() {
  static constexpr const char* name = "EPX_DEBUG_EPOCH_START";
  const auto v = get_int(name);
  if (!v) return std::nullopt;
  if (*v < 0 || *v > 0xffffffffL)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(name) + ": must be in [0, 4294967295], got " + std::to_string(*v));
  return static_cast<uint32_t>(*v);
}

namespace {
/// Decimal integers in [0, 2^31) separated by single colons, exactly `n` of
/// them and nothing else; false when `v` is anything else.
bool colon_ints(const std::string& v, int* out, int n) {
  std::size_t at = 0;
  for (int i = 0; i < n; ++i) {
    const std::size_t end = i + 1 < n ? v.find(':', at) : v.size();
    if (end == std::string::npos) return false;
    const std::string s = v.substr(at, end - at);
    if (s.empty() || s.size() > 10 || s.find_first_not_of("0123456789") != std::string::npos)
      return false;
    const long x = std::strtol(s.c_str(), nullptr, 10);
    if (x > 0x7fffffffL) return false;
    out[i] = static_cast<int>(x);
    at = end + 1;
  }
  return true;
}
}  // namespace

std::optional<LlDispatchStop> debug_ll_dispatch_stop() {
  static constexpr const char* name = "EPX_DEBUG_LL_DISPATCH_STOP";
  const auto v = get(name);
  if (!v) return std::nullopt;
  int f[2];
  require(colon_ints(*v, f, 2), name, "must be RANK:TOKENS, two integers >= 0, got '" + *v + "'");
  return LlDispatchStop{f[0], f[1]};
}

std::optional<ProxyStop> debug_proxy_stop() {
  static constexpr const char* name = "EPX_DEBUG_PROXY_STOP";
  const auto v = get(name);
  if (!v) return std::nullopt;
  int f[3];
  require(colon_ints(*v, f, 3), name,
          "must be RANK:CHANNEL:COMMANDS, three integers >= 0, got '" + *v + "'");
  return ProxyStop{f[0], f[1], f[2]};
}

namespace {
/// A switch variable: 0 is off, 1 is on, unset is `unset`, anything else an
/// error naming it.
bool zero_or_one(const char* name, bool unset = false) {
  const auto v = get(name);
  if (!v) return unset;
  require(*v == "0" || *v == "1", name, "must be 0 or 1, got '" + *v + "'");
  return *v == "1";
}

constexpr int64_t kIntMax = 0x7fffffff;
}  // namespace

bool ht_pull() {
  return zero_or_one("EPX_HT_PULL");
}

std::optional<bool> net_split_puts() {
  if (!get("EPX_NET_SPLIT_PUTS")) return std::nullopt;
  return zero_or_one("EPX_NET_SPLIT_PUTS");
}

bool proxy_row_copies() {
  return zero_or_one("EPX_PROXY_ROW_COPIES");
}

std::optional<bool> proxy_cumem() {
  if (!get("EPX_PROXY_CUMEM")) return std::nullopt;
  return zero_or_one("EPX_PROXY_CUMEM");
}

int ht_rings() {
  const auto v = get_int("EPX_HT_RINGS");
  if (!v) return -1;
  require(*v >= 0 && *v <= (1 << 20), "EPX_HT_RINGS",
          "must be 0 (never), 1 (always, default ring sizes) or ring records in [2, 2^20] "
          "(always), or unset (the rings where the whole-call areas do not fit), got " +
              std::to_string(*v));
  return static_cast<int>(*v);
}

int ranks_per_node() {
  return static_cast<int>(get_int_in("EPX_RANKS_PER_NODE", 0, kIntMax).value_or(0));
}

int gin_contexts(int max_contexts) {
  return static_cast<int>(get_int_in("EPX_GIN_CONTEXTS", 1, max_contexts).value_or(4));
}

int proxy_channels(int max_channels) {
  return static_cast<int>(get_int_in("EPX_PROXY_CHANNELS", 1, max_channels).value_or(4));
}

std::optional<uint32_t> proxy_ring() {
  const auto v = get_int_in("EPX_PROXY_RING", 16, int64_t{1} << 22);
  if (!v) return std::nullopt;
  return static_cast<uint32_t>(*v);
}

ProxyDebug debug_proxy() {
  const auto v = get("EPX_DEBUG_PROXY");
  if (!v || *v == "0") return ProxyDebug::kOff;
  if (*v == "1") return ProxyDebug::kTrace;
  if (*v == "stats") return ProxyDebug::kStats;
  throw Error(ErrorCode::kInvalidArgument,
              "EPX_DEBUG_PROXY: must be 0, 1 (every command) or stats, got '" + *v + "'");
}

std::string proxy_engine() {
  const std::string v = get("EPX_PROXY_ENGINE").value_or("auto");
  require(v == "auto" || v == "cuda_ipc" || v == "libfabric", "EPX_PROXY_ENGINE",
          "must be auto, cuda_ipc or libfabric, got '" + v + "'");
  return v;
}

std::string fabric_provider() {
  return get("EPX_FABRIC_PROVIDER").value_or("tcp;ofi_rxm");
}

std::string fabric_domains() {
  return get("EPX_FABRIC_DOMAINS").value_or("");
}

bool nvshmem_trace() {
  return zero_or_one("EPX_NVSHMEM_TRACE");
}

bool ring_trace() {
  return zero_or_one("EPX_RING_TRACE");
}

bool ll_context_ranges() {
  return zero_or_one("EPX_LL_CONTEXT_RANGES");
}

bool ll_arrival_order() {
  return zero_or_one("EPX_LL_ARRIVAL_ORDER");
}

double timeout_seconds() {
  auto t = get_double("EPX_TIMEOUT_S");
  if (!t) return 60.0;
  require(*t > 0, "EPX_TIMEOUT_S", "must be > 0 seconds, got " + std::to_string(*t));
  return *t;
}

std::optional<int> ll_sms() {
  const auto v = get_int("EPX_LL_SMS");
  if (!v) return std::nullopt;
  require(*v >= 1 && *v <= 1 << 20, "EPX_LL_SMS", "must be >= 1, got " + std::to_string(*v));
  return static_cast<int>(*v);
}

std::optional<int> max_ops_in_flight() {
  const auto v = get_int_in("EPX_MAX_OPS_IN_FLIGHT", 0, int64_t{1} << 20);
  if (!v) return std::nullopt;
  return static_cast<int>(*v);
}

RankInfo rank_info() {
  // Each value is range-checked as read (before it is narrowed to int).
  const auto in = [](const char* name, int64_t lo, int64_t hi) {
    return static_cast<int>(*get_int_in(name, lo, hi));
  };
  const auto in_or = [](const char* name, int64_t lo, int64_t hi, int unset) {
    return static_cast<int>(get_int_in(name, lo, hi).value_or(unset));
  };
  RankInfo info;
  const char *rank_var = nullptr, *size_var = nullptr;
  if (get("RANK") && get("WORLD_SIZE")) {
    info.launcher = "torchrun";
    info.world_size = in("WORLD_SIZE", 1, kIntMax);
    rank_var = "RANK";
    size_var = "WORLD_SIZE";
    info.local_rank = in_or("LOCAL_RANK", 0, kIntMax, -1);
  } else if (get("OMPI_COMM_WORLD_RANK")) {
    info.launcher = "mpirun";
    info.world_size = in_or("OMPI_COMM_WORLD_SIZE", 1, kIntMax, 1);
    rank_var = "OMPI_COMM_WORLD_RANK";
    size_var = "OMPI_COMM_WORLD_SIZE";
    info.local_rank = in_or("OMPI_COMM_WORLD_LOCAL_RANK", 0, kIntMax, -1);
  }
  if (rank_var) {
    const auto r = *get_int(rank_var);
    require(r >= 0 && r < info.world_size, rank_var,
            "must be in [0, " + std::string(size_var) + "=" + std::to_string(info.world_size) +
                "), got " + std::to_string(r));
    info.rank = static_cast<int>(r);
    if (info.local_rank < 0) info.local_rank = info.rank;
  }
  info.master_addr = get("MASTER_ADDR").value_or("127.0.0.1");
  // NCCL's bootstrap takes MASTER_PORT + 1 (Communicator::from_env).
  info.master_port = in_or("MASTER_PORT", 1, 65534, 29500);
  return info;
}

}  // namespace epx::env
