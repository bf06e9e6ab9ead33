#include "engines/cuda/codegen.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engines/cuda/codegen_backward.hpp"
#include "engines/cuda/graph_lowering.hpp"
#include "engines/cuda/kernel_sources.hpp"
#include "engines/cuda/kernels/params.cuh"
#include "flexattn/error.hpp"

namespace flexattn::cuda {
namespace {

// stageable_tensor's load node in score_mod, or -1.
std::int32_t stageable_load(const Problem& problem) {
  if (problem.layout() == Layout::kTHD) return -1;
  const Graph& graph = problem.score_mod();
  const ModifierBindings no_bindings;  // only which nodes vary per element is asked
  const GraphLowering lowering(graph, "s", problem, no_bindings);
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    const GraphNode& node = graph.nodes()[i];
    if (node.op != Op::kLoad) continue;
    const auto decl = problem.desc().tensors.find(node.name);
    if (decl == problem.desc().tensors.end()) continue;
    const std::vector<std::int64_t>& shape = decl->second.shape;
    const std::size_t rank = shape.size();
    if ((decl->second.dtype != DType::kBF16 && decl->second.dtype != DType::kF16) || rank < 2 ||
        node.args.size() != rank || graph.node(node.args[rank - 1]).op != Op::kKey ||
        graph.node(node.args[rank - 2]).op != Op::kQuery ||
        shape[rank - 1] != problem.seq_len_kv() || shape[rank - 2] != problem.seq_len_q() ||
        shape[rank - 1] % 8 != 0) {
      continue;
    }
    bool invariant_rest = true;
    for (std::size_t k = 0; k + 2 < rank; ++k) {
      invariant_rest = invariant_rest && !lowering.varies(static_cast<std::size_t>(node.args[k]));
    }
    if (invariant_rest) return static_cast<std::int32_t>(i);
  }
  return -1;
}

}  // namespace

std::string stageable_tensor(const Problem& problem) {
  const std::int32_t index = stageable_load(problem);
  return index < 0 ? std::string() : problem.score_mod().node(index).name;
}

BindingSelection bind_modifier(const Problem& problem) {
  BindingSelection selection;
  std::set<std::string> tensors;
  std::set<std::string> params;
  for (const Graph* graph : {&problem.score_mod(), &problem.mask_mod()}) {
    for (const std::string& name : graph->tensors()) tensors.insert(name);
    for (const std::string& name : graph->params()) params.insert(name);
  }
  selection.bindings.tensors.assign(tensors.begin(), tensors.end());
  selection.bindings.params.assign(params.begin(), params.end());
  if (tensors.size() > static_cast<std::size_t>(flexattn_kernels::kMaxTensors)) {
    selection.reason = fmt::format("the modifiers read {} tensors; the kernel takes at most {}",
                                   tensors.size(), flexattn_kernels::kMaxTensors);
  } else if (params.size() > static_cast<std::size_t>(flexattn_kernels::kMaxParams)) {
    selection.reason = fmt::format("the modifiers read {} parameters; the kernel takes at most {}",
                                   params.size(), flexattn_kernels::kMaxParams);
  }
  return selection;
}

// The widest logit range (log2 units) for which the forward's softmax fixes its reference after
// a row's first tile (at a logit of the row): P = exp2(logit - reference) then stays a normal
// number of fp32's (and bf16's) exponent range, far from the 2^-126 where ex2.approx.ftz flushes
// to 0, and a row sum of 2^31 terms up to 2^96 stays below fp32's 2^128.
constexpr double kStaticReferenceSpan = 96.0;

// kStaticReference (forward_mma.cuh, bounded_softmax_probabilities): no running row max after a
// row's first tile, when score_mod's interval over the problem (the score unbounded) is finite
// and at most kStaticReferenceSpan wide in log2 units, e.g. a softcap (30 tanh(score / 30) lies
// in [-30, 30]: 86.6 log2 units); kStaticReferenceLog2 is its top. Not for fp16, whose P (stored
// as fp16 for P V) would underflow below 2^-24.
std::string static_reference_members(const Problem& problem) {
  const Graph& graph = problem.score_mod();
  const Interval range =
      node_intervals(graph, problem.leaf_ranges())[static_cast<std::size_t>(graph.root())];
  const double lo = range.lo * std::numbers::log2e;
  const double hi = range.hi * std::numbers::log2e;
  const bool fixed = problem.dtype() != DType::kF16 && std::isfinite(lo) && std::isfinite(hi) &&
                     hi - lo <= kStaticReferenceSpan;
  std::string text = fmt::format("  static constexpr bool kStaticReference = {};\n", fixed);
  text += fmt::format("  static constexpr float kStaticReferenceLog2 = {};{}\n",
                      fixed ? float_literal(hi) : "0.0f",
                      fixed ? fmt::format("  // logits in [{}, {}]", range.lo, range.hi) : "");
  return text;
}

namespace {

// The namespace flexattn_generated with the Modifier struct of the problem's score_mod and
// mask_mod (the part source_lift.cpp reads back); `stage_tensor`: KernelChoice::stage_tensor.
std::string modifier_struct_source(const Problem& problem, const ModifierBindings& bindings,
                                   bool stage_tensor, const BackwardCode* backward) {
  if (problem.wants_backward() != (backward != nullptr)) {
    throw_internal("cuda codegen: backward code must be given exactly when gradients are wanted");
  }
  const GraphLowering score(problem.score_mod(), "s", problem, bindings);
  const GraphLowering mask(problem.mask_mod(), "m", problem, bindings);
  std::string fields;
  std::string assignments;
  score.emit_invariants(fields, assignments);
  mask.emit_invariants(fields, assignments);
  std::string score_body;
  const std::string score_value = score.emit_varying(score_body);
  GraphLowering score_log2(problem.score_mod(), "s", problem, bindings);
  std::string staged_members = "  static constexpr int kStagedTensor = -1;\n";
  if (stage_tensor) {
    const std::int32_t staged = stageable_load(problem);
    if (staged < 0) throw_internal("cuda codegen: a staged tensor without a stageable load");
    staged_members = score_log2.stage_load(static_cast<std::size_t>(staged));
  }
  SmallTanh score_small;
  const std::string score_log2_body =
      score_log2.emit_from_dot(fields, assignments, true, &score_small);
  // The forward's logit (score_mod_forward): score_mod_log2, or the natural-units function when
  // log2 e costs it per-element multiplies that the natural one does not have (a bias: `dot *
  // (scale log2 e) + bias * log2 e` against `dot * scale + bias`, one FMA); the softmax then
  // takes log2 e in its exp2 argument, an FMA in place of the subtraction (kForwardToLog2).
  // Not with small-tanh functions (they are of score_mod_log2).
  std::string forward_members =
      "  static constexpr float kForwardToLog2 = 1.0f;\n"
      "  __device__ static __forceinline__ float score_mod_forward(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv, "
      "const StagedElement* staged) {\n"
      "    return score_mod_log2(inv, p, at, dot, q, kv, staged);\n  }\n";
  if (!problem.score_mod().is_identity_score() && score_log2.factor_multiplies() > 0 &&
      !(score_small.has_tanh && score_small.possible)) {
    GraphLowering score_natural(problem.score_mod(), "s", problem, bindings);
    if (stage_tensor) {
      const auto staged = static_cast<std::size_t>(stageable_load(problem));
      static_cast<void>(score_natural.stage_load(staged));
    }
    std::string natural_fields = fields;
    std::string natural_assignments = assignments;
    const std::string natural_body =
        score_natural.emit_from_dot(natural_fields, natural_assignments, false);
    if (score_natural.factor_multiplies() < score_log2.factor_multiplies()) {
      fields = std::move(natural_fields);
      assignments = std::move(natural_assignments);
      forward_members =
          "  static constexpr float kForwardToLog2 = kLog2e;\n"
          "  // score_mod(dot * scale), constant multiplications merged (natural units)\n"
          "  __device__ static __forceinline__ float score_mod_forward(const Invariants& inv, "
          "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv, "
          "[[maybe_unused]] const StagedElement* staged) {\n" +
          natural_body + "  }\n";
    }
  }
  std::string mask_body;
  const std::string mask_value = mask.emit_varying(mask_body);
  SmallTanh derivative_small;
  std::string backward_text =
      backward != nullptr
          ? backward_members(problem, bindings, *backward, fields, assignments, derivative_small)
          : std::string();
  // The small-tanh variants (kSmallTanh), decided by score_mod alone (the forward's source is
  // the same with or without the backward): offered when it computes a tanh and every tanh
  // argument has a known bound. The derivative's variant has its tanh in the small form when its
  // arguments are covered by the same condition (softcap: the same argument), else it is the
  // derivative unchanged, which is exact at any bound.
  const bool small_tanh = score_small.has_tanh && score_small.possible;
  if (small_tanh && backward != nullptr) {
    const bool covered = derivative_small.possible && derivative_small.covered_by(score_small);
    backward_text +=
        "  __device__ static __forceinline__ float score_grad_from_dot_small("
        "const Invariants& inv, const ForwardParams& p, const Coordinates& at, float dot, "
        "int q, int kv) {\n" +
        (covered ? derivative_small.body : derivative_small.unchanged) + "  }\n";
  }

  std::string text = "// ---- generated by flexattn's cuda engine ----\n";
  text += "namespace flexattn_generated {\nusing namespace flexattn_kernels;\n\n";
  text += "struct Modifier {\n";
  text += fmt::format("  static constexpr bool kIdentityScore = {};\n",
                      problem.score_mod().is_identity_score());
  text += fmt::format("  static constexpr bool kHasMask = {};\n",
                      !keeps_everything(problem.mask_mod()));
  text += "  struct Invariants {\n" + fields + "  };\n";
  text +=
      "  __device__ static __forceinline__ Invariants prepare(const ForwardParams& p, "
      "const Coordinates& at) {\n    Invariants inv{};\n" +
      assignments + "    return inv;\n  }\n";
  text += fmt::format("  // score_mod: {}\n", problem.score_mod().to_string());
  text +=
      "  __device__ static __forceinline__ float score_mod(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float score, int q, int kv) {\n" +
      score_body + fmt::format("    return {};\n  }}\n", score_value);
  text +=
      "  // score_mod(dot * scale) * log2(e), constant multiplications merged\n"
      "  __device__ static __forceinline__ float score_mod_log2(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv, "
      "[[maybe_unused]] const StagedElement* staged) {\n" +
      score_log2_body + "  }\n";
  text += forward_members;
  text += static_reference_members(problem);
  text += fmt::format("  static constexpr bool kSmallTanh = {};\n", small_tanh);
  if (small_tanh) {
    text +=
        "  // Whether every tanh argument is below kTanhSmallLimit for |dot| <= bound, where\n"
        "  // ir_tanh_small equals ir_tanh: then the _small functions give the same values.\n"
        "  __device__ static __forceinline__ bool tanh_args_small(const Invariants& inv, "
        "const ForwardParams& p, float bound) {\n" +
        fmt::format("    return {};\n  }}\n", score_small.condition());
    text +=
        "  __device__ static __forceinline__ float score_mod_log2_small(const Invariants& inv, "
        "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv, "
        "[[maybe_unused]] const StagedElement* staged) {\n" +
        score_small.body + "  }\n";
  }
  text += staged_members;
  text += fmt::format("  // mask_mod: {}\n", problem.mask_mod().to_string());
  text +=
      "  __device__ static __forceinline__ bool mask_mod(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, int q, int kv) {\n" +
      mask_body + fmt::format("    return {};\n  }}\n", mask_value);
  text += backward_text;
  text += "};\n\n}  // namespace flexattn_generated\n\n";
  return text;
}

}  // namespace

std::string generate_modifier_source(const Problem& problem, const ModifierBindings& bindings,
                                     const KernelChoice& choice, const BackwardCode* backward) {
  std::string text = modifier_struct_source(problem, bindings, choice.stage_tensor, backward);
  text += fmt::format("using FlexattnConfig = {};\n", choice.config_type());
  if (choice.kind == KernelKind::kDecode) {
    // The paged-cache kernel and its split combination (no backward: caches are forward only).
    // (Chunked prefill on the wgmma forward: its launch's threads, a producer's included.)
    text += fmt::format(
        "extern \"C\" __global__ void __launch_bounds__({}) {}(\n"
        "    const flexattn_kernels::DecodeParams params) {{\n"
        "  flexattn_kernels::{}<FlexattnConfig, flexattn_generated::Modifier>(params);\n"
        "}}\n"
        "extern \"C\" __global__ void __launch_bounds__(flexattn_kernels::kDecodeCombineThreads) "
        "{}(\n"
        "    const flexattn_kernels::DecodeParams params) {{\n"
        "  flexattn_kernels::decode_combine<{}, {}>(params);\n}}\n",
        choice.paged_wgmma ? "FlexattnConfig::kBlockThreads, FlexattnConfig::kMinBlocks"
                           : "FlexattnConfig::kThreads",
        kKernelName, choice.kernel_template(), kDecodeCombineName, element_tag(problem.dtype()),
        problem.head_dim_v());
    return text;
  }
  const bool tensor_cores = choice.kind != KernelKind::kSimt;
  const std::string forward_entry = fmt::format(
      "extern \"C\" __global__ void __launch_bounds__(FlexattnConfig::{}{}) {}(\n"
      "    const flexattn_kernels::ForwardParams params) {{\n"
      "  flexattn_kernels::{}<FlexattnConfig, flexattn_generated::Modifier>(params);\n}}\n",
      choice.kind == KernelKind::kWgmma ? "kBlockThreads" : "kThreads",
      tensor_cores ? ", FlexattnConfig::kMinBlocks" : "", kKernelName, choice.kernel_template());
  if (backward == nullptr) return text + forward_entry;
  // The forward's and the backward's modules (kForwardModuleDefine, kBackwardModuleDefine).
  return text + fmt::format("#ifndef {}\n{}#endif\n#ifndef {}\n{}#endif\n", kBackwardModuleDefine,
                            forward_entry, kForwardModuleDefine,
                            backward_entry_points(problem, backward->choice));
}

std::string generate_translation_unit(const Problem& problem, const ModifierBindings& bindings,
                                      const KernelChoice& choice, const BackwardCode* backward) {
  return std::string(kernel_library_source()) + "\n" +
         generate_modifier_source(problem, bindings, choice, backward);
}

std::string generate_repair_translation_unit(const Problem& problem,
                                             const ModifierBindings& bindings,
                                             const BackwardCode* backward) {
  std::string text = std::string(kernel_library_source()) + "\n" +
                     modifier_struct_source(problem, bindings, false, backward);
  const std::string arguments =
      fmt::format("{}, flexattn_generated::Modifier, {}, {}", element_tag(problem.dtype()),
                  problem.head_dim_qk(), problem.head_dim_v());
  text += fmt::format(
      "extern \"C\" __global__ void __launch_bounds__(flexattn_kernels::kRepairThreads) {}(\n"
      "    const flexattn_kernels::ForwardParams params) {{\n"
      "  flexattn_kernels::repair_forward<{}>(params);\n}}\n",
      kRepairForwardName, arguments);
  if (backward == nullptr) return text;
  text += fmt::format(
      "extern \"C\" __global__ void __launch_bounds__(flexattn_kernels::kDeltaThreads) {}(\n"
      "    const flexattn_kernels::BackwardParams params) {{\n"
      "  flexattn_kernels::backward_delta<{}, {}>(params);\n}}\n",
      kBackwardDeltaName, element_tag(problem.dtype()), problem.head_dim_v());
  for (const auto& [name, function] :
       {std::pair{kRepairDqName, "repair_dq"}, std::pair{kRepairDkdvName, "repair_dkdv"}}) {
    text += fmt::format(
        "extern \"C\" __global__ void __launch_bounds__(flexattn_kernels::kRepairThreads) {}(\n"
        "    const flexattn_kernels::BackwardParams params) {{\n"
        "  flexattn_kernels::{}<{}>(params);\n}}\n",
        name, function, arguments);
  }
  return text;
}

}  // namespace flexattn::cuda
