// Deliberate errors the lowering can emit into an operation graph, for tests that show the plan
// proof (proof.hpp) refuses every one of them. Never set outside tests.
#pragma once

namespace flexattn {

enum class CudnnLoweringFault {
  kNone,
  kDropOperation,          // the first modifier operation whose input can stand for its output
  kChangeConstant,         // the first finite by-value constant of the modifier
  kSwapOperands,           // X and B of the first non-commutative two-input modifier operation
  kDropMaskSelect,         // the BINARY_SELECT that applies the mask to the score
  kDropDerivativeMultiply  // the multiply of dS by the modifier's derivative
};

}  // namespace flexattn
