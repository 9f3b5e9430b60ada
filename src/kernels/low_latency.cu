// Low-latency dispatch and combine (decode): the launchers for every
// transport of dev::AnyTransport. The kernels, their protocol and a launch
// helper per op and transport type are in low_latency/ (kernels.cuh); a module's
// transport (dev::ModuleTransport) brings its own instantiations, called
// through its table.
#include "kernels/launch_on.hpp"
#include "kernels/low_latency/kernels.cuh"

namespace epx::kernels {

void launch_ll_dispatch(const dev::AnyTransport& t, const LlDispatchSendArgs& sa,
                        const LlDispatchRecvArgs& ra, int num_blocks, int send_blocks, int phases,
                        cudaStream_t stream) {
  launch_on(
      t,
      phases == kLlBothPhases  ? "low-latency dispatch"
      : phases == kLlSendPhase ? "low-latency dispatch send"
                               : "low-latency dispatch receive",
      [&](const auto& tt) {
        launch_ll_dispatch_for(tt, sa, ra, num_blocks, send_blocks, phases, stream);
      },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ll_dispatch(tt, sa, ra, num_blocks, send_blocks, phases, stream, err, n);
      });
}

void launch_ll_combine(const dev::AnyTransport& t, const LlCombineSendArgs& sa,
                       const LlCombineRecvArgs& ra, int num_blocks, int phases,
                       cudaStream_t stream) {
  launch_on(
      t,
      phases == kLlBothPhases  ? "low-latency combine"
      : phases == kLlSendPhase ? "low-latency combine send"
                               : "low-latency combine receive",
      [&](const auto& tt) { launch_ll_combine_for(tt, sa, ra, num_blocks, phases, stream); },
      [&](const ModuleKernels& k, const auto& tt, char* err, std::size_t n) {
        return k.ll_combine(tt, sa, ra, num_blocks, phases, stream, err, n);
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
