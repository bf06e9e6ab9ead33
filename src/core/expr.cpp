// The builder side of the modifier IR: typed construction with type checking.
#include "flexattn/expr.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "core/printer.hpp"
#include "flexattn/error.hpp"

namespace flexattn {

std::string_view to_string(Type type) {
  switch (type) {
    case Type::kF32:
      return "f32";
    case Type::kI32:
      return "i32";
    case Type::kBool:
      return "bool";
  }
  return "?";
}

std::string_view to_string(Op op) {
  switch (op) {
    case Op::kScore:
      return "score";
    case Op::kBatch:
      return "b";
    case Op::kHead:
      return "h";
    case Op::kQuery:
      return "q";
    case Op::kKey:
      return "kv";
    case Op::kQueryLen:
      return "Q_LEN";
    case Op::kKeyLen:
      return "KV_LEN";
    case Op::kLiteral:
      return "literal";
    case Op::kParam:
      return "param";
    case Op::kLoad:
      return "load";
    case Op::kAdd:
      return "+";
    case Op::kSub:
      return "-";
    case Op::kMul:
      return "*";
    case Op::kDiv:
      return "/";
    case Op::kMod:
      return "%";
    case Op::kNeg:
      return "-";
    case Op::kLess:
      return "<";
    case Op::kLessEqual:
      return "<=";
    case Op::kGreater:
      return ">";
    case Op::kGreaterEqual:
      return ">=";
    case Op::kEqual:
      return "==";
    case Op::kNotEqual:
      return "!=";
    case Op::kAnd:
      return "&&";
    case Op::kOr:
      return "||";
    case Op::kNot:
      return "!";
    case Op::kWhere:
      return "where";
    case Op::kMin:
      return "min";
    case Op::kMax:
      return "max";
    case Op::kClamp:
      return "clamp";
    case Op::kAbs:
      return "abs";
    case Op::kExp:
      return "exp";
    case Op::kExp2:
      return "exp2";
    case Op::kLog:
      return "log";
    case Op::kLog2:
      return "log2";
    case Op::kSqrt:
      return "sqrt";
    case Op::kRsqrt:
      return "rsqrt";
    case Op::kTanh:
      return "tanh";
    case Op::kSigmoid:
      return "sigmoid";
    case Op::kFloor:
      return "floor";
    case Op::kToFloat:
      return "float";
    case Op::kToInt:
      return "int";
  }
  return "?";
}

int arity(Op op) {
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
      return 0;
    case Op::kLoad:
      return -1;
    case Op::kNeg:
    case Op::kNot:
    case Op::kAbs:
    case Op::kExp:
    case Op::kExp2:
    case Op::kLog:
    case Op::kLog2:
    case Op::kSqrt:
    case Op::kRsqrt:
    case Op::kTanh:
    case Op::kSigmoid:
    case Op::kFloor:
    case Op::kToFloat:
    case Op::kToInt:
      return 1;
    case Op::kAdd:
    case Op::kSub:
    case Op::kMul:
    case Op::kDiv:
    case Op::kMod:
    case Op::kLess:
    case Op::kLessEqual:
    case Op::kGreater:
    case Op::kGreaterEqual:
    case Op::kEqual:
    case Op::kNotEqual:
    case Op::kAnd:
    case Op::kOr:
    case Op::kMin:
    case Op::kMax:
      return 2;
    case Op::kWhere:
    case Op::kClamp:
      return 3;
  }
  return 0;
}

bool is_commutative(Op op) {
  return op == Op::kAdd || op == Op::kMul || op == Op::kMin || op == Op::kMax || op == Op::kEqual ||
         op == Op::kNotEqual || op == Op::kAnd || op == Op::kOr;
}

namespace ir {
namespace {

bool is_numeric(Type type) { return type == Type::kI32 || type == Type::kF32; }

Type promoted(const std::vector<Expr>& args, std::size_t first) {
  for (std::size_t i = first; i < args.size(); ++i) {
    if (args[i].type() == Type::kF32) return Type::kF32;
  }
  return Type::kI32;
}

// The first operand (from `first`) that is not numeric, for the error message.
std::optional<Type> first_non_numeric(const std::vector<Expr>& args, std::size_t first = 0) {
  for (std::size_t i = first; i < args.size(); ++i) {
    if (!is_numeric(args[i].type())) return args[i].type();
  }
  return std::nullopt;
}

std::string quoted(Op op) { return fmt::format("'{}'", to_string(op)); }

// The result type of `op` applied to `args`, or the reason it is ill-typed.
struct TypeCheck {
  Type type = Type::kF32;
  std::string error;  // empty when well-typed
};

TypeCheck check_numeric(Op op, const std::vector<Expr>& args, bool keeps_i32) {
  if (auto bad = first_non_numeric(args)) {
    const char* what = args.size() == 1 ? "a numeric operand" : "numeric operands";
    return {Type::kF32, fmt::format("{} needs {}, got {}", quoted(op), what, to_string(*bad))};
  }
  return {keeps_i32 ? promoted(args, 0) : Type::kF32, {}};
}

TypeCheck check_types(Op op, const std::vector<Expr>& args) {
  switch (op) {
    case Op::kScore:
      return {Type::kF32, {}};
    case Op::kBatch:
    case Op::kHead:
    case Op::kQuery:
    case Op::kKey:
    case Op::kQueryLen:
    case Op::kKeyLen:
      return {Type::kI32, {}};
    case Op::kLiteral:
    case Op::kParam:
    case Op::kLoad:
      return {Type::kF32, fmt::format("{} is built with literal_*(), param() or load(), not make()",
                                      to_string(op))};
    case Op::kAdd:
    case Op::kSub:
    case Op::kMul:
    case Op::kDiv:
    case Op::kMod:
    case Op::kNeg:
    case Op::kMin:
    case Op::kMax:
    case Op::kClamp:
    case Op::kAbs:
      return check_numeric(op, args, /*keeps_i32=*/true);
    case Op::kExp:
    case Op::kExp2:
    case Op::kLog:
    case Op::kLog2:
    case Op::kSqrt:
    case Op::kRsqrt:
    case Op::kTanh:
    case Op::kSigmoid:
    case Op::kFloor:
    case Op::kToFloat:
      return check_numeric(op, args, /*keeps_i32=*/false);
    case Op::kToInt: {
      TypeCheck check = check_numeric(op, args, false);
      check.type = Type::kI32;
      return check;
    }
    case Op::kLess:
    case Op::kLessEqual:
    case Op::kGreater:
    case Op::kGreaterEqual: {
      TypeCheck check = check_numeric(op, args, false);
      check.type = Type::kBool;
      return check;
    }
    case Op::kEqual:
    case Op::kNotEqual: {
      const Type a = args[0].type();
      const Type b = args[1].type();
      if ((is_numeric(a) && is_numeric(b)) || (a == Type::kBool && b == Type::kBool)) {
        return {Type::kBool, {}};
      }
      return {Type::kBool, fmt::format("{} needs two numeric or two bool operands, got {} and {}",
                                       quoted(op), to_string(a), to_string(b))};
    }
    case Op::kAnd:
    case Op::kOr:
    case Op::kNot:
      for (const Expr& arg : args) {
        if (arg.type() != Type::kBool) {
          const char* what = args.size() == 1 ? "a bool operand" : "bool operands";
          return {Type::kBool,
                  fmt::format("{} needs {}, got {}", quoted(op), what, to_string(arg.type()))};
        }
      }
      return {Type::kBool, {}};
    case Op::kWhere: {
      if (args[0].type() != Type::kBool) {
        return {Type::kF32,
                fmt::format("'where' needs a bool condition, got {}", to_string(args[0].type()))};
      }
      const Type a = args[1].type();
      const Type b = args[2].type();
      if (a == Type::kBool && b == Type::kBool) return {Type::kBool, {}};
      if (is_numeric(a) && is_numeric(b)) return {promoted(args, 1), {}};
      return {Type::kF32, fmt::format("'where' needs two numeric or two bool values, got {} and {}",
                                      to_string(a), to_string(b))};
    }
  }
  return {Type::kF32, "unknown op"};
}

bool is_identifier(const std::string& name) {
  if (name.empty()) return false;
  const auto is_alpha = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  };
  if (!is_alpha(name[0])) return false;
  for (char c : name) {
    if (!is_alpha(c) && !(c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool is_reserved(const std::string& name) {
  static constexpr std::string_view kReserved[] = {
      "score", "b",     "h",     "q",    "kv",      "Q_LEN", "KV_LEN", "inf",  "true",
      "false", "where", "min",   "max",  "clamp",   "abs",   "exp",    "exp2", "log",
      "log2",  "sqrt",  "rsqrt", "tanh", "sigmoid", "floor", "float",  "int"};
  for (std::string_view reserved : kReserved) {
    if (name == reserved) return true;
  }
  return false;
}

void check_name(const std::string& name, std::string_view what) {
  if (!is_identifier(name)) {
    throw_invalid(
        fmt::format("{} name '{}' is not an identifier ([A-Za-z_][A-Za-z0-9_]*)", what, name));
  }
  if (is_reserved(name)) {
    throw_invalid(
        fmt::format("{} name '{}' is a reserved word of the modifier syntax", what, name));
  }
}

Expr make_node(Op op, Type type, double literal, std::string name, std::vector<Expr> args) {
  auto node = std::make_shared<ExprNode>();
  node->op = op;
  node->type = type;
  node->literal = literal;
  node->name = std::move(name);
  node->args = std::move(args);
  return Expr(std::shared_ptr<const ExprNode>(std::move(node)));
}

[[noreturn]] void throw_type_error(const std::string& reason, const Expr& offending) {
  throw_invalid(fmt::format("type error: {} in \"{}\"", reason, offending.to_string()));
}

}  // namespace

Expr::Expr(double value) : Expr(literal_f32(value)) {}
Expr::Expr(int value) : Expr(literal_i32(value)) {}

Type Expr::type() const { return node_->type; }
Op Expr::op() const { return node_->op; }
std::string Expr::to_string() const { return print(*node_); }

Expr score() { return make_node(Op::kScore, Type::kF32, 0.0, {}, {}); }
Expr batch() { return make_node(Op::kBatch, Type::kI32, 0.0, {}, {}); }
Expr head() { return make_node(Op::kHead, Type::kI32, 0.0, {}, {}); }
Expr query() { return make_node(Op::kQuery, Type::kI32, 0.0, {}, {}); }
Expr key() { return make_node(Op::kKey, Type::kI32, 0.0, {}, {}); }
Expr query_length() { return make_node(Op::kQueryLen, Type::kI32, 0.0, {}, {}); }
Expr key_length() { return make_node(Op::kKeyLen, Type::kI32, 0.0, {}, {}); }

Expr literal_f32(double value) {
  if (std::isnan(value)) throw_invalid("an f32 literal cannot be NaN");
  // f32 is float32: a literal past its range is +-inf, as every engine computes it.
  if (std::isfinite(value) && std::isinf(static_cast<float>(value))) {
    value = std::copysign(std::numeric_limits<double>::infinity(), value);
  }
  return make_node(Op::kLiteral, Type::kF32, value, {}, {});
}

Expr literal_i32(std::int64_t value) {
  if (value < std::numeric_limits<std::int32_t>::min() ||
      value > std::numeric_limits<std::int32_t>::max()) {
    throw_invalid(fmt::format("integer literal {} is outside the i32 range", value));
  }
  return make_node(Op::kLiteral, Type::kI32, static_cast<double>(value), {}, {});
}

Expr literal_bool(bool value) {
  return make_node(Op::kLiteral, Type::kBool, value ? 1.0 : 0.0, {}, {});
}

Expr infinity() { return literal_f32(std::numeric_limits<double>::infinity()); }

Expr param(std::string name) {
  check_name(name, "parameter");
  return make_node(Op::kParam, Type::kF32, 0.0, std::move(name), {});
}

Expr load(std::string tensor, Type element_type, std::vector<Expr> indices) {
  check_name(tensor, "tensor");
  if (element_type != Type::kF32 && element_type != Type::kI32) {
    throw_invalid(fmt::format("tensor '{}' must have f32 or i32 elements, got {}", tensor,
                              to_string(element_type)));
  }
  if (indices.empty()) throw_invalid(fmt::format("load of '{}' needs at least one index", tensor));
  for (std::size_t i = 0; i < indices.size(); ++i) {
    if (indices[i].type() != Type::kI32) {
      const std::string reason = fmt::format("index {} of '{}' must be i32, got {}", i, tensor,
                                             to_string(indices[i].type()));
      throw_type_error(reason, make_node(Op::kLoad, element_type, 0.0, tensor, indices));
    }
  }
  return make_node(Op::kLoad, element_type, 0.0, std::move(tensor), std::move(indices));
}

Expr make(Op op, std::vector<Expr> args) {
  const int expected = arity(op);
  if (op == Op::kLiteral || op == Op::kParam || op == Op::kLoad) {
    throw_invalid(std::string(check_types(op, args).error));
  }
  if (static_cast<int>(args.size()) != expected) {
    throw_invalid(fmt::format("{} takes {} operand{}, got {}", quoted(op), expected,
                              expected == 1 ? "" : "s", args.size()));
  }
  for (const Expr& arg : args) {
    if (!arg.pointer()) throw_internal("ir::make: null operand");
  }
  TypeCheck check = check_types(op, args);
  Expr result = make_node(op, check.type, 0.0, {}, std::move(args));
  if (!check.error.empty()) throw_type_error(check.error, result);
  return result;
}

Expr operator+(const Expr& a, const Expr& b) { return make(Op::kAdd, {a, b}); }
Expr operator-(const Expr& a, const Expr& b) { return make(Op::kSub, {a, b}); }
Expr operator*(const Expr& a, const Expr& b) { return make(Op::kMul, {a, b}); }
Expr operator/(const Expr& a, const Expr& b) { return make(Op::kDiv, {a, b}); }
Expr operator%(const Expr& a, const Expr& b) { return make(Op::kMod, {a, b}); }
Expr operator-(const Expr& a) { return make(Op::kNeg, {a}); }
Expr operator<(const Expr& a, const Expr& b) { return make(Op::kLess, {a, b}); }
Expr operator<=(const Expr& a, const Expr& b) { return make(Op::kLessEqual, {a, b}); }
Expr operator>(const Expr& a, const Expr& b) { return make(Op::kGreater, {a, b}); }
Expr operator>=(const Expr& a, const Expr& b) { return make(Op::kGreaterEqual, {a, b}); }
Expr operator==(const Expr& a, const Expr& b) { return make(Op::kEqual, {a, b}); }
Expr operator!=(const Expr& a, const Expr& b) { return make(Op::kNotEqual, {a, b}); }
Expr operator&&(const Expr& a, const Expr& b) { return make(Op::kAnd, {a, b}); }
Expr operator||(const Expr& a, const Expr& b) { return make(Op::kOr, {a, b}); }
Expr operator!(const Expr& a) { return make(Op::kNot, {a}); }
Expr where(const Expr& condition, const Expr& if_true, const Expr& if_false) {
  return make(Op::kWhere, {condition, if_true, if_false});
}
Expr min(const Expr& a, const Expr& b) { return make(Op::kMin, {a, b}); }
Expr max(const Expr& a, const Expr& b) { return make(Op::kMax, {a, b}); }
Expr clamp(const Expr& x, const Expr& lo, const Expr& hi) { return make(Op::kClamp, {x, lo, hi}); }
Expr abs(const Expr& x) { return make(Op::kAbs, {x}); }
Expr exp(const Expr& x) { return make(Op::kExp, {x}); }
Expr exp2(const Expr& x) { return make(Op::kExp2, {x}); }
Expr log(const Expr& x) { return make(Op::kLog, {x}); }
Expr log2(const Expr& x) { return make(Op::kLog2, {x}); }
Expr sqrt(const Expr& x) { return make(Op::kSqrt, {x}); }
Expr rsqrt(const Expr& x) { return make(Op::kRsqrt, {x}); }
Expr tanh(const Expr& x) { return make(Op::kTanh, {x}); }
Expr sigmoid(const Expr& x) { return make(Op::kSigmoid, {x}); }
Expr floor(const Expr& x) { return make(Op::kFloor, {x}); }
Expr to_float(const Expr& x) { return make(Op::kToFloat, {x}); }
Expr to_int(const Expr& x) { return make(Op::kToInt, {x}); }

}  // namespace ir
}  // namespace flexattn
