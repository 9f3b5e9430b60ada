// The loopback GIN plugin's CUDA memops on 2 GPUs: the built
// libnccl-net-epxloop.so loaded with dlopen, driven through its exported
// tables by 2 forked processes (rank r on GPU r), as NCCL's GIN proxy would:
// registration of a cuMem window exported as a POSIX FD (NCCL_PTR_CUDA), of a
// local-only cuMem signal buffer (handle type NONE) and of malloc'd inline
// values (NCCL_PTR_HOST); then puts, inline puts (staged host sources),
// iputSignal ADD and size-0 signals to each rank (itself included); the
// target checks on its passes that every signal it sees covers its payloads,
// and at the end every byte and every signal word.
//
// Exit code 77 (ctest "skipped") with fewer than 2 GPUs. The parent never
// touches CUDA (its children fork from it); a probe child counts the GPUs.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plugins/gin_loopback/abi.hpp"

namespace gl = epx::gin_loop;

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kRanks = 2;
constexpr int kDepth = 32;      // EPX_GIN_LOOP_DEPTH: the rings wrap
constexpr int kRounds = 128;    // ops per (source, target)
constexpr int kPutBytes = 256;  // per put
constexpr int kWords = kPutBytes / 8;

struct Failure {
  std::string what;
};

// ---- logs ------------------------------------------------------------------------
std::mutex g_log_mutex;
std::string g_logs;
extern "C" void capture_log(gl::ncclDebugLogLevel, unsigned long, const char*, int, const char* fmt,
                            ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard lock(g_log_mutex);
  g_logs += buf;
  g_logs += "\n";
}
std::string logs() {
  std::lock_guard lock(g_log_mutex);
  return g_logs;
}

#define CHECK_OK(call)                                                                      \
  do {                                                                                      \
    const auto _rc = (call);                                                                \
    if (_rc != gl::ncclSuccess)                                                             \
      throw Failure{std::string(#call) + " returned " + std::to_string(_rc) + "; logs:\n" + \
                    logs()};                                                                \
  } while (0)
#define CHECK_CUDA(call)                                                                      \
  do {                                                                                        \
    const cudaError_t _e = (call);                                                            \
    if (_e != cudaSuccess) throw Failure{std::string(#call) + ": " + cudaGetErrorString(_e)}; \
  } while (0)
#define CHECK_TRUE(cond, msg)                                      \
  do {                                                             \
    if (!(cond)) throw Failure{std::string(#cond) + ": " + (msg)}; \
  } while (0)

// ---- the driver's VMM calls, through the runtime (no -lcuda) --------------------------
template <class F>
F entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  CHECK_CUDA(cudaGetDriverEntryPointByVersion(name, &fn, CUDA_VERSION, cudaEnableDefault, &found));
  CHECK_TRUE(found == cudaDriverEntryPointSuccess && fn, std::string("driver lacks ") + name);
  return reinterpret_cast<F>(fn);
}
void check_cu(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS)
    throw Failure{std::string(what) + " failed: CUresult " + std::to_string(rc)};
}

/// A cuMem allocation of device `dev`, mapped read-write for it.
struct VmmBuffer {
  CUdeviceptr ptr = 0;
  std::size_t bytes = 0;
  CUmemGenericAllocationHandle handle = 0;

  VmmBuffer(int dev, std::size_t want, CUmemAllocationHandleType type) {
    auto get_granularity =
        entry<decltype(&::cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
    auto create = entry<decltype(&::cuMemCreate)>("cuMemCreate");
    auto reserve = entry<decltype(&::cuMemAddressReserve)>("cuMemAddressReserve");
    auto map = entry<decltype(&::cuMemMap)>("cuMemMap");
    auto set_access = entry<decltype(&::cuMemSetAccess)>("cuMemSetAccess");
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = type;
    std::size_t gran = 0;
    check_cu(get_granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity");
    bytes = (want + gran - 1) / gran * gran;
    check_cu(create(&handle, bytes, &prop, 0), "cuMemCreate");
    check_cu(reserve(&ptr, bytes, 0, 0, 0), "cuMemAddressReserve");
    check_cu(map(ptr, bytes, 0, handle, 0), "cuMemMap");
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check_cu(set_access(ptr, bytes, &access, 1), "cuMemSetAccess");
    CHECK_CUDA(cudaMemset(reinterpret_cast<void*>(ptr), 0, bytes));
  }
  ~VmmBuffer() {
    if (!ptr) return;
    try {
      entry<decltype(&::cuMemUnmap)>("cuMemUnmap")(ptr, bytes);
      entry<decltype(&::cuMemAddressFree)>("cuMemAddressFree")(ptr, bytes);
      entry<decltype(&::cuMemRelease)>("cuMemRelease")(handle);
    } catch (...) {
    }
  }
  void* get() const { return reinterpret_cast<void*>(ptr); }
};

// ---- the plugin and the ranks' board -----------------------------------------------------
struct Plugin {
  void* so = nullptr;
  gl::ncclGin_v11_t* gin = nullptr;
  std::string error;  ///< dlerror() when it did not load
};
/// The plugin to load: NCCL_NET_PLUGIN when it names a file (as NCCL itself
/// would take it), else the one this build made.
const char* plugin_path() {
  const char* env = std::getenv("NCCL_NET_PLUGIN");
  return env != nullptr && std::strchr(env, '/') != nullptr ? env : EPX_GIN_LOOPBACK_SO;
}
const Plugin& plugin() {
  static const Plugin p = [] {
    setenv("EPX_GIN_LOOP_DEPTH", std::to_string(kDepth).c_str(), 1);
    setenv("EPX_GIN_LOOP_TIMEOUT_S", "30", 1);
    Plugin q;
    q.so = dlopen(plugin_path(), RTLD_NOW | RTLD_LOCAL);
    if (q.so) q.gin = static_cast<gl::ncclGin_v11_t*>(dlsym(q.so, "ncclGinPlugin_v11"));
    if (!q.gin) {
      const char* e = dlerror();
      q.error = e != nullptr ? e : "no ncclGinPlugin_v11";
    }
    return q;
  }();
  return p;
}

struct Board {
  std::atomic<int> arrived[4];
  char handles[kRanks][gl::NCCL_NET_HANDLE_MAXSIZE];
  char errors[kRanks][4096];
};

void board_barrier(Board* b, int phase) {
  b->arrived[phase].fetch_add(1);
  const auto end = Clock::now() + std::chrono::seconds(60);
  while (b->arrived[phase].load() < kRanks) {
    CHECK_TRUE(Clock::now() < end, "board barrier " + std::to_string(phase) + " timed out");
    std::this_thread::yield();
  }
}

uint64_t tag(int src, int dst, int k, int i) {
  return (uint64_t{0xC3} << 56) | (uint64_t(src) << 44) | (uint64_t(dst) << 32) |
         (uint64_t(k) << 12) | uint64_t(i);
}
enum class Op { kPut, kPutAdd, kInline, kSignalOnly };
Op op_of(int k) {
  return static_cast<Op>(k % 4);
}

void run_rank(Board* board, int rank) {
  const Plugin& p = plugin();
  CHECK_TRUE(p.gin != nullptr, std::string("plugin not loaded: ") + plugin_path() + ": " + p.error);
  const auto& g = *p.gin;
  CHECK_CUDA(cudaSetDevice(rank));
  CHECK_CUDA(cudaFree(nullptr));  // the primary context, current on this thread

  void *ctx = nullptr, *inst = nullptr, *lc = nullptr, *coll = nullptr;
  CHECK_OK(g.init(&ctx, 77, capture_log));
  CHECK_OK(g.init(&inst, 77, capture_log));
  CHECK_OK(g.listen(inst, 0, board->handles[rank], &lc));
  board_barrier(board, 0);
  void* handles[kRanks];
  for (int r = 0; r < kRanks; ++r) handles[r] = board->handles[r];
  CHECK_OK(g.connect(ctx, handles, kRanks, rank, lc, &coll));

  // Window: [send: kRanks x kRounds puts][recv: kRanks x kRounds puts], POSIX-FD cuMem.
  const std::size_t area = std::size_t(kRanks) * kRounds * kPutBytes;
  VmmBuffer window(rank, 2 * area, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  std::vector<uint64_t> host(area / 8);
  for (int d = 0; d < kRanks; ++d)
    for (int k = 0; k < kRounds; ++k)
      for (int i = 0; i < kWords; ++i)
        host[(std::size_t(d) * kRounds + k) * kWords + i] = tag(rank, d, k, i);
  CHECK_CUDA(cudaMemcpy(window.get(), host.data(), area, cudaMemcpyHostToDevice));
  // Signal buffer: local-only cuMem (handle type NONE), as NCCL's per-context one.
  // Words: [ADD count of s][signal-only sum of s] for each source s.
  VmmBuffer signals(rank, 2 * kRanks * 8, CU_MEM_HANDLE_TYPE_NONE);
  std::vector<uint64_t> inlines(kRanks, 0);

  void *win_mh, *win_gh, *sig_mh, *sig_gh, *inl_mh, *inl_gh;
  CHECK_OK(g.regMrSym(coll, window.get(), window.bytes, gl::NCCL_PTR_CUDA, 0, &win_mh, &win_gh));
  CHECK_OK(g.regMrSym(coll, signals.get(), signals.bytes, gl::NCCL_PTR_CUDA,
                      gl::NCCL_NET_MR_FLAG_FORCE_SO, &sig_mh, &sig_gh));
  CHECK_OK(
      g.regMrSym(coll, inlines.data(), inlines.size() * 8, gl::NCCL_PTR_HOST, 0, &inl_mh, &inl_gh));

  auto read_signals = [&] {
    std::vector<uint64_t> s(2 * kRanks);
    CHECK_CUDA(cudaMemcpy(s.data(), signals.get(), s.size() * 8, cudaMemcpyDeviceToHost));
    return s;
  };
  auto read_recv = [&] {
    std::vector<uint64_t> r(area / 8);
    CHECK_CUDA(cudaMemcpy(r.data(), static_cast<char*>(window.get()) + area, area,
                          cudaMemcpyDeviceToHost));
    return r;
  };
  auto check_round = [&](const std::vector<uint64_t>& recv, int s, int k, const char* why) {
    for (int i = 0; i < kWords; ++i) {
      uint64_t want = 0;
      if (op_of(k) == Op::kPut || op_of(k) == Op::kPutAdd) want = tag(s, rank, k, i);
      if (op_of(k) == Op::kInline && i == 0) want = tag(s, rank, k, 0);
      const uint64_t got = recv[(std::size_t(s) * kRounds + k) * kWords + i];
      if (got != want)
        throw Failure{"rank " + std::to_string(rank) + " (" + why + "): from rank " +
                      std::to_string(s) + ", round " + std::to_string(k) + ", word " +
                      std::to_string(i) + " holds " + std::to_string(got) + ", expected " +
                      std::to_string(want)};
    }
  };
  // Payload before signal: read the signals first, then the payloads they cover.
  auto check_ordering = [&] {
    const auto sig = read_signals();
    const auto recv = read_recv();
    for (int s = 0; s < kRanks; ++s) {
      const uint64_t adds = sig[s], sos = sig[kRanks + s] / 3;
      for (int k = 0; k < kRounds; ++k) {
        const uint64_t n = uint64_t(k / 4) + 1;  // signals of a kind up to round k
        if ((adds >= n && k <= 4 * int(adds - 1) + 1) || (sos >= n && k <= 4 * int(sos - 1) + 3))
          check_round(recv, s, k, "covered by a signal");
      }
    }
  };

  const auto deadline = Clock::now() + std::chrono::seconds(60);
  std::deque<void*> live[kRanks];
  int passes = 0;
  auto pass = [&] {
    for (int d = 0; d < kRanks; ++d)
      while (!live[d].empty()) {
        int done = 0;
        CHECK_OK(g.test(coll, live[d].front(), &done));
        if (!done) break;
        live[d].pop_front();
      }
    CHECK_OK(g.ginProgress(coll));
    if (++passes % 64 == 0) check_ordering();
    CHECK_TRUE(Clock::now() < deadline, "requests not done in 60 s; logs:\n" + logs());
  };
  for (int k = 0; k < kRounds; ++k)
    for (int d = 0; d < kRanks; ++d) {
      while (live[d].size() >= std::size_t(kDepth)) pass();
      const uint64_t src = (std::size_t(d) * kRounds + k) * kPutBytes;
      const uint64_t dst = area + (std::size_t(rank) * kRounds + k) * kPutBytes;
      void* req = nullptr;
      switch (op_of(k)) {
        case Op::kPut:
          CHECK_OK(g.iput(coll, src, win_gh, kPutBytes, dst, win_gh, d, &req));
          break;
        case Op::kPutAdd:
          CHECK_OK(g.iputSignal(coll, src, win_gh, kPutBytes, dst, win_gh, d, rank * 8, sig_gh, 1,
                                gl::NCCL_NET_SIGNAL_OP_ADD, &req));
          break;
        case Op::kInline:  // NCCL's putValue: the value is stored just before the call
          inlines[d] = tag(rank, d, k, 0);
          CHECK_OK(g.iput(coll, d * 8, inl_mh, 8, dst, win_gh, d, &req));
          break;
        case Op::kSignalOnly:
          CHECK_OK(g.iputSignal(coll, 0, nullptr, 0, 0, nullptr, d, (kRanks + rank) * 8, sig_gh, 3,
                                gl::NCCL_NET_SIGNAL_OP_ADD, &req));
          break;
      }
      CHECK_TRUE(req != nullptr, "no request");
      live[d].push_back(req);
    }
  const uint64_t want_adds = kRounds / 4, want_sos = 3 * (kRounds / 4);
  while (true) {
    bool all = live[0].empty() && live[1].empty();
    const auto sig = read_signals();
    for (int s = 0; s < kRanks; ++s)
      all = all && sig[s] == want_adds && sig[kRanks + s] == want_sos;
    if (all) break;
    for (int s = 0; s < kRanks; ++s)
      CHECK_TRUE(sig[s] <= want_adds && sig[kRanks + s] <= want_sos,
                 "a signal word overshot: " + std::to_string(sig[s]) + ", " +
                     std::to_string(sig[kRanks + s]));
    pass();
  }
  const auto recv = read_recv();
  for (int s = 0; s < kRanks; ++s)
    for (int k = 0; k < kRounds; ++k) check_round(recv, s, k, "final");
  board_barrier(board, 1);  // every rank's signals are applied: teardown may begin

  CHECK_OK(g.deregMrSym(coll, inl_mh));
  CHECK_OK(g.deregMrSym(coll, sig_mh));
  CHECK_OK(g.deregMrSym(coll, win_mh));
  CHECK_OK(g.closeColl(coll));
  CHECK_OK(g.closeListen(lc));
  CHECK_OK(g.finalize(inst));
  CHECK_OK(g.finalize(ctx));
}

TEST(GinLoopbackGpu, TwoProcessesPutAndSignalCuMem) {
  ASSERT_NE(plugin().gin, nullptr) << dlerror();  // loaded before fork: children inherit it
  void* mem =
      mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  Board* b = new (mem) Board{};
  pid_t pids[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    pids[r] = fork();
    ASSERT_GE(pids[r], 0) << std::strerror(errno);
    if (pids[r] == 0) {
      std::string e;
      try {
        run_rank(b, r);
      } catch (const Failure& f) {
        e = f.what;
      } catch (const std::exception& x) {
        e = std::string("exception: ") + x.what();
      }
      std::snprintf(b->errors[r], sizeof b->errors[r], "%s", e.c_str());
      _exit(e.empty() ? 0 : 1);
    }
  }
  const auto end = Clock::now() + std::chrono::seconds(120);
  for (int r = 0; r < kRanks; ++r) {
    int status = 0;
    pid_t got = 0;
    while ((got = waitpid(pids[r], &status, WNOHANG)) == 0 && Clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (got == 0) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], &status, 0);
      ADD_FAILURE() << "rank " << r << " did not finish in 120 s";
      continue;
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " failed: " << b->errors[r];
  }
  munmap(mem, sizeof(Board));
}

/// GPUs visible, counted in a child so that this process never initializes CUDA.
int count_gpus() {
  int fds[2];
  if (pipe(fds) != 0) return 0;
  const pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    (void)!write(fds[1], &n, sizeof n);
    _exit(0);
  }
  close(fds[1]);
  int n = 0;
  if (pid < 0 || read(fds[0], &n, sizeof n) != sizeof n) n = 0;
  close(fds[0]);
  if (pid > 0) waitpid(pid, nullptr, 0);
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  const int n = count_gpus();
  if (n < kRanks) {
    std::printf("epx_gin_loopback_gpu_tests: %d GPU(s), need %d: skipped\n", n, kRanks);
    return 77;
  }
  return RUN_ALL_TESTS();
}
