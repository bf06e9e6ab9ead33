// The text syntax: the examples of docs/design.md, print/parse round trips over every op, and error
// messages with their columns.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flexattn/error.hpp"
#include "flexattn/graph.hpp"

namespace flexattn {
namespace {

using ir::Expr;

ir::Scope test_scope() {
  ir::Scope scope;
  scope.params = {"alpha", "beta"};
  scope.tensors["bias"] = {Type::kF32, 3};
  scope.tensors["slopes"] = {Type::kF32, 1};
  scope.tensors["rel"] = {Type::kF32, 2};
  scope.tensors["doc"] = {Type::kI32, 1};
  scope.tensors["prefix"] = {Type::kI32, 1};
  return scope;
}

Graph parse_graph(const std::string& text) { return Graph(ir::parse(text, test_scope())); }

std::string parse_error(const std::string& text) {
  try {
    ir::parse(text, test_scope());
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << text;
    return error.what();
  }
  ADD_FAILURE() << "no error for " << text;
  return {};
}

TEST(Parser, DesignExamplesParse) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  const Expr s = ir::score();
  const auto slopes = [&](Expr i) { return ir::load("slopes", Type::kF32, {i}); };
  const auto doc = [&](Expr i) { return ir::load("doc", Type::kI32, {i}); };
  EXPECT_EQ(parse_graph("30 * tanh(score / 30)"), Graph(30.0 * ir::tanh(s / 30.0)));
  EXPECT_EQ(parse_graph("score + bias[h, q, kv]"),
            Graph(s + ir::load("bias", Type::kF32, {ir::head(), q, kv})));
  EXPECT_EQ(parse_graph("score + slopes[h] * (kv - q)"), Graph(s + slopes(ir::head()) * (kv - q)));
  EXPECT_EQ(parse_graph("score + rel[h, clamp(kv - q + 64, 0, 128)]"),
            Graph(s + ir::load("rel", Type::kF32, {ir::head(), ir::clamp(kv - q + 64, 0, 128)})));
  EXPECT_EQ(parse_graph("q >= kv"), Graph(q >= kv));
  EXPECT_EQ(parse_graph("q + (KV_LEN - Q_LEN) >= kv"),
            Graph(q + (ir::key_length() - ir::query_length()) >= kv));
  EXPECT_EQ(parse_graph("q >= kv && q - kv < 32"), Graph((q >= kv) && (q - kv < 32)));
  EXPECT_EQ(parse_graph("doc[q] == doc[kv] && q >= kv"), Graph((doc(q) == doc(kv)) && (q >= kv)));
}

TEST(Parser, PrecedenceAndAssociativity) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  const Expr b = ir::batch();
  EXPECT_EQ(parse_graph("q - kv - b"), Graph((q - kv) - b));
  EXPECT_NE(parse_graph("q - kv - b"), Graph(q - (kv - b)));
  EXPECT_EQ(parse_graph("q + kv * b"), Graph(q + kv * b));
  EXPECT_EQ(parse_graph("q / kv % b"), Graph((q / kv) % b));
  EXPECT_EQ(parse_graph("-q * kv"), Graph((-q) * kv));
  EXPECT_EQ(parse_graph("!(q < kv) || q == b && kv != b"),
            Graph(!(q < kv) || ((q == b) && (kv != b))));
  EXPECT_EQ(parse_graph("q < kv == b > kv"), Graph((q < kv) == (b > kv)));
  EXPECT_EQ(parse_graph("  q\t>=\nkv  "), Graph(q >= kv));
}

TEST(Parser, Literals) {
  EXPECT_EQ(ir::parse("3").type(), Type::kI32);
  EXPECT_EQ(ir::parse("3.0").type(), Type::kF32);
  EXPECT_EQ(ir::parse("3e2").type(), Type::kF32);
  EXPECT_EQ(ir::parse(".5").node().literal, 0.5);
  EXPECT_EQ(ir::parse("1.5e-3").node().literal, 1.5e-3);
  EXPECT_EQ(ir::parse("-2147483648").node().literal, -2147483648.0);
  EXPECT_EQ(ir::parse("2147483647").node().literal, 2147483647.0);
  EXPECT_EQ(Graph(ir::parse("-inf")).to_string(), "-inf");
  EXPECT_EQ(ir::parse("true").type(), Type::kBool);
  EXPECT_EQ(ir::parse("alpha * score", test_scope()).node().args[0].op(), Op::kParam);
}

// Every op appears at least once; printing then parsing must give the same canonical graph.
TEST(Parser, PrintParseRoundTrip) {
  const std::vector<std::string> sources = {
      "score",
      "30 * tanh(score / 30)",
      "score + bias[h, q, kv]",
      "score + slopes[h] * (kv - q)",
      "score + rel[h, clamp(kv - q + 64, 0, 128)]",
      "q >= kv",
      "q + (KV_LEN - Q_LEN) >= kv",
      "q >= kv && q - kv < 32",
      "doc[q] == doc[kv] && q >= kv",
      "kv < prefix[b] || q >= kv",
      "q - (kv - b)",
      "(q - kv) * (q - kv) % 7",
      "q / 3 - -5",
      "-score + -(q * kv)",
      "q <= kv || q > kv + 1 || q != 2",
      "!(q < kv) && !(b == h)",
      "where(q >= kv, score, -inf)",
      "where(q > kv, 30.0, 1.0)",
      "where(doc[q] != doc[kv], q < kv, true)",
      "min(score, 5) + max(q, kv) * 0.5",
      "clamp(score, -2.5, alpha)",
      "abs(q - kv) + abs(score)",
      "exp(score) + exp2(q) + log(abs(score) + 1) + log2(kv + 1)",
      "sqrt(q) * rsqrt(kv + 1.5)",
      "sigmoid(score * beta) + floor(score / 3)",
      "float(q) / kv",
      "float(q) / float(kv)",
      "int(score * 8) % 16 == 3",
      "score * 1e-30 + 1.0000001",
      "score + 123456789012.0 + 0.1",
      "score * -0.0 + 2.5e+20",
      "where(q == kv, inf, -inf) + score",
      "q * -2147483648",
      "(q >= kv) == (b < h) != false",
      "log(-1.0) + score",
      "score - (score - 1)",
  };
  for (const std::string& source : sources) {
    const Graph graph = parse_graph(source);
    const std::string printed = graph.to_string();
    const Graph reparsed = parse_graph(printed);
    EXPECT_EQ(reparsed.hash(), graph.hash()) << source << " printed as " << printed;
    EXPECT_EQ(reparsed.to_string(), printed) << source;
    // The builder tree prints to text that means the same too.
    EXPECT_EQ(parse_graph(ir::parse(source, test_scope()).to_string()), graph) << source;
  }
}

TEST(Parser, PrintsCanonicalGraphsReadably) {
  EXPECT_EQ(parse_graph("30 * tanh(score / 30)").to_string(), "tanh(score / 30) * 30");
  EXPECT_EQ(parse_graph("q - (kv - b)").to_string(), "q - (kv - b)");
  EXPECT_EQ(parse_graph("score + 2 * 3").to_string(), "score + 6");
  EXPECT_EQ(parse_graph("where(q >= kv, score, -inf)").to_string(), "where(q >= kv, score, -inf)");
  EXPECT_EQ(parse_graph("where(q > kv, 30.0, 1.0)").to_string(), "where(q > kv, 30.0, 1)");
  EXPECT_EQ(parse_graph("float(q) / float(kv)").to_string(), "float(q) / kv");
}

// Random well-typed expressions from a fixed seed, for the round-trip property.
class RandomExpr {
 public:
  explicit RandomExpr(std::uint32_t seed) : engine_(seed) {}

  Expr of(Type type, int depth) {
    if (depth == 0 || pick(4) == 0) return leaf(type);
    switch (type) {
      case Type::kBool:
        return boolean(depth - 1);
      case Type::kI32:
        return integer(depth - 1);
      case Type::kF32:
        return real(depth - 1);
    }
    return leaf(type);
  }

 private:
  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(engine_); }
  Type numeric() { return pick(2) == 0 ? Type::kI32 : Type::kF32; }

  Expr leaf(Type type) {
    static const double kReals[] = {0.0, -0.0, 1.0, 30.0, -2.5, 0.1, 1e-30, 3e20, -1e300};
    switch (type) {
      case Type::kBool:
        return pick(3) == 0 ? ir::literal_bool(pick(2) == 0) : ir::query() >= ir::key();
      case Type::kI32: {
        const Expr leaves[] = {ir::batch(),
                               ir::head(),
                               ir::query(),
                               ir::key(),
                               ir::query_length(),
                               ir::key_length(),
                               Expr(pick(200) - 100),
                               Expr(0),
                               Expr(1),
                               ir::literal_i32(-2147483647 - 1)};
        return leaves[pick(10)];
      }
      case Type::kF32: {
        const int choice = pick(5);
        if (choice == 0) return ir::score();
        if (choice == 1) return ir::param("alpha");
        if (choice == 2) return ir::infinity();
        return ir::literal_f32(kReals[pick(9)]);
      }
    }
    return ir::score();
  }

  Expr boolean(int depth) {
    const Type t = numeric();
    switch (pick(6)) {
      case 0:
        return of(t, depth) < of(numeric(), depth);
      case 1:
        return of(t, depth) == of(numeric(), depth);
      case 2:
        return of(Type::kBool, depth) && of(Type::kBool, depth);
      case 3:
        return of(Type::kBool, depth) || !of(Type::kBool, depth);
      case 4:
        return ir::where(of(Type::kBool, depth), of(Type::kBool, depth), of(Type::kBool, depth));
      default:
        return of(Type::kBool, depth) != (of(t, depth) >= of(t, depth));
    }
  }

  Expr integer(int depth) {
    const Expr a = of(Type::kI32, depth);
    const Expr b = of(Type::kI32, depth);
    switch (pick(10)) {
      case 0:
        return a + b;
      case 1:
        return a - b;
      case 2:
        return a * b;
      case 3:
        return a / b;
      case 4:
        return a % b;
      case 5:
        return -a;
      case 6:
        return ir::where(of(Type::kBool, depth), a, b);
      case 7:
        return ir::clamp(a, b, of(Type::kI32, depth));
      case 8:
        return ir::to_int(of(Type::kF32, depth)) + ir::abs(a);
      default:
        return ir::load("doc", Type::kI32, {a}) + ir::min(a, ir::max(a, b));
    }
  }

  Expr real(int depth) {
    const Expr a = of(numeric(), depth);
    const Expr b = of(pick(3) == 0 ? Type::kI32 : Type::kF32, depth);
    static const Op kUnary[] = {Op::kExp,   Op::kExp2, Op::kLog,     Op::kLog2,  Op::kSqrt,
                                Op::kRsqrt, Op::kTanh, Op::kSigmoid, Op::kFloor, Op::kToFloat};
    switch (pick(9)) {
      case 0:
        return a + b;
      case 1:
        return a - b;
      case 2:
        return b * a;
      case 3:
        return a / b;
      case 4:
        return b % a;
      case 5:
        return -b;
      case 6:
        return ir::make(kUnary[pick(10)], {a});
      case 7:
        return ir::where(of(Type::kBool, depth), a, b);
      default:
        return ir::clamp(a, b, of(numeric(), depth)) +
               ir::load("bias", Type::kF32, {of(Type::kI32, depth), ir::query(), ir::key()});
    }
  }

  std::mt19937 engine_;
};

TEST(Parser, RandomExpressionsRoundTrip) {
  constexpr std::uint32_t kSeed = 20240611;
  constexpr int kCount = 3000;
  constexpr int kDepth = 4;
  RandomExpr random(kSeed);
  const Type types[] = {Type::kF32, Type::kI32, Type::kBool};
  for (int i = 0; i < kCount; ++i) {
    const Expr expr = random.of(types[i % 3], kDepth);
    const Graph graph(expr);
    const std::string printed = graph.to_string();
    const Graph reparsed = parse_graph(printed);
    ASSERT_EQ(reparsed.hash(), graph.hash()) << expr.to_string() << " printed as " << printed;
    ASSERT_EQ(parse_graph(expr.to_string()).hash(), graph.hash()) << expr.to_string();
    ASSERT_EQ(Graph(graph.to_expr()).hash(), graph.hash()) << printed;
  }
}

TEST(Parser, ErrorMessagesHaveColumns) {
  EXPECT_EQ(parse_error("q >= kvv"), "unknown name 'kvv' at column 6 in \"q >= kvv\"");
  EXPECT_EQ(parse_error(""), "empty expression at column 1 in \"\"");
  EXPECT_EQ(parse_error("   "), "empty expression at column 4 in \"   \"");
  EXPECT_EQ(parse_error("(q >= kv"),
            "expected ')' but found end of input at column 9 in \"(q >= kv\"");
  EXPECT_EQ(parse_error("q >= kv)"), "unexpected ')' at column 8 in \"q >= kv)\"");
  EXPECT_EQ(parse_error("q >= kv kv"), "unexpected 'kv' at column 9 in \"q >= kv kv\"");
  EXPECT_EQ(parse_error("q >="), "unexpected end of input at column 5 in \"q >=\"");
  EXPECT_EQ(parse_error("q $ kv"), "unexpected character '$' at column 3 in \"q $ kv\"");
  EXPECT_EQ(parse_error("q & kv"), "unexpected character '&' at column 3 in \"q & kv\"");
  EXPECT_EQ(parse_error("clamp(q, 0)"),
            "'clamp' takes 3 arguments, got 2 at column 1 in \"clamp(q, 0)\"");
  EXPECT_EQ(parse_error("score * tanh()"),
            "'tanh' takes 1 argument, got 0 at column 9 in \"score * tanh()\"");
  EXPECT_EQ(parse_error("tanh + 1"), "expected '(' after 'tanh' at column 6 in \"tanh + 1\"");
  EXPECT_EQ(parse_error("score + bias[h, q]"),
            "'bias' has rank 3 but got 2 indices at column 9 in \"score + bias[h, q]\"");
  EXPECT_EQ(parse_error("score + slopes"),
            "tensor 'slopes' needs indices: slopes[...] at column 15 in \"score + slopes\"");
  EXPECT_EQ(parse_error("q + 3000000000"),
            "integer literal 3000000000 is outside the i32 range at column 5 in "
            "\"q + 3000000000\"");
  EXPECT_EQ(parse_error("score + 1e999"),
            "number 1e999 is out of range at column 9 in \"score + 1e999\"");
  EXPECT_EQ(parse_error("foo(q)"), "unknown name 'foo' at column 1 in \"foo(q)\"");
  EXPECT_EQ(parse_error("min(q, kv,)"), "unexpected ')' at column 11 in \"min(q, kv,)\"");
}

TEST(Parser, TypeErrorsReportTheOperatorColumn) {
  EXPECT_EQ(parse_error("score && q >= kv"),
            "type error: '&&' needs bool operands, got f32 in \"score && q >= kv\" at column 7 "
            "in \"score && q >= kv\"");
  EXPECT_EQ(parse_error("q >= kv + (q < 3)"),
            "type error: '+' needs numeric operands, got bool in \"kv + (q < 3)\" at column 9 in "
            "\"q >= kv + (q < 3)\"");
  EXPECT_EQ(parse_error("score + rel[h, score]"),
            "type error: index 1 of 'rel' must be i32, got f32 in \"rel[h, score]\" at column 9 "
            "in \"score + rel[h, score]\"");
  EXPECT_EQ(parse_error("-(q < kv)"),
            "type error: '-' needs a numeric operand, got bool in \"-(q < kv)\" at column 1 in "
            "\"-(q < kv)\"");
  EXPECT_EQ(parse_error("where(q, 1, 2)"),
            "type error: 'where' needs a bool condition, got i32 in \"where(q, 1, 2)\" at column "
            "1 in \"where(q, 1, 2)\"");
}

}  // namespace
}  // namespace flexattn
