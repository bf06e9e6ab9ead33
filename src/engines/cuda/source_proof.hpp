// The cuda engine's plan proof: the generated Modifier source (the text NVRTC compiles) lifted
// back into expression trees (source_lift.hpp) and proven, function by function, to compute what
// the request asks, by evaluation at deterministic pseudo-random points of the problem.
//
// An evaluation-equivalence proof, not a structural hash: the code generator rewrites the graphs
// algebraically for the tensor-core kernels (constant factors merged into `dot * inv.x`, log2(e)
// folded into the result, sums distributed, ir_tanh_small under its bound), so a lifted function
// is not the request's graph node for node, but it must give the request's value. Each lifted
// function is evaluated in float64 with a running error bound (one float32 rounding of every
// literal and parameter, a few float32 ulps per operation, propagated through each operation's
// derivative), and must lie within that bound of the request evaluated by the IR's float64
// evaluator at the same point: the rewrites move a result by about an ulp per operation, a
// dropped operation, changed constant or swapped operand by far more.
#pragma once

#include <string>
#include <string_view>

#include "engines/cuda/codegen.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cuda {

struct SourceProof {
  bool proven = false;
  std::string failure;  // the first function that is not proven and why (empty when proven)
  int points = 0;       // evaluation points per function
};

// Proves the generated source of `problem` (generate_modifier_source's text, or a translation
// unit that ends with it): prepare(), score_mod, score_mod_log2, score_mod_forward, the small-tanh
// variants under tanh_args_small's condition, the staged load, mask_mod and the constants the
// kernels branch on (kIdentityScore, kHasMask, kSmallTanh, kStaticReference...), and for a problem
// that wants gradients score_grad, score_grad_from_dot (and _small) against d score_mod / d score
// and tensor_grads against the derivatives of score_mod's float tensor loads.
SourceProof prove_modifier_source(const Problem& problem, const ModifierBindings& bindings,
                                  std::string_view source);

// The hashes a cuda plan reports from its proof: the problem's modifier_hash (and backward_hash
// when it wants gradients) when every source the plan can run is proven, else 0 (which matches
// no problem).
struct ProofHashes {
  std::uint64_t lowered_hash = 0;
  std::uint64_t lowered_backward_hash = 0;
};
ProofHashes proof_hashes(const Problem& problem, const SourceProof& proof);

// What the cuda engine's plan for `problem` reports (cuda_engine.cpp): the same lowering and
// proof as plan(), without compiling or a device. `capability`: the compute capability the
// kernels are chosen for (0: the portable kernels). Zero hashes when the problem is not supported.
ProofHashes plan_proof_hashes(const Problem& problem, int capability);

}  // namespace flexattn::cuda
