// Lowering of the canonical modifier graphs to CUDA: a `Modifier` struct (kernels/
// forward_common.cuh describes its interface) and the kernel entry point, appended to the
// embedded kernel templates to form the one translation unit NVRTC compiles.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "engines/cuda/tile_plan.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cuda {

// The name of the generated kernel (extern "C", so not mangled).
inline constexpr std::string_view kKernelName = "flexattn_forward";

// Which kernel-argument slot carries each extra tensor and scalar parameter the modifiers read.
struct ModifierBindings {
  std::vector<std::string> tensors;  // ForwardParams::tensors[i] is tensors[i]
  std::vector<std::string> params;   // ForwardParams::params[i] is params[i]
};
struct BindingSelection {
  ModifierBindings bindings;
  std::string reason;  // empty when every tensor and parameter has a slot
};
BindingSelection bind_modifier(const Problem& problem);

// The generated code alone: the Modifier struct of the problem's score_mod and mask_mod and the
// entry point for `choice`.
std::string generate_modifier_source(const Problem& problem, const ModifierBindings& bindings,
                                     const KernelChoice& choice);
// The complete translation unit: the embedded templates, then the generated code.
std::string generate_translation_unit(const Problem& problem, const ModifierBindings& bindings,
                                      const KernelChoice& choice);

}  // namespace flexattn::cuda
