// Engine selection and its guards: the policy (globs, allow/deny, FLEXATTN_ENGINES), forcing
// without fallback, the "nothing can run" error, the plan cache, the plan proof against the
// planted faulty engines (the regression test for docs/design.md section 1), argument checking, and
// the selection log.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "flexattn/testing.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

using namespace flexattn::ir;
using test::ScopedEnvironment;

// Two float64 computations of the same function that differ only in summation order.
constexpr double kFloat64Tolerance = 1e-12;
// The TE regression softcap: small enough that tanh is far from linear on N(0, 1) scores.
constexpr double kSmallCap = 0.8;
constexpr double kValueStddev = 0.1;
constexpr std::uint64_t kSeed = 7;

ProblemDesc small_desc(DType dtype = DType::kF64) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = 16;
  desc.seq_len_kv = 16;
  desc.head_dim_qk = 64;
  desc.dtype = dtype;
  return desc;
}

Problem softcap_problem(double cap, Direction direction = Direction::kForward) {
  ProblemDesc desc = small_desc();
  desc.score_mod = cap * tanh(score() / cap);
  desc.direction = direction;
  return Problem(desc);
}

// A context with the built-in engines plus the planted faulty ones, and an explicit policy (the
// environment's FLEXATTN_ENGINES must not leak into these tests).
ContextOptions faulty_options(Policy policy = {}) {
  ContextOptions options;
  options.policy = std::move(policy);
  options.log_level = LogLevel::kOff;
  options.extra_engines = testing::planted_faulty_engines();
  return options;
}

Policy forced(std::string engine) {
  Policy policy;
  policy.force = std::move(engine);
  return policy;
}

HostTensor like(const TensorView& view) { return HostTensor(view.dtype, view.shape); }

// Runs the forward pass of `plan` on `inputs`, returning the output.
HostTensor run_forward(const Plan& plan, const test::Inputs& inputs) {
  test::Outputs outputs;
  outputs.out = like(plan.problem().expected("o"));
  outputs.lse = like(plan.problem().expected("lse"));
  plan.forward(test::forward_args(inputs, outputs));
  return std::move(outputs.out);
}

template <typename Body>
Error expect_error(const Body& body) {
  try {
    body();
  } catch (const Error& error) {
    return error;
  }
  ADD_FAILURE() << "expected flexattn::Error";
  return Error(ErrorCode::kInternal, "no error");
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

// ---- policy -------------------------------------------------------------------------------------

TEST(Glob, MatchesWholeNames) {
  EXPECT_TRUE(glob_match("cuda", "cuda"));
  EXPECT_FALSE(glob_match("cuda", "cudnn"));
  EXPECT_FALSE(glob_match("cud", "cuda"));
  EXPECT_TRUE(glob_match("cud*", "cudnn"));
  EXPECT_TRUE(glob_match("cud*", "cud"));
  EXPECT_TRUE(glob_match("*_ref", "cpu_ref"));
  EXPECT_TRUE(glob_match("c?u*", "cpu_ref"));
  EXPECT_FALSE(glob_match("c?da", "cda"));
  EXPECT_TRUE(glob_match("*", "anything"));
  EXPECT_TRUE(glob_match("*a*b*", "xxaxxbxx"));
  EXPECT_FALSE(glob_match("*a*b", "xxaxxbxx"));
}

TEST(Policy, ParsesPatternsInOrder) {
  const Policy policy = Policy::parse(" cuda , -cudnn*,,+cpu?ref ");
  EXPECT_EQ(policy.patterns, (std::vector<std::string>{"cuda", "-cudnn*", "+cpu?ref"}));
  EXPECT_TRUE(policy.force.empty());
  EXPECT_EQ(policy.to_string(), "cuda,-cudnn*,+cpu?ref");
  EXPECT_TRUE(Policy::parse("").patterns.empty());
}

TEST(Policy, RejectsMalformedPatterns) {
  for (const char* text : {"-", "cuda,+", "cu da", "cuda;cudnn", "cuda/x"}) {
    const Error error = expect_error([&] { Policy::parse(text); });
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << text;
    EXPECT_TRUE(contains(error.what(), "engine policy")) << error.what();
  }
}

TEST(Policy, EmptyAllowsEverything) {
  const Policy policy;
  EXPECT_TRUE(policy.allows("cpu_ref"));
  EXPECT_TRUE(policy.allows("cuda"));
  EXPECT_TRUE(policy.refusal("cuda").empty());
}

TEST(Policy, AllowListRestricts) {
  const Policy policy = Policy::parse("cuda,cpu*");
  EXPECT_TRUE(policy.allows("cuda"));
  EXPECT_TRUE(policy.allows("cpu_ref"));
  EXPECT_FALSE(policy.allows("cudnn"));
  EXPECT_TRUE(contains(policy.refusal("cudnn"), "matches no allow pattern"));
}

TEST(Policy, DenyWinsOverAllowInAnyOrder) {
  for (const char* text : {"cpu*,-cpu_ref", "-cpu_ref,cpu*", "+cpu_ref,-cpu_?ef"}) {
    const Policy policy = Policy::parse(text);
    EXPECT_FALSE(policy.allows("cpu_ref")) << text;
    EXPECT_TRUE(contains(policy.refusal("cpu_ref"), "denied by policy")) << text;
  }
  const Policy policy = Policy::parse("cpu*,-cpu_ref");
  EXPECT_TRUE(policy.allows("cpu"));
  EXPECT_TRUE(Policy::parse("-cudnn*").allows("cuda"));
}

TEST(Policy, ForceAllowsOnlyTheForcedEngine) {
  const Policy policy = forced("cpu_ref");
  EXPECT_TRUE(policy.allows("cpu_ref"));
  EXPECT_FALSE(policy.allows("cuda"));
  EXPECT_TRUE(contains(policy.refusal("cuda"), "not the forced engine"));
  Policy allow_list = Policy::parse("cuda");
  allow_list.force = "cpu_ref";
  EXPECT_TRUE(allow_list.allows("cpu_ref"));  // forcing beats an allow list that omits it
  EXPECT_FALSE(allow_list.allows("cuda"));
}

TEST(Policy, ReadsTheEnvironment) {
  {
    const ScopedEnvironment environment("FLEXATTN_ENGINES", "cuda,-cudnn*");
    const Policy policy = Policy::from_environment();
    EXPECT_EQ(policy.patterns, (std::vector<std::string>{"cuda", "-cudnn*"}));
    EXPECT_TRUE(policy.force.empty());  // a name there is an allow pattern, not a force
    EXPECT_EQ(policy.source, "FLEXATTN_ENGINES");
    EXPECT_EQ(policy.refusal("cudnn_9"),
              "denied by policy FLEXATTN_ENGINES=cuda,-cudnn* (pattern -cudnn*)");
  }
  const ScopedEnvironment unset("FLEXATTN_ENGINES", nullptr);
  EXPECT_TRUE(Policy::from_environment().patterns.empty());
}

TEST(LogLevel, ReadsTheEnvironment) {
  {
    const ScopedEnvironment environment("FLEXATTN_LOG", "debug");
    EXPECT_EQ(log_level_from_environment(), LogLevel::kDebug);
  }
  {
    const ScopedEnvironment environment("FLEXATTN_LOG", "info");
    EXPECT_EQ(log_level_from_environment(), LogLevel::kInfo);
  }
  {
    const ScopedEnvironment environment("FLEXATTN_LOG", "loud");
    EXPECT_EQ(expect_error([] { log_level_from_environment(); }).code(),
              ErrorCode::kInvalidArgument);
  }
  const ScopedEnvironment unset("FLEXATTN_LOG", nullptr);
  EXPECT_EQ(log_level_from_environment(), LogLevel::kOff);
}

// ---- context ------------------------------------------------------------------------------------

TEST(Context, BuiltinEnginesFirstThenExtras) {
  const Context context(faulty_options());
  const auto& engines = context.engines();
  ASSERT_GE(engines.size(), 3u);
  EXPECT_EQ(engines[engines.size() - 2]->name(), "faulty_drop_mod");
  EXPECT_EQ(engines.back()->name(), "faulty_lying_hash");
  ASSERT_NE(context.find_engine("cpu_ref"), nullptr);
  EXPECT_EQ(context.find_engine("nope"), nullptr);
}

TEST(Context, UnknownForcedEngineListsTheEngines) {
  const Error error = expect_error([] { Context context(faulty_options(forced("cdua"))); });
  EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(error.what(), "unknown engine 'cdua'")) << error.what();
  EXPECT_TRUE(contains(error.what(), "cpu_ref")) << error.what();
  EXPECT_TRUE(contains(error.what(), "faulty_drop_mod")) << error.what();
}

TEST(Context, AutoPrefersTheFirstSupportingEngine) {
  Context context(faulty_options());
  const Problem problem = softcap_problem(kSmallCap);
  std::string first;
  for (const auto& engine : context.engines()) {
    if (engine->supports(problem)) {
      first = std::string(engine->name());
      break;
    }
  }
  EXPECT_EQ(context.select(problem)->info().engine, first);
  EXPECT_EQ(first.rfind("faulty_", 0), std::string::npos) << "built-in engines come first";
}

TEST(Context, ForceNeverFallsBack) {
  Context context(faulty_options(forced("faulty_lying_hash")));
  const Error error = expect_error(
      [&] { context.select(softcap_problem(kSmallCap, Direction::kForwardBackward)); });
  EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(error.what(), "faulty_lying_hash")) << error.what();
  EXPECT_TRUE(contains(error.what(), "canary")) << error.what();
  EXPECT_EQ(context.cached_plans(), 0u);
}

TEST(Context, NothingCanRunListsEveryEngineWithItsReason) {
  // Deny every built-in engine by name and the planted ones by one pattern.
  std::string deny_builtins;
  for (const auto& engine : builtin_engines()) {
    deny_builtins += (deny_builtins.empty() ? "-" : ",-") + std::string(engine->name());
  }
  deny_builtins += ",-faulty_*";
  Context context(faulty_options(Policy::parse(deny_builtins)));
  const Error error = expect_error(
      [&] { context.select(softcap_problem(kSmallCap, Direction::kForwardBackward)); });
  EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
  const std::vector<std::string> lines = lines_of(error.what());
  ASSERT_EQ(lines.size(), 1 + context.engines().size()) << error.what();
  EXPECT_EQ(lines[0].rfind("no engine can run this problem (fwd+bwd bshd fp64 cpu", 0), 0u)
      << lines[0];
  for (std::size_t i = 0; i < context.engines().size(); ++i) {
    const std::string name(context.engines()[i]->name());
    if (name.rfind("faulty_", 0) == 0) {
      EXPECT_EQ(lines[i + 1],
                fmt::format("  {}: denied by policy {} (pattern -faulty_*)", name, deny_builtins));
    } else {
      EXPECT_EQ(lines[i + 1],
                fmt::format("  {}: denied by policy {} (pattern -{})", name, deny_builtins, name));
    }
  }
}

// An engine that says yes to supports() but declines while planning, as the cudnn engine does
// when cuDNN's heuristics offer no engine for a lowered graph.
class DecliningEngine final : public Engine {
 public:
  std::string_view name() const override { return "declining"; }
  Support available() const override { return Support::yes(); }

 protected:
  Lowered lower(const Problem&, Stage stage) const override {
    Lowered lowered;
    lowered.support =
        stage == Stage::kCheck ? Support::yes() : Support::no("no kernel for this graph");
    return lowered;
  }
};

ContextOptions declining_options(Policy policy) {
  ContextOptions options;
  options.policy = std::move(policy);
  options.log_level = LogLevel::kOff;
  options.extra_engines = {std::make_shared<DecliningEngine>(), testing::make_lying_engine()};
  // The lying engine stands for any engine that plans; the canary would refuse it (test_canary).
  options.canary = false;
  return options;
}

TEST(Context, AnEngineDecliningWhilePlanningFallsThroughToTheNext) {
  Context context(declining_options(Policy::parse("declining,faulty_lying_hash")));
  EXPECT_EQ(context.select(softcap_problem(kSmallCap))->info().engine, "faulty_lying_hash");
}

TEST(Context, AnEngineDecliningWhilePlanningIsNamedWhenNothingRuns) {
  Context context(declining_options(Policy::parse("declining")));
  const Error error = expect_error([&] { context.select(softcap_problem(kSmallCap)); });
  EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(error.what(),
                       "declining: declined while planning: declining: no kernel for this graph"))
      << error.what();
}

TEST(Context, AForcedEngineDecliningWhilePlanningDoesNotFallBack) {
  Context context(declining_options(forced("declining")));
  const Error error = expect_error([&] { context.select(softcap_problem(kSmallCap)); });
  EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(error.what(), "no kernel for this graph")) << error.what();
}

TEST(Context, HonoursFlexattnEnginesFromTheEnvironment) {
  const ScopedEnvironment environment("FLEXATTN_ENGINES", "-cpu_ref*");
  Context context;  // default options read the environment
  const Error error = expect_error([&] { context.select(softcap_problem(kSmallCap)); });
  EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(error.what(), "cpu_ref: denied by policy FLEXATTN_ENGINES=-cpu_ref*"))
      << error.what();
}

TEST(Context, DenyWinsOverForce) {
  ContextOptions options = faulty_options(Policy::parse("-cpu_ref"));
  options.policy.force = "cpu_ref";
  Context context(options);
  const Error error = expect_error([&] { context.select(softcap_problem(kSmallCap)); });
  EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(contains(error.what(), "cpu_ref: denied by policy")) << error.what();
  EXPECT_TRUE(contains(error.what(), "faulty_drop_mod: not the forced engine")) << error.what();
}

TEST(Context, ExplainAsksEveryEngineAndShowsThePolicy) {
  const Context context(faulty_options(Policy::parse("-faulty_lying*")));
  const std::vector<Verdict> verdicts =
      context.explain(softcap_problem(kSmallCap, Direction::kForwardBackward));
  ASSERT_EQ(verdicts.size(), context.engines().size());
  for (std::size_t i = 0; i < verdicts.size(); ++i) {
    const Verdict& verdict = verdicts[i];
    EXPECT_EQ(verdict.engine, context.engines()[i]->name());
    if (verdict.engine == "cpu_ref") {
      EXPECT_TRUE(verdict.allowed);
      EXPECT_TRUE(verdict.support.ok());
    } else if (verdict.engine.rfind("faulty_", 0) == 0) {
      EXPECT_EQ(verdict.allowed, verdict.engine != "faulty_lying_hash") << verdict.engine;
      EXPECT_TRUE(verdict.support.ok()) << verdict.engine;  // forward and backward
    } else {
      EXPECT_TRUE(verdict.allowed) << verdict.engine;  // other built-in engines: any verdict
    }
  }
}

// ---- plan cache ---------------------------------------------------------------------------------

TEST(PlanCache, SameProblemSamePlanOtherModifierOtherPlan) {
  Context context(faulty_options());
  const auto first = context.select(softcap_problem(kSmallCap));
  const auto again = context.select(softcap_problem(kSmallCap));
  EXPECT_EQ(first.get(), again.get());
  EXPECT_EQ(context.cached_plans(), 1u);
  const auto other = context.select(softcap_problem(2 * kSmallCap));
  EXPECT_NE(first.get(), other.get());
  EXPECT_EQ(context.cached_plans(), 2u);
  const auto identity = context.select(Problem(small_desc()));
  EXPECT_NE(first.get(), identity.get());
  EXPECT_EQ(context.cached_plans(), 3u);
}

TEST(PlanCache, KeyedByEngine) {
  Context reference(faulty_options(forced("cpu_ref")));
  Context lying(faulty_options(forced("faulty_lying_hash")));
  const Problem problem(small_desc());
  EXPECT_EQ(reference.select(problem)->info().engine, "cpu_ref");
  EXPECT_EQ(lying.select(problem)->info().engine, "faulty_lying_hash");
  EXPECT_EQ(lying.select(problem).get(), lying.select(problem).get());
}

// The built-in cpu_ref engine under another name, with plan settings the test changes.
class SettingsEngine final : public Engine {
 public:
  std::string settings;

  std::string_view name() const override { return "settings"; }
  Support available() const override { return Support::yes(); }
  std::string plan_settings() const override { return settings; }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered lowered;
    lowered.support = reference_->supports(problem);
    if (lowered.support && stage == Stage::kBuild) lowered.plan = reference_->plan(problem);
    return lowered;
  }

 private:
  std::shared_ptr<const Engine> reference_ = [] {
    for (const auto& engine : builtin_engines()) {
      if (engine->name() == "cpu_ref") return engine;
    }
    return std::shared_ptr<const Engine>();
  }();
};

// A plan built under one of an engine's plan settings is never served under another.
TEST(PlanCache, KeyedByTheEnginesPlanSettings) {
  const auto engine = std::make_shared<SettingsEngine>();
  ContextOptions options;
  options.policy = forced("settings");
  options.log_level = LogLevel::kOff;
  options.canary = false;  // a plan of cpu_ref itself
  options.extra_engines = {engine};
  Context context(options);
  const Problem problem(small_desc());
  const auto plain = context.select(problem);
  EXPECT_EQ(context.select(problem).get(), plain.get());
  engine->settings = "wgmma=0";
  const auto other = context.select(problem);
  EXPECT_NE(other.get(), plain.get());
  EXPECT_EQ(context.cached_plans(), 2u);
  EXPECT_EQ(context.select(problem).get(), other.get());
  engine->settings.clear();
  EXPECT_EQ(context.select(problem).get(), plain.get());
  EXPECT_EQ(context.cached_plans(), 2u);
}

// ---- the plan proof (docs/design.md section 1)
// -------------------------------------------------------

TEST(PlanProof, RefusesTheEngineThatDropsTheModifier) {
  Context context(faulty_options(forced("faulty_drop_mod")));
  const Problem problem = softcap_problem(kSmallCap);
  const Error error = expect_error([&] { context.select(problem); });
  EXPECT_EQ(error.code(), ErrorCode::kInternal);
  const std::string message = error.what();
  EXPECT_TRUE(contains(message, "faulty_drop_mod")) << message;
  EXPECT_TRUE(contains(message, hash_to_hex(problem.modifier_hash()))) << message;
  const std::uint64_t dropped =
      modifier_hash(Graph::identity_score(), problem.mask_mod(), problem.scale());
  EXPECT_TRUE(contains(message, hash_to_hex(dropped))) << message;
  EXPECT_TRUE(
      contains(message, "refusing to run a plan that does not implement the requested modifier"))
      << message;
  EXPECT_EQ(context.cached_plans(), 0u);  // a refused plan is never cached
  EXPECT_EQ(expect_error([&] { context.select(problem); }).code(), ErrorCode::kInternal);
}

// The proof covers the backward's derivatives: a plan whose forward modifier matches but whose
// derivatives do not (the derivative replaced by 1) is refused, naming the engine and the part.
TEST(PlanProof, RefusesDerivativesOtherThanTheRequestedOnes) {
  const Problem problem = softcap_problem(kSmallCap, Direction::kForwardBackward);
  const Graph& score_mod = problem.score_mod();
  PlanInfo info;
  info.engine = "proof_fixture";
  info.lowered_hash = problem.modifier_hash();
  info.lowered_backward_hash =
      backward_hash(derivative_wrt_score(score_mod), derivatives_wrt_tensors(score_mod));
  EXPECT_EQ(plan_proof_failure(info, problem), "");
  info.lowered_backward_hash = backward_hash(Graph(literal_f32(1.0)), {});
  const std::string derivative = plan_proof_failure(info, problem);
  EXPECT_TRUE(contains(derivative, "engine proof_fixture: the derivative differs")) << derivative;
  EXPECT_TRUE(contains(derivative, hash_to_hex(problem.backward_hash()))) << derivative;
  info.lowered_hash = modifier_hash(Graph::identity_score(), problem.mask_mod(), problem.scale());
  const std::string forward = plan_proof_failure(info, problem);
  EXPECT_TRUE(contains(forward, "engine proof_fixture: the forward modifier differs")) << forward;

  // A forward-only problem has no derivatives to prove.
  const Problem forward_only = softcap_problem(kSmallCap);
  EXPECT_EQ(forward_only.backward_hash(), 0u);
  info.lowered_hash = forward_only.modifier_hash();
  EXPECT_EQ(plan_proof_failure(info, forward_only), "");
}

TEST(PlanProof, AutoDoesNotFallThroughPastARefusedPlan) {
  Context context(faulty_options(Policy::parse("-cpu_ref")));
  const Error error = expect_error([&] { context.select(softcap_problem(kSmallCap)); });
  EXPECT_EQ(error.code(), ErrorCode::kInternal);
  EXPECT_TRUE(contains(error.what(), "faulty_drop_mod")) << error.what();
}

TEST(PlanProof, AcceptsTheDroppingEngineForTheIdentityModifier) {
  Context context(faulty_options(forced("faulty_drop_mod")));
  ProblemDesc desc = small_desc();
  desc.mask_mod = query() >= key();
  const Problem problem(desc);
  const auto plan = context.select(problem);
  EXPECT_EQ(plan->info().lowered_hash, problem.modifier_hash());
  const test::Inputs inputs = test::random_inputs(problem, kSeed);
  const HostTensor out = run_forward(*plan, inputs);
  const test::Outputs reference =
      test::run_engine(*test::builtin_engine("cpu_ref"), problem, inputs);
  EXPECT_LE(test::max_abs_error(out, reference.out), kFloat64Tolerance);
}

// The lying engine passes the proof (it claims the requested hash); only comparing its output
// with cpu_ref catches it, by a wide margin on the TE softcap case.
TEST(PlanProof, LyingEngineIsCaughtByComparisonWithTheReference) {
  // Without the canary (which refuses it at selection, test_canary), only a comparison sees it.
  ContextOptions options = faulty_options(forced("faulty_lying_hash"));
  options.canary = false;
  Context context(options);
  const Problem problem = softcap_problem(kSmallCap);
  const auto plan = context.select(problem);
  const test::Inputs inputs = test::random_inputs(problem, kSeed, kValueStddev);
  const HostTensor out = run_forward(*plan, inputs);
  const test::Outputs reference =
      test::run_engine(*test::builtin_engine("cpu_ref"), problem, inputs);
  // Dropping a 0.8 softcap changes the attention weights of N(0, 1) scores a lot: the error is
  // tens of percent of the output's magnitude, far beyond any engine's tolerance.
  constexpr double kLargeRelativeError = 0.1;
  EXPECT_GT(test::max_abs_error(out, reference.out),
            kLargeRelativeError * test::max_abs_value(reference.out));
}

// ---- argument checks ----------------------------------------------------------------------------

TEST(PlanArguments, RejectsWrongShapeStrideAndDtype) {
  Context context(faulty_options());
  const Problem problem(small_desc(DType::kF32));
  const auto plan = context.select(problem);
  const test::Inputs inputs = test::random_inputs(problem, kSeed);
  test::Outputs outputs;
  outputs.out = like(problem.expected("o"));
  outputs.lse = like(problem.expected("lse"));
  const ForwardArgs good = test::forward_args(inputs, outputs);
  plan->forward(good);

  ForwardArgs wrong_dtype = good;
  const HostTensor q64 = inputs.q.to(DType::kF64);
  wrong_dtype.q = q64.view();
  Error error = expect_error([&] { plan->forward(wrong_dtype); });
  EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(error.what(), "argument q")) << error.what();
  EXPECT_TRUE(contains(error.what(), "fp64")) << error.what();

  ForwardArgs wrong_shape = good;
  std::vector<std::int64_t> shape = problem.expected("k").shape;
  shape[1] += 1;
  const HostTensor longer_k(DType::kF32, shape);
  wrong_shape.k = longer_k.view();
  error = expect_error([&] { plan->forward(wrong_shape); });
  EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(error.what(), "argument k")) << error.what();

  ForwardArgs wrong_strides = good;
  TensorView strided = good.v;
  std::swap(strided.strides[0], strided.strides[1]);
  wrong_strides.v = strided;
  error = expect_error([&] { plan->forward(wrong_strides); });
  EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(error.what(), "argument v")) << error.what();
  EXPECT_TRUE(contains(error.what(), "strides")) << error.what();
}

// ---- log
// ------------------------------------------------------------------------------------------

TEST(SelectionLog, InfoLogsOneLinePerSelectionDebugEveryVerdict) {
  std::ostringstream info_log;
  ContextOptions options = faulty_options(forced("cpu_ref"));
  options.log_level = LogLevel::kInfo;
  options.log_stream = &info_log;
  Context info(options);
  info.select(softcap_problem(kSmallCap));
  info.select(softcap_problem(kSmallCap));
  const std::vector<std::string> info_lines = lines_of(info_log.str());
  ASSERT_EQ(info_lines.size(), 2u) << info_log.str();
  EXPECT_TRUE(contains(info_lines[0], "selected cpu_ref (plan: float64 reference"))
      << info_lines[0];
  EXPECT_TRUE(contains(info_lines[1], "cached plan")) << info_lines[1];

  std::ostringstream debug_log;
  options.log_level = LogLevel::kDebug;
  options.log_stream = &debug_log;
  Context debug(options);
  debug.select(softcap_problem(kSmallCap, Direction::kForwardBackward));
  const std::string text = debug_log.str();
  for (const auto& engine : debug.engines()) {
    EXPECT_TRUE(contains(text, "  " + std::string(engine->name()) + ": ")) << text;
  }
  EXPECT_TRUE(contains(text, "faulty_drop_mod: supported; not the forced engine")) << text;
  EXPECT_TRUE(contains(text, "selected cpu_ref")) << text;
}

}  // namespace
}  // namespace flexattn
