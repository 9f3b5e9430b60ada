// common/check.cpp - the throwers behind EPX_CUDA_CHECK and EPX_NCCL_CHECK.
#include "common/check.hpp"

#include <nccl.h>

#include <sstream>

namespace epx {

namespace detail {

void throw_cuda(cudaError_t err, const char* expr, const char* file, int line) {
  std::ostringstream os;
  os << "CUDA error " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ") in " << expr
     << " at " << file << ":" << line;
  throw Error(ErrorCode::kCuda, os.str());
}

void throw_nccl(int err, const char* expr, const char* file, int line) {
  std::ostringstream os;
  os << "NCCL error " << err << " (" << ncclGetErrorString(static_cast<ncclResult_t>(err))
     << ") in " << expr << " at " << file << ":" << line;
  throw Error(ErrorCode::kNccl, os.str());
}

}  // namespace detail

}  // namespace epx
