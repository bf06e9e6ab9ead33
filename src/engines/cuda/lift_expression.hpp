// The expression half of the generated source's parser (source_lift.cpp): tokens and a
// recursive-descent parser of exactly the expressions codegen.cpp prints, into LiftedNodes.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engines/cuda/source_lift.hpp"

namespace flexattn::cuda::lift {

// Thrown inside the parser; lift_modifier_source turns it into LiftResult::failure.
struct LiftError {
  std::string what;
};
[[noreturn]] void fail(std::string what);
const char* type_name(LiftedType type);

enum class TokenKind { kIdentifier, kNumber, kSymbol, kEnd };
struct Token {
  TokenKind kind;
  std::string text;
};
std::vector<Token> tokenize(std::string_view text);

// What a statement may read: the function's scalar parameters, whether `p` and `staged` are in
// scope, its named values.
struct Scope {
  std::set<std::string> leaves;  // score, dot, q, kv, bound, dlogit
  bool has_p = false;
  bool has_at = false;
  bool has_inv = false;
  bool has_staged = false;
  std::map<std::string, int> values;  // const locals: node
};

class ExpressionParser {
 public:
  ExpressionParser(LiftedModifier& modifier, const Scope& scope, std::vector<Token> tokens)
      : modifier_(modifier), scope_(scope), tokens_(std::move(tokens)) {}

  // An expression up to the next token it cannot continue with (',', ')', the end...).
  int expression();
  // Single tokens, for the statements around expressions.
  void expect(std::string_view text);
  bool accept(std::string_view text);
  void expect_end();
  std::int64_t integer();
  std::string identifier();
  LiftedType type(int node) const { return modifier_.nodes[static_cast<std::size_t>(node)].type; }

 private:
  int add(LiftedKind kind, LiftedType type, std::vector<int> args, std::string name = {},
          double number = 0.0, int slot = -1);
  void require(int node, LiftedType wanted, std::string_view what) const;

  int logical_or();
  int logical_and();
  int comparison();
  // Plain C++ arithmetic: offsets (int / long long) and tanh_args_small's float products.
  int arithmetic(const char* symbol, int left, int right);
  int additive();
  int multiplicative();
  int unary();
  int number();
  LiftedType cast_type();
  std::vector<int> arguments();
  // load_tensor_*(static_cast<const T*>(p.tensors[slot].data), offset)
  int load(const std::string& loader);
  int call(const std::string& name);
  int primary();

  LiftedModifier& modifier_;
  const Scope& scope_;
  std::vector<Token> tokens_;
  std::size_t position_ = 0;
};

}  // namespace flexattn::cuda::lift
