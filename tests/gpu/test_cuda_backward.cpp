// The cuda engine's backward pass on a GPU (ctest label `gpu`; skipped where no device is
// available):
// - every golden case in every layout and dtype: dq, dk, dv and the learned tensors' gradients
//   against PyTorch FlexAttention's float64 values, with the tolerance set by the plain
//   same-precision implementation (and the forward of the same plan, likewise);
// - the conformance matrix's backward cases (full tier) and the benchmark's modifiers against
//   cpu_ref under docs/design.md's tolerance rule;
// - determinism: repeated backward runs give bit-identical gradients, tensor gradients included;
// - rows with no kept key give dq = 0, keys no query keeps give dk = dv = 0;
// - argument checks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "check/check_internal.hpp"
#include "core/canary.hpp"
#include "cuda_device.hpp"
#include "flexattn/conformance.hpp"
#include "support/test_support.hpp"

namespace flexattn::test {
namespace {

// ---- forward and backward on the device ---------------------------------------------------------

HostTensor empty_like(const TensorView& expected) {
  return HostTensor(expected.dtype, expected.shape);
}

// Names of the floating-point tensors the modifiers read: the gradients a backward may compute.
std::vector<std::string> learned_tensors(const Problem& problem) {
  std::vector<std::string> names = problem.score_mod().tensors();
  for (const std::string& name : problem.mask_mod().tensors()) names.push_back(name);
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  std::erase_if(names, [&](const std::string& name) {
    return !is_floating(problem.desc().tensors.at(name).dtype);
  });
  return names;
}

// One problem's inputs on the device and its plan: a forward, then any number of backward runs,
// each into fresh NaN-poisoned gradient buffers (fp32 tensor gradients for `learned`). Holds the
// engine: its device memory must outlive every buffer.
class DeviceRun {
 public:
  DeviceRun(std::shared_ptr<const Engine> engine, const Problem& problem, const Inputs& inputs,
            std::vector<std::string> learned)
      : engine_(std::move(engine)),
        memory_(*engine_->memory()),
        problem_(problem),
        plan_(engine_->plan(problem)),
        learned_(std::move(learned)),
        q_(memory_, inputs.q),
        k_(memory_, inputs.k),
        v_(memory_, inputs.v),
        dout_(memory_, inputs.dout),
        out_(memory_, empty_like(problem.expected("o")), true),
        lse_(memory_, empty_like(problem.expected("lse")), true) {
    for (const auto& [name, tensor] : inputs.tensors) {
      tensors_.emplace(name, std::make_unique<DeviceTensor>(memory_, tensor));
    }
  }

  const Plan& plan() const { return *plan_; }
  const DeviceMemory& memory() const { return memory_; }

  void forward() {
    ForwardArgs args;
    args.q = q_.view();
    args.k = k_.view();
    args.v = v_.view();
    args.out = out_.view();
    args.lse = lse_.view();
    for (const auto& [name, tensor] : tensors_) args.tensors[name] = tensor->view();
    plan_->forward(args);
  }

  // The backward's inputs (after forward()); the caller adds the gradient outputs.
  BackwardArgs backward_inputs() const {
    BackwardArgs args;
    args.q = q_.view();
    args.k = k_.view();
    args.v = v_.view();
    args.out = out_.view();
    args.lse = lse_.view();
    args.dout = dout_.view();
    for (const auto& [name, tensor] : tensors_) args.tensors[name] = tensor->view();
    return args;
  }

  // Runs the backward and brings every output back (out and lse of the last forward too).
  Outputs backward() {
    DeviceTensor dq(memory_, empty_like(problem_.expected("dq")), true);
    DeviceTensor dk(memory_, empty_like(problem_.expected("dk")), true);
    DeviceTensor dv(memory_, empty_like(problem_.expected("dv")), true);
    std::map<std::string, std::unique_ptr<DeviceTensor>> gradients;
    BackwardArgs args = backward_inputs();
    args.dq = dq.view();
    args.dk = dk.view();
    args.dv = dv.view();
    for (const std::string& name : learned_) {
      const TensorDecl& decl = problem_.desc().tensors.at(name);
      gradients.emplace(
          name, std::make_unique<DeviceTensor>(memory_, HostTensor(DType::kF32, decl.shape), true));
      args.tensor_grads[name] = gradients.at(name)->view();
    }
    plan_->backward(args);
    Outputs outputs;
    outputs.out = out_.download();
    outputs.lse = lse_.download();
    outputs.dq = dq.download();
    outputs.dk = dk.download();
    outputs.dv = dv.download();
    for (auto& [name, gradient] : gradients) outputs.tensor_grads[name] = gradient->download();
    return outputs;
  }

 private:
  std::shared_ptr<const Engine> engine_;
  const DeviceMemory& memory_;
  const Problem& problem_;
  std::unique_ptr<Plan> plan_;
  std::vector<std::string> learned_;
  DeviceTensor q_, k_, v_, dout_, out_, lse_;
  std::map<std::string, std::unique_ptr<DeviceTensor>> tensors_;
};

// The engine, or a failure naming its reason when it refuses the problem.
::testing::AssertionResult supported(const Problem& problem) {
  const Support support = device_engine()->supports(problem);
  if (support) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "the cuda engine refuses: " << support.reason();
}

// ---- golden cases -------------------------------------------------------------------------------

// The plain same-precision implementation (the conformance runner's) on the golden inputs rounded
// to `dtype`, bhsd: its error against the float64 values sets the tolerance.
Outputs plain_outputs(const GoldenCase& golden, DType dtype,
                      const std::vector<std::string>& learned) {
  const Problem problem(golden.desc(Layout::kBHSD, dtype, Direction::kForwardBackward));
  const HostTensor q = golden.array("q").to(dtype), k = golden.array("k").to(dtype);
  const HostTensor v = golden.array("v").to(dtype), dout = golden.array("dout").to(dtype);
  std::map<std::string, HostTensor> tensors;
  for (const std::string& name : golden.tensors) tensors.emplace(name, golden.array(name));
  Outputs plain;
  plain.out = empty_like(problem.expected("o"));
  plain.lse = HostTensor(DType::kF32, problem.expected("lse").shape);
  ForwardArgs args{q.view(), k.view(), v.view(), plain.out.view(), plain.lse.view(), {}, nullptr};
  for (const auto& [name, tensor] : tensors) args.tensors[name] = tensor.view();
  conformance::detail::plain_forward(problem, args);
  plain.dq = HostTensor(dtype, q.shape());
  plain.dk = HostTensor(dtype, k.shape());
  plain.dv = HostTensor(dtype, v.shape());
  BackwardArgs backward;
  backward.q = q.view(), backward.k = k.view(), backward.v = v.view();
  backward.out = plain.out.view(), backward.lse = plain.lse.view(), backward.dout = dout.view();
  backward.dq = plain.dq.view(), backward.dk = plain.dk.view(), backward.dv = plain.dv.view();
  backward.tensors = args.tensors;
  for (const std::string& name : learned) {
    plain.tensor_grads.emplace(name, HostTensor(DType::kF32, tensors.at(name).shape()));
    backward.tensor_grads[name] = plain.tensor_grads.at(name).view();
  }
  conformance::detail::plain_backward(problem, backward);
  return plain;
}

// docs/design.md's rule: within twice the plain implementation's error plus one rounding of the
// largest value in `rounding` (the output's storage precision).
::testing::AssertionResult close_to_golden(const HostTensor& result, const HostTensor& plain,
                                           const HostTensor& expected, DType rounding) {
  const double floor = epsilon(rounding) * std::max(1.0, max_abs_value(expected));
  return within_tolerance(result, expected, allowed_error(max_abs_error(plain, expected), floor));
}

// One golden case's forward and backward on the device against FlexAttention's float64 values.
void check_golden_gradients(const GoldenParam& param) {
  const auto& [name, layout, dtype] = param;
  const GoldenCase golden = load_golden_case(name);
  ProblemDesc desc = golden.desc(layout, dtype, Direction::kForwardBackward);
  desc.device = Device::kCuda;
  const Problem problem(desc);
  ASSERT_TRUE(supported(problem));

  Inputs inputs;
  inputs.q = from_bhsd(golden.array("q").to(dtype), layout);
  inputs.k = from_bhsd(golden.array("k").to(dtype), layout);
  inputs.v = from_bhsd(golden.array("v").to(dtype), layout);
  inputs.dout = from_bhsd(golden.array("dout").to(dtype), layout);
  for (const std::string& tensor : golden.tensors) inputs.tensors[tensor] = golden.array(tensor);
  const std::vector<std::string> learned = learned_tensors(problem);
  DeviceRun run(device_engine(), problem, inputs, learned);
  run.forward();
  const Outputs result = run.backward();
  const Outputs plain = plain_outputs(golden, dtype, learned);

  const std::int64_t batch = golden.batch;
  EXPECT_TRUE(
      close_to_golden(to_bhsd(result.out, layout, batch), plain.out, golden.array("out"), dtype))
      << "out";
  EXPECT_TRUE(close_to_golden(lse_as_bhs(result.lse, layout, golden), plain.lse,
                              golden.array("lse"), DType::kF32))
      << "lse";
  const std::vector<std::tuple<const char*, const HostTensor*, const HostTensor*>> gradients = {
      {"dq", &result.dq, &plain.dq}, {"dk", &result.dk, &plain.dk}, {"dv", &result.dv, &plain.dv}};
  for (const auto& [gradient, engine_gradient, plain_gradient] : gradients) {
    EXPECT_TRUE(close_to_golden(to_bhsd(*engine_gradient, layout, batch), *plain_gradient,
                                golden.array(gradient), dtype))
        << gradient;
  }
  for (const std::string& tensor : learned) {
    EXPECT_TRUE(close_to_golden(result.tensor_grads.at(tensor), plain.tensor_grads.at(tensor),
                                golden.array("d" + tensor), DType::kF32))
        << "d" << tensor;
  }
}

class CudaBackwardGolden : public ::testing::TestWithParam<GoldenParam> {};

TEST_P(CudaBackwardGolden, GradientsMatchFlexAttention) {
  FLEXATTN_REQUIRE_GOLDEN();
  SKIP_WITHOUT_DEVICE();
  check_golden_gradients(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardGolden, ::testing::ValuesIn(golden_params()),
                         golden_name);

// The mma.sync kernels where sm_90 would get the wgmma ones (FLEXATTN_CUDA_WGMMA=0: forward and
// dK/dV), so both stay verified on the H200.
class CudaBackwardGoldenMmaSync : public ::testing::TestWithParam<GoldenParam> {
  const ScopedEnvironment mma_sync_{"FLEXATTN_CUDA_WGMMA", "0"};
};

TEST_P(CudaBackwardGoldenMmaSync, GradientsMatchFlexAttention) {
  FLEXATTN_REQUIRE_GOLDEN();
  SKIP_WITHOUT_DEVICE();
  check_golden_gradients(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackwardGoldenMmaSync, ::testing::ValuesIn(golden_params()),
                         golden_name);

// ---- conformance matrix -------------------------------------------------------------------------

std::vector<conformance::Case> backward_cases() {
  std::vector<conformance::Case> result;
  for (const conformance::Case& c : conformance::cases(conformance::Tier::kFull)) {
    if (c.backward) result.push_back(c);
  }
  // The benchmark's modifiers at a length the reference computes quickly: full tiles, several q
  // blocks per kv tile, and the bias and ALiBi gradients summed over many blocks.
  for (const auto& [modifier, mask] :
       std::vector<std::pair<std::string, std::string>>{{"none", "none"},
                                                        {"none", "causal"},
                                                        {"softcap30", "none"},
                                                        {"softcap30", "causal"},
                                                        {"alibi", "none"},
                                                        {"bias", "causal"}}) {
    for (std::int64_t head_dim : {64, 128}) {
      conformance::Case c;
      c.modifier = modifier;
      c.mask = mask;
      c.shape = conformance::Shape{1, 4, 4, 1024, 1024, head_dim, head_dim};
      c.layout = Layout::kBHSD;
      c.dtype = DType::kBF16;
      c.backward = true;
      c.name = fmt::format("bench_bf16_bhsd_d{}/{}_{}_bwd", head_dim, modifier, mask);
      result.push_back(c);
    }
  }
  // Head dims above 128 on tensor cores, where the dK/dV kernel splits a kv tile into a dV block
  // and a dK block (Gemma's 256, MLA's 192/128, 160 padded to 192): GQA, lengths no tile divides,
  // packed sequences, every modifier kind (the bias's gradient too).
  for (const auto& [head_dim_qk, head_dim_v] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{256, 256}, {192, 128}, {160, 160}}) {
    for (const auto& [modifier, mask] :
         std::vector<std::pair<std::string, std::string>>{{"none", "causal"},
                                                          {"softcap30", "none"},
                                                          {"alibi", "window"},
                                                          {"bias", "causal"}}) {
      for (const DType dtype : {DType::kBF16, DType::kF16}) {
        for (const Layout layout : {Layout::kBSHD, Layout::kTHD}) {
          conformance::Case c;
          c.modifier = modifier;
          c.mask = mask;
          c.shape = conformance::Shape{2, 4, 2, 150, 211, head_dim_qk, head_dim_v};
          c.layout = layout;
          c.dtype = dtype;
          c.backward = true;
          c.name = fmt::format("wide_{}_{}_d{}_dv{}/{}_{}_bwd", to_string(dtype),
                               layout == Layout::kTHD ? "thd" : "bshd", head_dim_qk, head_dim_v,
                               modifier, mask);
          result.push_back(c);
        }
      }
    }
  }
  // Head dim 256 over many q blocks per kv tile (17 blocks x 2 heads of GQA 2:1) and many kv
  // tiles per q block (9): the wide kernels' two-stage rings turn over many times. (One kv head
  // leaves the float64 reference a single thread: 4 heads of 1030 x 1030 took 148 s on an H100
  // machine's host; this shape has a quarter of those (q, kv) pairs.)
  {
    conformance::Case c;
    c.modifier = "softcap30";
    c.mask = "none";
    c.shape = conformance::Shape{1, 2, 1, 1030, 520, 256, 256};
    c.layout = Layout::kBSHD;
    c.dtype = DType::kBF16;
    c.backward = true;
    c.name = "wide_long_bf16_bshd_d256_dv256/softcap30_none_bwd";
    result.push_back(c);
  }
  // Both tanh forms in one launch, and the switch between them (test_support.hpp).
  for (const conformance::Case& c : mixed_tanh_tile_cases(true)) result.push_back(c);
  return result;
}

class CudaBackwardConformance : public ::testing::TestWithParam<conformance::Case> {};

// Runs one conformance case on the device engine against cpu_ref.
void check_conformance_case(const conformance::Case& c) {
  const conformance::Outcome outcome = conformance::run_case(*device_engine(), c);
  if (outcome.status == conformance::Status::kSkipped) GTEST_SKIP() << outcome.reason;
  ASSERT_EQ(outcome.status, conformance::Status::kPass)
      << c.name << ": " << conformance::to_string(outcome.status) << ": " << outcome.reason
      << " (max error " << outcome.max_error() << ", allowed " << outcome.allowed() << ")";
}

TEST_P(CudaBackwardConformance, GradientsMatchReference) {
  SKIP_WITHOUT_DEVICE();
  check_conformance_case(GetParam());
}

std::string case_name(const ::testing::TestParamInfo<conformance::Case>& info) {
  std::string name = info.param.name;
  std::replace_if(
      name.begin(), name.end(), [](char c) { return !std::isalnum(c); }, '_');
  return name;
}

INSTANTIATE_TEST_SUITE_P(Matrix, CudaBackwardConformance, ::testing::ValuesIn(backward_cases()),
                         case_name);

// ---- plans --------------------------------------------------------------------------------------

// GQA 4:2, lengths no tile divides, seq_len_q != seq_len_kv.
ProblemDesc small_desc(DType dtype, const std::string& score_mod, const std::string& mask_mod) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = 100;
  desc.seq_len_kv = 140;
  desc.head_dim_qk = 64;
  desc.dtype = dtype;
  desc.device = Device::kCuda;
  desc.direction = Direction::kForwardBackward;
  desc.tensors["bias"] = TensorDecl{DType::kF32, {desc.heads_q, desc.seq_len_q, desc.seq_len_kv}};
  desc.tensors["slopes"] = TensorDecl{DType::kF32, {desc.heads_q}};
  desc.score_mod = ir::parse(score_mod, desc.scope());
  desc.mask_mod = ir::parse(mask_mod, desc.scope());
  return desc;
}

TEST(CudaBackwardPlan, ProvesTheModifierItLowered) {
  SKIP_WITHOUT_DEVICE();
  const std::shared_ptr<const Engine> engine = device_engine();  // outlives its plans
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    const Problem problem(small_desc(dtype, "20 * tanh(score / 20) + bias[h, q, kv]", "q >= kv"));
    ASSERT_TRUE(supported(problem)) << to_string(dtype);
    const std::unique_ptr<Plan> plan = engine->plan(problem);
    EXPECT_EQ(plan->info().engine, "cuda");
    EXPECT_EQ(plan->info().lowered_hash, problem.modifier_hash()) << to_string(dtype);
    EXPECT_EQ(plan->info().signature, problem.signature()) << to_string(dtype);
  }
}

// ---- the plan canary ----------------------------------------------------------------------------

// Selection runs the canary (src/core/canary.hpp) on every new plan, so a correct cuda plan must
// pass it, forward and backward: the kernels round P and dS to the storage dtype, and a canary
// tolerance below that rounding once refused the softcap backward (auto selection then served
// the cpu engine). Includes the problems of the gradient catalogue that went wrong elsewhere.
TEST(CudaCanary, PassesCorrectPlansForwardAndBackward) {
  SKIP_WITHOUT_DEVICE();
  const std::shared_ptr<const Engine> engine = device_engine();
  struct Canary {
    DType dtype;
    std::int64_t seq_q, seq_kv, head_dim;
    const char* score_mod;
    const char* mask_mod;
  };
  const Canary canaries[] = {
      {DType::kBF16, 1024, 1024, 128, "30 * tanh(score / 30)", "q >= kv"},
      {DType::kF16, 1024, 1024, 128, "30 * tanh(score / 30)", "q >= kv"},
      {DType::kBF16, 1024, 1024, 64, "score", "true"},
      {DType::kBF16, 1024, 1024, 64, "score + bias[h, q, kv]", "q >= kv"},
      {DType::kBF16, 17, 33, 16, "score * score", "true"},
      {DType::kBF16, 64, 64, 16, "score + float(kv - q) * exp2(-float(h + 1))", "true"},
  };
  for (const Canary& c : canaries) {
    for (Direction direction : {Direction::kForward, Direction::kForwardBackward}) {
      ProblemDesc desc = small_desc(c.dtype, c.score_mod, c.mask_mod);
      desc.seq_len_q = c.seq_q, desc.seq_len_kv = c.seq_kv, desc.head_dim_qk = c.head_dim;
      desc.heads_kv = desc.heads_q;
      desc.tensors["bias"] = TensorDecl{DType::kF32, {desc.heads_q, c.seq_q, c.seq_kv}};
      desc.direction = direction;
      const Problem problem(desc);
      const std::string label = fmt::format("{} {} {}x{} d{} '{}' '{}'", to_string(c.dtype),
                                            direction == Direction::kForward ? "fwd" : "fwd+bwd",
                                            c.seq_q, c.seq_kv, c.head_dim, c.score_mod, c.mask_mod);
      ASSERT_TRUE(supported(problem)) << label;
      const detail::CanaryResult result = detail::run_canary(*engine, *engine->plan(problem));
      EXPECT_TRUE(result.passed) << label << ": " << result.reason;
      std::printf("[cuda canary] %s: %s, %.3g of the tolerance, q x %g, %.3g s\n", label.c_str(),
                  result.passed ? "passed" : "refused", result.largest_error_ratio,
                  result.input_scale, result.seconds);
    }
  }
}

// ---- determinism --------------------------------------------------------------------------------

// Tensor gradients are scattered with atomics from many blocks in no fixed order; dK/dV sum a
// whole GQA group. Three runs make an order-dependent sum very likely to show.
constexpr int kBackwardRuns = 3;

struct DeterminismParam {
  std::string label;
  std::string score_mod;
  DType dtype;
  std::int64_t head_dim = 64;
};

// Names the parameter in test listings (instead of its bytes).
void PrintTo(const DeterminismParam& param, std::ostream* stream) { *stream << param.label; }

class CudaBackwardDeterminism : public ::testing::TestWithParam<DeterminismParam> {};

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

bool all_finite(const HostTensor& tensor) {
  const TensorView view = tensor.view();
  for (std::int64_t i = 0; i < view.numel(); ++i) {
    if (!std::isfinite(view.load(i))) return false;
  }
  return true;
}

TEST_P(CudaBackwardDeterminism, RepeatedRunsAreBitIdentical) {
  SKIP_WITHOUT_DEVICE();
  const DeterminismParam& param = GetParam();
  // GQA 8:2, causal, lengths that leave partial tiles, several q blocks per kv tile.
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 8;
  desc.heads_kv = 2;
  desc.seq_len_q = 515;
  desc.seq_len_kv = 515;
  desc.head_dim_qk = param.head_dim;
  desc.dtype = param.dtype;
  desc.layout = Layout::kBSHD;
  desc.device = Device::kCuda;
  desc.direction = Direction::kForwardBackward;
  desc.tensors["bias"] = TensorDecl{DType::kF32, {desc.heads_q, desc.seq_len_q, desc.seq_len_kv}};
  desc.tensors["slopes"] = TensorDecl{DType::kF32, {desc.heads_q}};
  desc.score_mod = ir::parse(param.score_mod, desc.scope());
  desc.mask_mod = ir::parse("q >= kv", desc.scope());
  const Problem problem(desc);
  ASSERT_TRUE(supported(problem));

  Inputs inputs = random_inputs(problem, 7);
  // ALiBi's slopes 2^(-8 (h + 1) / heads): logits stay in a realistic range.
  for (std::int64_t h = 0; h < desc.heads_q; ++h) {
    inputs.tensors.at("slopes").set(
        h, std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(desc.heads_q)));
  }
  const std::vector<std::string> learned = learned_tensors(problem);
  DeviceRun run(device_engine(), problem, inputs, learned);
  run.forward();
  const Outputs first = run.backward();
  ASSERT_TRUE(all_finite(first.dq) && all_finite(first.dk) && all_finite(first.dv));
  for (const auto& [name, gradient] : first.tensor_grads) {
    ASSERT_TRUE(all_finite(gradient)) << "d" << name;
  }
  for (int again = 1; again < kBackwardRuns; ++again) {
    const Outputs other = run.backward();
    EXPECT_TRUE(same_bytes(first.dq, other.dq)) << "dq, run " << again + 1;
    EXPECT_TRUE(same_bytes(first.dk, other.dk)) << "dk, run " << again + 1;
    EXPECT_TRUE(same_bytes(first.dv, other.dv)) << "dv, run " << again + 1;
    ASSERT_EQ(first.tensor_grads.size(), other.tensor_grads.size());
    for (const auto& [name, gradient] : first.tensor_grads) {
      EXPECT_TRUE(same_bytes(gradient, other.tensor_grads.at(name)))
          << "d" << name << ", run " << again + 1;
    }
  }
}

std::vector<DeterminismParam> determinism_params() {
  std::vector<DeterminismParam> params;
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    const std::string suffix = std::string(to_string(dtype));
    params.push_back({"softcap_" + suffix, "30 * tanh(score / 30)", dtype});
    params.push_back({"bias_" + suffix, "score + bias[h, q, kv]", dtype});
    params.push_back({"alibi_" + suffix, "score + slopes[h] * (kv - q)", dtype});
  }
  // Head dim 128: five kv tiles of 128 keys visit each 64-row q block (the wgmma backward's
  // tiles on sm_90).
  params.push_back({"softcap_bf16_d128", "30 * tanh(score / 30)", DType::kBF16, 128});
  // Head dim 256 (the wide wgmma kernels on sm_90): the two warpgroups' exact-delta row sums
  // are added in a fixed order (the bias's and the slopes' gradients take that pass).
  params.push_back({"softcap_bf16_d256", "30 * tanh(score / 30)", DType::kBF16, 256});
  params.push_back({"bias_bf16_d256", "score + bias[h, q, kv]", DType::kBF16, 256});
  params.push_back({"alibi_bf16_d256", "score + slopes[h] * (kv - q)", DType::kBF16, 256});
  return params;
}

std::string determinism_name(const ::testing::TestParamInfo<DeterminismParam>& param) {
  return param.param.label;
}

INSTANTIATE_TEST_SUITE_P(Modifiers, CudaBackwardDeterminism,
                         ::testing::ValuesIn(determinism_params()), determinism_name);

// ---- rows and keys nothing sees ---------------------------------------------------------------

// Queries below this position keep no key.
constexpr std::int64_t kEmptyRows = 20;

class CudaBackwardEmpty : public ::testing::TestWithParam<DType> {};

TEST_P(CudaBackwardEmpty, EmptyRowsGiveZeroDqAndUnseenKeysZeroDkDv) {
  SKIP_WITHOUT_DEVICE();
  const DType dtype = GetParam();
  // seq_len_kv (140) > seq_len_q (100): keys past the last query are kept by no row.
  const Problem problem(small_desc(dtype, "score", fmt::format("q >= {} && kv <= q", kEmptyRows)));
  ASSERT_TRUE(supported(problem));
  DeviceRun run(device_engine(), problem, random_inputs(problem, 11), {});
  run.forward();
  const Outputs result = run.backward();
  const HostTensor dq = to_bhsd(result.dq, problem.layout()).to(DType::kF64);
  const HostTensor dk = to_bhsd(result.dk, problem.layout()).to(DType::kF64);
  const HostTensor dv = to_bhsd(result.dv, problem.layout()).to(DType::kF64);
  ASSERT_TRUE(all_finite(dq) && all_finite(dk) && all_finite(dv));

  const std::int64_t heads_q = problem.heads_q(), heads_kv = problem.heads_kv();
  const std::int64_t seq_len_q = problem.seq_len_q(), seq_len_kv = problem.seq_len_kv();
  const std::int64_t head_dim = problem.head_dim_qk();
  double nonzero_kept = 0.0;  // some gradient of a kept row must be nonzero, or the test is void
  for (std::int64_t b = 0; b < problem.batch(); ++b) {
    for (std::int64_t h = 0; h < heads_q; ++h) {
      for (std::int64_t q = 0; q < seq_len_q; ++q) {
        for (std::int64_t d = 0; d < head_dim; ++d) {
          const double value = dq.at(((b * heads_q + h) * seq_len_q + q) * head_dim + d);
          if (q < kEmptyRows) {
            ASSERT_EQ(value, 0.0) << "dq of empty row " << q << " (b " << b << ", h " << h << ")";
          } else {
            nonzero_kept = std::max(nonzero_kept, std::abs(value));
          }
        }
      }
    }
    for (std::int64_t h = 0; h < heads_kv; ++h) {
      for (std::int64_t kv = seq_len_q; kv < seq_len_kv; ++kv) {
        for (std::int64_t d = 0; d < head_dim; ++d) {
          const std::int64_t at = ((b * heads_kv + h) * seq_len_kv + kv) * head_dim + d;
          ASSERT_EQ(dk.at(at), 0.0)
              << "dk of unseen key " << kv << " (b " << b << ", h " << h << ")";
          ASSERT_EQ(dv.at(at), 0.0)
              << "dv of unseen key " << kv << " (b " << b << ", h " << h << ")";
        }
      }
    }
  }
  EXPECT_GT(nonzero_kept, 0.0);
}

std::string dtype_name(const ::testing::TestParamInfo<DType>& param) {
  return std::string(to_string(param.param));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaBackwardEmpty,
                         ::testing::Values(DType::kBF16, DType::kF16, DType::kF32), dtype_name);

// ---- arguments ----------------------------------------------------------------------------------

// The tensor-core kernels' access granule (cp.async copies 16-byte chunks).
constexpr std::size_t kChunkBytes = 16;

// Expects `call` to throw Error(kInvalidArgument) with a one-line message naming `what`.
template <class Call>
void expect_invalid(Call call, const std::string& what) {
  try {
    call();
    ADD_FAILURE() << "accepted a wrong " << what;
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << message;
    EXPECT_NE(message.find(what), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
  }
}

TEST(CudaBackwardArguments, WrongGradientBuffersAreRefused) {
  SKIP_WITHOUT_DEVICE();
  const Problem problem(small_desc(DType::kBF16, "score + bias[h, q, kv]", "q >= kv"));
  ASSERT_TRUE(supported(problem));
  DeviceRun run(device_engine(), problem, random_inputs(problem, 3), {"bias"});
  run.forward();
  const DeviceMemory& memory = run.memory();
  const TensorView expected_dq = problem.expected("dq");
  DeviceTensor dq(memory, empty_like(expected_dq), true);
  DeviceTensor dk(memory, empty_like(problem.expected("dk")), true);
  DeviceTensor dv(memory, empty_like(problem.expected("dv")), true);
  DeviceTensor dbias(memory, HostTensor(DType::kF32, problem.desc().tensors.at("bias").shape));
  const auto correct = [&] {
    BackwardArgs args = run.backward_inputs();
    args.dq = dq.view();
    args.dk = dk.view();
    args.dv = dv.view();
    args.tensor_grads["bias"] = dbias.view();
    return args;
  };
  run.plan().backward(correct());  // the baseline is accepted

  // dq with the heads and sequence swapped: as many elements, the wrong shape.
  std::vector<std::int64_t> swapped = expected_dq.shape;
  std::swap(swapped[1], swapped[2]);
  DeviceTensor wrong_dq(memory, HostTensor(expected_dq.dtype, swapped), true);
  expect_invalid(
      [&] {
        BackwardArgs args = correct();
        args.dq = wrong_dq.view();
        run.plan().backward(args);
      },
      "dq");
  expect_invalid(
      [&] {
        BackwardArgs args = correct();
        args.dk = TensorView{};
        run.plan().backward(args);
      },
      "dk");
  // The tensor-core kernels copy 16-byte chunks: an element-aligned dq is refused, not misread.
  const std::size_t dq_bytes =
      static_cast<std::size_t>(expected_dq.numel()) * size_of(expected_dq.dtype);
  void* padded = memory.allocate(dq_bytes + kChunkBytes);
  expect_invalid(
      [&] {
        BackwardArgs args = correct();
        args.dq.data = static_cast<char*>(padded) + size_of(expected_dq.dtype);
        run.plan().backward(args);
      },
      "aligned");
  memory.release(padded);
  // A tensor gradient must be fp32 or fp64.
  DeviceTensor bf16_dbias(memory,
                          HostTensor(DType::kBF16, problem.desc().tensors.at("bias").shape));
  expect_invalid(
      [&] {
        BackwardArgs args = correct();
        args.tensor_grads["bias"] = bf16_dbias.view();
        run.plan().backward(args);
      },
      "bias");
  // The gradient of a tensor the modifiers do not read.
  DeviceTensor dslopes(memory, HostTensor(DType::kF32, {problem.heads_q()}));
  expect_invalid(
      [&] {
        BackwardArgs args = correct();
        args.tensor_grads["slopes"] = dslopes.view();
        run.plan().backward(args);
      },
      "slopes");
}

TEST(CudaBackwardArguments, ForwardPlanRefusesBackward) {
  SKIP_WITHOUT_DEVICE();
  ProblemDesc desc = small_desc(DType::kBF16, "score", "q >= kv");
  desc.direction = Direction::kForward;
  const Problem problem(desc);
  const std::shared_ptr<const Engine> engine = device_engine();  // outlives its plan
  const std::unique_ptr<Plan> plan = engine->plan(problem);
  expect_invalid([&] { plan->backward(BackwardArgs{}); }, "forward");
}

}  // namespace
}  // namespace flexattn::test
