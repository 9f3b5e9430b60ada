#include "transport/backend.hpp"

#include "common/env.hpp"
#include "epx/communicator.hpp"
#include "epx/error.hpp"

namespace epx::transport {

std::unique_ptr<Backend> make_backend(const std::string& requested, Communicator& comm) {
  std::string name = requested.empty() ? "auto" : requested;
  std::string from = "backend";
  if (name == "auto") {
    name = env::get("EPX_BACKEND").value_or("auto");
    if (name != "auto") from = "EPX_BACKEND";
  }
  if (name == "nccl" || name == "nvshmem" || name == "proxy")
    throw Error(ErrorCode::kUnsupported,
                from + ": '" + name +
                    "' is not built yet; this build serves 'nvlink' and 'in_process' (auto)");
  if (comm.in_process()) {
    if (name == "auto" || name == "in_process") return make_in_process_backend(comm);
    if (name == "nvlink")
      throw Error(ErrorCode::kUnsupported,
                  from +
                      ": 'nvlink' needs an NCCL communicator (Communicator::create or from_env); "
                      "ranks from Communicator::create_in_process use 'in_process' (auto)");
  } else {
    if (name == "in_process")
      throw Error(ErrorCode::kUnsupported,
                  from + ": 'in_process' needs ranks from Communicator::create_in_process");
    if (name == "auto" || name == "nvlink") return make_nvlink_backend(comm);
  }
  throw Error(
      ErrorCode::kInvalidArgument,
      from + ": must be one of auto|nvlink|in_process|nccl|nvshmem|proxy, got '" + name + "'");
}

}  // namespace epx::transport
