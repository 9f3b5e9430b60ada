// Low-latency dispatch and combine (decode): the launchers for every
// transport of dev::AnyTransport. The kernels, their protocol and a launch
// helper per op and transport type are in low_latency/ (kernels.cuh); a module's
// transport (dev::ModuleTransport) brings its own instantiations, called
// through its table.
#include "kernels/launch_on.hpp"
#include "kernels/low_latency/kernels.cuh"

namespace epx::kernels {

void launch_ll_dispatch_send(const dev::AnyTransport& t, const LlDispatchSendArgs& a,
                             int num_blocks, cudaStream_t stream) {
  launch_on(
      t, "low-latency dispatch send",
      [&](const auto& tt) { launch_ll_dispatch_send_for(tt, a, num_blocks, stream); },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ll_dispatch_send(tt, a, num_blocks, stream, err, n);
      });
}

void launch_ll_dispatch_recv(const dev::AnyTransport& t, const LlDispatchRecvArgs& a,
                             int num_blocks, cudaStream_t stream) {
  launch_on(
      t, "low-latency dispatch receive",
      [&](const auto& tt) { launch_ll_dispatch_recv_for(tt, a, num_blocks, stream); },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ll_dispatch_recv(tt, a, num_blocks, stream, err, n);
      });
}

void launch_ll_dispatch_fused(const dev::AnyTransport& t, const LlDispatchSendArgs& sa,
                              const LlDispatchRecvArgs& ra, int num_blocks, int send_blocks,
                              cudaStream_t stream) {
  launch_on(
      t, "low-latency dispatch",
      [&](const auto& tt) {
        launch_ll_dispatch_fused_for(tt, sa, ra, num_blocks, send_blocks, stream);
      },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ll_dispatch_fused(tt, sa, ra, num_blocks, send_blocks, stream, err, n);
      });
}

void launch_ll_combine_send(const dev::AnyTransport& t, const LlCombineSendArgs& a, int num_blocks,
                            cudaStream_t stream) {
  launch_on(
      t, "low-latency combine send",
      [&](const auto& tt) { launch_ll_combine_send_for(tt, a, num_blocks, stream); },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ll_combine_send(tt, a, num_blocks, stream, err, n);
      });
}

void launch_ll_combine_recv(const dev::AnyTransport& t, const LlCombineRecvArgs& a, int num_blocks,
                            cudaStream_t stream, bool dependent) {
  launch_on(
      t, "low-latency combine receive",
      [&](const auto& tt) { launch_ll_combine_recv_for(tt, a, num_blocks, stream, dependent); },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ll_combine_recv(tt, a, num_blocks, stream, dependent, err, n);
      });
}

namespace {
/// preload_ll_kernels_of<T> for every built-in transport T of dev::AnyTransport
/// (a module preloads its own when it loads).
template <class T>
void preload_if_built_in() {
  if constexpr (dev::kBuiltIn<T>) preload_ll_kernels_of<T>();
}
template <std::size_t... I>
void preload_ll_kernels_of_all(std::index_sequence<I...>) {
  (preload_if_built_in<std::variant_alternative_t<I, dev::AnyTransport>>(), ...);
}
}  // namespace

void preload_ll_kernels() {
  preload_ll_kernels_of_all(std::make_index_sequence<std::variant_size_v<dev::AnyTransport>>{});
}

}  // namespace epx::kernels
