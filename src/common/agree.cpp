#include "common/agree.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "epx/error.hpp"

namespace epx::detail {

namespace {
/// One rank's word in the exchange: the same plain bytes on every rank.
struct Readiness {
  int32_t failed;  ///< 1: its local work threw
  int32_t code;    ///< the ErrorCode it threw (kInternal for other exceptions)
  char error[400];
};

std::string without_prefix(const char* what) {
  std::string s = what;
  return s.rfind("epx: ", 0) == 0 ? s.substr(5) : s;
}
}  // namespace

void agree_before(const char* step, int rank, const AllGather& allgather,
                  const std::function<void()>& local) {
  Readiness mine;
  std::memset(&mine, 0, sizeof(mine));
  std::exception_ptr failure;
  try {
    local();
  } catch (const Error& e) {
    failure = std::current_exception();
    mine.failed = 1;
    mine.code = static_cast<int32_t>(e.code());
    std::snprintf(mine.error, sizeof(mine.error), "%s", without_prefix(e.what()).c_str());
  } catch (const std::exception& e) {
    failure = std::current_exception();
    mine.failed = 1;
    mine.code = static_cast<int32_t>(ErrorCode::kInternal);
    std::snprintf(mine.error, sizeof(mine.error), "%s", e.what());
  }
  std::vector<uint8_t> gathered;
  try {
    gathered = allgather(&mine, sizeof(mine));
  } catch (...) {
    if (failure) std::rethrow_exception(failure);
    throw;
  }
  if (failure) std::rethrow_exception(failure);
  const std::size_t n = gathered.size() / sizeof(Readiness);
  int first = -1, failed = 0;
  Readiness theirs{};
  for (std::size_t r = 0; r < n; ++r) {
    Readiness x;
    std::memcpy(&x, gathered.data() + r * sizeof(Readiness), sizeof(x));
    if (!x.failed) continue;
    if (first < 0) first = static_cast<int>(r), theirs = x;
    ++failed;
  }
  if (first < 0) return;
  theirs.error[sizeof(theirs.error) - 1] = '\0';
  const int32_t c = theirs.code;
  const ErrorCode code = c >= 0 && c <= static_cast<int32_t>(ErrorCode::kInternal)
                             ? static_cast<ErrorCode>(c)
                             : ErrorCode::kInternal;
  throw Error(code, std::string(step) + ": rank " + std::to_string(first) +
                        " failed before joining it: " + theirs.error +
                        (failed > 1 ? " (" + std::to_string(failed - 1) + " more rank(s) failed)"
                                    : std::string()) +
                        "; rank " + std::to_string(rank) +
                        " did not join either (the ranks agree first, so none waits for it)");
}

}  // namespace epx::detail
