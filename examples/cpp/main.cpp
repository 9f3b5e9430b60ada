// examples/cpp/main.cpp - EPX from C++ through the installed CMake package
// (find_package(epx), epx::epx).
//
// Always: sizes the communication buffers for a DeepSeek-V3-like layer with
// the library's own hints, and routes a small batch through the CPU
// reference model (epx::ref). With a CUDA GPU: runs that batch through a
// high-throughput dispatch and combine on one in-process rank and checks
// both against the reference. Without one it says so and exits 0, so CI can
// run it on machines without GPUs.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "epx/reference.hpp"

namespace {

// The small batch: tokens, hidden size (BF16), top-k, experts.
constexpr int kTokens = 64, kHidden = 1024, kTopk = 4, kExperts = 16;

/// Fails with the CUDA error's name (examples have no error framework).
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw epx::Error(epx::ErrorCode::kCuda, std::string(what) + ": " + cudaGetErrorString(e));
}

/// A device copy of `host`, freed with the returned pointer.
template <class T>
std::shared_ptr<void> to_device(const std::vector<T>& host) {
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, host.size() * sizeof(T)), "cudaMalloc");
  std::shared_ptr<void> owner(p, [](void* q) { cudaFree(q); });
  cuda_check(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
             "cudaMemcpy");
  return owner;
}

template <class T>
std::vector<T> to_host(const epx::Tensor& t) {
  std::vector<T> out(static_cast<std::size_t>(t.numel()));
  cuda_check(cudaMemcpy(out.data(), t.view.data, out.size() * sizeof(T), cudaMemcpyDeviceToHost),
             "cudaMemcpy");
  return out;
}

void print_size_hints() {
  // A DeepSeek-V3-like layer: hidden 7168, top-8 of 256 experts; 8 ranks on
  // one node for high throughput, 16 ranks (2 nodes) at 128 tokens each for
  // low latency.
  const epx::Config ht = epx::get_dispatch_config(8);
  std::printf(
      "high-throughput, 8 ranks: Config{num_sms=%d, send tokens=%d, recv tokens=%d}, "
      "num_nvl_bytes=%zu\n",
      ht.num_sms, ht.num_max_send_tokens, ht.num_max_recv_tokens,
      ht.get_nvl_buffer_size_hint(7168 * 2, 8, 8));
  std::printf("high-throughput, 16 ranks in nodes of 8, 4096 tokens: num_nvl_bytes=%zu\n",
              epx::Buffer::get_internode_nvl_size_hint(4096, 7168, 16, 8, 8));
  std::printf("low-latency, 16 ranks, 128 tokens: num_rdma_bytes=%zu\n",
              epx::Buffer::get_low_latency_rdma_size_hint(128, 7168, 16, 256));
}

/// One in-process rank: dispatch the batch to its experts (all on this rank)
/// and combine it back; both results must equal the reference's bits.
bool run_on_gpu(const epx::ref::HtInput& in, const epx::ref::HtDispatchOutput& want_dispatch,
                const epx::ref::HtCombineOutput& want_combine) {
  auto comms = epx::Communicator::create_in_process(1);
  epx::BufferOptions options;
  options.num_nvl_bytes = static_cast<int64_t>(
      epx::get_dispatch_config(1).get_nvl_buffer_size_hint(2 * kHidden, 1, kTopk));
  epx::Buffer buffer(comms[0], options);
  std::printf("GPU %d: backend %s, %zu buffer bytes\n", buffer.device(), buffer.backend_name(),
              buffer.buffer_bytes());

  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const int dev = buffer.device();
  auto d_x = to_device(in.x_bf16);
  auto d_topk = to_device(in.topk_idx);
  auto d_weights = to_device(in.topk_weights);

  epx::StreamArgs s;
  s.stream = stream;
  const auto topk_view =
      epx::TensorView::contiguous(d_topk.get(), epx::DType::kI64, {kTokens, kTopk}, dev);
  const epx::Layout layout = buffer.get_dispatch_layout(topk_view, kExperts, s);

  epx::DispatchArgs d;
  d.x = epx::TensorView::contiguous(d_x.get(), epx::DType::kBF16, {kTokens, kHidden}, dev);
  d.topk_idx = topk_view;
  d.topk_weights =
      epx::TensorView::contiguous(d_weights.get(), epx::DType::kF32, {kTokens, kTopk}, dev);
  d.set_layout(layout);
  d.streams = s;
  const epx::DispatchResult got = buffer.dispatch(d);

  // The experts' output: here the received rows themselves, so the combine
  // sums each token's row once per rank it reached (once, on one rank).
  epx::CombineArgs c;
  c.x = got.recv_x.view;
  c.handle = got.handle;
  c.streams = s;
  const epx::CombineResult combined = buffer.combine(c);
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");

  const bool dispatch_ok =
      got.recv_x.size(0) == want_dispatch.num_recv_tokens &&
      to_host<uint16_t>(got.recv_x) == want_dispatch.recv_x_bf16 &&
      got.num_recv_tokens_per_expert == want_dispatch.num_recv_tokens_per_expert;
  const bool combine_ok = to_host<uint16_t>(combined.combined_x) == want_combine.combined_x;
  std::printf("dispatch: %lld rows received, %s the reference\n",
              static_cast<long long>(got.recv_x.size(0)), dispatch_ok ? "equal to" : "UNLIKE");
  std::printf("combine: [%d, %d] rows, %s the reference\n", kTokens, kHidden,
              combine_ok ? "equal to" : "UNLIKE");
  buffer.destroy();
  cudaStreamDestroy(stream);
  return dispatch_ok && combine_ok;
}

}  // namespace

int main() {
  try {
    std::printf("EPX %s\n", EPX_VERSION_STRING);
    print_size_hints();

    // The batch and what one rank holding every expert must make of it.
    epx::ref::HtInput in;
    in.num_tokens = kTokens;
    in.x_bf16 = epx::ref::random_bf16(std::size_t{kTokens} * kHidden, /*seed=*/1);
    in.topk_idx = epx::ref::random_topk(kTokens, kTopk, kExperts, /*masked=*/0.0, /*seed=*/2);
    in.topk_weights.assign(std::size_t{kTokens} * kTopk, 0.25f);
    const auto layout = epx::ref::get_dispatch_layout(in.topk_idx, kTokens, kTopk, kExperts, 1);
    std::printf("reference: %d tokens, top-%d of %d experts; tokens of expert 0: %d\n", kTokens,
                kTopk, kExperts, layout.num_tokens_per_expert[0]);
    const auto want_dispatch = epx::ref::ht_dispatch({in}, kHidden, kTopk, kExperts, 1);
    epx::ref::HtCombineInput cin;
    cin.x = want_dispatch[0].recv_x_bf16;
    const auto want_combine = epx::ref::ht_combine({in}, {cin}, kHidden, kTopk, kExperts);

    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
      cudaGetLastError();  // clear the error a machine without a driver reports
      std::printf("no CUDA GPU: size hints and reference only\n");
      return 0;
    }
    return run_on_gpu(in, want_dispatch[0], want_combine[0]) ? 0 : 1;
  } catch (const epx::Error& e) {
    std::fprintf(stderr, "epx error (%s): %s\n", epx::to_string(e.code()), e.what());
    return 1;
  }
}
