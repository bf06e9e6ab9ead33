// Interval analysis: soundness of every node's interval by random sampling, tightness where the
// engines rely on it, tensor-load bound checks and clamping, and mask tile classification
// confirmed by brute force on every element of every tile.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"
#include "flexattn/expr.hpp"
#include "flexattn/graph.hpp"

namespace flexattn {
namespace {

using ir::Expr;

using Shapes = std::map<std::string, std::vector<std::int64_t>>;

Expr score() { return ir::score(); }
Expr b() { return ir::batch(); }
Expr h() { return ir::head(); }
Expr q() { return ir::query(); }
Expr kv() { return ir::key(); }
Expr q_len() { return ir::query_length(); }
Expr kv_len() { return ir::key_length(); }
Expr flt(const Expr& x) { return ir::to_float(x); }

constexpr std::int64_t kHeads = 4;
constexpr std::int64_t kSeqLenQ = 41;
constexpr std::int64_t kSeqLenKv = 51;
constexpr std::int64_t kIdxMin = -6;  // integer tensor contents: small, some out of any range
constexpr std::int64_t kIdxMax = 60;
constexpr int kSamples = 300;

Interval span(std::int64_t lo, std::int64_t hi) {
  return {static_cast<double>(lo), static_cast<double>(hi)};
}

LeafRanges fixed_ranges() {
  return {span(0, 1),
          span(0, kHeads - 1),
          span(0, kSeqLenQ - 1),
          span(0, kSeqLenKv - 1),
          span(kSeqLenQ, kSeqLenQ),
          span(kSeqLenKv, kSeqLenKv)};
}

// Ragged (thd): every sequence has its own lengths; positions stay below the longest.
LeafRanges ragged_ranges() {
  return {span(0, 3),        span(0, kHeads - 1), span(0, kSeqLenQ - 1), span(0, kSeqLenKv - 1),
          span(1, kSeqLenQ), span(1, kSeqLenKv)};
}

// Tensors for sampling: float tensors with wide values, an integer tensor with small values.
class SampleTensors {
 public:
  explicit SampleTensors(std::uint64_t seed) {
    std::mt19937_64 generator(seed);
    std::normal_distribution<double> normal(0.0, 4.0);
    std::uniform_int_distribution<std::int32_t> small(static_cast<std::int32_t>(kIdxMin),
                                                      static_cast<std::int32_t>(kIdxMax));
    for (std::int64_t i = 0; i < kHeads; ++i) slopes_.push_back(normal(generator));
    for (std::int64_t i = 0; i < kHeads * kSeqLenQ * kSeqLenKv; ++i) {
      bias_.push_back(normal(generator));
    }
    for (std::int64_t i = 0; i < kSeqLenKv; ++i) idx_.push_back(small(generator));
    bind("slopes", slopes_.data(), DType::kF64, {kHeads});
    bind("bias", bias_.data(), DType::kF64, {kHeads, kSeqLenQ, kSeqLenKv});
    bind("idx", idx_.data(), DType::kI32, {kSeqLenKv});
    bindings_.params["p"] = normal(generator);
  }

  const Bindings& bindings() const { return bindings_; }
  static Shapes shapes() {
    return {{"slopes", {kHeads}}, {"bias", {kHeads, kSeqLenQ, kSeqLenKv}}, {"idx", {kSeqLenKv}}};
  }

 private:
  void bind(const std::string& name, void* data, DType dtype, std::vector<std::int64_t> shape) {
    TensorView view;
    view.data = data;
    view.dtype = dtype;
    view.shape = std::move(shape);
    view.strides = contiguous_strides(view.shape);
    bindings_.tensors[name] = view;
  }

  std::vector<double> slopes_;
  std::vector<double> bias_;
  std::vector<std::int32_t> idx_;
  Bindings bindings_;
};

Expr bias() { return ir::load("bias", Type::kF32, {h(), q(), kv()}); }
Expr slopes() { return ir::load("slopes", Type::kF32, {h()}); }
Expr idx(const Expr& at) { return ir::load("idx", Type::kI32, {at}); }

std::vector<Expr> integer_expressions() {
  return {
      q() + kv(),
      q() - kv() + 7,
      (q() - 20) * (kv() - 25),
      -(q() - kv()),
      (q() - 20) / (kv() - 25),  // divisor range contains 0 (x / 0 == 0)
      (q() - 20) / 7,
      (q() + 10) / (-(kv() % 4) - 2),  // negative divisors: the minimum at (a.hi, b.hi)
      (q() - 20) / -7,
      q() / 4,
      (q() - 20) % (kv() - 25),
      q() % 8,
      (q() + 3) % 64,
      (q() - 20) % -6,
      (q() - 20) % (-kv() - 1),
      (-(q() % 5)) % (-kv() - 10),  // y < x <= 0: x % y == x
      (q() % 5) % (kv() + 10),
      ir::abs(q() - kv()),
      ir::min(q(), kv()),
      ir::max(q() - 30, kv() - 40),
      ir::clamp(q() - kv(), -5, 5),
      ir::where(q() > kv(), q(), kv() - 100),
      ir::to_int(score() * 10.0),
      ir::to_int(flt(q()) / 3.0),
      ir::to_int(flt(q()) * -0.7),
      ir::to_int(ir::sqrt(flt(q() - 20)) + 1.0),  // NaN (q < 20) converts to 0
      idx(kv()),
      idx(kv()) / (q() - 3),
      idx(idx(kv())) % 5,  // data-dependent index: clamped by check_and_clamp_loads
      q_len() - q() - 1,
      kv_len() - q_len() + q() - kv(),
      b() * ir::literal_i32(kHeads) + h(),
  };
}

std::vector<Expr> float_expressions() {
  const Expr s = score();
  return {
      s + 1.5,
      s * s,
      s / (flt(kv()) - 25.5),
      s / flt(kv() - 25),  // divisor range contains 0
      flt(q() - 20) / flt(kv() + 1),
      flt(q() + 1) / flt(kv() - 25),  // bounded dividend, divisor through 0
      s % 2.5,
      flt(q()) % 2.5,
      flt(q() - 20) % flt(kv() - 25),
      flt(q() - 20) % -3.5,
      -s,
      ir::exp(s),
      ir::exp(flt(q()) * 0.25),
      ir::exp2(flt(kv() - q())),
      ir::log(ir::abs(s)),
      ir::log(s),
      ir::log(flt(q())),
      ir::log2(flt(kv()) + 0.5),
      ir::sqrt(s),
      ir::sqrt(flt(q())),
      ir::rsqrt(flt(q()) + 0.5),
      ir::rsqrt(flt(q() - 10)),
      ir::tanh(s) * 3.0 + ir::sigmoid(s),
      ir::tanh(flt(q() - kv()) * 0.1),
      ir::sigmoid(flt(kv()) * 0.3 - 4.0),
      ir::floor(s * 3.0),
      ir::floor(flt(q()) / 3.0),
      flt(q()) * 0.1,  // 0.1 is not a float: the interval must hold the f32 and f64 products
      slopes() * (kv() - q()),
      bias() + s,
      ir::param("p") * s,
      ir::where(s > 0.0, s, 0.1 * s),
      ir::min(ir::tanh(s), 0.5),
      ir::max(ir::exp(s), flt(q())),
      ir::clamp(s, -1.0, 1.0),
      ir::clamp(flt(q() - kv()), -2.5, 3.5),
      ir::abs(flt(q()) - 20.5),
      30.0 * ir::tanh(s / 30.0),
      ir::infinity() * flt(q() - 20),
      flt(q()) - ir::infinity(),
      flt(idx(kv())),
  };
}

std::vector<Expr> bool_expressions() {
  const Expr s = score();
  return {
      q() >= kv(),
      q() < kv(),
      q() == kv(),
      q() != kv(),
      q() <= kv() + 3,
      q() > 5,
      flt(q()) >= 1.5 * flt(kv()),
      s > 0.0 && q() >= kv(),
      !(q() > kv()) || kv() < 10,
      ir::where(q() > 10, q() < kv(), kv() < 5),
      idx(q()) == idx(kv()),
      ir::sqrt(flt(q() - kv())) < 3.0,  // NaN for q < kv: never "always true"
      ir::log(flt(q() - 20)) != 1.0,
      (q() >= kv()) == (kv() < 20),
      q() + (kv_len() - q_len()) >= kv(),
  };
}

// Every node's evaluated value (when not NaN) lies in its interval, at random points that
// include the corners of the ranges.
void check_sound(const Expr& expression, const LeafRanges& ranges, std::uint64_t seed) {
  SCOPED_TRACE(expression.to_string());
  SampleTensors tensors(seed);
  const Graph graph = check_and_clamp_loads(Graph(expression), ranges, SampleTensors::shapes());
  const std::vector<Interval> intervals = node_intervals(graph, ranges);
  ASSERT_EQ(intervals.size(), graph.nodes().size());
  std::mt19937_64 generator(seed);
  auto pick = [&](const Interval& range) {
    const auto lo = static_cast<std::int64_t>(range.lo);
    const auto hi = static_cast<std::int64_t>(range.hi);
    const int corner = std::uniform_int_distribution<int>(0, 3)(generator);
    if (corner == 0) return lo;
    if (corner == 1) return hi;
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(generator);
  };
  std::normal_distribution<double> wide_score(0.0, 20.0);
  std::vector<double> values;
  for (int sample = 0; sample < kSamples; ++sample) {
    EvalPoint point;
    point.score = sample % 10 == 0 ? 0.0 : wide_score(generator);
    point.batch = pick(ranges.batch);
    point.head = pick(ranges.head);
    point.query = pick(ranges.query);
    point.key = pick(ranges.key);
    point.query_length = pick(ranges.query_length);
    point.key_length = pick(ranges.key_length);
    evaluate_all(graph, point, tensors.bindings(), values);
    ASSERT_EQ(values.size(), graph.nodes().size());
    for (std::size_t node = 0; node < values.size(); ++node) {
      if (std::isnan(values[node])) continue;
      ASSERT_TRUE(intervals[node].contains(values[node]))
          << "node " << node << " (" << to_string(graph.nodes()[node].op) << ") value "
          << values[node] << " outside [" << intervals[node].lo << ", " << intervals[node].hi
          << "] at score " << point.score << " q " << point.query << " kv " << point.key;
    }
  }
}

TEST(IntervalTest, IntegerNodesAreSound) {
  std::uint64_t seed = 1;
  for (const Expr& expression : integer_expressions()) {
    check_sound(expression, fixed_ranges(), seed++);
    check_sound(expression, ragged_ranges(), seed++);
  }
}

TEST(IntervalTest, FloatNodesAreSound) {
  std::uint64_t seed = 100;
  for (const Expr& expression : float_expressions()) {
    check_sound(expression, fixed_ranges(), seed++);
    check_sound(expression, ragged_ranges(), seed++);
  }
}

TEST(IntervalTest, BoolNodesAreSound) {
  std::uint64_t seed = 200;
  for (const Expr& expression : bool_expressions()) {
    check_sound(expression, fixed_ranges(), seed++);
    check_sound(expression, ragged_ranges(), seed++);
  }
}

Interval root_interval(const Expr& expression, const LeafRanges& ranges) {
  const Graph graph(expression);
  return node_intervals(graph, ranges)[static_cast<std::size_t>(graph.root())];
}

void expect_interval(const Interval& actual, double lo, double hi, const std::string& what) {
  EXPECT_EQ(actual.lo, lo) << what;
  EXPECT_EQ(actual.hi, hi) << what;
}

TEST(IntervalTest, IntegerIntervalsAreExact) {
  LeafRanges ranges = fixed_ranges();
  ranges.query = span(0, 127);
  ranges.key = span(0, 127);
  expect_interval(root_interval(kv() - q() + 64, ranges), -63, 191, "kv - q + 64");
  expect_interval(root_interval(ir::clamp(kv() - q() + 64, 0, 128), ranges), 0, 128, "clamp");
  expect_interval(root_interval(q() / 4, ranges), 0, 31, "q / 4");
  expect_interval(root_interval((q() - 64) / 4, ranges), -16, 15, "(q - 64) / 4");
  expect_interval(root_interval(q() % 8, ranges), 0, 7, "q % 8");
  expect_interval(root_interval((q() - 5) % -8, ranges), -7, 0, "(q - 5) % -8");
  expect_interval(root_interval(q() / (kv() - 1), ranges), -127, 127, "divisor through 0");
  expect_interval(root_interval(ir::abs(q() - kv()), ranges), 0, 127, "abs");
  ranges.query = span(64, 79);
  expect_interval(root_interval(q() % 64, ranges), 0, 15, "q % 64 in one block");
  expect_interval(root_interval(q() / 16, ranges), 4, 4, "q / 16 in one block");
  ranges.query = span(3, 5);
  expect_interval(root_interval(q() % (kv() + 10), ranges), 3, 5, "dividend below divisor");
}

TEST(IntervalTest, FloatIntervalsAreBounded) {
  const LeafRanges ranges = fixed_ranges();
  const Interval tanh = root_interval(ir::tanh(score()), ranges);
  EXPECT_GE(tanh.lo, -1.0);
  EXPECT_LE(tanh.hi, 1.0);
  const Interval sigmoid = root_interval(ir::sigmoid(score()), ranges);
  EXPECT_GE(sigmoid.lo, 0.0);
  EXPECT_LE(sigmoid.hi, 1.0);
  EXPECT_GE(root_interval(ir::exp(score()), ranges).lo, 0.0);
  const Interval unknown = root_interval(score() * 2.0, ranges);
  EXPECT_TRUE(std::isinf(unknown.lo) && std::isinf(unknown.hi));
  // Integers below 2^24 are floats: conversions and sums of them stay exact.
  expect_interval(root_interval(flt(q()) + 0.5, ranges), 0.5, static_cast<double>(kSeqLenQ) - 0.5,
                  "float(q) + 0.5");
  const Interval softcap = root_interval(30.0 * ir::tanh(score() / 30.0), ranges);
  EXPECT_GE(softcap.lo, -30.0001);
  EXPECT_LE(softcap.hi, 30.0001);
}

TEST(IntervalTest, BoolIntervals) {
  LeafRanges ranges = fixed_ranges();
  ranges.query = span(10, 20);
  ranges.key = span(0, 9);
  expect_interval(root_interval(q() >= kv(), ranges), 1, 1, "q >= kv below the diagonal");
  expect_interval(root_interval(q() < kv(), ranges), 0, 0, "q < kv below the diagonal");
  expect_interval(root_interval(q() != kv(), ranges), 1, 1, "q != kv disjoint");
  expect_interval(root_interval(q() > 15, ranges), 0, 1, "undecided");
  // A possibly-NaN comparison is never decided true.
  expect_interval(root_interval(ir::sqrt(flt(q() - kv())) < 100.0, ranges), 1, 1, "no NaN");
  ranges.key = span(0, 30);
  expect_interval(root_interval(ir::sqrt(flt(q() - kv())) < 100.0, ranges), 0, 1, "NaN");
}

// ---- tensor loads ---------------------------------------------------------------------------

LeafRanges square_ranges(std::int64_t length) {
  return {span(0, 0),          span(0, kHeads - 1),  span(0, length - 1),
          span(0, length - 1), span(length, length), span(length, length)};
}

std::string error_message(const std::function<void()>& action, ErrorCode expected_code) {
  try {
    action();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), expected_code) << error.what();
    return error.what();
  }
  ADD_FAILURE() << "expected an error";
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(LoadCheckTest, InBoundsLoadsAreUnchanged) {
  const Shapes shapes{{"rel", {kHeads, 129}}, {"slopes", {kHeads}}};
  const Graph relative(score() +
                       ir::load("rel", Type::kF32, {h(), ir::clamp(kv() - q() + 64, 0, 128)}));
  const Graph checked = check_and_clamp_loads(relative, square_ranges(128), shapes);
  EXPECT_EQ(checked, relative);
  EXPECT_EQ(checked.to_string(), relative.to_string());
  const Graph alibi(score() + slopes() * (kv() - q()));
  EXPECT_EQ(check_and_clamp_loads(alibi, square_ranges(128), shapes), alibi);
}

TEST(LoadCheckTest, DataIndependentIndexOutOfRangeIsAnError) {
  const Shapes shapes{{"rel", {kHeads, 129}}};
  const Graph relative(score() + ir::load("rel", Type::kF32, {h(), kv() - q() + 64}));
  const std::string message =
      error_message([&] { check_and_clamp_loads(relative, square_ranges(128), shapes); },
                    ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(message, "rel[")) << message;
  EXPECT_TRUE(contains(message, "index 1 ranges over [-63, 191]")) << message;
  EXPECT_TRUE(contains(message, "rel has 129 entries along dimension 1")) << message;

  const Shapes small_slopes{{"slopes", {2}}};
  const std::string first_index = error_message(
      [&] { check_and_clamp_loads(Graph(score() + slopes()), square_ranges(8), small_slopes); },
      ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(first_index, "slopes[h]")) << first_index;
  EXPECT_TRUE(contains(first_index, "index 0 ranges over [0, 3]")) << first_index;
  EXPECT_TRUE(contains(first_index, "2 entries along dimension 0")) << first_index;
}

TEST(LoadCheckTest, DataDependentIndexIsClamped) {
  const Shapes shapes{{"table", {10}}, {"idx", {kSeqLenKv}}};
  const Graph graph(score() + ir::load("table", Type::kF32, {idx(q())}));
  const Graph checked = check_and_clamp_loads(graph, fixed_ranges(), shapes);
  EXPECT_TRUE(contains(checked.to_string(), "clamp(")) << checked.to_string();
  EXPECT_FALSE(checked == graph);

  // The clamped graph evaluates safely whatever the integer tensor holds.
  std::vector<double> table(10, 0.0);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<double>(i) * 10.0;
  std::vector<std::int32_t> indices(kSeqLenKv, 0);
  indices[0] = -5;
  indices[1] = 4;
  indices[2] = 99;
  Bindings bindings;
  TensorView table_view;
  table_view.data = table.data();
  table_view.dtype = DType::kF64;
  table_view.shape = {10};
  table_view.strides = {1};
  TensorView index_view = table_view;
  index_view.data = indices.data();
  index_view.dtype = DType::kI32;
  index_view.shape = {kSeqLenKv};
  bindings.tensors["table"] = table_view;
  bindings.tensors["idx"] = index_view;
  EvalPoint point;
  point.query = 0;
  EXPECT_EQ(evaluate(checked, point, bindings), 0.0);
  point.query = 1;
  EXPECT_EQ(evaluate(checked, point, bindings), 40.0);
  point.query = 2;
  EXPECT_EQ(evaluate(checked, point, bindings), 90.0);

  // A data-dependent index the analysis already bounds needs no clamp.
  const Graph bounded(score() + ir::load("table", Type::kF32, {ir::clamp(idx(q()), 0, 9)}));
  EXPECT_EQ(check_and_clamp_loads(bounded, fixed_ranges(), shapes), bounded);
}

TEST(LoadCheckTest, RankMismatchAndUnboundTensorsAreErrors) {
  const Shapes shapes{{"rel", {kHeads, 129}}};
  const std::string rank = error_message(
      [&] {
        check_and_clamp_loads(Graph(score() + ir::load("rel", Type::kF32, {h()})), square_ranges(8),
                              shapes);
      },
      ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(rank, "rel[h]")) << rank;
  EXPECT_TRUE(contains(rank, "rank 2")) << rank;
  const std::string unbound = error_message(
      [&] { check_and_clamp_loads(Graph(score() + slopes()), square_ranges(8), shapes); },
      ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(unbound, "'slopes'")) << unbound;
  EXPECT_TRUE(contains(unbound, "rel")) << unbound;  // lists what is bound
}

// ---- tile classification ---------------------------------------------------------------------

struct TileCounts {
  int all_false = 0;
  int all_true = 0;
  int mixed = 0;
};

// Classifies every tile of the (query, key) ranges and checks each verdict against the mask
// evaluated on every element of the tile, for every combination of the lengths' values. When
// `exact`, a tile whose elements all agree must also be decided.
TileCounts check_tiles(const Expr& mask_expression, const LeafRanges& ranges, std::int64_t tile_q,
                       std::int64_t tile_kv, const Bindings& bindings, bool exact) {
  SCOPED_TRACE(mask_expression.to_string());
  const Graph mask(mask_expression);
  auto whole = [](double value) { return static_cast<std::int64_t>(value); };
  TileCounts counts;
  for (std::int64_t q_begin = whole(ranges.query.lo); q_begin <= whole(ranges.query.hi);
       q_begin += tile_q) {
    for (std::int64_t kv_begin = whole(ranges.key.lo); kv_begin <= whole(ranges.key.hi);
         kv_begin += tile_kv) {
      const TileRect tile{q_begin, std::min(q_begin + tile_q, whole(ranges.query.hi) + 1), kv_begin,
                          std::min(kv_begin + tile_kv, whole(ranges.key.hi) + 1)};
      const TileClass verdict = classify_tile(mask, ranges, tile);
      bool any_true = false;
      bool any_false = false;
      EvalPoint point;
      point.batch = whole(ranges.batch.lo);
      point.head = whole(ranges.head.lo);
      for (point.query = tile.query_begin; point.query < tile.query_end; ++point.query) {
        for (point.key = tile.key_begin; point.key < tile.key_end; ++point.key) {
          for (point.query_length = whole(ranges.query_length.lo);
               point.query_length <= whole(ranges.query_length.hi); ++point.query_length) {
            for (point.key_length = whole(ranges.key_length.lo);
                 point.key_length <= whole(ranges.key_length.hi); ++point.key_length) {
              const bool kept = evaluate(mask, point, bindings) != 0.0;
              any_true = any_true || kept;
              any_false = any_false || !kept;
            }
          }
        }
      }
      const std::string where =
          fmt::format("tile q [{}, {}) kv [{}, {}) classified {}", tile.query_begin, tile.query_end,
                      tile.key_begin, tile.key_end, to_string(verdict));
      if (verdict == TileClass::kAllFalse) {
        EXPECT_FALSE(any_true) << where;
      }
      if (verdict == TileClass::kAllTrue) {
        EXPECT_FALSE(any_false) << where;
      }
      if (exact) {
        const TileClass truth = !any_true    ? TileClass::kAllFalse
                                : !any_false ? TileClass::kAllTrue
                                             : TileClass::kMixed;
        EXPECT_EQ(verdict, truth) << where;
      }
      counts.all_false += verdict == TileClass::kAllFalse;
      counts.all_true += verdict == TileClass::kAllTrue;
      counts.mixed += verdict == TileClass::kMixed;
    }
  }
  return counts;
}

LeafRanges grid(std::int64_t seq_len_q, std::int64_t seq_len_kv) {
  return {span(0, 0),
          span(0, 0),
          span(0, seq_len_q - 1),
          span(0, seq_len_kv - 1),
          span(seq_len_q, seq_len_q),
          span(seq_len_kv, seq_len_kv)};
}

TEST(TileClassTest, CausalSplitsAtTheDiagonal) {
  const Graph causal(q() >= kv());
  const LeafRanges ranges = grid(128, 128);
  EXPECT_EQ(classify_tile(causal, ranges, {0, 16, 16, 32}), TileClass::kAllFalse);
  EXPECT_EQ(classify_tile(causal, ranges, {16, 32, 0, 16}), TileClass::kAllTrue);
  EXPECT_EQ(classify_tile(causal, ranges, {16, 32, 16, 32}), TileClass::kMixed);
  EXPECT_EQ(classify_tile(causal, ranges, {16, 32, 31, 47}), TileClass::kMixed);
  EXPECT_EQ(classify_tile(causal, ranges, {16, 32, 32, 48}), TileClass::kAllFalse);
  const TileCounts counts = check_tiles(q() >= kv(), ranges, 16, 16, {}, /*exact=*/true);
  EXPECT_EQ(counts.mixed, 8);
  EXPECT_EQ(counts.all_false, 28);
  EXPECT_EQ(counts.all_true, 28);
  check_tiles(q() >= kv(), grid(77, 100), 13, 7, {}, /*exact=*/true);
}

TEST(TileClassTest, SlidingWindowIsExact) {
  const Expr window = q() >= kv() && q() - kv() < 32;
  const TileCounts counts = check_tiles(window, grid(128, 128), 8, 8, {}, /*exact=*/true);
  EXPECT_GT(counts.all_true, 0);
  EXPECT_GT(counts.all_false, 0);
  check_tiles(window, grid(100, 77), 16, 11, {}, /*exact=*/true);
}

TEST(TileClassTest, BottomRightCausalIsExact) {
  const Expr causal = q() + (kv_len() - q_len()) >= kv();
  const TileCounts counts = check_tiles(causal, grid(60, 100), 16, 16, {}, /*exact=*/true);
  EXPECT_GT(counts.all_true, 0);
  EXPECT_GT(counts.all_false, 0);
}

TEST(TileClassTest, PrefixLmIsExact) {
  const Expr prefix = kv() < 128 || q() >= kv();
  const TileCounts counts = check_tiles(prefix, grid(256, 256), 32, 24, {}, /*exact=*/true);
  EXPECT_GT(counts.all_true, 0);
  EXPECT_GT(counts.all_false, 0);
}

TEST(TileClassTest, DocumentMaskSkipsAboveTheDiagonal) {
  constexpr std::int64_t kLength = 100;
  std::vector<std::int32_t> documents(kLength);
  for (std::int64_t i = 0; i < kLength; ++i) {
    documents[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i < 30 ? 0 : i < 45 ? 1 : 2);
  }
  Bindings bindings;
  TensorView view;
  view.data = documents.data();
  view.dtype = DType::kI32;
  view.shape = {kLength};
  view.strides = {1};
  bindings.tensors["doc"] = view;
  const Expr document = ir::load("doc", Type::kI32, {q()}) == ir::load("doc", Type::kI32, {kv()});
  const Expr mask = document && q() >= kv();
  const LeafRanges ranges = grid(kLength, kLength);
  check_tiles(mask, ranges, 16, 16, bindings, /*exact=*/false);
  constexpr std::int64_t kTile = 16;
  for (std::int64_t q_begin = 0; q_begin < kLength; q_begin += kTile) {
    for (std::int64_t kv_begin = q_begin + kTile; kv_begin < kLength; kv_begin += kTile) {
      const TileRect tile{q_begin, std::min(q_begin + kTile, kLength), kv_begin,
                          std::min(kv_begin + kTile, kLength)};
      EXPECT_EQ(classify_tile(Graph(mask), ranges, tile), TileClass::kAllFalse)
          << "q " << q_begin << " kv " << kv_begin;
    }
  }
}

TEST(TileClassTest, RaggedLengthsStaySound) {
  // thd: positions below the longest sequence, lengths ranging over the batch's sequences.
  const LeafRanges ranges{span(0, 0),  span(0, 0),   span(0, 29),
                          span(0, 39), span(20, 30), span(30, 40)};
  const Expr bottom_right = q() + (kv_len() - q_len()) >= kv();
  const TileCounts counts = check_tiles(bottom_right, ranges, 8, 8, {}, /*exact=*/false);
  EXPECT_GT(counts.all_true, 0);
  EXPECT_GT(counts.all_false, 0);
  EXPECT_GT(counts.mixed, 0);
  check_tiles(q() >= kv() && kv() < kv_len() - 5, ranges, 8, 8, {}, /*exact=*/false);
  check_tiles(q() < q_len() && kv() < kv_len(), ranges, 8, 8, {}, /*exact=*/false);
  check_tiles(q() >= kv() && q() - kv() < 12, ranges, 8, 8, {}, /*exact=*/true);
}

TEST(TileClassTest, EdgeCases) {
  const LeafRanges ranges = grid(16, 16);
  EXPECT_EQ(classify_tile(Graph(q() >= kv()), ranges, {4, 4, 0, 8}), TileClass::kAllFalse);
  EXPECT_EQ(classify_tile(Graph::always_true(), ranges, {0, 8, 3, 3}), TileClass::kAllFalse);
  EXPECT_EQ(classify_tile(Graph::always_true(), ranges, {0, 8, 0, 8}), TileClass::kAllTrue);
  EXPECT_EQ(classify_tile(Graph(ir::literal_bool(false)), ranges, {0, 8, 0, 8}),
            TileClass::kAllFalse);
  EXPECT_THROW(classify_tile(Graph(score()), ranges, {0, 8, 0, 8}), Error);
  EXPECT_EQ(to_string(TileClass::kAllFalse), "all_false");
  EXPECT_EQ(to_string(TileClass::kAllTrue), "all_true");
  EXPECT_EQ(to_string(TileClass::kMixed), "mixed");
}

}  // namespace
}  // namespace flexattn
