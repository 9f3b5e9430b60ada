// The run-time NCCL version check: decoding ncclGetVersion's codes of both
// eras, the comparison, and the error a too-old library gives.
#include <gtest/gtest.h>

#include <string>

#include "core/nccl_version.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

using nccl_version::Version;

void expect_version(const Version& v, int major, int minor, int patch) {
  EXPECT_EQ(v.major, major);
  EXPECT_EQ(v.minor, minor);
  EXPECT_EQ(v.patch, patch);
}

TEST(NcclVersion, DecodesBothCodeSchemes) {
  expect_version(nccl_version::decode(22809), 2, 28, 9);  // 2.9 and later: x10000
  expect_version(nccl_version::decode(22703), 2, 27, 3);
  expect_version(nccl_version::decode(21903), 2, 19, 3);
  expect_version(nccl_version::decode(20900), 2, 9, 0);
  expect_version(nccl_version::decode(30000), 3, 0, 0);
  expect_version(nccl_version::decode(2804), 2, 8, 4);  // before 2.9: x1000
  expect_version(nccl_version::decode(2708), 2, 7, 8);
  EXPECT_EQ(nccl_version::to_string(nccl_version::decode(22809)), "2.28.9");
  EXPECT_EQ(nccl_version::to_string(nccl_version::kRequired), "2.28.9");
}

TEST(NcclVersion, ComparesFieldByField) {
  const Version need{2, 28, 9};
  EXPECT_TRUE(nccl_version::at_least({2, 28, 9}, need));
  EXPECT_TRUE(nccl_version::at_least({2, 28, 10}, need));
  EXPECT_TRUE(nccl_version::at_least({2, 29, 0}, need));
  EXPECT_TRUE(nccl_version::at_least({3, 0, 0}, need));
  EXPECT_FALSE(nccl_version::at_least({2, 28, 8}, need));
  EXPECT_FALSE(nccl_version::at_least({2, 27, 99}, need));
  EXPECT_FALSE(nccl_version::at_least({1, 99, 99}, need));
}

std::string check_message(int code, const std::string& library) {
  try {
    nccl_version::check(code, library);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    return e.what();
  }
  return "";
}

TEST(NcclVersion, OlderLibraryIsAnErrorNamingBothVersions) {
  EXPECT_NO_THROW(nccl_version::check(22809, "/lib/libnccl.so.2"));
  EXPECT_NO_THROW(nccl_version::check(22900, ""));
  const std::string m = check_message(22707, "/opt/torch/nvidia/nccl/lib/libnccl.so.2");
  EXPECT_NE(m.find("NCCL 2.27.7 is loaded"), std::string::npos) << m;
  EXPECT_NE(m.find("/opt/torch/nvidia/nccl/lib/libnccl.so.2"), std::string::npos) << m;
  EXPECT_NE(m.find("needs NCCL 2.28.9 or newer"), std::string::npos) << m;
  const std::string old = check_message(2804, "");
  EXPECT_NE(old.find("NCCL 2.8.4 is loaded;"), std::string::npos) << old;
  EXPECT_NE(check_message(22808, "").find("2.28.8"), std::string::npos);
}

std::string gin_message(int code, int built, const std::string& library) {
  try {
    nccl_version::check_gin_device_abi(code, built, library);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    return e.what();
  }
  return "";
}

TEST(NcclVersion, GinDeviceCodeRunsOnlyWithItsMinorVersion) {
  EXPECT_NO_THROW(nccl_version::check_gin_device_abi(22809, 22809, ""));
  EXPECT_NO_THROW(nccl_version::check_gin_device_abi(22805, 22809, ""));   // patch: same layout
  EXPECT_NO_THROW(nccl_version::check_gin_device_abi(22812, 22809, "x"));  // newer patch too
  // DeepEP V2's NCCL (2.30.4 and later) and PyPI's newest, against 2.28 headers.
  for (const int newer : {23004, 23007, 23203}) {
    const std::string m = gin_message(newer, 22809, "/venv/nvidia/nccl/lib/libnccl.so.2");
    EXPECT_NE(m.find("NCCL " + nccl_version::to_string(nccl_version::decode(newer)) +
                     " is loaded (/venv/nvidia/nccl/lib/libnccl.so.2)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("built against NCCL 2.28.9"), std::string::npos) << m;
    EXPECT_NE(m.find("only with NCCL 2.28.x"), std::string::npos) << m;
    EXPECT_NE(m.find("backend proxy, nvlink or nvshmem"), std::string::npos) << m;
  }
  EXPECT_NE(gin_message(22703, 22809, "").find("NCCL 2.27.3 is loaded,"), std::string::npos);
  EXPECT_NE(gin_message(32809, 22809, "").find("3.28.9"), std::string::npos);  // major differs
  // Built against newer headers, an older loaded NCCL is refused the same way.
  EXPECT_NE(gin_message(22809, 23007, "").find("only with NCCL 2.30.x"), std::string::npos);
}

}  // namespace
}  // namespace epx
