// The cpu engine's plan proof (docs/design.md section 4): the tapes the runner executes, lifted
// back into the IR instruction by instruction, and the test-only faults that check the proof
// refuses a tape that differs from the request.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "engines/cpu/plan.hpp"
#include "flexattn/engine.hpp"

namespace flexattn::cpu {

// The graph that `tape` computes into output(output), rebuilt from its instructions, leaves,
// constants and parameters. Throws Error(kInternal) when the instructions do not form a well-typed
// IR expression (an operand of the wrong type where the IR would need a conversion).
Graph lift_output(const Tape& tape, std::size_t output);

struct LoweringProof {
  std::uint64_t forward = 0;   // modifier_hash of what the forward (and backward) evaluate
  std::uint64_t backward = 0;  // backward_hash of the derivatives; 0 without a backward tape
};
// The proof of a lowering, from its tapes (score tape output 0, mask tape output 0, backward
// tape outputs 0 and 1, gradient tape outputs), honouring the flags that skip a tape at run time
// (identity_score: the score passes through, derivative 1; keep_all: no mask). A tape that cannot
// be lifted proves nothing: both hashes are then 0.
LoweringProof prove_lowering(const Lowering& lowering, const Problem& problem);

// ---- test-only faults (never reachable through make_cpu_engine) --------------------------------

enum class TapeFault {
  kDropOperation,   // an instruction's result replaced by its first operand
  kChangeConstant,  // a constant's value changed
  kSwapOperands,    // the operands of a non-commutative operation swapped (where: its branches)
  kDropMask,        // the mask tape replaced by `true`
  kDropDerivative,  // d score_mod / d score, or a load's derivative, replaced by 1
};

// Applies `fault` at its site number `site` among the tapes the plan executes (score, mask,
// backward, gradient, in that order). Returns false when the lowering has no such site.
bool apply_fault(Lowering& lowering, TapeFault fault, std::size_t site);

// A cpu engine whose lowering applies `fault` at `site` between building the tapes and the proof
// (a plan whose lowering has no such site is refused with "no site").
std::shared_ptr<const Engine> make_faulty_cpu_engine(TapeFault fault, std::size_t site);

}  // namespace flexattn::cpu
