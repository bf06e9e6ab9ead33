// The backward's part of the generated code: the Modifier's backward members (the derivatives
// of score_mod lowered by GraphLowering) and the four backward entry points. codegen.cpp appends
// them to the forward's when the problem wants gradients.
#pragma once

#include <string>

#include "engines/cuda/codegen.hpp"
#include "engines/cuda/graph_lowering.hpp"
#include "engines/cuda/tile_plan.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cuda {

// The Modifier's backward members (kernels/backward_common.cuh). The lowerings of the derivative
// graphs add their invariant nodes to `fields` and `assignments` (Invariants and prepare()),
// under prefixes of their own: d (the score derivative), g<n>i<k>_ (index k of load n), g<n>d_
// (the derivative with respect to load n).
// `small`: score_grad_from_dot with its tanh in the small form (see emit_from_dot).
std::string backward_members(const Problem& problem, const ModifierBindings& bindings,
                             const BackwardCode& backward, std::string& fields,
                             std::string& assignments, SmallTanh& small);

// The four backward entry points (their grids: kernels/params.cuh and the engine's run_backward).
std::string backward_entry_points(const Problem& problem, const BackwardChoice& choice);

}  // namespace flexattn::cuda
