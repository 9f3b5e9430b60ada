// The loopback GIN plugin (plugins/gin_loopback) as NCCL sees it: the ABI
// layouts, the built libnccl-net-epxloop.so loaded with dlopen, and the
// plugin driven through its exported tables by ranks that are threads of this
// process or forked processes, replaying NCCL 2.28.9's GIN_PROXY sequence
// (init twice, listen, handle exchange, connect, regMrSym, iput / iputSignal /
// test / ginProgress, teardown) over host shared memory. No GPU, no NCCL.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <nccl_device/net_device.h>  // NCCL's own device types, to check ours against
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/host_mesh.hpp"
#include "plugins/gin_loopback/abi.hpp"
#include "plugins/gin_loopback/inbox.hpp"
#include "plugins/gin_loopback/loop.hpp"
#include "plugins/gin_loopback/memops.hpp"

namespace gl = epx::gin_loop;

// ---- the ABI ------------------------------------------------------------------------
// abi.hpp static_asserts the sizes and offsets of NCCL 2.28.9; here its
// constants are checked against the header NCCL ships (nccl_device/net_device.h).
static_assert(static_cast<int>(::NCCL_NET_DEVICE_HOST) ==
              static_cast<int>(gl::NCCL_NET_DEVICE_HOST));
static_assert(static_cast<int>(::NCCL_NET_DEVICE_GIN_PROXY) ==
              static_cast<int>(gl::NCCL_NET_DEVICE_GIN_PROXY));
static_assert(static_cast<int>(::NCCL_NET_DEVICE_GIN_GDAKI) ==
              static_cast<int>(gl::NCCL_NET_DEVICE_GIN_GDAKI));
static_assert(sizeof(::ncclNetDeviceHandle_v11_t) == sizeof(gl::ncclNetDeviceHandle_v11_t));
static_assert(offsetof(::ncclNetDeviceHandle_v11_t, needsProxyProgress) ==
              offsetof(gl::ncclNetDeviceHandle_v11_t, needsProxyProgress));

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kDepth = 32;  // EPX_GIN_LOOP_DEPTH for these tests: the rings wrap often

// ---- log capture (the logger NCCL would pass) ---------------------------------------
std::mutex g_log_mutex;
std::vector<std::string> g_logs;

extern "C" void capture_log(gl::ncclDebugLogLevel, unsigned long, const char*, int, const char* fmt,
                            ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard lock(g_log_mutex);
  g_logs.emplace_back(buf);
}
bool logged(const std::string& needle) {
  std::lock_guard lock(g_log_mutex);
  for (const auto& l : g_logs)
    if (l.find(needle) != std::string::npos) return true;
  return false;
}
std::string all_logs() {
  std::lock_guard lock(g_log_mutex);
  std::string s;
  for (const auto& l : g_logs) s += l + "\n";
  return s;
}

// ---- the plugin, loaded as NCCL loads it --------------------------------------------
struct Plugin {
  void* so = nullptr;
  gl::ncclNet_v11_t* net = nullptr;
  gl::ncclGin_v11_t* gin = nullptr;
  int (*alloc)(std::size_t, void**) = nullptr;
  int (*free)(void*) = nullptr;
};

const Plugin& plugin() {
  static const Plugin p = [] {
    setenv("EPX_GIN_LOOP_DEPTH", std::to_string(kDepth).c_str(), 1);
    setenv("EPX_GIN_LOOP_TIMEOUT_S", "10", 1);
    Plugin q;
    q.so = dlopen(EPX_GIN_LOOPBACK_SO, RTLD_NOW | RTLD_LOCAL);
    if (!q.so) return q;
    q.net = static_cast<gl::ncclNet_v11_t*>(dlsym(q.so, "ncclNetPlugin_v11"));
    q.gin = static_cast<gl::ncclGin_v11_t*>(dlsym(q.so, "ncclGinPlugin_v11"));
    q.alloc = reinterpret_cast<int (*)(std::size_t, void**)>(dlsym(q.so, "epxGinLoopHostAlloc"));
    q.free = reinterpret_cast<int (*)(void*)>(dlsym(q.so, "epxGinLoopHostFree"));
    return q;
  }();
  return p;
}

TEST(GinLoopback, DlopenExportsBothTables) {
  const Plugin& p = plugin();
  ASSERT_NE(p.so, nullptr) << dlerror();
  ASSERT_NE(p.net, nullptr) << "ncclNetPlugin_v11 missing";
  ASSERT_NE(p.gin, nullptr) << "ncclGinPlugin_v11 missing";
  ASSERT_NE(p.alloc, nullptr);
  ASSERT_NE(p.free, nullptr);
  EXPECT_STREQ(p.net->name, "EPX-LOOP");
  EXPECT_STREQ(p.gin->name, "EPX-LOOP");

  // Net: every member NCCL calls unconditionally is set; the optional ones are NULL.
  const auto& n = *p.net;
  for (const void* f :
       {(const void*)n.init, (const void*)n.devices, (const void*)n.getProperties,
        (const void*)n.listen, (const void*)n.connect, (const void*)n.accept, (const void*)n.regMr,
        (const void*)n.regMrDmaBuf, (const void*)n.deregMr, (const void*)n.isend,
        (const void*)n.irecv, (const void*)n.iflush, (const void*)n.test, (const void*)n.closeSend,
        (const void*)n.closeRecv, (const void*)n.closeListen, (const void*)n.finalize})
    EXPECT_NE(f, nullptr);
  EXPECT_EQ(n.makeVDevice, nullptr);
  EXPECT_EQ(n.getDeviceMr, nullptr);
  EXPECT_EQ(n.irecvConsumed, nullptr);
  EXPECT_EQ(n.setNetAttr, nullptr);

  // GIN: the proxy-mode members are set; createContext, destroyContext,
  // queryLastError and regMrSymDmaBuf are NULL (docs/nccl_gin.md).
  const auto& g = *p.gin;
  for (const void* f : {(const void*)g.init, (const void*)g.devices, (const void*)g.getProperties,
                        (const void*)g.listen, (const void*)g.connect, (const void*)g.regMrSym,
                        (const void*)g.deregMrSym, (const void*)g.closeColl,
                        (const void*)g.closeListen, (const void*)g.iput, (const void*)g.iputSignal,
                        (const void*)g.test, (const void*)g.ginProgress, (const void*)g.finalize})
    EXPECT_NE(f, nullptr);
  EXPECT_EQ(g.createContext, nullptr);
  EXPECT_EQ(g.destroyContext, nullptr);
  EXPECT_EQ(g.queryLastError, nullptr);
  EXPECT_EQ(g.regMrSymDmaBuf, nullptr);
}

TEST(GinLoopback, PropertiesAndStubNet) {
  const Plugin& p = plugin();
  ASSERT_NE(p.gin, nullptr);
  void* nctx = nullptr;
  ASSERT_EQ(p.net->init(&nctx, 1, nullptr, capture_log, nullptr), gl::ncclSuccess);
  int ndev = 0;
  ASSERT_EQ(p.net->devices(&ndev), gl::ncclSuccess);
  EXPECT_EQ(ndev, 1);
  gl::ncclNetProperties_v11_t props{};
  ASSERT_EQ(p.net->getProperties(0, &props), gl::ncclSuccess);
  EXPECT_EQ(props.netDeviceType, gl::NCCL_NET_DEVICE_HOST);
  EXPECT_EQ(props.pciPath, nullptr);
  EXPECT_STREQ(props.name, "EPX-LOOP");
  EXPECT_EQ(props.ptrSupport, gl::NCCL_PTR_HOST);
  EXPECT_EQ(props.maxRecvs, 1);
  // The stub's data path refuses with a WARN saying why.
  void* lc = nullptr;
  char handle[128];
  EXPECT_EQ(p.net->listen(nctx, 0, handle, &lc), gl::ncclInternalError);
  EXPECT_TRUE(logged("net listen: the EPX-LOOP net device is a stub")) << all_logs();
  EXPECT_EQ(p.net->getProperties(1, &props), gl::ncclInvalidArgument);
  EXPECT_EQ(p.net->finalize(nctx), gl::ncclSuccess);

  ASSERT_EQ(p.gin->devices(&ndev), gl::ncclSuccess);
  EXPECT_EQ(ndev, 1);
  ASSERT_EQ(p.gin->getProperties(0, &props), gl::ncclSuccess);
  EXPECT_EQ(props.netDeviceType, gl::NCCL_NET_DEVICE_GIN_PROXY);
  EXPECT_EQ(props.pciPath, nullptr);
  EXPECT_EQ(props.maxRecvs, kDepth / 32);  // NCCL queues 32 * maxRecvs per peer
#ifdef EPX_GIN_LOOP_CUDA
  EXPECT_EQ(props.ptrSupport, gl::NCCL_PTR_HOST | gl::NCCL_PTR_CUDA);  // CUDA memops built in
#else
  EXPECT_EQ(props.ptrSupport, gl::NCCL_PTR_HOST);  // no CUDA memops in this build
#endif
  EXPECT_EQ(props.ptrSupport & gl::NCCL_PTR_DMABUF, 0);
}

// ---- a board the ranks share (threads or forked processes) ---------------------------
constexpr int kMaxRanks = 4;
struct Board {
  std::atomic<int> arrived[8];
  char handles[kMaxRanks][gl::NCCL_NET_HANDLE_MAXSIZE];
  char errors[kMaxRanks][1024];
};

Board* new_board() {
  void* p = mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  return new (p) Board{};
}
void free_board(Board* b) {
  munmap(b, sizeof(Board));
}

struct Failure {
  std::string what;
};
#define CHECK_OK(call)                                                                      \
  do {                                                                                      \
    const auto _rc = (call);                                                                \
    if (_rc != gl::ncclSuccess)                                                             \
      throw Failure{std::string(#call) + " returned " + std::to_string(_rc) + "; logs:\n" + \
                    all_logs()};                                                            \
  } while (0)
#define CHECK_TRUE(cond, msg)                                      \
  do {                                                             \
    if (!(cond)) throw Failure{std::string(#cond) + ": " + (msg)}; \
  } while (0)

/// The bootstrap barrier NCCL would run between listen and connect (deadline 10 s).
void board_barrier(Board* b, int phase, int nranks) {
  b->arrived[phase].fetch_add(1);
  const auto end = Clock::now() + std::chrono::seconds(10);
  while (b->arrived[phase].load() < nranks) {
    if (Clock::now() > end)
      throw Failure{"board barrier " + std::to_string(phase) + ": only " +
                    std::to_string(b->arrived[phase].load()) + " of " + std::to_string(nranks) +
                    " ranks arrived"};
    std::this_thread::yield();
  }
}

uint64_t tag(int src, int dst, int k) {
  return (uint64_t{0xA5} << 56) | (uint64_t(src) << 40) | (uint64_t(dst) << 24) | uint64_t(k + 1);
}

struct Options {
  int rounds = 200;    ///< ops per peer (more than kDepth: every ring wraps)
  int slow_rank = -1;  ///< this rank starts its traffic and progress late
  double slow_s = 0.3;
  double* elapsed = nullptr;  ///< per rank: seconds its issue phase took (threads only)
};

/// Kind of op of round k (per peer): the mix of NCCL's descriptors.
enum class Op { kPut, kPutInc, kPutInline, kPutAdd, kSignalOnly, kPutAddInline };
Op op_of(int k) {
  switch (k % 8) {
    case 1:
      return Op::kPutInc;
    case 2:
      return Op::kPutInline;
    case 3:
      return Op::kPutAdd;
    case 5:
      return Op::kSignalOnly;
    case 6:
      return Op::kPutAddInline;
    default:
      return Op::kPut;
  }
}

/// One rank of NCCL's sequence; throws Failure.
void run_rank(Board* board, int rank, int nranks, const Options& opt) {
  const Plugin& p = plugin();
  CHECK_TRUE(p.gin != nullptr, "plugin not loaded");
  const auto& g = *p.gin;
  const int R = opt.rounds;

  // init twice: comm->ginContext (used by connect) and ginInstance (used by listen).
  void* gin_context = nullptr;
  void* gin_instance = nullptr;
  CHECK_OK(g.init(&gin_context, 42, capture_log));
  CHECK_OK(g.init(&gin_instance, 42, capture_log));
  void* listen_comm = nullptr;
  CHECK_OK(g.listen(gin_instance, 0, board->handles[rank], &listen_comm));
  board_barrier(board, 0, nranks);  // the bootstrap allgather of the handles
  void* handles[kMaxRanks];
  for (int r = 0; r < nranks; ++r) handles[r] = board->handles[r];
  void* coll = nullptr;
  CHECK_OK(g.connect(gin_context, handles, nranks, rank, listen_comm, &coll));

  // Window: [send: nranks x R words][recv: nranks x R words], exportable.
  const std::size_t area = std::size_t(nranks) * R * 8;
  uint64_t* window = nullptr;
  CHECK_TRUE(p.alloc(2 * area, reinterpret_cast<void**>(&window)) == 0, "host alloc");
  uint64_t* send = window;
  uint64_t* recv = window + std::size_t(nranks) * R;
  for (int d = 0; d < nranks; ++d)
    for (int k = 0; k < R; ++k) send[d * R + k] = tag(rank, d, k);
  // Signal buffer (local-only, like NCCL's type-NONE cuMem one): words
  // [ADD of s][INC of s][signal-only of s] for each source s.
  std::vector<uint64_t> signals(3 * nranks, 0);
  // Inline values (malloc'd, registered as host memory): one word per peer.
  std::vector<uint64_t> inlines(nranks, 0);
  void *win_mh, *win_gh, *sig_mh, *sig_gh, *inl_mh, *inl_gh;
  CHECK_OK(g.regMrSym(coll, window, 2 * area, gl::NCCL_PTR_HOST, 0, &win_mh, &win_gh));
  CHECK_OK(g.regMrSym(coll, signals.data(), signals.size() * 8, gl::NCCL_PTR_HOST,
                      gl::NCCL_NET_MR_FLAG_FORCE_SO, &sig_mh, &sig_gh));
  CHECK_OK(
      g.regMrSym(coll, inlines.data(), inlines.size() * 8, gl::NCCL_PTR_HOST, 0, &inl_mh, &inl_gh));
  CHECK_TRUE(win_mh == win_gh && sig_mh == sig_gh && inl_mh == inl_gh,
             "regMrSym must return one handle as mhandle and ginHandle");

  auto sig_word = [&](int kind, int s) -> uint64_t {
    return std::atomic_ref<uint64_t>(signals[kind * nranks + s]).load(std::memory_order_acquire);
  };
  // Payload-before-signal: once source s's signal words show j signals of a
  // kind, every payload that source put to this rank up to that signal's round
  // must be here.
  auto check_prefix = [&](int s, int last_round, const char* why) {
    for (int k = 0; k <= last_round && k < R; ++k) {
      const uint64_t want = op_of(k) == Op::kSignalOnly ? 0 : tag(s, rank, k);
      const uint64_t got = recv[s * R + k];
      if (got != want)
        throw Failure{"rank " + std::to_string(rank) + ": after " + why + " of rank " +
                      std::to_string(s) + ", round " + std::to_string(k) + " holds " +
                      std::to_string(got) + ", expected " + std::to_string(want)};
    }
  };
  auto check_ordering = [&] {
    for (int s = 0; s < nranks; ++s) {
      const uint64_t adds = sig_word(0, s), incs = sig_word(1, s), so = sig_word(2, s) / 3;
      if (adds > 0) check_prefix(s, 8 * int((adds - 1) / 2) + ((adds - 1) % 2 ? 6 : 3), "ADDs");
      if (incs > 0) check_prefix(s, 8 * int(incs - 1) + 1, "INCs");
      if (so > 0) check_prefix(s, 8 * int(so - 1) + 5, "signal-only ADDs");
    }
  };

  if (rank == opt.slow_rank) std::this_thread::sleep_for(std::chrono::duration<double>(opt.slow_s));
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::seconds(15);
  std::vector<std::deque<void*>> live(nranks);
  // NCCL's progress pass: test live requests of each peer in order, then progress.
  auto pass = [&] {
    for (int d = 0; d < nranks; ++d)
      while (!live[d].empty()) {
        int done = 0;
        CHECK_OK(g.test(coll, live[d].front(), &done));
        if (!done) break;
        live[d].pop_front();
      }
    CHECK_OK(g.ginProgress(coll));
    check_ordering();
    if (Clock::now() > deadline)
      throw Failure{"rank " + std::to_string(rank) + ": requests not done by the deadline"};
  };
  for (int k = 0; k < R; ++k)
    for (int d = 0; d < nranks; ++d) {
      while (live[d].size() >= std::size_t(kDepth)) pass();         // NCCL's queue credit
      const uint64_t off = (std::size_t(d) * R + k) * 8;            // my send word for d, round k
      const uint64_t dst = area + (std::size_t(rank) * R + k) * 8;  // my recv word at d
      const uint64_t add_word = (0 * nranks + rank) * 8, inc_word = (1 * nranks + rank) * 8,
                     so_word = (2 * nranks + rank) * 8;
      void* req = nullptr;
      switch (op_of(k)) {
        case Op::kPut:
          CHECK_OK(g.iput(coll, off, win_gh, 8, dst, win_gh, d, &req));
          break;
        case Op::kPutInline:  // NCCL's putValue: the value is stored just before the call
          inlines[d] = tag(rank, d, k);
          CHECK_OK(g.iput(coll, d * 8, inl_mh, 8, dst, win_gh, d, &req));
          break;
        case Op::kPutInc:
          CHECK_OK(g.iputSignal(coll, off, win_gh, 8, dst, win_gh, d, inc_word, sig_gh, 1,
                                gl::NCCL_NET_SIGNAL_OP_INC, &req));
          break;
        case Op::kPutAdd:
          CHECK_OK(g.iputSignal(coll, off, win_gh, 8, dst, win_gh, d, add_word, sig_gh, 1,
                                gl::NCCL_NET_SIGNAL_OP_ADD, &req));
          break;
        case Op::kPutAddInline:
          inlines[d] = tag(rank, d, k);
          CHECK_OK(g.iputSignal(coll, d * 8, inl_mh, 8, dst, win_gh, d, add_word, sig_gh, 1,
                                gl::NCCL_NET_SIGNAL_OP_ADD, &req));
          break;
        case Op::kSignalOnly:  // size 0, NULL data handles
          CHECK_OK(g.iputSignal(coll, 0, nullptr, 0, 0, nullptr, d, so_word, sig_gh, 3,
                                gl::NCCL_NET_SIGNAL_OP_ADD, &req));
          break;
      }
      CHECK_TRUE(req != nullptr, "iput returned no request");
      live[d].push_back(req);
    }
  while (true) {  // every request done, every expected signal here
    bool all = true;
    for (int d = 0; d < nranks; ++d) all = all && live[d].empty();
    int adds = 0, incs = 0, sos = 0;
    for (int k = 0; k < R; ++k) {
      adds += op_of(k) == Op::kPutAdd || op_of(k) == Op::kPutAddInline;
      incs += op_of(k) == Op::kPutInc;
      sos += op_of(k) == Op::kSignalOnly;
    }
    for (int s = 0; s < nranks; ++s)
      all = all && sig_word(0, s) == uint64_t(adds) && sig_word(1, s) == uint64_t(incs) &&
            sig_word(2, s) == uint64_t(3 * sos);
    if (all) break;
    pass();
  }
  if (opt.elapsed) opt.elapsed[rank] = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int s = 0; s < nranks; ++s) check_prefix(s, R - 1, "all signals");
  board_barrier(board, 1, nranks);  // NCCL quiesces every rank before teardown

  // A bad rank: refused, and the error sticks for the next iput.
  void* req = nullptr;
  const uint32_t bad = uint32_t(nranks + 5);
  CHECK_TRUE(g.iput(coll, 0, win_gh, 8, area, win_gh, bad, &req) == gl::ncclInvalidArgument,
             "iput to a bad rank must fail");
  CHECK_TRUE(logged("rank " + std::to_string(bad) + " is not in [0, " + std::to_string(nranks)),
             "the error names the rank: " + all_logs());
  CHECK_TRUE(g.iput(coll, 0, win_gh, 8, area, win_gh, 0, &req) == gl::ncclInvalidArgument,
             "the next iput must return the sticky error");
  CHECK_TRUE(logged("an earlier error stopped this collComm"), all_logs());

  CHECK_OK(g.deregMrSym(coll, inl_mh));
  CHECK_OK(g.deregMrSym(coll, sig_mh));
  CHECK_OK(g.deregMrSym(coll, win_mh));
  CHECK_OK(g.closeColl(coll));
  CHECK_OK(g.closeListen(listen_comm));
  CHECK_OK(g.finalize(gin_instance));
  CHECK_OK(g.finalize(gin_context));
  CHECK_TRUE(p.free(window) == 0, "host free");
}

std::string run_guarded(Board* b, int rank, int nranks, const Options& opt) {
  try {
    run_rank(b, rank, nranks, opt);
    return {};
  } catch (const Failure& f) {
    return "rank " + std::to_string(rank) + ": " + f.what;
  } catch (const std::exception& e) {
    return "rank " + std::to_string(rank) + ": exception " + e.what();
  }
}

void run_threads(int nranks, const Options& opt) {
  ASSERT_NE(plugin().gin, nullptr);
  Board* b = new_board();
  ASSERT_NE(b, nullptr);
  std::vector<std::string> errors(nranks);
  {
    std::vector<std::jthread> ts;
    for (int r = 0; r < nranks; ++r)
      ts.emplace_back([&, r] { errors[r] = run_guarded(b, r, nranks, opt); });
  }
  free_board(b);
  for (auto& e : errors) EXPECT_EQ(e, "");
}

void run_processes(int nranks, const Options& opt) {
  ASSERT_NE(plugin().gin, nullptr);  // loaded before fork: children inherit it
  Board* b = new_board();
  ASSERT_NE(b, nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < nranks; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) {
      const std::string e = run_guarded(b, r, nranks, opt);
      std::snprintf(b->errors[r], sizeof b->errors[r], "%s", e.c_str());
      _exit(e.empty() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  const auto end = Clock::now() + std::chrono::seconds(20);
  for (int r = 0; r < nranks; ++r) {
    int status = 0;
    pid_t got = 0;
    while ((got = waitpid(pids[r], &status, WNOHANG)) == 0 && Clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (got == 0) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], &status, 0);
      ADD_FAILURE() << "rank " << r << " (pid " << pids[r] << ") did not finish in 20 s";
      continue;
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " failed: " << b->errors[r];
  }
  free_board(b);
}

TEST(GinLoopback, TwoThreads) {
  run_threads(2, {});
}
TEST(GinLoopback, FourThreads) {
  run_threads(4, {});
}
TEST(GinLoopback, OneRankPutsToItself) {
  run_threads(1, {});
}
TEST(GinLoopback, TwoProcesses) {
  run_processes(2, {});
}
TEST(GinLoopback, FourProcesses) {
  run_processes(4, {});
}

TEST(GinLoopback, SlowTargetHoldsSourcesBack) {
  // Rank 1 starts late: rank 0's signalled requests to it cannot complete
  // until rank 1's progress drains its inbox, so rank 0 is held back.
  double elapsed[kMaxRanks] = {};
  Options opt;
  opt.slow_rank = 1;
  opt.slow_s = 0.3;
  opt.elapsed = elapsed;
  run_threads(2, opt);
  EXPECT_GE(elapsed[0], 0.25) << "rank 0 finished before the slow target progressed";
}

// ---- single-rank error paths ----------------------------------------------------------

struct OneRank {
  const gl::ncclGin_v11_t& g = *plugin().gin;
  void *ctx = nullptr, *inst = nullptr, *lc = nullptr, *coll = nullptr;
  char handle[gl::NCCL_NET_HANDLE_MAXSIZE];
  std::vector<uint64_t> local = std::vector<uint64_t>(64, 0);
  void *mh = nullptr, *gh = nullptr;
  OneRank() {
    EXPECT_EQ(g.init(&ctx, 7, capture_log), gl::ncclSuccess);
    EXPECT_EQ(g.init(&inst, 7, capture_log), gl::ncclSuccess);
    EXPECT_EQ(g.listen(inst, 0, handle, &lc), gl::ncclSuccess);
    void* hs[1] = {handle};
    EXPECT_EQ(g.connect(ctx, hs, 1, 0, lc, &coll), gl::ncclSuccess);
    EXPECT_EQ(g.regMrSym(coll, local.data(), 512, gl::NCCL_PTR_HOST, 0, &mh, &gh), gl::ncclSuccess);
  }
  ~OneRank() {
    EXPECT_EQ(g.deregMrSym(coll, mh), gl::ncclSuccess);
    EXPECT_EQ(g.closeColl(coll), gl::ncclSuccess);
    EXPECT_EQ(g.closeListen(lc), gl::ncclSuccess);
    EXPECT_EQ(g.finalize(inst), gl::ncclSuccess);
    EXPECT_EQ(g.finalize(ctx), gl::ncclSuccess);
  }
};

// NCCL 2.28 connects a split communicator with the comm's ginContext, which
// its loader left NULL: the plugin takes the listen comm's context instead.
TEST(GinLoopback, ConnectWithNullContextUsesTheListenContext) {
  ASSERT_NE(plugin().gin, nullptr);
  const gl::ncclGin_v11_t& g = *plugin().gin;
  void *inst = nullptr, *lc = nullptr, *coll = nullptr;
  char handle[gl::NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_EQ(g.init(&inst, 7, capture_log), gl::ncclSuccess);
  ASSERT_EQ(g.listen(inst, 0, handle, &lc), gl::ncclSuccess);
  void* hs[1] = {handle};
  ASSERT_EQ(g.connect(nullptr, hs, 1, 0, lc, &coll), gl::ncclSuccess);
  ASSERT_NE(coll, nullptr);
  // The communicator works: a put to itself lands.
  std::vector<uint64_t> local(64, 0);
  void *mh = nullptr, *gh = nullptr;
  ASSERT_EQ(g.regMrSym(coll, local.data(), 512, gl::NCCL_PTR_HOST, 0, &mh, &gh), gl::ncclSuccess);
  local[0] = 0x1234;
  void* req = nullptr;
  ASSERT_EQ(g.iput(coll, 0, mh, 8, 256, mh, 0, &req), gl::ncclSuccess);
  int done = 0;
  for (int i = 0; i < 1000000 && !done; ++i) ASSERT_EQ(g.test(coll, req, &done), gl::ncclSuccess);
  EXPECT_EQ(done, 1);
  EXPECT_EQ(local[32], 0x1234u);
  EXPECT_EQ(g.deregMrSym(coll, mh), gl::ncclSuccess);
  EXPECT_EQ(g.closeColl(coll), gl::ncclSuccess);
  EXPECT_EQ(g.closeListen(lc), gl::ncclSuccess);
  EXPECT_EQ(g.finalize(inst), gl::ncclSuccess);
  // NCCL destroys such a communicator by finalizing its NULL context.
  EXPECT_EQ(g.finalize(nullptr), gl::ncclSuccess);
}

TEST(GinLoopback, RingOverrunIsAnError) {
  ASSERT_NE(plugin().gin, nullptr);
  OneRank o;
  void* req = nullptr;
  for (int i = 0; i < kDepth; ++i)
    ASSERT_EQ(o.g.iput(o.coll, 0, o.mh, 8, 8, o.mh, 0, &req), gl::ncclSuccess) << i;
  EXPECT_EQ(o.g.iput(o.coll, 0, o.mh, 8, 8, o.mh, 0, &req), gl::ncclInternalError);
  EXPECT_TRUE(logged("ring overrun: " + std::to_string(kDepth) + " requests to this peer"))
      << all_logs();
}

TEST(GinLoopback, BadArgumentsAreNamed) {
  ASSERT_NE(plugin().gin, nullptr);
  {
    OneRank o;
    void* req = nullptr;
    EXPECT_EQ(o.g.iput(o.coll, 0, o.mh, 8, 512, o.mh, 0, &req), gl::ncclInvalidArgument);
    EXPECT_TRUE(logged("destination [512, +8) is outside rank 0's registration of 512 bytes"))
        << all_logs();
  }
  {
    OneRank o;
    void* req = nullptr;
    EXPECT_EQ(o.g.iputSignal(o.coll, 0, nullptr, 0, 0, nullptr, 0, 8, o.mh, 1, 7, &req),
              gl::ncclInvalidArgument);
    EXPECT_TRUE(logged("signalOp 7 is neither INC (1) nor ADD (2)")) << all_logs();
  }
  {
    OneRank o;
    int x = 0;
    void *mh, *gh;
    EXPECT_EQ(o.g.regMrSym(o.coll, &x, 4, gl::NCCL_PTR_CUDA, 0, &mh, &gh), gl::ncclInvalidArgument);
#ifdef EPX_GIN_LOOP_CUDA
    // A host pointer registered as NCCL_PTR_CUDA is refused: without a driver
    // (CPU CI) because none loads, with one because it is not GPU memory.
    EXPECT_TRUE(logged("regMrSym of an NCCL_PTR_CUDA range: ")) << all_logs();
#else
    EXPECT_TRUE(logged("type NCCL_PTR_CUDA: this build of the plugin has host memops only"))
        << all_logs();
#endif
    int done = 0;
    EXPECT_EQ(o.g.test(o.coll, reinterpret_cast<void*>(uintptr_t{5}), &done),
              gl::ncclInvalidArgument);
    EXPECT_TRUE(logged("is not live")) << all_logs();
  }
}

// EPX_GIN_LOOP_STALL_AFTER_S: from that many seconds after connecting no
// request is reported done again (a network that stopped completing; the
// bytes still land): what the nccl backend's quiet must name within its
// deadline (Network.StalledNetworkIsNamed on a GPU).
TEST(GinLoopback, StallAfterStopsCompletions) {
  ASSERT_NE(plugin().gin, nullptr);
  setenv("EPX_GIN_LOOP_STALL_AFTER_S", "0.5", 1);  // read by init
  OneRank o;
  unsetenv("EPX_GIN_LOOP_STALL_AFTER_S");
  auto put_and_test = [&](uint64_t value, int64_t for_ms) {
    o.local[0] = value;
    void* req = nullptr;
    EXPECT_EQ(o.g.iput(o.coll, 0, o.mh, 8, 256, o.mh, 0, &req), gl::ncclSuccess);
    int done = 0;
    const auto t0 = std::chrono::steady_clock::now();
    while (!done && std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(for_ms))
      EXPECT_EQ(o.g.test(o.coll, req, &done), gl::ncclSuccess);
    return done;
  };
  EXPECT_EQ(put_and_test(0x11, 200), 1) << "before the stall a put completes";
  EXPECT_EQ(o.local[32], 0x11u);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(put_and_test(0x22, 200), 0) << "after the stall no put is reported done";
  EXPECT_EQ(o.local[32], 0x22u) << "the bytes still land";
  setenv("EPX_GIN_LOOP_STALL_AFTER_S", "-1", 1);
  void* ctx = nullptr;
  EXPECT_EQ(o.g.init(&ctx, 7, capture_log), gl::ncclInvalidArgument);
  EXPECT_TRUE(logged("EPX_GIN_LOOP_STALL_AFTER_S='-1'")) << all_logs();
  unsetenv("EPX_GIN_LOOP_STALL_AFTER_S");
}

TEST(GinLoopback, ConnectNamesTheMissingRank) {
  // Rank 0 of 2 connects but rank 1 never does: the deadline names it.
  ASSERT_NE(plugin().gin, nullptr);
  const auto& g = *plugin().gin;
  void *ctx = nullptr, *lc0 = nullptr, *lc1 = nullptr, *coll = nullptr;
  char h0[128], h1[128];
  setenv("EPX_GIN_LOOP_TIMEOUT_S", "0.3", 1);  // read by init
  const auto rc = g.init(&ctx, 9, capture_log);
  setenv("EPX_GIN_LOOP_TIMEOUT_S", "10", 1);
  ASSERT_EQ(rc, gl::ncclSuccess);
  ASSERT_EQ(g.listen(ctx, 0, h0, &lc0), gl::ncclSuccess);
  ASSERT_EQ(g.listen(ctx, 0, h1, &lc1), gl::ncclSuccess);
  void* hs[2] = {h0, h1};
  EXPECT_EQ(g.connect(ctx, hs, 2, 0, lc0, &coll), gl::ncclSystemError);
  EXPECT_TRUE(logged("rank(s) 1 to connect to rank 0")) << all_logs();
  EXPECT_EQ(g.closeListen(lc0), gl::ncclSuccess);
  EXPECT_EQ(g.closeListen(lc1), gl::ncclSuccess);
  EXPECT_EQ(g.finalize(ctx), gl::ncclSuccess);
}

// ---- peers that lie about sizes --------------------------------------------------------

/// Rank 1 of 2 played by this test on the mesh itself (it holds the handles,
/// so rank 0 admits it), sending an inbox memfd of `inbox_bytes` and, unless
/// `inbox_only`, a registration record `rec` with a memfd of `fd_bytes`.
/// Rank 0 is the plugin; returns rank 0's regMrSym result (or connect's if
/// that failed), and `what` the logs.
gl::ncclResult_t run_with_lying_peer(std::size_t inbox_bytes, bool inbox_only,
                                     const gl::RegRecord& rec, std::size_t fd_bytes) {
  namespace hm = epx::host_mesh;
  const auto& g = *plugin().gin;
  void *ctx = nullptr, *lc0 = nullptr, *coll = nullptr;
  char h0[gl::NCCL_NET_HANDLE_MAXSIZE];
  EXPECT_EQ(g.init(&ctx, 13, capture_log), gl::ncclSuccess);
  EXPECT_EQ(g.listen(ctx, 0, h0, &lc0), gl::ncclSuccess);
  hm::MeshHandle h1{};
  hm::MeshListener l1(&h1);
  std::string rogue_error;
  std::thread rogue([&] {
    auto memfd = [](std::size_t bytes) {
      const int fd = memfd_create("lying-peer", MFD_CLOEXEC);
      if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) throw hm::MeshError("memfd");
      return fd;
    };
    auto close_all = [](std::vector<hm::Mesh::Item>& items) {
      for (auto& it : items)
        if (it.fd >= 0) close(it.fd);
    };
    try {
      hm::Mesh m({reinterpret_cast<const hm::MeshHandle*>(h0), &h1}, 1, l1, 10);
      const int inbox = memfd(inbox_bytes);
      auto items = m.allgather("inbox", inbox, "connect (signal inbox exchange)");
      close(inbox);
      close_all(items);
      if (inbox_only) return;
      const int window = memfd(fd_bytes);
      items = m.allgather(std::string(reinterpret_cast<const char*>(&rec), sizeof rec), window,
                          "regMrSym");
      close(window);
      close_all(items);
    } catch (const std::exception& e) {
      rogue_error = e.what();
    }
  });
  void* hs[2] = {h0, &h1};
  gl::ncclResult_t rc = g.connect(ctx, hs, 2, 0, lc0, &coll);
  void* window = nullptr;
  if (rc == gl::ncclSuccess) {
    EXPECT_EQ(plugin().alloc(4096, &window), 0);
    void *mh = nullptr, *gh = nullptr;
    rc = g.regMrSym(coll, window, 4096, gl::NCCL_PTR_HOST, 0, &mh, &gh);
    if (rc == gl::ncclSuccess) g.deregMrSym(coll, mh);
  }
  rogue.join();
  EXPECT_EQ(rogue_error, "");
  if (coll) g.closeColl(coll);  // its barrier fails at once: the peer is gone
  if (window) plugin().free(window);
  EXPECT_EQ(g.closeListen(lc0), gl::ncclSuccess);
  EXPECT_EQ(g.finalize(ctx), gl::ncclSuccess);
  return rc;
}

std::size_t inbox_bytes_of_two() {
  return static_cast<std::size_t>(gl::SignalRing::bytes_for(kDepth)) * 2;
}

// A peer whose registration claims an allocation larger than the descriptor
// it sends is refused by name before the mapping is used (a mapping past the
// end of a memfd would fault at first touch).
TEST(GinLoopback, APeerClaimingMoreThanItsDescriptorHoldsIsRefused) {
  ASSERT_NE(plugin().gin, nullptr);
  const gl::RegRecord rec{1,
                          4096,
                          1 << 20,
                          0,
                          static_cast<uint32_t>(gl::RegionKind::kExportable),
                          static_cast<uint32_t>(gl::NCCL_PTR_HOST),
                          0,
                          0};
  EXPECT_NE(run_with_lying_peer(inbox_bytes_of_two(), false, rec, 4096), gl::ncclSuccess);
  EXPECT_TRUE(logged("rank 1 sent a descriptor of 4096 bytes for an allocation of 1048576 bytes"))
      << all_logs();
}

// A registration whose offset plus size wraps past 2^64 into the allocation
// is refused by name (the sum is never computed).
TEST(GinLoopback, APeerRegionOutsideItsAllocationIsRefused) {
  ASSERT_NE(plugin().gin, nullptr);
  const gl::RegRecord rec{1,
                          4096,
                          4096,
                          ~uint64_t{0} - 15,
                          static_cast<uint32_t>(gl::RegionKind::kExportable),
                          static_cast<uint32_t>(gl::NCCL_PTR_HOST),
                          0,
                          0};
  EXPECT_NE(run_with_lying_peer(inbox_bytes_of_two(), false, rec, 4096), gl::ncclSuccess);
  EXPECT_TRUE(
      logged("rank 1 describes its registration as 4096 bytes at offset "
             "18446744073709551600 of an allocation of 4096 bytes"))
      << all_logs();
}

// A signal inbox shorter than the rings rank 0 maps of it is refused at connect.
TEST(GinLoopback, APeerInboxShorterThanItsRingsIsRefused) {
  ASSERT_NE(plugin().gin, nullptr);
  EXPECT_NE(run_with_lying_peer(64, true, gl::RegRecord{}, 0), gl::ncclSuccess);
  EXPECT_TRUE(logged("rank 1's signal inbox is a descriptor of 64 bytes, shorter than the " +
                     std::to_string(inbox_bytes_of_two()) + " bytes to map"))
      << all_logs();
}

// ---- the signal ring itself ---------------------------------------------------------------

TEST(GinLoopback, SignalRingWrapsAndRefusesWhenFull) {
  std::vector<uint64_t> mem(gl::SignalRing::bytes_for(4) / 8, 0);
  gl::SignalRing ring(mem.data(), 4);
  uint64_t next = 0, applied = 0;
  for (int round = 0; round < 5; ++round) {
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(ring.push({1, 8, ++next, 0}));
    EXPECT_FALSE(ring.push({1, 8, 99, 0})) << "a full ring must refuse";
    EXPECT_EQ(ring.drain([&](const gl::SignalEntry& e) { return e.add == ++applied; }), 4u);
  }
  EXPECT_EQ(applied, 20u);
  EXPECT_EQ(ring.in_flight(), 0u);
}

// ---- the target's adds, merged ------------------------------------------------------------

/// One entry per word, its adds summed (wrapping at 2^64 as the word does),
/// in the order the words were first seen; flags kept from the first entry.
TEST(GinLoopback, MergedAddsSumPerWordInFirstSeenOrder) {
  uint64_t w[3] = {0, 0, 0};
  std::vector<gl::WordAdd> adds{{&w[1], 1, true}, {&w[0], 5, false},    {&w[1], 2, true},
                                {&w[2], 7, true}, {&w[1], ~0ull, true}, {&w[0], 1, false}};
  gl::merge_word_adds(adds);
  ASSERT_EQ(adds.size(), 3u);
  EXPECT_EQ(adds[0].word, &w[1]);
  EXPECT_EQ(adds[0].add, 2u);  // 1 + 2 + (2^64 - 1)
  EXPECT_TRUE(adds[0].device);
  EXPECT_EQ(adds[1].word, &w[0]);
  EXPECT_EQ(adds[1].add, 6u);
  EXPECT_FALSE(adds[1].device);
  EXPECT_EQ(adds[2].word, &w[2]);
  EXPECT_EQ(adds[2].add, 7u);
  std::vector<gl::WordAdd> none;
  gl::merge_word_adds(none);
  EXPECT_TRUE(none.empty());
  // Many adds over few words, each word's adds interleaved with the others'
  uint64_t many[10] = {};
  std::vector<gl::WordAdd> big;
  for (int i = 0; i < 500; ++i)
    big.push_back({&many[(i * 7) % 10], static_cast<uint64_t>(i), true});
  gl::merge_word_adds(big);
  ASSERT_EQ(big.size(), 10u);
  for (int k = 0; k < 10; ++k) {
    EXPECT_EQ(big[static_cast<std::size_t>(k)].word, &many[(k * 7) % 10]);
    uint64_t sum = 0;
    for (int i = 0; i < 500; ++i)
      if ((i * 7) % 10 == (k * 7) % 10) sum += static_cast<uint64_t>(i);
    EXPECT_EQ(big[static_cast<std::size_t>(k)].add, sum);
  }
}

}  // namespace
