// The cuda engine's plan proof (src/engines/cuda/source_proof.hpp), on the CPU: the generated
// Modifier source of every catalogue modifier and mask, forward and backward, bf16 (tensor-core
// functions) and fp32 (simt), for the portable kernels and sm_90's, is lifted and proven; every
// applicable mutation of that text (an operation dropped, a literal changed, the operands of a
// non-commutative operation swapped, the mask dropped, a derivative replaced by 1) is refused;
// and the hashes a plan reports are the proof's. Skipped in builds without CUDA.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flexattn/flexattn.hpp"

#if FLEXATTN_HAVE_CUDA
#include "engines/cuda/codegen.hpp"
#include "engines/cuda/source_proof.hpp"
#include "engines/cuda/tile_plan.hpp"
#endif

namespace flexattn {
namespace {

#if FLEXATTN_HAVE_CUDA

struct ProofCase {
  std::string score_mod, mask_mod;
  DType dtype;
  bool backward;
  Layout layout = Layout::kBSHD;
  std::string name() const {
    return fmt::format("[{}] [{}] {}{}{}", score_mod, mask_mod, to_string(dtype),
                       backward ? " backward" : "", layout == Layout::kTHD ? " thd" : "");
  }
};

// The tensors the modifiers below read, each of the shape its indices need.
std::map<std::string, TensorDecl> tensors_for(const std::string& text) {
  const std::map<std::string, TensorDecl> all = {{"bias", {DType::kBF16, {4, 100, 80}}},
                                                 {"slopes", {DType::kF32, {4}}},
                                                 {"rel", {DType::kF32, {4, 129}}},
                                                 {"gate", {DType::kF16, {4}}},
                                                 {"g", {DType::kF32, {4}}},
                                                 {"gk", {DType::kF32, {4, 80}}},
                                                 {"docq", {DType::kI64, {100}}},
                                                 {"dockv", {DType::kI32, {80}}}};
  std::map<std::string, TensorDecl> used;
  for (const auto& [name, decl] : all) {
    if (text.find(name + "[") != std::string::npos) used.emplace(name, decl);
  }
  return used;
}

Problem make_problem(const ProofCase& c) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = 100;
  desc.seq_len_kv = 80;
  desc.head_dim_qk = 64;
  desc.dtype = c.dtype;
  desc.layout = c.layout;
  desc.device = Device::kCuda;
  desc.direction = c.backward ? Direction::kForwardBackward : Direction::kForward;
  desc.tensors = tensors_for(c.score_mod + " " + c.mask_mod);
  if (c.score_mod.find("gain") != std::string::npos) desc.params["gain"] = 0.7;
  if (c.layout == Layout::kTHD) {
    // Lengths (30, 70) x (75, 5): kv - q + 64 leaves [0, 128] at both ends.
    desc.cu_seqlens_q = {0, 30, 100};
    desc.cu_seqlens_kv = {0, 75, 80};
    desc.seq_len_q = 0;
    desc.seq_len_kv = 0;
  }
  if (!c.score_mod.empty()) desc.score_mod = ir::parse(c.score_mod, desc.scope());
  if (!c.mask_mod.empty()) desc.mask_mod = ir::parse(c.mask_mod, desc.scope());
  return Problem(std::move(desc));
}

// The conformance catalogue's score modifiers and masks (src/check/catalogue.cpp), the code
// generation tests' features, and the named catalogue (softcap, ALiBi, T5 buckets, ...).
const std::vector<std::string> kScoreMods = {
    "",
    "30 * tanh(score / 30)",
    "5 * tanh(score / 5)",
    "0.8 * tanh(score / 0.8)",
    "score + bias[h, q, kv]",
    "score + slopes[h] * (kv - q)",
    "score + rel[h, clamp(kv - q + 64, 0, 128)]",
    "score * sigmoid(gate[h])",
    "where(score > 0, score * 0.5, score * 2 + 0.25 * float(kv % 3))",
    "where(kv % 5 == 3, -inf, score)",
    "score + float(kv - q) * exp2(-float(h + 1))",
    "score + log(float(kv + 1)) * sqrt(float(h + 1)) * 0.5",
    "score * score * 0.25",
    "score * sigmoid(score)",
    "1 / score",
    "score * g[h]",
    "score + gk[h, kv]",
    "gk[h, kv]",
    "score + bias[h, q, kv] * gk[h, kv]",
    "where(kv % 5 == 3, -inf, score * gain)",
    "score * sigmoid(gate[h]) + log2(1 + exp2(abs(score))) - sqrt(rsqrt(4.0)) + floor(score) + "
    "int(score)",
    "(score + float(kv - q) * slopes[h]) * 0.5 - max(score, -2) / 3",
};
const std::vector<std::string> kMasks = {
    "",
    "q >= kv",
    "q + (KV_LEN - Q_LEN) >= kv",
    "q >= kv && q - kv < 24",
    "docq[q] == dockv[kv]",
    "kv < 8 || q >= kv",
    "q % 4 != 1 && kv <= q + 3",
    "!(kv < 8) || q >= kv",
};

// Each score modifier with one mask in turn (every mask several times), bf16 and fp32, forward
// and backward; the relative bias also in thd.
std::vector<ProofCase> proof_cases() {
  std::vector<ProofCase> cases;
  for (std::size_t i = 0; i < kScoreMods.size(); ++i) {
    const std::string& mask = kMasks[i % kMasks.size()];
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      for (bool backward : {false, true}) cases.push_back({kScoreMods[i], mask, dtype, backward});
    }
  }
  cases.push_back({"score + rel[h, clamp(kv - q + 64, 0, 128)]", "q + (KV_LEN - Q_LEN) >= kv",
                   DType::kBF16, true, Layout::kTHD});
  return cases;
}

// What lower_problem (cuda_engine.cpp) generates for `capability`: the kernel choice, the staged
// tensor where the wgmma forward stages one, the backward's derivatives. Empty when unsupported.
struct Generated {
  std::string source;
  cuda::ModifierBindings bindings;
};
std::optional<Generated> generate(const Problem& problem, int capability) {
  cuda::KernelSelection selection = cuda::choose_kernel(problem, capability);
  if (!selection.reason.empty()) return std::nullopt;
  cuda::KernelChoice choice = selection.choice;
  if (!cuda::stageable_tensor(problem).empty()) {
    cuda::KernelChoice staged = choice;
    if (cuda::stage_wgmma_tensor(staged).empty() && staged.stage_tensor) choice = staged;
  }
  const cuda::BindingSelection binding = cuda::bind_modifier(problem);
  if (!binding.reason.empty()) return std::nullopt;
  std::optional<cuda::BackwardCode> backward;
  if (problem.wants_backward()) {
    const cuda::BackwardSelection selected = cuda::choose_backward_kernel(problem, capability);
    if (!selected.reason.empty()) return std::nullopt;
    backward = cuda::backward_code(problem, selected.choice);
  }
  return Generated{cuda::generate_modifier_source(problem, binding.bindings, choice,
                                                  backward ? &*backward : nullptr),
                   binding.bindings};
}

// ---- mutations of the generated text ---------------------------------------------------------

struct Mutant {
  std::string description;
  std::string source;
};

// The part of the text that is the Modifier struct (mutations stay inside it).
std::pair<std::size_t, std::size_t> modifier_span(const std::string& source) {
  const std::size_t begin = source.find("struct Modifier {");
  const std::size_t end = source.find("\n};\n", begin);
  return {begin, end};
}

// The end of the call whose '(' is at `open`, and the positions of its top-level commas.
std::size_t matching_paren(const std::string& text, std::size_t open,
                           std::vector<std::size_t>& commas) {
  int depth = 0;
  for (std::size_t i = open; i < text.size(); ++i) {
    if (text[i] == '(') ++depth;
    if (text[i] == ')' && --depth == 0) return i;
    if (text[i] == ',' && depth == 1) commas.push_back(i);
  }
  return std::string::npos;
}

bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }

// The functions whose call an operation-drop replaces by an operand, and those whose first two
// operands do not commute.
const std::vector<std::string> kDroppable = {
    "ir_add",        "ir_sub",   "ir_mul",     "ir_div",
    "ir_mod",        "ir_min",   "ir_max",     "ir_clamp",
    "ir_neg",        "ir_abs",   "ir_sigmoid", "ir_tanh",
    "ir_tanh_small", "ir_rsqrt", "ir_to_int",  "ir_small_int_to_float",
    "tanhf",         "expf",     "exp2f",      "logf",
    "log2f",         "sqrtf",    "floorf"};
const std::vector<std::string> kNonCommutative = {"ir_sub", "ir_div", "ir_mod", "ir_clamp"};

std::vector<Mutant> mutants(const std::string& source) {
  std::vector<Mutant> result;
  // Named copies, not a structured binding: Clang before 16 cannot capture one in a lambda.
  const std::pair<std::size_t, std::size_t> span = modifier_span(source);
  const std::size_t begin = span.first, end = span.second;
  const auto add = [&](std::string description, std::size_t from, std::size_t to,
                       const std::string& replacement) {
    std::string mutated = source;
    mutated.replace(from, to - from, replacement);
    if (mutated == source) return;  // the mask already true, the derivative already 1
    result.push_back({std::move(description), std::move(mutated)});
  };
  for (std::size_t i = begin; i < end; ++i) {
    if (source.compare(i, 2, "//") == 0) {  // comments are not code
      i = source.find('\n', i);
      continue;
    }
    if (is_name_char(source[i]) && (i == 0 || !is_name_char(source[i - 1]))) {
      std::size_t name_end = i;
      while (is_name_char(source[name_end])) ++name_end;
      const std::string name = source.substr(i, name_end - i);
      if (source[name_end] == '(' &&
          std::find(kDroppable.begin(), kDroppable.end(), name) != kDroppable.end()) {
        std::vector<std::size_t> commas;
        const std::size_t close = matching_paren(source, name_end, commas);
        std::vector<std::string> operands;
        std::size_t start = name_end + 1;
        for (std::size_t comma : commas) {
          operands.push_back(source.substr(start, comma - start));
          start = comma + 2;
        }
        operands.push_back(source.substr(start, close - start));
        for (std::size_t k = 0; k < std::min<std::size_t>(operands.size(), 2); ++k) {
          add(fmt::format("drop {} at {} (keep operand {})", name, i, k), i, close + 1,
              "(" + operands[k] + ")");
        }
        if (operands.size() >= 2 && std::find(kNonCommutative.begin(), kNonCommutative.end(),
                                              name) != kNonCommutative.end()) {
          // ir_clamp(x, lo, hi) is max(x, lo) first, where x and lo commute: lo and hi swap.
          const std::size_t first = name == "ir_clamp" ? 1 : 0;
          std::swap(operands[first], operands[first + 1]);
          std::string swapped = name + "(" + operands[0];
          for (std::size_t k = 1; k < operands.size(); ++k) swapped += ", " + operands[k];
          add(fmt::format("swap the operands of {} at {}", name, i), i, close + 1, swapped + ")");
        }
      }
      i = name_end - 1;
      continue;
    }
    // A float literal `(0x...f)`: halved (1 where it is 0).
    if (source.compare(i, 3, "(0x") == 0) {
      const std::size_t close = source.find("f)", i);
      const double value = std::strtod(source.substr(i + 1, close - i - 1).c_str(), nullptr);
      add(fmt::format("change the literal {} at {}", value, i), i, close + 2,
          fmt::format("({:a}f)", value == 0.0 ? 1.0f : static_cast<float>(value * 0.5)));
      i = close + 1;
      continue;
    }
    // An integer literal of an expression (not an array index): plus one.
    if (std::isdigit(static_cast<unsigned char>(source[i])) != 0 && source[i - 1] != '[' &&
        !is_name_char(source[i - 1])) {
      std::size_t digits_end = i;
      while (std::isdigit(static_cast<unsigned char>(source[digits_end])) != 0) ++digits_end;
      const std::size_t line_start = source.rfind('\n', i) + 1;
      const std::string line = source.substr(line_start, source.find('\n', i) - line_start);
      const bool expression = line.find(" = ") != std::string::npos ||
                              line.find("return") != std::string::npos ||
                              line.find("add_fixed(") != std::string::npos;
      if (expression && !is_name_char(source[digits_end]) && source[digits_end] != ']' &&
          line.find("static constexpr") == std::string::npos) {
        const long long value = std::stoll(source.substr(i, digits_end - i));
        add(fmt::format("change the integer {} at {}", value, i), i, digits_end,
            std::to_string(value + 1));
      }
      i = digits_end - 1;
      continue;
    }
    // A comparison `(a OP b)` with OP ordered: operands swapped.
    for (const char* op : {" < ", " <= ", " > ", " >= "}) {
      const std::string symbol(op);
      if (source.compare(i, symbol.size(), symbol) != 0) continue;
      const std::size_t open = source.rfind('(', i);
      std::vector<std::size_t> commas;
      const std::size_t close = matching_paren(source, open, commas);
      if (close == std::string::npos || close < i || !commas.empty()) break;
      const std::string left = source.substr(open + 1, i - open - 1);
      const std::string right = source.substr(i + symbol.size(), close - i - symbol.size());
      if (left.find_first_of("()?") != std::string::npos ||
          right.find_first_of("()?") != std::string::npos) {
        break;
      }
      add(fmt::format("swap the operands of{}at {}", op, i), open, close + 1,
          "(" + right + op + left + ")");
      break;
    }
    // A ternary `(c ? a : b)`: branches swapped.
    if (source.compare(i, 3, " ? ") == 0) {
      const std::size_t colon = source.find(" : ", i);
      const std::size_t open = source.rfind('(', i);
      std::vector<std::size_t> commas;
      const std::size_t close = matching_paren(source, open, commas);
      if (colon < close) {
        const std::string yes = source.substr(i + 3, colon - i - 3);
        const std::string no = source.substr(colon + 3, close - colon - 3);
        add(fmt::format("swap the branches of ?: at {}", i), i, close, " ? " + no + " : " + yes);
      }
    }
  }
  // The mask dropped, each derivative replaced by 1.
  const auto replace_return = [&](const std::string& function, const std::string& value) {
    const std::size_t header = source.find(" " + function + "(", begin);
    if (header == std::string::npos || header > end) return;
    const std::size_t statement = source.find("    return ", header);
    const std::size_t stop = source.find(";\n", statement);
    add(fmt::format("{} returns {}", function, value), statement, stop, "    return " + value);
  };
  replace_return("mask_mod", "true");
  // Each tensor gradient's derivative replaced by 1.
  for (std::size_t at = source.find("to_fixed(dlogit * ", begin); at < end;
       at = source.find("to_fixed(dlogit * ", at + 1)) {
    const std::size_t value = at + 18;
    std::vector<std::size_t> commas;
    const std::size_t close = matching_paren(source, at + 8, commas);
    add(fmt::format("the tensor gradient at {} takes 1", at), value, close, "(0x1p+0f)");
  }
  for (const char* function : {"score_grad", "score_grad_from_dot", "score_grad_from_dot_small"}) {
    replace_return(function, "(0x1p+0f)");
  }
  return result;
}

// ---- tests -----------------------------------------------------------------------------------

TEST(CudaPlanProof, EveryGeneratedSourceIsProven) {
  int proven = 0;
  for (const ProofCase& c : proof_cases()) {
    const Problem problem = make_problem(c);
    for (int capability : {0, 90}) {
      const std::optional<Generated> generated = generate(problem, capability);
      if (!generated) continue;
      const cuda::SourceProof proof =
          cuda::prove_modifier_source(problem, generated->bindings, generated->source);
      EXPECT_TRUE(proof.proven) << c.name() << " sm_" << capability << ": " << proof.failure;
      proven += proof.proven ? 1 : 0;
    }
  }
  // bf16 and fp32, forward and backward, of every modifier, on both kinds of kernels.
  EXPECT_GE(proven, static_cast<int>(proof_cases().size()) * 3 / 2);
}

TEST(CudaPlanProof, EveryMutationIsRefused) {
  int applied = 0;
  for (const ProofCase& c : proof_cases()) {
    const Problem problem = make_problem(c);
    for (int capability : {0, 90}) {
      const std::optional<Generated> generated = generate(problem, capability);
      if (!generated) continue;
      for (const Mutant& mutant : mutants(generated->source)) {
        ++applied;
        const cuda::SourceProof proof =
            cuda::prove_modifier_source(problem, generated->bindings, mutant.source);
        EXPECT_FALSE(proof.proven)
            << c.name() << " sm_" << capability << ": " << mutant.description << " is not refused";
      }
    }
  }
  EXPECT_GT(applied, 1000);
}

TEST(CudaPlanProof, PlanReportsTheHashesOfItsProof) {
  for (const ProofCase& c : proof_cases()) {
    const Problem problem = make_problem(c);
    for (int capability : {0, 80, 90}) {
      if (!generate(problem, capability)) continue;
      // What the cuda engine's plan() sets in PlanInfo, from the same lowering and proof.
      const cuda::ProofHashes hashes = cuda::plan_proof_hashes(problem, capability);
      PlanInfo info;
      info.engine = "cuda";
      info.lowered_hash = hashes.lowered_hash;
      info.lowered_backward_hash = hashes.lowered_backward_hash;
      EXPECT_EQ(plan_proof_failure(info, problem), "") << c.name() << " sm_" << capability;
      EXPECT_EQ(hashes.lowered_hash, problem.modifier_hash());
      EXPECT_EQ(hashes.lowered_backward_hash, problem.backward_hash());
    }
  }
}

TEST(CudaPlanProof, AnUnprovenSourceGivesHashesThatMatchNothing) {
  const Problem problem = make_problem({"30 * tanh(score / 30)", "q >= kv", DType::kBF16, true});
  const std::optional<Generated> generated = generate(problem, 90);
  ASSERT_TRUE(generated);
  std::string source = generated->source;
  const std::size_t tanh = source.find("ir_tanh(");
  ASSERT_NE(tanh, std::string::npos);
  source.replace(tanh, 8, "ir_sigmoid(");
  const cuda::SourceProof proof = cuda::prove_modifier_source(problem, generated->bindings, source);
  EXPECT_FALSE(proof.proven);
  EXPECT_NE(proof.failure.find("score_mod_log2"), std::string::npos) << proof.failure;
  const cuda::ProofHashes hashes = cuda::proof_hashes(problem, proof);
  PlanInfo info;
  info.engine = "cuda";
  info.lowered_hash = hashes.lowered_hash;
  info.lowered_backward_hash = hashes.lowered_backward_hash;
  EXPECT_NE(plan_proof_failure(info, problem), "");
  // Text the generator never emits proves nothing.
  std::string extra = generated->source;
  extra.insert(extra.find("  static constexpr bool kHasMask"), "  int counter = 0;\n");
  const cuda::SourceProof refused =
      cuda::prove_modifier_source(problem, generated->bindings, extra);
  EXPECT_FALSE(refused.proven);
  EXPECT_NE(refused.failure.find("does not lift"), std::string::npos) << refused.failure;
}

#endif

}  // namespace
}  // namespace flexattn
