// cpu_ref against an independent dense float64 implementation written here (materialising the
// score matrix is fine at these sizes), plus the semantics docs/design.md section 2 singles out:
// fully masked rows, -inf scores, GQA, ragged thd batches, head_dim_v != head_dim_qk, storage
// dtypes, strided views, determinism, and finite-difference checks of the gradients.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <tuple>

#include "engines/cpu_ref/cpu_ref.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

using namespace flexattn::ir;
using test::from_bhsd;
using test::Inputs;
using test::Outputs;
using test::to_bhsd;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Two float64 computations of the same function that differ only in summation order.
constexpr double kFloat64Tolerance = 1e-12;

const Engine& cpu_ref() {
  static const std::shared_ptr<const Engine> engine = test::builtin_engine("cpu_ref");
  return *engine;
}

void expect_close(const HostTensor& result, const HostTensor& expected, const std::string& what,
                  double relative = kFloat64Tolerance) {
  const double allowed = relative * std::max(1.0, test::max_abs_value(expected));
  EXPECT_TRUE(test::within_tolerance(result, expected, allowed)) << what;
}

bool has_nan(const HostTensor& tensor) {
  for (std::int64_t i = 0; i < tensor.numel(); ++i) {
    if (std::isnan(tensor.at(i))) return true;
  }
  return false;
}

// ---- the independent dense implementation ----------------------------------------------------

struct NaiveModifier {
  std::function<double(double score, std::int64_t h, std::int64_t q, std::int64_t kv)> score =
      [](double s, std::int64_t, std::int64_t, std::int64_t) { return s; };
  std::function<double(double score)> slope = [](double) { return 1.0; };  // d score / d s
  std::function<bool(std::int64_t q, std::int64_t kv)> keep = [](std::int64_t, std::int64_t) {
    return true;
  };
};

struct Dense {
  HostTensor out, lse, dq, dk, dv;  // bhsd, fp64
};

// q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv), dout (B, Hq, Sq, Dv), all fp64.
Dense naive_attention(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                      const HostTensor& dout, double scale, const NaiveModifier& modifier) {
  const std::int64_t batch = q.shape()[0], heads_q = q.shape()[1], seq_q = q.shape()[2];
  const std::int64_t dim = q.shape()[3], heads_kv = k.shape()[1], seq_kv = k.shape()[2];
  const std::int64_t dim_v = v.shape()[3], group = heads_q / heads_kv;
  Dense r{HostTensor(DType::kF64, {batch, heads_q, seq_q, dim_v}),
          HostTensor(DType::kF64, {batch, heads_q, seq_q}), HostTensor(DType::kF64, q.shape()),
          HostTensor(DType::kF64, k.shape()), HostTensor(DType::kF64, v.shape())};
  const auto at = [](const HostTensor& t, std::int64_t a, std::int64_t b, std::int64_t c,
                     std::int64_t d) {
    const auto& s = t.shape();
    return ((a * s[1] + b) * s[2] + c) * s[3] + d;
  };
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < heads_q; ++h) {
      const std::int64_t hk = h / group;
      std::vector<double> raw(seq_q * seq_kv), s(seq_q * seq_kv, -kInf), p(seq_q * seq_kv, 0.0);
      for (std::int64_t i = 0; i < seq_q; ++i) {
        double max = -kInf;
        for (std::int64_t j = 0; j < seq_kv; ++j) {
          double dot = 0.0;
          for (std::int64_t d = 0; d < dim; ++d) {
            dot += q.at(at(q, b, h, i, d)) * k.at(at(k, b, hk, j, d));
          }
          raw[i * seq_kv + j] = scale * dot;
          if (modifier.keep(i, j)) s[i * seq_kv + j] = modifier.score(scale * dot, h, i, j);
          max = std::max(max, s[i * seq_kv + j]);
        }
        double sum = 0.0;
        for (std::int64_t j = 0; j < seq_kv && max > -kInf; ++j) {
          sum += std::exp(s[i * seq_kv + j] - max);
        }
        const double lse = max > -kInf ? max + std::log(sum) : -kInf;
        r.lse.set((b * heads_q + h) * seq_q + i, lse);
        for (std::int64_t j = 0; j < seq_kv && max > -kInf; ++j) {
          p[i * seq_kv + j] = std::exp(s[i * seq_kv + j] - lse);
        }
        for (std::int64_t d = 0; d < dim_v; ++d) {
          double o = 0.0;
          for (std::int64_t j = 0; j < seq_kv; ++j) {
            o += p[i * seq_kv + j] * v.at(at(v, b, hk, j, d));
          }
          r.out.set(at(r.out, b, h, i, d), o);
        }
      }
      // Backward, matrix by matrix.
      for (std::int64_t i = 0; i < seq_q; ++i) {
        double row = 0.0;  // rowsum(dO * O)
        for (std::int64_t d = 0; d < dim_v; ++d) {
          row += dout.at(at(dout, b, h, i, d)) * r.out.at(at(r.out, b, h, i, d));
        }
        for (std::int64_t j = 0; j < seq_kv; ++j) {
          const double pij = p[i * seq_kv + j];
          if (pij == 0.0) continue;
          double dp = 0.0;
          for (std::int64_t d = 0; d < dim_v; ++d) {
            dp += dout.at(at(dout, b, h, i, d)) * v.at(at(v, b, hk, j, d));
            r.dv.set(at(v, b, hk, j, d),
                     r.dv.at(at(v, b, hk, j, d)) + pij * dout.at(at(dout, b, h, i, d)));
          }
          const double ds = pij * (dp - row) * modifier.slope(raw[i * seq_kv + j]) * scale;
          for (std::int64_t d = 0; d < dim; ++d) {
            r.dq.set(at(q, b, h, i, d), r.dq.at(at(q, b, h, i, d)) + ds * k.at(at(k, b, hk, j, d)));
            r.dk.set(at(k, b, hk, j, d),
                     r.dk.at(at(k, b, hk, j, d)) + ds * q.at(at(q, b, h, i, d)));
          }
        }
      }
    }
  }
  return r;
}

// ---- helpers ----------------------------------------------------------------------------------

ProblemDesc make_desc(std::int64_t batch, std::int64_t heads_q, std::int64_t heads_kv,
                      std::int64_t seq_q, std::int64_t seq_kv, std::int64_t dim, std::int64_t dim_v,
                      Layout layout = Layout::kBHSD) {
  ProblemDesc desc;
  desc.batch = batch;
  desc.heads_q = heads_q;
  desc.heads_kv = heads_kv;
  desc.seq_len_q = seq_q;
  desc.seq_len_kv = seq_kv;
  desc.head_dim_qk = dim;
  desc.head_dim_v = dim_v;
  desc.layout = layout;
  desc.dtype = DType::kF64;
  desc.direction = Direction::kForwardBackward;
  return desc;
}

// bhsd fp64 copies of inputs given in `layout`.
struct DenseInputs {
  HostTensor q, k, v, dout;
};
DenseInputs dense_inputs(const Inputs& inputs, Layout layout) {
  return {to_bhsd(inputs.q, layout).to(DType::kF64), to_bhsd(inputs.k, layout).to(DType::kF64),
          to_bhsd(inputs.v, layout).to(DType::kF64), to_bhsd(inputs.dout, layout).to(DType::kF64)};
}

void expect_matches_naive(const Problem& problem, const Inputs& inputs, const Outputs& outputs,
                          const NaiveModifier& modifier) {
  const Layout layout = problem.layout();
  const DenseInputs in = dense_inputs(inputs, layout);
  const Dense want = naive_attention(in.q, in.k, in.v, in.dout, problem.scale(), modifier);
  expect_close(to_bhsd(outputs.out, layout), want.out, "out");
  expect_close(outputs.lse, want.lse, "lse");
  expect_close(to_bhsd(outputs.dq, layout), want.dq, "dq");
  expect_close(to_bhsd(outputs.dk, layout), want.dk, "dk");
  expect_close(to_bhsd(outputs.dv, layout), want.dv, "dv");
}

// sum(dout * out) through cpu_ref's forward, for finite differences.
double forward_loss(const Problem& problem, const Inputs& inputs) {
  ProblemDesc desc = problem.desc();
  desc.direction = Direction::kForward;
  const Problem forward(desc);
  const Outputs outputs = test::run_engine(cpu_ref(), forward, inputs);
  double loss = 0.0;
  for (std::int64_t i = 0; i < outputs.out.numel(); ++i) {
    loss += outputs.out.at(i) * inputs.dout.at(i);
  }
  return loss;
}

// Central difference of the loss in element `index` of `tensor` (a member of `inputs`).
double finite_difference(const Problem& problem, Inputs& inputs, HostTensor& tensor,
                         std::int64_t index) {
  constexpr double kStep = 1e-6;
  const double original = tensor.at(index);
  tensor.set(index, original + kStep);
  const double up = forward_loss(problem, inputs);
  tensor.set(index, original - kStep);
  const double down = forward_loss(problem, inputs);
  tensor.set(index, original);
  return (up - down) / (2 * kStep);
}

// Step 1e-6 in float64: truncation ~1e-12, cancellation ~1e-16 * |loss| / 1e-6.
constexpr double kFiniteDifferenceTolerance = 1e-6;

// ---- the Transformer Engine regression cases ---------------------------------------------------

enum class TeModifier { kSoftcap, kPostScaleBias, kCausal, kSoftcapCausal };
using TeParam = std::tuple<TeModifier, std::int64_t, Layout>;

std::string te_name(const ::testing::TestParamInfo<TeParam>& info) {
  const char* names[] = {"softcap", "post_scale_bias", "causal", "softcap_causal"};
  return std::string(names[static_cast<int>(std::get<0>(info.param))]) + "_s" +
         std::to_string(std::get<1>(info.param)) + "_" +
         std::string(to_string(std::get<2>(info.param)));
}

class TeRegression : public ::testing::TestWithParam<TeParam> {};

TEST_P(TeRegression, MatchesDenseReferenceForwardAndBackward) {
  const auto [which, seq_len, layout] = GetParam();
  constexpr double kCap = 0.8;  // a cap small enough that tanh is far from linear
  ProblemDesc desc = make_desc(2, 4, 4, seq_len, seq_len, 64, 64, layout);
  NaiveModifier modifier;
  if (which == TeModifier::kSoftcap || which == TeModifier::kSoftcapCausal) {
    desc.score_mod = kCap * tanh(score() / kCap);
    modifier.score = [&](double s, std::int64_t, std::int64_t, std::int64_t) {
      return kCap * std::tanh(s / kCap);
    };
    modifier.slope = [&](double s) { return 1.0 - std::pow(std::tanh(s / kCap), 2); };
  }
  if (which == TeModifier::kPostScaleBias) {
    desc.score_mod = score() + to_float(query() - key());
    modifier.score = [](double s, std::int64_t, std::int64_t q, std::int64_t kv) {
      return s + static_cast<double>(q - kv);
    };
  }
  if (which == TeModifier::kCausal || which == TeModifier::kSoftcapCausal) {
    desc.mask_mod = query() >= key();
    modifier.keep = [](std::int64_t q, std::int64_t kv) { return q >= kv; };
  }
  const Problem problem(desc);
  constexpr double kValueStddev = 0.1;
  Inputs inputs = test::random_inputs(problem, 11, kValueStddev);
  const Outputs outputs = test::run_engine(cpu_ref(), problem, inputs);
  expect_matches_naive(problem, inputs, outputs, modifier);

  if (seq_len > 16) return;  // finite differences on the small size only
  for (std::int64_t index : {std::int64_t{0}, inputs.q.numel() / 3, inputs.q.numel() - 1}) {
    const double numeric = finite_difference(problem, inputs, inputs.q, index);
    EXPECT_NEAR(outputs.dq.at(index), numeric, kFiniteDifferenceTolerance) << "dq " << index;
  }
  const std::int64_t k_index = inputs.k.numel() / 2;
  EXPECT_NEAR(outputs.dk.at(k_index), finite_difference(problem, inputs, inputs.k, k_index),
              kFiniteDifferenceTolerance);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TeRegression,
    ::testing::Combine(::testing::Values(TeModifier::kSoftcap, TeModifier::kPostScaleBias,
                                         TeModifier::kCausal, TeModifier::kSoftcapCausal),
                       ::testing::Values(16, 64), ::testing::Values(Layout::kBSHD, Layout::kSBHD)),
    te_name);

// The test-only mutant with d score_mod / d score replaced by 1: the plan proves the requested
// modifier, the forward is the oracle's, and the backward is the dense one with slope 1.
TEST(CpuRef, ScoreDerivativeReplacedByOneIsTheDenseBackwardWithSlopeOne) {
  constexpr double kCap = 0.8;  // tanh far from linear: slope 1 is far from the true slope
  ProblemDesc desc = make_desc(1, 2, 2, 16, 16, 64, 64);
  desc.score_mod = kCap * tanh(score() / kCap);
  const Problem problem(desc);
  const auto mutant = internal::make_cpu_ref_engine(ScoreDerivative::kReplacedByOne);
  EXPECT_EQ(mutant->name(), "cpu_ref_score_derivative_one");
  EXPECT_EQ(mutant->plan(problem)->info().lowered_hash, problem.modifier_hash());
  NaiveModifier modifier;
  modifier.score = [&](double s, std::int64_t, std::int64_t, std::int64_t) {
    return kCap * std::tanh(s / kCap);
  };
  const Inputs inputs = test::random_inputs(problem, 5);
  const Outputs outputs = test::run_engine(*mutant, problem, inputs);
  expect_matches_naive(problem, inputs, outputs, modifier);  // NaiveModifier's slope is 1
  const Outputs exact = test::run_engine(cpu_ref(), problem, inputs);
  EXPECT_GT(test::max_abs_error(outputs.dq, exact.dq), 0.1 * test::max_abs_value(exact.dq));
}

// ---- semantics ----------------------------------------------------------------------------------

TEST(CpuRef, FullyMaskedRowsGiveZeroOutputMinusInfLseAndZeroGradients) {
  ProblemDesc desc = make_desc(1, 2, 2, 12, 12, 8, 8);
  desc.mask_mod = query() >= 4 && key() <= query();  // rows 0..3 keep nothing
  const Problem problem(desc);
  const Inputs inputs = test::random_inputs(problem, 3);
  const Outputs outputs = test::run_engine(cpu_ref(), problem, inputs);
  for (const HostTensor* tensor : {&outputs.out, &outputs.dq, &outputs.dk, &outputs.dv}) {
    EXPECT_FALSE(has_nan(*tensor));
  }
  for (std::int64_t h = 0; h < 2; ++h) {
    for (std::int64_t q = 0; q < 12; ++q) {
      const double lse = outputs.lse.at(h * 12 + q);
      EXPECT_EQ(lse == -kInf, q < 4) << "h " << h << " q " << q;
      for (std::int64_t d = 0; q < 4 && d < 8; ++d) {
        EXPECT_EQ(outputs.out.at((h * 12 + q) * 8 + d), 0.0);
        EXPECT_EQ(outputs.dq.at((h * 12 + q) * 8 + d), 0.0);
      }
    }
  }
  NaiveModifier modifier;
  modifier.keep = [](std::int64_t q, std::int64_t kv) { return q >= 4 && kv <= q; };
  expect_matches_naive(problem, inputs, outputs, modifier);

  // Nothing kept anywhere: everything zero, LSE -inf.
  desc.mask_mod = query() < 0;
  const Problem none(desc);
  const Outputs empty = test::run_engine(cpu_ref(), none, inputs);
  EXPECT_EQ(test::max_abs_value(empty.out), 0.0);
  EXPECT_EQ(test::max_abs_value(empty.dk), 0.0);
  EXPECT_EQ(test::max_abs_value(empty.dv), 0.0);
  EXPECT_FALSE(has_nan(empty.dq));
  for (std::int64_t i = 0; i < empty.lse.numel(); ++i) EXPECT_EQ(empty.lse.at(i), -kInf);
}

TEST(CpuRef, ScoreModReturningMinusInfActsAsAMask) {
  ProblemDesc masked = make_desc(2, 2, 1, 10, 14, 8, 8);
  masked.mask_mod = query() + 4 >= key();
  ProblemDesc modified = masked;
  modified.mask_mod.reset();
  modified.score_mod = where(query() + 4 >= key(), score(), -infinity());
  const Problem a(masked), b(modified);
  const Inputs inputs = test::random_inputs(a, 5);
  const Outputs x = test::run_engine(cpu_ref(), a, inputs);
  const Outputs y = test::run_engine(cpu_ref(), b, inputs);
  expect_close(y.out, x.out, "out");
  expect_close(y.lse, x.lse, "lse");
  expect_close(y.dq, x.dq, "dq");
  expect_close(y.dk, x.dk, "dk");
  expect_close(y.dv, x.dv, "dv");
  EXPECT_FALSE(has_nan(y.dq));
}

TEST(CpuRef, GqaEqualsExplicitlyRepeatedKeysAndValues) {
  const std::int64_t heads_q = 6, heads_kv = 2, group = 3;
  ProblemDesc gqa_desc = make_desc(2, heads_q, heads_kv, 9, 13, 8, 4);
  gqa_desc.score_mod = 5.0 * tanh(score() / 5.0);
  gqa_desc.mask_mod = query() + (key_length() - query_length()) >= key();
  const Problem gqa(gqa_desc);
  const Inputs inputs = test::random_inputs(gqa, 9);
  const Outputs grouped = test::run_engine(cpu_ref(), gqa, inputs);

  ProblemDesc mha_desc = gqa_desc;
  mha_desc.heads_kv = heads_q;
  const Problem mha(mha_desc);
  Inputs repeated = test::random_inputs(mha, 9);
  repeated.q = inputs.q.to(DType::kF64);
  repeated.dout = inputs.dout.to(DType::kF64);
  for (auto [source, target] : {std::pair{&inputs.k, &repeated.k}, {&inputs.v, &repeated.v}}) {
    const std::int64_t per_head = source->shape()[2] * source->shape()[3];
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t h = 0; h < heads_q; ++h) {
        for (std::int64_t i = 0; i < per_head; ++i) {
          target->set((b * heads_q + h) * per_head + i,
                      source->at((b * heads_kv + h / group) * per_head + i));
        }
      }
    }
  }
  const Outputs plain = test::run_engine(cpu_ref(), mha, repeated);
  expect_close(grouped.out, plain.out, "out");
  expect_close(grouped.lse, plain.lse, "lse");
  expect_close(grouped.dq, plain.dq, "dq");
  for (auto [mine, theirs] : {std::pair{&grouped.dk, &plain.dk}, {&grouped.dv, &plain.dv}}) {
    const std::int64_t per_head = mine->shape()[2] * mine->shape()[3];
    HostTensor summed(DType::kF64, mine->shape());
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t h = 0; h < heads_q; ++h) {
        for (std::int64_t i = 0; i < per_head; ++i) {
          const std::int64_t to = (b * heads_kv + h / group) * per_head + i;
          summed.set(to, summed.at(to) + theirs->at((b * heads_q + h) * per_head + i));
        }
      }
    }
    expect_close(*mine, summed, "dk/dv summed over the group");
  }
}

TEST(CpuRef, RaggedThdBatchEqualsSeparateProblems) {
  const std::vector<std::int64_t> cu_q = {0, 5, 17, 20}, cu_kv = {0, 9, 12, 30};
  const std::int64_t heads = 2, dim = 8, max_q = 12, max_kv = 18;
  ProblemDesc desc = make_desc(3, heads, heads, 0, 0, dim, dim, Layout::kTHD);
  desc.cu_seqlens_q = cu_q;
  desc.cu_seqlens_kv = cu_kv;
  desc.tensors["bias"] = TensorDecl{DType::kF32, {heads, max_q, max_kv}};
  const auto bias = [] { return load("bias", Type::kF32, {head(), query(), key()}); };
  desc.score_mod = score() + bias();
  desc.mask_mod = query() + (key_length() - query_length()) >= key();
  const Problem packed(desc);
  const Inputs inputs = test::random_inputs(packed, 21);
  const Outputs together = test::run_engine(cpu_ref(), packed, inputs);
  HostTensor bias_grad_sum(DType::kF64, {heads, max_q, max_kv});

  for (std::int64_t b = 0; b < 3; ++b) {
    const std::int64_t len_q = cu_q[b + 1] - cu_q[b], len_kv = cu_kv[b + 1] - cu_kv[b];
    ProblemDesc single_desc = make_desc(1, heads, heads, len_q, len_kv, dim, dim, Layout::kBSHD);
    single_desc.tensors = desc.tensors;
    single_desc.score_mod = score() + bias();
    single_desc.mask_mod = desc.mask_mod;
    const Problem single(single_desc);
    Inputs part = test::random_inputs(single, 0);
    part.tensors.at("bias") = inputs.tensors.at("bias").to(DType::kF32);
    // thd rows [cu[b], cu[b + 1]) are bshd rows of a batch of one.
    const auto slice = [](const HostTensor& from, HostTensor& to, std::int64_t first_row) {
      const std::int64_t row = from.shape()[1] * from.shape()[2];
      for (std::int64_t i = 0; i < to.numel(); ++i) to.set(i, from.at(first_row * row + i));
    };
    slice(inputs.q, part.q, cu_q[b]);
    slice(inputs.dout, part.dout, cu_q[b]);
    slice(inputs.k, part.k, cu_kv[b]);
    slice(inputs.v, part.v, cu_kv[b]);
    const Outputs alone = test::run_engine(cpu_ref(), single, part);

    HostTensor mine_out = alone.out.to(DType::kF64), mine_dq = alone.dq.to(DType::kF64);
    HostTensor mine_dk = alone.dk.to(DType::kF64), mine_dv = alone.dv.to(DType::kF64);
    HostTensor packed_out(DType::kF64, alone.out.shape()), packed_dq(DType::kF64, alone.dq.shape());
    HostTensor packed_dk(DType::kF64, alone.dk.shape()), packed_dv(DType::kF64, alone.dv.shape());
    slice(together.out, packed_out, cu_q[b]);
    slice(together.dq, packed_dq, cu_q[b]);
    slice(together.dk, packed_dk, cu_kv[b]);
    slice(together.dv, packed_dv, cu_kv[b]);
    expect_close(packed_out, mine_out, "out of sequence " + std::to_string(b));
    expect_close(packed_dq, mine_dq, "dq of sequence " + std::to_string(b));
    expect_close(packed_dk, mine_dk, "dk of sequence " + std::to_string(b));
    expect_close(packed_dv, mine_dv, "dv of sequence " + std::to_string(b));
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t q = 0; q < len_q; ++q) {
        const double packed_lse = together.lse.at(h * cu_q.back() + cu_q[b] + q);
        const double alone_lse = alone.lse.at(h * len_q + q);
        if (packed_lse != alone_lse) {  // equal -inf for rows the bottom-right mask empties
          EXPECT_NEAR(packed_lse, alone_lse, kFloat64Tolerance);
        }
      }
    }
    const HostTensor& grad = alone.tensor_grads.at("bias");
    for (std::int64_t i = 0; i < grad.numel(); ++i) {
      bias_grad_sum.set(i, bias_grad_sum.at(i) + grad.at(i));
    }
  }
  expect_close(together.tensor_grads.at("bias"), bias_grad_sum, "dbias");
}

TEST(CpuRef, ThdSequenceWithoutKeysIsFullyMasked) {
  ProblemDesc desc = make_desc(2, 1, 1, 0, 0, 4, 4, Layout::kTHD);
  desc.cu_seqlens_q = {0, 3, 6};
  desc.cu_seqlens_kv = {0, 0, 5};  // the first sequence has no keys
  const Problem problem(desc);
  const Outputs outputs = test::run_engine(cpu_ref(), problem, test::random_inputs(problem, 2));
  for (std::int64_t q = 0; q < 3; ++q) EXPECT_EQ(outputs.lse.at(q), -kInf);
  for (std::int64_t q = 3; q < 6; ++q) EXPECT_TRUE(std::isfinite(outputs.lse.at(q)));
  for (std::int64_t i = 0; i < 12; ++i) EXPECT_EQ(outputs.out.at(i), 0.0);
  EXPECT_FALSE(has_nan(outputs.dq));
}

TEST(CpuRef, HeadDimVDiffersFromHeadDimQk) {
  ProblemDesc desc = make_desc(1, 2, 2, 7, 11, 16, 5, Layout::kBSHD);
  desc.score_mod = score() * 0.5 + to_float(key()) * 0.125;
  const Problem problem(desc);
  const Inputs inputs = test::random_inputs(problem, 4);
  const Outputs outputs = test::run_engine(cpu_ref(), problem, inputs);
  EXPECT_EQ(outputs.out.shape(), (std::vector<std::int64_t>{1, 7, 2, 5}));
  NaiveModifier modifier;
  modifier.score = [](double s, std::int64_t, std::int64_t, std::int64_t kv) {
    return s * 0.5 + static_cast<double>(kv) * 0.125;
  };
  modifier.slope = [](double) { return 0.5; };
  expect_matches_naive(problem, inputs, outputs, modifier);
}

TEST(CpuRef, AcceptsEveryStorageDType) {
  ProblemDesc desc = make_desc(1, 2, 2, 9, 9, 16, 16, Layout::kSBHD);
  desc.mask_mod = query() >= key();
  const Problem exact(desc);
  const Inputs inputs64 = test::random_inputs(exact, 8);
  // Each storage dtype sees its own rounding of the inputs; the outputs are the float64 results
  // on those inputs, rounded once to the storage dtype.
  const std::pair<DType, double> dtypes[] = {
      {DType::kF32, 0x1p-24}, {DType::kF16, 0x1p-11}, {DType::kBF16, 0x1p-8}};
  for (const auto& [dtype, epsilon] : dtypes) {
    desc.dtype = dtype;
    const Problem stored(desc);
    Inputs rounded = test::random_inputs(stored, 8);
    Inputs back = test::random_inputs(exact, 8);
    for (auto [from, to, wide] : {std::tuple{&inputs64.q, &rounded.q, &back.q},
                                  {&inputs64.k, &rounded.k, &back.k},
                                  {&inputs64.v, &rounded.v, &back.v},
                                  {&inputs64.dout, &rounded.dout, &back.dout}}) {
      copy_into(from->view(), to->view());
      copy_into(to->view(), wide->view());
    }
    const Outputs low = test::run_engine(cpu_ref(), stored, rounded);
    const Outputs high = test::run_engine(cpu_ref(), exact, back);
    EXPECT_EQ(low.out.dtype(), dtype);
    EXPECT_EQ(low.lse.dtype(), DType::kF32);
    for (auto [result, reference] : {std::pair{&low.out, &high.out},
                                     {&low.dq, &high.dq},
                                     {&low.dk, &high.dk},
                                     {&low.dv, &high.dv}}) {
      EXPECT_TRUE(
          test::within_tolerance(*result, *reference, epsilon * test::max_abs_value(*reference)))
          << to_string(dtype);
    }
    EXPECT_TRUE(test::within_tolerance(low.lse, high.lse, 0x1p-24 * test::max_abs_value(high.lse)));
  }
}

TEST(CpuRef, HonoursStridedViews) {
  ProblemDesc desc = make_desc(2, 2, 2, 5, 5, 4, 4, Layout::kBSHD);
  desc.score_mod = 2.0 * tanh(score() / 2.0);
  const Problem contiguous(desc);
  const Inputs inputs = test::random_inputs(contiguous, 6);
  const Outputs want = test::run_engine(cpu_ref(), contiguous, inputs);

  // Q and O with padded rows: (2, 5, 2, 4) inside (2, 5, 3, 8) buffers.
  const std::vector<std::int64_t> padded = {120, 24, 8, 1};
  desc.q_strides = padded;
  desc.o_strides = padded;
  const Problem strided(desc);
  HostTensor q_buffer(DType::kF64, {2, 5, 3, 8}), o_buffer(DType::kF64, {2, 5, 3, 8});
  HostTensor dq_buffer(DType::kF64, {2, 5, 3, 8}), dout_buffer(DType::kF64, {2, 5, 3, 8});
  const auto as_padded = [&](const HostTensor& buffer) {
    TensorView view = buffer.view();
    view.shape = {2, 5, 2, 4};
    view.strides = padded;
    return view;
  };
  copy_into(inputs.q.view(), as_padded(q_buffer));
  copy_into(inputs.dout.view(), as_padded(dout_buffer));
  const std::unique_ptr<Plan> plan = cpu_ref().plan(strided);
  Outputs got;
  got.lse = HostTensor(DType::kF64, strided.expected("lse").shape);
  got.dk = HostTensor(DType::kF64, inputs.k.shape());
  got.dv = HostTensor(DType::kF64, inputs.v.shape());
  ForwardArgs forward{as_padded(q_buffer),
                      inputs.k.view(),
                      inputs.v.view(),
                      as_padded(o_buffer),
                      got.lse.view(),
                      {},
                      nullptr};
  plan->forward(forward);
  BackwardArgs backward;
  backward.q = as_padded(q_buffer);
  backward.k = inputs.k.view();
  backward.v = inputs.v.view();
  backward.out = as_padded(o_buffer);
  backward.lse = got.lse.view();
  backward.dout = as_padded(dout_buffer);
  backward.dq = as_padded(dq_buffer);
  backward.dk = got.dk.view();
  backward.dv = got.dv.view();
  plan->backward(backward);
  HostTensor out(DType::kF64, inputs.q.shape()), dq(DType::kF64, inputs.q.shape());
  copy_into(as_padded(o_buffer), out.view());
  copy_into(as_padded(dq_buffer), dq.view());
  expect_close(out, want.out, "out");
  expect_close(dq, want.dq, "dq");
  expect_close(got.dk, want.dk, "dk");
  for (std::int64_t i = 0; i < o_buffer.numel(); ++i) {  // padding untouched
    const bool written = i % 24 < 16 && i % 8 < 4;       // (h < 2, d < 4) of each (b, s) row of 24
    if (!written) {
      EXPECT_EQ(o_buffer.at(i), 0.0) << i;
    }
  }

  ForwardArgs contiguous_args = forward;  // the plan refuses views of another signature
  contiguous_args.q = inputs.q.view();
  EXPECT_THROW(plan->forward(contiguous_args), Error);
}

TEST(CpuRef, TensorGradientsMatchFiniteDifferences) {
  ProblemDesc desc = make_desc(2, 2, 1, 6, 8, 4, 4, Layout::kBHSD);
  desc = test::catalogue_desc({"relative_bias", "causal"}, desc);
  desc.tensors["rel"].dtype = DType::kF64;  // fp64 so the finite-difference step is not rounded
  desc.tensors["gate"] = TensorDecl{DType::kF64, {2}};
  desc.score_mod = *desc.score_mod * sigmoid(load("gate", Type::kF32, {head()}));
  const Problem problem(desc);
  Inputs inputs = test::catalogue_inputs(problem, {"relative_bias"}, 17);
  inputs.tensors.at("rel") = inputs.tensors.at("rel").to(DType::kF64);
  const Outputs outputs = test::run_engine(cpu_ref(), problem, inputs);
  HostTensor& rel = inputs.tensors.at("rel");
  for (std::int64_t index : {std::int64_t{64}, std::int64_t{129 + 62}, std::int64_t{129 + 66}}) {
    EXPECT_NEAR(outputs.tensor_grads.at("rel").at(index),
                finite_difference(problem, inputs, rel, index), kFiniteDifferenceTolerance)
        << "rel " << index;
  }
  EXPECT_EQ(outputs.tensor_grads.at("rel").at(0), 0.0);  // bucket never reached: kv - q >= -5
  HostTensor& gate = inputs.tensors.at("gate");
  for (std::int64_t index : {0, 1}) {
    EXPECT_NEAR(outputs.tensor_grads.at("gate").at(index),
                finite_difference(problem, inputs, gate, index), kFiniteDifferenceTolerance);
  }
}

TEST(CpuRef, BackwardIsDeterministicAcrossThreadCounts) {
  ProblemDesc desc = make_desc(3, 4, 2, 20, 20, 8, 8, Layout::kBSHD);
  desc = test::catalogue_desc({"post_scale_bias"}, desc);
  const Problem problem(desc);
  const Inputs inputs = test::random_inputs(problem, 12);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Outputs serial = test::run_engine(cpu_ref(), problem, inputs);
  omp_set_num_threads(3);
  const Outputs parallel = test::run_engine(cpu_ref(), problem, inputs);
  omp_set_num_threads(threads);
  EXPECT_EQ(test::max_abs_error(parallel.out, serial.out), 0.0);
  EXPECT_EQ(test::max_abs_error(parallel.dk, serial.dk), 0.0);
  EXPECT_EQ(test::max_abs_error(parallel.tensor_grads.at("bias"), serial.tensor_grads.at("bias")),
            0.0);
}

TEST(CpuRef, SupportsEveryCpuProblemAndProvesItsModifier) {
  ProblemDesc desc = make_desc(1, 2, 2, 4, 4, 4, 4);
  desc = test::catalogue_desc({"alibi", "sliding_window"}, desc);
  const Problem problem(desc);
  EXPECT_TRUE(cpu_ref().supports(problem));
  EXPECT_EQ(cpu_ref().name(), "cpu_ref");
  const std::unique_ptr<Plan> plan = cpu_ref().plan(problem);
  EXPECT_EQ(plan->info().engine, "cpu_ref");
  EXPECT_EQ(plan->info().lowered_hash, problem.modifier_hash());
  EXPECT_EQ(plan->info().signature, problem.signature());
  EXPECT_FALSE(plan->info().description.empty());

  desc.device = Device::kCuda;
  const Problem on_gpu(desc);
  const Support verdict = cpu_ref().supports(on_gpu);
  EXPECT_FALSE(verdict);
  EXPECT_NE(verdict.reason().find("cuda"), std::string::npos) << verdict.reason();
  try {
    cpu_ref().plan(on_gpu);
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
    EXPECT_EQ(std::string(error.what()).rfind("cpu_ref: ", 0), 0u) << error.what();
  }
}

}  // namespace
}  // namespace flexattn
