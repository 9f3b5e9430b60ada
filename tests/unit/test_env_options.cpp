// The environment variables and BufferOptions fields EPX reads: each unset takes its
// default, a bad value is an error naming the variable (or field) and the rule, and a
// field wins over its variable. No GPU needed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "common/env.hpp"
#include "common/internode_rings.hpp"
#include "core/algorithm_choices.hpp"
#include "epx/buffer.hpp"
#include "expect_error.hpp"
#include "transport/proxy/engine.hpp"

namespace epx {
namespace {

using test::expect_error;

/// Puts an environment variable back as it was when the scope ends.
class SavedEnv {
 public:
  explicit SavedEnv(const char* name) : name_(name) {
    const char* v = std::getenv(name);
    had_ = v != nullptr;
    if (had_) value_ = v;
  }
  ~SavedEnv() {
    if (had_)
      setenv(name_, value_.c_str(), 1);
    else
      unsetenv(name_);
  }
  SavedEnv(const SavedEnv&) = delete;
  SavedEnv& operator=(const SavedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string value_;
};

TEST(Env, HtPullSetsTheDispatchConfigs) {
  unsetenv("EPX_HT_PULL");
  EXPECT_FALSE(get_dispatch_config(4).pull_dispatch);
  setenv("EPX_HT_PULL", "1", 1);
  EXPECT_TRUE(get_dispatch_config(4).pull_dispatch);
  EXPECT_FALSE(get_combine_config(4).pull_dispatch);
  setenv("EPX_HT_PULL", "2", 1);
  expect_error([] { get_dispatch_config(4); }, {"EPX_HT_PULL", "0 or 1"});
  unsetenv("EPX_HT_PULL");
}

/// A 0-or-1 switch `name` read by `get`: unset and "0" are off, "1" on;
/// another number or a word is an error naming the variable and the rule.
void expect_zero_or_one_switch(const char* name, bool (*get)(), bool unset = false) {
  SCOPED_TRACE(name);
  const SavedEnv saved(name);
  unsetenv(name);
  EXPECT_EQ(get(), unset);
  setenv(name, "1", 1);
  EXPECT_TRUE(get());
  setenv(name, "0", 1);
  EXPECT_FALSE(get());
  setenv(name, "2", 1);
  expect_error([&] { get(); }, {name, "0 or 1"});
  setenv(name, "rows", 1);
  expect_error([&] { get(); }, {name, "0 or 1", "'rows'"});
  setenv(name, "01", 1);
  expect_error([&] { get(); }, {name, "0 or 1"});
}

TEST(Env, NvshmemTraceIsZeroOrOne) {
  expect_zero_or_one_switch("EPX_NVSHMEM_TRACE", env::nvshmem_trace);
}

TEST(Env, FabricDomainsIsTheListAsGivenAndUnsetIsEmpty) {
  // Empty means the provider's first domain; the engine parses the list.
  const SavedEnv saved("EPX_FABRIC_DOMAINS");
  unsetenv("EPX_FABRIC_DOMAINS");
  EXPECT_EQ(env::fabric_domains(), "");
  setenv("EPX_FABRIC_DOMAINS", "mlx5_0,mlx5_1", 1);
  EXPECT_EQ(env::fabric_domains(), "mlx5_0,mlx5_1");
}

TEST(Env, SwitchesUnsetTakeTheirDefaults) {
  // Unset switches are read during Buffer creation: their default, with no
  // value looked at (an empty optional dereferenced aborts under
  // _GLIBCXX_ASSERTIONS, which CI builds with).
  for (const char* name :
       {"EPX_HT_PULL", "EPX_PROXY_ROW_COPIES", "EPX_PROXY_CUMEM", "EPX_LL_CONTEXT_RANGES",
        "EPX_LL_ARRIVAL_ORDER", "EPX_NET_SPLIT_PUTS", "EPX_NVSHMEM_TRACE", "EPX_DEBUG_PROXY"})
    unsetenv(name);
  EXPECT_FALSE(env::ht_pull());
  EXPECT_FALSE(env::proxy_row_copies());
  EXPECT_FALSE(env::proxy_cumem().has_value());
  EXPECT_FALSE(env::ll_context_ranges());
  EXPECT_FALSE(env::ll_arrival_order());
  EXPECT_FALSE(env::net_split_puts().has_value());
  EXPECT_FALSE(env::nvshmem_trace());
  EXPECT_EQ(env::debug_proxy(), env::ProxyDebug::kOff);
}

/// An integer variable read by `get` takes `good`, and refuses each of `bad`
/// (out of its range, or past 32 bits, where narrowing would have wrapped it
/// into range) naming the variable.
template <class Get>
void expect_ranged(const char* name, Get get, const char* good,
                   std::initializer_list<const char*> bad) {
  SCOPED_TRACE(name);
  const SavedEnv saved(name);
  setenv(name, good, 1);
  EXPECT_NO_THROW(get());
  for (const char* b : bad) {
    setenv(name, b, 1);
    expect_error([&] { get(); }, {name, "must be"});
  }
}

TEST(Env, IntegerVariablesAreRangeCheckedBeforeNarrowing) {
  expect_ranged("EPX_RANKS_PER_NODE", env::ranks_per_node, "4",
                {"-1", "4294967298", "x", "9223372036854775808"});
  expect_ranged("EPX_PROXY_CHANNELS", [] { return env::proxy_channels(16); }, "16",
                {"0", "17", "4294967297"});
  expect_ranged("EPX_GIN_CONTEXTS", [] { return env::gin_contexts(16); }, "8",
                {"0", "17", "4294967297"});
  expect_ranged("EPX_PROXY_RING", env::proxy_ring, "64", {"15", "4194305", "4294967312"});
  expect_ranged("EPX_DEBUG_PROXY", env::debug_proxy, "stats", {"2", "yes"});
  {
    const SavedEnv r("RANK"), w("WORLD_SIZE"), l("LOCAL_RANK"), m("MASTER_PORT");
    setenv("WORLD_SIZE", "4", 1);
    unsetenv("LOCAL_RANK");
    unsetenv("MASTER_PORT");
    setenv("RANK", "4294967296", 1);  // 2^32: was narrowed to rank 0
    expect_error([] { env::rank_info(); }, {"RANK", "[0, WORLD_SIZE=4)", "4294967296"});
    setenv("RANK", "1", 1);
    EXPECT_EQ(env::rank_info().rank, 1);
    EXPECT_EQ(env::rank_info().local_rank, 1);  // LOCAL_RANK unset: the rank
    EXPECT_EQ(env::rank_info().master_port, 29500);
    setenv("WORLD_SIZE", "4294967297", 1);  // 2^32 + 1: was narrowed to 1
    expect_error([] { env::rank_info(); }, {"WORLD_SIZE", "must be in"});
    setenv("WORLD_SIZE", "4", 1);
    setenv("LOCAL_RANK", "4294967296", 1);
    expect_error([] { env::rank_info(); }, {"LOCAL_RANK", "must be in"});
    unsetenv("LOCAL_RANK");
    setenv("MASTER_PORT", "4294996796", 1);  // 2^32 + 29500: was narrowed to 29500
    expect_error([] { env::rank_info(); }, {"MASTER_PORT", "[1, 65534]"});
    setenv("MASTER_PORT", "65535", 1);  // NCCL's bootstrap takes port + 1
    expect_error([] { env::rank_info(); }, {"MASTER_PORT", "[1, 65534]"});
  }
}

TEST(Env, LlArrivalOrderIsZeroOrOne) {
  expect_zero_or_one_switch("EPX_LL_ARRIVAL_ORDER", env::ll_arrival_order);
}

TEST(Env, LlContextRangesIsZeroOrOne) {
  expect_zero_or_one_switch("EPX_LL_CONTEXT_RANGES", env::ll_context_ranges);
}

TEST(Env, HtRingsIsAutoOffOneOrARingSize) {
  const SavedEnv saved("EPX_HT_RINGS");
  unsetenv("EPX_HT_RINGS");
  EXPECT_EQ(env::ht_rings(), -1);  // the rings where the whole-call areas do not fit
  setenv("EPX_HT_RINGS", "0", 1);
  EXPECT_EQ(env::ht_rings(), 0);
  setenv("EPX_HT_RINGS", "1", 1);
  EXPECT_EQ(env::ht_rings(), 1);
  setenv("EPX_HT_RINGS", "4", 1);
  EXPECT_EQ(env::ht_rings(), 4);
  setenv("EPX_HT_RINGS", "-1", 1);
  expect_error([] { env::ht_rings(); }, {"EPX_HT_RINGS", "ring records"});
  setenv("EPX_HT_RINGS", "rings", 1);
  expect_error([] { env::ht_rings(); }, {"EPX_HT_RINGS", "integer"});
}

TEST(Env, ProxyRowCopiesIsZeroOrOne) {
  expect_zero_or_one_switch("EPX_PROXY_ROW_COPIES", env::proxy_row_copies);
}

/// Unless the rings are off (EPX_HT_RINGS=0), the internode size hint also
/// holds the rings (of the default config's channels: a channel per three
/// SMs) and their state block: a buffer of the hint's size takes them; with
/// them off the hint is the whole-call worst case alone.
TEST(Env, InternodeSizeHintHoldsTheRings) {
  const SavedEnv saved("EPX_HT_RINGS");
  const int R = 4, L = 2, H = 7168, K = 8, T = 128;
  setenv("EPX_HT_RINGS", "0", 1);
  const std::size_t off = Buffer::get_internode_nvl_size_hint(T, H, R, L, K);
  const std::size_t record = epx::plan::ht_net_record_bytes(2 * H, 0, K, L);
  for (const int records : {-1, 1, 4}) {  // -1: unset, the default
    if (records < 0)
      unsetenv("EPX_HT_RINGS");
    else
      setenv("EPX_HT_RINGS", std::to_string(records).c_str(), 1);
    const std::size_t on = Buffer::get_internode_nvl_size_hint(T, H, R, L, K);
    EXPECT_GT(on, off) << records;
    epx::plan::HtRingGeometry g;  // 1: the default sizes
    g.channels = (epx::get_dispatch_config(R).num_sms) / 3;
    if (records > 1) {
      g.net_slots = g.nvl_slots = records;
      g.net_chunk = std::min(g.net_chunk, records);
      g.nvl_chunk = std::min(g.nvl_chunk, records);
    }
    EXPECT_NO_THROW(epx::plan::HtRingRegion::make(epx::Topology{R, L}, g, record,
                                                  epx::plan::HtNetRegion::body(R), on))
        << "EPX_HT_RINGS=" << records << ": " << on << " bytes";
  }
}

TEST(Env, ProxyCumemIsUnsetZeroOrOne) {
  // unset: no value (proxy::cumem_regions picks the default); else a 0/1 switch
  expect_zero_or_one_switch("EPX_PROXY_CUMEM", [] { return env::proxy_cumem().value_or(false); });
  const SavedEnv saved("EPX_PROXY_CUMEM");
  unsetenv("EPX_PROXY_CUMEM");
  EXPECT_FALSE(env::proxy_cumem().has_value());
}

TEST(Env, NetSplitPutsIsUnsetZeroOrOne) {
  const SavedEnv saved("EPX_NET_SPLIT_PUTS");
  unsetenv("EPX_NET_SPLIT_PUTS");
  EXPECT_FALSE(env::net_split_puts().has_value());
  setenv("EPX_NET_SPLIT_PUTS", "1", 1);
  EXPECT_EQ(env::net_split_puts(), std::optional<bool>(true));
  setenv("EPX_NET_SPLIT_PUTS", "0", 1);
  EXPECT_EQ(env::net_split_puts(), std::optional<bool>(false));
  setenv("EPX_NET_SPLIT_PUTS", "yes", 1);
  expect_error([] { env::net_split_puts(); }, {"EPX_NET_SPLIT_PUTS"});
  setenv("EPX_NET_SPLIT_PUTS", "3", 1);
  expect_error([] { env::net_split_puts(); }, {"EPX_NET_SPLIT_PUTS", "0 or 1"});
}

TEST(Env, LlSmsIsAPositiveCount) {
  const SavedEnv saved("EPX_LL_SMS");
  unsetenv("EPX_LL_SMS");
  EXPECT_FALSE(env::ll_sms().has_value());
  setenv("EPX_LL_SMS", "100", 1);
  EXPECT_EQ(env::ll_sms(), 100);
  setenv("EPX_LL_SMS", "0", 1);
  expect_error([] { env::ll_sms(); }, {"EPX_LL_SMS", ">= 1"});
  setenv("EPX_LL_SMS", "many", 1);
  expect_error([] { env::ll_sms(); }, {"EPX_LL_SMS"});
}

TEST(Env, MaxOpsInFlightIsACountOrZero) {
  const SavedEnv saved("EPX_MAX_OPS_IN_FLIGHT");
  unsetenv("EPX_MAX_OPS_IN_FLIGHT");
  EXPECT_FALSE(env::max_ops_in_flight().has_value());
  setenv("EPX_MAX_OPS_IN_FLIGHT", "0", 1);
  EXPECT_EQ(env::max_ops_in_flight(), 0);
  setenv("EPX_MAX_OPS_IN_FLIGHT", "16", 1);
  EXPECT_EQ(env::max_ops_in_flight(), 16);
  for (const char* bad : {"-1", "2000000", "some"}) {
    setenv("EPX_MAX_OPS_IN_FLIGHT", bad, 1);
    expect_error([] { env::max_ops_in_flight(); }, {"EPX_MAX_OPS_IN_FLIGHT"});
  }
  setenv("EPX_MAX_OPS_IN_FLIGHT", "-1", 1);
  expect_error([] { env::max_ops_in_flight(); }, {"EPX_MAX_OPS_IN_FLIGHT", "[0, 1048576]", "-1"});
}

/// The options a Buffer could be made from: the rules of every field, each
/// error naming the field and its rule.
TEST(BufferOptions, ValidateNamesTheFieldAndTheRule) {
  BufferOptions ok;
  ok.num_rdma_bytes = 1;
  EXPECT_NO_THROW(ok.validate());  // every algorithm choice unset
  auto with = [&](auto set) {
    BufferOptions o = ok;
    set(o);
    return o;
  };
  expect_error([&] { with([](BufferOptions& o) { o.num_rdma_bytes = -1; }).validate(); },
               {"num_rdma_bytes", ">= 0", "-1"});
  expect_error([&] { with([](BufferOptions& o) { o.num_rdma_bytes = 0; }).validate(); },
               {"num_nvl_bytes", "must be > 0"});
  expect_error([&] { with([](BufferOptions& o) { o.num_qps_per_rank = 0; }).validate(); },
               {"num_qps_per_rank", ">= 1"});
  for (const int bad : {-2, (1 << 20) + 1})
    expect_error([&] { with([&](BufferOptions& o) { o.ht_rings = bad; }).validate(); },
                 {"ht_rings", "ring records in [2, 2^20]", std::to_string(bad).c_str()});
  for (const int good : {-1, 0, 1, 2, 1 << 20})
    EXPECT_NO_THROW(with([&](BufferOptions& o) { o.ht_rings = good; }).validate()) << good;
  for (const int bad : {0, -3, (1 << 20) + 1})
    expect_error([&] { with([&](BufferOptions& o) { o.ll_sms = bad; }).validate(); },
                 {"ll_sms", "must be in [1, 2^20]", std::to_string(bad).c_str()});
  EXPECT_NO_THROW(with([](BufferOptions& o) { o.ll_sms = 1; }).validate());
  for (const int bad : {-1, (1 << 20) + 1})
    expect_error([&] { with([&](BufferOptions& o) { o.max_ops_in_flight = bad; }).validate(); },
                 {"max_ops_in_flight", "[0, 2^20]", std::to_string(bad).c_str()});
  for (const int good : {0, 1, 1 << 20})
    EXPECT_NO_THROW(with([&](BufferOptions& o) { o.max_ops_in_flight = good; }).validate());
}

/// A field set wins over its variable, which is then not even read (a
/// malformed one does not refuse the buffer); a field unset takes the
/// variable, and with both unset the built-in default.
TEST(BufferOptions, AlgorithmFieldsWinOverTheirVariables) {
  const char* names[] = {"EPX_HT_RINGS",          "EPX_NET_SPLIT_PUTS", "EPX_LL_ARRIVAL_ORDER",
                         "EPX_LL_CONTEXT_RANGES", "EPX_LL_SMS",         "EPX_MAX_OPS_IN_FLIGHT"};
  const SavedEnv s0(names[0]), s1(names[1]), s2(names[2]), s3(names[3]), s4(names[4]), s5(names[5]);
  for (const char* n : names) unsetenv(n);
  BufferOptions o;
  AlgorithmChoices c = resolve_algorithm_choices(o);
  EXPECT_EQ(c.ht_rings, -1);
  EXPECT_FALSE(c.net_split_puts.has_value());
  EXPECT_FALSE(c.ll_arrival_order);
  EXPECT_FALSE(c.ll_context_ranges);
  EXPECT_FALSE(c.ll_sms.has_value());
  EXPECT_FALSE(c.max_ops_in_flight.has_value());

  setenv("EPX_HT_RINGS", "0", 1);
  setenv("EPX_NET_SPLIT_PUTS", "1", 1);
  setenv("EPX_LL_ARRIVAL_ORDER", "1", 1);
  setenv("EPX_LL_CONTEXT_RANGES", "1", 1);
  setenv("EPX_LL_SMS", "7", 1);
  setenv("EPX_MAX_OPS_IN_FLIGHT", "5", 1);
  c = resolve_algorithm_choices(o);  // unset fields: the variables
  EXPECT_EQ(c.ht_rings, 0);
  EXPECT_EQ(c.net_split_puts, std::optional<bool>(true));
  EXPECT_TRUE(c.ll_arrival_order);
  EXPECT_TRUE(c.ll_context_ranges);
  EXPECT_EQ(c.ll_sms, std::optional<int>(7));
  EXPECT_EQ(c.max_ops_in_flight, std::optional<int>(5));

  o.ht_rings = 64;
  o.net_split_puts = false;
  o.ll_arrival_order = false;
  o.ll_context_ranges = false;
  o.ll_sms = 3;
  o.max_ops_in_flight = 0;
  c = resolve_algorithm_choices(o);
  EXPECT_EQ(c.ht_rings, 64);
  EXPECT_EQ(c.net_split_puts, std::optional<bool>(false));
  EXPECT_FALSE(c.ll_arrival_order);
  EXPECT_FALSE(c.ll_context_ranges);
  EXPECT_EQ(c.ll_sms, std::optional<int>(3));
  EXPECT_EQ(c.max_ops_in_flight, std::optional<int>(0));

  for (const char* n : names) setenv(n, "bad", 1);
  EXPECT_NO_THROW(resolve_algorithm_choices(o));  // every field set: no variable read
  o.ll_sms.reset();
  expect_error([&] { resolve_algorithm_choices(o); }, {"EPX_LL_SMS"});
  o.ll_sms = 3;
  o.max_ops_in_flight.reset();
  expect_error([&] { resolve_algorithm_choices(o); }, {"EPX_MAX_OPS_IN_FLIGHT"});
}

TEST(BufferOptions, ProxyCumemFieldWinsOverItsVariable) {
  const SavedEnv saved("EPX_PROXY_CUMEM");
  unsetenv("EPX_PROXY_CUMEM");
  // the defaults: a process per rank, and in-process ranks by how many share the device
  EXPECT_TRUE(proxy::cumem_regions(std::nullopt, 1));
  EXPECT_FALSE(proxy::cumem_regions(std::nullopt, 2));
  EXPECT_FALSE(proxy::cumem_regions(std::nullopt, proxy::kSharedContextRanks));
  EXPECT_TRUE(proxy::cumem_regions(std::nullopt, proxy::kSharedContextRanks + 1));
  EXPECT_TRUE(proxy::cumem_regions(std::nullopt, 16));
  setenv("EPX_PROXY_CUMEM", "0", 1);
  EXPECT_FALSE(proxy::cumem_regions(std::nullopt, 1));
  EXPECT_FALSE(proxy::cumem_regions(std::nullopt, 16));
  EXPECT_TRUE(proxy::cumem_regions(true, 4));
  setenv("EPX_PROXY_CUMEM", "1", 1);
  EXPECT_TRUE(proxy::cumem_regions(std::nullopt, 4));
  setenv("EPX_PROXY_CUMEM", "bad", 1);
  EXPECT_FALSE(proxy::cumem_regions(false, 16));  // set: the variable is not read
  expect_error([] { proxy::cumem_regions(std::nullopt, 1); }, {"EPX_PROXY_CUMEM", "0 or 1"});
}

/// The size hint's ht_rings is the buffer's field: set, it decides over
/// EPX_HT_RINGS; a bad one is refused naming it.
TEST(BufferOptions, InternodeSizeHintTakesTheRingsField) {
  const SavedEnv saved("EPX_HT_RINGS");
  const int R = 4, L = 2, H = 7168, K = 8, T = 128;
  setenv("EPX_HT_RINGS", "0", 1);
  const std::size_t off = Buffer::get_internode_nvl_size_hint(T, H, R, L, K);
  unsetenv("EPX_HT_RINGS");
  const std::size_t automatic = Buffer::get_internode_nvl_size_hint(T, H, R, L, K);
  EXPECT_GT(automatic, off);
  EXPECT_EQ(Buffer::get_internode_nvl_size_hint(T, H, R, L, K, 0), off);
  EXPECT_EQ(Buffer::get_internode_nvl_size_hint(T, H, R, L, K, -1), automatic);
  setenv("EPX_HT_RINGS", "0", 1);
  EXPECT_EQ(Buffer::get_internode_nvl_size_hint(T, H, R, L, K, -1), automatic);
  expect_error([&] { Buffer::get_internode_nvl_size_hint(T, H, R, L, K, -2); },
               {"ht_rings", "ring records"});
}

TEST(Env, RankInfoFromTorchrunAndMpi) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "3", 1);
  setenv("MASTER_PORT", "29500", 1);
  auto i = env::rank_info();
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_STREQ(i.launcher, "torchrun");
  setenv("RANK", "4", 1);
  expect_error([] { env::rank_info(); }, {"RANK", "[0, WORLD_SIZE=4)"});
  setenv("RANK", "x", 1);
  expect_error([] { env::rank_info(); }, {"RANK", "integer", "'x'"});
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("LOCAL_RANK");
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  i = env::rank_info();
  EXPECT_EQ(i.rank, 1);
  EXPECT_EQ(i.world_size, 2);
  EXPECT_STREQ(i.launcher, "mpirun");
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("EPX_TIMEOUT_S", "-1", 1);
  expect_error([] { env::timeout_seconds(); }, {"EPX_TIMEOUT_S", "> 0"});
  setenv("EPX_TIMEOUT_S", "2.5", 1);
  EXPECT_DOUBLE_EQ(env::timeout_seconds(), 2.5);
  unsetenv("EPX_TIMEOUT_S");
  EXPECT_DOUBLE_EQ(env::timeout_seconds(), 60.0);
  // the epoch-wrap test knob: unset, a 32-bit value, or an error naming it
  unsetenv("EPX_DEBUG_EPOCH_START");
  EXPECT_FALSE(env::debug_epoch_start().has_value());
  setenv("EPX_DEBUG_EPOCH_START", "4294967290", 1);
  EXPECT_EQ(env::debug_epoch_start(), std::optional<uint32_t>(4294967290u));
  setenv("EPX_DEBUG_EPOCH_START", "4294967296", 1);
  expect_error([] { env::debug_epoch_start(); }, {"EPX_DEBUG_EPOCH_START", "[0, 4294967295]"});
  setenv("EPX_DEBUG_EPOCH_START", "-1", 1);
  expect_error([] { env::debug_epoch_start(); }, {"EPX_DEBUG_EPOCH_START", "[0, 4294967295]"});
  setenv("EPX_DEBUG_EPOCH_START", "x", 1);
  expect_error([] { env::debug_epoch_start(); }, {"EPX_DEBUG_EPOCH_START", "integer"});
  unsetenv("EPX_DEBUG_EPOCH_START");
  // the mid-dispatch death knob: unset, RANK:TOKENS, or an error naming it
  unsetenv("EPX_DEBUG_LL_DISPATCH_STOP");
  EXPECT_FALSE(env::debug_ll_dispatch_stop().has_value());
  setenv("EPX_DEBUG_LL_DISPATCH_STOP", "2:5", 1);
  const auto stop = env::debug_ll_dispatch_stop();
  ASSERT_TRUE(stop.has_value());
  EXPECT_EQ(stop->rank, 2);
  EXPECT_EQ(stop->tokens, 5);
  setenv("EPX_DEBUG_LL_DISPATCH_STOP", "0:2147483647", 1);
  EXPECT_EQ(env::debug_ll_dispatch_stop()->tokens, 2147483647);
  for (const char* bad : {"2", "2:", ":5", "2:5:1", "2:5x", "-1:5", "2:-5", "a:b", " 2:5", "+2:5",
                          "2: 5", "0:2147483648", "99999999999:1"}) {
    setenv("EPX_DEBUG_LL_DISPATCH_STOP", bad, 1);
    expect_error([] { env::debug_ll_dispatch_stop(); },
                 {"EPX_DEBUG_LL_DISPATCH_STOP", "RANK:TOKENS"});
  }
  unsetenv("EPX_DEBUG_LL_DISPATCH_STOP");
  // the dead-proxy knob: unset, RANK:CHANNEL:COMMANDS, or an error naming it
  unsetenv("EPX_DEBUG_PROXY_STOP");
  EXPECT_FALSE(env::debug_proxy_stop().has_value());
  setenv("EPX_DEBUG_PROXY_STOP", "3:1:7", 1);
  const auto proxy_stop = env::debug_proxy_stop();
  ASSERT_TRUE(proxy_stop.has_value());
  EXPECT_EQ(proxy_stop->rank, 3);
  EXPECT_EQ(proxy_stop->channel, 1);
  EXPECT_EQ(proxy_stop->commands, 7);
  for (const char* bad :
       {"3", "3:1", "3:1:", "3::7", "3:1:7:2", "-3:1:7", "3:1:x", " 3:1:7", "3:1:2147483648"}) {
    setenv("EPX_DEBUG_PROXY_STOP", bad, 1);
    expect_error([] { env::debug_proxy_stop(); },
                 {"EPX_DEBUG_PROXY_STOP", "RANK:CHANNEL:COMMANDS"});
  }
  unsetenv("EPX_DEBUG_PROXY_STOP");
}
}  // namespace
}  // namespace epx
