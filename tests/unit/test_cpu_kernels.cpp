// The `cpu` engine's building blocks: the tile kernels (AVX2 against the portable set and a
// float64 reference) and the modifier tape (every IR op against `evaluate`).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engines/cpu/kernels.hpp"
#include "engines/cpu/skipping_product.hpp"
#include "engines/cpu/tape.hpp"
#include "flexattn/flexattn.hpp"

namespace flexattn::cpu {
namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();
// Float32 products of k terms of size ~1: a few roundings per term (relative to sqrt(k) growth
// this is generous but catches any indexing error, which is off by O(1)).
constexpr double kProductTolerance = 1e-5;
// exp/tanh/sigmoid of the vector kernels: Cephes-style polynomials, a few ulp.
constexpr double kTranscendentalTolerance = 4e-7;

std::vector<const Kernels*> kernel_sets() {
  std::vector<const Kernels*> sets{&generic_kernels()};
  if (avx2_kernels() != nullptr) sets.push_back(avx2_kernels());
  return sets;
}

std::vector<float> random_values(std::size_t count, std::uint32_t seed, float lo = -1.0f,
                                 float hi = 1.0f) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> distribution(lo, hi);
  std::vector<float> values(count);
  for (float& value : values) value = distribution(generator);
  return values;
}

TEST(CpuKernels, GemmMatchesFloat64ForEveryShapeAndOrientation) {
  for (const Kernels* set : kernel_sets()) {
    for (std::int64_t m : {1, 5, 6, 13}) {
      for (std::int64_t n : {8, 16, 24, 40}) {
        for (std::int64_t k : {1, 7, 64}) {
          for (bool transposed : {false, true}) {
            for (bool accumulate : {false, true}) {
              const std::int64_t lda = transposed ? m + 3 : k + 2;  // padded leading dimensions
              const std::int64_t ldb = n + 8, ldc = n + 16;
              const auto a = random_values(static_cast<std::size_t>(lda * std::max(m, k)), 1);
              const auto b = random_values(static_cast<std::size_t>(ldb * k), 2);
              auto c = random_values(static_cast<std::size_t>(ldc * m), 3);
              const std::vector<float> initial = c;
              const std::int64_t row = transposed ? 1 : lda, column = transposed ? lda : 1;
              set->gemm({m, n, k, a.data(), row, column, b.data(), ldb, c.data(), ldc, accumulate});
              for (std::int64_t i = 0; i < m; ++i) {
                for (std::int64_t j = 0; j < n; ++j) {
                  double expected =
                      accumulate ? initial[static_cast<std::size_t>(i * ldc + j)] : 0.0;
                  for (std::int64_t p = 0; p < k; ++p) {
                    expected +=
                        static_cast<double>(a[static_cast<std::size_t>(i * row + p * column)]) *
                        b[static_cast<std::size_t>(p * ldb + j)];
                  }
                  ASSERT_NEAR(c[static_cast<std::size_t>(i * ldc + j)], expected, kProductTolerance)
                      << set->isa << " m=" << m << " n=" << n << " k=" << k << " at " << i << ","
                      << j;
                }
                // Columns past n are untouched.
                for (std::int64_t j = n; j < ldc; ++j) {
                  ASSERT_EQ(c[static_cast<std::size_t>(i * ldc + j)],
                            initial[static_cast<std::size_t>(i * ldc + j)]);
                }
              }
            }
          }
        }
      }
    }
  }
}

// The narrow product of a decoding step: every column count 0 .. 8, row counts around the AVX2
// blocks (8, 16 and 32 rows, and the rows past them), padded leading dimensions; C's columns past
// n untouched.
TEST(CpuKernels, NarrowAccumulateMatchesFloat64ForEveryColumnCount) {
  constexpr std::int64_t kColumns = kVectorWidth, kLdc = kVectorWidth + 5;
  for (const Kernels* set : kernel_sets()) {
    for (std::int64_t n = 0; n <= kColumns; ++n) {
      for (std::int64_t m : {1, 3, 5, 8, 13, 16, 24, 37, 64}) {
        for (std::int64_t k : {1, 5, 8, 13, 64, 130}) {
          const std::string what = std::string(set->isa) + " n=" + std::to_string(n) +
                                   " m=" + std::to_string(m) + " k=" + std::to_string(k);
          // A (k x m) rows lda apart, B (k x n) rows ldb apart.
          const std::int64_t lda = m + 3, ldb = kColumns + 3;
          const auto a = random_values(static_cast<std::size_t>(k * lda), 4);
          const auto b = random_values(static_cast<std::size_t>(k * ldb), 5);
          const auto initial = random_values(static_cast<std::size_t>(m * kLdc), 3);
          std::vector<float> c = initial;
          set->narrow_accumulate({m, n, k, a.data(), lda, b.data(), ldb, c.data(), kLdc});
          for (std::int64_t i = 0; i < m; ++i) {
            for (std::int64_t j = 0; j < kLdc; ++j) {
              const float got = c[static_cast<std::size_t>(i * kLdc + j)];
              const float before = initial[static_cast<std::size_t>(i * kLdc + j)];
              if (j >= n) {
                ASSERT_EQ(got, before) << what << " column " << j;
                continue;
              }
              double expected = before;
              for (std::int64_t p = 0; p < k; ++p) {
                expected += static_cast<double>(a[static_cast<std::size_t>(p * lda + i)]) *
                            b[static_cast<std::size_t>(p * ldb + j)];
              }
              ASSERT_NEAR(got, expected, kProductTolerance) << what << " at " << i << "," << j;
            }
          }
        }
      }
    }
  }
}

// any_non_finite over every length up to 40 (whole vectors and tails): finite extremes (the
// largest float, the smallest subnormal, -0) never count; one NaN, +inf or -inf at any position
// always does.
TEST(CpuKernels, AnyNonFiniteFindsEachNaNAndInfinityAnywhere) {
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), kInfinity, -kInfinity};
  for (const Kernels* set : kernel_sets()) {
    for (std::int64_t count = 0; count <= 40; ++count) {
      std::vector<float> values = random_values(static_cast<std::size_t>(count), 12, -1e30f, 1e30f);
      for (std::int64_t i = 0; i < count; i += 3) {
        values[static_cast<std::size_t>(i)] = i % 2 == 0 ? std::numeric_limits<float>::max()
                                                         : std::numeric_limits<float>::denorm_min();
      }
      if (count > 1) values[1] = -0.0f;
      ASSERT_FALSE(set->any_non_finite(values.data(), count, 1)) << set->isa << " " << count;
      for (std::int64_t at = 0; at < count; ++at) {
        for (const float special : specials) {
          std::vector<float> marked = values;
          marked[static_cast<std::size_t>(at)] = special;
          ASSERT_TRUE(set->any_non_finite(marked.data(), count, 1))
              << set->isa << " " << count << " at " << at << " " << special;
          // Every third value of the same array: found only where the stride meets it.
          const std::int64_t every_third = (count + 2) / 3;
          ASSERT_EQ(set->any_non_finite(marked.data(), every_third, 3), at % 3 == 0)
              << set->isa << " stride 3, " << count << " at " << at << " " << special;
        }
      }
    }
  }
}

// Every 16-bit pattern, fp16 and bf16, through each kernel set's conversion (in runs of 8 and
// a tail) against the scalar conversion of flexattn/dtype.hpp: the same float bit for bit, NaN
// for NaN.
TEST(CpuKernels, SixteenBitConversionsMatchTheScalarOnesForEveryPattern) {
  constexpr std::int64_t kPatterns = 1 << 16;
  std::vector<std::uint16_t> bits(kPatterns + 3);
  for (std::int64_t i = 0; i < kPatterns + 3; ++i)
    bits[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(i);
  for (const Kernels* set : kernel_sets()) {
    for (const bool brain : {false, true}) {
      std::vector<float> out(bits.size());
      (brain ? set->bfloat16_to_float : set->half_to_float)(bits.data(), out.data(), kPatterns + 3);
      for (std::size_t i = 0; i < bits.size(); ++i) {
        const float expected = brain ? to_float(BFloat16{bits[i]}) : to_float(Half{bits[i]});
        if (std::isnan(expected)) {
          ASSERT_TRUE(std::isnan(out[i])) << set->isa << " " << brain << " " << i;
        } else {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), std::bit_cast<std::uint32_t>(expected))
              << set->isa << (brain ? " bf16 " : " fp16 ") << i;
        }
      }
    }
  }
}

TEST(CpuKernels, TranscendentalsAreAccurateAndHandleSpecialValues) {
  std::vector<float> inputs = random_values(1000, 4, -20.0f, 20.0f);
  const std::vector<float> specials = {0.0f,       -0.0f,
                                       1e-8f,      -1e-8f,
                                       0.6249f,    0.6251f,
                                       -0.625f,    88.0f,
                                       -87.0f,     -100.0f,
                                       100.0f,     kInfinity,
                                       -kInfinity, std::numeric_limits<float>::quiet_NaN()};
  inputs.insert(inputs.end(), specials.begin(), specials.end());
  const auto count = static_cast<std::int64_t>(inputs.size());
  for (const Kernels* set : kernel_sets()) {
    std::vector<float> out(inputs.size());
    // Against the float64 function rounded to float32 (so overflow is inf); results below the
    // smallest normal float may be flushed to zero (attention never needs them).
    const auto check = [&](const char* name, double (*reference)(double)) {
      constexpr double kSmallestNormal = std::numeric_limits<float>::min();
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        const double expected = static_cast<float>(reference(inputs[i]));
        const std::string what =
            std::string(set->isa) + " " + name + "(" + std::to_string(inputs[i]) + ")";
        if (std::isnan(expected)) {
          EXPECT_TRUE(std::isnan(out[i])) << what;
        } else if (std::isinf(expected) || expected == 0.0) {
          EXPECT_EQ(out[i], expected) << what;
        } else if (std::fabs(expected) < kSmallestNormal) {
          EXPECT_LE(std::fabs(out[i] - expected), kSmallestNormal) << what;
        } else {
          EXPECT_NEAR(out[i] / expected, 1.0, kTranscendentalTolerance) << what;
        }
      }
    };
    set->exp(inputs.data(), out.data(), count);
    check("exp", [](double x) { return std::exp(x); });
    set->tanh(inputs.data(), out.data(), count);
    check("tanh", [](double x) { return std::tanh(x); });
    set->sigmoid(inputs.data(), out.data(), count);
    check("sigmoid", [](double x) { return 1.0 / (1.0 + std::exp(-x)); });
  }
}

TEST(CpuKernels, SoftmaxStepAndGradientAgreeAcrossKernelSets) {
  constexpr std::int64_t kRows = 5, kWidth = 16, kLd = 24;
  const std::vector<float> tile = [] {
    std::vector<float> values = random_values(kRows * kLd, 5, -4.0f, 4.0f);
    values[3] = -kInfinity;  // masked entries, and a column masked in every row
    for (std::int64_t r = 0; r < kRows; ++r)
      values[static_cast<std::size_t>(r * kLd + 7)] = -kInfinity;
    return values;
  }();
  std::vector<std::vector<float>> results;
  for (const Kernels* set : kernel_sets()) {
    std::vector<float> probs = tile, row_max(kWidth, -kInfinity), row_sum(kWidth, 0.0f),
                       alpha(kWidth);
    row_max[1] = 10.0f;  // a running max above the tile: alpha == 1 there
    row_sum[1] = 2.0f;
    EXPECT_TRUE(set->softmax_step(probs.data(), kRows, kWidth, kLd, row_max.data(), row_sum.data(),
                                  alpha.data()));
    EXPECT_EQ(row_max[7], -kInfinity);
    EXPECT_EQ(row_sum[7], 0.0f);
    EXPECT_EQ(alpha[1], 1.0f);
    for (std::int64_t r = 0; r < kRows; ++r)
      EXPECT_EQ(probs[static_cast<std::size_t>(r * kLd + 7)], 0.0f);
    const std::vector<float> dmod = random_values(kRows * kLd, 6);
    std::vector<float> ds = random_values(kRows * kLd, 7), ds_raw(kRows * kLd);
    const std::vector<float> delta = random_values(kWidth, 8);
    set->softmax_gradient(probs.data(), dmod.data(), ds.data(), ds_raw.data(), kRows, kWidth, kLd,
                          delta.data());
    EXPECT_EQ(ds[3], 0.0f);
    EXPECT_EQ(ds_raw[3], 0.0f);
    std::vector<float> all = probs;
    all.insert(all.end(), row_sum.begin(), row_sum.end());
    all.insert(all.end(), ds.begin(), ds.end());
    all.insert(all.end(), ds_raw.begin(), ds_raw.end());
    results.push_back(all);
  }
  for (std::size_t s = 1; s < results.size(); ++s) {
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_NEAR(results[s][i], results[0][i], 1e-6 * (1.0 + std::fabs(results[0][i]))) << i;
    }
  }
}

// A zero coefficient skips its term whatever the data holds (no 0 * NaN): column_dot in every
// kernel set, and gemm_skipping_zeros with the data as either operand, against a scalar loop that
// skips. Nonzero coefficients against NaN and +-inf data stay IEEE (NaN, or the infinity).
TEST(CpuKernels, ZeroCoefficientsSkipNonFiniteData) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr std::int64_t kRows = 3, kWidth = 16, kLd = 16;
  std::vector<float> coefficients = random_values(kRows * kLd, 9);
  std::vector<float> data = random_values(kRows * kLd, 10);
  coefficients[2] = 0.0f;
  data[2] = nan;  // skipped: column 2 stays finite
  data[5] = nan;  // kept: column 5 becomes NaN
  coefficients[kLd + 6] = 0.0f;
  data[kLd + 6] = kInfinity;  // skipped
  for (const Kernels* set : kernel_sets()) {
    std::vector<float> out(kWidth, 0.0f);
    set->column_dot(coefficients.data(), data.data(), kRows, kWidth, kLd, out.data());
    EXPECT_TRUE(std::isfinite(out[2])) << set->isa;
    EXPECT_TRUE(std::isnan(out[5])) << set->isa;
    EXPECT_TRUE(std::isfinite(out[6])) << set->isa;
  }

  // C (m x n) = A (m x k) B (k x n): a k-wide band of zeros and non-finite values in each form.
  constexpr std::int64_t m = 4, k = 5, n = 8;
  for (const DataOperand which : {DataOperand::kA, DataOperand::kB}) {
    std::vector<float> a = random_values(m * k, 11), b = random_values(k * n, 12);
    std::vector<float>& values = which == DataOperand::kA ? a : b;
    std::vector<float>& weights = which == DataOperand::kA ? b : a;
    for (std::size_t i = 0; i < weights.size(); i += 3) weights[i] = 0.0f;
    values[1] = nan;
    values[6] = kInfinity;
    values[7] = -kInfinity;
    for (const Kernels* set : kernel_sets()) {
      std::vector<float> c(m * n, 1.0f), scratch;
      gemm_skipping_zeros(*set, {m, n, k, a.data(), k, 1, b.data(), n, c.data(), n, true}, which,
                          false, scratch);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; ++j) {
          double expected = 1.0;
          for (std::int64_t p = 0; p < k; ++p) {
            const double x = a[static_cast<std::size_t>(i * k + p)];
            const double y = b[static_cast<std::size_t>(p * n + j)];
            const double weight = which == DataOperand::kA ? y : x;
            if (weight != 0.0) expected += x * y;
          }
          const float got = c[static_cast<std::size_t>(i * n + j)];
          const std::string what =
              std::string(set->isa) + " C(" + std::to_string(i) + ", " + std::to_string(j) + ")";
          if (std::isnan(expected)) {
            EXPECT_TRUE(std::isnan(got)) << what;
          } else if (std::isinf(expected)) {
            EXPECT_EQ(got, expected) << what;
          } else {
            EXPECT_NEAR(got, expected, 1e-5) << what;
          }
        }
      }
    }
  }
}

// FiniteTiles scans a tile the first time it is asked about and keeps the answer: every
// (batch, head, tile) of ragged sequences has its own entry, a NaN or an infinity in the copy
// makes it non-finite, and later copies are not scanned again.
TEST(CpuKernels, FiniteTilesScanEachTileOnce) {
  ProblemDesc desc;
  desc.batch = 3;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.head_dim_qk = desc.head_dim_v = 8;
  desc.layout = Layout::kTHD;
  desc.seq_len_q = desc.seq_len_kv = 0;
  desc.cu_seqlens_q = {0, 37, 37, 60};  // 3 tiles of 16, none, 2
  desc.cu_seqlens_kv = {0, 5, 40, 41};  // 1 tile, 3, 1
  const Problem problem(desc);
  constexpr std::int64_t kBlock = 16, kColumns = 8, kLd = 10;
  const std::vector<float> finite(kBlock * kLd, 0.5f);
  for (const bool query_side : {true, false}) {
    const std::int64_t heads = query_side ? 4 : 2;
    for (const float planted : {std::numeric_limits<float>::quiet_NaN(), kInfinity, -kInfinity}) {
      std::vector<float> marked = finite;
      marked[3 * kLd + kColumns - 1] = planted;
      std::vector<float> beyond = finite;  // non-finite only outside the columns
      beyond[3 * kLd + kColumns] = planted;
      const FiniteTiles tiles(problem, query_side, kBlock);
      std::vector<std::array<std::int64_t, 3>> all;
      for (std::int64_t b = 0; b < 3; ++b) {
        const std::int64_t length = query_side ? problem.seq_len_q_of(b) : problem.seq_len_kv_of(b);
        for (std::int64_t h = 0; h < heads; ++h) {
          for (std::int64_t t = 0; t * kBlock < length; ++t) all.push_back({b, h, t});
        }
      }
      const std::array<std::int64_t, 3> chosen = all[all.size() / 2];
      for (const auto& [b, h, t] : all) {
        const bool is_chosen = std::array<std::int64_t, 3>{b, h, t} == chosen;
        const std::int64_t count = std::min(
            kBlock, (query_side ? problem.seq_len_q_of(b) : problem.seq_len_kv_of(b)) - t * kBlock);
        const std::vector<float>& copy = is_chosen ? marked : beyond;
        EXPECT_EQ(tiles.at(b, h, t, copy.data(), kLd, count, kColumns), !is_chosen)
            << b << " " << h << " " << t;
      }
      for (const auto& [b, h, t] : all) {  // remembered: the copy is not read again
        const bool is_chosen = std::array<std::int64_t, 3>{b, h, t} == chosen;
        EXPECT_EQ(tiles.at(b, h, t, marked.data(), kLd, 1, kColumns), !is_chosen)
            << b << " " << h << " " << t;
      }
    }
  }
}

// ---- the tape ---------------------------------------------------------------------------------

constexpr std::int64_t kTensorRows = 4, kTensorColumns = 8, kIds = 16;
// f32 results: float32 evaluation of a few ops against float64.
constexpr double kTapeTolerance = 2e-6;

// A modifier expression over the score, positions, a parameter p0 and two tensors (tf: float
// (4, 8); ti: int (16,)), with their values.
struct TapeSubject {
  explicit TapeSubject(const std::string& expression)
      : graph(parse(expression)),
        tf(DType::kF32, {kTensorRows, kTensorColumns}),
        ti(DType::kI64, {kIds}) {
    tf.fill_normal(9);
    for (std::int64_t i = 0; i < kIds; ++i) ti.set(i, static_cast<double>((i * 7) % 5 - 2));
    inputs.params["p0"] = 0.75;
    inputs.tensors["tf"] = tf.view();
    inputs.tensors["ti"] = ti.view();
    bindings.params = inputs.params;
    bindings.tensors = inputs.tensors;
  }
  static Graph parse(const std::string& expression) {
    ir::Scope scope;
    scope.params = {"p0"};
    scope.tensors["tf"] = {Type::kF32, 2};
    scope.tensors["ti"] = {Type::kI32, 1};
    return Graph(ir::parse(expression, scope));
  }
  Graph graph;
  HostTensor tf, ti;
  TapeInputs inputs;
  Bindings bindings;
};

class TapeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TapeTest, MatchesEvaluateOnEveryLane) {
  const TapeSubject subject(GetParam());
  const Graph& graph = subject.graph;
  const TapeInputs& inputs = subject.inputs;
  const Bindings& bindings = subject.bindings;
  constexpr std::int64_t kWidth = 16, kQueryLength = 12, kKeyLength = 9;
  const Tape tape({&graph});
  TapeRunner runner(tape, inputs, kWidth);
  std::mt19937 generator(10);
  std::uniform_int_distribution<int> eighths(-24, 24);  // exact in float32 and float64
  for (std::int64_t head = 0; head < 2; ++head) {
    runner.set_head(1, head, kQueryLength, kKeyLength);
    for (std::int64_t first : {0, 5}) {
      const std::int64_t count = std::min<std::int64_t>(kWidth, kQueryLength - first);
      runner.set_queries(first, count);
      for (std::int64_t key = 0; key < kKeyLength; ++key) {
        std::vector<float> scores(kWidth);
        for (float& score : scores) score = static_cast<float>(eighths(generator)) / 8.0f;
        runner.run(key, scores.data());
        for (std::int64_t lane = 0; lane < count; ++lane) {
          EvalPoint point;
          point.score = scores[static_cast<std::size_t>(lane)];
          point.batch = 1;
          point.head = head;
          point.query = first + lane;
          point.key = key;
          point.query_length = kQueryLength;
          point.key_length = kKeyLength;
          const double expected = evaluate(graph, point, bindings);
          const Slot out = tape.output(0);
          const double actual = out.is_float ? static_cast<double>(runner.floats(out)[lane])
                                             : static_cast<double>(runner.ints(out)[lane]);
          if (std::isnan(expected)) {
            EXPECT_TRUE(std::isnan(actual)) << GetParam();
          } else if (!out.is_float || std::isinf(expected)) {
            ASSERT_EQ(actual, expected) << GetParam() << " q=" << point.query << " kv=" << key;
          } else {
            ASSERT_NEAR(actual, expected, kTapeTolerance * std::max(1.0, std::fabs(expected)))
                << GetParam() << " q=" << point.query << " kv=" << key << " score=" << point.score;
          }
        }
      }
    }
  }
}

// run_keys, as a decoding task uses it: lanes set to a pattern of 8 (a GQA group's heads and
// positions, padding lanes repeating the last) twice over, two keys per call; each lane must
// hold, bit for bit, what run() gives it for its own key (keys past the length clamped alike).
TEST_P(TapeTest, RunKeysEqualsRunKeyByKey) {
  const TapeSubject subject(GetParam());
  constexpr std::int64_t kWidth = 16, kStride = 8, kUsed = 5, kQueryLength = 12, kKeyLength = 9;
  const Tape tape({&subject.graph});
  TapeRunner many(tape, subject.inputs, kWidth), one(tape, subject.inputs, kWidth);
  std::vector<std::int32_t> heads(kWidth), queries(kWidth);
  for (std::int64_t i = 0; i < kWidth; ++i) {
    const std::int64_t lane = std::min(i % kStride, kUsed - 1);
    heads[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(lane % 2);
    queries[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(3 + lane);
  }
  many.set_lanes(1, heads.data(), queries.data(), kWidth, kQueryLength, kKeyLength);
  one.set_lanes(1, heads.data(), queries.data(), kStride, kQueryLength, kKeyLength);
  ASSERT_EQ(many.lanes(), kWidth);
  ASSERT_EQ(one.lanes(), kStride);
  std::mt19937 generator(11);
  std::uniform_int_distribution<int> eighths(-24, 24);
  const Slot out = tape.output(0);
  for (std::int64_t first = 0; first < kKeyLength; first += 2) {  // the last pair runs past it
    std::vector<float> scores(kWidth);
    for (float& score : scores) score = static_cast<float>(eighths(generator)) / 8.0f;
    many.run_keys(first, kStride, scores.data());
    for (std::int64_t row = 0; row < kWidth / kStride; ++row) {
      one.run(first + row, scores.data() + row * kStride);
      for (std::int64_t lane = 0; lane < kStride; ++lane) {
        const std::int64_t at = row * kStride + lane;
        if (out.is_float) {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(many.floats(out)[at]),
                    std::bit_cast<std::uint32_t>(one.floats(out)[lane]))
              << GetParam() << " key " << first + row << " lane " << lane;
        } else {
          ASSERT_EQ(many.ints(out)[at], one.ints(out)[lane])
              << GetParam() << " key " << first + row << " lane " << lane;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    EveryOp, TapeTest,
    ::testing::Values(
        "score * 2 + p0", "score - float(q) / 7", "float(q % 5 - kv % 3) * score",
        "where(q >= kv, score, -score)", "float((q - kv) / 3) + float((kv - q) % 4)",
        "float(q / (kv - kv) + kv % (q - q))", "score % 0.375 + float(q) % -2.5",
        "min(score, 0.5) + max(score, -0.25)", "clamp(score, -1, 1)",
        "float(clamp(kv - q, -3, 3) + min(q, kv) - max(q, 2))", "abs(score) + float(abs(q - kv))",
        "exp(score) + exp2(score)", "log(abs(score) + 1) + log2(abs(score) + 2)",
        "sqrt(abs(score)) + rsqrt(abs(score) + 1)", "tanh(score * 3) + sigmoid(score * 2)",
        "floor(score * 3)", "float(int(score * 1000)) + float(int(score * 1e12))",
        "float(int(-score * 1e12)) * 1e-9", "float(int(log(score - score))) * 1e-9",
        "tf[clamp(q, 0, 3), clamp(kv, 0, 7)] * score", "float(ti[clamp(q + kv, 0, 15)]) + score",
        "where(!(q == kv) && (q < kv || kv > 3), 1.0, 0.0) * score", "-score + float(-q)",
        "where(q != kv, 1.0, 0.0) + where(q <= kv, 2.0, 0.0) + where(q > kv && score < 0.5, 4, 8)",
        "float(b * 100 + h * 10 + Q_LEN - KV_LEN) + score", "where(score > 0, score, -inf)",
        "log(score)", "q >= kv && kv != 2", "(q < 3 || kv >= 5) && !(score >= 1)",
        "where(kv > 4, q, kv * 2) == 3", "tf[h, kv % 8] + tf[h + 1, (q + kv) % 8]"));

}  // namespace
}  // namespace flexattn::cpu
