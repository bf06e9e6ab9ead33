// The plan canary (src/core/canary.hpp): engines that hold the right modifier and compute something
// else (the lying engine, a mask-dropping engine, a backward with d score_mod / d score replaced
// by 1) are refused by selection, forced or auto; correct engines pass on every quick-tier case;
// the canary's inputs discriminate, and inputs that cannot are reported; it runs once per plan.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <string>

#include "check/check_internal.hpp"
#include "core/canary.hpp"
#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/conformance.hpp"
#include "flexattn/testing.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

using namespace flexattn::ir;

bool contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

ProblemDesc small_desc(DType dtype = DType::kF32, Direction direction = Direction::kForward) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = 130;  // past the 64- and 128-row tile boundaries
  desc.seq_len_kv = 70;
  desc.head_dim_qk = 32;
  desc.dtype = dtype;
  desc.direction = direction;
  return desc;
}

Problem softcap_causal(DType dtype = DType::kF32, Direction direction = Direction::kForward) {
  ProblemDesc desc = small_desc(dtype, direction);
  desc.score_mod = 30.0 * tanh(score() / 30.0);
  desc.mask_mod = query() >= key();
  return Problem(desc);
}

ContextOptions options_with(std::vector<std::shared_ptr<const Engine>> extra, Policy policy) {
  ContextOptions options;
  options.policy = std::move(policy);
  options.log_level = LogLevel::kOff;
  options.canary = true;
  options.extra_engines = std::move(extra);
  return options;
}

Policy forced(std::string engine) {
  Policy policy;
  policy.force = std::move(engine);
  return policy;
}

Error select_error(Context& context, const Problem& problem) {
  try {
    context.select(problem);
  } catch (const Error& error) {
    return error;
  }
  ADD_FAILURE() << "select() did not throw";
  return Error(ErrorCode::kInternal, "no error");
}

// A plan that runs another plan (built for a different problem of the same signature) while
// claiming the requested problem's proof: an engine that holds the right graph and ignores part
// of it.
class DelegatingPlan final : public Plan {
 public:
  DelegatingPlan(PlanInfo info, Problem problem, std::unique_ptr<Plan> inner)
      : Plan(std::move(info)), problem_(std::move(problem)), inner_(std::move(inner)) {}
  const Problem& problem() const override { return problem_; }

 protected:
  void run_forward(const ForwardArgs& args) const override { inner_->forward(args); }
  void run_backward(const BackwardArgs& args) const override { inner_->backward(args); }

 private:
  Problem problem_;
  std::unique_ptr<Plan> inner_;
};

// cpu_ref computing the request without its mask, reporting the request's hash.
class MaskDroppingEngine final : public Engine {
 public:
  std::string_view name() const override { return "mask_dropping"; }
  Support available() const override { return Support::yes(); }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    result.support = Support::yes();
    if (stage == Stage::kCheck) return result;
    ProblemDesc desc = problem.desc();
    desc.mask_mod.reset();
    std::unique_ptr<Plan> inner = make_cpu_ref_engine()->plan(Problem(desc));
    PlanInfo info = inner->info();
    info.engine = std::string(name());
    info.lowered_hash = problem.modifier_hash();  // the lie
    result.plan = std::make_unique<DelegatingPlan>(std::move(info), problem, std::move(inner));
    return result;
  }
};

// A built-in engine under another name, listed after the planted ones.
class RenamedEngine final : public Engine {
 public:
  RenamedEngine(std::string name, std::shared_ptr<const Engine> inner)
      : name_(std::move(name)), inner_(std::move(inner)) {}
  std::string_view name() const override { return name_; }
  Support available() const override { return inner_->available(); }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    result.support = inner_->supports(problem);
    if (stage == Stage::kBuild && result.support) result.plan = inner_->plan(problem);
    return result;
  }

 private:
  std::string name_;
  std::shared_ptr<const Engine> inner_;
};

// The conformance runner's plain same-precision implementation as an engine: P and dS rounded to
// the storage dtype before their products, the output rounded before the backward's
// rowsum(dO * O), as tensor-core kernels do. A correct engine the canary must pass in every dtype.
class PlainPlan final : public Plan {
 public:
  PlainPlan(PlanInfo info, Problem problem) : Plan(std::move(info)), problem_(std::move(problem)) {}
  const Problem& problem() const override { return problem_; }

 protected:
  void run_forward(const ForwardArgs& args) const override {
    conformance::detail::plain_forward(problem_, args);
  }
  void run_backward(const BackwardArgs& args) const override {
    conformance::detail::plain_backward(problem_, args);
  }

 private:
  Problem problem_;
};

class PlainEngine final : public Engine {
 public:
  std::string_view name() const override { return "plain_rounding"; }
  Support available() const override { return Support::yes(); }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    result.support = Support::yes();
    if (stage == Stage::kCheck) return result;
    PlanInfo info;
    info.engine = std::string(name());
    info.signature = problem.signature();
    info.lowered_hash = problem.modifier_hash();
    info.lowered_backward_hash = problem.wants_backward() ? problem.backward_hash() : 0;
    info.description = "the plain same-precision implementation";
    result.plan = std::make_unique<PlainPlan>(std::move(info), problem);
    return result;
  }
};

void expect_canary_refusal(const Error& error, std::string_view engine) {
  const std::string message = error.what();
  EXPECT_EQ(error.code(), ErrorCode::kUnsupported) << message;
  EXPECT_TRUE(contains(message, fmt::format("canary: engine {} computed", engine))) << message;
  EXPECT_TRUE(contains(message, "is allowed")) << message;
  EXPECT_FALSE(contains(message, "\n")) << message;
}

// ---- refusals -----------------------------------------------------------------------------------

TEST(Canary, RefusesTheLyingEngineWhenForced) {
  Context context(options_with(testing::planted_faulty_engines(), forced("faulty_lying_hash")));
  const Error error = select_error(context, softcap_causal());
  expect_canary_refusal(error, "faulty_lying_hash");
  EXPECT_EQ(context.cached_plans(), 0u);  // a refused plan is never cached
  EXPECT_EQ(context.canary_runs(), 1u);
}

TEST(Canary, RefusesTheLyingEngineInEveryStorageDtype) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    Context context(options_with(testing::planted_faulty_engines(), forced("faulty_lying_hash")));
    expect_canary_refusal(select_error(context, softcap_causal(dtype)), "faulty_lying_hash");
  }
}

TEST(Canary, AutoSelectionMovesPastTheLyingEngine) {
  const auto honest = std::make_shared<RenamedEngine>("honest_cpu", test::builtin_engine("cpu"));
  Context context(
      options_with({testing::make_lying_engine(), honest}, Policy::parse("-cpu,-cpu_ref,-cud*")));
  const Problem problem = softcap_causal();
  EXPECT_EQ(context.select(problem)->info().engine, "cpu");  // honest_cpu's plan
  EXPECT_EQ(context.canary_runs(), 2u);                      // the lying one, then honest_cpu

  Context nothing(options_with({testing::make_lying_engine()}, Policy::parse("faulty_lying_hash")));
  const Error error = select_error(nothing, problem);
  EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(error.what(), "no engine can run this problem")) << error.what();
  EXPECT_TRUE(contains(error.what(), "faulty_lying_hash: refused by the canary: canary: engine"))
      << error.what();
}

TEST(Canary, RefusesAnEngineThatDropsOnlyTheMask) {
  Context context(options_with({std::make_shared<MaskDroppingEngine>()}, forced("mask_dropping")));
  ProblemDesc desc = small_desc();
  desc.mask_mod = query() >= key();
  expect_canary_refusal(select_error(context, Problem(desc)), "mask_dropping");
}

TEST(Canary, RefusesABackwardWithTheDerivativeReplacedByOne) {
  const auto wrong = internal::make_cpu_ref_engine(ScoreDerivative::kReplacedByOne);
  Context context(options_with({wrong}, forced(std::string(wrong->name()))));
  const Error error =
      select_error(context, softcap_causal(DType::kF32, Direction::kForwardBackward));
  expect_canary_refusal(error, wrong->name());
  // The forward is right; only a gradient can show the wrong derivative.
  const std::string message = error.what();
  EXPECT_TRUE(contains(message, "computed dq") || contains(message, "computed dk")) << message;
}

// ---- correct engines, discrimination --------------------------------------------------------

// A backward that rounds P and dS to bf16 (every tensor-core kernel does) sums rounded terms that
// cancel: dK of a key seen by a few sampled rows is far smaller than its terms. The tolerance
// follows the terms (the sum of their absolute values), not the result, so such an engine passes
// where the sampled rows' scores are large (softcap causal at 1024, q scaled up by the canary's
// discrimination), and the dropped-derivative mutant is still refused.
TEST(Canary, PassesAnEngineThatRoundsPAndDsToTheStorageDtype) {
  const PlainEngine plain;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    ProblemDesc desc = small_desc(dtype, Direction::kForwardBackward);
    desc.batch = 1, desc.heads_q = 4, desc.heads_kv = 4;
    desc.seq_len_q = desc.seq_len_kv = 1024;
    desc.head_dim_qk = 128;
    desc.score_mod = 30.0 * tanh(score() / 30.0);
    desc.mask_mod = query() >= key();
    const Problem problem(desc);
    const detail::CanaryResult result = detail::run_canary(plain, *plain.plan(problem));
    EXPECT_TRUE(result.passed) << to_string(dtype) << ": " << result.reason;
    EXPECT_EQ(result.note, "") << to_string(dtype);
  }
}

// Every quick-tier case: the cpu engine passes, the canary's inputs discriminate every applicable
// mutant, and the mutant engines are refused wherever their fault changes the function.
TEST(Canary, QuickTierCpuPassesAndMutantsAreRefused) {
  const auto cpu = test::builtin_engine("cpu");
  const auto lying = testing::make_lying_engine();
  const auto wrong_derivative = internal::make_cpu_ref_engine(ScoreDerivative::kReplacedByOne);
  const MaskDroppingEngine mask_dropping;
  int compared = 0;
  for (const conformance::Case& c : conformance::cases(conformance::Tier::kQuick)) {
    const conformance::Instance instance = conformance::instantiate(c, Device::kCpu, 1);
    const Problem problem(instance.desc);
    if (!cpu->supports(problem)) continue;
    const detail::CanaryResult result = detail::run_canary(*cpu, *cpu->plan(problem));
    EXPECT_TRUE(result.passed) << c.name << ": " << result.reason;
    // The variants that are the same function as the request on the case's problem: a score
    // modifier that is -inf where the derivative differs (P = 0 there), and ALiBi over one key
    // and one query (kv - q = 0). Every other case must discriminate every mutant.
    const bool same_function = (c.modifier == "neginf" && c.backward) ||
                               (c.modifier == "alibi" && c.shape.seq_len_kv == 1);
    if (!same_function) {
      EXPECT_EQ(result.note, "") << c.name;
    }
    ++compared;

    // Each mutant engine must be refused wherever its fault changes the function.
    for (const detail::CanaryVariant& variant : result.variants) {
      if (variant.ratio < detail::kDiscriminationFactor) continue;  // the same function here
      const Engine* mutant = variant.name == "score_mod dropped"          ? lying.get()
                             : variant.name == "mask dropped"             ? &mask_dropping
                             : variant.name == "derivative replaced by 1" ? wrong_derivative.get()
                                                                          : nullptr;
      if (mutant == nullptr || !mutant->supports(problem)) continue;
      EXPECT_FALSE(detail::run_canary(*mutant, *mutant->plan(problem)).passed)
          << c.name << " " << variant.name;
    }
  }
  EXPECT_GT(compared, 100);
}

TEST(Canary, ReportsTheVariantsAndTheirDistance) {
  const auto cpu = test::builtin_engine("cpu");
  const Problem problem = softcap_causal(DType::kBF16, Direction::kForwardBackward);
  const detail::CanaryResult result = detail::run_canary(*cpu, *cpu->plan(problem));
  EXPECT_TRUE(result.passed) << result.reason;
  ASSERT_EQ(result.variants.size(), 3u);
  for (const detail::CanaryVariant& variant : result.variants) {
    EXPECT_GE(variant.ratio, detail::kDiscriminationFactor) << variant.name;
  }
  EXPECT_LE(result.largest_error_ratio, 1.0);
  EXPECT_GT(result.bytes, 0u);
}

// All-zero queries make every score 0, where softcap is the identity: no scale of q helps, and
// the canary must say so instead of claiming it checked the modifier.
TEST(Canary, InputsThatCannotDiscriminateAreReported) {
  const auto cpu = test::builtin_engine("cpu");
  const Problem problem = softcap_causal();
  detail::CanaryOptions options;
  options.zero_queries = true;
  const detail::CanaryResult result = detail::run_canary(*cpu, *cpu->plan(problem), options);
  EXPECT_TRUE(result.passed) << result.reason;  // the engine is right; the inputs are weak
  EXPECT_TRUE(contains(result.note, "do not discriminate")) << result.note;
  EXPECT_TRUE(contains(result.note, "score_mod dropped")) << result.note;
  EXPECT_FALSE(contains(result.note, "mask dropped")) << result.note;  // the mask still shows
}

// ---- once per plan, the opt-out ------------------------------------------------------------

TEST(Canary, RunsOncePerCachedPlan) {
  Context context(options_with({}, forced("cpu")));
  const Problem problem = softcap_causal();
  const auto first = context.select(problem);
  EXPECT_EQ(context.select(problem).get(), first.get());
  EXPECT_EQ(context.canary_runs(), 1u);
  ProblemDesc other = small_desc();
  other.score_mod = 5.0 * tanh(score() / 5.0);
  context.select(Problem(other));
  EXPECT_EQ(context.canary_runs(), 2u);

  Context reference(options_with({}, forced("cpu_ref")));
  reference.select(problem);
  EXPECT_EQ(reference.canary_runs(), 0u);  // the oracle is not compared with itself
}

TEST(Canary, LogsItsVerdict) {
  std::ostringstream log;
  ContextOptions options = options_with({}, forced("cpu"));
  options.log_level = LogLevel::kInfo;
  options.log_stream = &log;
  Context context(options);
  context.select(softcap_causal());
  EXPECT_TRUE(contains(log.str(), "canary for cpu: passed")) << log.str();
}

TEST(Canary, FlexattnCanaryZeroTurnsItOff) {
  {
    const test::ScopedEnvironment off("FLEXATTN_CANARY", "0");
    EXPECT_FALSE(ContextOptions().canary);
    ContextOptions options;
    options.policy = forced("faulty_lying_hash");
    options.extra_engines = testing::planted_faulty_engines();
    Context context(options);
    EXPECT_EQ(context.select(softcap_causal())->info().engine, "faulty_lying_hash");
    EXPECT_EQ(context.canary_runs(), 0u);
  }
  {
    const test::ScopedEnvironment on("FLEXATTN_CANARY", "1");
    EXPECT_TRUE(ContextOptions().canary);
  }
  const test::ScopedEnvironment bad("FLEXATTN_CANARY", "yes");
  EXPECT_THROW(canary_from_environment(), Error);
}

}  // namespace
}  // namespace flexattn
