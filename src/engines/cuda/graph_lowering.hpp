// Lowering of one canonical IR graph (a modifier or one of its derivatives) to the CUDA
// expressions of the generated Modifier struct: the fields of its Invariants with their
// assignments in prepare(), and the per-element statements, optionally as a function of the raw
// dot product with the constant factors around the score merged (emit_from_dot). The forward's
// and the backward's code generation (codegen.cpp, codegen_backward.cpp) both build on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "engines/cuda/codegen.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cuda {

// An f32 literal as CUDA text: hexadecimal (exact), or the kernels' infinities and NaN.
std::string float_literal(double value);

// The kernel-argument slot of `name` among `names` (ModifierBindings); throws Error(kInternal)
// when it has none.
std::size_t slot_of(const std::vector<std::string>& names, const std::string& name);

// The element offset of a load from its index expressions. Extra tensors are contiguous
// (check_forward_args enforces it), so the strides are constants; offsets are 32-bit when the
// tensor has fewer than 2^31 elements.
std::string linear_offset(const TensorDecl& decl, const std::vector<std::string>& indices);

// A function of the dot product with every tanh in its small form (GraphLowering::emit_from_dot).
struct SmallTanh {
  bool has_tanh = false;  // the function computes a tanh
  bool possible = true;   // every tanh argument has a form whose bound is known
  std::string body;       // with ir_tanh_small when both hold, else the function unchanged
  std::string unchanged;  // the function's body with ir_tanh
  // On `bound`, `inv` and `p`: each tanh argument below kTanhSmallLimit.
  std::vector<std::string> terms;
  std::string condition() const;
  // Whether this function's terms are among `other`'s.
  bool covered_by(const SmallTanh& other) const;
};

// Lowers one canonical graph. Nodes that depend only on (b, h, Q_LEN, KV_LEN), params and loads
// at such indices are "invariant": computed once per thread block into Invariants; the rest are
// computed per element.
class GraphLowering {
 public:
  GraphLowering(const Graph& graph, std::string prefix, const Problem& problem,
                const ModifierBindings& bindings);

  // Fields of Invariants and their assignments in prepare().
  void emit_invariants(std::string& fields, std::string& assignments) const;

  // Per-element statements; returns the root's value.
  std::string emit_varying(std::string& statements) const;

  // Whether the root (or node `index`) depends on the score, q or kv (else it is a field of
  // Invariants or a leaf).
  bool varies() const { return varies(static_cast<std::size_t>(graph_.root())); }
  bool varies(std::size_t index) const { return varying_[index]; }

  // The staged load (stageable_load): its node reads the StagedElement when the kernel passes one
  // (score_mod_log2 takes `const StagedElement* staged`). Returns the members that go with
  // it: kStagedRowStride and staged_origin (the offset of element [..., 0, 0]).
  std::string stage_load(std::size_t index);

  // The body of a function of the raw dot product q . k instead of the score (score_mod_log2 and
  // score_grad_from_dot, which the tensor-core kernels call). Constant multiplications are merged
  // where the graph allows, so softcap's `tanh(score / 30) * 30` costs two instructions less per
  // element: a score used only as `score * c` or `score / c` becomes `dot * (scale * c)` with the
  // product computed once per block (extra Invariants fields; equal products in two functions are
  // one value after inlining, so the forward's tanh and the derivative's stay one computation), and
  // a root `x * c1 * c2` (each step `* c` or `/ c`, inner steps used only there) returns
  // `x * (c1 * c2)`, times log2(e) with `log2_result` (the exp2-domain logit), or `x` when the
  // product is 1 (softcap's derivative). Each merge moves the result by about an ulp of fp32, far
  // inside the 16-bit storage these kernels serve. Returns the statements and the return.
  //
  // With `small`, also the same function with every tanh as ir_tanh_small, and the condition on
  // `bound` (a bound of |dot| over a tile) under which each tanh argument is below
  // kTanhSmallLimit, where ir_tanh returns exactly ir_tanh_small: the kernels then run the cheaper
  // function on the whole tile, with the same values. Offered when every tanh takes the score times
  // or divided by an invariant (softcap's `tanh(score / c)`): such an argument is largest in
  // magnitude at |dot| = bound, because rounding is monotone and symmetric, so the condition
  // evaluates the argument's own operations at the bound.
  std::string emit_from_dot(std::string& fields, std::string& assignments, bool log2_result,
                            SmallTanh* small = nullptr);

  // How many per-element multiplies by the root's constant factor the last emit_from_dot's
  // function has (a varying value times the factor that no product took in: a bias term's
  // `bias * log2 e`, a root `t * log2 e`).
  int factor_multiplies() const { return factor_multiplies_; }

 private:
  // The name of an Invariants field holding `expression` (computed in prepare()), added as
  // `name` unless a field already holds the same expression: the derivative reuses
  // score_mod_log2's products and adds no field.
  static std::string invariant_field(const std::string& name, const std::string& expression,
                                     std::string& fields, std::string& assignments);

  // The Invariants field `p.scale * factor` that a score used as `score * factor` by node `index`
  // becomes (`dot * inv.field`), shared with any equal product (invariant_field).
  std::string dot_field(std::size_t index, const std::string& factor, std::string& fields,
                        std::string& assignments) const;

  // The root's constant factor (log2(e) times the root's own constants) taken into each term of
  // a sum at `base`: (score + b) * c becomes dot * (scale * c) + b * c, and ALiBi's
  // (score + float(kv - q) * slope) * c becomes dot * (scale * c) + float(kv - q) * (slope * c)
  // with slope * c computed once per block: a multiply and an FMA per score instead of a
  // multiply, a multiply, an add and the final multiply. Like the other merges, each term moves
  // by about an ulp. Returns the sum's expression, or empty when `base` is not a sum; the sum's
  // nodes that the expression replaces are added to skipped_.
  std::string distribute_factor(std::size_t base, double factor, std::int32_t score_node,
                                const std::vector<int>& uses, std::string& fields,
                                std::string& assignments);

  // Node `index` times `factor` (distribute_factor). `whole`: the node is the sum itself, whose
  // only use is the function's result.
  std::string term_times(std::size_t index, double factor, std::int32_t score_node,
                         const std::vector<int>& uses, std::string& fields,
                         std::string& assignments, bool whole = false);

  // The condition that tanh argument `index` is below kTanhSmallLimit in magnitude for every
  // |dot| <= bound, or empty when its form is not one whose magnitude grows with |dot|: a fold
  // (`dot * inv.field`), or `score * c`, `c * score`, `score / c` with c invariant (the score is
  // `dot * p.scale`).
  std::string small_tanh_term(std::size_t index, std::int32_t score_node) const;

  // Nodes that get a named value (everything but leaves, literals and params).
  bool is_computed(std::size_t index) const;

  // How another expression refers to node `index`.
  std::string reference(std::size_t index) const;

  // Operand `k` of `node`, converted to `type` when its own type differs.
  std::string operand(const GraphNode& node, std::size_t k, Type type) const;

  // Node `index`'s value as `type`.
  std::string converted(std::size_t index, Type type) const;

  // The common type of a comparison's operands (i32 with f32 compares as f32).
  Type comparison_type(const GraphNode& node) const;

  std::string call(const char* function, const GraphNode& node, Type type) const;

  std::string compare(const char* symbol, const GraphNode& node) const;

  // x / c for an f32 literal c: x * (1 / c) when 1 / c is a normal float (within an ulp of the
  // division, and a multiply instead of a division in the per-element code). Empty otherwise.
  std::string reciprocal_of_literal(const GraphNode& node) const;

  std::string load(const GraphNode& node) const;

  // `score * c`, `c * score` or `score / c` (operand `k` is the score) for an f32-typed node:
  // the constant c as a literal, else empty.
  std::string score_factor(const GraphNode& node, std::size_t k) const;

  std::string expression(std::size_t index) const;

  const Graph& graph_;
  std::string prefix_;
  // Expressions that replace a node's own (emit_log2_from_dot's merged multiplications).
  std::map<std::size_t, std::string> overrides_;
  std::set<std::size_t> skipped_;  // nodes emit_varying leaves out (merged into a factor)
  std::map<std::size_t, std::string> override_fields_;  // the Invariants field of each fold
  // tanh as CUDA's tanhf, as ir_tanh (emit_from_dot) or as ir_tanh_small (its small variant).
  enum class TanhForm { kLibrary, kFast, kSmall };
  TanhForm tanh_form_ = TanhForm::kLibrary;
  int factor_multiplies_ = 0;                                // emit_from_dot's (factor_multiplies)
  std::size_t staged_index_ = static_cast<std::size_t>(-1);  // stage_load's node
  std::string staged_;                                       // and its expression
  const Problem& problem_;
  const ModifierBindings& bindings_;
  std::vector<Interval> intervals_;  // each node's range over the problem (interval analysis)
  std::vector<bool> reachable_;
  std::vector<bool> varying_;
};

// Whether a mask graph is the literal true (keeps every element).
bool keeps_everything(const Graph& mask);
// Whether a graph is the literal `value`.
bool is_constant(const Graph& graph, double value);
// Two more spaces before every line (statements moved into a block).
std::string indent(const std::string& lines);

}  // namespace flexattn::cuda
