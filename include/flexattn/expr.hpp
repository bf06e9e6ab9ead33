// The modifier IR, builder side: a typed expression tree built with operator overloading or parsed
// from text. `Graph` (graph.hpp) is its canonical, hash-consed form that engines lower.
//
//   using namespace flexattn::ir;
//   Expr softcap = 30.0 * tanh(score() / 30.0);
//   Expr causal = query() >= key();
//   Expr alibi = score() + load("slopes", Type::kF32, {head()}) * (key() - query());
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "flexattn/export.hpp"

namespace flexattn {

enum class Type : std::uint8_t { kF32, kI32, kBool };
FLEXATTN_API std::string_view to_string(Type type);  // "f32", "i32", "bool"

// Every operation of the IR. Switches over Op have no `default:`, so adding an op breaks the
// build until every engine lowers or rejects it.
enum class Op : std::uint8_t {
  // leaves
  kScore,     // f32, the scaled score (score_mod only)
  kBatch,     // i32 `b`
  kHead,      // i32 `h` (query head)
  kQuery,     // i32 `q`
  kKey,       // i32 `kv`
  kQueryLen,  // i32 `Q_LEN`
  kKeyLen,    // i32 `KV_LEN`
  kLiteral,   // a constant of the node's type (f32 literals include inf)
  kParam,     // named scalar parameter, f32
  kLoad,      // named tensor load `name[i, j, ...]`; f32 for float tensors, i32 for integer ones
  // The elementwise operations, from here to the end of the enum (is_elementwise): keep them
  // last and contiguous.
  // arithmetic (i32 op i32 -> i32; anything with f32 -> f32)
  kAdd,
  kSub,
  kMul,
  kDiv,  // i32: floor division (Python/PyTorch `//`), x / 0 == 0
  kMod,  // floor modulo (sign of the divisor), x % 0 == 0
  kNeg,
  // comparisons -> bool
  kLess,
  kLessEqual,
  kGreater,
  kGreaterEqual,
  kEqual,
  kNotEqual,
  // logic on bool
  kAnd,
  kOr,
  kNot,
  // selection
  kWhere,  // where(bool, a, b)
  kMin,
  kMax,
  kClamp,  // clamp(x, lo, hi) == min(max(x, lo), hi)
  // math on f32 (i32 arguments are promoted)
  kAbs,  // keeps i32 for i32
  kExp,
  kExp2,
  kLog,
  kLog2,
  kSqrt,
  kRsqrt,
  kTanh,
  kSigmoid,
  kFloor,  // f32 -> f32
  // conversions
  kToFloat,  // float(x)
  kToInt,    // int(x): truncation toward zero; NaN -> 0; saturates to the i32 range
};

// Whether `op` is an elementwise operation: its value follows from its arguments' values alone
// (kAdd .. kToInt). The other ops are the leaves (kScore .. kParam) and kLoad. Code that treats
// every elementwise op alike switches on the others and handles these in one place.
constexpr bool is_elementwise(Op op) { return op >= Op::kAdd; }

// The text-syntax spelling: "+", "tanh", "where", "score", ...
FLEXATTN_API std::string_view to_string(Op op);
FLEXATTN_API int arity(Op op);            // -1 for kLoad (rank-dependent), 0 for leaves
FLEXATTN_API bool is_commutative(Op op);  // + * min max == != && ||

namespace ir {

struct ExprNode;

// A handle to an immutable, typed expression node. Cheap to copy. Construction type-checks and
// throws Error(kInvalidArgument) naming the offending sub-expression.
class FLEXATTN_API Expr {
 public:
  Expr(double value);        // f32 literal (implicit, so `30.0 * tanh(s / 30.0)` reads naturally)
  Expr(int value);           // i32 literal
  Expr(bool value) = delete;  // use literal_bool(): implicit bool conversions hide bugs

  Type type() const;
  Op op() const;
  const ExprNode& node() const { return *node_; }
  const std::shared_ptr<const ExprNode>& pointer() const { return node_; }
  std::string to_string() const;  // text syntax (same printer as Graph)

  explicit Expr(std::shared_ptr<const ExprNode> node) : node_(std::move(node)) {}

 private:
  std::shared_ptr<const ExprNode> node_;
};

struct ExprNode {
  Op op;
  Type type;
  double literal = 0.0;    // kLiteral (f32: the value; i32: an integer value; bool: 0 or 1)
  std::string name;        // kParam, kLoad
  std::vector<Expr> args;  // operands (indices for kLoad)
};

// Leaves.
FLEXATTN_API Expr score();
FLEXATTN_API Expr batch();         // b
FLEXATTN_API Expr head();          // h
FLEXATTN_API Expr query();         // q
FLEXATTN_API Expr key();           // kv
FLEXATTN_API Expr query_length();  // Q_LEN
FLEXATTN_API Expr key_length();    // KV_LEN
FLEXATTN_API Expr literal_f32(double value);
FLEXATTN_API Expr literal_i32(std::int64_t value);  // throws if outside the i32 range
FLEXATTN_API Expr literal_bool(bool value);
FLEXATTN_API Expr infinity();  // f32 +inf
FLEXATTN_API Expr param(std::string name);
// A load of `tensor` at `indices`; the element type is f32 or i32.
FLEXATTN_API Expr load(std::string tensor, Type element_type, std::vector<Expr> indices);

// Generic construction from an op and operands (used by the parser and the builder operators).
FLEXATTN_API Expr make(Op op, std::vector<Expr> args);

FLEXATTN_API Expr operator+(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator-(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator*(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator/(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator%(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator-(const Expr& a);
FLEXATTN_API Expr operator<(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator<=(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator>(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator>=(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator==(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator!=(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator&&(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator||(const Expr& a, const Expr& b);
FLEXATTN_API Expr operator!(const Expr& a);
FLEXATTN_API Expr where(const Expr& condition, const Expr& if_true, const Expr& if_false);
FLEXATTN_API Expr min(const Expr& a, const Expr& b);
FLEXATTN_API Expr max(const Expr& a, const Expr& b);
FLEXATTN_API Expr clamp(const Expr& x, const Expr& lo, const Expr& hi);
FLEXATTN_API Expr abs(const Expr& x);
FLEXATTN_API Expr exp(const Expr& x);
FLEXATTN_API Expr exp2(const Expr& x);
FLEXATTN_API Expr log(const Expr& x);
FLEXATTN_API Expr log2(const Expr& x);
FLEXATTN_API Expr sqrt(const Expr& x);
FLEXATTN_API Expr rsqrt(const Expr& x);
FLEXATTN_API Expr tanh(const Expr& x);
FLEXATTN_API Expr sigmoid(const Expr& x);
FLEXATTN_API Expr floor(const Expr& x);
FLEXATTN_API Expr to_float(const Expr& x);
FLEXATTN_API Expr to_int(const Expr& x);

// Names the parser may resolve besides the built-in leaves and functions.
struct Scope {
  std::vector<std::string> params;         // scalar parameters (f32)
  struct TensorDecl {
    Type element_type;  // kF32 or kI32
    int rank;
  };
  std::map<std::string, TensorDecl> tensors;
};

// Parses the text syntax. Errors are Error(kInvalidArgument) with the position and the offending
// text, e.g. `unknown name 'kvv' at column 6 in "q >= kvv"` (columns count from 1).
FLEXATTN_API Expr parse(std::string_view text, const Scope& scope = {});

// Builds a score modifier from a C++ callable taking the score: trace([](Expr s) { ... }).
inline Expr trace(const std::function<Expr(Expr)>& score_mod) { return score_mod(score()); }

}  // namespace ir
}  // namespace flexattn
