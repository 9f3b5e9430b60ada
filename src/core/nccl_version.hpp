// core/nccl_version.hpp - the NCCL a process loads at run time (ncclGetVersion)
// against the one EPX needs. Pure functions; Communicator::create applies them.
#pragma once

#include <string>

namespace epx::nccl_version {

struct Version {
  int major = 0, minor = 0, patch = 0;
};

/// The oldest NCCL with the device API and symmetric windows EPX uses.
inline constexpr Version kRequired{2, 28, 9};

/// ncclGetVersion's code -> (major, minor, patch). From NCCL 2.9 on the code is
/// major * 10000 + minor * 100 + patch; before, major * 1000 + minor * 100 + patch.
Version decode(int code);
/// "2.28.9"
std::string to_string(const Version& v);
/// Whether `found` is `needed` or newer.
bool at_least(const Version& found, const Version& needed);
/// Throws Error(kUnsupported) naming the version found (and `library`, the
/// file it was loaded from, when known) and the one needed, unless `code` is
/// kRequired or newer.
void check(int code, const std::string& library);
/// The loaded NCCL's ncclGetVersion code; `library` gets the file it was
/// loaded from when the loader says (else stays empty).
int loaded(std::string& library);
/// The NCCL GIN backend's device code holds NCCL's device structs
/// (ncclDevComm, the GIN contexts) as the headers it was compiled against lay
/// them out, and their layout may change with each minor release: it runs
/// only with the major and minor version of `built_code`. Throws
/// Error(kUnsupported) naming the loaded version (and `library`), the
/// supported one and the way out otherwise.
void check_gin_device_abi(int code, int built_code, const std::string& library);

}  // namespace epx::nccl_version
