// The planted faulty engines (testing.hpp): float64 attention that honours the mask but ignores
// the score modifier, forward and backward, exactly the failure of docs/design.md section 1. They
// compute with cpu_ref on the problem without its score modifier (so the fault is the only
// difference from the oracle), and differ only in the proof they report: the dropping engine
// reports the hashes of what it lowered (so the plan proof refuses it), the lying one the
// requested hashes (so only a comparison of outputs catches it).
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"
#include "flexattn/testing.hpp"

namespace flexattn::testing {

namespace {

enum class Claim { kHonest, kLying };

// The fault: the request with its score modifier dropped (the identity).
Problem without_score_modifier(const Problem& problem) {
  ProblemDesc desc = problem.desc();
  desc.score_mod.reset();
  return Problem(desc);
}

class FaultyPlan final : public Plan {
 public:
  FaultyPlan(PlanInfo info, Problem problem, std::unique_ptr<Plan> dropped)
      : Plan(std::move(info)), problem_(std::move(problem)), dropped_(std::move(dropped)) {}
  const Problem& problem() const override { return problem_; }

 protected:
  void run_forward(const ForwardArgs& args) const override { dropped_->forward(args); }
  void run_backward(const BackwardArgs& args) const override;

 private:
  Problem problem_;
  std::unique_ptr<Plan> dropped_;  // cpu_ref's plan of the problem without the score modifier
};

void FaultyPlan::run_backward(const BackwardArgs& args) const {
  // Without the modifier no tensor is read by a score, so every tensor gradient is zero.
  BackwardArgs dropped_args = args;
  dropped_args.tensor_grads.clear();
  const std::vector<std::string> read = dropped_->problem().score_mod().tensors();
  for (const auto& [name, gradient] : args.tensor_grads) {
    if (std::find(read.begin(), read.end(), name) != read.end()) {
      dropped_args.tensor_grads[name] = gradient;
      continue;
    }
    for (std::int64_t i = 0; i < gradient.numel(); ++i) gradient.store(i, 0.0);
  }
  dropped_->backward(dropped_args);
}

class FaultyEngine final : public Engine {
 public:
  FaultyEngine(std::string_view name, Claim claim) : name_(name), claim_(claim) {}
  std::string_view name() const override { return name_; }
  Support available() const override { return Support::yes(); }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    if (problem.device() != Device::kCpu) {
      result.support = Support::no("computes on the CPU only");
      return result;
    }
    result.support = Support::yes();
    if (stage == Stage::kCheck) return result;
    const Problem dropped = without_score_modifier(problem);
    PlanInfo info;
    info.engine = name_;
    // What it really lowered: the identity score modifier, its derivatives and the problem's mask.
    const bool honest = claim_ == Claim::kHonest;
    info.lowered_hash = honest ? dropped.modifier_hash() : problem.modifier_hash();
    info.lowered_backward_hash = honest ? dropped.backward_hash() : problem.backward_hash();
    info.description = honest ? "test fixture: float64 attention that drops the score modifier "
                                "and reports the hashes of what it lowered"
                              : "test fixture: float64 attention that drops the score modifier "
                                "and claims the requested hashes";
    info.signature = problem.signature();
    std::unique_ptr<Plan> dropped_plan =
        internal::make_cpu_ref_engine(ScoreDerivative::kExact)->plan(dropped);
    result.plan = std::make_unique<FaultyPlan>(std::move(info), problem, std::move(dropped_plan));
    return result;
  }

 private:
  std::string name_;
  Claim claim_;
};

}  // namespace

std::shared_ptr<const Engine> make_dropping_engine() {
  return std::make_shared<FaultyEngine>("faulty_drop_mod", Claim::kHonest);
}

std::shared_ptr<const Engine> make_lying_engine() {
  return std::make_shared<FaultyEngine>("faulty_lying_hash", Claim::kLying);
}

std::vector<std::shared_ptr<const Engine>> planted_faulty_engines() {
  return {make_dropping_engine(), make_lying_engine()};
}

}  // namespace flexattn::testing
