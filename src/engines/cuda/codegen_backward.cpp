#include "engines/cuda/codegen_backward.hpp"

#include <fmt/format.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flexattn/error.hpp"

namespace flexattn::cuda {

std::string backward_members(const Problem& problem, const ModifierBindings& bindings,
                             const BackwardCode& backward, std::string& fields,
                             std::string& assignments, SmallTanh& small) {
  const GraphLowering derivative(backward.score_derivative, "d", problem, bindings);
  derivative.emit_invariants(fields, assignments);
  std::string derivative_body;
  const std::string derivative_value = derivative.emit_varying(derivative_body);
  GraphLowering derivative_dot(backward.score_derivative, "d", problem, bindings);
  const std::string derivative_dot_body =
      derivative_dot.emit_from_dot(fields, assignments, false, &small);

  std::string scatter;  // tensor_grads' body
  std::string flush;    // flush_tensor_grads' body
  int local_slots = 0;
  for (std::size_t n = 0; n < backward.load_derivatives.size(); ++n) {
    const LoadDerivative& load = backward.load_derivatives[n];
    // The modifier is piecewise constant in this load (e.g. it only compares it): nothing to add.
    if (is_constant(load.derivative, 0.0)) continue;
    const std::string accumulator =
        fmt::format("bp.grad_fixed[{}]", slot_of(bindings.tensors, load.tensor));
    std::string body;
    std::vector<std::string> indices;
    bool invariant = true;
    for (std::size_t k = 0; k < load.indices.size(); ++k) {
      const GraphLowering index(load.indices[k], fmt::format("g{}i{}_", n, k), problem, bindings);
      index.emit_invariants(fields, assignments);
      indices.push_back(index.emit_varying(body));
      invariant = invariant && !index.varies();
    }
    const GraphLowering value(load.derivative, fmt::format("g{}d_", n), problem, bindings);
    value.emit_invariants(fields, assignments);
    const std::string value_root = value.emit_varying(body);
    const std::string offset = linear_offset(problem.desc().tensors.at(load.tensor), indices);
    const std::string contribution = fmt::format("to_fixed(dlogit * {})", value_root);
    std::vector<std::string> index_text;
    for (const Graph& index : load.indices) index_text.push_back(index.to_string());
    scatter += fmt::format("    // d score_mod / d {}[{}] = {}\n", load.tensor,
                           fmt::join(index_text, ", "), load.derivative.to_string());
    scatter += fmt::format("    if ({} != nullptr) {{\n", accumulator) + indent(body);
    if (invariant) {
      // The same element for the whole (b, h): summed per thread, then per warp, then added.
      scatter += fmt::format("      local[{}] += {};\n", local_slots, contribution);
      flush += fmt::format(
          "    {{\n      const GradSum sum = warp_sum_fixed(local[{}]);\n"
          "      if ((threadIdx.x % kWarpSize) == 0 && {} != nullptr) add_fixed({} + {}, sum);\n"
          "    }}\n",
          local_slots, accumulator, accumulator, offset);
      ++local_slots;
    } else {
      scatter += fmt::format("      add_fixed({} + {}, {});\n", accumulator, offset, contribution);
    }
    scatter += "    }\n";
  }

  std::string text;
  text += fmt::format("  static constexpr bool kIdentityDerivative = {};\n",
                      is_constant(backward.score_derivative, 1.0));
  // Whether d score_mod / d score is finite at every finite score (its interval over the problem,
  // the score unbounded, has finite ends): then an element whose dlogit is 0 (masked, or P = 0)
  // gets 0 from the product alone, without the kernels' select against 0 * inf.
  const Interval derivative_range = node_intervals(
      backward.score_derivative,
      problem.leaf_ranges())[static_cast<std::size_t>(backward.score_derivative.root())];
  text += fmt::format("  static constexpr bool kBoundedDerivative = {};\n",
                      std::isfinite(derivative_range.lo) && std::isfinite(derivative_range.hi));
  text += fmt::format("  static constexpr bool kHasTensorGrads = {};\n", !scatter.empty());
  // At least one slot: a C++ array cannot be empty.
  text += fmt::format("  static constexpr int kLocalGradSlots = {};\n", std::max(local_slots, 1));
  text += fmt::format("  // d score_mod / d score: {}\n", backward.score_derivative.to_string());
  text +=
      "  __device__ static __forceinline__ float score_grad(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float score, int q, int kv) {\n" +
      derivative_body + fmt::format("    return {};\n  }}\n", derivative_value);
  text +=
      "  // score_grad(dot * scale), constant multiplications merged\n"
      "  __device__ static __forceinline__ float score_grad_from_dot(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv) {\n" +
      derivative_dot_body + "  }\n";
  text +=
      "  __device__ static __forceinline__ void tensor_grads(const Invariants& inv, "
      "const BackwardParams& bp, const Coordinates& at, float score, int q, int kv, "
      "float dlogit, GradSum (&local)[kLocalGradSlots]) {\n";
  if (!scatter.empty()) text += "    [[maybe_unused]] const ForwardParams& p = bp.fwd;\n";
  text += scatter + "  }\n";
  text +=
      "  __device__ static __forceinline__ void flush_tensor_grads(const Invariants& inv, "
      "const BackwardParams& bp, const Coordinates& at, "
      "GradSum (&local)[kLocalGradSlots]) {\n" +
      flush + "  }\n";
  return text;
}

std::string backward_entry_points(const Problem& problem, const BackwardChoice& choice) {
  const std::string launch_bounds = choice.min_blocks > 0
                                        ? fmt::format("{}, {}", choice.threads, choice.min_blocks)
                                        : fmt::format("{}", choice.threads);
  std::string text = fmt::format("using FlexattnBackwardConfig = {};\n", choice.config_type());
  text += fmt::format(
      "extern \"C\" __global__ void __launch_bounds__(flexattn_kernels::kDeltaThreads) {}(\n"
      "    const flexattn_kernels::BackwardParams params) {{\n"
      "  flexattn_kernels::backward_delta<{}, {}>(params);\n}}\n",
      kBackwardDeltaName, element_tag(problem.dtype()), problem.head_dim_v());
  // On wgmma (or the wide wgmma kernels) both kernels take that configuration and its block of
  // threads.
  const bool wgmma = choice.wgmma || choice.wgmma_wide;
  if (wgmma) text += fmt::format("using FlexattnWgmmaConfig = {};\n", choice.wgmma_config_type());
  const std::string config = wgmma ? "FlexattnWgmmaConfig" : "FlexattnBackwardConfig";
  for (const auto& [name, function, threads] :
       {std::tuple{kBackwardDkdvName, choice.dkdv_template(), choice.dkdv_threads},
        std::tuple{kBackwardDqName, choice.dq_template(), choice.dq_threads}}) {
    const std::string bounds = wgmma ? fmt::format("{}, 1", threads) : launch_bounds;
    text += fmt::format(
        "extern \"C\" __global__ void __launch_bounds__({}) {}(\n"
        "    const flexattn_kernels::BackwardParams params) {{\n"
        "  flexattn_kernels::{}<{}, flexattn_generated::Modifier>(params);\n"
        "}}\n",
        bounds, name, function, config);
  }
  text += fmt::format(
      "extern \"C\" __global__ void __launch_bounds__(flexattn_kernels::kFinalizeThreads) {}(\n"
      "    const flexattn_kernels::FinalizeParams params) {{\n"
      "  flexattn_kernels::backward_finalize(params);\n}}\n",
      kBackwardFinalizeName);
  return text;
}

BackwardCode backward_code(const Problem& problem, const BackwardChoice& choice) {
  BackwardCode code;
  code.choice = choice;
  code.score_derivative = derivative_wrt_score(problem.score_mod());
  for (LoadDerivative& load : derivatives_wrt_tensors(problem.score_mod())) {
    const auto decl = problem.desc().tensors.find(load.tensor);
    if (decl != problem.desc().tensors.end() && is_floating(decl->second.dtype)) {
      code.load_derivatives.push_back(std::move(load));
    }
  }
  return code;
}

}  // namespace flexattn::cuda
