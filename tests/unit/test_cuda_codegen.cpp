// The cuda engine's code generation, on the CPU: the generated CUDA for a spread of modifiers,
// dtypes, head dims and layouts contains the lowering of each IR feature (invariants hoisted,
// constant factors merged, small integers and tanh variants, the static softmax reference), and
// the backward's Modifier members and entry points. test_cuda_kernel_choice.cpp has the kernel
// and tile choices, test_cuda_compile.cpp the NVRTC compilation. Skipped in builds without CUDA.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/cuda_codegen_cases.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

using namespace test;

TEST(CudaCodegen, EngineIsListedAndExplainsAvailability) {
  SKIP_WITHOUT_CUDA_ENGINE();
  const auto engine = cuda_engine();
  EXPECT_EQ(engine->device(), Device::kCuda);
  const Support available = engine->available();
  if (!available) {
    EXPECT_NE(available.reason().find("CUDA"), std::string::npos) << available.reason();
    EXPECT_EQ(engine->memory(), nullptr);
  } else {
    EXPECT_NE(engine->memory(), nullptr);
  }
}

// FLEXATTN_CUDA_WGMMA=0 keeps the mma.sync kernels on sm_90: a plan setting, so a context never
// serves a plan made under the other value. Other values leave the wgmma kernels allowed.
TEST(CudaCodegen, TheWgmmaSwitchIsAPlanSetting) {
  SKIP_WITHOUT_CUDA_ENGINE();
  const auto engine = cuda_engine();
  {
    const test::ScopedEnvironment unset("FLEXATTN_CUDA_WGMMA", nullptr);
    EXPECT_EQ(engine->plan_settings(), "");
  }
  {
    const test::ScopedEnvironment mma_sync("FLEXATTN_CUDA_WGMMA", "0");
    EXPECT_EQ(engine->plan_settings(), "wgmma=0");
  }
  const test::ScopedEnvironment allowed("FLEXATTN_CUDA_WGMMA", "1");
  EXPECT_EQ(engine->plan_settings(), "");
}

TEST(CudaCodegen, GeneratedSourceLowersEveryFeature) {
  SKIP_WITHOUT_CUDA_ENGINE();
  const auto engine = cuda_engine();
  for (const GeneratedCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Problem problem = make_problem(c);
    const std::string source = engine->generated_source(problem);
    ASSERT_NE(source.find("extern \"C\" __global__"), std::string::npos) << source;
    EXPECT_NE(source.find("struct Modifier"), std::string::npos);
    for (const std::string& fragment : c.expected_fragments) {
      EXPECT_NE(source.find(fragment), std::string::npos)
          << "missing '" << fragment << "' in the generated code:\n"
          << source.substr(source.find("// ---- generated"));
    }
  }
}

TEST(CudaCodegen, InvariantLoadsAreHoistedOutOfTheElementLoop) {
  SKIP_WITHOUT_CUDA_ENGINE();
  GeneratedCase alibi{"alibi", DType::kBF16, 64, 64, "score + slopes[h] * (kv - q)", "",
                      {{"slopes", TensorDecl{DType::kF32, {4}}}}, {}, Layout::kBSHD, {}};
  const std::string source = cuda_engine()->generated_source(make_problem(alibi));
  const std::string generated = source.substr(source.find("// ---- generated"));
  const std::size_t prepare = generated.find("prepare(");
  const std::size_t score_mod = generated.find("score_mod(");
  const std::size_t load = generated.find("load_tensor_f32(");
  ASSERT_NE(load, std::string::npos);
  EXPECT_GT(load, prepare);
  EXPECT_LT(load, score_mod) << "slopes[h] depends only on the head: load it once per block\n"
                             << generated;
}

TEST(CudaCodegen, Float64IsRefusedWithAReason) {
  SKIP_WITHOUT_CUDA_ENGINE();
  GeneratedCase plain{"plain", DType::kF64, 64, 64, "", "", {}, {}, Layout::kBSHD, {}};
  const std::string source = cuda_engine()->generated_source(make_problem(plain));
  EXPECT_NE(source.find("not supported"), std::string::npos) << source;
}

// ---- backward ------------------------------------------------------------------------------

std::string tensor_grads_body(const std::string& source) {
  return between(source, "void tensor_grads(", "void flush_tensor_grads(");
}
std::string flush_body(const std::string& source) {
  return between(source, "void flush_tensor_grads(", "};");
}

TEST(CudaCodegenBackward, SoftcapHasAScoreGradient) {
  SKIP_WITHOUT_CUDA_ENGINE();
  // The mma.sync kernels on every machine (an sm_90 device would get the wgmma ones).
  const test::ScopedEnvironment mma_sync("FLEXATTN_CUDA_WGMMA", "0");
  GeneratedCase softcap{"softcap", DType::kBF16, 64, 64, "30 * tanh(score / 30)", "q >= kv",
                        {}, {}, Layout::kBSHD, {}};
  const std::string source =
      generated_part(cuda_engine()->generated_source(make_backward_problem(softcap)));
  EXPECT_NE(source.find("kIdentityDerivative = false"), std::string::npos) << source;
  EXPECT_NE(source.find("kHasTensorGrads = false"), std::string::npos) << source;
  EXPECT_NE(source.find("kLocalGradSlots = 1;"), std::string::npos) << source;
  const std::string score_grad = between(source, "float score_grad(", "float score_grad_from_dot(");
  EXPECT_NE(score_grad.find("tanhf("), std::string::npos) << score_grad;  // the fp32 kernels'
  EXPECT_EQ(score_grad.find("ir_tanh("), std::string::npos) << score_grad;
  // From the dot product: the same merged tanh argument as score_mod_log2 (one tanh per element
  // after inlining), and (1 - t^2) / 30 * 30 returned as 1 - t^2.
  const std::string from_dot = between(source, "float score_grad_from_dot(", "void tensor_grads(");
  const std::string logit = between(source, "float score_mod_log2(", "bool mask_mod(");
  EXPECT_NE(from_dot.find("ir_mul(dot, inv.s2_dot)"), std::string::npos) << from_dot;
  EXPECT_NE(logit.find("ir_mul(dot, inv.s2_dot)"), std::string::npos) << logit;
  EXPECT_EQ(from_dot.find("(0x1.ep+4f)"), std::string::npos) << from_dot;
  EXPECT_EQ(from_dot.find("const float score"), std::string::npos) << from_dot;
  EXPECT_NE(from_dot.find("ir_tanh("), std::string::npos) << from_dot;
  for (const char* entry : {"flexattn_forward(", "flexattn_backward_delta(",
                            "flexattn_backward_dkdv(", "flexattn_backward_dq(",
                            "flexattn_backward_finalize("}) {
    EXPECT_NE(source.find(entry), std::string::npos) << entry;
  }
  EXPECT_NE(source.find("backward_dkdv_mma<FlexattnBackwardConfig"), std::string::npos);
  EXPECT_NE(source.find("backward_dq_mma<FlexattnBackwardConfig"), std::string::npos);
  EXPECT_NE(source.find("__launch_bounds__(128, 1) flexattn_backward_dkdv"), std::string::npos);
  EXPECT_NE(source.find("backward_delta<flexattn_kernels::BFloat16Tag, 64>"), std::string::npos);
}

// kBoundedDerivative (the kernels leave out their select against 0 * inf) only where the
// derivative's interval over every score is finite.
TEST(CudaCodegenBackward, BoundedDerivativeOnlyWhereItsIntervalIsFinite) {
  SKIP_WITHOUT_CUDA_ENGINE();
  const std::vector<std::pair<std::string, bool>> modifiers = {
      {"30 * tanh(score / 30)", true},           // 1 - tanh^2: [0, 1]
      {"", true},                                // the constant 1
      {"where(kv % 5 == 3, -inf, score * 0.5)", true},  // 0 or 0.5
      {"score * score / 8", false},              // score / 4: unbounded
      {"exp(score)", false},
  };
  for (const auto& [modifier, bounded] : modifiers) {
    GeneratedCase c{"bounded", DType::kBF16, 64, 64, modifier, "", {}, {}, Layout::kBSHD, {}};
    const std::string source =
        generated_part(cuda_engine()->generated_source(make_backward_problem(c)));
    EXPECT_NE(source.find(bounded ? "kBoundedDerivative = true" : "kBoundedDerivative = false"),
              std::string::npos)
        << modifier << "\n"
        << source;
  }
}

TEST(CudaCodegenBackward, PlainHasTheIdentityDerivative) {
  SKIP_WITHOUT_CUDA_ENGINE();
  GeneratedCase plain{"plain", DType::kF32, 80, 80, "", "", {}, {}, Layout::kBSHD, {}};
  const std::string source =
      generated_part(cuda_engine()->generated_source(make_backward_problem(plain)));
  EXPECT_NE(source.find("kIdentityDerivative = true"), std::string::npos) << source;
  EXPECT_NE(source.find("kHasTensorGrads = false"), std::string::npos) << source;
  EXPECT_EQ(tensor_grads_body(source).find("grad_fixed"), std::string::npos) << source;
  // fp32: the fp32-unit kernels, without a minimum of blocks per multiprocessor.
  EXPECT_NE(source.find("backward_dkdv_simt<FlexattnBackwardConfig"), std::string::npos);
  EXPECT_NE(source.find("__launch_bounds__(128) flexattn_backward_dq"), std::string::npos);
  EXPECT_NE(source.find("BackwardSimtConfig<flexattn_kernels::Float32Tag, 80, 80, "),
            std::string::npos)
      << source;
}

TEST(CudaCodegenBackward, VaryingIndexScattersWithAtomics) {
  SKIP_WITHOUT_CUDA_ENGINE();
  GeneratedCase bias{"bias", DType::kBF16, 64, 64, "score + bias[h, q, kv]", "",
                     {{"bias", TensorDecl{DType::kF32, {4, 100, 77}}}}, {}, Layout::kBSHD, {}};
  const std::string source =
      generated_part(cuda_engine()->generated_source(make_backward_problem(bias)));
  EXPECT_NE(source.find("kIdentityDerivative = true"), std::string::npos) << source;
  EXPECT_NE(source.find("kHasTensorGrads = true"), std::string::npos) << source;
  const std::string scatter = tensor_grads_body(source);
  EXPECT_NE(scatter.find("if (bp.grad_fixed[0] != nullptr)"), std::string::npos) << scatter;
  EXPECT_NE(scatter.find("add_fixed(bp.grad_fixed[0] + at.head * 7700 + q * 77 + kv, "
                         "to_fixed(dlogit * (0x1p+0f)))"),
            std::string::npos)
      << scatter;
  EXPECT_EQ(scatter.find("local["), std::string::npos) << scatter;
  EXPECT_EQ(flush_body(source).find("grad_fixed"), std::string::npos) << source;
}

TEST(CudaCodegenBackward, HeadIndexedLoadsAreSummedPerThread) {
  SKIP_WITHOUT_CUDA_ENGINE();
  const TensorDecl per_head{DType::kF32, {4}};
  GeneratedCase gate{"gate", DType::kBF16, 64, 64, "score * gate[h]", "", {{"gate", per_head}},
                     {}, Layout::kBSHD, {}};
  const std::string gated =
      generated_part(cuda_engine()->generated_source(make_backward_problem(gate)));
  // d/d score = gate[h]: an invariant, loaded once per block.
  EXPECT_NE(gated.find("kIdentityDerivative = false"), std::string::npos) << gated;
  EXPECT_NE(between(gated, "float score_grad(", "void tensor_grads(").find("return inv."),
            std::string::npos)
      << gated;
  EXPECT_NE(tensor_grads_body(gated).find("local[0] += to_fixed(dlogit * score);"),
            std::string::npos)
      << gated;
  EXPECT_EQ(tensor_grads_body(gated).find("add_fixed("), std::string::npos) << gated;
  const std::string flush = flush_body(gated);
  EXPECT_NE(flush.find("warp_sum_fixed(local[0])"), std::string::npos) << flush;
  EXPECT_NE(flush.find("add_fixed(bp.grad_fixed[0] + at.head, sum)"), std::string::npos)
      << flush;

  // Two head-indexed tensors (ALiBi slopes and a gate): two local slots, one per load, each
  // flushed into its own tensor's accumulator.
  GeneratedCase alibi{"alibi_gate", DType::kF16, 64, 64, "score * gate[h] + slopes[h] * (kv - q)",
                      "", {{"gate", per_head}, {"slopes", per_head}}, {}, Layout::kBSHD, {}};
  const std::string both =
      generated_part(cuda_engine()->generated_source(make_backward_problem(alibi)));
  EXPECT_NE(both.find("kLocalGradSlots = 2;"), std::string::npos) << both;
  EXPECT_NE(flush_body(both).find("add_fixed(bp.grad_fixed[0] + at.head, sum)"),
            std::string::npos)
      << both;
  EXPECT_NE(flush_body(both).find("add_fixed(bp.grad_fixed[1] + at.head, sum)"),
            std::string::npos)
      << both;
}

TEST(CudaCodegenBackward, IntegerTensorsGetNoGradient) {
  SKIP_WITHOUT_CUDA_ENGINE();
  GeneratedCase document{"document", DType::kBF16, 64, 64, "score + 0.5 * float(doc[kv])",
                         "doc[q] == doc[kv]", {{"doc", TensorDecl{DType::kI32, {100}}}}, {},
                         Layout::kBSHD, {}};
  const std::string source =
      generated_part(cuda_engine()->generated_source(make_backward_problem(document)));
  EXPECT_NE(source.find("kHasTensorGrads = false"), std::string::npos) << source;
  EXPECT_EQ(source.find("add_fixed("), std::string::npos) << source;
}

// A forward-only problem generates what it did before the backward existed (so its kernel cache
// keys are unchanged): the backward problem's code is the forward's plus the backward members
// and entry points (for a modifier whose derivative adds no invariants), the forward's entry
// point outside the backward's module and the backward's outside the forward's.
TEST(CudaCodegenBackward, ForwardOnlySourceIsUnchanged) {
  SKIP_WITHOUT_CUDA_ENGINE();
  GeneratedCase softcap{"softcap", DType::kBF16, 64, 64, "30 * tanh(score / 30)", "q >= kv",
                        {}, {}, Layout::kBSHD, {}};
  const std::string forward =
      generated_part(cuda_engine()->generated_source(make_problem(softcap)));
  EXPECT_EQ(forward.find("kIdentityDerivative"), std::string::npos);
  EXPECT_EQ(forward.find("flexattn_backward"), std::string::npos);
  std::string backward =
      generated_part(cuda_engine()->generated_source(make_backward_problem(softcap)));
  const std::size_t members = backward.find("  static constexpr bool kIdentityDerivative");
  const std::size_t members_end = backward.find("};\n\n}  // namespace flexattn_generated");
  ASSERT_NE(members, std::string::npos);
  ASSERT_NE(members_end, std::string::npos);
  backward.erase(members, members_end - members);
  const std::string forward_guard = "#ifndef FLEXATTN_BACKWARD_MODULE\n";
  const std::size_t guard = backward.find(forward_guard);
  ASSERT_NE(guard, std::string::npos);
  backward.erase(guard, forward_guard.size());
  const std::size_t entry_points =
      backward.find("#endif\n#ifndef FLEXATTN_FORWARD_MODULE\nusing FlexattnBackwardConfig");
  ASSERT_NE(entry_points, std::string::npos);
  EXPECT_TRUE(backward.ends_with("}\n#endif\n"));
  backward.erase(entry_points);
  EXPECT_EQ(backward, forward);
}

TEST(CudaCodegenBackward, UnservedProblemsAreRefusedWithAReason) {
  SKIP_WITHOUT_CUDA_ENGINE();
  GeneratedCase wide{"wide", DType::kBF16, 320, 320, "", "", {}, {}, Layout::kBSHD, {}};
  const std::string source = cuda_engine()->generated_source(make_backward_problem(wide));
  EXPECT_NE(source.find("not supported"), std::string::npos) << source;
  EXPECT_NE(source.find("256"), std::string::npos) << source;
}

// ---- the forward's logit and its variants ----------------------------------------------------

// kStaticReference (the forward's softmax subtracts a bound on every logit, no running max)
// only where score_mod's interval is finite and at most 96 log2 units wide, and not for fp16
// (whose P would underflow); the reference is the interval's top in log2 units.
TEST(CudaCodegen, StaticReferenceOnlyForNarrowBoundedLogits) {
  SKIP_WITHOUT_CUDA_ENGINE();
  struct Expected {
    std::string modifier;
    DType dtype;
    std::string fragment;
  };
  const std::string off = "kStaticReference = false";
  const std::vector<Expected> cases = {
      // 30 log2 e = 43.28: the span 86.6 log2 units.
      {"30 * tanh(score / 30)", DType::kBF16, "kStaticReferenceLog2 = (0x1.5a3f2ep+5f)"},
      {"30 * tanh(score / 30)", DType::kF32, "kStaticReferenceLog2 = (0x1.5a3f2ep+5f)"},
      {"30 * tanh(score / 30)", DType::kF16, off},
      {"50 * tanh(score / 50)", DType::kBF16, off},  // 144 log2 units
      {"34 * tanh(score / 34)", DType::kBF16, off},  // 98.1 log2 units
      {"where(score > 0, 3, -2)", DType::kBF16, "kStaticReferenceLog2 = (0x1.14ff58p+2f)"},
      {"", DType::kBF16, off},
      {"score + bias[h, q, kv]", DType::kBF16, off},
      {"where(kv % 5 == 3, -inf, 30 * tanh(score / 30))", DType::kBF16, off},
  };
  for (const Expected& e : cases) {
    std::map<std::string, TensorDecl> tensors;
    if (e.modifier.find("bias") != std::string::npos) {
      tensors["bias"] = TensorDecl{DType::kF32, {4, 100, 100}};
    }
    const Problem problem = make_problem(
        GeneratedCase{"static", e.dtype, 128, 128, e.modifier, "", tensors, {}, Layout::kBSHD, {}});
    const std::string source = generated_part(cuda_engine()->generated_source(problem));
    EXPECT_NE(source.find(e.fragment), std::string::npos) << e.modifier << "\n" << source;
    if (e.fragment != off) {
      EXPECT_NE(source.find("kStaticReference = true"), std::string::npos) << e.modifier;
    }
  }
}

// score_mod_log2 (the tensor-core kernels' logit in the exp2 domain) merges the constant
// multiplications around softcap's tanh: two fewer instructions per score, and no separate
// `score` when every use of it has a constant factor.
TEST(CudaCodegen, ConstantMultiplicationsAroundTheScoreAreMerged) {
  SKIP_WITHOUT_CUDA_ENGINE();
  struct Expectation {
    std::string score_mod;
    std::vector<std::string> present, absent;
  };
  const std::vector<Expectation> expectations = {
      // 30 * tanh(score / 30): dot * (scale / 30), then tanh(...) * (30 * log2(e)).
      {"30 * tanh(score / 30)",
       {"ir_mul(dot, inv.s", "ir_tanh(", "(0x1.5a3f2ep+5f)"},
       {"const float score", "kLog2e", "(0x1.ep+4f)"}},
      // A sum takes log2(e) term by term: dot * (scale * log2(e)) + float(kv - q) * (slope *
      // log2(e)), the products once per block; no separate score, no final multiplication.
      {"score + slopes[h] * (kv - q)",
       {"return ir_add(ir_mul(dot, inv.s", "_times)", "ir_small_int_to_float("},
       {"const float score", "static_cast<float>"}},
      // A dense bias: dot * (scale * log2(e)) + bias * log2(e), one multiply and one FMA.
      {"score + slopes[kv % 4]", {"ir_add(ir_mul(dot, inv.s", ", (0x1.715476p+0f)))"},
       {"const float score"}},
      // A sum with a score used elsewhere keeps `score` for that use.
      {"score + where(score > 0, 1.0, score)",
       {"const float score = dot * p.scale;", "ir_add(ir_mul(dot, inv.s"}, {}},
      // The root multiplies the score itself: dot * (scale * 2), then times log2(e).
      {"score * 2", {"ir_mul(dot, inv.s", "(0x1.715476p+0f)"}, {"const float score"}},
      // A chain of constant factors at the root: one multiplication.
      {"tanh(score) * 3 / 2", {"(0x1.14ff58p+1f)"}, {"kLog2e"}},
      // A score used twice, once without a constant factor: computed once, not merged.
      {"where(score > 0, score * 0.5, score)", {"const float score = dot * p.scale;"}, {"_dot"}},
      // Division of the root by a constant: x * (log2(e) / c).
      {"tanh(score * 0.25) / 4", {"ir_mul(dot, inv.s", "(0x1.715476p-2f)"}, {"kLog2e"}},
  };
  for (const Expectation& e : expectations) {
    SCOPED_TRACE(e.score_mod);
    GeneratedCase c{"merge", DType::kBF16, 64, 64, e.score_mod, "",
                    {{"slopes", TensorDecl{DType::kF32, {4}}}}, {}, Layout::kBSHD, {}};
    if (e.score_mod.find("slopes") == std::string::npos) c.tensors.clear();
    const std::string source = cuda_engine()->generated_source(make_problem(c));
    const std::string body = function_body(source, "score_mod_log2");
    ASSERT_FALSE(body.empty()) << source.substr(source.find("// ---- generated"));
    for (const std::string& fragment : e.present) {
      EXPECT_NE(body.find(fragment), std::string::npos) << "missing '" << fragment << "' in\n"
                                                        << body;
    }
    for (const std::string& fragment : e.absent) {
      EXPECT_EQ(body.find(fragment), std::string::npos) << "unexpected '" << fragment << "' in\n"
                                                        << body;
    }
  }
}

// The forward's logit (score_mod_forward) is in natural units exactly when log2(e) would cost
// score_mod_log2 per-element multiplies that the natural function does not have: a bias term
// (`bias * log2(e)`), a root with no constant factor of its own. The kernels' softmax then takes
// log2(e) in its exp2 argument (kForwardToLog2). Not for the identity, ALiBi (the factor goes
// into the per-block slope), softcap (the root's own constant takes it; and its small-tanh
// functions are in log2 units), or a root with a constant factor.
TEST(CudaCodegen, ForwardLogitInNaturalUnitsWhereLog2eCostsMultiplies) {
  SKIP_WITHOUT_CUDA_ENGINE();
  struct Expectation {
    std::string score_mod;
    bool natural;
  };
  const std::vector<Expectation> expectations = {
      {"score", false},
      {"score + slopes[kv % 4]", true},
      {"score - slopes[kv % 4]", true},
      {"slopes[kv % 4]", true},
      {"score + slopes[h] * (kv - q)", false},
      {"30 * tanh(score / 30)", false},
      {"(score + slopes[kv % 4]) * 2", false},
      {"tanh(score)", true},
  };
  for (const Expectation& e : expectations) {
    SCOPED_TRACE(e.score_mod);
    GeneratedCase c{"natural", DType::kBF16, 64, 64, e.score_mod, "",
                    {{"slopes", TensorDecl{DType::kF32, {4}}}}, {}, Layout::kBSHD, {}};
    if (e.score_mod.find("slopes") == std::string::npos) c.tensors.clear();
    const std::string source = cuda_engine()->generated_source(make_problem(c));
    const std::string generated = source.substr(source.find("// ---- generated"));
    const std::string body = function_body(source, "score_mod_forward");
    ASSERT_FALSE(body.empty()) << generated;
    if (e.natural) {
      EXPECT_NE(generated.find("kForwardToLog2 = kLog2e;"), std::string::npos) << generated;
      EXPECT_EQ(body.find("score_mod_log2"), std::string::npos) << body;
      EXPECT_EQ(body.find("0x1.715476p+0f"), std::string::npos) << "log2(e) in\n" << body;
    } else {
      EXPECT_NE(generated.find("kForwardToLog2 = 1.0f;"), std::string::npos) << generated;
      EXPECT_NE(body.find("return score_mod_log2("), std::string::npos) << body;
    }
  }
}

// An i32 converted to f32 skips I2F (ir_small_int_to_float) exactly when the interval analysis
// bounds it inside [-2^22, 2^22) over the problem: ALiBi's kv - q at ordinary lengths, not at
// lengths of 2^22 and more, nor an integer read from a tensor (unless reduced modulo a literal).
TEST(CudaCodegen, SmallIntegersConvertWithoutI2F) {
  SKIP_WITHOUT_CUDA_ENGINE();
  struct Expectation {
    std::string score_mod;
    std::int64_t seq_len;
    bool small;
  };
  const std::vector<Expectation> expectations = {
      {"score + slopes[h] * (kv - q)", 4096, true},
      {"score + slopes[h] * (kv - q)", 4194304, true},  // kv - q within (-2^22, 2^22)
      {"score + slopes[h] * (kv + q)", 2097152, true},  // up to 2^22 - 2
      {"score + slopes[h] * (kv + q)", 2097153, false},
      {"score + slopes[h] * (kv - q)", 4194305, false},
      {"score + float(ids[kv])", 4096, false},  // data: any i32
      {"score + float(ids[kv] % 7)", 4096, true},  // the divisor's sign: within [0, 6]
  };
  for (const Expectation& e : expectations) {
    SCOPED_TRACE(fmt::format("{} at length {}", e.score_mod, e.seq_len));
    ProblemDesc desc;
    desc.batch = 1;
    desc.heads_q = 4;
    desc.heads_kv = 4;
    desc.seq_len_q = e.seq_len;
    desc.seq_len_kv = e.seq_len;
    desc.head_dim_qk = 64;
    desc.head_dim_v = 64;
    desc.dtype = DType::kBF16;
    desc.device = Device::kCuda;
    desc.tensors = {{"slopes", TensorDecl{DType::kF32, {4}}},
                    {"ids", TensorDecl{DType::kI32, {e.seq_len}}}};
    desc.score_mod = ir::parse(e.score_mod, desc.scope());
    const std::string body = function_body(
        generated_part(cuda_engine()->generated_source(Problem(std::move(desc)))),
        "score_mod_log2");
    EXPECT_EQ(body.find("ir_small_int_to_float(") != std::string::npos, e.small) << body;
    EXPECT_EQ(body.find("static_cast<float>") != std::string::npos, !e.small) << body;
  }
}

// The small-tanh variants (kSmallTanh): offered exactly when every tanh argument is the score
// times or divided by an invariant, with the bound condition evaluating that argument at the
// tile's largest |dot|, and the backward's derivative in the same small form.
TEST(CudaCodegen, SmallTanhVariantsComeWithTheirBound) {
  SKIP_WITHOUT_CUDA_ENGINE();
  struct Expectation {
    std::string score_mod;
    bool offered;
    std::vector<std::string> condition;  // fragments of tanh_args_small's body
  };
  const std::vector<Expectation> expectations = {
      {"30 * tanh(score / 30)", true, {"fabsf(bound * inv.s", "< kTanhSmallLimit"}},
      {"c * tanh(score / c)", true, {"fabsf((bound * fabsf(p.scale)) / p.params[0])"}},
      {"tanh(score * slopes[h]) * 2", true, {"(bound * fabsf(p.scale)) * inv.s"}},
      {"30 * tanh(score / 30) + tanh(score * 0.5)", true, {" && "}},
      {"tanh(score + 1)", false, {}},
      {"tanh(score * (kv - q))", false, {}},
      {"tanh(slopes[h]) * score", false, {}},  // a tanh, but not of the score: nothing to gain
      {"score + slopes[h]", false, {}},
  };
  for (const Expectation& e : expectations) {
    SCOPED_TRACE(e.score_mod);
    GeneratedCase c{"small", DType::kBF16, 64, 64, e.score_mod, "",
                    {{"slopes", TensorDecl{DType::kF32, {4}}}}, {{"c", 30.0}}, Layout::kBSHD, {}};
    if (e.score_mod.find("slopes") == std::string::npos) c.tensors.clear();
    if (e.score_mod.find("c *") == std::string::npos) c.params.clear();
    const std::string source = generated_part(cuda_engine()->generated_source(make_problem(c)));
    EXPECT_NE(source.find(fmt::format("kSmallTanh = {};", e.offered)), std::string::npos)
        << source;
    const std::string condition = function_body(source, "tanh_args_small");
    const std::string small = function_body(source, "score_mod_log2_small");
    EXPECT_EQ(condition.empty(), !e.offered) << condition;
    EXPECT_EQ(small.empty(), !e.offered) << small;
    if (!e.offered) continue;
    for (const std::string& fragment : e.condition) {
      EXPECT_NE(condition.find(fragment), std::string::npos) << "missing '" << fragment << "' in\n"
                                                             << condition;
    }
    // The same function as score_mod_log2 with every tanh in its small form.
    std::string expected = function_body(source, "score_mod_log2");
    for (std::size_t at = expected.find("ir_tanh("); at != std::string::npos;
         at = expected.find("ir_tanh(", at)) {
      expected.replace(at, 8, "ir_tanh_small(");
    }
    expected.replace(expected.find("score_mod_log2("), 15, "score_mod_log2_small(");
    EXPECT_EQ(small, expected);
  }
  // Forward and backward: the derivative has its small form too, on the same bound.
  GeneratedCase softcap{"softcap", DType::kBF16, 128, 128, "30 * tanh(score / 30)", "q >= kv",
                        {}, {}, Layout::kBSHD, {}};
  const std::string source =
      generated_part(cuda_engine()->generated_source(make_backward_problem(softcap)));
  const std::string derivative = function_body(source, "score_grad_from_dot_small");
  EXPECT_NE(derivative.find("ir_mul(dot, inv.s2_dot)"), std::string::npos) << derivative;
  EXPECT_NE(derivative.find("ir_tanh_small("), std::string::npos) << derivative;
  EXPECT_EQ(derivative.find("ir_tanh("), std::string::npos) << derivative;
  EXPECT_EQ(function_body(source, "tanh_args_small").find(" && "), std::string::npos)
      << "the derivative's condition is the logit's, stated once";
}

}  // namespace
}  // namespace flexattn
