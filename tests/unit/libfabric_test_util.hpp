// unit/libfabric_test_util.hpp - what the libfabric engine's test files
// share: the provider probe, the byte pattern, the exchange handed to an
// engine, and the provider-parameterised fixture.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "transport/proxy/libfabric_engine.hpp"
#include "unit/forked_ranks.hpp"

namespace epx::proxy::lftest {

using forked::Ranks;
using forked::ShmExchange;

/// Whether `provider` can run here (probed in a forked child): "" if so.
inline std::string provider_missing(const std::string& provider) {
  static std::map<std::string, std::string> cache;
  auto it = cache.find(provider);
  if (it != cache.end()) return it->second;
  Ranks ranks;
  ranks.start(1, [&](int, ShmExchange& ex) {
    LibfabricOptions o;
    o.provider = provider;
    auto shared = std::shared_ptr<Exchange>(&ex, [](Exchange*) {});
    make_libfabric_engine(shared, 1, o);
  });
  std::string why = ranks.wait(20);
  if (!why.empty()) why = "provider " + provider + " cannot run here: " + why;
  cache[provider] = why;
  return why;
}

constexpr int kChannels = 2;  // channels of the tests on one domain

inline uint8_t pattern(int rank, uint64_t i) {
  return static_cast<uint8_t>(((i * 2654435761u) >> 11) ^ (rank * 37 + 11));
}

inline std::shared_ptr<Exchange> borrow(ShmExchange& ex) {
  return std::shared_ptr<Exchange>(&ex, [](Exchange*) {});
}

class LibfabricEngineTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    setenv("FI_TCP_IFACE", "lo", 0);  // 127.0.0.1 only
    const std::string why = provider_missing(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
  std::string provider() const { return GetParam(); }
};

/// gtest's name of a provider parameter ("tcp;ofi_rxm" -> "tcp_ofi_rxm").
inline std::string provider_test_name(const ::testing::TestParamInfo<const char*>& info) {
  std::string s = info.param;
  for (char& ch : s)
    if (ch == ';') ch = '_';
  return s;
}

}  // namespace epx::proxy::lftest
