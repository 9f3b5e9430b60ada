#include "transport/proxy/libfabric_engine_impl.hpp"

namespace epx::proxy {

using fabric::CommunicatorExchange;
using fabric::domains_of;
using fabric::LibfabricEngine;

std::unique_ptr<Exchange> make_communicator_exchange(Communicator& comm) {
  return std::make_unique<CommunicatorExchange>(comm);
}

std::unique_ptr<Engine> make_libfabric_engine(std::shared_ptr<Exchange> exchange, int num_channels,
                                              const LibfabricOptions& options) {
  return std::make_unique<LibfabricEngine>(std::move(exchange), num_channels, options);
}

std::vector<std::string> libfabric_domains(const std::string& provider) {
  return domains_of(provider);
}

LibfabricStats libfabric_stats(const Engine& engine) {
  const auto* e = dynamic_cast<const LibfabricEngine*>(&engine);
  require(e != nullptr, "engine",
          std::string("is not a libfabric engine (it is '") + engine.name() + "')");
  return e->stats();
}

}  // namespace epx::proxy
