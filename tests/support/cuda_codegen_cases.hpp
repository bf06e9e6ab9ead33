// Problems and helpers shared by the cuda engine's code-generation tests (test_cuda_codegen,
// test_cuda_kernel_choice, test_cuda_compile): a spread of modifiers, dtypes, head dims and
// layouts as small problems, and pieces of the generated source. Public API only.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flexattn/flexattn.hpp"

namespace flexattn::test {

// The built-in cuda engine, null in builds without it.
inline std::shared_ptr<const Engine> cuda_engine() {
  for (const std::shared_ptr<const Engine>& engine : builtin_engines()) {
    if (engine->name() == "cuda") return engine;
  }
  return nullptr;
}

#define SKIP_WITHOUT_CUDA_ENGINE()                                                        \
  do {                                                                                    \
    if (::flexattn::test::cuda_engine() == nullptr) GTEST_SKIP() << "built without CUDA"; \
  } while (false)

// A problem of make_problem's shape with its modifiers.
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

// B 2, heads 4/2 (GQA), lengths 100 and 77 (no tile divides them; thd: two sequences).
inline Problem make_problem(const GeneratedCase& c) {
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

// A spread of modifiers, dtypes, head dims and layouts, each with fragments of its lowering.
inline std::vector<GeneratedCase> cases() {
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

// The same problem wanting gradients.
inline Problem make_backward_problem(const GeneratedCase& c) {
  Problem forward = make_problem(c);
  ProblemDesc desc = forward.desc();
  desc.direction = Direction::kForwardBackward;
  return Problem(std::move(desc));
}

// The generated part of a translation unit, and pieces of it.
inline std::string generated_part(const std::string& source) {
  const std::size_t marker = source.find("// ---- generated");
  return marker == std::string::npos ? source : source.substr(marker);
}
inline std::string between(const std::string& text, const std::string& from,
                           const std::string& to) {
  const std::size_t begin = text.find(from);
  if (begin == std::string::npos) return {};
  const std::size_t end = text.find(to, begin + from.size());
  return text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// The body of one generated function, from its name to the closing brace of its definition.
inline std::string function_body(const std::string& source, const std::string& name) {
  const std::size_t start = source.find(" " + name + "(", source.find("// ---- generated"));
  if (start == std::string::npos) return {};
  return source.substr(start, source.find("\n  }\n", start) - start);
}

// A problem that wants gradients, without modifiers, for the backward's kernel choice.
inline Problem backward_problem_with(DType dtype, std::int64_t head_dim_qk,
                                     std::int64_t head_dim_v) {
  GeneratedCase c{"choice", dtype, head_dim_qk, head_dim_v, "", "", {}, {}, Layout::kBSHD, {}};
  return make_backward_problem(c);
}

// A bias-like problem for the staged tensor: B 2, H 4, S 128 (kv a multiple of 8).
inline Problem staging_problem(const std::string& score_mod, TensorDecl bias,
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

}  // namespace flexattn::test
