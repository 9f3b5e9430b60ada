// epx/error.hpp - the one exception type EPX throws.
#pragma once

#include <stdexcept>
#include <string>

namespace epx {

/// What went wrong, coarsely; `Error::what()` carries the full sentence.
enum class ErrorCode {
  kInvalidArgument,  ///< user input broke a documented rule (names the argument and the rule)
  kBufferTooSmall,   ///< the communication buffer cannot hold what the call needs
  kTimeout,          ///< a wait passed its deadline (names op, rank, peer, what was awaited)
  kCuda,             ///< a CUDA runtime call failed
  kNccl,             ///< an NCCL call failed
  kBootstrap,        ///< rank discovery or communicator setup failed
  kUnsupported,      ///< valid request this build or machine cannot serve
  kInternal,         ///< a bug in EPX
};

const char* to_string(ErrorCode code) noexcept;

/// Exception thrown by every EPX entry point. Python sees a subclass of
/// ValueError (kInvalidArgument), TimeoutError (kTimeout) or RuntimeError.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

/// Throws Error(kInvalidArgument, "<arg>: <rule>") when `ok` is false.
void require(bool ok, const char* arg, const std::string& rule);

}  // namespace epx
