// The `cpu` engine against the golden cases computed with PyTorch FlexAttention in float64:
// forward and backward (including the gradients of learned tensors), fp32 storage, every layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>

#include "support/test_support.hpp"

namespace flexattn::test {
namespace {

// The golden inputs are float32 values, so the only difference is float32 arithmetic: within
// 1e-5 of the float64 result relative to the largest output magnitude (at least 1), the same
// bound the unit tests hold fp32 storage to.
constexpr double kRelativeTolerance = 1e-5;

using GoldenParam = std::tuple<std::string, Layout>;

class GoldenCpu : public ::testing::TestWithParam<GoldenParam> {};

void expect_close(const HostTensor& result, const HostTensor& expected, const std::string& what) {
  const double allowed = kRelativeTolerance * std::max(1.0, max_abs_value(expected));
  EXPECT_TRUE(within_tolerance(result, expected, allowed)) << what;
}

TEST_P(GoldenCpu, ForwardAndBackwardMatchFlexAttention) {
  FLEXATTN_REQUIRE_GOLDEN();
  const auto& [name, layout] = GetParam();
  const GoldenCase golden = load_golden_case(name);
  const Problem problem(golden.desc(layout, DType::kF32, Direction::kForwardBackward));

  Inputs inputs;
  inputs.q = from_bhsd(golden.array("q").to(DType::kF32), layout);
  inputs.k = from_bhsd(golden.array("k").to(DType::kF32), layout);
  inputs.v = from_bhsd(golden.array("v").to(DType::kF32), layout);
  inputs.dout = from_bhsd(golden.array("dout").to(DType::kF32), layout);
  for (const std::string& tensor : golden.tensors) inputs.tensors[tensor] = golden.array(tensor);

  const std::shared_ptr<const Engine> engine = builtin_engine("cpu");
  ASSERT_NE(engine, nullptr);
  const Outputs outputs = run_engine(*engine, problem, inputs);
  const std::int64_t batch = golden.batch;

  expect_close(to_bhsd(outputs.out, layout, batch), golden.array("out"), "out");
  expect_close(lse_as_bhs(outputs.lse, layout, golden), golden.array("lse"), "lse");
  expect_close(to_bhsd(outputs.dq, layout, batch), golden.array("dq"), "dq");
  expect_close(to_bhsd(outputs.dk, layout, batch), golden.array("dk"), "dk");
  expect_close(to_bhsd(outputs.dv, layout, batch), golden.array("dv"), "dv");
  for (const std::string& tensor : golden.tensors) {
    if (!is_floating(inputs.tensors.at(tensor).dtype())) continue;
    const auto gradient = outputs.tensor_grads.find(tensor);
    ASSERT_NE(gradient, outputs.tensor_grads.end()) << "no gradient for " << tensor;
    expect_close(gradient->second, golden.array("d" + tensor), "d" + tensor);
  }
}

std::vector<std::string> case_names() {
  std::vector<std::string> names = golden_case_names();
  if (names.empty()) names.push_back("missing");  // one test that reports the missing data
  return names;
}

std::string param_name(const ::testing::TestParamInfo<GoldenParam>& info) {
  return std::get<0>(info.param) + "_" + std::string(to_string(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenCpu,
                         ::testing::Combine(::testing::ValuesIn(case_names()),
                                            ::testing::Values(Layout::kBHSD, Layout::kBSHD,
                                                              Layout::kSBHD, Layout::kTHD)),
                         param_name);

}  // namespace
}  // namespace flexattn::test
