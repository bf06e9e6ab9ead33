// Deliberately faulty engines, for proving that the guards and the conformance checks catch an
// engine that does not compute the requested function (the bug of docs/design.md section 1). Never
// part of the default engine list; tests and `flexattn check --planted-faults` add them.
#pragma once

#include <memory>
#include <vector>

#include "flexattn/engine.hpp"

namespace flexattn::testing {

// Both compute on the CPU, forward and backward, in float64, the requested problem without its
// score modifier (tensor gradients zero), storing in the problem's dtypes.
// "faulty_drop_mod": drops the score modifier and honestly reports the hashes of what it lowered
// (the identity and its derivatives), so the plan proof must refuse it.
std::shared_ptr<const Engine> make_dropping_engine();
// "faulty_lying_hash": drops the score modifier but claims the requested hashes; only comparing
// its outputs with cpu_ref catches it.
std::shared_ptr<const Engine> make_lying_engine();

std::vector<std::shared_ptr<const Engine>> planted_faulty_engines();

}  // namespace flexattn::testing
