// The conformance matrix as a GoogleTest suite: every built-in engine (but the oracle itself) on
// every case of the tier, against cpu_ref. Tests are named `<engine>/<shape>.<modifier>_<mask>`;
// unsupported combinations are skipped with the engine's reason so coverage gaps show.
// FLEXATTN_CONFORMANCE_TIER=full selects the full tier (default: quick).
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

#include "flexattn/conformance.hpp"
#include "flexattn/context.hpp"
#include "flexattn/testing.hpp"

namespace flexattn::conformance {
namespace {

class ConformanceTest : public ::testing::Test {
 public:
  ConformanceTest(std::shared_ptr<const Engine> engine, Case test_case)
      : engine_(std::move(engine)), case_(std::move(test_case)) {}

  void TestBody() override {
    const Outcome outcome = run_case(*engine_, case_);
    if (outcome.status == Status::kSkipped) GTEST_SKIP() << outcome.reason;
    for (const OutputCheck& check : outcome.checks) {
      EXPECT_TRUE(check.guard_intact) << check.output << ": write outside the buffer";
      EXPECT_LE(check.max_error, check.allowed)
          << check.output << ": " << 100.0 * check.fraction_outside
          << "% of elements outside tolerance";
    }
    EXPECT_EQ(outcome.status, Status::kPass) << outcome.reason;
  }

 private:
  std::shared_ptr<const Engine> engine_;
  Case case_;
};

Tier tier_from_environment() {
  const char* text = std::getenv("FLEXATTN_CONFORMANCE_TIER");
  return text == nullptr ? Tier::kQuick : parse_tier(text);
}

// The tier of the environment, then the non-finite tier (docs/design.md, "Non-finite values").
void register_matrix() {
  std::vector<Case> all_cases = cases(tier_from_environment());
  for (Case& c : cases(Tier::kNonFinite)) all_cases.push_back(std::move(c));
  for (const std::shared_ptr<const Engine>& engine : builtin_engines()) {
    if (engine->name() == "cpu_ref") continue;  // the oracle is not compared with itself
    for (const Case& test_case : all_cases) {
      const std::size_t slash = test_case.name.find('/');
      const std::string suite = std::string(engine->name()) + "/" + test_case.name.substr(0, slash);
      const std::string name = test_case.name.substr(slash + 1);
      ::testing::RegisterTest(suite.c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                              [engine, test_case]() -> ::testing::Test* {
                                return new ConformanceTest(engine, test_case);
                              });
    }
  }
}

// The planted faulty engines must fail the matrix on a modifier they drop: the dropping one by
// the plan proof, the lying one by the comparison with cpu_ref.
TEST(PlantedFaults, DroppingEngineFailsThePlanProof) {
  const Case softcap = [] {
    for (const Case& c : cases(Tier::kQuick)) {
      if (c.modifier == "softcap5" && c.mask == "none" && !c.backward) return c;
    }
    throw std::runtime_error("catalogue lost its softcap5 case");
  }();
  const Outcome outcome = run_case(*testing::make_dropping_engine(), softcap);
  EXPECT_EQ(outcome.status, Status::kFail);
  EXPECT_NE(outcome.reason.find("plan proof"), std::string::npos) << outcome.reason;
}

// The lying engine computes the request without its score modifier and claims the requested
// hashes: every quick case whose modifier matters must fail, in every dtype, forward and
// backward, on out, the LSE and each gradient separately (dq, dk, dv, the tensors'). A row with
// one key has P = 1 whatever the modifier (and ALiBi adds 0 there), so cases with seq_len_kv 1
// are left out.
TEST(PlantedFaults, LyingEngineFailsEveryModifierCaseOnEveryOutput) {
  std::set<DType> dtypes;
  int backward_cases = 0;
  for (const Case& c : cases(Tier::kQuick)) {
    const Outcome outcome = run_case(*testing::make_lying_engine(), c);
    if (c.page_size > 0) {  // it reads no KV cache: refused before its lowering
      EXPECT_EQ(outcome.status, Status::kSkipped) << c.name;
      EXPECT_NE(outcome.reason.find("reads no paged KV cache"), std::string::npos) << c.name;
      continue;
    }
    if (c.modifier == "none") {
      EXPECT_EQ(outcome.status, Status::kPass) << c.name << ": " << outcome.reason;
      continue;
    }
    if (c.shape.seq_len_kv == 1) continue;
    ASSERT_EQ(outcome.status, Status::kFail) << c.name;
    EXPECT_EQ(outcome.reason.find("catalogue"), std::string::npos) << c.name << outcome.reason;
    ASSERT_GE(outcome.checks.size(), c.backward ? 5u : 2u) << c.name;  // every output compared
    for (const OutputCheck& check : outcome.checks) {
      EXPECT_FALSE(check.passed()) << c.name << ": " << check.output << " passed, error "
                                   << check.max_error << " <= " << check.allowed;
    }
    dtypes.insert(c.dtype);
    backward_cases += c.backward ? 1 : 0;
  }
  EXPECT_EQ(dtypes.size(), 3u);
  EXPECT_GE(backward_cases, 30);
}

// The dropping engine reports the hashes of what it lowered: the plan proof refuses it before any
// output is compared, backward cases included.
TEST(PlantedFaults, DroppingEngineFailsThePlanProofBackwardToo) {
  for (const Case& c : cases(Tier::kQuick)) {
    if (c.modifier != "softcap5" || !c.backward) continue;
    const Outcome outcome = run_case(*testing::make_dropping_engine(), c);
    EXPECT_EQ(outcome.status, Status::kFail) << c.name;
    EXPECT_NE(outcome.reason.find("plan proof"), std::string::npos) << outcome.reason;
  }
}

// The table's "max err" and "allowed" must describe the same output: a large but tolerated error
// of O next to a tight LSE tolerance once read as 3000x over.
TEST(Outcome, WorstOutputPairsItsErrorWithItsOwnTolerance) {
  Outcome outcome;
  outcome.checks.push_back({"out", 3e-3, 3e-2, 0.0, true});
  outcome.checks.push_back({"lse", 5e-7, 1e-6, 0.0, true});
  ASSERT_NE(outcome.worst(), nullptr);
  EXPECT_EQ(outcome.worst()->output, "lse");
  EXPECT_DOUBLE_EQ(outcome.max_error(), 5e-7);
  EXPECT_DOUBLE_EQ(outcome.allowed(), 1e-6);
  EXPECT_LE(outcome.max_error() / outcome.allowed(), 1.0);
}

TEST(Catalogue, QuickTierCoversEveryFeature) {
  const std::vector<Case> quick = cases(Tier::kQuick);
  std::set<std::string> modifiers, masks, layouts, dtypes;
  std::set<std::int64_t> lengths, head_dims, ratios;
  bool unequal_lengths = false, unequal_head_dims = false, backward = false;
  std::set<std::int64_t> page_sizes;
  std::set<std::string> paged_layouts;
  for (const Case& c : quick) {
    if (c.page_size > 0) {
      page_sizes.insert(c.page_size);
      paged_layouts.insert(std::string(to_string(c.layout)));
      EXPECT_FALSE(c.backward) << c.name;  // a cache problem is forward only
    }
    modifiers.insert(c.modifier);
    masks.insert(c.mask);
    layouts.insert(std::string(to_string(c.layout)));
    dtypes.insert(std::string(to_string(c.dtype)));
    lengths.insert(c.shape.seq_len_q);
    head_dims.insert(c.shape.head_dim_qk);
    ratios.insert(c.shape.heads_q / c.shape.heads_kv);
    if (c.shape.heads_kv == 1) ratios.insert(0);  // MQA
    unequal_lengths |= c.shape.seq_len_q != c.shape.seq_len_kv;
    unequal_head_dims |= c.shape.head_dim_qk != c.shape.head_dim_v;
    backward |= c.backward;
  }
  EXPECT_EQ(modifiers.size(), 19u);
  EXPECT_EQ(masks.size(), 7u);
  EXPECT_EQ(layouts.size(), 4u);
  EXPECT_EQ(dtypes.size(), 3u);
  for (std::int64_t length : {1, 17, 33, 100, 128, 129, 577}) {
    EXPECT_TRUE(lengths.count(length)) << length;
  }
  for (std::int64_t dim : {64, 80, 128, 256}) EXPECT_TRUE(head_dims.count(dim)) << dim;
  for (std::int64_t ratio : {0, 1, 4}) EXPECT_TRUE(ratios.count(ratio)) << ratio;
  EXPECT_TRUE(unequal_lengths);
  EXPECT_TRUE(unequal_head_dims);
  EXPECT_EQ(page_sizes, (std::set<std::int64_t>{1, 16, 64}));
  EXPECT_EQ(paged_layouts, (std::set<std::string>{"bshd", "thd"}));
  EXPECT_TRUE(backward);
}

// Every planted kind, forward and backward (dO backward only), under a mask and the -inf modifier;
// the wide backward and the wgmma prefill over a paged cache among them.
TEST(Catalogue, NonFiniteTierPlantsEveryKindForwardAndBackward) {
  std::set<std::pair<std::string, bool>> planted;
  std::set<std::string> masks;
  bool wide_backward = false;
  bool wgmma_prefill = false;
  for (const Case& c : cases(Tier::kNonFinite)) {
    EXPECT_NE(c.planted, Planted::kNone) << c.name;
    wide_backward = wide_backward || (c.backward && c.shape.head_dim_qk == 256);
    wgmma_prefill = wgmma_prefill || (c.page_size > 0 && c.shape.seq_len_q >= 128 &&
                                      c.shape.head_dim_qk == 128 && c.mask == "window");
    planted.emplace(std::string(to_string(c.planted)), c.backward);
    masks.insert(c.mask);
    if (c.modifier == "custom") {
      EXPECT_NE(c.custom_score_mod.find("-inf"), std::string::npos) << c.name;
    }
  }
  EXPECT_EQ(planted.size(), 7u);
  EXPECT_TRUE(planted.count({"nando", true}));
  EXPECT_TRUE(wide_backward);   // head dim 256 (the GPU's wide backward kernels)
  EXPECT_TRUE(wgmma_prefill);   // chunked prefill on sm_90's wgmma forward, repaired rows
  EXPECT_GE(masks.size(), 4u);  // causal, window, document, and none with the -inf modifier
}

}  // namespace
}  // namespace flexattn::conformance

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  flexattn::conformance::register_matrix();
  return RUN_ALL_TESTS();
}
