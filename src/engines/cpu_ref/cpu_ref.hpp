// `cpu_ref`: the float64 reference engine, the oracle every other engine is compared with.
#pragma once

#include <memory>

#include "flexattn/engine.hpp"
#include "flexattn/export.hpp"

namespace flexattn {

std::shared_ptr<const Engine> make_cpu_ref_engine();

// What the reference's backward uses as d score_mod / d score.
enum class ScoreDerivative {
  kExact,          // the IR's symbolic derivative: the oracle
  kReplacedByOne,  // 1 everywhere (tensor derivatives stay exact): a wrong-derivative mutant
};

// Test-only: cpu_ref with the given score derivative. With kReplacedByOne the plan records the
// request's modifier hash (it lowered the right modifier) and claims the request's derivatives
// (the score derivative graph it holds, unevaluated) yet its backward computes dQ, dK and the
// tensor gradients as if d score_mod / d score were 1; the forward is unchanged. Conformance uses
// it to prove a case discriminates a wrong derivative, and tests use it as an engine that passes
// the plan proof but computes the wrong gradients. Not in the engine registry, so selection never
// reaches it; its name is "cpu_ref_score_derivative_one".
//
// The one internal function a shared libflexattn exports besides the API, in namespace
// flexattn::internal: the conformance runner (src/check), which the flexattn tool links against
// the shared library, builds both references with it. Not API: this header is not installed.
namespace internal {
FLEXATTN_API std::shared_ptr<const Engine> make_cpu_ref_engine(ScoreDerivative score_derivative);
}  // namespace internal

}  // namespace flexattn
