// tests/unit/expect_error.hpp - expect_error: a call must raise epx::Error with a code and
// every given part in its message (the argument and the rule it names).
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "epx/error.hpp"

namespace epx::test {

/// Runs `fn`, expects epx::Error with code `code` whose message contains every `parts`.
template <class Fn>
void expect_error(Fn&& fn, std::initializer_list<const char*> parts,
                  ErrorCode code = ErrorCode::kInvalidArgument) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const char* p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << e.what() << " lacks '" << p << "'";
  }
}

}  // namespace epx::test
