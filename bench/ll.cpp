// epx-bench ll: low-latency dispatch/combine (being written; see issue 4).
#include <stdexcept>

#include "bench/common.hpp"

namespace epx::bench {
void run_ll(World&, const Options&, nlohmann::json&) {
  throw std::runtime_error("epx-bench ll: the low-latency kernels are not built yet");
}
}  // namespace epx::bench
