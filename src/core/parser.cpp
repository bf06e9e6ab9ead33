// Parser of the modifier text syntax: a tokenizer and a precedence-climbing parser that builds
// through ir::make, so parsed and built expressions are type-checked by the same rules.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flexattn/error.hpp"
#include "flexattn/expr.hpp"

namespace flexattn::ir {
namespace {

enum class TokenKind { kInteger, kReal, kIdentifier, kSymbol, kEnd };

struct Token {
  TokenKind kind = TokenKind::kEnd;
  std::string_view text;
  std::size_t column = 0;  // 1-based
};

bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

struct BinaryOperator {
  std::string_view symbol;
  Op op;
  int level;  // binding strength, weakest first (C-like)
};

constexpr BinaryOperator kBinaryOperators[] = {
    {"||", Op::kOr, 1},       {"&&", Op::kAnd, 2},          {"==", Op::kEqual, 3},
    {"!=", Op::kNotEqual, 3}, {"<", Op::kLess, 4},          {"<=", Op::kLessEqual, 4},
    {">", Op::kGreater, 4},   {">=", Op::kGreaterEqual, 4}, {"+", Op::kAdd, 5},
    {"-", Op::kSub, 5},       {"*", Op::kMul, 6},           {"/", Op::kDiv, 6},
    {"%", Op::kMod, 6},
};
constexpr int kLowestLevel = 1;

struct Function {
  std::string_view name;
  Op op;
};

constexpr Function kFunctions[] = {
    {"where", Op::kWhere},     {"min", Op::kMin},     {"max", Op::kMax},
    {"clamp", Op::kClamp},     {"abs", Op::kAbs},     {"exp", Op::kExp},
    {"exp2", Op::kExp2},       {"log", Op::kLog},     {"log2", Op::kLog2},
    {"sqrt", Op::kSqrt},       {"rsqrt", Op::kRsqrt}, {"tanh", Op::kTanh},
    {"sigmoid", Op::kSigmoid}, {"floor", Op::kFloor}, {"float", Op::kToFloat},
    {"int", Op::kToInt},
};

struct Leaf {
  std::string_view name;
  Expr (*make)();
};

Expr literal_true() { return literal_bool(true); }
Expr literal_false() { return literal_bool(false); }

constexpr Leaf kLeaves[] = {
    {"score", score},
    {"b", batch},
    {"h", head},
    {"q", query},
    {"kv", key},
    {"Q_LEN", query_length},
    {"KV_LEN", key_length},
    {"inf", infinity},
    {"true", literal_true},
    {"false", literal_false},
};

std::vector<Token> tokenize(std::string_view text, const std::string& context) {
  std::vector<Token> tokens;
  std::size_t i = 0;
  const auto column = [](std::size_t offset) { return offset + 1; };
  while (i < text.size()) {
    const char c = text[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
      continue;
    }
    const std::size_t begin = i;
    if (is_digit(c) || (c == '.' && i + 1 < text.size() && is_digit(text[i + 1]))) {
      bool real = false;
      while (i < text.size() && is_digit(text[i])) ++i;
      if (i < text.size() && text[i] == '.') {
        real = true;
        ++i;
        while (i < text.size() && is_digit(text[i])) ++i;
      }
      if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
        std::size_t j = i + 1;
        if (j < text.size() && (text[j] == '+' || text[j] == '-')) ++j;
        if (j < text.size() && is_digit(text[j])) {
          real = true;
          i = j;
          while (i < text.size() && is_digit(text[i])) ++i;
        }
      }
      tokens.push_back({real ? TokenKind::kReal : TokenKind::kInteger,
                        text.substr(begin, i - begin), column(begin)});
      continue;
    }
    if (is_alpha(c)) {
      while (i < text.size() && (is_alpha(text[i]) || is_digit(text[i]))) ++i;
      tokens.push_back({TokenKind::kIdentifier, text.substr(begin, i - begin), column(begin)});
      continue;
    }
    static constexpr std::string_view kTwoCharacter[] = {"&&", "||", "==", "!=", "<=", ">="};
    bool matched = false;
    for (std::string_view symbol : kTwoCharacter) {
      if (text.substr(i, 2) == symbol) {
        tokens.push_back({TokenKind::kSymbol, text.substr(i, 2), column(begin)});
        i += 2;
        matched = true;
        break;
      }
    }
    if (matched) continue;
    static constexpr std::string_view kOneCharacter = "+-*/%<>!()[],";
    if (kOneCharacter.find(c) != std::string_view::npos) {
      tokens.push_back({TokenKind::kSymbol, text.substr(i, 1), column(begin)});
      ++i;
      continue;
    }
    throw_invalid(
        fmt::format("unexpected character '{}' at column {} in {}", c, column(begin), context));
  }
  tokens.push_back({TokenKind::kEnd, {}, column(text.size())});
  return tokens;
}

// The deepest expression parse() accepts, in nested operators, calls and parentheses, and in the
// height of the tree it builds. Real modifiers are a few levels deep; the limit keeps every
// recursive walk of the IR (canonicalisation, printing, derivatives, interval analysis, engines'
// lowerings) far from the end of the stack.
constexpr int kMaxParseDepth = 256;

// Error messages quote the text, shortened past this many characters (a hostile expression can
// be megabytes long; the column still locates the error).
constexpr std::size_t kQuotedTextLength = 120;

std::string quoted(std::string_view text) {
  if (text.size() <= kQuotedTextLength) return fmt::format("\"{}\"", text);
  return fmt::format("\"{}...\" ({} characters)", text.substr(0, kQuotedTextLength), text.size());
}

class Parser {
 public:
  Parser(std::string_view text, const Scope& scope)
      : context_(quoted(text)), scope_(scope), tokens_(tokenize(text, context_)) {}

  Expr parse_all() {
    if (peek().kind == TokenKind::kEnd) fail("empty expression", peek());
    Expr result = parse_binary(kLowestLevel);
    if (peek().kind != TokenKind::kEnd) fail(fmt::format("unexpected '{}'", peek().text), peek());
    return result;
  }

 private:
  [[noreturn]] void fail(const std::string& message, const Token& at) const {
    throw_invalid(fmt::format("{} at column {} in {}", message, at.column, context_));
  }

  const Token& peek() const { return tokens_[position_]; }
  Token next() { return tokens_[position_ < tokens_.size() - 1 ? position_++ : position_]; }
  bool at_symbol(std::string_view symbol) const {
    return peek().kind == TokenKind::kSymbol && peek().text == symbol;
  }
  void expect(std::string_view symbol) {
    if (!at_symbol(symbol)) {
      const Token& token = peek();
      const std::string found = token.kind == TokenKind::kEnd ? std::string("end of input")
                                                              : fmt::format("'{}'", token.text);
      fail(fmt::format("expected '{}' but found {}", symbol, found), token);
    }
    next();
  }

  // Counts the parser's own recursion (parentheses, unary operators and function calls nest it
  // even where the tree stays flat, as in "((((score))))").
  class Nesting {
   public:
    Nesting(Parser& parser, const Token& at) : parser_(parser) {
      if (++parser_.nesting_ > kMaxParseDepth) {
        parser_.fail(fmt::format("expression nested deeper than {} levels", kMaxParseDepth), at);
      }
    }
    ~Nesting() { --parser_.nesting_; }
    Nesting(const Nesting&) = delete;
    Nesting& operator=(const Nesting&) = delete;

   private:
    Parser& parser_;
  };

  // The height of a parsed node: leaves are 1 (absent from heights_).
  int height(const Expr& expr) const {
    const auto found = heights_.find(expr.pointer().get());
    return found == heights_.end() ? 1 : found->second;
  }

  // Records `built`'s height; a chain such as "score + 1 + 1 + ..." grows the tree without
  // nesting the parser, so the tree's height has its own check.
  Expr with_height(Expr built, const Token& at) {
    int tallest = 0;
    for (const Expr& arg : built.node().args) tallest = std::max(tallest, height(arg));
    if (tallest + 1 > kMaxParseDepth) {
      fail(fmt::format("expression nested deeper than {} levels", kMaxParseDepth), at);
    }
    heights_[built.pointer().get()] = tallest + 1;
    return built;
  }

  // Builds through ir::make; a type error gets the operator's position.
  Expr build(Op op, std::vector<Expr> args, const Token& at) {
    Expr built = [&] {
      try {
        return make(op, std::move(args));
      } catch (const Error& error) {
        fail(error.what(), at);
      }
    }();
    return with_height(std::move(built), at);
  }

  const BinaryOperator* binary_operator() const {
    if (peek().kind != TokenKind::kSymbol) return nullptr;
    for (const BinaryOperator& candidate : kBinaryOperators) {
      if (candidate.symbol == peek().text) return &candidate;
    }
    return nullptr;
  }

  Expr parse_binary(int min_level) {
    Expr left = parse_unary();
    while (const BinaryOperator* binary = binary_operator()) {
      if (binary->level < min_level) break;
      const Token token = next();
      Expr right = parse_binary(binary->level + 1);
      left = build(binary->op, {left, right}, token);
    }
    return left;
  }

  Expr parse_unary() {
    const Nesting nesting(*this, peek());
    if (at_symbol("-")) {
      const Token token = next();
      // A minus directly before a number is part of the literal (so -2147483648 is an i32).
      if (peek().kind == TokenKind::kInteger || peek().kind == TokenKind::kReal) {
        return parse_number(/*negative=*/true);
      }
      return build(Op::kNeg, {parse_unary()}, token);
    }
    if (at_symbol("!")) {
      const Token token = next();
      return build(Op::kNot, {parse_unary()}, token);
    }
    return parse_primary();
  }

  Expr parse_number(bool negative) {
    const Token token = next();
    const std::string_view digits = token.text;
    if (token.kind == TokenKind::kInteger) {
      std::int64_t value = 0;
      auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
      const std::int64_t limit =
          negative ? -static_cast<std::int64_t>(std::numeric_limits<std::int32_t>::min())
                   : std::numeric_limits<std::int32_t>::max();
      if (error != std::errc() || end != digits.data() + digits.size() || value > limit) {
        fail(fmt::format("integer literal {}{} is outside the i32 range", negative ? "-" : "",
                         digits),
             token);
      }
      return literal_i32(negative ? -value : value);
    }
    double value = 0.0;
    auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    if (error != std::errc() || end != digits.data() + digits.size()) {
      fail(fmt::format("number {} is out of range", digits), token);
    }
    return literal_f32(negative ? -value : value);
  }

  Expr parse_primary() {
    const Token& token = peek();
    switch (token.kind) {
      case TokenKind::kInteger:
      case TokenKind::kReal:
        return parse_number(/*negative=*/false);
      case TokenKind::kIdentifier:
        return parse_name();
      case TokenKind::kSymbol:
        if (token.text == "(") {
          next();
          Expr inner = parse_binary(kLowestLevel);
          expect(")");
          return inner;
        }
        fail(fmt::format("unexpected '{}'", token.text), token);
      case TokenKind::kEnd:
        fail("unexpected end of input", token);
    }
    fail("unexpected token", token);
  }

  std::vector<Expr> parse_arguments(std::string_view close) {
    std::vector<Expr> args;
    if (at_symbol(close)) {
      next();
      return args;
    }
    args.push_back(parse_binary(kLowestLevel));
    while (at_symbol(",")) {
      next();
      args.push_back(parse_binary(kLowestLevel));
    }
    expect(close);
    return args;
  }

  Expr parse_name() {
    const Token token = next();
    const std::string name(token.text);
    for (const Function& function : kFunctions) {
      if (function.name != name) continue;
      if (!at_symbol("(")) fail(fmt::format("expected '(' after '{}'", name), peek());
      next();
      std::vector<Expr> args = parse_arguments(")");
      const int expected = arity(function.op);
      if (static_cast<int>(args.size()) != expected) {
        fail(fmt::format("'{}' takes {} argument{}, got {}", name, expected,
                         expected == 1 ? "" : "s", args.size()),
             token);
      }
      return build(function.op, std::move(args), token);
    }
    for (const Leaf& leaf : kLeaves) {
      if (leaf.name == name) return leaf.make();
    }
    if (auto tensor = scope_.tensors.find(name); tensor != scope_.tensors.end()) {
      if (!at_symbol("["))
        fail(fmt::format("tensor '{}' needs indices: {}[...]", name, name), peek());
      next();
      std::vector<Expr> indices = parse_arguments("]");
      if (static_cast<int>(indices.size()) != tensor->second.rank) {
        fail(fmt::format("'{}' has rank {} but got {} ind{}", name, tensor->second.rank,
                         indices.size(), indices.size() == 1 ? "ex" : "ices"),
             token);
      }
      Expr loaded = [&] {
        try {
          return load(name, tensor->second.element_type, std::move(indices));
        } catch (const Error& error) {
          fail(error.what(), token);
        }
      }();
      return with_height(std::move(loaded), token);
    }
    for (const std::string& param_name : scope_.params) {
      if (param_name == name) return param(name);
    }
    fail(fmt::format("unknown name '{}'", name), token);
  }

  std::string context_;
  const Scope& scope_;
  std::vector<Token> tokens_;
  std::size_t position_ = 0;
  int nesting_ = 0;
  std::unordered_map<const ExprNode*, int> heights_;  // every node built here, but leaves
};

}  // namespace

Expr parse(std::string_view text, const Scope& scope) { return Parser(text, scope).parse_all(); }

}  // namespace flexattn::ir
