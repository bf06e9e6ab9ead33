// Faults planted in the cpu engine's tapes between building them and the plan proof, to check
// that the proof refuses every tape that differs from the request (tests/unit/test_plan_proof.cpp).
// Test code: compiled into the tests that use it, never into the library.
#pragma once

#include <cstddef>
#include <memory>

#include "engines/cpu/tape_proof.hpp"
#include "flexattn/engine.hpp"

namespace flexattn::cpu {

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

// A cpu engine whose lowering applies `fault` at `site` before the proof (a problem whose
// lowering has no such site is refused).
std::shared_ptr<const Engine> make_faulty_cpu_engine(TapeFault fault, std::size_t site);

}  // namespace flexattn::cpu
