// Low-latency dispatch and combine (decode): the launchers for the built-in
// transports (dev::AnyTransport). The kernels, their protocol and a launch
// helper per op and transport type are in low_latency_kernels.cuh.
#include <type_traits>
#include <utility>
#include <variant>

#include "kernels/low_latency_kernels.cuh"

namespace epx::kernels {

void launch_ll_dispatch_send(const dev::AnyTransport& t, const LlDispatchSendArgs& a,
                             int num_blocks, cudaStream_t stream) {
  std::visit([&](const auto& tt) { launch_ll_dispatch_send_for(tt, a, num_blocks, stream); }, t);
}

void launch_ll_dispatch_recv(const dev::AnyTransport& t, const LlDispatchRecvArgs& a,
                             int num_blocks, cudaStream_t stream) {
  std::visit([&](const auto& tt) { launch_ll_dispatch_recv_for(tt, a, num_blocks, stream); }, t);
}

void launch_ll_dispatch_fused(const dev::AnyTransport& t, const LlDispatchSendArgs& sa,
                              const LlDispatchRecvArgs& ra, int num_blocks, int send_blocks,
                              cudaStream_t stream) {
  std::visit(
      [&](const auto& tt) {
        launch_ll_dispatch_fused_for(tt, sa, ra, num_blocks, send_blocks, stream);
      },
      t);
}

void launch_ll_combine_send(const dev::AnyTransport& t, const LlCombineSendArgs& a, int num_blocks,
                            cudaStream_t stream) {
  std::visit([&](const auto& tt) { launch_ll_combine_send_for(tt, a, num_blocks, stream); }, t);
}

void launch_ll_combine_recv(const dev::AnyTransport& t, const LlCombineRecvArgs& a, int num_blocks,
                            cudaStream_t stream, bool dependent) {
  std::visit(
      [&](const auto& tt) { launch_ll_combine_recv_for(tt, a, num_blocks, stream, dependent); }, t);
}

namespace {
/// preload_ll_kernels_of<T> for every transport T of dev::AnyTransport.
template <std::size_t... I>
void preload_ll_kernels_of_all(std::index_sequence<I...>) {
  (preload_ll_kernels_of<std::variant_alternative_t<I, dev::AnyTransport>>(), ...);
}
}  // namespace

void preload_ll_kernels() {
  preload_ll_kernels_of_all(std::make_index_sequence<std::variant_size_v<dev::AnyTransport>>{});
}

}  // namespace epx::kernels
