#include "engines/cuda/lift_expression.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

namespace flexattn::cuda::lift {

[[noreturn]] void fail(std::string what) { throw LiftError{std::move(what)}; }

const char* type_name(LiftedType type) {
  switch (type) {
    case LiftedType::kFloat:
      return "float";
    case LiftedType::kInt:
      return "int";
    case LiftedType::kLong:
      return "long long";
    case LiftedType::kBool:
      return "bool";
  }
  return "?";
}

// ---- tokens ----------------------------------------------------------------------------------

namespace {

bool is_identifier_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
}

}  // namespace

std::vector<Token> tokenize(std::string_view text) {
  static const std::vector<std::string_view> kSymbols = {
      "[[", "]]", "&&", "||", "<=", ">=", "==", "!=", "+=", "(", ")", "[", "]", "{", "}",
      ",",  ";",  "?",  ":",  ".",  "*",  "+",  "-",  "/",  "<", ">", "!", "&", "=", "%"};
  std::vector<Token> tokens;
  std::size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (c == ' ') {
      ++i;
    } else if (std::isdigit(static_cast<unsigned char>(c)) != 0) {
      const bool hex = text.substr(i, 2) == "0x";
      std::size_t end = i + (hex ? 2 : 0);
      while (end < text.size()) {
        const char d = text[end];
        const char before = text[end - 1];
        const bool sign = (d == '+' || d == '-') && (hex ? (before == 'p' || before == 'P')
                                                         : (before == 'e' || before == 'E'));
        if (!is_identifier_char(d) && d != '.' && !sign) break;
        ++end;
      }
      tokens.push_back({TokenKind::kNumber, std::string(text.substr(i, end - i))});
      i = end;
    } else if (is_identifier_char(c)) {
      std::size_t end = i;
      while (end < text.size() && is_identifier_char(text[end])) ++end;
      tokens.push_back({TokenKind::kIdentifier, std::string(text.substr(i, end - i))});
      i = end;
    } else {
      bool matched = false;
      for (std::string_view symbol : kSymbols) {
        if (text.substr(i, symbol.size()) == symbol) {
          tokens.push_back({TokenKind::kSymbol, std::string(symbol)});
          i += symbol.size();
          matched = true;
          break;
        }
      }
      if (!matched) fail(fmt::format("unexpected character '{}'", c));
    }
  }
  tokens.push_back({TokenKind::kEnd, ""});
  return tokens;
}

namespace {

// ---- the device functions of device_math.cuh the generated code calls --------------------------

// Elementwise functions whose operands and result share one type (int or float overloads).
const std::set<std::string>& same_type_functions() {
  static const std::set<std::string> names = {"ir_add", "ir_sub", "ir_mul", "ir_div", "ir_mod",
                                              "ir_min", "ir_max", "ir_neg", "ir_abs", "ir_clamp"};
  return names;
}
int same_type_arity(const std::string& name) {
  if (name == "ir_neg" || name == "ir_abs") return 1;
  if (name == "ir_clamp") return 3;
  return 2;
}
// float -> float functions.
const std::set<std::string>& float_functions() {
  static const std::set<std::string> names = {"expf",          "exp2f",      "logf",   "log2f",
                                              "sqrtf",         "ir_rsqrt",   "tanhf",  "ir_tanh",
                                              "ir_tanh_small", "ir_sigmoid", "floorf", "fabsf"};
  return names;
}

// The loader of each tensor storage and the pointer type it takes (codegen's tensor_access).
const std::map<std::string, std::string>& loader_pointers() {
  static const std::map<std::string, std::string> loaders = {{"load_tensor_f32", "float"},
                                                             {"load_tensor_f64", "double"},
                                                             {"load_tensor_bf16", "unsigned short"},
                                                             {"load_tensor_f16", "unsigned short"},
                                                             {"load_tensor_i32", "int"},
                                                             {"load_tensor_i64", "long long"}};
  return loaders;
}

}  // namespace

// ---- expressions -----------------------------------------------------------------------------

int ExpressionParser::expression() {
  const int condition = logical_or();
  if (!accept("?")) return condition;
  require(condition, LiftedType::kBool, "a condition");
  const int yes = expression();
  expect(":");
  const int no = expression();
  if (type(yes) != type(no)) fail("the branches of a ?: differ in type");
  return add(LiftedKind::kSelect, type(yes), {condition, yes, no});
}

void ExpressionParser::expect(std::string_view text) {
  if (tokens_[position_].text != text || tokens_[position_].kind == TokenKind::kEnd) {
    fail(fmt::format("expected '{}', found '{}'", text, tokens_[position_].text));
  }
  ++position_;
}

bool ExpressionParser::accept(std::string_view text) {
  if (tokens_[position_].kind == TokenKind::kEnd || tokens_[position_].text != text) return false;
  ++position_;
  return true;
}

void ExpressionParser::expect_end() {
  if (tokens_[position_].kind != TokenKind::kEnd) {
    fail(fmt::format("unexpected '{}'", tokens_[position_].text));
  }
}

std::int64_t ExpressionParser::integer() {
  const Token& token = tokens_[position_];
  if (token.kind != TokenKind::kNumber)
    fail(fmt::format("expected a number, found '{}'", token.text));
  char* end = nullptr;
  const long long value = std::strtoll(token.text.c_str(), &end, 10);
  if (*end != '\0') fail(fmt::format("expected an integer, found '{}'", token.text));
  ++position_;
  return value;
}

std::string ExpressionParser::identifier() {
  const Token& token = tokens_[position_];
  if (token.kind != TokenKind::kIdentifier) {
    fail(fmt::format("expected a name, found '{}'", token.text));
  }
  ++position_;
  return token.text;
}

int ExpressionParser::add(LiftedKind kind, LiftedType type, std::vector<int> args, std::string name,
                          double number, int slot) {
  modifier_.nodes.push_back({kind, type, number, std::move(name), slot, std::move(args)});
  return static_cast<int>(modifier_.nodes.size()) - 1;
}

void ExpressionParser::require(int node, LiftedType wanted, std::string_view what) const {
  if (type(node) != wanted) {
    fail(fmt::format("{} of type {} where {} is wanted", what, type_name(type(node)),
                     type_name(wanted)));
  }
}

int ExpressionParser::logical_or() {
  int left = logical_and();
  while (accept("||")) {
    const int right = logical_and();
    require(left, LiftedType::kBool, "an operand of ||");
    require(right, LiftedType::kBool, "an operand of ||");
    left = add(LiftedKind::kOr, LiftedType::kBool, {left, right});
  }
  return left;
}

int ExpressionParser::logical_and() {
  int left = comparison();
  while (accept("&&")) {
    const int right = comparison();
    require(left, LiftedType::kBool, "an operand of &&");
    require(right, LiftedType::kBool, "an operand of &&");
    left = add(LiftedKind::kAnd, LiftedType::kBool, {left, right});
  }
  return left;
}

int ExpressionParser::comparison() {
  const int left = additive();
  for (const char* symbol : {"<=", ">=", "==", "!=", "<", ">"}) {
    if (!accept(symbol)) continue;
    const int right = additive();
    if (type(left) != type(right) || type(left) == LiftedType::kBool) {
      fail(
          fmt::format("a comparison of {} with {}", type_name(type(left)), type_name(type(right))));
    }
    return add(LiftedKind::kCompare, LiftedType::kBool, {left, right}, symbol);
  }
  return left;
}

// Plain C++ arithmetic: offsets (int / long long) and tanh_args_small's float products.
int ExpressionParser::arithmetic(const char* symbol, int left, int right) {
  const LiftedType a = type(left);
  const LiftedType b = type(right);
  if (a == LiftedType::kBool || b == LiftedType::kBool) fail("arithmetic on bool");
  if ((a == LiftedType::kFloat) != (b == LiftedType::kFloat)) {
    fail("arithmetic mixing float and integer");
  }
  const LiftedType result =
      a == LiftedType::kLong || b == LiftedType::kLong ? LiftedType::kLong : a;
  return add(LiftedKind::kArithmetic, result, {left, right}, symbol);
}

int ExpressionParser::additive() {
  int left = multiplicative();
  for (;;) {
    if (accept("+")) {
      left = arithmetic("+", left, multiplicative());
    } else if (accept("-")) {
      left = arithmetic("-", left, multiplicative());
    } else {
      return left;
    }
  }
}

int ExpressionParser::multiplicative() {
  int left = unary();
  for (;;) {
    if (accept("*")) {
      left = arithmetic("*", left, unary());
    } else if (accept("/")) {
      left = arithmetic("/", left, unary());
    } else {
      return left;
    }
  }
}

int ExpressionParser::unary() {
  if (accept("!")) {
    const int operand = unary();
    require(operand, LiftedType::kBool, "the operand of !");
    return add(LiftedKind::kNot, LiftedType::kBool, {operand});
  }
  if (accept("-")) {
    // Only a negative literal: `(-5)`, `(-2147483647 - 1)`.
    if (tokens_[position_].kind != TokenKind::kNumber) fail("unary minus of a non-literal");
    const int literal = number();
    modifier_.nodes[static_cast<std::size_t>(literal)].number *= -1.0;
    return literal;
  }
  return primary();
}

int ExpressionParser::number() {
  std::string text = tokens_[position_++].text;
  LiftedType type = LiftedType::kInt;
  const bool hex = text.rfind("0x", 0) == 0;
  if (text.size() > 2 && text.substr(text.size() - 2) == "LL") {
    type = LiftedType::kLong;
    text.resize(text.size() - 2);
  } else if (text.back() == 'f' && (!hex || text.find('p') != std::string::npos)) {
    type = LiftedType::kFloat;
    text.pop_back();
  } else if (text.find_first_of(hex ? "p" : ".eE") != std::string::npos) {
    fail(fmt::format("a floating-point literal without its f suffix: {}", text));
  }
  char* end = nullptr;
  const double value = type == LiftedType::kFloat
                           ? static_cast<double>(std::strtof(text.c_str(), &end))
                           : static_cast<double>(std::strtoll(text.c_str(), &end, 0));
  if (*end != '\0') fail(fmt::format("a malformed number: {}", text));
  return add(LiftedKind::kLiteral, type, {}, {}, value);
}

LiftedType ExpressionParser::cast_type() {
  const std::string name = identifier();
  if (name == "float") return LiftedType::kFloat;
  if (name == "int") return LiftedType::kInt;
  if (name == "bool") return LiftedType::kBool;
  if (name == "long") {
    expect("long");
    return LiftedType::kLong;
  }
  fail(fmt::format("a cast to '{}'", name));
}

std::vector<int> ExpressionParser::arguments() {
  expect("(");
  std::vector<int> args;
  if (accept(")")) return args;
  do {
    args.push_back(expression());
  } while (accept(","));
  expect(")");
  return args;
}

int ExpressionParser::load(const std::string& loader) {
  expect("(");
  expect("static_cast");
  expect("<");
  expect("const");
  std::string pointee = identifier();
  if (pointee == "unsigned" || pointee == "long") pointee += " " + identifier();
  expect("*");
  expect(">");
  expect("(");
  if (!scope_.has_p) fail("p.tensors outside the scope of p");
  expect("p");
  expect(".");
  expect("tensors");
  expect("[");
  const auto slot = static_cast<int>(integer());
  expect("]");
  expect(".");
  expect("data");
  expect(")");
  expect(",");
  const int offset = expression();
  expect(")");
  if (loader_pointers().at(loader) != pointee) {
    fail(fmt::format("{} given a const {}*", loader, pointee));
  }
  if (type(offset) != LiftedType::kInt && type(offset) != LiftedType::kLong) {
    fail("a tensor offset that is not an integer");
  }
  const bool integral = loader == "load_tensor_i32" || loader == "load_tensor_i64";
  return add(LiftedKind::kLoad, integral ? LiftedType::kInt : LiftedType::kFloat, {offset}, loader,
             0.0, slot);
}

int ExpressionParser::call(const std::string& name) {
  if (loader_pointers().count(name) != 0) return load(name);
  if (name == "staged_bf16" || name == "staged_f16") {
    if (!scope_.has_staged) fail("a staged element outside the scope of staged");
    expect("(");
    expect("*");
    expect("staged");
    expect(")");
    return add(LiftedKind::kStagedElement, LiftedType::kFloat, {}, name);
  }
  if (name == "score_mod_log2") {
    // score_mod_forward's delegation: the caller's own arguments, in order.
    expect("(");
    for (const char* argument : {"inv", "p", "at", "dot", "q", "kv", "staged"}) {
      if (std::string(argument) != "inv") expect(",");
      expect(argument);
    }
    expect(")");
    if (scope_.leaves.count("dot") == 0 || !scope_.has_staged)
      fail("score_mod_log2 called out of scope");
    return add(LiftedKind::kFunctionCall, LiftedType::kFloat, {}, name);
  }
  if (name == "positive_infinity" || name == "negative_infinity") {
    expect("(");
    expect(")");
    const double infinity = std::numeric_limits<double>::infinity();
    return add(LiftedKind::kLiteral, LiftedType::kFloat, {}, {},
               name == "positive_infinity" ? infinity : -infinity);
  }
  if (name == "__int_as_float") {
    expect("(");
    const Token& bits = tokens_[position_++];
    if (bits.text != "0x7fc00000") fail("__int_as_float of anything but the quiet NaN");
    expect(")");
    return add(LiftedKind::kLiteral, LiftedType::kFloat, {}, {},
               std::numeric_limits<double>::quiet_NaN());
  }
  const std::vector<int> args = arguments();
  if (same_type_functions().count(name) != 0) {
    if (static_cast<int>(args.size()) != same_type_arity(name)) {
      fail(fmt::format("{} with {} arguments", name, args.size()));
    }
    const LiftedType common = type(args[0]);
    if (common != LiftedType::kFloat && common != LiftedType::kInt) {
      fail(fmt::format("{} of {}", name, type_name(common)));
    }
    for (int arg : args) require(arg, common, fmt::format("an operand of {}", name));
    return add(LiftedKind::kCall, common, args, name);
  }
  const bool from_float = float_functions().count(name) != 0 || name == "ir_to_int";
  if (from_float || name == "ir_small_int_to_float") {
    if (args.size() != 1) fail(fmt::format("{} with {} arguments", name, args.size()));
    require(args[0], from_float ? LiftedType::kFloat : LiftedType::kInt,
            fmt::format("the operand of {}", name));
    return add(LiftedKind::kCall, name == "ir_to_int" ? LiftedType::kInt : LiftedType::kFloat, args,
               name);
  }
  fail(fmt::format("a call of '{}', which the generated code does not make", name));
}

int ExpressionParser::primary() {
  const Token token = tokens_[position_];
  if (token.kind == TokenKind::kNumber) return number();
  if (accept("(")) {
    const int inner = expression();
    expect(")");
    return inner;
  }
  const std::string name = identifier();
  if (name == "true" || name == "false") {
    return add(LiftedKind::kLiteral, LiftedType::kBool, {}, {}, name == "true" ? 1.0 : 0.0);
  }
  if (name == "kTanhSmallLimit") return add(LiftedKind::kLiteral, LiftedType::kFloat, {}, {}, 0.6f);
  if (name == "kLog2e") {
    return add(LiftedKind::kLiteral, LiftedType::kFloat, {}, {}, 1.4426950408889634f);
  }
  if (name == "static_cast") {
    expect("<");
    const LiftedType to = cast_type();
    expect(">");
    expect("(");
    const int operand = expression();
    expect(")");
    if (type(operand) == to) fail("a cast to the operand's own type");
    return add(LiftedKind::kCast, to, {operand});
  }
  if (name == "staged") {
    if (!scope_.has_staged) fail("staged outside its scope");
    expect("!=");
    expect("nullptr");
    return add(LiftedKind::kStagedPresent, LiftedType::kBool, {});
  }
  if (name == "at") {
    if (!scope_.has_at) fail("at outside its scope");
    expect(".");
    const std::string field = identifier();
    if (field != "batch" && field != "head" && field != "q_len" && field != "kv_len") {
      fail(fmt::format("at.{}", field));
    }
    return add(LiftedKind::kLeaf, LiftedType::kInt, {}, "at." + field);
  }
  if (name == "p") {
    if (!scope_.has_p) fail("p outside its scope");
    expect(".");
    const std::string field = identifier();
    if (field == "scale") return add(LiftedKind::kLeaf, LiftedType::kFloat, {}, "p.scale");
    if (field != "params") fail(fmt::format("p.{}", field));
    expect("[");
    const auto slot = static_cast<int>(integer());
    expect("]");
    return add(LiftedKind::kParam, LiftedType::kFloat, {}, {}, 0.0, slot);
  }
  if (name == "inv") {
    if (!scope_.has_inv) fail("inv outside its scope");
    expect(".");
    const std::string field = identifier();
    const auto found = modifier_.invariant_fields.find(field);
    if (found == modifier_.invariant_fields.end()) fail(fmt::format("inv.{} is no field", field));
    return add(LiftedKind::kInvariant, found->second, {}, field);
  }
  if (tokens_[position_].text == "(") return call(name);
  if (const auto local = scope_.values.find(name); local != scope_.values.end()) {
    return local->second;
  }
  if (scope_.leaves.count(name) != 0) {
    const bool integral = name == "q" || name == "kv";
    return add(LiftedKind::kLeaf, integral ? LiftedType::kInt : LiftedType::kFloat, {}, name);
  }
  fail(fmt::format("unknown name '{}'", name));
}

}  // namespace flexattn::cuda::lift
