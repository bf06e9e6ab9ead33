// Point evaluation of canonical graphs: every op at chosen points, including the integer edge
// cases (floor division and modulo of negatives, division by zero, int() of NaN and huge values).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

ir::Scope scope() {
  ir::Scope result;
  result.params = {"alpha"};
  result.tensors["bias"] = {Type::kF32, 2};
  result.tensors["doc"] = {Type::kI32, 1};
  return result;
}

// Evaluates `text` at score s, q, kv (b = 1, h = 2, Q_LEN = 10, KV_LEN = 12), alpha = 0.25.
double eval(const std::string& text, double s = 0.0, std::int64_t q = 0, std::int64_t kv = 0,
            const Bindings& extra = {}) {
  EvalPoint point;
  point.score = s;
  point.batch = 1;
  point.head = 2;
  point.query = q;
  point.key = kv;
  point.query_length = 10;
  point.key_length = 12;
  Bindings bindings = extra;
  bindings.params["alpha"] = 0.25;
  return evaluate(Graph(ir::parse(text, scope())), point, bindings);
}

// Integer operations evaluated with q and kv as operands, so no constant folding is involved.
double eval_int(const std::string& text, std::int64_t q, std::int64_t kv) {
  return eval(text, 0.0, q, kv);
}

TEST(Evaluate, Leaves) {
  EXPECT_EQ(eval("score", 1.5), 1.5);
  EXPECT_EQ(eval("b"), 1.0);
  EXPECT_EQ(eval("h"), 2.0);
  EXPECT_EQ(eval("q", 0, 3), 3.0);
  EXPECT_EQ(eval("kv", 0, 0, 4), 4.0);
  EXPECT_EQ(eval("Q_LEN"), 10.0);
  EXPECT_EQ(eval("KV_LEN"), 12.0);
  EXPECT_EQ(eval("alpha"), 0.25);
  EXPECT_EQ(eval("inf"), kInf);
  EXPECT_EQ(eval("-inf"), -kInf);
  EXPECT_EQ(eval("true"), 1.0);
  EXPECT_EQ(eval("false"), 0.0);
}

TEST(Evaluate, Arithmetic) {
  EXPECT_EQ(eval("score + q", 0.5, 2), 2.5);
  EXPECT_EQ(eval("score - kv", 0.5, 0, 2), -1.5);
  EXPECT_EQ(eval("score * alpha", 3.0), 0.75);
  EXPECT_EQ(eval("score / 4", 1.0), 0.25);
  EXPECT_EQ(eval("-score", 2.0), -2.0);
  EXPECT_EQ(eval("score / 0", 1.0), kInf);
  EXPECT_EQ(eval_int("q + kv", 3, 4), 7.0);
  EXPECT_EQ(eval_int("q - kv", 3, 4), -1.0);
  EXPECT_EQ(eval_int("q * kv", 3, 4), 12.0);
  EXPECT_EQ(eval_int("-q", 3, 0), -3.0);
  // i32 arithmetic wraps like the engines' 32-bit integers.
  EXPECT_EQ(eval_int("q * kv", 65536, 65536), 0.0);
  EXPECT_EQ(eval_int("q + kv", 2147483647, 1), -2147483648.0);
}

TEST(Evaluate, FloorDivisionAndModulo) {
  EXPECT_EQ(eval_int("q / kv", 7, 2), 3.0);
  EXPECT_EQ(eval_int("q / kv", -7, 2), -4.0);
  EXPECT_EQ(eval_int("q / kv", 7, -2), -4.0);
  EXPECT_EQ(eval_int("q / kv", -7, -2), 3.0);
  EXPECT_EQ(eval_int("q / kv", -6, 2), -3.0);
  EXPECT_EQ(eval_int("q / kv", 7, 0), 0.0);
  EXPECT_EQ(eval_int("q % kv", 7, 3), 1.0);
  EXPECT_EQ(eval_int("q % kv", -7, 3), 2.0);
  EXPECT_EQ(eval_int("q % kv", 7, -3), -2.0);
  EXPECT_EQ(eval_int("q % kv", -7, -3), -1.0);
  EXPECT_EQ(eval_int("q % kv", -6, 3), 0.0);
  EXPECT_EQ(eval_int("q % kv", 7, 0), 0.0);
  EXPECT_EQ(eval_int("q / kv", -2147483647 - 1, -1), -2147483648.0);
  EXPECT_EQ(eval("score % 2", -0.5), 1.5);
  EXPECT_EQ(eval("score % -2", 0.5), -1.5);
  EXPECT_EQ(eval("score % 0", 0.5), 0.0);
  EXPECT_EQ(eval("score / q", -7.0, 2), -3.5);
}

TEST(Evaluate, ComparisonsAndLogic) {
  EXPECT_EQ(eval_int("q < kv", 1, 2), 1.0);
  EXPECT_EQ(eval_int("q < kv", 2, 2), 0.0);
  EXPECT_EQ(eval_int("q <= kv", 2, 2), 1.0);
  EXPECT_EQ(eval_int("q > kv", 3, 2), 1.0);
  EXPECT_EQ(eval_int("q >= kv", 1, 2), 0.0);
  EXPECT_EQ(eval_int("q == kv", 2, 2), 1.0);
  EXPECT_EQ(eval_int("q != kv", 2, 2), 0.0);
  EXPECT_EQ(eval("score < q", 1.5, 2), 1.0);
  EXPECT_EQ(eval("score == score", kNaN), 0.0);
  EXPECT_EQ(eval("score != score", kNaN), 1.0);
  EXPECT_EQ(eval_int("q >= kv && q - kv < 32", 40, 5), 0.0);
  EXPECT_EQ(eval_int("q >= kv && q - kv < 32", 20, 5), 1.0);
  EXPECT_EQ(eval_int("q > kv || q == 0", 0, 5), 1.0);
  EXPECT_EQ(eval_int("q > kv || q == 0", 1, 5), 0.0);
  EXPECT_EQ(eval_int("!(q > kv)", 1, 5), 1.0);
  EXPECT_EQ(eval_int("(q > kv) == (kv > q)", 1, 1), 1.0);
}

TEST(Evaluate, SelectionAndMath) {
  EXPECT_EQ(eval("where(q >= kv, score, -inf)", 1.25, 3, 2), 1.25);
  EXPECT_EQ(eval("where(q >= kv, score, -inf)", 1.25, 1, 2), -kInf);
  EXPECT_EQ(eval_int("where(q > kv, q, kv)", 1, 2), 2.0);
  EXPECT_EQ(eval_int("min(q, kv)", -1, 2), -1.0);
  EXPECT_EQ(eval_int("max(q, kv)", -1, 2), 2.0);
  EXPECT_EQ(eval("min(score, q)", 0.5, 1), 0.5);
  EXPECT_EQ(eval("max(score, -inf)", -1e30), -1e30);
  EXPECT_EQ(eval_int("clamp(kv - q + 64, 0, 128)", 100, 0), 0.0);
  EXPECT_EQ(eval_int("clamp(kv - q + 64, 0, 128)", 0, 100), 128.0);
  EXPECT_EQ(eval_int("clamp(kv - q + 64, 0, 128)", 10, 20), 74.0);
  EXPECT_EQ(eval("clamp(score, -1, 1)", -kInf), -1.0);
  EXPECT_EQ(eval_int("abs(q - kv)", 1, 5), 4.0);
  EXPECT_EQ(eval("abs(score)", -2.5), 2.5);
  EXPECT_DOUBLE_EQ(eval("exp(score)", 1.0), std::exp(1.0));
  EXPECT_EQ(eval("exp(score)", -kInf), 0.0);
  EXPECT_EQ(eval("exp2(q)", 0, 10), 1024.0);
  EXPECT_DOUBLE_EQ(eval("log(score)", 2.0), std::log(2.0));
  EXPECT_EQ(eval("log(score)", 0.0), -kInf);
  EXPECT_TRUE(std::isnan(eval("log(score)", -1.0)));
  EXPECT_EQ(eval("log2(kv)", 0, 0, 8), 3.0);
  EXPECT_EQ(eval("sqrt(q)", 0, 9), 3.0);
  EXPECT_EQ(eval("rsqrt(score)", 4.0), 0.5);
  EXPECT_DOUBLE_EQ(eval("30 * tanh(score / 30)", 45.0), 30.0 * std::tanh(1.5));
  EXPECT_EQ(eval("sigmoid(score)", 0.0), 0.5);
  EXPECT_EQ(eval("sigmoid(score)", -kInf), 0.0);
  EXPECT_EQ(eval("sigmoid(score)", kInf), 1.0);
  EXPECT_EQ(eval("floor(score)", -1.5), -2.0);
  EXPECT_EQ(eval("floor(q)", 0, 3), 3.0);
}

TEST(Evaluate, Conversions) {
  EXPECT_EQ(eval("float(q) / kv", 0, 1, 2), 0.5);
  EXPECT_EQ(eval_int("q / kv", 1, 2), 0.0);
  EXPECT_EQ(eval("int(score)", 2.7), 2.0);
  EXPECT_EQ(eval("int(score)", -2.7), -2.0);
  EXPECT_EQ(eval("int(score)", kNaN), 0.0);
  EXPECT_EQ(eval("int(score)", 1e20), 2147483647.0);
  EXPECT_EQ(eval("int(score)", -1e20), -2147483648.0);
  EXPECT_EQ(eval("int(score)", kInf), 2147483647.0);
  EXPECT_EQ(eval("int(score)", -kInf), -2147483648.0);
  EXPECT_EQ(eval("int(score) % 16", 35.5), 3.0);
}

TEST(Evaluate, ConstantFoldingAgreesWithEvaluation) {
  // The same text with literals (folded by Graph) and with leaves (evaluated) gives equal values.
  const std::vector<std::pair<std::int64_t, std::int64_t>> points = {
      {7, 2}, {-7, 2}, {7, -2}, {-7, -3}, {5, 0}, {0, 0}, {-2147483647, 3}};
  const std::vector<std::string> ops = {"+", "-", "*", "/", "%", "<", "==", ">="};
  for (const auto& [a, b] : points) {
    for (const std::string& op : ops) {
      const std::string folded =
          "(" + std::to_string(a) + ") " + op + " (" + std::to_string(b) + ")";
      const Graph literal_graph(ir::parse(folded));
      ASSERT_TRUE(literal_graph.is_literal()) << folded;
      EXPECT_EQ(evaluate(literal_graph, {}, {}), eval_int("q " + op + " kv", a, b)) << folded;
    }
  }
}

TEST(Evaluate, LoadsReadThroughStrides) {
  // bias is a (3, 4) view of a transposed (4, 3) buffer: bias[i, j] = storage[j * 3 + i].
  HostTensor storage(DType::kF32, {4, 3});
  for (std::int64_t i = 0; i < 12; ++i) storage.set(i, static_cast<double>(i) * 0.5);
  TensorView bias = storage.view();
  bias.shape = {3, 4};
  bias.strides = {1, 3};
  HostTensor doc(DType::kI32, {5});
  for (std::int64_t i = 0; i < 5; ++i) doc.set(i, static_cast<double>(i / 2));
  Bindings bindings;
  bindings.tensors["bias"] = bias;
  bindings.tensors["doc"] = doc.view();
  EXPECT_EQ(eval("score + bias[q, kv]", 1.0, 2, 3, bindings), 1.0 + 0.5 * (3 * 3 + 2));
  EXPECT_EQ(eval("doc[q] == doc[kv]", 0, 2, 3, bindings), 1.0);
  EXPECT_EQ(eval("doc[q] == doc[kv]", 0, 1, 2, bindings), 0.0);
  EXPECT_EQ(eval("bias[doc[kv], q]", 0, 1, 4, bindings), 0.5 * (1 * 3 + 2));

  std::vector<double> values;
  EvalPoint point;
  point.query = 1;
  point.key = 2;
  const Graph graph(ir::parse("score * bias[q, kv]", scope()));
  evaluate_all(graph, point, bindings, values);
  ASSERT_EQ(values.size(), graph.nodes().size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (graph.nodes()[i].op == Op::kLoad) {
      EXPECT_EQ(values[i], 0.5 * (2 * 3 + 1));
    }
  }

  try {
    eval("bias[q, kv]", 0, 3, 0, bindings);
    FAIL() << "out-of-bounds load did not throw";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInternal);
  }
  try {
    eval("bias[q, kv]", 0, 0, -1, bindings);
    FAIL() << "negative index did not throw";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInternal);
  }
}

TEST(Evaluate, UnboundNamesAreInvalidArguments) {
  try {
    evaluate(Graph(ir::param("gamma")), {}, {});
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  }
  try {
    eval("doc[q]");
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace flexattn
