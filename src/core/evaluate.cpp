// Point evaluation of a canonical graph in float64: the oracle's modifier evaluator, and the
// op semantics the constant folder of Graph shares.
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/semantics.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn {
namespace {

// Two's-complement wrap to 32 bits, like i32 arithmetic on every engine.
double wrap_i32(std::int64_t value) {
  return static_cast<double>(
      static_cast<std::int32_t>(static_cast<std::uint32_t>(static_cast<std::uint64_t>(value))));
}

std::int64_t as_int(double value) { return static_cast<std::int64_t>(value); }

// Floor division (Python `//`), x / 0 == 0.
std::int64_t floor_divide(std::int64_t a, std::int64_t b) {
  if (b == 0) return 0;
  std::int64_t quotient = a / b;
  if (a % b != 0 && ((a < 0) != (b < 0))) --quotient;
  return quotient;
}

// Floor modulo: the result has the sign of the divisor, x % 0 == 0.
std::int64_t floor_modulo(std::int64_t a, std::int64_t b) {
  if (b == 0) return 0;
  std::int64_t remainder = a % b;
  if (remainder != 0 && ((remainder < 0) != (b < 0))) remainder += b;
  return remainder;
}

double floor_modulo(double a, double b) {
  if (b == 0.0) return 0.0;
  double remainder = std::fmod(a, b);
  if (remainder != 0.0 && ((remainder < 0.0) != (b < 0.0))) remainder += b;
  return remainder;
}

// int(x): truncation toward zero, NaN -> 0, saturating to the i32 range.
double to_int(double value) {
  if (std::isnan(value)) return 0.0;
  constexpr double kLowest = std::numeric_limits<std::int32_t>::min();
  constexpr double kHighest = std::numeric_limits<std::int32_t>::max();
  if (value <= kLowest) return kLowest;
  if (value >= kHighest) return kHighest;
  return std::trunc(value) + 0.0;  // + 0.0 turns -0.0 into 0.0
}

double boolean(bool value) { return value ? 1.0 : 0.0; }

// An f32 value computed in float64: what overflows float32 is +-inf, as on every engine that
// computes in float32 (the mantissa keeps float64's precision: this is the reference).
double f32_range(double value) {
  if (std::isfinite(value) && std::isinf(static_cast<float>(value))) {
    return std::copysign(std::numeric_limits<double>::infinity(), value);
  }
  return value;
}

}  // namespace

namespace {
double apply_op_unrounded(Op op, Type result_type, std::span<const double> args);
}  // namespace

double apply_op(Op op, Type result_type, std::span<const double> args) {
  const double value = apply_op_unrounded(op, result_type, args);
  return result_type == Type::kF32 ? f32_range(value) : value;
}

namespace {

double apply_op_unrounded(Op op, Type result_type, std::span<const double> args) {
  const bool integer = result_type == Type::kI32;
  const auto arg = [&](std::size_t i) { return args[i]; };
  switch (op) {
    case Op::kScore:
    case Op::kBatch:
    case Op::kHead:
    case Op::kQuery:
    case Op::kKey:
    case Op::kQueryLen:
    case Op::kKeyLen:
    case Op::kLiteral:
    case Op::kParam:
    case Op::kLoad:
      throw_internal(fmt::format("apply_op called on leaf '{}'", to_string(op)));
    case Op::kAdd:
      return integer ? wrap_i32(as_int(arg(0)) + as_int(arg(1))) : arg(0) + arg(1);
    case Op::kSub:
      return integer ? wrap_i32(as_int(arg(0)) - as_int(arg(1))) : arg(0) - arg(1);
    case Op::kMul:
      return integer ? wrap_i32(as_int(arg(0)) * as_int(arg(1))) : arg(0) * arg(1);
    case Op::kDiv:
      return integer ? wrap_i32(floor_divide(as_int(arg(0)), as_int(arg(1)))) : arg(0) / arg(1);
    case Op::kMod:
      return integer ? wrap_i32(floor_modulo(as_int(arg(0)), as_int(arg(1))))
                     : floor_modulo(arg(0), arg(1));
    case Op::kNeg:
      return integer ? wrap_i32(-as_int(arg(0))) : -arg(0);
    case Op::kLess:
      return boolean(arg(0) < arg(1));
    case Op::kLessEqual:
      return boolean(arg(0) <= arg(1));
    case Op::kGreater:
      return boolean(arg(0) > arg(1));
    case Op::kGreaterEqual:
      return boolean(arg(0) >= arg(1));
    case Op::kEqual:
      return boolean(arg(0) == arg(1));
    case Op::kNotEqual:
      return boolean(arg(0) != arg(1));
    case Op::kAnd:
      return boolean(arg(0) != 0.0 && arg(1) != 0.0);
    case Op::kOr:
      return boolean(arg(0) != 0.0 || arg(1) != 0.0);
    case Op::kNot:
      return boolean(arg(0) == 0.0);
    case Op::kWhere:
      return arg(0) != 0.0 ? arg(1) : arg(2);
    case Op::kMin:
      return std::fmin(arg(0), arg(1));
    case Op::kMax:
      return std::fmax(arg(0), arg(1));
    case Op::kClamp:
      return std::fmin(std::fmax(arg(0), arg(1)), arg(2));
    case Op::kAbs:
      return integer ? wrap_i32(std::abs(as_int(arg(0)))) : std::fabs(arg(0));
    case Op::kExp:
      return std::exp(arg(0));
    case Op::kExp2:
      return std::exp2(arg(0));
    case Op::kLog:
      return std::log(arg(0));
    case Op::kLog2:
      return std::log2(arg(0));
    case Op::kSqrt:
      return std::sqrt(arg(0));
    case Op::kRsqrt:
      return 1.0 / std::sqrt(arg(0));
    case Op::kTanh:
      return std::tanh(arg(0));
    case Op::kSigmoid:
      return 1.0 / (1.0 + std::exp(-arg(0)));
    case Op::kFloor:
      return std::floor(arg(0));
    case Op::kToFloat:
      return arg(0);
    case Op::kToInt:
      return to_int(arg(0));
  }
  throw_internal("apply_op: unknown op");
}

double load_value(const Graph& graph, const GraphNode& node, const Bindings& bindings,
                  const std::vector<double>& values) {
  const auto found = bindings.tensors.find(node.name);
  if (found == bindings.tensors.end()) {
    throw_invalid(fmt::format("tensor '{}' is not bound", node.name));
  }
  const TensorView& tensor = found->second;
  if (tensor.rank() != static_cast<int>(node.args.size())) {
    throw_invalid(fmt::format("tensor '{}' has rank {} but is loaded with {} indices", node.name,
                              tensor.rank(), node.args.size()));
  }
  std::int64_t offset = 0;
  for (std::size_t dim = 0; dim < node.args.size(); ++dim) {
    const auto index = static_cast<std::int64_t>(values[static_cast<std::size_t>(node.args[dim])]);
    if (index < 0 || index >= tensor.shape[dim]) {
      throw_internal(fmt::format("index {} of '{}' is {}, outside [0, {}) in {}", dim, node.name,
                                 index, tensor.shape[dim], graph.to_string()));
    }
    offset += index * tensor.strides[dim];
  }
  // An integer element becomes i32 by two's-complement wrap, as on every engine (and as every i32
  // operation of the IR wraps); a floating one past float32's range is +-inf.
  if (node.type == Type::kI32) return wrap_i32(tensor.load_index(offset));
  return f32_range(tensor.load(offset));
}

}  // namespace

void evaluate_all(const Graph& graph, const EvalPoint& point, const Bindings& bindings,
                  std::vector<double>& values) {
  const std::vector<GraphNode>& nodes = graph.nodes();
  values.assign(nodes.size(), 0.0);
  std::vector<double> operands;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const GraphNode& node = nodes[i];
    double value = 0.0;
    // f32 values take float32's range: the score and parameters here, literals when they are
    // built, operations in apply_op, loads in load_value.
    switch (node.op) {
      case Op::kScore:
        value = f32_range(point.score);
        break;
      case Op::kBatch:
        value = static_cast<double>(point.batch);
        break;
      case Op::kHead:
        value = static_cast<double>(point.head);
        break;
      case Op::kQuery:
        value = static_cast<double>(point.query);
        break;
      case Op::kKey:
        value = static_cast<double>(point.key);
        break;
      case Op::kQueryLen:
        value = static_cast<double>(point.query_length);
        break;
      case Op::kKeyLen:
        value = static_cast<double>(point.key_length);
        break;
      case Op::kLiteral:
        value = node.literal;
        break;
      case Op::kParam: {
        const auto found = bindings.params.find(node.name);
        if (found == bindings.params.end()) {
          throw_invalid(fmt::format("parameter '{}' is not bound", node.name));
        }
        value = f32_range(found->second);
        break;
      }
      case Op::kLoad:
        value = load_value(graph, node, bindings, values);
        break;
      default:
        if (!is_elementwise(node.op)) throw_internal("evaluate: unknown op");
        operands.clear();
        for (std::int32_t arg : node.args)
          operands.push_back(values[static_cast<std::size_t>(arg)]);
        value = apply_op(node.op, node.type, operands);
        break;
    }
    values[i] = value;
  }
}

double evaluate(const Graph& graph, const EvalPoint& point, const Bindings& bindings) {
  std::vector<double> values;
  evaluate_all(graph, point, bindings, values);
  return values[static_cast<std::size_t>(graph.root())];
}

}  // namespace flexattn
