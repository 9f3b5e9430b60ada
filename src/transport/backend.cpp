#include "transport/backend.hpp"

#include "core/env.hpp"
#include "epx/buffer.hpp"
#include "epx/error.hpp"

namespace epx::transport {

std::unique_ptr<Backend> make_backend(const std::string& requested, Communicator& comm) {
  std::string name = requested.empty() ? "auto" : requested;
  if (name == "auto") name = env::get("EPX_BACKEND").value_or("auto");
  if (comm.in_process()) {
    if (name == "auto" || name == "in_process") return make_in_process_backend(comm);
    if (name == "nvlink" || name == "nccl" || name == "nvshmem" || name == "proxy")
      throw Error(ErrorCode::kUnsupported,
                  "backend: '" + name +
                      "' needs an NCCL communicator (Communicator::create or from_env); ranks "
                      "from Communicator::create_in_process use 'in_process' (auto)");
  }
  if (name == "in_process")
    throw Error(ErrorCode::kUnsupported,
                "backend: 'in_process' needs ranks from Communicator::create_in_process");
  if (name == "auto" || name == "nvlink") return make_nvlink_backend(comm);
  if (name == "nccl" || name == "nvshmem" || name == "proxy")
    throw Error(ErrorCode::kUnsupported,
                "backend: '" + name + "' is not built yet; this build serves 'nvlink' (auto)");
  throw Error(
      ErrorCode::kInvalidArgument,
      "backend: must be one of auto|nvlink|in_process|nccl|nvshmem|proxy, got '" + name + "'");
}

}  // namespace epx::transport
