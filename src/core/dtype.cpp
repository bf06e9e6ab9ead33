// Storage dtype names and sizes, and the IEEE binary16 conversions (round to nearest even,
// subnormals, infinities and NaN included).
#include "flexattn/dtype.hpp"

#include <string>

#include "flexattn/error.hpp"

namespace flexattn {

namespace {

constexpr DType kAllDTypes[] = {DType::kF64,  DType::kF32, DType::kF16,
                                DType::kBF16, DType::kI32, DType::kI64};

// binary32 fields.
constexpr std::uint32_t kF32SignMask = 0x80000000u;
constexpr std::uint32_t kF32AbsMask = 0x7fffffffu;
constexpr std::uint32_t kF32Infinity = 0x7f800000u;
constexpr int kF32MantissaBits = 23;
constexpr int kF32ExponentBias = 127;

// binary16 fields.
constexpr std::uint32_t kF16Infinity = 0x7c00u;
constexpr std::uint32_t kF16QuietNan = 0x7e00u;
constexpr std::uint32_t kF16MantissaMask = 0x03ffu;
constexpr int kF16MantissaBits = 10;
constexpr int kF16ExponentBias = 15;

// Mantissa bits dropped when narrowing binary32 to binary16.
constexpr int kDroppedBits = kF32MantissaBits - kF16MantissaBits;  // 13
// Re-biasing the exponent from binary32 to binary16, already shifted into the exponent field.
constexpr std::uint32_t kRebias = static_cast<std::uint32_t>(kF32ExponentBias - kF16ExponentBias)
                                  << kF16MantissaBits;
// |x| >= 2^-14 is a normal binary16 number.
constexpr std::uint32_t kF32OfSmallestF16Normal = 0x38800000u;
// Biased binary32 exponent below which |x| < 2^-25: rounds to zero (2^-25 itself is the tie
// between 0 and the smallest subnormal 2^-24, and ties go to the even zero).
constexpr std::uint32_t kSmallestRoundingExponent = 102;

}  // namespace

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return "fp64";
    case DType::kF32:
      return "fp32";
    case DType::kF16:
      return "fp16";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
  }
  return "?";
}

DType parse_dtype(std::string_view text) {
  for (DType dtype : kAllDTypes) {
    if (text == to_string(dtype)) return dtype;
  }
  throw_invalid("unknown dtype '" + std::string(text) +
                "' (expected fp64, fp32, fp16, bf16, int32 or int64)");
}

std::size_t size_of(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
  }
  return 0;
}

float to_float(Half value) {
  const std::uint32_t sign = static_cast<std::uint32_t>(value.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (value.bits & kF16Infinity) >> kF16MantissaBits;
  std::uint32_t mantissa = value.bits & kF16MantissaMask;
  constexpr std::uint32_t kMaxExponent = kF16Infinity >> kF16MantissaBits;
  if (exponent == kMaxExponent) {  // inf or NaN (payload kept, NaN stays NaN)
    return std::bit_cast<float>(sign | kF32Infinity | (mantissa << kDroppedBits));
  }
  if (exponent != 0) {  // normal
    const std::uint32_t rebiased = (exponent << kF16MantissaBits) + kRebias + mantissa;
    return std::bit_cast<float>(sign | (rebiased << kDroppedBits));
  }
  if (mantissa == 0) return std::bit_cast<float>(sign);  // signed zero
  // Subnormal: normalise the mantissa; every binary16 subnormal is a binary32 normal.
  int shift = 0;
  while ((mantissa & (1u << kF16MantissaBits)) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  mantissa &= kF16MantissaMask;
  const auto f32_exponent =
      static_cast<std::uint32_t>(kF32ExponentBias - kF16ExponentBias + 1 - shift);
  return std::bit_cast<float>(sign | (f32_exponent << kF32MantissaBits) |
                              (mantissa << kDroppedBits));
}

Half to_half(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits & kF32SignMask) >> 16);
  const std::uint32_t magnitude = bits & kF32AbsMask;
  if (magnitude > kF32Infinity) {  // NaN: quiet, keep the top payload bits
    return Half{static_cast<std::uint16_t>(sign | kF16QuietNan |
                                           ((magnitude >> kDroppedBits) & kF16MantissaMask))};
  }
  if (magnitude >= kF32OfSmallestF16Normal) {
    // Round to nearest even on the dropped bits; a carry moves into the exponent correctly, and
    // anything at or past the tie above 65504 becomes infinity.
    const std::uint32_t halfway = (1u << (kDroppedBits - 1)) - 1;
    const std::uint32_t rounded = magnitude + halfway + ((magnitude >> kDroppedBits) & 1u);
    std::uint32_t result = (rounded >> kDroppedBits) - kRebias;
    if (result > kF16Infinity) result = kF16Infinity;
    return Half{static_cast<std::uint16_t>(sign | result)};
  }
  const std::uint32_t exponent = magnitude >> kF32MantissaBits;
  if (exponent < kSmallestRoundingExponent) return Half{sign};  // rounds to (signed) zero
  // Subnormal result: value = full_mantissa * 2^(exponent - 150) = k * 2^-24, so
  // k = full_mantissa / 2^(126 - exponent), rounded to nearest even.
  const std::uint32_t full_mantissa = (magnitude & 0x007fffffu) | (1u << kF32MantissaBits);
  constexpr auto kSubnormalShiftBase = static_cast<std::uint32_t>(kF32ExponentBias - 1);
  const std::uint32_t shift = kSubnormalShiftBase - exponent;  // in [14, 24]
  std::uint32_t quotient = full_mantissa >> shift;
  const std::uint32_t remainder = full_mantissa & ((1u << shift) - 1u);
  const std::uint32_t tie = 1u << (shift - 1u);
  if (remainder > tie || (remainder == tie && (quotient & 1u) != 0)) ++quotient;
  return Half{static_cast<std::uint16_t>(sign | quotient)};
}

}  // namespace flexattn
