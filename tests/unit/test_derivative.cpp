// Symbolic derivatives of score modifiers against central finite differences in float64, for
// every op, with respect to the score and to every float tensor the modifier reads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"
#include "flexattn/expr.hpp"
#include "flexattn/graph.hpp"

namespace flexattn {
namespace {

using ir::Expr;

constexpr std::int64_t kBatch = 2;
constexpr std::int64_t kHeads = 3;
constexpr std::int64_t kSeqLenQ = 5;
constexpr std::int64_t kSeqLenKv = 7;
constexpr std::int64_t kRelativeBuckets = 9;  // rel[h, clamp(kv - q + 4, 0, 8)]
// Finite-difference step: central differences have O(step^2) truncation error and O(eps/step)
// rounding error in double; 1e-5 balances both near 1e-10.
constexpr double kStep = 1e-5;
// Points closer than this to a kink (tie, step) are skipped: far larger than kStep, so the
// two-sided difference never straddles one.
constexpr double kKinkMargin = 1e-3;
constexpr double kRelativeTolerance = 1e-6;
constexpr int kPointsPerCase = 40;
constexpr int kMaxTries = 400;

// A score modifier with the places where it is not differentiable: `ties` are zero at a kink,
// `steps` are integers at one (floor, int, %).
struct Case {
  std::string name;
  Expr score_mod;
  std::vector<Expr> ties;
  std::vector<Expr> steps;
};

Expr score() { return ir::score(); }
Expr h() { return ir::head(); }
Expr q() { return ir::query(); }
Expr kv() { return ir::key(); }
Expr bias() { return ir::load("bias", Type::kF32, {h(), q(), kv()}); }
Expr slopes() { return ir::load("slopes", Type::kF32, {h()}); }
Expr gate() { return ir::load("gate", Type::kF32, {h()}); }
Expr rel(const Expr& bucket) { return ir::load("rel", Type::kF32, {h(), bucket}); }
Expr idx() { return ir::load("idx", Type::kI32, {q()}); }

// Float tensors in double storage (perturbed in place) and one integer tensor.
class TensorStore {
 public:
  TensorStore() {
    std::mt19937_64 generator(7);
    std::uniform_real_distribution<double> value(-1.5, 1.5);
    add_float("bias", {kHeads, kSeqLenQ, kSeqLenKv}, generator, value);
    add_float("slopes", {kHeads}, generator, value);
    add_float("gate", {kHeads}, generator, value);
    add_float("rel", {kHeads, kRelativeBuckets}, generator, value);
    indices_ = {3, -2, 0, 7, 1};
    TensorView view;
    view.data = indices_.data();
    view.dtype = DType::kI32;
    view.shape = {kSeqLenQ};
    view.strides = contiguous_strides(view.shape);
    bindings_.tensors["idx"] = view;
    bindings_.params["p"] = 0.75;
  }

  const Bindings& bindings() const { return bindings_; }
  double& element(const std::string& name, std::int64_t offset) {
    return floats_.at(name)[static_cast<std::size_t>(offset)];
  }

 private:
  void add_float(const std::string& name, std::vector<std::int64_t> shape,
                 std::mt19937_64& generator, std::uniform_real_distribution<double>& value) {
    std::int64_t count = 1;
    for (std::int64_t extent : shape) count *= extent;
    std::vector<double>& storage = floats_[name];
    for (std::int64_t i = 0; i < count; ++i) storage.push_back(value(generator));
    TensorView view;
    view.data = storage.data();
    view.dtype = DType::kF64;
    view.shape = std::move(shape);
    view.strides = contiguous_strides(view.shape);
    bindings_.tensors[name] = view;
  }

  std::map<std::string, std::vector<double>> floats_;  // node-based: data pointers stay valid
  std::vector<std::int32_t> indices_;
  Bindings bindings_;
};

bool near_kink(const Case& test_case, const EvalPoint& point, const Bindings& bindings) {
  for (const Expr& tie : test_case.ties) {
    if (std::abs(evaluate(Graph(tie), point, bindings)) < kKinkMargin) return true;
  }
  for (const Expr& step : test_case.steps) {
    const double value = evaluate(Graph(step), point, bindings);
    if (std::abs(value - std::round(value)) < kKinkMargin) return true;
  }
  return false;
}

void expect_close(double symbolic, double numeric, const std::string& what) {
  const double tolerance = kRelativeTolerance * std::max(1.0, std::abs(numeric));
  EXPECT_NEAR(symbolic, numeric, tolerance) << what;
}

std::string describe(const EvalPoint& point) {
  return "score " + std::to_string(point.score) + " b " + std::to_string(point.batch) + " h " +
         std::to_string(point.head) + " q " + std::to_string(point.query) + " kv " +
         std::to_string(point.key);
}

// Checks d/dscore and d/dtensor of `test_case` at kPointsPerCase random points off its kinks.
void check_case(const Case& test_case) {
  SCOPED_TRACE(test_case.name + ": " + test_case.score_mod.to_string());
  TensorStore store;
  const Graph graph(test_case.score_mod);
  const Graph score_derivative = derivative_wrt_score(graph);
  ASSERT_EQ(score_derivative.type(), Type::kF32);
  const std::vector<LoadDerivative> load_derivatives = derivatives_wrt_tensors(graph);
  std::mt19937_64 generator(11);
  std::uniform_real_distribution<double> score_value(-3.0, 3.0);
  auto pick = [&](std::int64_t count) {
    return std::uniform_int_distribution<std::int64_t>(0, count - 1)(generator);
  };
  int checked = 0;
  for (int attempt = 0; attempt < kMaxTries && checked < kPointsPerCase; ++attempt) {
    EvalPoint point;
    point.score = score_value(generator);
    point.batch = pick(kBatch);
    point.head = pick(kHeads);
    point.query = pick(kSeqLenQ);
    point.key = pick(kSeqLenKv);
    point.query_length = kSeqLenQ;
    point.key_length = kSeqLenKv;
    const Bindings& bindings = store.bindings();
    if (near_kink(test_case, point, bindings)) continue;
    ++checked;
    const std::string where = describe(point);

    EvalPoint up = point;
    EvalPoint down = point;
    up.score += kStep;
    down.score -= kStep;
    const double numeric =
        (evaluate(graph, up, bindings) - evaluate(graph, down, bindings)) / (2 * kStep);
    expect_close(evaluate(score_derivative, point, bindings), numeric, "d/dscore at " + where);

    // Loads that hit the same element at this point add up.
    std::map<std::pair<std::string, std::int64_t>, double> expected;
    for (const LoadDerivative& load : load_derivatives) {
      const TensorView& view = bindings.tensors.at(load.tensor);
      ASSERT_EQ(static_cast<int>(load.indices.size()), view.rank());
      std::int64_t offset = 0;
      for (std::size_t d = 0; d < load.indices.size(); ++d) {
        ASSERT_EQ(load.indices[d].type(), Type::kI32);
        const auto index = static_cast<std::int64_t>(evaluate(load.indices[d], point, bindings));
        ASSERT_GE(index, 0);
        ASSERT_LT(index, view.shape[d]);
        offset += index * view.strides[d];
      }
      expected[{load.tensor, offset}] += evaluate(load.derivative, point, bindings);
    }
    for (const auto& [element, derivative] : expected) {
      double& value = store.element(element.first, element.second);
      const double saved = value;
      value = saved + kStep;
      const double above = evaluate(graph, point, bindings);
      value = saved - kStep;
      const double below = evaluate(graph, point, bindings);
      value = saved;
      expect_close(derivative, (above - below) / (2 * kStep),
                   "d/d" + element.first + "[" + std::to_string(element.second) + "] at " + where);
    }
  }
  EXPECT_EQ(checked, kPointsPerCase) << "too many random points fell near a kink";
}

std::vector<Case> arithmetic_cases() {
  const Expr s = score();
  return {
      {"add", s + 1.5, {}, {}},
      {"add_self", s + s, {}, {}},
      {"sub", 2.0 - s, {}, {}},
      {"sub_index", s - ir::to_float(q()), {}, {}},
      {"mul", s * s * 0.5, {}, {}},
      {"mul_index", s * ir::to_float(kv() + 1), {}, {}},
      {"div_by_literal", s / 3.0, {}, {}},
      {"div_of_literal", 1.0 / (s * s + 1.0), {}, {}},
      {"div_both", (s + 5.0) / (s * s + 1.0), {}, {}},
      {"mod_dividend", s % 1.5, {}, {s / 1.5}},
      {"mod_divisor", 5.0 % (s + 6.0), {}, {5.0 / (s + 6.0)}},
      {"mod_both", (s * 3.0) % (s + 6.0), {}, {(s * 3.0) / (s + 6.0)}},
      {"mod_i32", s * ir::to_float(q() % 3), {}, {}},
      {"div_i32", s * ir::to_float((q() - 2) / 2), {}, {}},
      {"neg", -s * 2.0, {}, {}},
      {"exp", ir::exp(s), {}, {}},
      {"exp2", ir::exp2(s * 0.5), {}, {}},
      {"log", ir::log(s * s + 0.25), {}, {}},
      {"log2", ir::log2(s * s + 0.25), {}, {}},
      {"sqrt", ir::sqrt(s * s + 0.1), {}, {}},
      {"rsqrt", ir::rsqrt(s * s + 0.5), {}, {}},
      {"tanh", ir::tanh(s), {}, {}},
      {"sigmoid", ir::sigmoid(s * 2.0), {}, {}},
      {"floor", s * ir::floor(s * 2.0), {}, {s * 2.0}},
      {"float", s + ir::to_float(q() * kv()), {}, {}},
      {"int", s * ir::to_float(ir::to_int(s * 2.0)), {}, {s * 2.0}},
      {"leaves",
       s * ir::to_float(ir::batch() + h() + q() + kv()) +
           ir::to_float(ir::query_length() - ir::key_length()),
       {},
       {}},
      {"param", s * ir::param("p") + ir::param("p"), {}, {}},
      {"int_tensor", s * ir::to_float(idx() + 1), {}, {}},
      {"constant", ir::to_float(q() - kv()) * 2.0, {}, {}},
  };
}

std::vector<Case> selection_cases() {
  const Expr s = score();
  return {
      {"where_greater", ir::where(s > 0.5, s * 2.0, s * s), {s - 0.5}, {}},
      {"where_less_equal", ir::where(s <= 1.0, ir::exp(s), 2.0 - s), {s - 1.0}, {}},
      {"where_less", ir::where(s < -1.0, s * 3.0, 1.0), {s + 1.0}, {}},
      {"where_greater_equal", ir::where(s >= 0.0, 1.0, -s), {s}, {}},
      {"where_equal", ir::where(s == 1.0, 5.0, s), {s - 1.0}, {}},
      {"where_not_equal", ir::where(s != 0.25, s * s, 0.0), {s - 0.25}, {}},
      {"logic",
       ir::where((s > -1.0 && s < 1.0) || !(s < 2.0), s * 3.0, -s),
       {s + 1.0, s - 1.0, s - 2.0},
       {}},
      {"where_index", ir::where(q() >= kv(), s, s * 0.5 - 1.0), {}, {}},
      {"min", ir::min(s, 0.7 - s), {s - (0.7 - s)}, {}},
      {"max", ir::max(s * s, 1.0), {s * s - 1.0}, {}},
      {"clamp", ir::clamp(s, -1.0, 1.5), {s + 1.0, s - 1.5}, {}},
      {"clamp_bounds", ir::clamp(0.5, s, s + 1.0), {0.5 - s, 0.5 - (s + 1.0)}, {}},
      {"clamp_crossed_bounds", ir::clamp(1.0, s * s, s), {1.0 - s * s, 1.0 - s, s * s - s}, {}},
      {"abs", ir::abs(s - 0.3), {s - 0.3}, {}},
      {"abs_i32", s * ir::to_float(ir::abs(q() - kv())), {}, {}},
  };
}

// The named modifiers and modifiers reading float tensors (d/dtensor).
std::vector<Case> tensor_cases() {
  const Expr s = score();
  return {
      {"softcap", 30.0 * ir::tanh(s / 30.0), {}, {}},
      {"alibi", s + slopes() * (kv() - q()), {}, {}},
      {"bias", s + bias(), {}, {}},
      {"relative_bias", s + rel(ir::clamp(kv() - q() + 4, 0, 8)), {}, {}},
      {"piecewise", ir::where(s > 0.0, s, 0.1 * s) + bias() * 0.5, {s}, {}},
      {"sigmoid_gate", s * ir::sigmoid(gate()), {}, {}},
      {"same_load_twice", bias() * bias() + s, {}, {}},
      {"two_loads_same_tensor", gate() * ir::load("gate", Type::kF32, {q() % 3}) * s, {}, {}},
      {"exp_bias", ir::exp(bias()) * s, {}, {}},
      {"div_bias", bias() / (s * s + 1.0), {}, {}},
      {"mod_bias", (bias() + 2.0) % 1.5, {}, {(bias() + 2.0) / 1.5}},
      {"min_bias", ir::min(s, bias()), {s - bias()}, {}},
      {"clamp_by_tensors", ir::clamp(s, bias(), bias() + 1.0), {s - bias(), s - bias() - 1.0}, {}},
      {"log_gate", ir::log(gate() * gate() + 1.0) * s, {}, {}},
      {"tensor_in_index",
       s + rel(ir::clamp(ir::to_int(gate() * 3.0) + 4, 0, 8)),
       {},
       {gate() * 3.0}},
      {"mixed", s * slopes() - ir::tanh(bias()) + ir::sqrt(gate() * gate() + 0.5), {}, {}},
  };
}

TEST(DerivativeTest, ArithmeticOpsMatchFiniteDifferences) {
  for (const Case& test_case : arithmetic_cases()) check_case(test_case);
}

TEST(DerivativeTest, SelectionOpsMatchFiniteDifferences) {
  for (const Case& test_case : selection_cases()) check_case(test_case);
}

TEST(DerivativeTest, TensorModifiersMatchFiniteDifferences) {
  for (const Case& test_case : tensor_cases()) check_case(test_case);
}

TEST(DerivativeTest, IdentityHasUnitDerivative) {
  const Graph derivative = derivative_wrt_score(Graph::identity_score());
  EXPECT_TRUE(derivative.is_literal());
  EXPECT_EQ(evaluate(derivative, EvalPoint{}, Bindings{}), 1.0);
  EXPECT_TRUE(derivatives_wrt_tensors(Graph::identity_score()).empty());
}

TEST(DerivativeTest, PiecewiseConstantModifiersHaveZeroDerivative) {
  const Graph constant(ir::where(score() > 0.0, 1.0, -1.0) + ir::to_float(q()));
  const Graph derivative = derivative_wrt_score(constant);
  EXPECT_TRUE(derivative.is_literal());
  EXPECT_EQ(evaluate(derivative, EvalPoint{}, Bindings{}), 0.0);
  // Without the score at all.
  EXPECT_TRUE(derivative_wrt_score(Graph(bias() * 2.0)).is_literal());
}

TEST(DerivativeTest, LoadEntriesAreDistinctFloatLoads) {
  const Graph same(bias() * bias() + score());
  ASSERT_EQ(derivatives_wrt_tensors(same).size(), 1u);
  EXPECT_EQ(derivatives_wrt_tensors(same)[0].tensor, "bias");
  EXPECT_EQ(derivatives_wrt_tensors(same)[0].indices.size(), 3u);

  const Graph two(gate() * ir::load("gate", Type::kF32, {q() % 3}) + ir::to_float(idx()));
  const std::vector<LoadDerivative> entries = derivatives_wrt_tensors(two);
  ASSERT_EQ(entries.size(), 2u);  // the integer tensor idx has no gradient
  EXPECT_EQ(entries[0].tensor, "gate");
  EXPECT_EQ(entries[1].tensor, "gate");
  EXPECT_NE(entries[0].indices[0].hash(), entries[1].indices[0].hash());

  // A float load seen only through int() has a zero derivative but is still listed.
  const Graph through_int(score() + rel(ir::clamp(ir::to_int(gate()), 0, 8)));
  bool found_gate = false;
  for (const LoadDerivative& entry : derivatives_wrt_tensors(through_int)) {
    if (entry.tensor != "gate") continue;
    found_gate = true;
    EXPECT_TRUE(entry.derivative.is_literal());
    EXPECT_EQ(evaluate(entry.derivative, EvalPoint{}, Bindings{}), 0.0);
  }
  EXPECT_TRUE(found_gate);
}

TEST(DerivativeTest, TieConventionsAreOneSided) {
  EvalPoint point;
  point.score = 0.5;
  // min/max follow the first canonical operand at a tie; clamp and abs follow x.
  const Graph clamp_at_bound(ir::clamp(score(), 0.5, 2.0));
  EXPECT_EQ(evaluate(derivative_wrt_score(clamp_at_bound), point, Bindings{}), 1.0);
  point.score = 0.0;
  EXPECT_EQ(evaluate(derivative_wrt_score(Graph(ir::abs(score()))), point, Bindings{}), 1.0);
}

TEST(DerivativeTest, RejectsNonFloatModifiers) {
  try {
    derivative_wrt_score(Graph(q() >= kv()));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("f32"), std::string::npos) << error.what();
  }
  EXPECT_THROW(derivatives_wrt_tensors(Graph(q() >= kv())), Error);
}

}  // namespace
}  // namespace flexattn
