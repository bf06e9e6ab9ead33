// The meaning of every non-leaf IR op on float64 values, shared by the evaluator and the constant
// folder of Graph so that folding can never disagree with evaluation.
#pragma once

#include <span>

#include "flexattn/expr.hpp"

namespace flexattn {

// Applies `op` (not a leaf, literal, param or load) whose result has type `result_type` to
// operand values. i32 values are whole numbers and results wrap to 32 bits like the engines'
// integer arithmetic; bool values are 0.0 or 1.0.
double apply_op(Op op, Type result_type, std::span<const double> args);

}  // namespace flexattn
