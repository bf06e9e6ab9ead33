// One tape instruction over the lanes of a row (tape_ops.cpp): the element-wise semantics of
// every non-leaf, non-load IR op, in float32 and wrapping int32, as `evaluate` defines them.
#pragma once

#include <cstdint>

#include "engines/cpu/tape.hpp"

namespace flexattn::cpu {

// The value arrays of a TapeRunner: operands are read through `read_*`, results written through
// `write_*` (the two differ only for slots the runner points at caller memory).
struct LaneArrays {
  const float* const* read_floats;
  const std::int32_t* const* read_ints;
  float* const* write_floats;
  std::int32_t* const* write_ints;
  std::int64_t lanes;
};

// Executes `instruction` (not a leaf or a load) on every lane. Chosen once for the CPU: the same
// loops compiled for AVX2 where available, else for the baseline ISA.
void execute_instruction(const Instruction& instruction, const LaneArrays& arrays);

}  // namespace flexattn::cpu
