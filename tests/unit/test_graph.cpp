// Canonical graphs: hash-consing, explicit promotions, constant folding, exact identities,
// commutative ordering and a stable hash.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "flexattn/error.hpp"
#include "flexattn/graph.hpp"

namespace flexattn {
namespace {

using ir::Expr;

std::size_t count_ops(const Graph& graph, Op op) {
  return static_cast<std::size_t>(std::count_if(graph.nodes().begin(), graph.nodes().end(),
                                                [op](const GraphNode& n) { return n.op == op; }));
}

// Every operand precedes its user, and no node is unreachable from the root.
void expect_well_formed(const Graph& graph) {
  const auto& nodes = graph.nodes();
  ASSERT_FALSE(nodes.empty());
  EXPECT_EQ(graph.root(), static_cast<std::int32_t>(nodes.size()) - 1);
  std::vector<bool> used(nodes.size(), false);
  used[static_cast<std::size_t>(graph.root())] = true;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    for (std::int32_t arg : nodes[i].args) {
      EXPECT_LT(static_cast<std::size_t>(arg), i);
      used[static_cast<std::size_t>(arg)] = true;
    }
  }
  EXPECT_TRUE(std::all_of(used.begin(), used.end(), [](bool u) { return u; }));
}

TEST(Graph, DefaultIsTheIdentityScore) {
  const Graph identity;
  EXPECT_TRUE(identity.is_identity_score());
  EXPECT_TRUE(identity.uses_score());
  EXPECT_EQ(identity.nodes().size(), 1u);
  EXPECT_EQ(identity, Graph::identity_score());
  EXPECT_EQ(identity.to_string(), "score");
  EXPECT_FALSE(Graph(ir::score() * 2.0).is_identity_score());
}

TEST(Graph, AlwaysTrueIsALiteral) {
  const Graph mask = Graph::always_true();
  EXPECT_TRUE(mask.is_literal());
  EXPECT_EQ(mask.type(), Type::kBool);
  EXPECT_FALSE(mask.uses_score());
  EXPECT_EQ(mask.to_string(), "true");
}

TEST(Graph, HashConsesEqualSubExpressions) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  const Graph graph((q - kv) * (ir::query() - ir::key()));
  EXPECT_EQ(count_ops(graph, Op::kSub), 1u);
  EXPECT_EQ(count_ops(graph, Op::kQuery), 1u);
  EXPECT_EQ(graph.nodes().size(), 4u);
  expect_well_formed(graph);
  const GraphNode& root = graph.node(graph.root());
  ASSERT_EQ(root.args.size(), 2u);
  EXPECT_EQ(root.args[0], root.args[1]);
}

TEST(Graph, CommutativeOperandsAreOrdered) {
  const Expr a = ir::query();
  const Expr b = ir::score();
  EXPECT_EQ(Graph(a + b), Graph(b + a));
  EXPECT_EQ(Graph(a * b).nodes().size(), Graph(b * a).nodes().size());
  EXPECT_EQ(Graph(ir::min(a, b)), Graph(ir::min(b, a)));
  EXPECT_EQ(Graph(ir::max(a, b)), Graph(ir::max(b, a)));
  EXPECT_EQ(Graph(a == ir::key()), Graph(ir::key() == a));
  EXPECT_EQ(Graph((a < 3) && (a > 1)), Graph((a > 1) && (a < 3)));
  EXPECT_EQ(Graph((a < 3) || (a > 1)), Graph((a > 1) || (a < 3)));
  EXPECT_NE(Graph(a - ir::key()), Graph(ir::key() - a));
  EXPECT_NE(Graph(a < ir::key()), Graph(ir::key() < a));
  // Equal graphs have identical node lists, not just equal hashes.
  EXPECT_EQ(Graph(ir::score() + a * 2).to_string(), Graph(2 * a + ir::score()).to_string());
}

TEST(Graph, FoldsConstants) {
  const Expr s = ir::score();
  EXPECT_EQ(Graph(2 * 3 + s), Graph(6 + s));
  EXPECT_EQ(Graph(2 * 3 + s), Graph(s + 6.0));
  EXPECT_TRUE(Graph(Expr(7) / Expr(2) - 1).is_literal());
  EXPECT_EQ(Graph(Expr(-7) / Expr(2)).node(0).literal, -4.0);
  EXPECT_EQ(Graph(Expr(-7) % Expr(2)).node(0).literal, 1.0);
  EXPECT_EQ(Graph(ir::to_float(Expr(3))).to_string(), "3.0");
  EXPECT_EQ(Graph(ir::to_int(Expr(-2.7))).to_string(), "-2");
  EXPECT_EQ(Graph(-ir::infinity()).to_string(), "-inf");
  EXPECT_EQ(Graph(Expr(1) < Expr(2)).to_string(), "true");
  EXPECT_EQ(Graph(ir::tanh(Expr(0.0)) + s), Graph(s));
  // NaN has no literal syntax; it is left unfolded.
  EXPECT_EQ(Graph(ir::log(Expr(-1.0))).to_string(), "log(-1)");
}

TEST(Graph, AppliesExactIdentities) {
  const Expr s = ir::score();
  const Expr q = ir::query();
  const Expr c = ir::query() >= ir::key();
  EXPECT_EQ(Graph(s + 0.0), Graph(s));
  EXPECT_EQ(Graph(0 + q), Graph(q));
  EXPECT_EQ(Graph(q - 0), Graph(q));
  EXPECT_EQ(Graph(s * 1), Graph(s));
  EXPECT_EQ(Graph(1.0 * s), Graph(s));
  EXPECT_EQ(Graph(s / 1), Graph(s));
  EXPECT_EQ(Graph(q * 0), Graph(Expr(0)));
  EXPECT_EQ(Graph(-(-s)), Graph(s));
  EXPECT_EQ(Graph(!!c), Graph(c));
  EXPECT_EQ(Graph(ir::to_float(s)), Graph(s));
  EXPECT_EQ(Graph(ir::to_int(q)), Graph(q));
  EXPECT_EQ(Graph(ir::where(ir::literal_bool(true), s, q)), Graph(s));
  EXPECT_EQ(Graph(ir::where(Expr(1) > 2, s, q)), Graph(ir::to_float(q)));
  EXPECT_EQ(Graph(ir::where(c, s, s)), Graph(s));
  EXPECT_EQ(Graph(ir::where(!c, s, -s)), Graph(ir::where(c, -s, s)));
  EXPECT_EQ(Graph(c && ir::literal_bool(true)), Graph(c));
  EXPECT_EQ(Graph(c || ir::literal_bool(true)), Graph::always_true());
  EXPECT_EQ(Graph(c && ir::literal_bool(false)), Graph(ir::literal_bool(false)));
  // Not exact in floating point, so kept.
  EXPECT_EQ(Graph(s * 0.0).to_string(), "score * 0");
  expect_well_formed(Graph(ir::where(!c, s * 1, -s) + 0));
}

TEST(Graph, MakesPromotionsExplicit) {
  const Graph graph(ir::score() + ir::query());
  EXPECT_EQ(count_ops(graph, Op::kToFloat), 1u);
  EXPECT_EQ(graph, Graph(ir::score() + ir::to_float(ir::query())));
  EXPECT_EQ(graph.to_string(), "score + q");
  const Graph comparison(ir::score() < ir::query());
  EXPECT_EQ(count_ops(comparison, Op::kToFloat), 1u);
  const Graph math(ir::tanh(ir::query()));
  EXPECT_EQ(count_ops(math, Op::kToFloat), 1u);
  EXPECT_EQ(math.to_string(), "tanh(q)");
  const Graph selection(ir::where(ir::query() > 3, ir::query(), 2.5));
  EXPECT_EQ(count_ops(selection, Op::kToFloat), 1u);
  const Graph literal(ir::score() * 2);
  EXPECT_EQ(count_ops(literal, Op::kToFloat), 0u);
  EXPECT_EQ(literal.node(literal.node(literal.root()).args[0]).type, Type::kF32);
  EXPECT_EQ(count_ops(Graph(ir::abs(ir::query())), Op::kToFloat), 0u);
}

TEST(Graph, DifferentModifiersHashDifferently) {
  const Expr s = ir::score();
  const Expr q = ir::query();
  const Expr kv = ir::key();
  const std::vector<Graph> graphs = {
      Graph(s),
      Graph(s * 2.0),
      Graph(s * 3.0),
      Graph(30.0 * ir::tanh(s / 30.0)),
      Graph(50.0 * ir::tanh(s / 50.0)),
      Graph(q >= kv),
      Graph(q > kv),
      Graph(kv >= q),
      Graph(q - kv),
      Graph(kv - q),
      Graph(ir::literal_bool(true)),
      Graph(ir::literal_bool(false)),
      Graph(Expr(1)),
      Graph(Expr(1.0)),
      Graph(Expr(0.0)),
      Graph(Expr(-0.0)),
      Graph(ir::param("alpha")),
      Graph(ir::param("beta")),
      Graph(ir::load("bias", Type::kF32, {q})),
      Graph(ir::load("bias", Type::kF32, {kv})),
      Graph(ir::load("bias2", Type::kF32, {q})),
      Graph(ir::load("bias", Type::kI32, {q})),
  };
  for (std::size_t i = 0; i < graphs.size(); ++i) {
    for (std::size_t j = i + 1; j < graphs.size(); ++j) {
      EXPECT_NE(graphs[i].hash(), graphs[j].hash())
          << graphs[i].to_string() << " vs " << graphs[j].to_string();
    }
  }
}

TEST(Graph, MirroredComparisonsAreEqual) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  EXPECT_EQ(Graph(q >= kv).hash(), Graph(kv <= q).hash());
  EXPECT_EQ(Graph(q > kv).hash(), Graph(kv < q).hash());
  EXPECT_EQ(Graph(kv < 8).hash(), Graph(Expr(8) > kv).hash());
  EXPECT_NE(Graph(q >= kv).hash(), Graph(q > kv).hash());
  EXPECT_NE(Graph(q >= kv).hash(), Graph(kv >= q).hash());
}

TEST(Graph, HashIsPinned) {
  // Changing the hash function invalidates every on-disk cache and plan proof; do it on purpose.
  EXPECT_EQ(hash_to_hex(Graph(ir::query() >= ir::key()).hash()), "cf61fd3b681fa514");
  EXPECT_EQ(hash_to_hex(Graph(30.0 * ir::tanh(ir::score() / 30.0)).hash()), "26f87e1d70c3dc7f");
  EXPECT_EQ(hash_to_hex(hash_combine(0, 0)), "e220a8397b1dcdaf");
}

TEST(Graph, HashToHexHasSixteenDigits) {
  EXPECT_EQ(hash_to_hex(0), "0000000000000000");
  EXPECT_EQ(hash_to_hex(0xabcdef0123456789ULL), "abcdef0123456789");
  EXPECT_NE(hash_combine(1, 2), hash_combine(2, 1));
}

TEST(Graph, ListsTensorsAndParams) {
  const Expr q = ir::query();
  const Graph graph(ir::score() * ir::param("gamma") + ir::load("rel", Type::kF32, {q}) +
                    ir::load("bias", Type::kF32, {q}) * ir::param("alpha") +
                    ir::load("rel", Type::kF32, {ir::key()}));
  EXPECT_EQ(graph.tensors(), (std::vector<std::string>{"bias", "rel"}));
  EXPECT_EQ(graph.params(), (std::vector<std::string>{"alpha", "gamma"}));
  EXPECT_TRUE(Graph(q >= ir::key()).tensors().empty());
  EXPECT_FALSE(Graph(q >= ir::key()).uses_score());
}

TEST(Graph, ToExprRoundTrips) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  const std::vector<Expr> exprs = {
      ir::score() + ir::load("slopes", Type::kF32, {ir::head()}) * (kv - q),
      ir::where(q >= kv, ir::score(), -ir::infinity()),
      (q - kv) * (q - kv) + ir::to_int(ir::score()),
      ir::clamp(ir::score(), -1.5, q),
  };
  for (const Expr& expr : exprs) {
    const Graph graph(expr);
    EXPECT_EQ(Graph(graph.to_expr()), graph) << graph.to_string();
    EXPECT_EQ(Graph(graph.to_expr()).to_string(), graph.to_string());
    expect_well_formed(graph);
  }
}

TEST(Graph, RejectsIllTypedInput) {
  try {
    Graph graph(ir::make(Op::kAnd, {ir::score(), ir::query() >= ir::key()}));
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace flexattn
