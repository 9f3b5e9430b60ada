// The backend registry (transport/registry.hpp): what `auto` picks for each
// kind of group, what a named backend refuses and how it says so, and the
// list itself. choose_backend makes no CUDA call, so all of it runs here.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <set>
#include <string>

#include "core/signal_needs.hpp"
#include "epx/error.hpp"
#include "transport/registry.hpp"

namespace epx::transport {
namespace {

/// EPX_BACKEND unset (or set) for one test, restored after.
class BackendEnv {
 public:
  explicit BackendEnv(const char* value) {
    if (const char* v = std::getenv("EPX_BACKEND")) saved_ = v;
    if (value)
      setenv("EPX_BACKEND", value, 1);
    else
      unsetenv("EPX_BACKEND");
  }
  ~BackendEnv() {
    if (saved_)
      setenv("EPX_BACKEND", saved_->c_str(), 1);
    else
      unsetenv("EPX_BACKEND");
  }

 private:
  std::optional<std::string> saved_;
};

Topology nodes(int num_nodes, int per_node) {
  return Topology{num_nodes * per_node, per_node};
}

std::string refusal(const std::string& name, bool in_process, const Topology& t, ErrorCode code) {
  try {
    choose_backend(name, in_process, t);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "backend '" << name << "' was accepted";
  return "";
}

TEST(BackendRegistry, EveryBackendHasAUniqueNameAndAMaker) {
  std::set<std::string> names;
  for (const BackendInfo* b : backends()) {
    ASSERT_NE(b, nullptr);
    EXPECT_TRUE(names.insert(b->name).second) << b->name << " twice";
    EXPECT_NE(b->make, nullptr) << b->name;
  }
  EXPECT_EQ(names, (std::set<std::string>{"nvlink", "in_process", "proxy", "nccl", "nvshmem"}));
}

TEST(BackendRegistry, AutoPicksNvlinkInProcessOrProxyByTheGroup) {
  const BackendEnv env(nullptr);
  EXPECT_STREQ(choose_backend("auto", false, nodes(1, 4)).name, "nvlink");
  EXPECT_STREQ(choose_backend("", false, nodes(1, 8)).name, "nvlink");
  EXPECT_STREQ(choose_backend("auto", true, nodes(1, 4)).name, "in_process");
  EXPECT_STREQ(choose_backend("auto", false, nodes(2, 2)).name, "proxy");
  EXPECT_STREQ(choose_backend("auto", true, nodes(4, 4)).name, "proxy");
  // nccl and nvshmem only by name.
  EXPECT_STREQ(choose_backend("nccl", false, nodes(2, 2)).name, "nccl");
  EXPECT_STREQ(choose_backend("nvshmem", false, nodes(1, 2)).name, "nvshmem");
}

TEST(BackendRegistry, EpxBackendOverridesAutoOnlyAndIsNamedInErrors) {
  {
    const BackendEnv env("proxy");
    EXPECT_STREQ(choose_backend("auto", false, nodes(1, 4)).name, "proxy");
    EXPECT_STREQ(choose_backend("nvlink", false, nodes(1, 4)).name, "nvlink");
  }
  const BackendEnv env("nvlink");
  const std::string e = refusal("auto", false, nodes(2, 2), ErrorCode::kUnsupported);
  EXPECT_NE(e.find("EPX_BACKEND: 'nvlink' reaches only peers of this rank's node"),
            std::string::npos)
      << e;
}

TEST(BackendRegistry, NamedBackendsRefuseWhatTheyCannotServeByName) {
  const BackendEnv env(nullptr);
  std::string e = refusal("nvlink", false, nodes(2, 2), ErrorCode::kUnsupported);
  EXPECT_NE(e.find("backend: 'nvlink' reaches only peers of this rank's node, and the 4 ranks "
                   "form 2 nodes of 2 ranks"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("use backend 'proxy'"), std::string::npos) << e;
  e = refusal("in_process", true, nodes(4, 4), ErrorCode::kUnsupported);
  EXPECT_NE(e.find("'in_process' reaches only peers"), std::string::npos) << e;
  e = refusal("nvlink", true, nodes(1, 4), ErrorCode::kUnsupported);
  EXPECT_NE(e.find("'nvlink' needs an NCCL communicator"), std::string::npos) << e;
  e = refusal("in_process", false, nodes(1, 4), ErrorCode::kUnsupported);
  EXPECT_NE(e.find("'in_process' needs ranks from Communicator::create_in_process"),
            std::string::npos)
      << e;
}

TEST(BackendRegistry, UnknownNamesListEveryBackend) {
  {
    const BackendEnv env(nullptr);
    const std::string e = refusal("nvlnk", false, nodes(1, 2), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.find("backend: must be one of auto|nvlink|in_process|proxy|nccl|nvshmem, got "
                     "'nvlnk'"),
              std::string::npos)
        << e;
  }
  const BackendEnv env("gloo");
  const std::string e = refusal("", false, nodes(1, 2), ErrorCode::kInvalidArgument);
  EXPECT_NE(e.find("EPX_BACKEND: must be one of"), std::string::npos) << e;
  EXPECT_NE(e.find("got 'gloo'"), std::string::npos) << e;
}

// What a Buffer asks of a backend whose signals are a pool: every family's
// ids, the cleared ones among them, within NCCL's pool (1 to 65536 per
// context) up to the most ranks EPX takes, rings or not.
TEST(BackendRegistry, SignalNeedsFitTheNcclPoolUpToTheMostRanks) {
  for (int R : {2, 4, 16, 64, kMaxRanks})
    for (bool rings : {false, true}) {
      BackendOptions bo;
      detail::set_signal_needs(bo, R, rings);
      EXPECT_GE(bo.num_signals, bo.num_cleared_signals) << R << " ranks, rings " << rings;
      EXPECT_GT(bo.num_cleared_signals, 0) << R;
      EXPECT_LE(bo.num_signals, 65536) << R << " ranks, rings " << rings;
      if (rings) {
        BackendOptions plain;
        detail::set_signal_needs(plain, R, false);
        EXPECT_GT(bo.num_signals, plain.num_signals) << "the rings' ids come on top, " << R;
      }
    }
}

}  // namespace
}  // namespace epx::transport
