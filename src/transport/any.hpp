// transport/any.hpp - the one list of device transports. Kernels are
// instantiated for exactly these; a backend hands the core its region's
// device struct as an AnyTransport, and the kernels' launchers dispatch on it,
// so the core never names a transport type.
#pragma once

#include <optional>
#include <string>
#include <type_traits>
#include <variant>

#include "epx/error.hpp"
#include "transport/lsa.cuh"
#include "transport/nccl/device.cuh"
#include "transport/proxy/device.cuh"

namespace epx::kernels {
struct ModuleKernels;  // kernels/kernels.hpp
}

namespace epx::dev {

/// A transport whose device struct and kernels live in a module the core
/// loads at run time (the NVSHMEM backend, docs/nvshmem.md), so that libepx
/// holds no relocatable device code and no symbol of that library. Its data
/// is what the module's device struct holds (a NetworkTransportBase); its
/// launchers are the module's (`kernels`). Not a DeviceTransport itself: no
/// kernel of libepx is instantiated for it.
struct ModuleTransport : NetworkTransportBase {
  const kernels::ModuleKernels* kernels = nullptr;
};

using AnyTransport = std::variant<LsaTransport, ProxyTransport, NcclGinTransport, ModuleTransport>;

/// Whether libepx's own kernels are instantiated for transport type T.
template <class T>
inline constexpr bool kBuiltIn = !std::is_same_v<T, ModuleTransport>;

static_assert(DeviceTransport<LsaTransport>);
static_assert(DeviceTransport<ProxyTransport>);
static_assert(DeviceTransport<NcclGinTransport>);

/// The members every transport shares (rank, node, signals, deadline, ...).
inline TransportBase& base_of(AnyTransport& t) {
  return std::visit([](auto& x) -> TransportBase& { return x; }, t);
}
inline const TransportBase& base_of(const AnyTransport& t) {
  return std::visit([](const auto& x) -> const TransportBase& { return x; }, t);
}

/// The load/store view of `t` when every rank is in this rank's node (what
/// kernels that only use peer memory run on), else nullopt.
inline std::optional<LsaTransport> node_view(const AnyTransport& t) {
  const TransportBase& b = base_of(t);
  if (b.ranks_per_node != b.num_ranks || b.num_ranks > kMaxRanksPerNode) return std::nullopt;
  if (const auto* lsa = std::get_if<LsaTransport>(&t)) return *lsa;
  // The network transports keep the node's copies by local index; with one
  // node that is the rank.
  LsaTransport v{};
  static_cast<TransportBase&>(v) = b;
  std::visit(
      [&](const auto& x) {
        if constexpr (!std::is_same_v<std::decay_t<decltype(x)>, LsaTransport>)
          for (int r = 0; r < b.num_ranks; ++r) v.base[r] = x.base[r];
      },
      t);
  return v;
}

/// node_view(t), or epx::Error(kUnsupported) naming `what` when the group
/// spans several nodes.
inline LsaTransport require_node_view(const AnyTransport& t, const char* what) {
  if (auto v = node_view(t)) return *v;
  const TransportBase& b = base_of(t);
  throw Error(ErrorCode::kUnsupported,
              std::string(what) + ": runs within one node; the " + std::to_string(b.num_ranks) +
                  " ranks form " + std::to_string(b.num_ranks / b.ranks_per_node) + " nodes of " +
                  std::to_string(b.ranks_per_node) + " (ranks_per_node)");
}

}  // namespace epx::dev
