// The cuda engine's code generation, on the CPU: the generated CUDA for a spread of modifiers,
// dtypes, head dims and layouts contains the lowering of each IR feature and compiles with NVRTC
// for sm_90 (NVRTC needs no GPU). Skipped in builds without CUDA.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

#if __has_include(<nvrtc.h>)
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
       Layout::kBHSD, {"tanhf(", "kHasMask = true", "HalfTag", "forward_mma"}},
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

TEST(CudaCodegen, BackwardAndFloat64AreRefusedWithAReason) {
  SKIP_WITHOUT_CUDA_ENGINE();
  GeneratedCase plain{"plain", DType::kF64, 64, 64, "", "", {}, {}, Layout::kBSHD, {}};
  const std::string source = cuda_engine()->generated_source(make_problem(plain));
  EXPECT_NE(source.find("not supported"), std::string::npos) << source;
}

#if FLEXATTN_TEST_HAS_NVRTC
// NVRTC as the engine links it (found in the process, so builds without the cuda engine, which
// skip this test, need not link NVRTC).
template <class Function>
Function nvrtc_function(const char* name) {
  return reinterpret_cast<Function>(dlsym(RTLD_DEFAULT, name));
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
