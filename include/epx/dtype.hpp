// epx/dtype.hpp - element types that cross the EPX API.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epx {

enum class DType : int32_t { kBF16 = 0, kFP8E4M3 = 1, kF32 = 2, kI32 = 3, kI64 = 4, kBool = 5 };

constexpr std::size_t element_size(DType t) noexcept {
  switch (t) {
    case DType::kBF16:
      return 2;
    case DType::kFP8E4M3:
      return 1;
    case DType::kF32:
      return 4;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kBool:
      return 1;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kFP8E4M3:
      return "float8_e4m3fn";
    case DType::kF32:
      return "float32";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kBool:
      return "bool";
  }
  return "?";
}

}  // namespace epx
