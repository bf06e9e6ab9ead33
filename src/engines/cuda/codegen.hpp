// Lowering of the canonical modifier graphs to CUDA: a `Modifier` struct (kernels/
// forward_common.cuh and, for problems that want gradients, backward_common.cuh describe its
// interface) and the kernel entry points, appended to the embedded kernel templates to form the
// one translation unit NVRTC compiles.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "engines/cuda/tile_plan.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cuda {

// The names of the generated kernels (extern "C", so not mangled). A forward-only problem's
// translation unit holds the first; one that wants gradients holds all five.
inline constexpr std::string_view kKernelName = "flexattn_forward";
inline constexpr std::string_view kBackwardDeltaName = "flexattn_backward_delta";
inline constexpr std::string_view kBackwardDkdvName = "flexattn_backward_dkdv";
inline constexpr std::string_view kBackwardDqName = "flexattn_backward_dq";
inline constexpr std::string_view kBackwardFinalizeName = "flexattn_backward_finalize";
// A translation unit with a backward compiles as two modules, at once: the forward's
// (kForwardModuleDefine defined: kKernelName alone) and the backward's (kBackwardModuleDefine:
// the four backward kernels). Undefined, the unit holds all five. Each kernel's code is the same
// in either form (test_cuda_compile compares their PTX).
inline constexpr std::string_view kForwardModuleDefine = "FLEXATTN_FORWARD_MODULE";
inline constexpr std::string_view kBackwardModuleDefine = "FLEXATTN_BACKWARD_MODULE";
// A paged-cache problem's module: kKernelName (forward_decode) and the split combination.
inline constexpr std::string_view kDecodeCombineName = "flexattn_decode_combine";
// The non-finite repair module's kernels (generate_repair_translation_unit).
inline constexpr std::string_view kRepairForwardName = "flexattn_repair_forward";
inline constexpr std::string_view kRepairDqName = "flexattn_repair_dq";
inline constexpr std::string_view kRepairDkdvName = "flexattn_repair_dkdv";

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

// What the backward adds to the generated code: its kernels and the derivatives of the score
// modifier they evaluate.
struct BackwardCode {
  BackwardChoice choice;
  Graph score_derivative;                        // d score_mod / d score
  std::vector<LoadDerivative> load_derivatives;  // loads of floating-point tensors only
};
// Throws Error when the score modifier cannot be differentiated.
BackwardCode backward_code(const Problem& problem, const BackwardChoice& choice);

// The load of score_mod that the wgmma forward can stage in shared memory beside K and V
// (KernelChoice::stage_tensor): a bf16/fp16 tensor indexed
// [..., q, kv] whose other indices depend only on (b, h) and the lengths, of shape
// [..., seq_len_q, seq_len_kv] with seq_len_kv a multiple of 8, in a problem with fixed-length
// sequences (not thd). Its tensor's name, or empty.
std::string stageable_tensor(const Problem& problem);

// The generated code alone: the Modifier struct of the problem's score_mod and mask_mod and the
// entry point for `choice`; with `backward` (required when the problem wants gradients, null
// otherwise) also the Modifier's backward members and the four backward entry points.
std::string generate_modifier_source(const Problem& problem, const ModifierBindings& bindings,
                                     const KernelChoice& choice, const BackwardCode* backward);
// The complete translation unit: the embedded templates, then the generated code.
std::string generate_translation_unit(const Problem& problem, const ModifierBindings& bindings,
                                      const KernelChoice& choice, const BackwardCode* backward);
// The non-finite repair module (kernels/repair.cuh): the embedded templates, the same Modifier
// struct (without a staged tensor), and kRepairForwardName; with `backward` also
// kBackwardDeltaName, kRepairDqName and kRepairDkdvName.
std::string generate_repair_translation_unit(const Problem& problem,
                                             const ModifierBindings& bindings,
                                             const BackwardCode* backward);

}  // namespace flexattn::cuda
