// The float64 reference of a conformance case and its wrong variants: a case discriminates when
// the reference without the score modifier, without the mask, and with d score_mod / d score
// replaced by 1 each fail the case's tolerance on every output they change (docs/design.md section
// 5).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "check/check_internal.hpp"
#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/analysis.hpp"

namespace flexattn::conformance::detail {
namespace {

// A variant "changes" an output when it differs from the reference by more than float64 noise
// (the same evaluator on the same inputs: a variant that is the identity here is bit-identical).
constexpr double kFloat64Noise = 1e-12;

std::string_view describe(ReferenceVariant variant) {
  switch (variant) {
    case ReferenceVariant::kExact:
      return "the reference";
    case ReferenceVariant::kWithoutScoreModifier:
      return "the reference without the score modifier";
    case ReferenceVariant::kWithoutMask:
      return "the reference without the mask";
    case ReferenceVariant::kScoreDerivativeOne:
      return "the reference with d score_mod / d score replaced by 1";
  }
  return "?";
}

const HostTensor* output_of(const ReferenceOutputs& outputs, const std::string& name) {
  if (name == "out") return &outputs.out;
  if (name == "lse") return &outputs.lse;
  if (name == "dq") return &outputs.dq;
  if (name == "dk") return &outputs.dk;
  if (name == "dv") return &outputs.dv;
  const auto found = outputs.tensor_grads.find(name.substr(1));  // "d<tensor>"
  return found == outputs.tensor_grads.end() ? nullptr : &found->second;
}

bool changes(const HostTensor& variant, const HostTensor& reference) {
  double difference = 0.0, magnitude = 1.0;
  for (std::int64_t i = 0; i < reference.numel(); ++i) {
    const double r = reference.at(i);
    if (std::isfinite(r)) magnitude = std::max(magnitude, std::fabs(r));
    difference = std::max(difference, element_error(variant.at(i), r));
  }
  return difference > kFloat64Noise * magnitude;
}

bool derivative_is_one(const Graph& score_mod) {
  if (score_mod.is_identity_score()) return true;
  const Graph derivative = derivative_wrt_score(score_mod);
  return derivative.is_literal() && derivative.node(derivative.root()).literal == 1.0;
}

}  // namespace

ReferenceOutputs run_reference(const ProblemDesc& desc, const ReferenceInputs& inputs,
                               const std::vector<std::string>& float_tensors,
                               ReferenceVariant variant) {
  ProblemDesc variant_desc = desc;
  if (variant == ReferenceVariant::kWithoutScoreModifier) variant_desc.score_mod.reset();
  if (variant == ReferenceVariant::kWithoutMask) variant_desc.mask_mod.reset();
  const Problem problem(variant_desc);
  const ScoreDerivative derivative = variant == ReferenceVariant::kScoreDerivativeOne
                                         ? ScoreDerivative::kReplacedByOne
                                         : ScoreDerivative::kExact;
  const auto engine = internal::make_cpu_ref_engine(derivative);
  const std::unique_ptr<Plan> plan = engine->plan(problem);
  ReferenceOutputs result;
  result.out = HostTensor(DType::kF64, problem.expected("o").shape);
  result.lse = HostTensor(DType::kF64, problem.expected("lse").shape);
  ForwardArgs args{
      inputs.q.view(), inputs.k.view(), inputs.v.view(), result.out.view(), result.lse.view(), {},
      nullptr};
  for (const auto& [name, tensor] : inputs.tensors) args.tensors[name] = tensor.view();
  if (problem.kv_cache()) {
    args.page_table = inputs.page_table.view();
    args.cache_lens = inputs.cache_lens.view();
  }
  plan->forward(args);
  if (!problem.wants_backward()) return result;
  result.dq = HostTensor(DType::kF64, inputs.q.shape());
  result.dk = HostTensor(DType::kF64, inputs.k.shape());
  result.dv = HostTensor(DType::kF64, inputs.v.shape());
  BackwardArgs backward;
  backward.q = args.q, backward.k = args.k, backward.v = args.v;
  backward.out = result.out.view(), backward.lse = result.lse.view();
  backward.dout = inputs.dout.view();
  backward.dq = result.dq.view(), backward.dk = result.dk.view(), backward.dv = result.dv.view();
  backward.tensors = args.tensors;
  const std::vector<std::string> read = problem.score_mod().tensors();
  for (const std::string& name : float_tensors) {
    // Zero-filled: the gradient of a tensor the variant no longer reads.
    result.tensor_grads.emplace(name, HostTensor(DType::kF64, inputs.tensors.at(name).shape()));
    if (std::find(read.begin(), read.end(), name) != read.end()) {
      backward.tensor_grads[name] = result.tensor_grads.at(name).view();
    }
  }
  plan->backward(backward);
  return result;
}

std::string discrimination_failure(const ProblemDesc& desc, const ReferenceInputs& inputs,
                                   const std::vector<std::string>& float_tensors,
                                   const std::vector<ToleratedOutput>& outputs) {
  const Problem problem(desc);
  std::vector<ReferenceVariant> variants;
  if (!problem.score_mod().is_identity_score()) {
    variants.push_back(ReferenceVariant::kWithoutScoreModifier);
  }
  const Graph& mask = problem.mask_mod();
  if (!(mask.is_literal() && mask.node(mask.root()).literal != 0.0)) {
    variants.push_back(ReferenceVariant::kWithoutMask);
  }
  if (problem.wants_backward() && !derivative_is_one(problem.score_mod())) {
    variants.push_back(ReferenceVariant::kScoreDerivativeOne);
  }
  std::string failure;
  for (ReferenceVariant variant : variants) {
    const ReferenceOutputs wrong = run_reference(desc, inputs, float_tensors, variant);
    for (const ToleratedOutput& output : outputs) {
      const HostTensor* got = output_of(wrong, output.name);
      if (got == nullptr || !changes(*got, *output.reference)) continue;
      const OutputCheck check =
          compare(output.name, got->view(), output.reference->view(), output.tolerance, true);
      if (!check.passed()) continue;
      if (!failure.empty()) failure += "; ";
      failure += fmt::format(
          "{} passes the tolerance of {} (max error {:.3g} <= allowed {:.3g} at element {})",
          describe(variant), output.name, check.max_error, check.allowed, check.worst_index);
    }
  }
  return failure;
}

}  // namespace flexattn::conformance::detail
