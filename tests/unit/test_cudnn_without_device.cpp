// The cudnn engine's decisions that need neither libcudnn nor a device (only its headers at build
// time): what the lowering table refuses, with which reason, that the modifiers it keeps still
// lower, and which cuDNN engines on which release count as verified. Runs wherever the engine is
// built, CI included.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "flexattn/conformance.hpp"
#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

#if FLEXATTN_HAVE_CUDNN
#include "engines/cudnn/cudnn_engine.hpp"
#include "engines/cudnn/guards.hpp"
#endif

namespace flexattn {
namespace {

#if FLEXATTN_HAVE_CUDNN

ProblemDesc bf16_desc(Direction direction) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = 100;
  desc.seq_len_kv = 100;
  desc.head_dim_qk = 64;
  desc.dtype = DType::kBF16;
  desc.device = Device::kCuda;
  desc.direction = direction;
  return desc;
}

Support lowering_of(const std::vector<std::string>& modifiers, Direction direction) {
  return check_cudnn_lowering(Problem(test::catalogue_desc(modifiers, bf16_desc(direction))));
}

// The first device run measured cuDNN's TANH_FWD outside flexattn's tolerance, so softcap, in
// either direction (the derivative reads tanh too), is refused with the measurement as reason.
TEST(CudnnLowering, RefusesTanhWithTheMeasuredInaccuracy) {
  for (const std::vector<std::string>& modifiers :
       {std::vector<std::string>{"softcap"}, std::vector<std::string>{"softcap", "causal"}}) {
    for (Direction direction : {Direction::kForward, Direction::kForwardBackward}) {
      const Support support = lowering_of(modifiers, direction);
      ASSERT_FALSE(support.ok()) << modifiers.front();
      const std::string& reason = support.reason();
      EXPECT_NE(reason.find("'tanh'"), std::string::npos) << reason;
      EXPECT_NE(reason.find("TANH_FWD is not accurate enough"), std::string::npos) << reason;
      EXPECT_NE(reason.find("1.5e-5"), std::string::npos) << reason;
      EXPECT_NE(reason.find("cuDNN 9.19"), std::string::npos) << reason;
      EXPECT_NE(reason.find("ir_tanh"), std::string::npos) << reason;
    }
  }
  ProblemDesc nested = bf16_desc(Direction::kForward);
  nested.score_mod = ir::parse("score + 0.5 * tanh(score)");
  const Support support = check_cudnn_lowering(Problem(nested));
  ASSERT_FALSE(support.ok());
  EXPECT_NE(support.reason().find("'tanh'"), std::string::npos) << support.reason();
}

// What the device run verified still lowers: the refusal is of tanh, not of modifiers.
TEST(CudnnLowering, LowersTheVerifiedModifiers) {
  for (const std::vector<std::string>& modifiers :
       {std::vector<std::string>{}, std::vector<std::string>{"causal"},
        std::vector<std::string>{"alibi"}, std::vector<std::string>{"alibi", "causal"}}) {
    const Support support = lowering_of(modifiers, Direction::kForward);
    EXPECT_TRUE(support.ok()) << (modifiers.empty() ? "none" : modifiers.front()) << ": "
                              << support.reason();
  }
  for (const std::vector<std::string>& modifiers :
       {std::vector<std::string>{}, std::vector<std::string>{"causal"}}) {
    const Support support = lowering_of(modifiers, Direction::kForwardBackward);
    EXPECT_TRUE(support.ok()) << support.reason();
  }
}

// The backward graph classes cuDNN computed wrongly with exit status 0 are refused, naming the
// class; the forward of the same modifiers still lowers, and so does a backward that avoids both
// classes (ALiBi with a constant slope, a causal mask).
TEST(CudnnLowering, RefusesTheBackwardClassesCudnnGotWrong) {
  const auto support_of = [](const char* score_mod, const char* mask_mod, Direction direction) {
    ProblemDesc desc = bf16_desc(direction);
    desc.seq_len_q = 17;
    desc.seq_len_kv = 33;
    if (score_mod != nullptr) desc.score_mod = ir::parse(score_mod);
    if (mask_mod != nullptr) desc.mask_mod = ir::parse(mask_mod);
    return check_cudnn_lowering(Problem(desc));
  };
  const struct {
    const char* score_mod;
    const char* mask_mod;
    const char* reason;
  } refused[] = {
      {"score + (kv - q) * exp2(-(h + 1))", nullptr, "reads the index h"},
      {"score + float(h) * 0.25", nullptr, "reads the index h"},
      {"score + float(b)", nullptr, "reads the index b"},
      {nullptr, "q >= kv || h == 1", "reads the index h"},
      {"score * score", nullptr, "derivative other than 1 ('score + score')"},
      {"score * 0.5", "q >= kv", "derivative other than 1"},
      {"where(score > 0, score, score * 0.25)", nullptr, "derivative other than 1"},
  };
  for (const auto& c : refused) {
    const Support backward = support_of(c.score_mod, c.mask_mod, Direction::kForwardBackward);
    ASSERT_FALSE(backward.ok()) << (c.score_mod ? c.score_mod : c.mask_mod);
    EXPECT_NE(backward.reason().find(c.reason), std::string::npos) << backward.reason();
    EXPECT_NE(backward.reason().find("cudnn backward refuses"), std::string::npos)
        << backward.reason();
    const Support forward = support_of(c.score_mod, c.mask_mod, Direction::kForward);
    EXPECT_TRUE(forward.ok()) << forward.reason();
  }
  for (const char* score_mod : {"score + (kv - q) * 0.5", "score + float(kv % 3)"}) {
    const Support backward = support_of(score_mod, "q >= kv", Direction::kForwardBackward);
    EXPECT_TRUE(backward.ok()) << score_mod << ": " << backward.reason();
  }
}

// cuDNN 9.19's heuristics crashed the process on forward graphs whose score modifier compares q
// with kv; those are refused before cuDNN sees them, in both directions, naming the class. The
// same comparison as the mask, and index arithmetic in the score modifier, still lower.
TEST(CudnnLowering, RefusesScoreModifiersComparingQueryWithKey) {
  for (const char* score_mod :
       {"where(kv > q, -inf, score)", "where(q < kv, -1e30, score)",
        "where(kv > q + 3, -inf, score)", "where(q - 2 == kv, score * 2, score)",
        "where(score > 0 && q >= kv, score, score * 0.5)"}) {
    for (Direction direction : {Direction::kForward, Direction::kForwardBackward}) {
      ProblemDesc desc = bf16_desc(direction);
      desc.score_mod = ir::parse(score_mod);
      const Support support = check_cudnn_lowering(Problem(desc));
      ASSERT_FALSE(support.ok()) << score_mod;
      EXPECT_NE(support.reason().find("compares q with kv"), std::string::npos) << support.reason();
    }
  }
  for (const auto& [score_mod, mask_mod] : {std::pair<const char*, const char*>{nullptr, "q >= kv"},
                                            {"score + float(kv - q) * 0.5", "kv <= q + 3"},
                                            {"where(kv % 5 == 3, score * 0.5, score)", nullptr},
                                            {"where(q == 3, score * 2, score)", nullptr}}) {
    ProblemDesc desc = bf16_desc(Direction::kForward);
    if (score_mod != nullptr) desc.score_mod = ir::parse(score_mod);
    if (mask_mod != nullptr) desc.mask_mod = ir::parse(mask_mod);
    const Support support = check_cudnn_lowering(Problem(desc));
    EXPECT_TRUE(support.ok()) << (score_mod ? score_mod : mask_mod) << ": " << support.reason();
  }
}

// The first device run verified eng2_k24=7 (forward) and eng6_k24=26 (backward) on cuDNN 9.19.0
// and sm_90; another patch level, another knob, another architecture, another engine or the other
// graph kind is not verified.
TEST(CudnnGuards, VerifiedEnginesAreScopedToKindKnobsReleaseAndArchitecture) {
  using cudnn::EngineChoice;
  using cudnn::GraphKind;
  constexpr std::size_t k9190 = 91900, k9193 = 91903, k9140 = 91400, k9200 = 92000;
  constexpr int kHopper = 90, kAmpere = 80, kBlackwell = 100;
  const EngineChoice eng2{2, {{24, 7}}};
  const EngineChoice eng6{6, {{24, 26}}};
  EXPECT_TRUE(cudnn::is_verified(GraphKind::kForward, eng2, k9190, kHopper));
  EXPECT_TRUE(cudnn::is_verified(GraphKind::kBackward, eng6, k9190, kHopper));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng2, k9193, kHopper));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng2, k9190, kAmpere));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng2, k9190, kBlackwell));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, EngineChoice{2, {{24, 8}}}, k9190, kHopper));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, EngineChoice{2, {}}, k9190, kHopper));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kBackward, eng2, k9190, kHopper));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng6, k9190, kHopper));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng2, k9140, kHopper));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng2, k9200, kHopper));
  EXPECT_EQ(cudnn::verified_engines(GraphKind::kForward), "eng2_k24=7 on cuDNN 9.19.0 sm_90");
  EXPECT_EQ(cudnn::verified_engines(GraphKind::kBackward), "eng6_k24=26 on cuDNN 9.19.0 sm_90");
}

// ---- the plan proof: modifiers read back from the graph descriptors ---------------------------

// The catalogue's score modifiers and masks that the cudnn lowering takes (tanh and gathers are
// refused before any descriptor exists), forward and backward, in bf16.
std::vector<Problem> proof_problems() {
  std::vector<Problem> problems;
  for (const char* modifier : {"none", "bias", "alibi", "gate", "piecewise", "neginf"}) {
    for (const char* mask :
         {"none", "causal", "causalbr", "window", "document", "prefix", "emptyrows"}) {
      for (bool backward : {false, true}) {
        conformance::Case test_case;
        test_case.shape = conformance::Shape{2, 4, 2, 100, 60, 64, 64};
        test_case.dtype = DType::kBF16;
        test_case.modifier = modifier;
        test_case.mask = mask;
        test_case.backward = backward;
        test_case.name = fmt::format("{}_{}{}", modifier, mask, backward ? "_bwd" : "");
        problems.emplace_back(conformance::instantiate(test_case, Device::kCuda, 1).desc);
      }
    }
  }
  return problems;
}

std::string label(const Problem& problem) {
  return fmt::format("'{}' masked by '{}'{}", problem.score_mod().to_string(),
                     problem.mask_mod().to_string(), problem.wants_backward() ? " (backward)" : "");
}

#define SKIP_WITHOUT_LIBCUDNN(proof)                                                           \
  do {                                                                                         \
    if (!(proof).proof && (proof).proof.reason().find("libcudnn.so.9") != std::string::npos) { \
      GTEST_SKIP() << (proof).proof.reason();                                                  \
    }                                                                                          \
  } while (false)

// Every graph the lowering builds reads back to the requested modifier, mask, scale and
// derivative. cuDNN answers the tensors' attributes; the pointwise modes are taken as it accepted
// them (cuDNN 9.19 answers CUDNN_STATUS_NOT_SUPPORTED for them, with or without a device).
TEST(CudnnPlanProof, EveryCatalogueGraphReadsBackToItsRequest) {
  int proven = 0;
  for (const Problem& problem : proof_problems()) {
    const CudnnGraphProof proof = prove_cudnn_graphs_without_device(problem);
    SKIP_WITHOUT_LIBCUDNN(proof);
    EXPECT_TRUE(proof.proof.ok()) << label(problem) << ": " << proof.proof.reason() << "\n"
                                  << proof.read_back;
    EXPECT_FALSE(proof.fault_applied);
    EXPECT_NE(proof.read_back.find("values answered by cuDNN"), std::string::npos);
    proven += proof.proof.ok() ? 1 : 0;
  }
  EXPECT_EQ(proven, 6 * 7 * 2);
}

// What is read back is the graph's, not the request's: the parameter, the lengths and the exp2
// recipe appear as the constants and operations cuDNN holds.
TEST(CudnnPlanProof, ReadsBackTheConstantsAndRecipesCudnnHolds) {
  ProblemDesc desc = bf16_desc(Direction::kForward);
  desc.params["slope"] = 0.1;
  desc.score_mod = ir::parse("score * slope + exp2(float(kv - q)) + float(KV_LEN)", desc.scope());
  desc.mask_mod = ir::parse("clamp(q - kv, 0, 8) < 5");
  const CudnnGraphProof proof = prove_cudnn_graphs_without_device(Problem(desc));
  SKIP_WITHOUT_LIBCUDNN(proof);
  ASSERT_TRUE(proof.proof.ok()) << proof.proof.reason();
  EXPECT_NE(proof.read_back.find("score * 0.1"), std::string::npos) << proof.read_back;
  EXPECT_NE(proof.read_back.find("exp("), std::string::npos) << proof.read_back;
  EXPECT_NE(proof.read_back.find("+ 100"), std::string::npos) << proof.read_back;
  EXPECT_NE(proof.read_back.find("min(max("), std::string::npos) << proof.read_back;
  EXPECT_EQ(proof.read_back.find("slope"), std::string::npos) << proof.read_back;
}

// A tensor load that varies along no axis of the problem (ALiBi's slopes[h] with one head, a
// bias[h, q, kv] at one query and key) is a broadcast scalar: it reads back as element 0 on both
// sides of the proof, not as a load without indices (which the IR refuses, so the plan threw).
TEST(CudnnPlanProof, LoadsThatVaryAlongNoAxisReadBackAsElementZero) {
  for (const char* modifier : {"alibi", "bias", "gate"}) {
    for (const conformance::Shape& shape : {conformance::Shape{1, 1, 1, 577, 577, 64, 64},
                                            conformance::Shape{1, 1, 1, 1, 1, 64, 64}}) {
      conformance::Case test_case;
      test_case.shape = shape;
      test_case.dtype = DType::kBF16;
      test_case.modifier = modifier;
      test_case.mask = "causalbr";
      test_case.name = modifier;
      const Problem problem(conformance::instantiate(test_case, Device::kCuda, 1).desc);
      const CudnnGraphProof proof = prove_cudnn_graphs_without_device(problem);
      SKIP_WITHOUT_LIBCUDNN(proof);
      EXPECT_TRUE(proof.proof.ok())
          << label(problem) << " at " << shape.seq_len_q << ": " << proof.proof.reason() << "\n"
          << proof.read_back;
    }
  }
}

// Each fault the lowering can be made to emit (an operation dropped, a constant changed, the
// operands of a non-commutative operation swapped, the mask's select dropped, the derivative's
// multiply dropped) is refused by the proof, in every catalogue graph it applies to.
TEST(CudnnPlanProof, RefusesEveryFaultTheLoweringEmits) {
  std::map<CudnnLoweringFault, int> applied, refused;
  for (const Problem& problem : proof_problems()) {
    for (CudnnLoweringFault fault :
         {CudnnLoweringFault::kDropOperation, CudnnLoweringFault::kChangeConstant,
          CudnnLoweringFault::kSwapOperands, CudnnLoweringFault::kDropMaskSelect,
          CudnnLoweringFault::kDropDerivativeMultiply}) {
      const CudnnGraphProof proof = prove_cudnn_graphs_without_device(problem, fault);
      SKIP_WITHOUT_LIBCUDNN(proof);
      if (!proof.fault_applied) continue;
      ++applied[fault];
      refused[fault] += proof.proof.ok() ? 0 : 1;
      EXPECT_FALSE(proof.proof.ok()) << label(problem) << " with fault " << static_cast<int>(fault)
                                     << " read back as " << proof.read_back;
    }
  }
  EXPECT_EQ(applied.size(), 5U);
  for (const auto& [fault, count] : applied) {
    EXPECT_GT(count, 0) << static_cast<int>(fault);
    EXPECT_EQ(refused[fault], count) << "fault " << static_cast<int>(fault);
  }
}

#else

TEST(CudnnLowering, NotBuilt) { GTEST_SKIP() << "built without cuDNN headers"; }

#endif

}  // namespace
}  // namespace flexattn
