// Deliberately faulty engines, for proving that the guards and the conformance checks catch an
// engine that does not compute the requested function (the bug of DESIGN.md section 1). Never
// part of the default engine list; tests and `flexattn check --planted-faults` add them.
#pragma once

#include <memory>
#include <vector>

#include "flexattn/engine.hpp"

namespace flexattn::testing {

// "faulty_drop_mod": drops the score modifier and honestly reports the hash of what it lowered
// (the identity), so the plan proof must refuse it.
std::shared_ptr<const Engine> make_dropping_engine();
// "faulty_lying_hash": drops the score modifier but claims the requested hash; only comparing
// its output with cpu_ref catches it.
std::shared_ptr<const Engine> make_lying_engine();

std::vector<std::shared_ptr<const Engine>> planted_faulty_engines();

}  // namespace flexattn::testing
