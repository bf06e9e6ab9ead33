// Symbolic forward-mode differentiation of a canonical score modifier.
//
// Every node gets the derivative of its value with respect to one variable (the score, or the
// value of one float tensor load treated as an independent input), built as a builder expression
// from the derivatives of its operands; the result is canonicalised with Graph(expr). A missing
// derivative means "identically zero", so constant branches never grow the graph.
//
// Conventions where the modifier is not differentiable (the one-sided derivative is taken):
// - min(a, b): the derivative of `a` when a <= b, else of `b`; max(a, b): of `a` when a >= b.
//   `a` is the first operand of the canonical node (commutative operands are ordered there).
// - clamp(x, lo, hi) == min(max(x, lo), hi): at x == lo or x == hi the derivative follows `x`.
// - abs(x): at x == 0 the derivative is that of `x` (as for x > 0).
// - where(c, a, b): the derivative of the selected branch; `c` itself contributes nothing.
// - floor, int(x), comparisons, logic, i32 arithmetic and integer tensor loads are piecewise
//   constant: derivative 0. float(x) of an i32 or bool is therefore 0 as well.
// - a % b on f32 is a - b * floor(a / b): d/da = 1 and d/db = -floor(a / b), floor being locally
//   constant. (At b == 0, where a % 0 == 0, this formula is not the derivative of the constant.)
// - Parameters are constants; only tensors have derivatives.
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/graph_rebuild.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn {
namespace {

using ir::Expr;
using Derivative = std::optional<Expr>;  // std::nullopt: identically zero

bool is_literal_value(const Expr& expr, double value) {
  return expr.op() == Op::kLiteral && expr.type() == Type::kF32 && expr.node().literal == value;
}

Expr zero() { return ir::literal_f32(0.0); }

Derivative plus(const Derivative& a, const Derivative& b) {
  if (!a) return b;
  if (!b) return a;
  return *a + *b;
}

Derivative negate(const Derivative& a) {
  if (!a) return std::nullopt;
  return -*a;
}

Derivative minus(const Derivative& a, const Derivative& b) {
  if (!b) return a;
  if (!a) return -*b;
  return *a - *b;
}

// derivative * factor, skipping the product for a zero derivative or a unit factor.
Derivative times(const Derivative& derivative, const Expr& factor) {
  if (!derivative) return std::nullopt;
  if (is_literal_value(factor, 1.0)) return derivative;
  if (is_literal_value(*derivative, 1.0)) return factor;
  return *derivative * factor;
}

Derivative select(const Expr& condition, const Derivative& if_true, const Derivative& if_false) {
  if (!if_true && !if_false) return std::nullopt;
  return ir::where(condition, if_true.value_or(zero()), if_false.value_or(zero()));
}

class ForwardDifferentiator {
 public:
  // `expressions` are the builder expressions of the nodes of `graph` (node_expressions).
  ForwardDifferentiator(const Graph& graph, const std::vector<Expr>& expressions)
      : graph_(graph), expressions_(expressions) {}

  // The derivative of the root with respect to the value of node `variable`.
  Derivative root_derivative(std::int32_t variable) {
    variable_ = variable;
    derivatives_.assign(graph_.nodes().size(), std::nullopt);
    for (std::size_t index = 0; index < graph_.nodes().size(); ++index) {
      derivatives_[index] = node_derivative(static_cast<std::int32_t>(index));
    }
    return derivatives_[static_cast<std::size_t>(graph_.root())];
  }

 private:
  const Expr& value(std::int32_t index) const {
    return expressions_[static_cast<std::size_t>(index)];
  }
  const Derivative& derivative(std::int32_t index) const {
    return derivatives_[static_cast<std::size_t>(index)];
  }

  Derivative node_derivative(std::int32_t index) const {
    const GraphNode& node = graph_.node(index);
    // i32 and bool values are piecewise constant in every f32 input.
    if (node.type != Type::kF32) return std::nullopt;
    const std::vector<std::int32_t>& args = node.args;
    const Expr& self = value(index);
    auto arg = [&](std::size_t position) -> const Expr& { return value(args[position]); };
    auto darg = [&](std::size_t position) -> const Derivative& {
      return derivative(args[position]);
    };
    switch (node.op) {
      case Op::kScore:
      case Op::kLoad:
        if (index == variable_) return ir::literal_f32(1.0);
        return std::nullopt;
      case Op::kBatch:
      case Op::kHead:
      case Op::kQuery:
      case Op::kKey:
      case Op::kQueryLen:
      case Op::kKeyLen:
      case Op::kLiteral:
      case Op::kParam:
        return std::nullopt;
      case Op::kAdd:
        return plus(darg(0), darg(1));
      case Op::kSub:
        return minus(darg(0), darg(1));
      case Op::kMul:
        return plus(times(darg(0), arg(1)), times(darg(1), arg(0)));
      case Op::kDiv:
        // d(a / b) = (da - (a / b) db) / b
        return times(minus(darg(0), times(darg(1), self)), 1.0 / arg(1));
      case Op::kMod:
        return minus(darg(0), times(darg(1), ir::floor(arg(0) / arg(1))));
      case Op::kNeg:
        return negate(darg(0));
      case Op::kLess:
      case Op::kLessEqual:
      case Op::kGreater:
      case Op::kGreaterEqual:
      case Op::kEqual:
      case Op::kNotEqual:
      case Op::kAnd:
      case Op::kOr:
      case Op::kNot:
        return std::nullopt;
      case Op::kWhere:
        return select(arg(0), darg(1), darg(2));
      case Op::kMin:
        return select(arg(0) <= arg(1), darg(0), darg(1));
      case Op::kMax:
        return select(arg(0) >= arg(1), darg(0), darg(1));
      case Op::kClamp:
        return clamp_derivative(arg(0), arg(1), arg(2), darg(0), darg(1), darg(2));
      case Op::kAbs:
        return select(arg(0) >= 0.0, darg(0), negate(darg(0)));
      case Op::kExp:
        return times(darg(0), self);
      case Op::kExp2:
        return times(darg(0), self * std::numbers::ln2);
      case Op::kLog:
        return times(darg(0), 1.0 / arg(0));
      case Op::kLog2:
        return times(darg(0), 1.0 / (arg(0) * std::numbers::ln2));
      case Op::kSqrt:
        return times(darg(0), 0.5 / self);
      case Op::kRsqrt:
        // d x^(-1/2) = -1/2 x^(-3/2) = -1/2 rsqrt(x) / x
        return times(darg(0), -0.5 * self / arg(0));
      case Op::kTanh:
        return times(darg(0), 1.0 - self * self);
      case Op::kSigmoid:
        return times(darg(0), self * (1.0 - self));
      case Op::kFloor:
        return std::nullopt;
      case Op::kToFloat:
        return darg(0);  // zero unless the operand is already f32
      case Op::kToInt:
        return std::nullopt;
    }
    throw_internal("differentiation met a graph node with an unknown op");
  }

  // clamp(x, lo, hi) == min(max(x, lo), hi): where(x >= lo, where(x <= hi, dx, dhi),
  // where(lo <= hi, dlo, dhi)); ties follow x.
  static Derivative clamp_derivative(const Expr& x, const Expr& lo, const Expr& hi,
                                     const Derivative& dx, const Derivative& dlo,
                                     const Derivative& dhi) {
    if (!dlo && !dhi) return select(x >= lo && x <= hi, dx, std::nullopt);
    return select(x >= lo, select(x <= hi, dx, dhi), select(lo <= hi, dlo, dhi));
  }

  const Graph& graph_;
  const std::vector<Expr>& expressions_;
  std::int32_t variable_ = -1;
  std::vector<Derivative> derivatives_;
};

Graph to_graph(const Derivative& derivative) { return Graph(derivative.value_or(zero())); }

void require_score_modifier(const Graph& score_mod, const char* what) {
  if (score_mod.type() != Type::kF32) {
    throw_invalid(std::string(what) + " needs an f32 score modifier, got a " +
                  std::string(to_string(score_mod.type())) +
                  " expression: " + score_mod.to_string());
  }
}

}  // namespace

Graph derivative_wrt_score(const Graph& score_mod) {
  require_score_modifier(score_mod, "derivative_wrt_score");
  std::int32_t score_node = -1;
  for (std::size_t index = 0; index < score_mod.nodes().size(); ++index) {
    if (score_mod.nodes()[index].op == Op::kScore) score_node = static_cast<std::int32_t>(index);
  }
  if (score_node < 0) return to_graph(std::nullopt);
  const std::vector<Expr> expressions = detail::node_expressions(score_mod);
  ForwardDifferentiator differentiator(score_mod, expressions);
  return to_graph(differentiator.root_derivative(score_node));
}

std::vector<LoadDerivative> derivatives_wrt_tensors(const Graph& score_mod) {
  require_score_modifier(score_mod, "derivatives_wrt_tensors");
  const std::vector<Expr> expressions = detail::node_expressions(score_mod);
  ForwardDifferentiator differentiator(score_mod, expressions);
  std::vector<LoadDerivative> result;
  // Hash-consing makes a load with the same tensor and the same index nodes one node; the hash
  // comparison below also merges equal loads of a graph that was not fully deduplicated.
  std::vector<std::uint64_t> seen_hashes;
  for (std::size_t index = 0; index < score_mod.nodes().size(); ++index) {
    const GraphNode& node = score_mod.nodes()[index];
    if (node.op != Op::kLoad || node.type != Type::kF32) continue;
    bool seen = false;
    for (std::uint64_t hash : seen_hashes) seen = seen || hash == node.hash;
    if (seen) continue;
    seen_hashes.push_back(node.hash);
    LoadDerivative entry;
    entry.tensor = node.name;
    for (std::int32_t arg : node.args) {
      entry.indices.emplace_back(expressions[static_cast<std::size_t>(arg)]);
    }
    // Every node with this hash is the same load: their derivatives add up.
    Derivative total;
    for (std::size_t other = index; other < score_mod.nodes().size(); ++other) {
      const GraphNode& candidate = score_mod.nodes()[other];
      if (candidate.op == Op::kLoad && candidate.hash == node.hash) {
        total = plus(total, differentiator.root_derivative(static_cast<std::int32_t>(other)));
      }
    }
    entry.derivative = to_graph(total);
    result.push_back(std::move(entry));
  }
  return result;
}

}  // namespace flexattn
