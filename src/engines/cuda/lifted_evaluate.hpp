// Evaluation of a lifted Modifier (source_lift.hpp) in float64 with a running error bound: what
// the plan proof (source_proof.cpp) compares with the request.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engines/cuda/source_lift.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn::cuda {

// float32's unit roundoff.
inline constexpr double kUnitRoundoff = 0x1p-24;
// The error each float operation of the kernels may add, in units of its result's roundoff: a
// correctly rounded operation adds 1; CUDA's expf/logf/tanhf and the MUFU forms of ir_tanh are
// within 2 ulp. 4 leaves a factor of 2 over the worst of them, and stays some 1e5 times below the
// change of any dropped operation, changed constant or swapped operand the mutation tests make.
inline constexpr double kUlpsPerOperation = 4.0;

// A value with a bound on its distance from the exact value of the expression the code means;
// `ambiguous` when a branch, comparison, floor or integer conversion could go either way within
// that bound (the point then proves nothing about this value).
struct LiftedValue {
  double value = 0.0;
  double error = 0.0;
  bool ambiguous = false;
};

// Where a lifted function is evaluated: the thread block's coordinates, the element, and the
// function's scalar arguments.
struct LiftedPoint {
  std::int64_t batch = 0, head = 0, q_len = 1, kv_len = 1, q = 0, kv = 0;
  double score = 0.0;   // `score` (score_mod, score_grad, tensor_grads)
  double dot = 0.0;     // `dot` (the _log2, _forward and _from_dot functions)
  double bound = 0.0;   // tanh_args_small's
  bool staged = false;  // whether `staged` points to the staged element
};

// The synthetic contents of an extra tensor, computed from the element's indices rather than
// stored (a [batch, heads, seq_len_q, seq_len_kv] bias is not copied at plan time): a hash of the
// indices (Horner's rule, base kElementHashBase, modulo the prime kElementHashPrime, starting
// from the tensor's salt), then for float tensors (hash % 255 - 127) / 32, exact in every
// storage dtype, and for integer tensors hash % 4 (document ids that match often). The request's
// loads are rewritten into the same function of their index expressions (source_proof.cpp).
inline constexpr std::int64_t kElementHashBase = 31;
inline constexpr std::int64_t kElementHashPrime = 65521;
inline constexpr std::int64_t kElementLevels = 255;
inline constexpr double kElementStep = 1.0 / 32.0;
inline constexpr std::int64_t kElementIds = 4;
struct SyntheticTensor {
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::int64_t salt = 0;
};
double synthetic_element(const SyntheticTensor& tensor, const std::vector<std::int64_t>& indices);

// What the kernel arguments hold: the scale and parameters (as float, as the engine passes
// them) and the extra tensors by slot (contiguous, as the kernels require).
struct LiftedEnvironment {
  double scale = 1.0;
  std::vector<double> params;
  std::vector<SyntheticTensor> tensors;
};

// Thrown for what the device could not compute meaningfully (an offset outside its tensor, a
// loader of another dtype, ir_small_int_to_float out of its range); the proof fails with it.
struct LiftedEvaluationError {
  std::string what;
};

class LiftedEvaluator {
 public:
  LiftedEvaluator(const LiftedModifier& modifier, const LiftedEnvironment& environment)
      : modifier_(modifier), environment_(environment) {}

  // Runs prepare() for the point's (batch, head, lengths); call before evaluating a function.
  void prepare(const LiftedPoint& point);
  // The value of function `name` (its return node) at `point`.
  LiftedValue function(const std::string& name, const LiftedPoint& point);
  // Node `node` at `point` (tensor_grads' offsets and values).
  LiftedValue node(int node, const LiftedPoint& point);

 private:
  LiftedValue evaluate(int node);
  LiftedValue call(const LiftedNode& node);
  LiftedValue integer_call(const LiftedNode& node, const std::vector<LiftedValue>& args) const;
  LiftedValue float_call(const LiftedNode& node, const std::vector<LiftedValue>& args) const;
  LiftedValue load(const LiftedNode& node);
  LiftedValue staged_element(const LiftedNode& node);

  const LiftedModifier& modifier_;
  const LiftedEnvironment& environment_;
  std::map<std::string, LiftedValue> invariants_;
  const LiftedPoint* point_ = nullptr;
  std::vector<LiftedValue> memo_;
  std::vector<bool> done_;
};

}  // namespace flexattn::cuda
