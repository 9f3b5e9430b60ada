#include "transport/backend.hpp"

#include "core/env.hpp"
#include "epx/error.hpp"

namespace epx::transport {

std::unique_ptr<Backend> make_backend(const std::string& requested, Communicator& comm) {
  std::string name = requested.empty() ? "auto" : requested;
  if (name == "auto") name = env::get("EPX_BACKEND").value_or("auto");
  if (name == "auto" || name == "nvlink") return make_nvlink_backend(comm);
  if (name == "nccl" || name == "nvshmem" || name == "proxy")
    throw Error(ErrorCode::kUnsupported,
                "backend: '" + name + "' is not built yet; this build serves 'nvlink' (auto)");
  throw Error(ErrorCode::kInvalidArgument,
              "backend: must be one of auto|nvlink|nccl|nvshmem|proxy, got '" + name + "'");
}

}  // namespace epx::transport
