// The libfabric engine's entry points in a build without libfabric
// (EPX_WITH_LIBFABRIC=OFF, or no libfabric-dev): asking for the engine is an
// error that says how to get it.
#include "epx/error.hpp"
#include "transport/proxy/libfabric_engine.hpp"

namespace epx::proxy {
namespace {
[[noreturn]] void absent() {
  throw Error(ErrorCode::kUnsupported,
              "proxy engine libfabric: this EPX was built without libfabric (install libfabric-dev "
              "and rebuild; CMake option EPX_WITH_LIBFABRIC)");
}
}  // namespace

std::unique_ptr<Exchange> make_communicator_exchange(Communicator&) {
  absent();
}
std::unique_ptr<Engine> make_libfabric_engine(std::shared_ptr<Exchange>, int,
                                              const LibfabricOptions&) {
  absent();
}
LibfabricStats libfabric_stats(const Engine&) {
  absent();
}
std::vector<std::string> libfabric_domains(const std::string&) {
  absent();
}

}  // namespace epx::proxy
