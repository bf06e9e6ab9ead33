// Internal: the plan canary (docs/design.md section 4). The plan proof shows a plan holds the
// requested modifier; the canary shows it computes with it. Before a plan of an engine other than
// cpu_ref is first used, selection runs the plan itself once on synthetic inputs and compares
// sampled rows with cpu_ref in float64. The inputs are chosen so that the requested function and
// its mutants (score modifier dropped, mask dropped, backward: d score_mod / d score replaced by 1)
// are far apart on the sampled rows.
//
// Sampling: a few (batch, query head) pairs (first, last, middle); in each, the query rows 0, 1,
// the tile boundaries 63, 64, 127, 128, the middle row and the last two. Forward: out and lse of
// those rows. Backward: dO is zero outside the sampled rows, so dK, dV and the tensor gradients
// receive contributions from the sampled rows only; the canary compares the dQ rows, every dK and
// dV row of the sampled pairs' kv heads, and the whole tensor gradients. The reference runs
// cpu_ref on a reduced problem per pair: the sampled rows as its queries, with `b`, `h`, `Q_LEN`
// and `KV_LEN` fixed to the pair's values and `q` read through a table of the sampled rows, so
// it costs (rows x seq_len_kv) per pair, not the whole problem.
//
// Tolerance, per element: 4 x u x magnitude, u = the storage dtype's unit roundoff plus 2^-22 x
// (1 + the score size), the score size being how large the modified scores and the rounding of
// the raw score carried through the modifier can be (its row's for out, lse and dq; the largest
// for dk, dv and tensor gradients); magnitude = the largest |v| of the pair's kv head for out (a
// convex combination of v rows), 1 for lse (absolute), the row's largest reference value for
// dq/dk/dv (at least 1/8 of the output's largest), the gradient's largest value for a tensor
// gradient.
//
// Discrimination: a variant is caught when some compared element differs from the request's
// reference by at least kDiscriminationFactor x its tolerance. q is scaled by 1, 2, 4, 8, 16 until
// every applicable variant is caught; if none does, the canary still compares, with the best
// scale, and says so in CanaryResult::note.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "flexattn/engine.hpp"

namespace flexattn::detail {

// How far apart a variant and the request must be, in tolerances.
inline constexpr double kDiscriminationFactor = 10.0;

struct CanaryVariant {
  std::string name;  // "score_mod dropped", "mask dropped", "derivative replaced by 1"
  double ratio = 0;  // largest |variant - request| / tolerance over the compared elements
};

struct CanaryResult {
  bool passed = true;
  // When failed, one line: the engine, the output, where, the measured error and the allowed one.
  std::string reason;
  // Empty when every applicable variant is discriminated; otherwise which is not, and by how much.
  std::string note;
  double input_scale = 1;               // the factor q was scaled by
  std::vector<CanaryVariant> variants;  // the applicable ones, at input_scale
  double largest_error_ratio = 0;       // largest |engine - reference| / tolerance
  double seconds = 0;                   // the whole canary
  double plan_seconds = 0;              // of which running the plan
  std::size_t bytes = 0;                // buffers the canary allocated for the plan's arguments
};

// Test-only ways to weaken the canary, for the tests that prove its checks can fail.
struct CanaryOptions {
  bool zero_queries = false;  // all-zero q: no score can tell the variants apart
};

// Runs `plan`, built by `engine` for the plan's problem, once on canary inputs on the engine's
// device and compares it with cpu_ref. Never throws for a wrong result (that is `passed` false);
// an exception from the plan itself propagates.
CanaryResult run_canary(const Engine& engine, const Plan& plan, const CanaryOptions& options = {});

}  // namespace flexattn::detail
