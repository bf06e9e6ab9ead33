// The cudnn engine's decisions that need neither libcudnn nor a device (only its headers at build
// time): what the lowering table refuses, with which reason, that the modifiers it keeps still
// lower, and which cuDNN engines on which release count as verified. Runs wherever the engine is
// built, CI included.
#include <gtest/gtest.h>

#include <string>
#include <vector>

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

// The first device run verified eng2 (forward) and eng6 (backward) on cuDNN 9.19; another
// release, another engine or the other graph kind is not verified.
TEST(CudnnGuards, VerifiedEnginesAreScopedToKindAndRelease) {
  using cudnn::EngineChoice;
  using cudnn::GraphKind;
  constexpr std::size_t k9190 = 91900, k9193 = 91903, k9140 = 91400, k9200 = 92000;
  const EngineChoice eng2{2, {{24, 7}}};
  const EngineChoice eng6{6, {{24, 26}}};
  EXPECT_TRUE(cudnn::is_verified(GraphKind::kForward, eng2, k9190));
  EXPECT_TRUE(cudnn::is_verified(GraphKind::kForward, eng2, k9193));
  EXPECT_TRUE(cudnn::is_verified(GraphKind::kBackward, eng6, k9190));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kBackward, eng2, k9190));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng6, k9190));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng2, k9140));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, eng2, k9200));
  EXPECT_FALSE(cudnn::is_verified(GraphKind::kForward, EngineChoice{5, {}}, k9190));
  EXPECT_EQ(cudnn::verified_engines(GraphKind::kForward), "eng2 on cuDNN 9.19");
  EXPECT_EQ(cudnn::verified_engines(GraphKind::kBackward), "eng6 on cuDNN 9.19");
}

#else

TEST(CudnnLowering, NotBuilt) { GTEST_SKIP() << "built without cuDNN headers"; }

#endif

}  // namespace
}  // namespace flexattn
