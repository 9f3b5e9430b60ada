// The NVSHMEM backend's loading (no GPU): a missing module and a module that
// cannot load are named; the module this build made loads and has its table.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "epx/error.hpp"
#include "transport/nvshmem/module.hpp"
#include "transport/nvshmem/nvshmem_backend.hpp"

namespace {

using epx::Error;
using epx::ErrorCode;

/// Sets an environment variable for one scope.
struct ScopedEnv {
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_.empty())
      ::unsetenv(name_);
    else
      ::setenv(name_, old_.c_str(), 1);
  }
  const char* name_;
  std::string old_;
};

std::string load_error() {
  try {
    epx::transport::load_nvshmem_module();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    return e.what();
  }
  return {};
}

#ifndef EPX_NVSHMEM_MODULE_PATH
TEST(NvshmemModule, ABuildWithoutItSaysSo) {
  const std::string msg = load_error();
  ASSERT_FALSE(msg.empty()) << "a build without the module loaded one";
  EXPECT_NE(msg.find("no NVSHMEM module"), std::string::npos) << msg;
  EXPECT_NE(msg.find("EPX_WITH_NVSHMEM"), std::string::npos) << msg;
}
#else
// A file that is not a loadable module: named with the loader's reason. (Runs
// before the module is loaded: a loaded module stays for the process.)
TEST(NvshmemModule, AModuleThatCannotLoadIsNamed) {
  const std::string bogus = ::testing::TempDir() + "/libepx_nvshmem_bogus.so";
  FILE* f = std::fopen(bogus.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("not an ELF file\n", f);
  std::fclose(f);
  ScopedEnv env("EPX_NVSHMEM_MODULE", bogus);
  const std::string msg = load_error();
  ASSERT_FALSE(msg.empty()) << "a bogus module loaded";
  EXPECT_NE(msg.find("could not be loaded"), std::string::npos) << msg;
  EXPECT_NE(msg.find(bogus), std::string::npos) << msg;
}

// By bare name and not on the loader's path: no module (not "could not load").
TEST(NvshmemModule, ABareNameNotOnTheLoadersPathIsNoModule) {
  ScopedEnv env("EPX_NVSHMEM_MODULE", "libepx_nvshmem_absent.so");
  const std::string msg = load_error();
  ASSERT_FALSE(msg.empty()) << "an absent module loaded";
  EXPECT_NE(msg.find("no NVSHMEM module"), std::string::npos) << msg;
  EXPECT_NE(msg.find("libepx_nvshmem_absent.so"), std::string::npos) << msg;
}

TEST(NvshmemModule, AMissingPathIsNamed) {
  ScopedEnv env("EPX_NVSHMEM_MODULE", "/nonexistent/libepx_nvshmem.so");
  const std::string msg = load_error();
  ASSERT_FALSE(msg.empty()) << "a missing module loaded";
  EXPECT_NE(msg.find("/nonexistent/libepx_nvshmem.so"), std::string::npos) << msg;
}

// The module of this build loads without a GPU (NVSHMEM starts only at a
// Buffer) and brings every entry of its table.
TEST(NvshmemModule, TheBuiltModuleLoadsWithItsTable) {
  // (The binary run away from its build tree, as on the GPU machine, has no
  // module at that path; there the GPU suites load it from beside them.)
  if (::access(EPX_NVSHMEM_MODULE_PATH, F_OK) != 0)
    GTEST_SKIP() << "no module at " << EPX_NVSHMEM_MODULE_PATH << " (run away from the build tree)";
  ScopedEnv env("EPX_NVSHMEM_MODULE", EPX_NVSHMEM_MODULE_PATH);
  const epx::nvshmem_module::Api* api = nullptr;
  try {
    api = &epx::transport::load_nvshmem_module();
  } catch (const Error& e) {
    FAIL() << e.what();
  }
  EXPECT_EQ(api->abi_version, epx::nvshmem_module::kAbiVersion);
  EXPECT_STREQ(api->nvshmem_version, "3.4.5");
  EXPECT_NE(api->init, nullptr);
  EXPECT_NE(api->finalize, nullptr);
  EXPECT_NE(api->alloc, nullptr);
  EXPECT_NE(api->free, nullptr);
  EXPECT_NE(api->peer_ptr, nullptr);
  EXPECT_NE(api->quiesce, nullptr);
  EXPECT_NE(api->barrier, nullptr);
  EXPECT_NE(api->preload, nullptr);
  ASSERT_NE(api->kernels, nullptr);
  EXPECT_NE(api->kernels->ll_dispatch, nullptr);
  EXPECT_NE(api->kernels->ll_combine, nullptr);
  // Once loaded it stays: asking again gives the same table.
  EXPECT_EQ(&epx::transport::load_nvshmem_module(), api);
}
#endif

TEST(NvshmemModule, ErrorCodesCrossTheBoundaryEncoded) {
  using epx::nvshmem_module::decode;
  using epx::nvshmem_module::encode;
  for (ErrorCode c : {ErrorCode::kInvalidArgument, ErrorCode::kTimeout, ErrorCode::kUnsupported,
                      ErrorCode::kInternal}) {
    EXPECT_NE(encode(c), 0) << "an error must not read as success";
    EXPECT_EQ(decode(encode(c)), c);
  }
  char err[64] = {0};
  EXPECT_EQ(epx::nvshmem_module::guarded(err, sizeof(err), [] {}), 0);
  EXPECT_EQ(decode(epx::nvshmem_module::guarded(err, sizeof(err),
                                                [] { throw Error(ErrorCode::kTimeout, "late"); })),
            ErrorCode::kTimeout);
  EXPECT_NE(std::string(err).find("late"), std::string::npos) << err;
  EXPECT_EQ(decode(epx::nvshmem_module::guarded(err, sizeof(err), [] { throw 3; })),
            ErrorCode::kInternal);
}

}  // namespace
