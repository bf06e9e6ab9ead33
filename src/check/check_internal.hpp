// Internals of the conformance runner shared by its files.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "flexattn/conformance.hpp"
#include "flexattn/engine.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::conformance::detail {

// Element offsets of the sequence tensors of a problem in its layout.
class LayoutIndex {
 public:
  explicit LayoutIndex(const Problem& problem) : problem_(problem) {}
  // Q/K/V/O-like views: element (b, head, position in the sequence, d).
  std::int64_t offset(const TensorView& view, bool query_side, std::int64_t b, std::int64_t head,
                      std::int64_t position, std::int64_t d) const;
  // LSE: (B, Hq, Sq) or thd (Hq, Tq), contiguous.
  std::int64_t lse_offset(std::int64_t b, std::int64_t head, std::int64_t position) const;

 private:
  const Problem& problem_;
};

// The plain same-precision implementation that sets the tolerance (docs/design.md section 5): what
// a straightforward framework implementation does in the storage precision: fp32 products of
// storage-precision inputs, fp32 softmax, P rounded to the storage dtype before P @ V, outputs
// rounded to the storage dtype; backward likewise (dS rounded before its two products). It reads
// and writes host views of any dtype; LSE and tensor gradients are fp32.
void plain_forward(const Problem& problem, const ForwardArgs& args);
void plain_backward(const Problem& problem, const BackwardArgs& args);
// The same loops as plain_backward with every sum taken over absolute values, dS as
// P (|dO| |V| + |dO| |O|) summed over the head dimension, and nothing rounded: the size of the
// terms whose cancellation each gradient element is, written to the gradient views of `args`
// (float64 host views). A gradient that cancels to 0 in exact arithmetic keeps the rounding of
// those sums in any float32 implementation; this is its scale.
void plain_backward_magnitudes(const Problem& problem, const BackwardArgs& args);
// The standard deviation of the error that the storage-dtype roundings of a backward's inputs put
// into each dQ and dK element, under the random-rounding model (each rounding an independent
// relative error, uniform within half a unit in the last place): the stored O and the forward's P
// (through D = rowsum(dO * O), shared by a whole row of dS), and dS itself. Implementations that
// round in another order (a flash kernel rounds P before dividing by the row sum) draw other
// errors of this size; where dS cancels (an early key under a causal mask) one such draw can be
// many times the plain implementation's. Written to the dq and dk views of `args` (float64 host
// views; dv and the tensors' gradients are not written).
void plain_backward_rounding_sigma(const Problem& problem, const BackwardArgs& args);

// The tolerance of one output: element i passes when
// |got_i - ref_i| <= atol + rtol * |ref_i| + floor_i.
struct Tolerance {
  double atol = 0.0;
  double rtol = 0.0;
  // Per element (empty: none): for the gradients through dS = P (dP - D), the rounding of the
  // float32 sums that cancel in the element and of the storage-dtype values they are made of
  // (gradient_floor below).
  std::shared_ptr<const std::vector<double>> floor = nullptr;
  // 0 where the reference is infinite or NaN.
  double allowed(std::int64_t element, double reference) const;
};

// One rounding step of `dtype` at 1 (the gap between 1 and the next value).
double machine_epsilon(DType dtype);

// The floor of each element of a gradient through dS (dq, dk, a tensor's): twice one float32
// rounding of the sums whose difference it is, from `magnitudes` (plain_backward_magnitudes).
std::shared_ptr<const std::vector<double>> cancellation_floor(const TensorView& magnitudes);

// How many standard deviations of plain_backward_rounding_sigma a gradient element may be off.
inline constexpr double kRoundingSigmas = 4.0;

// The floor of dq and dk: cancellation_floor plus kRoundingSigmas times `sigma`
// (plain_backward_rounding_sigma).
std::shared_ptr<const std::vector<double>> gradient_floor(const TensorView& magnitudes,
                                                          const TensorView& sigma);

// |value - reference|, with agreement: both NaN, or equal (also equal infinities), give 0; NaN on
// one side only gives +inf.
double element_error(double value, double reference);

// The tolerance of an output from the plain same-precision implementation of the same case: the
// line atol + rtol * |ref| that bounds every plain element's error and is lowest at the mean
// magnitude, times 2, plus rounding floors (rtol: one rounding in `rounding_dtype`; atol: one
// float32 rounding of the largest |ref|).
Tolerance derive_tolerance(const TensorView& plain, const TensorView& reference,
                           DType rounding_dtype);

// Every element of `got` against `reference` under `tolerance` (host views, same shape).
OutputCheck compare(std::string name, const TensorView& got, const TensorView& reference,
                    const Tolerance& tolerance, bool guard_intact);

// The float64 reference of a case: outputs of cpu_ref (or its variants) on float64 inputs.
struct ReferenceOutputs {
  HostTensor out, lse, dq, dk, dv;
  std::map<std::string, HostTensor> tensor_grads;  // gradients of the float tensors
};

struct ReferenceInputs {
  HostTensor q, k, v, dout;                   // float64
  std::map<std::string, HostTensor> tensors;  // float tensors in float64, integer ones as they are
  HostTensor page_table{}, cache_lens{};      // a paged case's
};

// What the float64 reference computes: the request, or a wrong function a conformance case must
// tell apart from it (docs/design.md section 5).
enum class ReferenceVariant {
  kExact,
  kWithoutScoreModifier,  // score_mod dropped (the identity)
  kWithoutMask,           // mask_mod dropped (every key kept)
  kScoreDerivativeOne,    // backward with d score_mod / d score replaced by 1
};

// Runs cpu_ref on `desc` (a float64 problem on the CPU) as `variant` says; backward when the
// problem wants it, with the gradients of `float_tensors`.
ReferenceOutputs run_reference(const ProblemDesc& desc, const ReferenceInputs& inputs,
                               const std::vector<std::string>& float_tensors,
                               ReferenceVariant variant);

// An output of a case with its float64 reference and its tolerance.
struct ToleratedOutput {
  std::string name;
  const HostTensor* reference;
  Tolerance tolerance;
};

// Empty when every variant that changes the function (on these inputs) fails the tolerance of
// every output it changes; otherwise why the case cannot tell the variant from the request.
std::string discrimination_failure(const ProblemDesc& desc, const ReferenceInputs& inputs,
                                   const std::vector<std::string>& float_tensors,
                                   const std::vector<ToleratedOutput>& outputs);

}  // namespace flexattn::conformance::detail
