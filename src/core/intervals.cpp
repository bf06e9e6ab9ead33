// Interval analysis over a canonical Graph: the range of every node, tensor-load bounds checks and
// mask tile classification.
//
// Soundness is against both evaluators of the IR: `evaluate` (float64) and the engines (f32
// arithmetic, i32 arithmetic that wraps). Hence:
// - i32 intervals are exact integer bounds; a result that can leave the i32 range becomes the
//   whole i32 range (i32 arithmetic wraps, in `evaluate` as on the engines).
// - f32 bounds are rounded outwards to the float grid (exact for integers below 2^24), with one
//   more float step for library functions (exp, log, tanh, ...) that are not correctly rounded.
// - f32 values may be NaN; a NaN flag per node keeps comparisons with them undecided.
// - Data (score, parameters, float tensor loads) is (-inf, inf) and may be NaN; integer tensor
//   loads are the whole i32 range.
// - bool is [0, 1]; [0, 0] is "always false", [1, 1] "always true". An empty leaf range (lo > hi)
//   makes every node that depends on it empty.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/graph_rebuild.hpp"
#include "core/interval_arithmetic.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn {
namespace {

using interval_math::Range;

Range leaf_range(const Interval& interval) { return interval_math::integer_leaf(interval); }

class IntervalAnalysis {
 public:
  IntervalAnalysis(const Graph& graph, const LeafRanges& ranges) : ranges_(ranges) {
    values_.reserve(graph.nodes().size());
    for (std::size_t index = 0; index < graph.nodes().size(); ++index) {
      values_.push_back(node_range(graph.nodes()[index]));
    }
  }

  const std::vector<Range>& values() const { return values_; }

 private:
  const Range& arg(const GraphNode& node, std::size_t position) const {
    return values_[static_cast<std::size_t>(node.args[position])];
  }

  Range node_range(const GraphNode& node) const {
    bool any_empty = false;
    for (std::int32_t index : node.args) {
      any_empty = any_empty || interval_math::is_empty(values_[static_cast<std::size_t>(index)]);
    }
    if (any_empty) return interval_math::empty_range();
    const bool is_integer = node.type == Type::kI32;
    switch (node.op) {
      case Op::kScore:
      case Op::kParam:
        return interval_math::unknown_float();
      case Op::kBatch:
        return leaf_range(ranges_.batch);
      case Op::kHead:
        return leaf_range(ranges_.head);
      case Op::kQuery:
        return leaf_range(ranges_.query);
      case Op::kKey:
        return leaf_range(ranges_.key);
      case Op::kQueryLen:
        return leaf_range(ranges_.query_length);
      case Op::kKeyLen:
        return leaf_range(ranges_.key_length);
      case Op::kLiteral:
        return interval_math::literal(node.literal, node.type);
      case Op::kLoad:
        return is_integer ? interval_math::whole_i32() : interval_math::unknown_float();
      case Op::kAdd:
        return is_integer ? interval_math::add_i32(arg(node, 0), arg(node, 1))
                          : interval_math::add_f32(arg(node, 0), arg(node, 1));
      case Op::kSub:
        return is_integer
                   ? interval_math::add_i32(arg(node, 0), interval_math::negate_any(arg(node, 1)))
                   : interval_math::add_f32(arg(node, 0), interval_math::negate_any(arg(node, 1)));
      case Op::kMul:
        return is_integer ? interval_math::mul_i32(arg(node, 0), arg(node, 1))
                          : interval_math::mul_f32(arg(node, 0), arg(node, 1));
      case Op::kDiv:
        return is_integer ? interval_math::div_i32(arg(node, 0), arg(node, 1))
                          : interval_math::div_f32(arg(node, 0), arg(node, 1));
      case Op::kMod:
        return is_integer ? interval_math::mod_i32(arg(node, 0), arg(node, 1))
                          : interval_math::mod_f32(arg(node, 0), arg(node, 1));
      case Op::kNeg:
        return is_integer ? interval_math::wrap_i32(interval_math::negate_any(arg(node, 0)))
                          : interval_math::negate_any(arg(node, 0));
      case Op::kLess:
        return interval_math::compare_less(arg(node, 0), arg(node, 1), /*or_equal=*/false);
      case Op::kLessEqual:
        return interval_math::compare_less(arg(node, 0), arg(node, 1), /*or_equal=*/true);
      case Op::kGreater:
        return interval_math::compare_less(arg(node, 1), arg(node, 0), /*or_equal=*/false);
      case Op::kGreaterEqual:
        return interval_math::compare_less(arg(node, 1), arg(node, 0), /*or_equal=*/true);
      case Op::kEqual:
        return interval_math::compare_equal(arg(node, 0), arg(node, 1));
      case Op::kNotEqual:
        return interval_math::logical_not(interval_math::compare_equal(arg(node, 0), arg(node, 1)));
      case Op::kAnd:
        return interval_math::logical_and(arg(node, 0), arg(node, 1));
      case Op::kOr:
        return interval_math::logical_or(arg(node, 0), arg(node, 1));
      case Op::kNot:
        return interval_math::logical_not(arg(node, 0));
      case Op::kWhere:
        return interval_math::select(arg(node, 0), arg(node, 1), arg(node, 2));
      case Op::kMin:
        return interval_math::minimum(arg(node, 0), arg(node, 1));
      case Op::kMax:
        return interval_math::maximum(arg(node, 0), arg(node, 1));
      case Op::kClamp:
        return interval_math::minimum(interval_math::maximum(arg(node, 0), arg(node, 1)),
                                      arg(node, 2));
      case Op::kAbs:
        return is_integer ? interval_math::wrap_i32(interval_math::absolute(arg(node, 0)))
                          : interval_math::absolute(arg(node, 0));
      case Op::kExp:
        return interval_math::increasing_function(
            arg(node, 0), [](double x) { return std::exp(x); }, {0.0, interval_math::kInfinity});
      case Op::kExp2:
        return interval_math::increasing_function(
            arg(node, 0), [](double x) { return std::exp2(x); }, {0.0, interval_math::kInfinity});
      case Op::kLog:
        return interval_math::nonnegative_domain_function(
            arg(node, 0), [](double x) { return std::log(x); }, /*decreasing=*/false,
            {-interval_math::kInfinity, interval_math::kInfinity});
      case Op::kLog2:
        return interval_math::nonnegative_domain_function(
            arg(node, 0), [](double x) { return std::log2(x); }, /*decreasing=*/false,
            {-interval_math::kInfinity, interval_math::kInfinity});
      case Op::kSqrt:
        return interval_math::nonnegative_domain_function(
            arg(node, 0), [](double x) { return std::sqrt(x); },
            /*decreasing=*/false, {0.0, interval_math::kInfinity});
      case Op::kRsqrt:
        return interval_math::nonnegative_domain_function(
            arg(node, 0), [](double x) { return 1.0 / std::sqrt(x); },
            /*decreasing=*/true, {0.0, interval_math::kInfinity});
      case Op::kTanh:
        return interval_math::increasing_function(
            arg(node, 0), [](double x) { return std::tanh(x); }, {-1.0, 1.0});
      case Op::kSigmoid:
        return interval_math::increasing_function(
            arg(node, 0), [](double x) { return 1.0 / (1.0 + std::exp(-x)); }, {0.0, 1.0});
      case Op::kFloor:
        return interval_math::floor_range(arg(node, 0));
      case Op::kToFloat:
        return interval_math::round_to_float_grid(arg(node, 0), /*extra_steps=*/0);
      case Op::kToInt:
        return interval_math::to_int_range(arg(node, 0));
    }
    throw_internal("interval analysis met a graph node with an unknown op");
  }

  const LeafRanges& ranges_;
  std::vector<Range> values_;
};

// Whether each node's value depends on data the analysis cannot bound: the score, parameters
// and tensor loads.
std::vector<bool> data_dependence(const Graph& graph) {
  std::vector<bool> depends(graph.nodes().size(), false);
  for (std::size_t index = 0; index < graph.nodes().size(); ++index) {
    const GraphNode& node = graph.nodes()[index];
    bool value = node.op == Op::kScore || node.op == Op::kParam || node.op == Op::kLoad;
    for (std::int32_t arg : node.args) value = value || depends[static_cast<std::size_t>(arg)];
    depends[index] = value;
  }
  return depends;
}

std::string bound_tensor_names(const std::map<std::string, std::vector<std::int64_t>>& shapes) {
  if (shapes.empty()) return "none";
  std::string names;
  for (const auto& [name, shape] : shapes) names += (names.empty() ? "" : ", ") + name;
  return names;
}

std::string format_bound(double value) {
  return fmt::format("{}", static_cast<std::int64_t>(value));
}

}  // namespace

std::vector<Interval> node_intervals(const Graph& graph, const LeafRanges& ranges) {
  IntervalAnalysis analysis(graph, ranges);
  std::vector<Interval> intervals;
  intervals.reserve(analysis.values().size());
  for (const Range& range : analysis.values()) intervals.push_back(range.interval);
  return intervals;
}

Graph check_and_clamp_loads(const Graph& graph, const LeafRanges& ranges,
                            const std::map<std::string, std::vector<std::int64_t>>& shapes) {
  IntervalAnalysis analysis(graph, ranges);
  const std::vector<bool> depends = data_dependence(graph);
  const std::vector<ir::Expr> original = detail::node_expressions(graph);
  std::vector<ir::Expr> rewritten;
  rewritten.reserve(original.size());
  bool clamped_any = false;
  for (std::size_t index = 0; index < graph.nodes().size(); ++index) {
    const GraphNode& node = graph.nodes()[index];
    std::vector<ir::Expr> args;
    args.reserve(node.args.size());
    for (std::int32_t arg : node.args) args.push_back(rewritten[static_cast<std::size_t>(arg)]);
    if (node.op == Op::kLoad) {
      const std::string load_text = original[index].to_string();
      const auto shape = shapes.find(node.name);
      if (shape == shapes.end()) {
        throw_invalid(fmt::format("tensor load {}: no tensor named '{}' is bound (bound: {})",
                                  load_text, node.name, bound_tensor_names(shapes)));
      }
      if (shape->second.size() != node.args.size()) {
        throw_invalid(fmt::format("tensor load {}: {} has rank {} but is read with {} indices",
                                  load_text, node.name, shape->second.size(), node.args.size()));
      }
      for (std::size_t dimension = 0; dimension < node.args.size(); ++dimension) {
        const std::size_t index_node = static_cast<std::size_t>(node.args[dimension]);
        const Interval range = analysis.values()[index_node].interval;
        const std::int64_t extent = shape->second[dimension];
        if (range.lo > range.hi) continue;  // never evaluated: an empty region
        if (range.lo >= 0.0 && range.hi <= static_cast<double>(extent - 1)) continue;
        if (!depends[index_node] || extent <= 0) {
          throw_invalid(fmt::format(
              "tensor load {}: index {} ranges over [{}, {}] but {} has {} entries along "
              "dimension {} (clamp the index or enlarge the tensor)",
              load_text, dimension, format_bound(range.lo), format_bound(range.hi), node.name,
              extent, dimension));
        }
        args[dimension] =
            ir::clamp(args[dimension], ir::literal_i32(0), ir::literal_i32(extent - 1));
        clamped_any = true;
      }
    }
    rewritten.push_back(detail::rebuild_node(node, std::move(args)));
  }
  if (!clamped_any) return graph;
  return Graph(rewritten[static_cast<std::size_t>(graph.root())]);
}

TileClass classify_tile(const Graph& mask, const LeafRanges& ranges, const TileRect& tile) {
  if (mask.type() != Type::kBool) {
    throw_invalid(fmt::format("classify_tile needs a bool mask, got a {} expression: {}",
                              to_string(mask.type()), mask.to_string()));
  }
  if (tile.query_end <= tile.query_begin || tile.key_end <= tile.key_begin) {
    return TileClass::kAllFalse;  // no element to keep
  }
  LeafRanges restricted = ranges;
  restricted.query = {static_cast<double>(tile.query_begin),
                      static_cast<double>(tile.query_end - 1)};
  restricted.key = {static_cast<double>(tile.key_begin), static_cast<double>(tile.key_end - 1)};
  IntervalAnalysis analysis(mask, restricted);
  const Interval root = analysis.values()[static_cast<std::size_t>(mask.root())].interval;
  if (root.lo > root.hi) return TileClass::kAllFalse;  // another leaf's range is empty
  if (root.hi <= 0.0) return TileClass::kAllFalse;
  if (root.lo >= 1.0) return TileClass::kAllTrue;
  return TileClass::kMixed;
}

std::string_view to_string(TileClass tile_class) {
  switch (tile_class) {
    case TileClass::kAllFalse:
      return "all_false";
    case TileClass::kAllTrue:
      return "all_true";
    case TileClass::kMixed:
      return "mixed";
  }
  return "unknown";
}

}  // namespace flexattn
