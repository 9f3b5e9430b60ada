// common/agree.hpp - "agree before joining": the ranks exchange whether each
// is ready for a collective step of a library that waits for every rank
// without a deadline (NCCL's ncclCommSplit, ncclDevCommCreate, window
// registration), so that a rank that failed before it is named by the others
// instead of leaving them waiting in the library. The exchange is an
// all-gather with a deadline (Communicator::allgather). No CUDA here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace epx::detail {

/// Every rank's `bytes` from `data`, in rank order; throws epx::Error past
/// its deadline.
using AllGather = std::function<std::vector<uint8_t>(const void* data, std::size_t bytes)>;

/// Collective over the ranks of `allgather`: runs `local` (this rank's own
/// work before `step`: allocations, checks), then every rank tells the others
/// whether its `local` succeeded. Returns when all did. Otherwise throws on
/// every rank: a rank whose `local` threw rethrows that; the others throw
/// epx::Error with the first failed rank's ErrorCode, naming `step`, that
/// rank, its error and how many failed. When `local` failed, the error of
/// the exchange itself (a peer that never answers) is dropped for it.
void agree_before(const char* step, int rank, const AllGather& allgather,
                  const std::function<void()>& local);

}  // namespace epx::detail
