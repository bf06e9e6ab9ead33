// Internal to the plan canary (canary.hpp): the sampled rows, the canary inputs, and the float64
// reference on the sampled rows only.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "flexattn/engine.hpp"

namespace flexattn::detail {

// One sampled (batch, query head) pair and its sampled query rows (ascending).
struct SampledPair {
  std::int64_t b = 0, h = 0, h_kv = 0, q_len = 0, kv_len = 0;
  std::int64_t q_offset = 0;  // a KV cache's: the position of query row 0 (kv_len - q_len)
  std::vector<std::int64_t> rows;
};

// A (batch, kv head) whose dK and dV rows are compared: every kv row of it.
struct SampledKvHead {
  std::int64_t b = 0, h_kv = 0, kv_len = 0;
};

struct Sample {
  std::vector<SampledPair> pairs;
  std::vector<SampledKvHead> kv_heads;  // of the pairs, in order of first appearance
};
Sample sample_rows(const Problem& problem);

// A KV cache problem's canary cache: sequence b holds from its query count up to the capacity
// (the last sequence full), its pages spread over the pool in a scrambled order (sequences may
// share pages, as prefix caching does).
std::int64_t canary_cache_length(const Problem& problem, std::int64_t b);
std::int64_t canary_page(const Problem& problem, std::int64_t b, std::int64_t j);

// The compared values of one output, row by row, in an order shared by the plan's result and
// every reference.
struct OutputRows {
  std::string output;              // "out", "lse", "dq", "dk", "dv", "d<tensor>"
  std::vector<std::string> where;  // "batch 1, head 3, row 127"
  std::vector<std::vector<double>> rows;
};
using SampledOutputs = std::vector<OutputRows>;

// The synthetic inputs on the host, in the problem's layout, strides and storage dtype. dout is
// zero outside the sampled rows.
struct CanaryInputs {
  HostTensor q, k, v, dout;  // flat buffers covering the strided views below
  TensorView q_view, k_view, v_view, dout_view;
  std::map<std::string, HostTensor> tensors;  // every tensor the problem declares
  HostTensor page_table, cache_lens;          // a KV cache problem's (int32)
};
CanaryInputs make_canary_inputs(const Problem& problem, const Sample& sample, double q_scale,
                                bool zero_queries);

// A flat host buffer covering the strided view `expected` (its data pointer set).
HostTensor buffer_for(const TensorView& expected, TensorView& view);

// Element offset of row `s` of (b, head) in a Q/K/V/O-like view of the problem; kv-side views
// (k, v, dk, dv) use the kv offsets in thd, and a KV cache's pools the canary's pages.
std::int64_t row_offset(const Problem& problem, const TensorView& view, bool kv_side,
                        std::int64_t b, std::int64_t head, std::int64_t s);
std::int64_t lse_offset(const Problem& problem, const TensorView& lse, std::int64_t b,
                        std::int64_t h, std::int64_t q);

// The function the reference computes: the request or one of its mutants.
enum class Variant { kRequest, kScoreModDropped, kMaskDropped, kDerivativeReplacedByOne };
std::string_view to_string(Variant variant);

// cpu_ref (float64) on the sampled rows, for `variant`.
SampledOutputs reference_outputs(const Problem& problem, const CanaryInputs& inputs,
                                 const Sample& sample, Variant variant);

// Per sampled query row (the pairs' rows in order): how large the row's modified scores and their
// rounding can be, max over its kept keys of max(|score_mod(s)|, |d score_mod / d score| x
// scale x sum_i |q_i k_i|); the second term is the rounding of the raw score's accumulation carried
// through the modifier (large where the modifier is steep, e.g. 1 / score near 0).
std::vector<double> score_sizes(const Problem& problem, const CanaryInputs& inputs,
                                const Sample& sample);

// Per compared row of dq, dk and dv (the reference's row order): the largest, over the row's
// elements, of the sum of the absolute values of the terms the element sums. An engine that
// rounds P and dS to the storage dtype before their products (tensor-core kernels do), or that
// forms rowsum(dO * O) from its rounded output, errs by a few roundings of these sums; where the
// terms cancel (dK of a key few sampled rows see), the sum is far above the result. Terms:
// dS = scale x P x (dO . v - D) x d score_mod / d score with D = dO . o, taken as scale x P x
// (|dO . v - D| + |dO| . |o|) x |d score_mod / d score| (the second part: D formed from an output
// rounded to the storage dtype); dq_i sums |dS_ij| |k_j|, dk_j sums |dS_ij| |q_i| and dv_j sums
// P_ij |dO_i| over the sampled rows. Empty for a forward problem.
struct GradientTermSizes {
  std::vector<double> dq, dk, dv;
};
GradientTermSizes gradient_term_sizes(const Problem& problem, const CanaryInputs& inputs,
                                      const Sample& sample, const SampledOutputs& reference);

}  // namespace flexattn::detail
