#include "gpu/harness.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "epx/reference.hpp"

namespace epx::test {

namespace {
thread_local World* t_world = nullptr;  // set on the threads of in-process ranks
thread_local bool t_failed = false;     // this thread reported a failure in this test

/// gtest calls OnTestPartResult on the thread that reported the result.
class RankFailureListener : public ::testing::EmptyTestEventListener {
  void OnTestStart(const ::testing::TestInfo&) override { t_failed = false; }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) t_failed = true;
  }
};
}  // namespace

bool rank_failed() {
  return t_failed;
}

::testing::TestEventListener* new_rank_failure_listener() {
  return new RankFailureListener();
}

World& world() {
  static World w;
  return t_world ? *t_world : w;
}

std::vector<World>& in_process_worlds() {
  static std::vector<World> v;
  return v;
}

int sm_share(const Communicator& comm) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, comm.device()) != cudaSuccess)
    throw Error(ErrorCode::kCuda, "cudaDeviceGetAttribute");
  return std::max(1, sms / comm.ranks_on_device());
}

int sm_budget() {
  return sm_share(*world().comm);
}

namespace {
const World& any_world() {
  auto& worlds = in_process_worlds();
  return worlds.empty() ? world() : worlds[0];
}
}  // namespace

const char* suite_skip_reason(const char* suite) {
  const World& w = any_world();
  if (std::string(suite) == "HighThroughput" && w.buffer && w.buffer->num_rdma_ranks() > 1)
    return "the high-throughput kernels run within one node; this world has virtual nodes "
           "(EPX_RANKS_PER_NODE)";
  if (std::string(suite) == "Internode" && (!w.buffer || w.buffer->num_rdma_ranks() < 2))
    return "needs ranks in several (virtual) nodes (EPX_RANKS_PER_NODE)";
  return nullptr;
}

bool same_node(int a, int b) {
  const int rpn = any_world().buffer->num_nvl_ranks();
  return a / rpn == b / rpn;
}

void on_every_rank(void (*body)()) {
  auto& worlds = in_process_worlds();
  if (worlds.empty()) return body();
  std::vector<std::jthread> threads;
  for (auto& w : worlds)
    threads.emplace_back([&w, body] {
      SCOPED_TRACE("rank " + std::to_string(w.rank));
      t_world = &w;
      if (cudaSetDevice(w.comm->device()) != cudaSuccess) {
        ADD_FAILURE() << "rank " << w.rank << ": cudaSetDevice failed";
        return;
      }
      try {
        body();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << w.rank << " threw: " << e.what();
      }
    });
}

namespace {
/// Device memory handed out by bumping a pointer, never freed or reused while
/// the arena lives (a graph keeps using what its capture allocated).
struct CaptureArena {
  char* base = nullptr;
  std::size_t size = 0;
  std::atomic<std::size_t> used{0};
  explicit CaptureArena(std::size_t bytes) : size(bytes) {
    if (cudaMalloc(reinterpret_cast<void**>(&base), bytes) != cudaSuccess)
      throw Error(ErrorCode::kCuda, "cudaMalloc (capture arena)");
  }
  ~CaptureArena() { cudaFree(base); }
  void* take(std::size_t bytes) {
    const std::size_t n = (std::max<std::size_t>(bytes, 1) + 255) & ~std::size_t{255};
    const std::size_t at = used.fetch_add(n);
    if (at + n > size)
      throw Error(ErrorCode::kBufferTooSmall,
                  "test capture arena exhausted: " + std::to_string(at + n) + " > " +
                      std::to_string(size) + " bytes");
    return base + at;
  }
};

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess)
    throw Error(ErrorCode::kCuda, "cudaStreamIsCapturing");
  return st == cudaStreamCaptureStatusActive;
}
}  // namespace

Allocator poisoning_allocator(bool capture_arena) {
  Allocator base = default_allocator();
  std::shared_ptr<CaptureArena> arena;
  if (capture_arena) arena = std::make_shared<CaptureArena>(std::size_t{256} << 20);
  return [base, arena](DType dtype, const std::vector<int64_t>& shape, cudaStream_t stream) {
    Tensor t;
    if (arena && capturing(stream)) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      void* p = arena->take(static_cast<std::size_t>(n) * element_size(dtype));
      int dev = 0;
      if (cudaGetDevice(&dev) != cudaSuccess) throw Error(ErrorCode::kCuda, "cudaGetDevice");
      t.view = TensorView::contiguous(p, dtype, shape, dev);
      t.owner = arena;  // keeps the arena, not the bytes: they are never reused
    } else {
      t = base(dtype, shape, stream);
    }
    if (t.view.nbytes() > 0) {
      cudaError_t e = cudaMemsetAsync(t.view.data, 0xff, t.view.nbytes(), stream);
      if (e != cudaSuccess) throw Error(ErrorCode::kCuda, cudaGetErrorString(e));
    }
    return t;
  };
}

Allocator int32_unaligned_allocator() {
  Allocator base = poisoning_allocator();
  return [base](DType dtype, const std::vector<int64_t>& shape, cudaStream_t stream) {
    if (dtype != DType::kI32) return base(dtype, shape, stream);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    Tensor raw = base(DType::kFP8E4M3, {4 * n + 4}, stream);  // bytes
    Tensor t;
    t.view = TensorView::contiguous(static_cast<char*>(raw.view.data) + 4, DType::kI32, shape,
                                    raw.view.device);
    t.owner = raw.owner;
    return t;
  };
}

bool instantiate_on_every_rank(cudaGraph_t graph, cudaGraphExec_t* exec, cudaStream_t stream) {
  bool ok = cudaGraphInstantiateWithFlags(exec, graph, cudaGraphInstantiateFlagAutoFreeOnLaunch) ==
                cudaSuccess &&
            cudaGraphUpload(*exec, stream) == cudaSuccess &&
            cudaStreamSynchronize(stream) == cudaSuccess;
  return all_ranks(ok);
}

DeviceArray<uint8_t> to_device_bytes(const void* data, std::size_t bytes) {
  // Stream-ordered on the rank's stream: cudaFree would wait for the whole
  // device, which in-process ranks share, while a peer's kernel may wait for
  // this rank's next call.
  cudaStream_t s = world().stream;
  void* p = nullptr;
  if (cudaMallocAsync(&p, bytes ? bytes : 16, s) != cudaSuccess)
    throw Error(ErrorCode::kCuda, "cudaMallocAsync");
  if (bytes && cudaMemcpyAsync(p, data, bytes, cudaMemcpyHostToDevice, s) != cudaSuccess)
    throw Error(ErrorCode::kCuda, "cudaMemcpyAsync");
  if (cudaStreamSynchronize(s) != cudaSuccess)
    throw Error(ErrorCode::kCuda, "cudaStreamSynchronize");
  return {std::shared_ptr<void>(p, [s](void* q) { cudaFreeAsync(q, s); }), bytes};
}

TensorView view(void* p, DType dtype, std::initializer_list<int64_t> shape) {
  int dev = 0;
  cudaGetDevice(&dev);
  return TensorView::contiguous(p, dtype, shape, dev);
}

std::vector<int64_t> random_topk(int T, int K, int E, double masked, uint64_t seed) {
  return ref::random_topk(T, K, E, masked, seed);
}

std::vector<uint16_t> random_bf16(std::size_t n, uint64_t seed, float scale) {
  return ref::random_bf16(n, seed, scale);
}

std::vector<float> random_f32(std::size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

void for_each_rank(int n, const std::function<void(int)>& f) {
  std::vector<std::exception_ptr> errors(n);
  World* caller = t_world;
  {
    std::vector<std::jthread> threads;
    threads.reserve(n);
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        t_world = caller;
        try {
          f(r);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

bool all_ranks(bool ok) {
  int mine = ok ? 1 : 0;
  auto all = world().comm->allgather(&mine, sizeof(int));
  for (std::size_t i = 0; i < all.size(); i += sizeof(int)) {
    int v;
    std::memcpy(&v, all.data() + i, sizeof(int));
    if (!v) return false;
  }
  return true;
}

struct StreamGate::State {
  std::atomic<bool> opened{false};
  std::atomic<bool> ran_out{false};
  double timeout_s = 60.0;
};

StreamGate::StreamGate(cudaStream_t stream, double timeout_s) : state_(std::make_shared<State>()) {
  state_->timeout_s = timeout_s;
  // The host function owns a reference of its own: it may run after the gate is gone.
  auto* ref = new std::shared_ptr<State>(state_);
  const cudaError_t e = cudaLaunchHostFunc(
      stream,
      [](void* arg) {
        auto* r = static_cast<std::shared_ptr<State>*>(arg);
        const auto start = std::chrono::steady_clock::now();
        const auto limit = std::chrono::duration<double>((*r)->timeout_s);
        while (!(*r)->opened.load(std::memory_order_acquire)) {
          if (std::chrono::steady_clock::now() - start > limit) {
            (*r)->ran_out = true;
            break;
          }
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        delete r;
      },
      ref);
  if (e != cudaSuccess) {
    delete ref;
    throw std::runtime_error(std::string("StreamGate: cudaLaunchHostFunc: ") +
                             cudaGetErrorString(e));
  }
}

StreamGate::~StreamGate() {
  open();
}

void StreamGate::open() {
  state_->opened.store(true, std::memory_order_release);
}

bool StreamGate::held_too_long() const {
  return state_->ran_out.load();
}

void kill_test_verdict(int victim, bool names_rank, const std::string& msg, ErrorCode code,
                       double secs) {
  const bool named = msg.find("rank " + std::to_string(victim)) != std::string::npos;
  const bool pass = (named || !names_rank) && code == ErrorCode::kTimeout && secs < 30;
  std::printf("KILL-TEST rank %d: %s after %.1f s%s: %s\n", world().rank, pass ? "PASS" : "FAIL",
              secs, named ? "" : " (not named)", msg.c_str());
  std::fflush(stdout);
  std::_Exit(pass ? 0 : 1);
}

std::optional<double> stall_after_s() {
  const char* v = std::getenv("EPX_GIN_LOOP_STALL_AFTER_S");
  if (v == nullptr || world().comm->in_process()) return std::nullopt;
  return std::atof(v);
}

void run_stall_test(double stall_after_s, const std::function<std::string(ErrorCode&)>& pair,
                    const std::vector<std::pair<std::string, std::string>>& kinds) {
  using clock = std::chrono::steady_clock;
  const double limit_s = stall_after_s + 60.0;
  const auto t0 = clock::now();
  auto last_ok = t0;
  std::string msg = "no error within the limit";
  ErrorCode code = ErrorCode::kInternal;
  long pairs = 0;
  while (std::chrono::duration<double>(clock::now() - t0).count() < limit_s) {
    const std::string e = pair(code);
    if (!e.empty()) {
      msg = e;
      break;
    }
    ++pairs;
    last_ok = clock::now();
  }
  const double secs = std::chrono::duration<double>(clock::now() - last_ok).count();
  const char* kind = nullptr;
  for (const auto& [text, label] : kinds)
    if (kind == nullptr && msg.find(text) != std::string::npos) kind = label.c_str();
  const bool named = kind != nullptr;
  std::printf("STALL-TEST rank %d: %s after %.1f s (%ld pairs before; %s): %s\n", world().rank,
              named && code == ErrorCode::kTimeout && secs < 30 ? "PASS" : "FAIL", secs, pairs,
              named ? kind : "a wait", msg.c_str());
  std::fflush(stdout);
  std::_Exit(named ? 0 : 1);
}

}  // namespace epx::test
