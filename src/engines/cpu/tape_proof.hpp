// The cpu engine's plan proof (docs/design.md section 4): the tapes the runner executes, lifted
// back into the IR instruction by instruction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
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

// Changes a lowering after its tapes are built and before they are proven; returning false
// refuses the problem. The seam through which tests plant faults the proof must catch
// (tests/support/cpu_tape_faults.hpp); make_cpu_engine() has none.
using LoweringHook = std::function<bool(Lowering&)>;
std::shared_ptr<const Engine> make_cpu_engine(LoweringHook hook);

}  // namespace flexattn::cpu
