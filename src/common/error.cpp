#include "epx/error.hpp"

namespace epx {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kBufferTooSmall:
      return "buffer too small";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kCuda:
      return "CUDA error";
    case ErrorCode::kNccl:
      return "NCCL error";
    case ErrorCode::kBootstrap:
      return "bootstrap error";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kInternal:
      return "internal error";
  }
  return "error";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error("epx: " + message), code_(code) {}

void require(bool ok, const char* arg, const std::string& rule) {
  if (!ok) throw Error(ErrorCode::kInvalidArgument, std::string(arg) + ": " + rule);
}

}  // namespace epx
