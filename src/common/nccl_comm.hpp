// common/nccl_comm.hpp - how EPX ends an NCCL communicator it made.
#pragma once

#include <nccl.h>

namespace epx::detail {

/// Ends `comm` (nullptr: nothing). A communicator that failed asynchronously
/// (ncclCommGetAsyncError, or a query that itself fails), or one `abort`
/// asks for (a peer is presumed dead), is aborted: ncclCommDestroy would
/// wait for its operations, which a failed communicator never completes;
/// ncclCommAbort does not wait. A healthy one is destroyed. Results are not
/// checked: the callers are destructors and cleanup paths with nobody to
/// report to.
inline void close_nccl_comm(ncclComm_t comm, bool abort = false) {
  if (comm == nullptr) return;
  ncclResult_t state = ncclSuccess;
  const bool healthy = !abort && ncclCommGetAsyncError(comm, &state) == ncclSuccess &&
                       (state == ncclSuccess || state == ncclInProgress);
  if (healthy)
    ncclCommDestroy(comm);
  else
    ncclCommAbort(comm);
}

}  // namespace epx::detail
