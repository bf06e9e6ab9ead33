// The cuda engine's code generation, on the CPU: the generated CUDA for a spread of modifiers,
// dtypes, head dims and layouts contains the lowering of each IR feature and compiles with NVRTC
// for sm_90 (NVRTC needs no GPU); the backward's Modifier members and entry points, its kernel
// choice and its kv-major tile list. Skipped in builds without CUDA.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

// The engine's internals (tile plan, NVRTC compilation) exist only in builds with the engine.
#if FLEXATTN_HAVE_CUDA
#include "engines/cuda/codegen.hpp"
#include "engines/cuda/kernel_cache.hpp"
#include "engines/cuda/tile_plan.hpp"
#endif

#if __has_include(<nvrtc.h>)
#include <cuda.h>
#include <dlfcn.h>
#include <nvrtc.h>
#define FLEXATTN_TEST_HAS_NVRTC 1
#endif

namespace flexattn {
namespace {

// The architecture the generated code is checked for (the H200 of the benchmarks).
constexpr const char* kArchitecture = "--gpu-architecture=sm_90";

std::shared_ptr<const Engine> cuda_engine() {
  for (const std::shared_ptr<const Engine>& engine : builtin_engines()) {
    if (engine->name() == "cuda") return engine;
  }
  return nullptr;
}

#define SKIP_WITHOUT_CUDA_ENGINE()                                        \
  do {                                                                    \
    if (cuda_engine() == nullptr) GTEST_SKIP() << "built without CUDA";  \
  } while (false)

struct GeneratedCase {
  std::string name;
  DType dtype;
  std::int64_t head_dim_qk, head_dim_v;
  std::string score_mod, mask_mod;
  std::map<std::string, TensorDecl> tensors;
  std::map<std::string, double> params;
  Layout layout = Layout::kBSHD;
  std::vector<std::string> expected_fragments;  // must appear in the generated source
};

Problem make_problem(const GeneratedCase& c) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = 100;
  desc.seq_len_kv = 77;
  desc.head_dim_qk = c.head_dim_qk;
  desc.head_dim_v = c.head_dim_v;
  desc.dtype = c.dtype;
  desc.layout = c.layout;
  desc.device = Device::kCuda;
  desc.tensors = c.tensors;
  desc.params = c.params;
  if (c.layout == Layout::kTHD) {
    desc.cu_seqlens_q = {0, 60, 100};
    desc.cu_seqlens_kv = {0, 30, 77};
    desc.seq_len_q = 0;
    desc.seq_len_kv = 0;
  }
  if (!c.score_mod.empty()) desc.score_mod = ir::parse(c.score_mod, desc.scope());
  if (!c.mask_mod.empty()) desc.mask_mod = ir::parse(c.mask_mod, desc.scope());
  return Problem(std::move(desc));
}

std::vector<GeneratedCase> cases() {
  const TensorDecl slopes{DType::kF32, {4}};
  const TensorDecl bias{DType::kBF16, {4, 100, 77}};
  const TensorDecl rel{DType::kF32, {4, 129}};
  const TensorDecl doc_q{DType::kI64, {100}};
  const TensorDecl doc_kv{DType::kI32, {77}};
  return {
      {"identity_bf16_d128", DType::kBF16, 128, 128, "", "", {}, {}, Layout::kBSHD,
       {"kIdentityScore = true", "kHasMask = false", "forward_mma", "BFloat16Tag, 128, 128"}},
      {"softcap_causal_fp16_d64", DType::kF16, 64, 64, "30 * tanh(score / 30)", "q >= kv", {}, {},
       Layout::kBHSD, {"ir_tanh(", "kHasMask = true", "HalfTag", "forward_mma"}},
      {"softcap_fp32_d64", DType::kF32, 64, 64, "30 * tanh(score / 30)", "", {}, {},
       Layout::kBSHD, {"tanhf(", "ir_mul(score", "forward_simt"}},
      {"alibi_bf16_d80_v72_sbhd", DType::kBF16, 80, 72, "score + slopes[h] * (kv - q)", "", {{"slopes", slopes}},
       {}, Layout::kSBHD, {"load_tensor_f32(", "inv.s", "80, 72, 128, 128"}},
      {"bias_window_fp32_d256", DType::kF32, 256, 256, "score + bias[h, q, kv]", "q >= kv && q - kv < 32",
       {{"bias", bias}}, {}, Layout::kBSHD, {"load_tensor_bf16(", "forward_simt", "Float32Tag"}},
      {"relative_bias_thd_d64", DType::kBF16, 64, 64, "score + rel[h, clamp(kv - q + 64, 0, 128)]",
       "q + (KV_LEN - Q_LEN) >= kv", {{"rel", rel}}, {}, Layout::kTHD,
       {"ir_clamp(", "at.kv_len", "at.q_len"}},
      {"document_piecewise_d17", DType::kBF16, 17, 17,
       "where(score > 0, score * 0.5, score * 2 + 0.25 * float(kv % 3))", "docq[q] == dockv[kv]",
       {{"docq", doc_q}, {"dockv", doc_kv}}, {}, Layout::kBSHD,
       {"load_tensor_i64(", "load_tensor_i32(", "ir_mod(", "forward_simt"}},
      {"params_neginf_fp16_d128", DType::kF16, 128, 96, "where(kv % 5 == 3, -inf, score * gain)",
       "!(kv < 8) || q >= kv", {}, {{"gain", 0.7}}, Layout::kBSHD,
       {"p.params[0]", "negative_infinity()", "(!"}},
      {"gate_exp_bf16_d64", DType::kBF16, 64, 64,
       "score * sigmoid(gate[h]) + log2(exp2(abs(score))) - sqrt(rsqrt(4.0)) + floor(score) + exp(log(1.5)) + int(score)",
       "", {{"gate", TensorDecl{DType::kF16, {4}}}}, {}, Layout::kBSHD,
       {"ir_sigmoid(", "load_tensor_f16(", "ir_to_int(", "floorf("}},
  };
}

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

Problem make_backward_problem(const GeneratedCase& c) {
  Problem forward = make_problem(c);
  ProblemDesc desc = forward.desc();
  desc.direction = Direction::kForwardBackward;
  return Problem(std::move(desc));
}

// The generated part of a translation unit, and pieces of it.
std::string generated_part(const std::string& source) {
  const std::size_t marker = source.find("// ---- generated");
  return marker == std::string::npos ? source : source.substr(marker);
}
std::string between(const std::string& text, const std::string& from, const std::string& to) {
  const std::size_t begin = text.find(from);
  if (begin == std::string::npos) return {};
  const std::size_t end = text.find(to, begin + from.size());
  return text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}
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

// kStaticReference (the forward's softmax subtracts a bound on every logit, no running max)
// only where score_mod's interval is finite and at most 100 log2 units wide, and not for fp16
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
// and entry points (for a modifier whose derivative adds no invariants).
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
  const std::size_t entry_points = backward.find("using FlexattnBackwardConfig");
  ASSERT_NE(entry_points, std::string::npos);
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

#if FLEXATTN_HAVE_CUDA
Problem backward_problem_with(DType dtype, std::int64_t head_dim_qk, std::int64_t head_dim_v) {
  GeneratedCase c{"choice", dtype, head_dim_qk, head_dim_v, "", "", {}, {}, Layout::kBSHD, {}};
  return make_backward_problem(c);
}

TEST(CudaBackwardChoice, TensorCoresForSixteenBitStorageUpToHeadDim128) {
  const cuda::BackwardSelection d64 = cuda::choose_backward_kernel(
      backward_problem_with(DType::kBF16, 64, 64));
  ASSERT_TRUE(d64.reason.empty()) << d64.reason;
  EXPECT_EQ(d64.choice.kind, cuda::KernelKind::kMma);
  EXPECT_EQ(d64.choice.block_q, 64);
  EXPECT_EQ(d64.choice.block_kv, 64);
  EXPECT_EQ(d64.choice.threads, 128);
  // kernels/backward_mma.cuh: 6 * 64 * (pqk + pv) bytes, plus 1024 for lse and delta (dK/dV).
  EXPECT_EQ(d64.choice.shared_dkdv, 6 * 64 * (64 + 64) + 1024);
  EXPECT_EQ(d64.choice.shared_dq, 6 * 64 * (64 + 64));

  const cuda::BackwardSelection d80 = cuda::choose_backward_kernel(
      backward_problem_with(DType::kF16, 80, 72));
  ASSERT_TRUE(d80.reason.empty()) << d80.reason;
  EXPECT_EQ(d80.choice.kind, cuda::KernelKind::kMma);
  EXPECT_EQ(d80.choice.padded_qk, 128);
  EXPECT_EQ(d80.choice.padded_v, 128);
  EXPECT_EQ(d80.choice.shared_dq, 6 * 64 * (128 + 128));
  EXPECT_NE(d80.choice.config_type().find("BackwardMmaConfig<flexattn_kernels::HalfTag, 80, 72, "
                                          "128, 128, "),
            std::string::npos)
      << d80.choice.config_type();
}

// On sm_90 both backward kernels run on wgmma for head dims 64/128: dK/dV over 128-key blocks
// (64-row q blocks), dQ over 128-row blocks (64-key tiles), 256 threads each.
TEST(CudaBackwardChoice, WgmmaOnSm90ForHeadDims64And128) {
  const cuda::BackwardSelection d128 =
      cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 128, 128), 90);
  ASSERT_TRUE(d128.reason.empty()) << d128.reason;
  const cuda::BackwardChoice& c = d128.choice;
  EXPECT_TRUE(c.wgmma);
  EXPECT_EQ(c.block_q, 64);
  EXPECT_EQ(c.block_kv, 64);
  EXPECT_EQ(c.dkdv_block_kv, 128);
  EXPECT_EQ(c.dq_block_q, 128);
  EXPECT_EQ(c.dkdv_threads, 256);
  EXPECT_EQ(c.dq_threads, 256);
  EXPECT_EQ(c.architecture_suffix(), "a");
  EXPECT_EQ(c.dkdv_template(), "backward_dkdv_wgmma");
  EXPECT_EQ(c.dq_template(), "backward_dq_wgmma");
  // kernels/backward_wgmma.cuh: 1024 + 128 rows resident (K, V or Q, dO) + 3 stages of 64 rows
  // of the other pair, + 3 x 512 for lse and delta (dK/dV).
  EXPECT_EQ(c.dkdv_shared_bytes(), 1024 + 128 * 256 * 2 + 3 * 64 * 256 * 2 + 3 * 512);
  EXPECT_EQ(c.dq_shared_bytes(), 1024 + 128 * 256 * 2 + 3 * 64 * 256 * 2);
  EXPECT_EQ(c.wgmma_config_type(),
            fmt::format("flexattn_kernels::BackwardWgmmaConfig<flexattn_kernels::BFloat16Tag, "
                        "128, 128, {}, {}>",
                        c.dkdv_shared_bytes(), c.dq_shared_bytes()));
  for (const cuda::BackwardSelection& other :
       {cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 128, 128), 80),
        cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 128, 128), 90, false),
        cuda::choose_backward_kernel(backward_problem_with(DType::kF16, 80, 72), 90)}) {
    EXPECT_FALSE(other.choice.wgmma);
    EXPECT_EQ(other.choice.dkdv_block_kv, other.choice.block_kv);
    EXPECT_EQ(other.choice.dq_block_q, other.choice.block_q);
    EXPECT_EQ(other.choice.dkdv_shared_bytes(), other.choice.shared_dkdv);
    EXPECT_EQ(other.choice.dkdv_template(), "backward_dkdv_mma");
    EXPECT_EQ(other.choice.dq_template(), "backward_dq_mma");
  }
}

TEST(CudaBackwardChoice, FloatUnitsOtherwiseWithTheirReason) {
  struct Expected {
    DType dtype;
    std::int64_t head_dim_qk, head_dim_v;
    const char* why;
  };
  for (const Expected& e : {Expected{DType::kF32, 64, 64, "fp32 storage"},
                            Expected{DType::kBF16, 17, 17, "not multiples of 8"},
                            Expected{DType::kBF16, 160, 160, "exceeds the tensor-core"},
                            Expected{DType::kF16, 256, 128, "exceeds the tensor-core"}}) {
    SCOPED_TRACE(e.why);
    const cuda::BackwardSelection selection =
        cuda::choose_backward_kernel(backward_problem_with(e.dtype, e.head_dim_qk, e.head_dim_v));
    ASSERT_TRUE(selection.reason.empty()) << selection.reason;
    EXPECT_EQ(selection.choice.kind, cuda::KernelKind::kSimt);
    EXPECT_NE(selection.choice.why.find(e.why), std::string::npos) << selection.choice.why;
    EXPECT_NE(selection.choice.describe().find(e.why), std::string::npos);
    EXPECT_EQ(selection.choice.block_q, 32);
    EXPECT_EQ(selection.choice.block_kv, 32);
    // kernels/backward_simt.cuh: 4 * (2 * 32 * (dqk + dv) + 2 * 32 + 2 * 32 * 33) bytes.
    const auto dims = static_cast<int>(e.head_dim_qk + e.head_dim_v);
    EXPECT_EQ(selection.choice.shared_dkdv, 4 * (2 * 32 * dims + 2 * 32 + 2 * 32 * 33));
    EXPECT_EQ(selection.choice.shared_dq, selection.choice.shared_dkdv);
  }

  // A query stride of 68 elements: rows are not 16-byte aligned.
  GeneratedCase strided{"strided", DType::kBF16, 64, 64, "", "", {}, {}, Layout::kBSHD, {}};
  ProblemDesc desc = make_backward_problem(strided).desc();
  desc.q_strides = std::vector<std::int64_t>{100 * 4 * 68, 4 * 68, 68, 1};
  const cuda::BackwardSelection selection = cuda::choose_backward_kernel(Problem(desc));
  ASSERT_TRUE(selection.reason.empty()) << selection.reason;
  EXPECT_EQ(selection.choice.kind, cuda::KernelKind::kSimt);
  EXPECT_NE(selection.choice.why.find("stride"), std::string::npos) << selection.choice.why;
}

TEST(CudaBackwardChoice, RefusesFloat64AndHeadDimsAbove256) {
  const cuda::BackwardSelection fp64 =
      cuda::choose_backward_kernel(backward_problem_with(DType::kF64, 64, 64));
  EXPECT_NE(fp64.reason.find("fp64"), std::string::npos) << fp64.reason;
  const cuda::BackwardSelection wide =
      cuda::choose_backward_kernel(backward_problem_with(DType::kF32, 64, 264));
  EXPECT_NE(wide.reason.find("264"), std::string::npos) << wide.reason;
  EXPECT_NE(wide.reason.find("256"), std::string::npos) << wide.reason;
}

// The kv-major list holds exactly the q-major list's pairs, each kv tile's query blocks in
// ascending order with their mixed bits, for masks with skipped, full and mixed tiles.
TEST(CudaBackwardTiles, TransposeMatchesTheQueryMajorList) {
  struct MaskCase {
    const char* mask;
    std::int64_t seq_len_q, seq_len_kv;
    int block_q, block_kv;
  };
  for (const MaskCase& m : {MaskCase{"q >= kv", 300, 300, 64, 64},
                            MaskCase{"q + (KV_LEN - Q_LEN) >= kv", 200, 333, 32, 32},
                            MaskCase{"q >= kv && q - kv < 80", 500, 500, 64, 64},
                            MaskCase{"", 70, 129, 32, 32}}) {
    SCOPED_TRACE(m.mask);
    GeneratedCase c{"tiles", DType::kBF16, 64, 64, "", m.mask, {}, {}, Layout::kBSHD, {}};
    ProblemDesc desc = make_backward_problem(c).desc();
    desc.seq_len_q = m.seq_len_q;
    desc.seq_len_kv = m.seq_len_kv;
    const Problem problem(desc);
    const cuda::TileList list = cuda::classify_tiles(problem, m.block_q, m.block_kv);
    const cuda::KvTileList transposed = cuda::transpose_tiles(list);
    ASSERT_EQ(transposed.offsets.size(), static_cast<std::size_t>(list.kv_tiles + 1));
    ASSERT_EQ(transposed.offsets.front(), 0);
    ASSERT_EQ(transposed.offsets.back(), static_cast<int>(list.entries.size()));
    for (std::int64_t tile = 0; tile < list.kv_tiles; ++tile) {
      std::vector<int> expected;  // brute force: every query block whose list names this tile
      for (std::int64_t block = 0; block < list.query_blocks; ++block) {
        for (int i = list.offsets[static_cast<std::size_t>(block)];
             i < list.offsets[static_cast<std::size_t>(block) + 1]; ++i) {
          const int entry = list.entries[static_cast<std::size_t>(i)];
          if ((entry >> 1) == tile) expected.push_back(static_cast<int>(block << 1) | (entry & 1));
        }
      }
      const std::vector<int> actual(
          transposed.entries.begin() + transposed.offsets[static_cast<std::size_t>(tile)],
          transposed.entries.begin() + transposed.offsets[static_cast<std::size_t>(tile) + 1]);
      EXPECT_EQ(actual, expected) << "kv tile " << tile;
    }
    if (std::string(m.mask) == "q >= kv") {
      // Causal, square tiles: kv tile t is visited by query blocks t.. (the diagonal mixed).
      const std::int64_t blocks = list.query_blocks;
      for (std::int64_t tile = 0; tile < list.kv_tiles; ++tile) {
        const int begin = transposed.offsets[static_cast<std::size_t>(tile)];
        EXPECT_EQ(transposed.offsets[static_cast<std::size_t>(tile) + 1] - begin, blocks - tile);
        EXPECT_EQ(transposed.entries[static_cast<std::size_t>(begin)],
                  static_cast<int>(tile << 1) | 1);
      }
    }
  }
}

// ---- forward kernel choice: wgmma on sm_90, mma.sync elsewhere ----------------------------------

TEST(CudaForwardChoice, WgmmaOnlyOnSm90ForSixteenBitHeadDims64And128) {
  const auto choose = [](DType dtype, std::int64_t qk, std::int64_t v, int capability,
                         bool allow = true) {
    GeneratedCase c{"choice", dtype, qk, v, "", "", {}, {}, Layout::kBSHD, {}};
    const cuda::KernelSelection selection = cuda::choose_kernel(make_problem(c), capability, allow);
    EXPECT_TRUE(selection.reason.empty()) << selection.reason;
    return selection.choice;
  };
  const cuda::KernelChoice d128 = choose(DType::kBF16, 128, 128, 90);
  EXPECT_EQ(d128.kind, cuda::KernelKind::kWgmma);
  EXPECT_EQ(d128.block_m, 128);
  EXPECT_EQ(d128.block_n, 128);
  EXPECT_TRUE(d128.producer);  // two computing warpgroups and the producer's
  EXPECT_EQ(d128.threads(), 384);
  EXPECT_EQ(d128.architecture_suffix(), "a");
  EXPECT_EQ(d128.kernel_template(), "forward_wgmma");
  // kernels/forward_wgmma.cuh: 1024 (alignment) + Q 128 rows + 3 stages of 128 keys of K and V +
  // the producer's 64 bytes of stage barriers.
  EXPECT_EQ(d128.shared_bytes, 1024 + 128 * 128 * 2 + 3 * 128 * (128 + 128) * 2 + 64);
  EXPECT_LE(d128.shared_bytes, 227 * 1024);  // what one block may have on sm_90
  EXPECT_EQ(d128.config_type(),
            fmt::format("flexattn_kernels::WgmmaConfig<flexattn_kernels::BFloat16Tag, 128, 128, "
                        "128, 3, true, {}, false, 2, 1, false, true>",
                        d128.shared_bytes));
  EXPECT_TRUE(d128.pipelined);
  // Head dim 64: the loop that waits for each product, two stages of 128 keys, two blocks per
  // multiprocessor (the largest shared-memory carveout).
  const cuda::KernelChoice d64 = choose(DType::kF16, 64, 64, 90);
  EXPECT_EQ(d64.kind, cuda::KernelKind::kWgmma);
  EXPECT_FALSE(d64.pipelined);
  EXPECT_EQ(d64.stages, 2);
  EXPECT_EQ(d64.block_n, 128);
  EXPECT_EQ(d64.min_blocks, 2);
  EXPECT_EQ(d64.shared_bytes, 1024 + 128 * 64 * 2 + 2 * 128 * (64 + 64) * 2);
  EXPECT_NE(d64.config_type().find(", false, 2, 2>"), std::string::npos) << d64.config_type();
  EXPECT_EQ(choose(DType::kBF16, 128, 64, 90).kind, cuda::KernelKind::kWgmma);
  // Elsewhere the portable kernels: another architecture or none known, head dims wgmma does not
  // hold unpadded, fp32 storage, or the switch off.
  for (const cuda::KernelChoice& other :
       {choose(DType::kBF16, 128, 128, 80), choose(DType::kBF16, 128, 128, 0),
        choose(DType::kBF16, 128, 128, 100), choose(DType::kBF16, 96, 96, 90),
        choose(DType::kBF16, 128, 128, 90, false)}) {
    EXPECT_EQ(other.kind, cuda::KernelKind::kMma);
    EXPECT_EQ(other.architecture_suffix(), "");
  }
  EXPECT_EQ(choose(DType::kF32, 128, 128, 90).kind, cuda::KernelKind::kSimt);
}

// The body of one generated function, from its name to the closing brace of its definition.
std::string function_body(const std::string& source, const std::string& name) {
  const std::size_t start = source.find(" " + name + "(", source.find("// ---- generated"));
  if (start == std::string::npos) return {};
  return source.substr(start, source.find("\n  }\n", start) - start);
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

// NVRTC compiles `source` to a cubin (no GPU needed); a compile error is the test's failure.
void expect_compiles(const std::string& source, const std::string& name, int capability,
                     const std::string& suffix = "") {
  std::vector<char> cubin;
  try {
    cubin = cuda::compile_to_cubin(source, name, capability, suffix);
  } catch (const Error& error) {
    ADD_FAILURE() << error.what();
  }
  EXPECT_FALSE(cubin.empty());
}

// The wgmma translation units, forward and forward + backward, compile for sm_90a with NVRTC (no
// GPU) and hold the warpgroup instructions: the engine's module on an H200.
TEST(CudaForwardCompile, WgmmaTranslationUnitsCompileForSm90a) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  const TensorDecl slopes{DType::kF32, {4}};
  for (const auto& [c, backward] :
       {std::pair{GeneratedCase{"wgmma_bf16_d128_softcap_causal", DType::kBF16, 128, 128,
                                "30 * tanh(score / 30)", "q >= kv", {}, {}, Layout::kBSHD, {}},
                  false},
        std::pair{GeneratedCase{"wgmma_f16_d64_alibi_thd", DType::kF16, 64, 64,
                                "score + slopes[h] * (kv - q)", "", {{"slopes", slopes}}, {},
                                Layout::kTHD, {}},
                  true}}) {
    SCOPED_TRACE(c.name);
    const Problem problem = backward ? make_backward_problem(c) : make_problem(c);
    const cuda::KernelSelection selection = cuda::choose_kernel(problem, kCapability);
    ASSERT_EQ(selection.choice.kind, cuda::KernelKind::kWgmma);
    const cuda::BindingSelection bindings = cuda::bind_modifier(problem);
    ASSERT_TRUE(bindings.reason.empty()) << bindings.reason;
    std::optional<cuda::BackwardCode> backward_code;
    if (backward) {
      const cuda::BackwardChoice choice =
          cuda::choose_backward_kernel(problem, kCapability).choice;
      EXPECT_TRUE(choice.wgmma);
      backward_code = cuda::backward_code(problem, choice);
    }
    const std::string source = cuda::generate_translation_unit(
        problem, bindings.bindings, selection.choice, backward_code ? &*backward_code : nullptr);
    EXPECT_NE(source.find("flexattn_kernels::forward_wgmma<FlexattnConfig"), std::string::npos);
    if (backward) {
      EXPECT_NE(source.find("flexattn_kernels::backward_dkdv_wgmma<FlexattnWgmmaConfig"),
                std::string::npos);
      EXPECT_NE(source.find("flexattn_kernels::backward_dq_wgmma<FlexattnWgmmaConfig"),
                std::string::npos);
    }
    expect_compiles(source, c.name + ".cu", kCapability, selection.choice.architecture_suffix());
  }
}

// The head-dim-128 wgmma forward has a producer warpgroup: a third warpgroup of 128 threads
// (launched, not counted in `warps`) and 64 bytes of stage barriers; head dim 64 runs two blocks
// per multiprocessor without one.
TEST(CudaForwardChoice, WgmmaProducerAddsAWarpgroupAndItsBarriers) {
  constexpr int kCapability = 90;
  const Problem d128 = make_problem(GeneratedCase{"d128", DType::kBF16, 128, 128, "", "", {}, {},
                                                  Layout::kBSHD, {}});
  const cuda::KernelChoice c = cuda::choose_kernel(d128, kCapability).choice;
  EXPECT_TRUE(c.producer);
  EXPECT_TRUE(c.pipelined);
  EXPECT_TRUE(c.turns_possible());
  EXPECT_EQ(c.warps, 8);
  EXPECT_EQ(c.threads(), 384);
  EXPECT_EQ(c.min_blocks, 1);
  EXPECT_EQ(c.shared_bytes, 230464);  // 1024 + Q + 3 stages of K and V + 64 bytes of barriers
  EXPECT_NE(c.describe().find("producer warpgroup"), std::string::npos) << c.describe();
  const Problem d64 = make_problem(GeneratedCase{"d64", DType::kBF16, 64, 64, "", "", {}, {},
                                                 Layout::kBSHD, {}});
  const cuda::KernelChoice small = cuda::choose_kernel(d64, kCapability).choice;
  EXPECT_FALSE(small.producer);
  EXPECT_FALSE(small.pipelined);
  EXPECT_EQ(small.min_blocks, 2);
  EXPECT_EQ(small.threads(), 256);
}

// A bias-like problem for the staged tensor: B 2, H 4, S 128 (kv a multiple of 8).
Problem staging_problem(const std::string& score_mod, TensorDecl bias,
                        Layout layout = Layout::kBSHD, std::int64_t head_dim = 128) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 4;
  desc.seq_len_q = 128;
  desc.seq_len_kv = 128;
  desc.head_dim_qk = head_dim;
  desc.head_dim_v = head_dim;
  desc.dtype = DType::kBF16;
  desc.layout = layout;
  desc.device = Device::kCuda;
  if (layout == Layout::kTHD) {
    desc.cu_seqlens_q = {0, 60, 128};
    desc.cu_seqlens_kv = {0, 60, 128};
    desc.seq_len_q = 0;
    desc.seq_len_kv = 0;
  }
  desc.tensors["bias"] = std::move(bias);
  desc.score_mod = ir::parse(score_mod, desc.scope());
  return Problem(std::move(desc));
}

// Which loads the wgmma forward can stage through shared memory.
TEST(CudaCodegen, StageableTensorsAreDenseQueryKeyTiles) {
  const TensorDecl hqk{DType::kBF16, {4, 128, 128}};
  EXPECT_EQ(cuda::stageable_tensor(staging_problem("score + bias[h, q, kv]", hqk)), "bias");
  EXPECT_EQ(cuda::stageable_tensor(staging_problem("score + bias[b, h, q, kv]",
                                                   TensorDecl{DType::kF16, {2, 4, 128, 128}})),
            "bias");
  EXPECT_EQ(cuda::stageable_tensor(staging_problem("score * bias[h, q, kv] + 1", hqk)), "bias");
  for (const auto& [score_mod, decl, layout] :
       {std::tuple{"score + bias[h, q, kv]", TensorDecl{DType::kF32, {4, 128, 128}},
                   Layout::kBSHD},                                            // 4-byte values
        std::tuple{"score + bias[h, kv, q]", hqk, Layout::kBSHD},             // transposed
        std::tuple{"score + bias[h, q, min(kv + 1, 127)]", hqk, Layout::kBSHD},  // shifted
        std::tuple{"score + bias[h, q, kv]", hqk, Layout::kTHD},              // varlen
        std::tuple{"score + bias[kv % 4, q, kv]", hqk, Layout::kBSHD}}) {     // varying head
    SCOPED_TRACE(score_mod);
    EXPECT_EQ(cuda::stageable_tensor(staging_problem(score_mod, decl, layout)), "");
  }
}

// The staged wgmma forward: two stages without pipelining and the bias tiles in the shared
// memory; the generated code reads the tile when the kernel passes one, and compiles for sm_90a.
TEST(CudaForwardCompile, StagedTensorCompilesForSm90a) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  for (const std::int64_t head_dim : {64, 128}) {
    SCOPED_TRACE(head_dim);
    const Problem problem =
        staging_problem("score + bias[h, q, kv]", TensorDecl{DType::kBF16, {4, 128, 128}},
                        Layout::kBSHD, head_dim);
    cuda::KernelChoice choice = cuda::choose_kernel(problem, kCapability).choice;
    ASSERT_EQ(choice.kind, cuda::KernelKind::kWgmma);
    choice.take_turns = choice.pipelined;
    ASSERT_EQ(cuda::stage_wgmma_tensor(choice), "");
    EXPECT_TRUE(choice.stage_tensor);
    EXPECT_FALSE(choice.pipelined);
    EXPECT_FALSE(choice.take_turns);
    EXPECT_EQ(choice.stages, 2);
    const int h = static_cast<int>(head_dim);
    const int n = head_dim == 64 ? 64 : 128;  // keys per tile
    const int blocks = head_dim == 64 ? 2 : 1;  // per multiprocessor
    EXPECT_EQ(choice.block_n, n);
    EXPECT_EQ(choice.min_blocks, blocks);
    EXPECT_EQ(choice.shared_bytes, 1024 + 128 * h * 2 + 2 * (n * 2 * h * 2 + 128 * n * 2));
    EXPECT_NE(choice.config_type().find(fmt::format(", false, 2, {}, true>", blocks)),
              std::string::npos)
        << choice.config_type();
    // The unstaged fallback: the same shape without the tile.
    const cuda::KernelChoice unstaged = cuda::without_staged_tensor(choice);
    EXPECT_FALSE(unstaged.stage_tensor);
    EXPECT_EQ(unstaged.block_n, n);
    EXPECT_EQ(unstaged.shared_bytes, 1024 + 128 * h * 2 + 2 * n * 2 * h * 2);
    EXPECT_NE(choice.describe().find("staged in shared memory"), std::string::npos);
    const std::string source = cuda::generate_translation_unit(
        problem, cuda::bind_modifier(problem).bindings, choice, nullptr);
    const std::string generated = source.substr(source.find("// ---- generated"));
    for (const char* fragment :
         {"staged != nullptr ? staged_bf16(*staged) : load_tensor_bf16(",
          "kStagedTensor = 0;", "kStagedRowStride = 128LL;", "staged_origin("}) {
      EXPECT_NE(generated.find(fragment), std::string::npos) << fragment << "\n" << generated;
    }
    expect_compiles(source, "staged.cu", kCapability, choice.architecture_suffix());
  }
  // The mma.sync kernel (no sm_90) never stages: its generated code has no staged read.
  const Problem plain =
      staging_problem("score + bias[h, q, kv]", TensorDecl{DType::kBF16, {4, 128, 128}});
  const cuda::KernelChoice mma_sync = cuda::choose_kernel(plain, 0).choice;
  ASSERT_EQ(mma_sync.kind, cuda::KernelKind::kMma);
  const std::string source = cuda::generate_translation_unit(
      plain, cuda::bind_modifier(plain).bindings, mma_sync, nullptr);
  EXPECT_EQ(source.find("staged_bf16(*staged"), std::string::npos);
  EXPECT_NE(source.find("kStagedTensor = -1;"), std::string::npos);
}

// The head-dim-128 wgmma forward compiles for sm_90a with its producer warpgroup and with the
// warpgroups taking turns, hands its registers over (setmaxnreg), launches with the producer's
// threads, and says so.
TEST(CudaForwardCompile, WgmmaProducerTakingTurnsCompilesForSm90a) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  const Problem problem = make_problem(GeneratedCase{"turns", DType::kBF16, 128, 128,
                                                     "30 * tanh(score / 30)", "q >= kv", {}, {},
                                                     Layout::kBSHD, {}});
  cuda::KernelChoice choice = cuda::choose_kernel(problem, kCapability).choice;
  ASSERT_TRUE(choice.pipelined);
  ASSERT_TRUE(choice.producer);
  choice.take_turns = choice.turns_possible();
  EXPECT_NE(choice.describe().find("take turns"), std::string::npos) << choice.describe();
  const std::string source = cuda::generate_translation_unit(
      problem, cuda::bind_modifier(problem).bindings, choice, nullptr);
  EXPECT_NE(source.find("230464, true, 2, 1, false, true>"), std::string::npos);
  EXPECT_NE(source.find("__launch_bounds__(FlexattnConfig::kBlockThreads"), std::string::npos);
  expect_compiles(source, "turns.cu", kCapability, choice.architecture_suffix());
}

// The backward translation units compile for sm_90 (NVRTC, no GPU). These need the backward
// kernels (kernels/backward_mma.cuh and backward_simt.cuh): they fail until those templates exist.
TEST(CudaBackwardCompile, GeneratedBackwardTranslationUnitsCompile) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  const TensorDecl per_head{DType::kF32, {4}};
  const TensorDecl bias{DType::kF32, {4, 100, 77}};
  for (const GeneratedCase& c :
       {GeneratedCase{"bwd_bf16_d64_softcap_alibi_bias", DType::kBF16, 64, 64,
                      "30 * tanh(score / 30) + slopes[h] * (kv - q) + bias[h, q, kv]", "q >= kv",
                      {{"slopes", per_head}, {"bias", bias}}, {}, Layout::kBSHD, {}},
        GeneratedCase{"bwd_fp32_d80_gate", DType::kF32, 80, 80, "score * gate[h]", "",
                      {{"gate", per_head}}, {}, Layout::kBSHD, {}}}) {
    SCOPED_TRACE(c.name);
    const std::string source = cuda_engine()->generated_source(make_backward_problem(c));
    ASSERT_EQ(source.find("not supported"), std::string::npos) << source;
    expect_compiles(source, c.name + ".cu", kCapability);
  }
  // The wgmma backward at head dim 128, softcap and causal, for sm_90a.
  const GeneratedCase wgmma{"bwd_bf16_d128_softcap_wgmma", DType::kBF16, 128, 128,
                            "30 * tanh(score / 30)", "q >= kv", {}, {}, Layout::kBSHD, {}};
  const Problem problem = make_backward_problem(wgmma);
  const cuda::KernelSelection selection = cuda::choose_kernel(problem, kCapability);
  const cuda::BackwardCode code =
      cuda::backward_code(problem, cuda::choose_backward_kernel(problem, kCapability).choice);
  ASSERT_TRUE(code.choice.wgmma);
  const std::string source = cuda::generate_translation_unit(
      problem, cuda::bind_modifier(problem).bindings, selection.choice, &code);
  EXPECT_NE(source.find(code.choice.wgmma_config_type()), std::string::npos) << source;
  expect_compiles(source, wgmma.name + ".cu", kCapability, "a");
}
#endif

#if FLEXATTN_TEST_HAS_NVRTC
// NVRTC as the engine opens it at run time (the library of the toolkit's major version).
template <class Function>
Function nvrtc_function(const char* name) {
  static void* const handle =
      dlopen(("libnvrtc.so." + std::to_string(CUDA_VERSION / 1000)).c_str(), RTLD_NOW);
  return handle == nullptr ? nullptr : reinterpret_cast<Function>(dlsym(handle, name));
}

// Compiles like the engine does (kernel_cache.cpp) and returns NVRTC's log on failure.
std::string compile_errors(const std::string& source, const std::string& name) {
  const auto create = nvrtc_function<decltype(&nvrtcCreateProgram)>("nvrtcCreateProgram");
  const auto compile = nvrtc_function<decltype(&nvrtcCompileProgram)>("nvrtcCompileProgram");
  const auto log_size = nvrtc_function<decltype(&nvrtcGetProgramLogSize)>("nvrtcGetProgramLogSize");
  const auto get_log = nvrtc_function<decltype(&nvrtcGetProgramLog)>("nvrtcGetProgramLog");
  const auto destroy = nvrtc_function<decltype(&nvrtcDestroyProgram)>("nvrtcDestroyProgram");
  if (!create || !compile || !log_size || !get_log || !destroy) return "NVRTC not loaded";
  nvrtcProgram program = nullptr;
  if (create(&program, source.c_str(), name.c_str(), 0, nullptr, nullptr) != NVRTC_SUCCESS) {
    return "nvrtcCreateProgram failed";
  }
  const char* options[] = {kArchitecture, "-std=c++17"};
  const nvrtcResult result = compile(program, 2, options);
  std::string log;
  std::size_t size = 0;
  log_size(program, &size);
  log.resize(size);
  if (size > 0) get_log(program, log.data());
  destroy(&program);
  return result == NVRTC_SUCCESS ? std::string() : log;
}

TEST(CudaCodegen, GeneratedSourcesCompileWithNvrtc) {
  SKIP_WITHOUT_CUDA_ENGINE();
  const auto engine = cuda_engine();
  for (const GeneratedCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::string source = engine->generated_source(make_problem(c));
    const std::string errors = compile_errors(source, c.name + ".cu");
    EXPECT_TRUE(errors.empty()) << errors << "\n" << source.substr(source.find("// ---- generated"));
  }
}
#endif

}  // namespace
}  // namespace flexattn
