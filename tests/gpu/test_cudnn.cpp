// The cudnn engine on a GPU: availability and refusals with reasons, the guards (exclusion list,
// plan proof), the conformance matrix against cpu_ref (the quick tier, plus every modifier and
// mask in bf16 forward and backward, plus larger shapes), and the golden cases in bf16. With
// FLEXATTN_CUDNN_TIMING=1 it also times the benchmark shape (a measurement, not a test of speed).
// Every test is skipped where cuDNN or a device is missing.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/canary.hpp"
#include "flexattn/conformance.hpp"
#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

#if FLEXATTN_HAVE_CUDNN
#include "../../src/engines/cudnn/cudnn_engine.hpp"
#include "cudnn_device.hpp"
#endif

namespace flexattn {
namespace {

#if FLEXATTN_HAVE_CUDNN

using conformance::Case;
using conformance::Outcome;
using conformance::Shape;
using conformance::Status;
using test::DeviceCopy;

// FLEXATTN_TEST_CUDNN_ALLOW_UNVERIFIED=1 lets the matrix run on engines not yet in the verified
// list (qualifying a new cuDNN release); the default engine refuses them.
std::shared_ptr<const Engine> engine_under_test() {
  static const std::shared_ptr<const Engine> engine = [] {
    CudnnOptions options;
    options.allow_unverified_engines =
        std::getenv("FLEXATTN_TEST_CUDNN_ALLOW_UNVERIFIED") != nullptr;
    return make_cudnn_engine(options);
  }();
  return engine;
}

#define SKIP_WITHOUT_CUDNN_DEVICE()                                         \
  do {                                                                      \
    if (Support available = engine_under_test()->available(); !available) { \
      GTEST_SKIP() << "cudnn engine unavailable: " << available.reason();   \
    }                                                                       \
  } while (false)

ProblemDesc plain_bf16(std::int64_t seq, std::int64_t head_dim, Direction direction) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = seq;
  desc.seq_len_kv = seq;
  desc.head_dim_qk = head_dim;
  desc.dtype = DType::kBF16;
  desc.device = Device::kCuda;
  desc.direction = direction;
  return desc;
}

TEST(CudnnEngine, NamesItselfAndItsDevice) {
  const std::shared_ptr<const Engine> engine = engine_under_test();
  EXPECT_EQ(engine->name(), "cudnn");
  EXPECT_EQ(engine->device(), Device::kCuda);
  const Support available = engine->available();
  if (!available) {
    EXPECT_FALSE(available.reason().empty());
    EXPECT_EQ(engine->memory(), nullptr);
    GTEST_SKIP() << "cudnn engine unavailable: " << available.reason();
  }
  EXPECT_NE(engine->memory(), nullptr);
}

TEST(CudnnEngine, RefusesWhatItCannotComputeWithReasons) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  const std::shared_ptr<const Engine> engine = engine_under_test();
  const auto reason_of = [&](const ProblemDesc& desc) {
    const Support support = engine->supports(Problem(desc));
    EXPECT_FALSE(support.ok());
    return support.reason();
  };
  ProblemDesc fp32 = plain_bf16(64, 64, Direction::kForward);
  fp32.dtype = DType::kF32;
  EXPECT_NE(reason_of(fp32).find("fp16 or bf16"), std::string::npos);

  ProblemDesc odd_head = plain_bf16(64, 36, Direction::kForward);
  EXPECT_NE(reason_of(odd_head).find("multiple of 8"), std::string::npos);

  ProblemDesc ragged = plain_bf16(64, 64, Direction::kForward);
  ragged.layout = Layout::kTHD;
  ragged.cu_seqlens_q = ragged.cu_seqlens_kv = {0, 64, 100};
  EXPECT_NE(reason_of(ragged).find("thd"), std::string::npos);

  ProblemDesc to_int = plain_bf16(64, 64, Direction::kForward);
  to_int.score_mod = ir::parse("score + float(int(score))");
  EXPECT_NE(reason_of(to_int).find("'int'"), std::string::npos);

  // cuDNN's tanh missed the tolerance on the first device run (lowering.cpp).
  ProblemDesc softcap = test::catalogue_desc({"softcap"}, plain_bf16(64, 64, Direction::kForward));
  EXPECT_NE(reason_of(softcap).find("TANH_FWD is not accurate enough"), std::string::npos);

  ProblemDesc gather = plain_bf16(64, 64, Direction::kForward);
  gather.tensors["rel"] = TensorDecl{DType::kF32, {4, 129}};
  gather.score_mod = ir::parse("score + rel[h, clamp(kv - q + 64, 0, 128)]", gather.scope());
  EXPECT_NE(reason_of(gather).find("gather"), std::string::npos);

  ProblemDesc bias_gradient = plain_bf16(128, 64, Direction::kForwardBackward);
  bias_gradient.tensors["bias"] = TensorDecl{DType::kF32, {4, 128, 128}};
  bias_gradient.score_mod = ir::parse("score + bias[h, q, kv]", bias_gradient.scope());
  EXPECT_NE(reason_of(bias_gradient).find("gradient of tensor 'bias'"), std::string::npos);
}

TEST(CudnnEngine, ExcludedEnginesAreNeverChosen) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  CudnnOptions options;
  options.exclude = {"eng*"};
  options.allow_unverified_engines = true;
  const std::shared_ptr<const Engine> engine = make_cudnn_engine(options);
  const Support support = engine->supports(Problem(plain_bf16(128, 64, Direction::kForward)));
  ASSERT_FALSE(support.ok());
  EXPECT_NE(support.reason().find("excluded"), std::string::npos) << support.reason();
}

// Plans a spread of problems; each plan proves the modifier it lowered and names its cuDNN
// engine. The descriptions are printed: they are what docs/engines.md records.
TEST(CudnnEngine, PlansProveTheirModifierAndNameTheirEngine) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  const std::shared_ptr<const Engine> engine = engine_under_test();
  const std::vector<std::pair<std::string, std::vector<std::string>>> variants = {
      {"none", {}},
      {"softcap", {"softcap"}},
      {"alibi", {"alibi"}},
      {"causal", {"causal"}},
      {"softcap_causal", {"softcap", "causal"}},
      {"document", {"document_mask"}}};
  for (Direction direction : {Direction::kForward, Direction::kForwardBackward}) {
    for (const auto& [label, modifiers] : variants) {
      const ProblemDesc desc = test::catalogue_desc(modifiers, plain_bf16(256, 128, direction));
      const Problem problem(desc);
      const Support support = engine->supports(problem);
      const std::string pass = direction == Direction::kForward ? "fwd" : "fwd+bwd";
      if (!support) {
        std::printf("[cudnn plan] %s %s: refused: %s\n", label.c_str(), pass.c_str(),
                    support.reason().c_str());
        continue;
      }
      const std::unique_ptr<Plan> plan = engine->plan(problem);
      EXPECT_EQ(plan->info().lowered_hash, problem.modifier_hash()) << label;
      EXPECT_EQ(plan->info().signature, problem.signature()) << label;
      EXPECT_NE(plan->info().description.find("cuDNN engine eng"), std::string::npos);
      std::printf("[cudnn plan] %s %s: %s\n", label.c_str(), pass.c_str(),
                  plan->info().description.c_str());
      std::fflush(stdout);
    }
  }
}

// Selection runs the plan canary (src/core/canary.hpp) on every new plan: a correct cudnn plan
// must pass it, forward and backward, with and without a modifier.
TEST(CudnnCanary, PassesCorrectPlansForwardAndBackward) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  const std::shared_ptr<const Engine> engine = engine_under_test();
  for (Direction direction : {Direction::kForward, Direction::kForwardBackward}) {
    for (const std::vector<std::string>& modifiers :
         std::vector<std::vector<std::string>>{{}, {"causal"}, {"alibi", "causal"}}) {
      const Problem problem(test::catalogue_desc(modifiers, plain_bf16(1024, 128, direction)));
      const std::string label =
          fmt::format("{} {}", fmt::join(modifiers, "+"),
                      direction == Direction::kForward ? "fwd" : "fwd+bwd");
      if (Support support = engine->supports(problem); !support) {
        std::printf("[cudnn canary] %s: refused: %s\n", label.c_str(), support.reason().c_str());
        continue;
      }
      const detail::CanaryResult result = detail::run_canary(*engine, *engine->plan(problem));
      EXPECT_TRUE(result.passed) << label << ": " << result.reason;
      std::printf("[cudnn canary] %s: %s, %.3g of the tolerance, q x %g, %.3g s\n", label.c_str(),
                  result.passed ? "passed" : "refused", result.largest_error_ratio,
                  result.input_scale, result.seconds);
    }
  }
}

struct Tally {
  int passed = 0, failed = 0, skipped = 0;
  std::map<std::string, int> skip_reasons;
};

// FLEXATTN_CUDNN_QUALIFY_RECORD=FILE (scripts/gpu qualify-cudnn): one line per case that ran,
// "<case>\t<pass|fail>\t<plan description>", the description naming the cuDNN release, the
// compute capability and the engine (tag with knobs) of each graph; the script derives the
// verified list from it.
void record(const Case& test_case, const Outcome& outcome) {
  const char* path = std::getenv("FLEXATTN_CUDNN_QUALIFY_RECORD");
  if (path == nullptr || outcome.status == Status::kSkipped) return;
  std::string description;
  try {
    const conformance::Instance instance = conformance::instantiate(test_case, Device::kCuda, 1);
    description = engine_under_test()->plan(Problem(instance.desc))->info().description;
  } catch (const std::exception& error) {
    description = std::string("no plan: ") + error.what();
  }
  std::ofstream(path, std::ios::app)
      << test_case.name << '\t' << (outcome.status == Status::kPass ? "pass" : "fail") << '\t'
      << description << '\n';
}

void run_and_tally(const Case& test_case, Tally& tally) {
  const Outcome outcome = conformance::run_case(*engine_under_test(), test_case);
  record(test_case, outcome);
  switch (outcome.status) {
    case Status::kPass:
      ++tally.passed;
      break;
    case Status::kFail:
      ++tally.failed;
      ADD_FAILURE() << test_case.name << ": " << outcome.reason;
      break;
    case Status::kSkipped:
      ++tally.skipped;
      ++tally.skip_reasons[outcome.reason];
      break;
  }
  std::printf("[cudnn case] %-70s %s %s\n", test_case.name.c_str(),
              std::string(conformance::to_string(outcome.status)).c_str(),
              outcome.status == Status::kPass ? fmt::format("max error {:.3g} (allowed {:.3g})",
                                                            outcome.max_error(), outcome.allowed())
                                                    .c_str()
                                              : outcome.reason.c_str());
  std::fflush(stdout);
}

void report(const char* what, const Tally& tally) {
  std::printf("[cudnn %s] passed %d, failed %d, skipped %d\n", what, tally.passed, tally.failed,
              tally.skipped);
  for (const auto& [reason, count] : tally.skip_reasons) {
    std::printf("[cudnn %s] skipped %d: %s\n", what, count, reason.c_str());
  }
}

TEST(CudnnConformance, QuickTier) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  Tally tally;
  for (const Case& test_case : conformance::cases(conformance::Tier::kQuick)) {
    run_and_tally(test_case, tally);
  }
  report("quick tier", tally);
  EXPECT_GT(tally.passed, 0);
  EXPECT_EQ(tally.failed, 0);
}

Case make_case(const Shape& shape, DType dtype, const std::string& modifier,
               const std::string& mask, bool backward) {
  Case c;
  c.shape = shape;
  c.dtype = dtype;
  c.modifier = modifier;
  c.mask = mask;
  c.backward = backward;
  c.name = fmt::format("{}_b{}_hq{}_hkv{}_sq{}_skv{}_d{}/{}_{}{}", to_string(dtype), shape.batch,
                       shape.heads_q, shape.heads_kv, shape.seq_len_q, shape.seq_len_kv,
                       shape.head_dim_qk, modifier, mask, backward ? "_bwd" : "");
  return c;
}

// The catalogue's score modifiers (src/check/catalogue.cpp), each with no mask and with a causal
// one, and its masks, each with no score modifier and with softcap, in bf16, forward and
// backward.
TEST(CudnnConformance, EveryModifierAndMaskInBf16) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  const Shape shape{2, 4, 2, 100, 100, 64, 64};
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const char* modifier : {"none", "softcap30", "softcap5", "softcap08", "bias", "alibi",
                               "relbias", "gate", "piecewise", "neginf"}) {
    pairs.emplace_back(modifier, "none");
    pairs.emplace_back(modifier, "causal");
  }
  for (const char* mask : {"causalbr", "window", "document", "prefix", "emptyrows"}) {
    pairs.emplace_back("none", mask);
    pairs.emplace_back("softcap30", mask);
  }
  Tally tally;
  for (const auto& [modifier, mask] : pairs) {
    for (bool backward : {false, true}) {
      run_and_tally(make_case(shape, DType::kBF16, modifier, mask, backward), tally);
    }
  }
  report("bf16 matrix", tally);
  EXPECT_GT(tally.passed, 0);
  EXPECT_EQ(tally.failed, 0);
}

// Sequence lengths that fill cuDNN's tiles, head dim 128, GQA and MQA, fp16 and bf16, and more
// queries than keys (bottom-right causal then leaves the first rows with no key, forward and
// backward).
TEST(CudnnConformance, LargerShapes) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  Tally tally;
  for (const auto& [shape, dtype] :
       std::vector<std::pair<Shape, DType>>{{Shape{1, 8, 2, 512, 512, 128, 128}, DType::kBF16},
                                            {Shape{2, 4, 4, 256, 384, 64, 64}, DType::kF16},
                                            {Shape{1, 4, 1, 128, 640, 128, 128}, DType::kBF16},
                                            {Shape{1, 4, 2, 384, 256, 64, 64}, DType::kBF16}}) {
    for (const auto& [modifier, mask] :
         std::vector<std::pair<const char*, const char*>>{{"none", "none"},
                                                          {"softcap30", "none"},
                                                          {"none", "causal"},
                                                          {"none", "causalbr"},
                                                          {"alibi", "causalbr"},
                                                          {"softcap30", "window"}}) {
      for (bool backward : {false, true}) {
        run_and_tally(make_case(shape, dtype, modifier, mask, backward), tally);
      }
    }
  }
  report("larger shapes", tally);
  EXPECT_GT(tally.passed, 0);
  EXPECT_EQ(tally.failed, 0);
}

// The head dims models use beside 64 and 128: Gemma's 256 and MLA's 192 with a 128-wide V, bf16
// and fp16, plain, causal, ALiBi and a window, forward and backward. cuDNN serves these with other
// engines than at 64/128, so this is what `scripts/gpu qualify-cudnn` qualifies them on; a case
// it serves must pass.
TEST(CudnnConformance, WideHeadDims) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  Tally tally;
  for (const auto& [shape, dtype] :
       std::vector<std::pair<Shape, DType>>{{Shape{1, 4, 2, 256, 320, 256, 256}, DType::kBF16},
                                            {Shape{2, 4, 4, 192, 192, 256, 256}, DType::kF16},
                                            {Shape{1, 4, 1, 256, 320, 192, 128}, DType::kBF16},
                                            {Shape{2, 4, 2, 192, 192, 192, 128}, DType::kF16}}) {
    for (const auto& [modifier, mask] :
         std::vector<std::pair<const char*, const char*>>{{"none", "none"},
                                                          {"none", "causal"},
                                                          {"none", "causalbr"},
                                                          {"alibi", "causalbr"},
                                                          {"bias", "none"},
                                                          {"none", "window"}}) {
      for (bool backward : {false, true}) {
        run_and_tally(make_case(shape, dtype, modifier, mask, backward), tally);
      }
    }
  }
  report("wide head dims", tally);
  EXPECT_EQ(tally.failed, 0);
  // Until a qualification lists engines for these shapes, every case is refused ("no allowed
  // cuDNN engine"): nothing was served, so nothing was shown.
  if (tally.passed == 0) GTEST_SKIP() << "the cudnn engine served none of these shapes";
}

// ---- graph construction without a device ------------------------------------------------------

// Where libcudnn.so.9 is installed (a GPU is not needed), every catalogue modifier and mask, in
// every layout cuDNN takes and both directions, lowers to descriptors cuDNN accepts, or is refused
// for one of the documented reasons (softcap: cuDNN's tanh is not accurate enough).
TEST(CudnnGraphs, CatalogueLowersToDescriptorsCudnnAccepts) {
  const Shape shape{2, 4, 2, 100, 100, 64, 64};
  int built = 0;
  for (const char* modifier : {"none", "softcap30", "softcap5", "softcap08", "bias", "alibi",
                               "relbias", "gate", "piecewise", "neginf"}) {
    for (const char* mask :
         {"none", "causal", "causalbr", "window", "document", "prefix", "emptyrows"}) {
      for (Layout layout : {Layout::kBSHD, Layout::kSBHD, Layout::kBHSD}) {
        for (bool backward : {false, true}) {
          Case test_case = make_case(shape, DType::kBF16, modifier, mask, backward);
          test_case.layout = layout;
          const conformance::Instance instance =
              conformance::instantiate(test_case, Device::kCuda, 1);
          std::string summary;
          const Support support =
              check_cudnn_graphs_without_device(Problem(instance.desc), summary);
          if (!support && support.reason().find("libcudnn.so.9") != std::string::npos) {
            GTEST_SKIP() << support.reason();
          }
          const std::string name = test_case.name + " " + std::string(to_string(layout));
          const std::string m = modifier;
          const bool float_tensor = m == "bias" || m == "alibi" || m == "gate" || m == "relbias";
          if (m.starts_with("softcap")) {
            EXPECT_NE(support.reason().find("TANH_FWD is not accurate enough"), std::string::npos)
                << name << ": " << support.reason();
          } else if (backward && float_tensor) {
            EXPECT_NE(support.reason().find("gradient of tensor"), std::string::npos) << name;
          } else if (backward && (m == "piecewise" || m == "neginf")) {
            // A derivative other than the constant 1: a backward class the engine refuses
            // (docs/engines.md, section cudnn).
            EXPECT_NE(support.reason().find("derivative other than 1"), std::string::npos)
                << name << ": " << support.reason();
          } else if (m == "relbias") {
            EXPECT_NE(support.reason().find("gather"), std::string::npos) << name;
          } else {
            EXPECT_TRUE(support.ok()) << name << ": " << support.reason();
            built += support.ok() ? 1 : 0;
          }
        }
      }
    }
  }
  EXPECT_GT(built, 0);
}

// ---- golden cases in bf16 ----------------------------------------------------------------------

// bf16 inputs are the golden float32 inputs rounded to 8 significant bits, so the output moves by
// up to a few bf16 ulps of its largest value: 2^-5 relative leaves a margin over that without
// admitting a dropped modifier (which moves outputs by O(1)). Gradients sum more rounded terms.
constexpr double kGoldenOutputTolerance = 0x1p-5;
constexpr double kGoldenGradientTolerance = 0x1p-4;

void expect_close(const std::string& what, const HostTensor& result, const HostTensor& golden,
                  double relative) {
  const double allowed = relative * std::max(1.0, test::max_abs_value(golden));
  EXPECT_TRUE(test::within_tolerance(result.to(DType::kF64), golden.to(DType::kF64), allowed))
      << what;
}

TEST(CudnnGolden, Bf16CasesMatchFlexAttention) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  FLEXATTN_REQUIRE_GOLDEN();
  const std::shared_ptr<const Engine> engine = engine_under_test();
  const DeviceMemory& memory = *engine->memory();
  int compared = 0;
  for (const std::string& name : test::golden_case_names()) {
    const test::GoldenCase golden = test::load_golden_case(name);
    ProblemDesc desc = golden.desc(Layout::kBHSD, DType::kBF16, Direction::kForwardBackward);
    desc.device = Device::kCuda;
    std::map<std::string, HostTensor> tensors;
    for (const std::string& tensor : golden.tensors) {
      HostTensor stored = golden.array(tensor);
      // Index tensors are stored as int64; cuDNN reads int32.
      if (stored.dtype() == DType::kI64) stored = stored.to(DType::kI32);
      desc.tensors[tensor].dtype = stored.dtype();
      tensors.emplace(tensor, std::move(stored));
    }
    Problem problem(desc);
    if (Support support = engine->supports(problem); !support) {
      desc.direction = Direction::kForward;
      problem = Problem(desc);
      const Support forward = engine->supports(problem);
      std::printf("[cudnn golden] %s: backward refused (%s)%s\n", name.c_str(),
                  support.reason().c_str(),
                  forward ? "" : fmt::format("; forward refused ({})", forward.reason()).c_str());
      if (!forward) continue;
    }
    const std::unique_ptr<Plan> plan = engine->plan(problem);
    DeviceCopy q(memory, golden.array("q").to(DType::kBF16));
    DeviceCopy k(memory, golden.array("k").to(DType::kBF16));
    DeviceCopy v(memory, golden.array("v").to(DType::kBF16));
    DeviceCopy dout(memory, golden.array("dout").to(DType::kBF16));
    DeviceCopy out(memory, HostTensor(DType::kBF16, problem.expected("o").shape));
    DeviceCopy lse(memory, HostTensor(DType::kF32, problem.expected("lse").shape));
    std::map<std::string, std::unique_ptr<DeviceCopy>> inputs;
    ForwardArgs args{q.view(), k.view(), v.view(), out.view(), lse.view(), {}, nullptr};
    for (auto& [tensor, host] : tensors) {
      inputs.emplace(tensor, std::make_unique<DeviceCopy>(memory, host));
      args.tensors[tensor] = inputs.at(tensor)->view();
    }
    plan->forward(args);
    expect_close(name + " out", out.fetch(), golden.array("out"), kGoldenOutputTolerance);
    expect_close(name + " lse", lse.fetch(), golden.array("lse"), kGoldenOutputTolerance);
    if (problem.wants_backward()) {
      DeviceCopy dq(memory, HostTensor(DType::kBF16, problem.expected("q").shape));
      DeviceCopy dk(memory, HostTensor(DType::kBF16, problem.expected("k").shape));
      DeviceCopy dv(memory, HostTensor(DType::kBF16, problem.expected("v").shape));
      BackwardArgs bargs;
      bargs.q = q.view(), bargs.k = k.view(), bargs.v = v.view();
      bargs.out = out.view(), bargs.lse = lse.view(), bargs.dout = dout.view();
      bargs.dq = dq.view(), bargs.dk = dk.view(), bargs.dv = dv.view();
      bargs.tensors = args.tensors;
      plan->backward(bargs);
      expect_close(name + " dq", dq.fetch(), golden.array("dq"), kGoldenGradientTolerance);
      expect_close(name + " dk", dk.fetch(), golden.array("dk"), kGoldenGradientTolerance);
      expect_close(name + " dv", dv.fetch(), golden.array("dv"), kGoldenGradientTolerance);
    }
    std::printf("[cudnn golden] %s: compared (%s)\n", name.c_str(),
                problem.wants_backward() ? "forward and backward" : "forward");
    ++compared;
  }
  EXPECT_GT(compared, 0);
}

// ---- timing (FLEXATTN_CUDNN_TIMING=1) ----------------------------------------------------------

TEST(CudnnTiming, BenchmarkShape) {
  SKIP_WITHOUT_CUDNN_DEVICE();
  if (std::getenv("FLEXATTN_CUDNN_TIMING") == nullptr) {
    GTEST_SKIP() << "set FLEXATTN_CUDNN_TIMING=1 to time (a measurement, not a test)";
  }
  test::time_benchmark_shape(*engine_under_test());
}

#else

TEST(CudnnEngine, NotBuilt) { GTEST_SKIP() << "built without cuDNN headers"; }

#endif

}  // namespace
}  // namespace flexattn
