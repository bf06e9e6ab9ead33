// The plan proof computed from what executes (docs/design.md section 4): every engine's proof is
// lifted from its lowered artifact, so a lowering that differs from the request in any way (an
// operation dropped, a constant changed, operands swapped, the mask or a derivative dropped) is
// refused, and the unmutated lowering is accepted.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "engines/cpu/cpu.hpp"
#include "engines/cpu/tape_proof.hpp"
#include "support/cpu_tape_faults.hpp"
#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/modifiers.hpp"
#include "support/test_support.hpp"

namespace flexattn::test {
namespace {

constexpr std::int64_t kSequence = 64;

struct ProofCase {
  std::string name;
  ProblemDesc desc;
};

ProblemDesc base_desc(Direction direction) {
  ProblemDesc desc;
  desc.batch = 1;
  desc.heads_q = 2;
  desc.seq_len_q = kSequence;
  desc.head_dim_qk = 16;
  desc.direction = direction;
  return desc;
}

ProofCase text_case(std::string name, const std::string& score_mod, const std::string& mask_mod,
                    std::map<std::string, TensorDecl> tensors = {},
                    std::map<std::string, double> params = {}) {
  ProofCase proof_case{std::move(name), base_desc(Direction::kForwardBackward)};
  ProblemDesc& desc = proof_case.desc;
  desc.tensors = std::move(tensors);
  desc.params = std::move(params);
  if (!score_mod.empty()) desc.score_mod = ir::parse(score_mod, desc.scope());
  if (!mask_mod.empty()) desc.mask_mod = ir::parse(mask_mod, desc.scope());
  return proof_case;
}

// The catalogue's modifiers and masks, and more: a softcap with its cap as a parameter, ALiBi
// with learned slopes, a clamped relative bias, a sliding window, a document mask, where and %,
// and backward problems whose score modifier reads float tensors (their gradients).
std::vector<ProofCase> proof_cases() {
  std::vector<ProofCase> cases;
  const CatalogueDims dims{1, 2, kSequence, kSequence};
  for (const NamedModifier& modifier : modifier_catalogue()) {
    ProofCase proof_case{"catalogue_" + modifier.name, base_desc(Direction::kForwardBackward)};
    apply_modifier(modifier, proof_case.desc);
    for (const CatalogueTensor& tensor : modifier.tensors) {
      proof_case.desc.tensors[tensor.name].shape = modifier.tensor_shape(tensor, dims);
    }
    cases.push_back(std::move(proof_case));
  }
  const TensorDecl slopes{DType::kF32, {2}};
  const TensorDecl relative{DType::kF32, {2, 2 * kSequence + 1}};
  const TensorDecl bias{DType::kF32, {2, kSequence, kSequence}};
  const TensorDecl documents{DType::kI32, {kSequence}};
  cases.push_back(text_case("softcap", "30 * tanh(score / 30)", ""));
  cases.push_back(
      text_case("softcap_param", "cap * tanh(score / cap)", "q >= kv", {}, {{"cap", 20.0}}));
  cases.push_back(
      text_case("alibi", "score + slopes[h] * (kv - q)", "q >= kv", {{"slopes", slopes}}));
  cases.push_back(text_case("relative_bias_clamp", "score + rel[h, clamp(kv - q + 64, 0, 128)]", "",
                            {{"rel", relative}}));
  cases.push_back(text_case("sliding_window", "", "q >= kv && q - kv < 24"));
  cases.push_back(
      text_case("document_mask", "score", "doc[q] == doc[kv] && q >= kv", {{"doc", documents}}));
  cases.push_back(text_case("where_mod", "where(kv % 5 == 3, score - 2, score * 0.5)",
                            "kv % 3 != 1 || q - kv > 7"));
  cases.push_back(text_case("bias_gradient", "score * 0.75 + bias[h, q, kv] * sigmoid(score)",
                            "q + (KV_LEN - Q_LEN) >= kv", {{"bias", bias}}));
  cases.push_back(
      text_case("exp_log", "log(exp(score) + 1) - sqrt(abs(score) + 2) / 3", "kv <= q"));
  return cases;
}

const char* fault_name(cpu::TapeFault fault) {
  switch (fault) {
    case cpu::TapeFault::kDropOperation:
      return "drop an operation";
    case cpu::TapeFault::kChangeConstant:
      return "change a constant";
    case cpu::TapeFault::kSwapOperands:
      return "swap operands";
    case cpu::TapeFault::kDropMask:
      return "drop the mask";
    case cpu::TapeFault::kDropDerivative:
      return "drop the derivative";
  }
  return "?";
}

constexpr cpu::TapeFault kTapeFaults[] = {
    cpu::TapeFault::kDropOperation, cpu::TapeFault::kChangeConstant, cpu::TapeFault::kSwapOperands,
    cpu::TapeFault::kDropMask, cpu::TapeFault::kDropDerivative};

// The safety bound on sites per fault and problem (the largest tape here has fewer instructions).
constexpr std::size_t kMaxSites = 200;

TEST(PlanProofCpu, AcceptsTheUnmutatedLoweringForwardAndBackward) {
  const auto engine = make_cpu_engine();
  for (const ProofCase& proof_case : proof_cases()) {
    for (Direction direction : {Direction::kForward, Direction::kForwardBackward}) {
      ProblemDesc desc = proof_case.desc;
      desc.direction = direction;
      const Problem problem(desc);
      const auto plan = engine->plan(problem);
      EXPECT_EQ(plan_proof_failure(plan->info(), problem), "") << proof_case.name;
    }
  }
}

TEST(PlanProofCpu, RefusesEveryFaultAtEverySite) {
  std::map<cpu::TapeFault, std::size_t> refused;
  for (const ProofCase& proof_case : proof_cases()) {
    const Problem problem(proof_case.desc);
    for (cpu::TapeFault fault : kTapeFaults) {
      for (std::size_t site = 0; site < kMaxSites; ++site) {
        const auto engine = cpu::make_faulty_cpu_engine(fault, site);
        if (!engine->supports(problem)) break;
        const auto plan = engine->plan(problem);
        const std::string failure = plan_proof_failure(plan->info(), problem);
        EXPECT_NE(failure, "") << proof_case.name << ": " << fault_name(fault) << " at site "
                               << site << " passed the proof";
        ++refused[fault];
      }
    }
  }
  // Every fault had sites to apply to (so the loop above checked something).
  for (cpu::TapeFault fault : kTapeFaults) {
    EXPECT_GT(refused[fault], 0u) << fault_name(fault);
  }
}

// A fault is refused by selection too, with the part that differs named.
TEST(PlanProofCpu, SelectionRefusesADroppedDerivative) {
  const std::vector<ProofCase> cases = proof_cases();
  const ProofCase& softcap = *std::find_if(cases.begin(), cases.end(),
                                           [](const ProofCase& c) { return c.name == "softcap"; });
  const Problem problem(softcap.desc);
  const auto engine = cpu::make_faulty_cpu_engine(cpu::TapeFault::kDropDerivative, 0);
  const std::string failure = plan_proof_failure(engine->plan(problem)->info(), problem);
  EXPECT_NE(failure.find("engine cpu: the derivative differs"), std::string::npos) << failure;
  const auto mask_engine = cpu::make_faulty_cpu_engine(cpu::TapeFault::kDropMask, 0);
  ProblemDesc masked = softcap.desc;
  masked.mask_mod = ir::query() >= ir::key();
  const Problem masked_problem(masked);
  const std::string mask_failure =
      plan_proof_failure(mask_engine->plan(masked_problem)->info(), masked_problem);
  EXPECT_NE(mask_failure.find("engine cpu: the forward modifier differs"), std::string::npos)
      << mask_failure;
}

TEST(PlanProofCpuRef, AcceptsItsOwnPlansForwardAndBackward) {
  const auto engine = make_cpu_ref_engine();
  for (const ProofCase& proof_case : proof_cases()) {
    const Problem problem(proof_case.desc);
    EXPECT_EQ(plan_proof_failure(engine->plan(problem)->info(), problem), "") << proof_case.name;
  }
}

}  // namespace
}  // namespace flexattn::test
