// The conformance tolerance, judged per element (src/check/tolerance.cpp): derived from the plain
// same-precision implementation's errors, NaN and infinities compared by agreement, and the worst
// element reported with its own bound.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "check/check_internal.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn::conformance::detail {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

HostTensor tensor_of(const std::vector<double>& values) {
  HostTensor tensor(DType::kF64, {static_cast<std::int64_t>(values.size())});
  for (std::size_t i = 0; i < values.size(); ++i) {
    tensor.set(static_cast<std::int64_t>(i), values[i]);
  }
  return tensor;
}

// Half the elements large (1, plain error 1e-3: relative), half small (1e-3, plain error 1e-9).
struct TwoScales {
  HostTensor reference, plain;
  TwoScales() {
    std::vector<double> r, p;
    for (int i = 0; i < 64; ++i) {
      const bool large = i % 2 == 0;
      r.push_back(large ? 1.0 + 0.01 * i : 1e-3);
      p.push_back(large ? r.back() * (1.0 + 1e-3) : r.back() + 1e-9);
    }
    reference = tensor_of(r), plain = tensor_of(p);
  }
};

TEST(Tolerance, ThePlainImplementationPassesItsOwnTolerance) {
  const TwoScales data;
  const Tolerance tolerance =
      derive_tolerance(data.plain.view(), data.reference.view(), DType::kF64);
  const OutputCheck check =
      compare("out", data.plain.view(), data.reference.view(), tolerance, true);
  EXPECT_TRUE(check.passed()) << check.max_error << " > " << check.allowed;
  EXPECT_EQ(check.fraction_outside, 0.0);
}

TEST(Tolerance, ThreeTimesThePlainErrorFails) {
  const TwoScales data;
  const Tolerance tolerance =
      derive_tolerance(data.plain.view(), data.reference.view(), DType::kF64);
  HostTensor engine = data.reference.to(DType::kF64);
  for (std::int64_t i = 0; i < engine.numel(); ++i) {
    engine.set(i, data.reference.at(i) + 3.0 * (data.plain.at(i) - data.reference.at(i)));
  }
  const OutputCheck check = compare("out", engine.view(), data.reference.view(), tolerance, true);
  EXPECT_FALSE(check.passed());
  EXPECT_GT(check.fraction_outside, 0.4);
}

// What judging per element buys: an error as large as the plain implementation's error on the
// large elements, on a small element, fails (one bound per tensor, 2 x max plain error, passed it).
TEST(Tolerance, SmallElementsAreHeldToTheirOwnBound) {
  const TwoScales data;
  const Tolerance tolerance =
      derive_tolerance(data.plain.view(), data.reference.view(), DType::kF64);
  HostTensor engine = data.reference.to(DType::kF64);
  constexpr std::int64_t kSmallElement = 7;
  engine.set(kSmallElement, data.reference.at(kSmallElement) + 1e-3);
  const OutputCheck check = compare("out", engine.view(), data.reference.view(), tolerance, true);
  EXPECT_FALSE(check.passed());
  EXPECT_EQ(check.worst_index, kSmallElement);
  EXPECT_DOUBLE_EQ(check.max_error, 1e-3);
  EXPECT_LT(check.allowed, 1e-4);
  EXPECT_DOUBLE_EQ(check.fraction_outside, 1.0 / 64.0);
}

TEST(Tolerance, NanAndInfinitiesAgreeOnlyWithThemselves) {
  EXPECT_EQ(element_error(kNan, kNan), 0.0);
  EXPECT_EQ(element_error(-kInf, -kInf), 0.0);
  EXPECT_EQ(element_error(kNan, 1.0), kInf);
  EXPECT_EQ(element_error(1.0, kNan), kInf);
  EXPECT_EQ(element_error(0.0, -kInf), kInf);
  EXPECT_EQ(element_error(kInf, -kInf), kInf);

  // Fully masked rows: LSE -inf on both sides agrees; a NaN where the reference is finite fails,
  // however loose the tolerance.
  const HostTensor reference = tensor_of({-kInf, 2.0, kNan, 3.0});
  const Tolerance loose{1e3, 1e3};
  const HostTensor agreeing = tensor_of({-kInf, 2.0, kNan, 3.0});
  EXPECT_TRUE(compare("lse", agreeing.view(), reference.view(), loose, true).passed());
  const HostTensor nan_engine = tensor_of({-kInf, kNan, kNan, 3.0});
  const OutputCheck nan_check = compare("lse", nan_engine.view(), reference.view(), loose, true);
  EXPECT_FALSE(nan_check.passed());
  EXPECT_EQ(nan_check.worst_index, 1);
  const HostTensor finite_for_empty = tensor_of({0.0, 2.0, kNan, 3.0});
  EXPECT_FALSE(compare("lse", finite_for_empty.view(), reference.view(), loose, true).passed());
}

TEST(Tolerance, AnExactPlainImplementationLeavesTheRoundingFloor) {
  const HostTensor reference = tensor_of({1.0, -2.0, 0.5, 0.0});
  const Tolerance tolerance = derive_tolerance(reference.view(), reference.view(), DType::kBF16);
  EXPECT_DOUBLE_EQ(tolerance.rtol, 0x1p-7);         // one bf16 rounding of the element
  EXPECT_DOUBLE_EQ(tolerance.atol, 2.0 * 0x1p-23);  // one float32 rounding of max |ref|
  EXPECT_DOUBLE_EQ(tolerance.allowed(-kInf), 0.0);
}

TEST(Tolerance, AGuardOverwriteFailsEvenWithoutError) {
  const HostTensor reference = tensor_of({1.0, 2.0});
  const OutputCheck check = compare("out", reference.view(), reference.view(), Tolerance{}, false);
  EXPECT_FALSE(check.passed());
}

}  // namespace
}  // namespace flexattn::conformance::detail
