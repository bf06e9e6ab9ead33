// Text-syntax printer. Minimal parentheses by C-like precedence, left associative. Implicit
// promotions are left implicit where the parser would re-create them (`score + q` rather than
// `score + float(q)`), so printing then parsing gives an equal canonical graph.
#include "core/printer.hpp"

#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace flexattn::ir {
namespace {

// Binding strength, weakest first.
enum class Precedence : int {
  kOr = 1,
  kAnd,
  kEquality,
  kRelational,
  kAdditive,
  kMultiplicative,
  kUnary,
  kPrimary,
};

// Precedence of a binary operator, or kPrimary for anything that is not one.
Precedence binary_precedence(Op op) {
  switch (op) {
    case Op::kOr:
      return Precedence::kOr;
    case Op::kAnd:
      return Precedence::kAnd;
    case Op::kEqual:
    case Op::kNotEqual:
      return Precedence::kEquality;
    case Op::kLess:
    case Op::kLessEqual:
    case Op::kGreater:
    case Op::kGreaterEqual:
      return Precedence::kRelational;
    case Op::kAdd:
    case Op::kSub:
      return Precedence::kAdditive;
    case Op::kMul:
    case Op::kDiv:
    case Op::kMod:
      return Precedence::kMultiplicative;
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
    case Op::kNeg:
    case Op::kNot:
    case Op::kWhere:
    case Op::kMin:
    case Op::kMax:
    case Op::kClamp:
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
      return Precedence::kPrimary;
  }
  return Precedence::kPrimary;
}

// Ops whose numeric operands are promoted to f32 together (the first `group_begin` operands are
// not part of the group: the condition of `where`). `always_f32`: the op promotes even when every
// operand is i32 (tanh, exp, ...).
bool promotes_operands(Op op, std::size_t* group_begin, bool* always_f32) {
  *group_begin = 0;
  *always_f32 = false;
  switch (op) {
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
    case Op::kMin:
    case Op::kMax:
    case Op::kClamp:
      return true;
    case Op::kExp:
    case Op::kExp2:
    case Op::kLog:
    case Op::kLog2:
    case Op::kSqrt:
    case Op::kRsqrt:
    case Op::kTanh:
    case Op::kSigmoid:
    case Op::kFloor:
      *always_f32 = true;
      return true;
    case Op::kWhere:
      *group_begin = 1;
      return true;
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
    case Op::kNeg:
    case Op::kAnd:
    case Op::kOr:
    case Op::kNot:
    case Op::kAbs:
    case Op::kToFloat:
    case Op::kToInt:
      return false;
  }
  return false;
}

// The largest magnitude an integer literal may have (i32).
constexpr double kMaxBareInteger = std::numeric_limits<std::int32_t>::max();

// An f32 operand that may print as an i32 text when an enclosing op promotes it: `float(i)` (as
// `i`) and whole-number literals (as `30`).
bool is_weakable(const ExprNode& node) {
  if (node.type != Type::kF32) return false;
  if (node.op == Op::kToFloat) return node.args[0].type() == Type::kI32;
  if (node.op != Op::kLiteral) return false;
  const double value = node.literal;
  return std::isfinite(value) && value == std::floor(value) &&
         std::fabs(value) <= kMaxBareInteger && !(value == 0.0 && std::signbit(value));
}

std::string format_number(double value) {
  std::array<char, 64> buffer{};
  auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  return std::string(buffer.data(), result.ptr);
}

std::string format_literal(const ExprNode& node, bool weak) {
  const double value = node.literal;
  switch (node.type) {
    case Type::kBool:
      return value != 0.0 ? "true" : "false";
    case Type::kI32:
      return format_number(value);
    case Type::kF32:
      break;
  }
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  std::string text = format_number(value);
  const bool looks_integer = text.find_first_of(".e") == std::string::npos;
  if (looks_integer && !weak) text += ".0";
  return text;
}

// Text is for people (messages, explain, comments in generated code). A graph shares nodes that
// its text repeats, so the text of a small graph can be exponentially long (the derivative of 40
// nested abs() is 2^40 characters): printing stops past this length.
constexpr std::size_t kMaxPrintedLength = std::size_t{1} << 16;

class Printer {
 public:
  std::string text;

  // Prints `node`; `weak` allows an implicitly promotable f32 operand to print as i32 text.
  void emit(const ExprNode& node, bool weak) {
    if (text.size() > kMaxPrintedLength) return;
    if (weak && node.op == Op::kToFloat && node.args[0].type() == Type::kI32) {
      emit(node.args[0].node(), false);
      return;
    }
    switch (node.op) {
      case Op::kLiteral:
        text += format_literal(node, weak);
        return;
      case Op::kParam:
        text += node.name;
        return;
      case Op::kLoad:
        text += node.name;
        emit_arguments(node, '[', ']');
        return;
      case Op::kNeg:
      case Op::kNot:
        text += to_string(node.op);
        emit_operand(node.args[0].node(), false, Precedence::kUnary, /*parenthesize_equal=*/true);
        return;
      case Op::kScore:
      case Op::kBatch:
      case Op::kHead:
      case Op::kQuery:
      case Op::kKey:
      case Op::kQueryLen:
      case Op::kKeyLen:
        text += to_string(node.op);
        return;
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
        emit_binary(node);
        return;
      case Op::kWhere:
      case Op::kMin:
      case Op::kMax:
      case Op::kClamp:
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
        text += to_string(node.op);
        emit_arguments(node, '(', ')');
        return;
    }
  }

 private:
  // The precedence of `node` as it will be printed.
  static Precedence printed_precedence(const ExprNode& node, bool weak) {
    if (weak && node.op == Op::kToFloat && node.args[0].type() == Type::kI32) {
      return printed_precedence(node.args[0].node(), false);
    }
    if (node.op == Op::kLiteral && node.type != Type::kBool && std::signbit(node.literal)) {
      return Precedence::kUnary;
    }
    if (node.op == Op::kNeg || node.op == Op::kNot) return Precedence::kUnary;
    return binary_precedence(node.op);
  }

  // Which operands of `node` may print weakly: within a promotion group, every weakable operand
  // when another operand is plainly f32 or the op always promotes, otherwise all but the first
  // weakable one.
  static std::vector<bool> weak_operands(const ExprNode& node) {
    std::vector<bool> weak(node.args.size(), false);
    std::size_t group_begin = 0;
    bool always_f32 = false;
    if (!promotes_operands(node.op, &group_begin, &always_f32)) return weak;
    bool has_strong_f32 = always_f32;
    for (std::size_t i = group_begin; i < node.args.size(); ++i) {
      const ExprNode& arg = node.args[i].node();
      if (arg.type == Type::kF32 && !is_weakable(arg)) has_strong_f32 = true;
    }
    bool kept_one = has_strong_f32;
    for (std::size_t i = group_begin; i < node.args.size(); ++i) {
      if (!is_weakable(node.args[i].node())) continue;
      if (kept_one) {
        weak[i] = true;
      } else {
        kept_one = true;
      }
    }
    return weak;
  }

  void emit_operand(const ExprNode& operand, bool weak, Precedence context,
                    bool parenthesize_equal) {
    const Precedence own = printed_precedence(operand, weak);
    const bool parens = parenthesize_equal ? own <= context : own < context;
    if (parens) text += '(';
    emit(operand, weak);
    if (parens) text += ')';
  }

  void emit_binary(const ExprNode& node) {
    const Precedence precedence = binary_precedence(node.op);
    const std::vector<bool> weak = weak_operands(node);
    emit_operand(node.args[0].node(), weak[0], precedence, /*parenthesize_equal=*/false);
    text += ' ';
    text += to_string(node.op);
    text += ' ';
    emit_operand(node.args[1].node(), weak[1], precedence, /*parenthesize_equal=*/true);
  }

  void emit_arguments(const ExprNode& node, char open, char close) {
    const std::vector<bool> weak = weak_operands(node);
    text += open;
    for (std::size_t i = 0; i < node.args.size(); ++i) {
      if (i > 0) text += ", ";
      emit(node.args[i].node(), weak[i]);
    }
    text += close;
  }
};

}  // namespace

std::string print(const ExprNode& node) {
  Printer printer;
  printer.emit(node, false);
  if (printer.text.size() > kMaxPrintedLength) {
    printer.text.resize(kMaxPrintedLength);
    printer.text += " ... (the rest of a text longer than " + std::to_string(kMaxPrintedLength) +
                    " characters)";
  }
  return printer.text;
}

}  // namespace flexattn::ir
