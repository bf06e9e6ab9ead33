// The conformance matrix: one catalogue of cases (modifier x mask x layout x dtype x shape,
// forward and backward) shared by the test suite, `flexattn check` and the benchmarks, and the
// runner that compares any engine with cpu_ref under the tolerance rule of docs/design.md
// section 5.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "flexattn/engine.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::conformance {

// kNonFinite: the non-finite semantics of docs/design.md section 2 (Case::planted).
enum class Tier { kQuick, kFull, kNonFinite };
Tier parse_tier(std::string_view text);  // "quick" | "full" | "non-finite"

// One non-finite value planted in the inputs of a case (bshd layout), in the last kv head (and
// its last query head): NaN in V at key 2/5 of the keys, +inf in K there, NaN in Q or in dO at
// query 1/10 of the queries, each in every 7th element of the row. Under the catalogue's masks
// the planted key is removed for some queries and kept for others, and the planted query row
// keeps some keys only, so a masked position that contributed (0 * NaN) shows.
enum class Planted { kNone, kNanValue, kInfKey, kNanQuery, kNanOutputGradient };
std::string_view to_string(Planted planted);  // "nanv", "infk", "nanq", "nando"

struct Shape {
  std::int64_t batch, heads_q, heads_kv, seq_len_q, seq_len_kv, head_dim_qk, head_dim_v;
};

struct Case {
  // "bf16_bshd_b2_hq8_hkv2_sq17_skv577_d80/softcap30_causal"; "_bwd" suffix for backward.
  std::string name;
  std::string modifier;  // "softcap30", "alibi", ... ("none" for the identity)
  std::string mask;      // "causal", "window", ... ("none" for no mask)
  Shape shape;
  Layout layout = Layout::kBSHD;
  DType dtype = DType::kF32;
  bool backward = false;
  // IR text used as the score modifier when `modifier` is "custom" (the fuzz test); it may read
  // `bias[h, q, kv]` (f32) and `slopes[h]` (f32).
  std::string custom_score_mod;
  // Whether run_case first proves the case discriminating (see run_case). Catalogue cases do;
  // custom_case turns it off: a random expression (the fuzz test) may legitimately be close to
  // the identity, and the fuzz test checks the engine, not the case.
  bool prove_discriminating = true;
  Planted planted = Planted::kNone;
  // > 0: K and V in a paged KV cache of pages of this many tokens (forward only, bshd or thd
  // queries); shape.seq_len_kv is then the cache's capacity.
  std::int64_t page_size = 0;
};

// A case with a custom score modifier (see Case::custom_score_mod), not proven discriminating.
Case custom_case(const Shape& shape, Layout layout, DType dtype, std::string score_mod,
                 std::string mask, bool backward);

// The cases of a tier, in a fixed order. kQuick covers every modifier, mask, layout, dtype and
// shape feature at least once, within CI's budget; kFull is a larger product of them; kNonFinite
// plants each kind of non-finite value under masks and a -inf modifier, forward and backward.
std::vector<Case> cases(Tier tier);

// The problem of a case for an engine on `device`, with its extra tensors' contents.
struct Instance {
  ProblemDesc desc;
  std::map<std::string, HostTensor> tensors;
  // Standard deviation of the normal q and k entries (v and dO: 1): scores have about this
  // squared, so a case sets it where the score modifier must bite (softcap 30 on scores of ~1
  // changes them by ~1e-4, invisible in bf16).
  double query_key_stddev = 1.0;
  // Mean of the q and k entries (scores bounded away from 0 for a modifier singular there).
  double query_key_mean = 0.0;
  // A paged case's (Case::page_size): the sequences' pages, shuffled over a pool with spare pages
  // (entries past a sequence's pages are -1: never read), and their lengths: the capacity, the
  // query count alone, halfway between, and an empty slot, in turn.
  HostTensor page_table, cache_lens;
};
Instance instantiate(const Case& test_case, Device device, std::uint64_t seed);

// One output judged per element: element i passes when |engine_i - ref_i| <= atol + rtol *
// |ref_i| (ref the float64 reference; atol and rtol twice the plain same-precision
// implementation's, plus rounding floors). NaN against a finite reference fails; both NaN, or the
// same infinity, agree.
struct OutputCheck {
  std::string output;             // "out", "lse", "dq", "dk", "dv", "d<tensor>"
  double max_error = 0.0;         // |engine - reference| at the worst element
  double allowed = 0.0;           // atol + rtol * |reference| at the worst element
  double fraction_outside = 0.0;  // elements with error > allowed (NaN counts as outside)
  bool guard_intact = true;       // sentinel regions around the buffer untouched
  // The worst element: largest error / allowed (flat index in the output's own layout; -1: none).
  std::int64_t worst_index = -1;
  double worst_value = 0.0, worst_reference = 0.0;  // the engine's and the reference's value there
  double atol = 0.0, rtol = 0.0;
  bool passed() const { return guard_intact && max_error <= allowed; }
};

enum class Status { kPass, kFail, kSkipped };
std::string_view to_string(Status status);

struct Outcome {
  Status status = Status::kSkipped;
  std::string reason;  // skip reason (the engine's), or what failed
  std::vector<OutputCheck> checks;
  // The output closest to (or furthest past) its tolerance: largest max_error / allowed.
  const OutputCheck* worst() const;
  double max_error() const;         // of worst()
  double allowed() const;           // of worst()
  double fraction_outside() const;  // largest over all outputs
};

// Runs the case on `engine` and on cpu_ref (float64) with the same inputs, plus the plain
// same-precision implementation that sets the tolerance. First proves the case discriminating:
// the float64 reference without the score modifier, without the mask and (backward) with
// d score_mod / d score replaced by 1 must each fail the tolerance of every output it changes; a
// case that cannot tell one from the request is a kFail whose reason starts with "catalogue:".
// Never throws for an engine failure: an exception from the engine is a kFail with its message.
Outcome run_case(const Engine& engine, const Case& test_case, std::uint64_t seed = 1);

// run_case's rule for outputs computed elsewhere (`flexattn run --check`). The plain
// same-precision implementation that sets the tolerance, on host views of a CPU problem (LSE and
// tensor gradients fp32), and the per-element comparison of `got` with the float64 `reference`
// under the tolerance derived from `plain` (rounding_dtype: the output's storage dtype).
void plain_forward(const Problem& problem, const ForwardArgs& args);
void plain_backward(const Problem& problem, const BackwardArgs& args);
OutputCheck compare_output(std::string name, const TensorView& got, const TensorView& plain,
                           const TensorView& reference, DType rounding_dtype);

}  // namespace flexattn::conformance
