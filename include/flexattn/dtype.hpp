// Storage dtypes and the 16-bit float conversions every CPU engine shares.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "flexattn/export.hpp"

namespace flexattn {

enum class DType { kF64, kF32, kF16, kBF16, kI32, kI64 };

// "fp64", "fp32", "fp16", "bf16", "int32", "int64"; parse_dtype accepts these names and throws
// kInvalidArgument for others.
FLEXATTN_API std::string_view to_string(DType dtype);
FLEXATTN_API DType parse_dtype(std::string_view text);
FLEXATTN_API std::size_t size_of(DType dtype);
inline bool is_floating(DType dtype) {
  return dtype == DType::kF64 || dtype == DType::kF32 || dtype == DType::kF16 ||
         dtype == DType::kBF16;
}

// IEEE binary16 and bfloat16 held as raw bits; conversions round to nearest even.
struct Half {
  std::uint16_t bits = 0;
};
struct BFloat16 {
  std::uint16_t bits = 0;
};

inline float to_float(BFloat16 value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
}

inline BFloat16 to_bfloat16(float value) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<std::uint16_t>((bits >> 16) | 0x40)};  // quiet NaN
  std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return BFloat16{static_cast<std::uint16_t>((bits + rounding) >> 16)};
}

FLEXATTN_API float to_float(Half value);
FLEXATTN_API Half to_half(float value);

}  // namespace flexattn
