#include "engines/cuda/lifted_evaluate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

namespace flexattn::cuda {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();
// ir_small_int_to_float converts exactly the i32 values of [-2^22, 2^22) (device_math.cuh).
constexpr double kSmallIntLimit = 4194304.0;

[[noreturn]] void fail(std::string what) { throw LiftedEvaluationError{std::move(what)}; }

// The result of a float operation: `error` (propagated from the operands) plus the operation's
// own rounding; an infinite or NaN result is exact (the special values compare exactly).
// float32's range: a result at or past this rounds to +-inf on the device (as the IR's f32 does).
const double kFloatOverflow = std::ldexp(1.0, 128) * (1.0 - std::ldexp(1.0, -25));

LiftedValue rounded(double value, double error, bool ambiguous) {
  if (!std::isfinite(value)) return {value, 0.0, ambiguous};
  if (std::isnan(error)) error = kInfinity;
  error += kUlpsPerOperation * kUnitRoundoff * std::fabs(value);
  if (std::fabs(value) - error >= kFloatOverflow)
    return {std::copysign(kInfinity, value), 0.0, ambiguous};
  return {value, error, ambiguous || std::fabs(value) + error >= kFloatOverflow};
}

// The i32 wrap of the device's integer arithmetic.
double wrap_i32(double value) {
  const auto wide = static_cast<std::int64_t>(value);
  return static_cast<double>(static_cast<std::int32_t>(static_cast<std::uint32_t>(wide)));
}

// Whether `function` (floor, truncation) takes the same value over [x - e, x + e].
template <class Function>
bool steady(const LiftedValue& x, Function function) {
  if (x.error == 0.0 || !std::isfinite(x.value)) return true;
  return function(x.value - x.error) == function(x.value + x.error);
}

double truncate_to_int(double x) {
  if (std::isnan(x)) return 0.0;
  const double truncated = std::trunc(x);
  return std::clamp(truncated, -2147483648.0, 2147483647.0);
}

// The largest |tanh'| over [x - e, x + e].
double tanh_slope(const LiftedValue& x) {
  const double nearest = std::max(std::fabs(x.value) - x.error, 0.0);
  const double t = std::tanh(nearest);
  return 1.0 - t * t;
}

// ir_tanh_small's polynomial (device_math.cuh), in float64 with its float32 coefficients: equal
// to tanh within an ulp below kTanhSmallLimit, and far from it above.
double tanh_small(double x) {
  const double square = x * x;
  double poly = -0.0058951606042683125f * square + 0.020795974880456924f;
  poly = poly * square + -0.053783830255270004f;
  poly = poly * square + 0.13331924378871918f;
  poly = poly * square + -0.33333298563957214f;
  return x * square * poly + x;
}

bool same_dtype(const std::string& loader, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return loader == "load_tensor_f32";
    case DType::kF64:
      return loader == "load_tensor_f64";
    case DType::kBF16:
      return loader == "load_tensor_bf16" || loader == "staged_bf16";
    case DType::kF16:
      return loader == "load_tensor_f16" || loader == "staged_f16";
    case DType::kI32:
      return loader == "load_tensor_i32";
    case DType::kI64:
      return loader == "load_tensor_i64";
  }
  return false;
}

// Element `offset` of a contiguous tensor: its synthetic value.
double element_at(const SyntheticTensor& tensor, std::int64_t offset, const char* what) {
  std::int64_t elements = 1;
  for (std::int64_t extent : tensor.shape) elements *= extent;
  if (offset < 0 || offset >= elements) {
    fail(fmt::format("{} offset {} outside its tensor of {} elements", what, offset, elements));
  }
  std::vector<std::int64_t> indices(tensor.shape.size());
  for (std::size_t k = tensor.shape.size(); k-- > 0;) {
    indices[k] = offset % tensor.shape[k];
    offset /= tensor.shape[k];
  }
  return synthetic_element(tensor, indices);
}

}  // namespace

double synthetic_element(const SyntheticTensor& tensor, const std::vector<std::int64_t>& indices) {
  std::int64_t hash = tensor.salt;
  for (std::int64_t index : indices) {
    hash = (hash * kElementHashBase + index % kElementHashPrime) % kElementHashPrime;
  }
  if (!is_floating(tensor.dtype)) return static_cast<double>(hash % kElementIds);
  return static_cast<double>(hash % kElementLevels - kElementLevels / 2) * kElementStep;
}

void LiftedEvaluator::prepare(const LiftedPoint& point) {
  invariants_.clear();
  point_ = &point;
  memo_.assign(modifier_.nodes.size(), LiftedValue{});
  done_.assign(modifier_.nodes.size(), false);
  for (const auto& [field, value] : modifier_.prepare) invariants_[field] = evaluate(value);
}

LiftedValue LiftedEvaluator::function(const std::string& name, const LiftedPoint& point) {
  const auto found = modifier_.functions.find(name);
  if (found == modifier_.functions.end()) fail(fmt::format("{} is missing", name));
  return node(found->second.value, point);
}

LiftedValue LiftedEvaluator::node(int node, const LiftedPoint& point) {
  point_ = &point;
  memo_.assign(modifier_.nodes.size(), LiftedValue{});
  done_.assign(modifier_.nodes.size(), false);
  return evaluate(node);
}

LiftedValue LiftedEvaluator::evaluate(int index) {
  const auto at = static_cast<std::size_t>(index);
  if (done_[at]) return memo_[at];
  const LiftedNode& node = modifier_.nodes[at];
  const LiftedPoint& point = *point_;
  LiftedValue result;
  switch (node.kind) {
    case LiftedKind::kLiteral:
      // A float literal is the float32 rounding of what the generator meant.
      result = {node.number,
                node.type == LiftedType::kFloat && std::isfinite(node.number)
                    ? kUnitRoundoff * std::fabs(node.number)
                    : 0.0,
                false};
      break;
    case LiftedKind::kLeaf: {
      const std::string& name = node.name;
      if (name == "p.scale") {
        const double single = static_cast<float>(environment_.scale);
        result = {single, std::fabs(single - environment_.scale), false};
      } else {
        const double value = name == "score"       ? point.score
                             : name == "dot"       ? point.dot
                             : name == "bound"     ? point.bound
                             : name == "q"         ? static_cast<double>(point.q)
                             : name == "kv"        ? static_cast<double>(point.kv)
                             : name == "at.batch"  ? static_cast<double>(point.batch)
                             : name == "at.head"   ? static_cast<double>(point.head)
                             : name == "at.q_len"  ? static_cast<double>(point.q_len)
                             : name == "at.kv_len" ? static_cast<double>(point.kv_len)
                                                   : std::numeric_limits<double>::quiet_NaN();
        if (std::isnan(value) && name != "score" && name != "dot") {
          fail(fmt::format("{} has no value here", name));
        }
        result = {value, 0.0, false};
      }
      break;
    }
    case LiftedKind::kParam: {
      if (node.slot < 0 || static_cast<std::size_t>(node.slot) >= environment_.params.size()) {
        fail(fmt::format("p.params[{}] is no parameter slot", node.slot));
      }
      const double exact = environment_.params[static_cast<std::size_t>(node.slot)];
      const double single = static_cast<float>(exact);
      result = {single, std::isfinite(single) ? std::fabs(single - exact) : 0.0, false};
      break;
    }
    case LiftedKind::kInvariant: {
      const auto found = invariants_.find(node.name);
      if (found == invariants_.end()) fail(fmt::format("inv.{} read before prepare()", node.name));
      result = found->second;
      break;
    }
    case LiftedKind::kCall:
      result = call(node);
      break;
    case LiftedKind::kCast: {
      const LiftedValue x = evaluate(node.args[0]);
      const LiftedType from = modifier_.nodes[static_cast<std::size_t>(node.args[0])].type;
      if (node.type == LiftedType::kFloat) {
        const double single = static_cast<float>(x.value);
        result = {single, x.error + std::fabs(single - x.value), x.ambiguous};
      } else if (from == LiftedType::kFloat) {
        result = {truncate_to_int(x.value), 0.0, x.ambiguous || !steady(x, truncate_to_int)};
      } else {
        result = {x.value, 0.0, x.ambiguous};
      }
      break;
    }
    case LiftedKind::kArithmetic: {
      const LiftedValue a = evaluate(node.args[0]);
      const LiftedValue b = evaluate(node.args[1]);
      const bool ambiguous = a.ambiguous || b.ambiguous;
      const char symbol = node.name[0];
      if (node.type != LiftedType::kFloat) {
        const double value = symbol == '+'   ? a.value + b.value
                             : symbol == '-' ? a.value - b.value
                             : symbol == '*' ? a.value * b.value
                                             : std::trunc(a.value / b.value);
        if (symbol == '/' && b.value == 0.0) fail("an integer division by zero");
        result = {value, 0.0, ambiguous};
      } else if (symbol == '*') {
        const double value = a.value * b.value;
        result = rounded(
            value, std::fabs(a.value) * b.error + std::fabs(b.value) * a.error + a.error * b.error,
            ambiguous);
      } else if (symbol == '/') {
        const double value = a.value / b.value;
        const double margin = std::fabs(b.value) - b.error;
        result = rounded(value,
                         margin > 0.0 ? (a.error + std::fabs(value) * b.error) / margin : kInfinity,
                         ambiguous);
      } else {
        const double value = symbol == '+' ? a.value + b.value : a.value - b.value;
        result = rounded(value, a.error + b.error, ambiguous);
      }
      break;
    }
    case LiftedKind::kCompare: {
      const LiftedValue a = evaluate(node.args[0]);
      const LiftedValue b = evaluate(node.args[1]);
      const std::string& op = node.name;
      const bool value = op == "<"    ? a.value < b.value
                         : op == "<=" ? a.value <= b.value
                         : op == ">"  ? a.value > b.value
                         : op == ">=" ? a.value >= b.value
                         : op == "==" ? a.value == b.value
                                      : a.value != b.value;
      const double margin = a.error + b.error;
      const bool close = margin > 0.0 && std::fabs(a.value - b.value) <= margin;
      result = {value ? 1.0 : 0.0, 0.0, a.ambiguous || b.ambiguous || close};
      break;
    }
    case LiftedKind::kAnd:
    case LiftedKind::kOr: {
      const LiftedValue a = evaluate(node.args[0]);
      const LiftedValue b = evaluate(node.args[1]);
      const bool decided = node.kind == LiftedKind::kOr;
      // A decided operand that fixes the result (false && x, true || x) hides the other's doubt.
      if (!a.ambiguous && (a.value != 0.0) == decided) {
        result = a;
      } else if (!b.ambiguous && (b.value != 0.0) == decided) {
        result = b;
      } else {
        result = {decided ? 0.0 : 1.0, 0.0, a.ambiguous || b.ambiguous};
      }
      break;
    }
    case LiftedKind::kNot: {
      const LiftedValue a = evaluate(node.args[0]);
      result = {a.value != 0.0 ? 0.0 : 1.0, 0.0, a.ambiguous};
      break;
    }
    case LiftedKind::kSelect: {
      const LiftedValue condition = evaluate(node.args[0]);
      result = evaluate(condition.value != 0.0 ? node.args[1] : node.args[2]);
      result.ambiguous = result.ambiguous || condition.ambiguous;
      break;
    }
    case LiftedKind::kLoad:
      result = load(node);
      break;
    case LiftedKind::kStagedPresent:
      result = {point.staged ? 1.0 : 0.0, 0.0, false};
      break;
    case LiftedKind::kStagedElement:
      result = staged_element(node);
      break;
    case LiftedKind::kFunctionCall: {
      const auto found = modifier_.functions.find(node.name);
      if (found == modifier_.functions.end()) fail(fmt::format("{} is missing", node.name));
      result = evaluate(found->second.value);
      break;
    }
  }
  memo_[at] = result;
  done_[at] = true;
  return result;
}

LiftedValue LiftedEvaluator::call(const LiftedNode& node) {
  std::vector<LiftedValue> args;
  args.reserve(node.args.size());
  for (int arg : node.args) args.push_back(evaluate(arg));
  const LiftedType operand = modifier_.nodes[static_cast<std::size_t>(node.args[0])].type;
  if (operand == LiftedType::kInt) return integer_call(node, args);
  return float_call(node, args);
}

// The i32 overloads of device_math.cuh: wrapping arithmetic, floor division and Python's modulo
// with x / 0 == x % 0 == 0; ir_small_int_to_float within its range.
LiftedValue LiftedEvaluator::integer_call(const LiftedNode& node,
                                          const std::vector<LiftedValue>& args) const {
  bool ambiguous = false;
  for (const LiftedValue& arg : args) ambiguous = ambiguous || arg.ambiguous;
  const std::string& name = node.name;
  const double a = args[0].value;
  const double b = args.size() > 1 ? args[1].value : 0.0;
  double value = 0.0;
  if (name == "ir_small_int_to_float") {
    if (a < -kSmallIntLimit || a >= kSmallIntLimit) {
      fail(fmt::format("ir_small_int_to_float({}) outside [-2^22, 2^22)", a));
    }
    return {a, 0.0, ambiguous};
  }
  if (name == "ir_add") {
    value = wrap_i32(a + b);
  } else if (name == "ir_sub") {
    value = wrap_i32(a - b);
  } else if (name == "ir_mul") {
    value = wrap_i32(a * b);
  } else if (name == "ir_neg") {
    value = wrap_i32(-a);
  } else if (name == "ir_div") {
    value = b == 0.0 ? 0.0 : wrap_i32(std::floor(a / b));
  } else if (name == "ir_mod") {
    value = b == 0.0 ? 0.0 : a - b * std::floor(a / b);
  } else if (name == "ir_min") {
    value = std::min(a, b);
  } else if (name == "ir_max") {
    value = std::max(a, b);
  } else if (name == "ir_clamp") {
    value = std::min(std::max(a, b), args[2].value);
  } else if (name == "ir_abs") {
    value = wrap_i32(std::fabs(a));
  } else {
    fail(fmt::format("{} of an int", name));
  }
  return {value, 0.0, ambiguous};
}

// The float functions, each with the error its operands' errors carry through it (the largest
// slope over the operand's interval, or the difference of the values at its ends).
LiftedValue LiftedEvaluator::float_call(const LiftedNode& node,
                                        const std::vector<LiftedValue>& args) const {
  bool ambiguous = false;
  for (const LiftedValue& arg : args) ambiguous = ambiguous || arg.ambiguous;
  const std::string& name = node.name;
  const LiftedValue& x = args[0];
  const double a = x.value;
  const double e = x.error;
  if (name == "ir_to_int") {
    return {truncate_to_int(a), 0.0, ambiguous || !steady(x, truncate_to_int)};
  }
  if (name == "floorf") {
    return {std::floor(a), 0.0, ambiguous || !steady(x, [](double v) { return std::floor(v); })};
  }
  if (name == "ir_neg") return {-a, e, ambiguous};
  if (name == "ir_abs" || name == "fabsf") return {std::fabs(a), e, ambiguous};
  if (name == "ir_min" || name == "ir_max" || name == "ir_clamp") {
    double value = name == "ir_max" ? std::fmax(a, args[1].value) : std::fmin(a, args[1].value);
    if (name == "ir_clamp") value = std::fmin(std::fmax(a, args[1].value), args[2].value);
    double error = 0.0;
    for (const LiftedValue& arg : args) error = std::max(error, arg.error);
    return {value, std::isfinite(value) ? error : 0.0, ambiguous};
  }
  if (args.size() == 2) {
    const LiftedValue& y = args[1];
    const double b = y.value;
    if (name == "ir_add") return rounded(a + b, e + y.error, ambiguous);
    if (name == "ir_sub") return rounded(a - b, e + y.error, ambiguous);
    if (name == "ir_mul") {
      return rounded(a * b, std::fabs(a) * y.error + std::fabs(b) * e + e * y.error, ambiguous);
    }
    if (name == "ir_div") {
      const double value = a / b;
      const double margin = std::fabs(b) - y.error;
      return rounded(value, margin > 0.0 ? (e + std::fabs(value) * y.error) / margin : kInfinity,
                     ambiguous);
    }
    if (name == "ir_mod") {
      if (b == 0.0) return {0.0, 0.0, ambiguous || y.error > 0.0};
      double remainder = std::fmod(a, b);
      if (remainder != 0.0 && ((remainder < 0.0) != (b < 0.0))) remainder += b;
      const double quotient = std::floor(a / b);
      const bool wraps = std::floor((a - e) / b) != quotient || std::floor((a + e) / b) != quotient;
      return rounded(remainder, e + std::fabs(quotient) * y.error, ambiguous || wraps);
    }
  }
  if (name == "expf" || name == "exp2f") {
    const double base = name == "expf" ? 1.0 : std::numbers::ln2;
    const double value = std::exp(base * a);
    return rounded(value, value * std::expm1(base * e), ambiguous);
  }
  if (name == "logf" || name == "log2f") {
    const double base = name == "logf" ? 1.0 : std::numbers::log2e;
    const double value = std::log(a) * base;
    if (e == 0.0) return rounded(value, 0.0, ambiguous);
    return rounded(value, a > e ? -std::log1p(-e / a) * base : kInfinity, ambiguous);
  }
  if (name == "sqrtf") {
    const double value = std::sqrt(a);
    return rounded(value, e == 0.0 ? 0.0 : e / (value + std::sqrt(std::max(a - e, 0.0))),
                   ambiguous);
  }
  if (name == "ir_rsqrt") {
    const double value = 1.0 / std::sqrt(a);
    if (e == 0.0) return rounded(value, 0.0, ambiguous);
    return rounded(value, a > e ? 1.0 / std::sqrt(a - e) - value : kInfinity, ambiguous);
  }
  if (name == "tanhf" || name == "ir_tanh") {
    return rounded(std::tanh(a), tanh_slope(x) * e, ambiguous);
  }
  if (name == "ir_tanh_small") return rounded(tanh_small(a), tanh_slope(x) * e, ambiguous);
  if (name == "ir_sigmoid") return rounded(1.0 / (1.0 + std::exp(-a)), 0.25 * e, ambiguous);
  fail(fmt::format("{} of a float", name));
}

LiftedValue LiftedEvaluator::load(const LiftedNode& node) {
  const LiftedValue offset = evaluate(node.args[0]);
  if (node.slot < 0 || static_cast<std::size_t>(node.slot) >= environment_.tensors.size()) {
    fail(fmt::format("p.tensors[{}] is no tensor slot", node.slot));
  }
  const SyntheticTensor& tensor = environment_.tensors[static_cast<std::size_t>(node.slot)];
  if (!same_dtype(node.name, tensor.dtype)) {
    fail(fmt::format("{} reads tensor slot {} of another dtype", node.name, node.slot));
  }
  if (offset.ambiguous) return {0.0, 0.0, true};
  // Every synthetic value is exact in float (and in the storage dtype).
  return {element_at(tensor, static_cast<std::int64_t>(offset.value), node.name.c_str()), 0.0,
          false};
}

// The staged element: forward_wgmma stages row q of the tensor's [q, kv] plane from
// staged_origin(), kStagedRowStride elements per row.
LiftedValue LiftedEvaluator::staged_element(const LiftedNode& node) {
  if (!point_->staged) fail(fmt::format("{} dereferences a null staged pointer", node.name));
  const auto slot = modifier_.integers.find("kStagedTensor");
  const auto stride = modifier_.integers.find("kStagedRowStride");
  const auto origin = modifier_.functions.find("staged_origin");
  if (slot == modifier_.integers.end() || stride == modifier_.integers.end() ||
      origin == modifier_.functions.end() || slot->second < 0 ||
      slot->second >= static_cast<double>(environment_.tensors.size())) {
    fail("a staged element without kStagedTensor, kStagedRowStride and staged_origin");
  }
  const LiftedValue start = evaluate(origin->second.value);
  const double offset = start.value + static_cast<double>(point_->q) * stride->second +
                        static_cast<double>(point_->kv);
  const SyntheticTensor& tensor = environment_.tensors[static_cast<std::size_t>(slot->second)];
  if (!same_dtype(node.name, tensor.dtype)) {
    fail(fmt::format("{} reads a staged tensor of another dtype", node.name));
  }
  return {element_at(tensor, static_cast<std::int64_t>(offset), node.name.c_str()), 0.0,
          start.ambiguous};
}

}  // namespace flexattn::cuda
