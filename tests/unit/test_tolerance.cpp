// The conformance tolerance, judged per element (src/check/tolerance.cpp): derived from the plain
// same-precision implementation's errors, NaN and infinities compared by agreement, and the worst
// element reported with its own bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "check/check_internal.hpp"
#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/conformance.hpp"
#include "flexattn/engine.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn::conformance::detail {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

HostTensor tensor_of(const std::vector<double>& values) {
  HostTensor tensor(DType::kF64, {static_cast<std::int64_t>(values.size())});
  for (std::size_t i = 0; i < values.size(); ++i) {
    tensor.set(static_cast<std::int64_t>(i), values[i]);
  }
  return tensor;
}

// Half the elements large (1, plain error 1e-3: relative), half small (1e-3, plain error 1e-9).
struct TwoScales {
  HostTensor reference, plain;
  TwoScales() {
    std::vector<double> r, p;
    for (int i = 0; i < 64; ++i) {
      const bool large = i % 2 == 0;
      r.push_back(large ? 1.0 + 0.01 * i : 1e-3);
      p.push_back(large ? r.back() * (1.0 + 1e-3) : r.back() + 1e-9);
    }
    reference = tensor_of(r), plain = tensor_of(p);
  }
};

TEST(Tolerance, ThePlainImplementationPassesItsOwnTolerance) {
  const TwoScales data;
  const Tolerance tolerance =
      derive_tolerance(data.plain.view(), data.reference.view(), DType::kF64);
  const OutputCheck check =
      compare("out", data.plain.view(), data.reference.view(), tolerance, true);
  EXPECT_TRUE(check.passed()) << check.max_error << " > " << check.allowed;
  EXPECT_EQ(check.fraction_outside, 0.0);
}

TEST(Tolerance, ThreeTimesThePlainErrorFails) {
  const TwoScales data;
  const Tolerance tolerance =
      derive_tolerance(data.plain.view(), data.reference.view(), DType::kF64);
  HostTensor engine = data.reference.to(DType::kF64);
  for (std::int64_t i = 0; i < engine.numel(); ++i) {
    engine.set(i, data.reference.at(i) + 3.0 * (data.plain.at(i) - data.reference.at(i)));
  }
  const OutputCheck check = compare("out", engine.view(), data.reference.view(), tolerance, true);
  EXPECT_FALSE(check.passed());
  EXPECT_GT(check.fraction_outside, 0.4);
}

// What judging per element buys: an error as large as the plain implementation's error on the
// large elements, on a small element, fails (one bound per tensor, 2 x max plain error, passed it).
TEST(Tolerance, SmallElementsAreHeldToTheirOwnBound) {
  const TwoScales data;
  const Tolerance tolerance =
      derive_tolerance(data.plain.view(), data.reference.view(), DType::kF64);
  HostTensor engine = data.reference.to(DType::kF64);
  constexpr std::int64_t kSmallElement = 7;
  engine.set(kSmallElement, data.reference.at(kSmallElement) + 1e-3);
  const OutputCheck check = compare("out", engine.view(), data.reference.view(), tolerance, true);
  EXPECT_FALSE(check.passed());
  EXPECT_EQ(check.worst_index, kSmallElement);
  EXPECT_DOUBLE_EQ(check.max_error, 1e-3);
  EXPECT_LT(check.allowed, 1e-4);
  EXPECT_DOUBLE_EQ(check.fraction_outside, 1.0 / 64.0);
}

TEST(Tolerance, NanAndInfinitiesAgreeOnlyWithThemselves) {
  EXPECT_EQ(element_error(kNan, kNan), 0.0);
  EXPECT_EQ(element_error(-kInf, -kInf), 0.0);
  EXPECT_EQ(element_error(kNan, 1.0), kInf);
  EXPECT_EQ(element_error(1.0, kNan), kInf);
  EXPECT_EQ(element_error(0.0, -kInf), kInf);
  EXPECT_EQ(element_error(kInf, -kInf), kInf);

  // Fully masked rows: LSE -inf on both sides agrees; a NaN where the reference is finite fails,
  // however loose the tolerance.
  const HostTensor reference = tensor_of({-kInf, 2.0, kNan, 3.0});
  const Tolerance loose{1e3, 1e3};
  const HostTensor agreeing = tensor_of({-kInf, 2.0, kNan, 3.0});
  EXPECT_TRUE(compare("lse", agreeing.view(), reference.view(), loose, true).passed());
  const HostTensor nan_engine = tensor_of({-kInf, kNan, kNan, 3.0});
  const OutputCheck nan_check = compare("lse", nan_engine.view(), reference.view(), loose, true);
  EXPECT_FALSE(nan_check.passed());
  EXPECT_EQ(nan_check.worst_index, 1);
  const HostTensor finite_for_empty = tensor_of({0.0, 2.0, kNan, 3.0});
  EXPECT_FALSE(compare("lse", finite_for_empty.view(), reference.view(), loose, true).passed());
}

TEST(Tolerance, AnExactPlainImplementationLeavesTheRoundingFloor) {
  const HostTensor reference = tensor_of({1.0, -2.0, 0.5, 0.0});
  const Tolerance tolerance = derive_tolerance(reference.view(), reference.view(), DType::kBF16);
  EXPECT_DOUBLE_EQ(tolerance.rtol, 0x1p-7);         // one bf16 rounding of the element
  EXPECT_DOUBLE_EQ(tolerance.atol, 2.0 * 0x1p-23);  // one float32 rounding of max |ref|
  EXPECT_DOUBLE_EQ(tolerance.allowed(0, -kInf), 0.0);
}

TEST(Tolerance, AGuardOverwriteFailsEvenWithoutError) {
  const HostTensor reference = tensor_of({1.0, 2.0});
  const OutputCheck check = compare("out", reference.view(), reference.view(), Tolerance{}, false);
  EXPECT_FALSE(check.passed());
}

// ---- the cancellation floor of the gradients through dS ----------------------------------------

TEST(Tolerance, AFloorAddsItsOwnAllowanceToEachElement) {
  Tolerance tolerance{1e-6, 1e-3};
  tolerance.floor = std::make_shared<const std::vector<double>>(std::vector<double>{0.0, 5e-6});
  EXPECT_DOUBLE_EQ(tolerance.allowed(0, 2.0), 1e-6 + 2e-3);
  EXPECT_DOUBLE_EQ(tolerance.allowed(1, -2.0), 1e-6 + 2e-3 + 5e-6);
  EXPECT_DOUBLE_EQ(tolerance.allowed(1, kNan), 0.0);
}

TEST(Tolerance, TheCancellationFloorIsTwoFloat32RoundingsOfTheMagnitude) {
  const HostTensor magnitudes = tensor_of({0.0, 1.0, 40.0, kInf});
  const auto floor = cancellation_floor(magnitudes.view());
  ASSERT_EQ(floor->size(), 4U);
  EXPECT_DOUBLE_EQ((*floor)[0], 0.0);
  EXPECT_DOUBLE_EQ((*floor)[1], 2.0 * 0x1p-23);
  EXPECT_DOUBLE_EQ((*floor)[2], 80.0 * 0x1p-23);
  EXPECT_DOUBLE_EQ((*floor)[3], 0.0);
}

// One query keeping one key: dS = P (dP - D) is 0 in exact arithmetic (P = 1, O = V), so dq and
// dk are 0 and their plain errors too; a float32 kernel still returns the rounding of dP and D,
// each a sum of head_dim products: ~ eps_f32 * sum |dO V| * scale * |K| (or |Q|).
// cpu_ref with `edit` applied to its backward's outputs.
using BackwardEdit = std::function<void(const Problem&, const BackwardArgs&)>;

class EditedBackwardPlan final : public Plan {
 public:
  EditedBackwardPlan(std::unique_ptr<Plan> inner, BackwardEdit edit)
      : Plan(inner->info()), inner_(std::move(inner)), edit_(std::move(edit)) {}
  const Problem& problem() const override { return inner_->problem(); }

 protected:
  void run_forward(const ForwardArgs& args) const override { inner_->forward(args); }
  void run_backward(const BackwardArgs& args) const override {
    inner_->backward(args);
    edit_(problem(), args);
  }

 private:
  std::unique_ptr<Plan> inner_;
  BackwardEdit edit_;
};

class EditedBackwardEngine final : public Engine {
 public:
  explicit EditedBackwardEngine(BackwardEdit edit) : edit_(std::move(edit)) {}
  std::string_view name() const override { return "cpu_ref_with_edited_backward"; }
  Support available() const override { return Support::yes(); }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    result.support = Support::yes();
    if (stage == Stage::kBuild) {
      result.plan =
          std::make_unique<EditedBackwardPlan>(make_cpu_ref_engine()->plan(problem), edit_);
    }
    return result;
  }

 private:
  BackwardEdit edit_;
};

// cpu_ref plus `factor` times that residue.
EditedBackwardEngine residue_engine(double factor) {
  return EditedBackwardEngine([factor](const Problem& p, const BackwardArgs& args) {
    const std::int64_t dim = p.head_dim_qk();
    const auto at = [](const TensorView& view, std::int64_t head, std::int64_t d) {
      return head * view.strides[2] + d * view.strides[3];  // bshd, batch 1, one token
    };
    for (std::int64_t h = 0; h < p.heads_q(); ++h) {
      double products = 0.0;  // sum |dO V| of the row
      for (std::int64_t d = 0; d < p.head_dim_v(); ++d) {
        products += std::fabs(args.dout.load(at(args.dout, h, d)) * args.v.load(at(args.v, h, d)));
      }
      const double residue = factor * 0x1p-23 * products * p.scale();
      for (std::int64_t d = 0; d < dim; ++d) {
        args.dq.store(at(args.dq, h, d),
                      args.dq.load(at(args.dq, h, d)) + residue * args.k.load(at(args.k, h, d)));
        args.dk.store(at(args.dk, h, d),
                      args.dk.load(at(args.dk, h, d)) + residue * args.q.load(at(args.q, h, d)));
      }
    }
  });
}

Case single_key_case(DType dtype, std::int64_t head_dim) {
  Case c;
  c.name = "single_key";
  c.modifier = "none";
  c.mask = "causal";
  c.shape = {1, 2, 2, 1, 1, head_dim, head_dim};
  c.layout = Layout::kBSHD;
  c.dtype = dtype;
  c.backward = true;
  c.prove_discriminating = false;  // one key: the mask changes nothing
  return c;
}

TEST(Tolerance, ASingleKeysRoundingResiduePassesAndARealErrorFails) {
  for (const DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (const std::int64_t head_dim : {64, 128}) {
      SCOPED_TRACE(std::string(to_string(dtype)) + " d" + std::to_string(head_dim));
      const Case c = single_key_case(dtype, head_dim);
      const Outcome exact = run_case(residue_engine(0.0), c);
      EXPECT_EQ(exact.status, Status::kPass) << exact.reason;
      const Outcome rounded = run_case(residue_engine(1.0), c);
      EXPECT_EQ(rounded.status, Status::kPass) << rounded.reason;
      const Outcome wrong = run_case(residue_engine(1e4), c);
      EXPECT_EQ(wrong.status, Status::kFail);
      EXPECT_NE(wrong.reason.find("dq: error"), std::string::npos) << wrong.reason;
    }
  }
}

// ---- the storage roundings behind D = rowsum(dO * O) -------------------------------------------

// cpu_ref with one dK element replaced.
EditedBackwardEngine one_dk_element_engine(std::int64_t element, double value) {
  return EditedBackwardEngine([element, value](const Problem&, const BackwardArgs& args) {
    args.dk.store(element, value);
  });
}

// fp16 softcap 30 under a causal mask: dK of key 3 (element 414: key 3, kv head 0, d 30) sums
// terms of total size 171 to -0.2425. The cuda engine returns -0.236572 there: its forward rounds
// P to fp16 before dividing by the row sum, so its stored O differs from the plain
// implementation's by a rounding in about a quarter of the elements, and D = rowsum(dO * O) with
// it; the queries that keep key 3 with a large P carry that into dK (an emulation in float64 of
// that order gives the same fp16 value). 1.2 standard deviations of the rounding model, 5.3 times
// the plain implementation's error at that element, 1.24 times the tolerance without the model.
// A quarter of the value off (what dropping softcap's derivative does to such elements) fails.
TEST(Tolerance, ARoundingOrderOfOThatDsCancelsPassesAndAWrongGradientFails) {
  constexpr std::int64_t kElement = 414;
  const std::string name = "fp16_bshd_b1_hq4_hkv2_sq100_skv100_d64/softcap30_causal_nanv_bwd";
  std::optional<Case> found;
  for (const Case& c : cases(Tier::kNonFinite)) {
    if (c.name == name) found = c;
  }
  ASSERT_TRUE(found.has_value()) << name;
  const Outcome flash_order = run_case(one_dk_element_engine(kElement, -0.236572), *found);
  EXPECT_EQ(flash_order.status, Status::kPass) << flash_order.reason;
  const Outcome wrong = run_case(one_dk_element_engine(kElement, 0.75 * -0.24246), *found);
  EXPECT_EQ(wrong.status, Status::kFail);
  EXPECT_NE(wrong.reason.find("dk: error"), std::string::npos) << wrong.reason;
  EXPECT_NE(wrong.reason.find("at element 414"), std::string::npos) << wrong.reason;
}

// plain_backward_rounding_sigma against a simulation of the roundings it models, in float64: P
// (as it enters O), O and dS each times (1 + e), e uniform within half an fp16 unit in the last
// place, independent (none in a row that keeps one key: P = 1 and O = V there). Softcap 5 under a
// causal mask, GQA 2:1: the derivative, the rows' shared D, the one-key row and the sum over the
// group's heads all enter. The standard deviation of every dQ and dK element over 4000 draws
// must be the model's within 10% (sampling error about 1%; the model is within 2.5%).
TEST(Tolerance, TheRoundingSigmaIsTheSpreadOfTheRoundingsItModels) {
  constexpr int kSeq = 7, kHeads = 2, kDim = 4, kTrials = 4000;
  Case c;
  c.name = "rounding_sigma";
  c.modifier = "softcap5";
  c.mask = "causal";
  c.shape = {1, kHeads, 1, kSeq, kSeq, kDim, kDim};
  c.dtype = DType::kF16;
  c.backward = true;
  const Instance instance = instantiate(c, Device::kCpu, 1);
  const Problem problem(instance.desc);
  HostTensor q(DType::kF16, {1, kSeq, kHeads, kDim}), k(DType::kF16, {1, kSeq, 1, kDim});
  HostTensor v(DType::kF16, {1, kSeq, 1, kDim}), dout(DType::kF16, {1, kSeq, kHeads, kDim});
  HostTensor out(DType::kF16, {1, kSeq, kHeads, kDim});
  q.fill_normal(11, 2.0);
  k.fill_normal(12, 2.0);
  v.fill_normal(13);
  dout.fill_normal(14);
  const double scale = problem.scale();
  const auto qi = [](int s, int h, int d) {
    return static_cast<std::int64_t>((s * kHeads + h) * kDim + d);
  };
  const auto ki = [](int s, int d) { return static_cast<std::int64_t>(s * kDim + d); };

  // One backward in float64 with the given relative errors (none: the exact gradients).
  std::mt19937_64 random(5);
  const double u = 0x1p-11;
  std::uniform_real_distribution<double> draw(-u, u);
  const auto gradients = [&](bool perturbed, std::vector<double>& dq, std::vector<double>& dk) {
    dq.assign(kSeq * kHeads * kDim, 0.0);
    dk.assign(kSeq * kDim, 0.0);
    for (int h = 0; h < kHeads; ++h) {
      for (int i = 0; i < kSeq; ++i) {
        const int keys = i + 1;  // causal
        std::vector<double> p(keys), g(keys), dp(keys, 0.0);
        double largest = -1e300, sum = 0.0;
        for (int j = 0; j < keys; ++j) {
          double dot = 0.0;
          for (int d = 0; d < kDim; ++d) dot += q.at(qi(i, h, d)) * k.at(ki(j, d));
          const double t = std::tanh(scale * dot / 5.0);
          p[j] = 5.0 * t;
          g[j] = 1.0 - t * t;
          largest = std::max(largest, p[j]);
        }
        for (int j = 0; j < keys; ++j) sum += (p[j] = std::exp(p[j] - largest));
        for (int j = 0; j < keys; ++j) p[j] /= sum;
        const bool rounded = perturbed && keys > 1;
        std::vector<double> stored_p(keys);  // P rounded once, for every column of O
        for (int j = 0; j < keys; ++j) stored_p[j] = p[j] * (1.0 + (rounded ? draw(random) : 0.0));
        double delta = 0.0;
        for (int d = 0; d < kDim; ++d) {
          double o = 0.0;
          for (int j = 0; j < keys; ++j) o += stored_p[j] * v.at(ki(j, d));
          o *= 1.0 + (rounded ? draw(random) : 0.0);
          if (!perturbed) out.set(qi(i, h, d), o);
          delta += dout.at(qi(i, h, d)) * o;
        }
        for (int j = 0; j < keys; ++j) {
          for (int d = 0; d < kDim; ++d) dp[j] += dout.at(qi(i, h, d)) * v.at(ki(j, d));
          const double ds =
              p[j] * (dp[j] - delta) * g[j] * (1.0 + (perturbed ? draw(random) : 0.0));
          for (int d = 0; d < kDim; ++d) {
            dq[qi(i, h, d)] += scale * ds * k.at(ki(j, d));
            dk[ki(j, d)] += scale * ds * q.at(qi(i, h, d));
          }
        }
      }
    }
  };
  std::vector<double> exact_dq, exact_dk, dq, dk;
  gradients(false, exact_dq, exact_dk);
  std::vector<double> square_dq(exact_dq.size(), 0.0), square_dk(exact_dk.size(), 0.0);
  for (int trial = 0; trial < kTrials; ++trial) {
    gradients(true, dq, dk);
    for (std::size_t i = 0; i < dq.size(); ++i)
      square_dq[i] += (dq[i] - exact_dq[i]) * (dq[i] - exact_dq[i]);
    for (std::size_t i = 0; i < dk.size(); ++i)
      square_dk[i] += (dk[i] - exact_dk[i]) * (dk[i] - exact_dk[i]);
  }

  HostTensor sigma_dq(DType::kF64, q.shape()), sigma_dk(DType::kF64, k.shape());
  BackwardArgs args;
  args.q = q.view(), args.k = k.view(), args.v = v.view(), args.out = out.view();
  args.dout = dout.view(), args.dq = sigma_dq.view(), args.dk = sigma_dk.view();
  plain_backward_rounding_sigma(problem, args);
  const auto expect_spread = [&](const char* name, const std::vector<double>& squares,
                                 const HostTensor& sigma) {
    int compared = 0;
    for (std::size_t i = 0; i < squares.size(); ++i) {
      const double simulated = std::sqrt(squares[i] / kTrials);
      const double model = sigma.at(static_cast<std::int64_t>(i));
      SCOPED_TRACE(std::string(name) + " element " + std::to_string(i));
      if (simulated < 1e-9) {  // the one-key row's dQ: dS is 0 there
        EXPECT_LT(model, 1e-9);
        continue;
      }
      EXPECT_GT(model, 0.9 * simulated);
      EXPECT_LT(model, 1.1 * simulated);
      ++compared;
    }
    EXPECT_GT(compared, static_cast<int>(squares.size()) / 2) << name;
  };
  expect_spread("dq", square_dq, sigma_dq);
  expect_spread("dk", square_dk, sigma_dk);
}

}  // namespace
}  // namespace flexattn::conformance::detail
