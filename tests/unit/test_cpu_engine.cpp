// The `cpu` engine against the float64 reference `cpu_ref`: storage dtypes, layouts, lengths,
// head dims, GQA/MQA, modifiers and masks, forward and backward (including the gradients of
// learned tensors); determinism for any thread count; strided views; fully masked rows; tile
// skipping; and its place in engine selection.
//
// Tolerances:
// - Matrix cases go through conformance::run_case: the same inputs, rounded to the storage dtype,
//   for cpu, cpu_ref (float64) and a plain same-precision implementation; the allowed error is
//   twice the plain implementation's error plus one rounding of the largest output in its
//   dtype (docs/design.md section 5).
// - fp32 storage is also held to kFp32Relative of the float64 result, relative to the largest
//   output magnitude (at least 1): float32 accumulation over a few hundred keys and 64-80 dims
//   loses about 1e-6.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "engines/cpu/cpu.hpp"
#include "engines/cpu/plan.hpp"
#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/conformance.hpp"
#include "support/test_support.hpp"

namespace flexattn::test {
namespace {

using conformance::Case;
using conformance::Shape;

constexpr double kFp32Relative = 1e-5;

Case make_case(const Shape& shape, Layout layout, DType dtype, const std::string& modifier,
               const std::string& mask, bool backward) {
  Case c;
  c.shape = shape;
  c.layout = layout;
  c.dtype = dtype;
  c.modifier = modifier;
  c.mask = mask;
  c.backward = backward;
  c.name = std::string(to_string(dtype)) + "_" + std::string(to_string(layout)) + "_sq" +
           std::to_string(shape.seq_len_q) + "_skv" + std::to_string(shape.seq_len_kv) + "_hq" +
           std::to_string(shape.heads_q) + "_hkv" + std::to_string(shape.heads_kv) + "_d" +
           std::to_string(shape.head_dim_qk) + "_dv" + std::to_string(shape.head_dim_v) + "_" +
           modifier + "_" + mask + (backward ? "_bwd" : "_fwd");
  return c;
}

std::vector<Case> matrix_cases() {
  std::vector<Case> cases;
  // Every layout with every storage dtype: MQA, head_dim_v != head_dim_qk, seq_len_q !=
  // seq_len_kv, ragged thd batches; a modifier/mask pair that changes along the way.
  const Shape layout_shape{2, 4, 1, 33, 47, 80, 64};
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"softcap30", "causal"}, {"bias", "document"}, {"alibi", "window"}, {"gate", "emptyrows"}};
  std::size_t next = 0;
  for (Layout layout : {Layout::kBSHD, Layout::kSBHD, Layout::kBHSD, Layout::kTHD}) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      const auto& [modifier, mask] = pairs[next++ % pairs.size()];
      cases.push_back(make_case(layout_shape, layout, dtype, modifier, mask, true));
    }
  }
  // Lengths 1, 17, 100, 577; head dims 64 and 80; GQA 4:1 and MQA.
  cases.push_back(
      make_case({1, 4, 1, 1, 577, 64, 64}, Layout::kBSHD, DType::kBF16, "alibi", "causalbr", true));
  cases.push_back(
      make_case({2, 4, 4, 17, 17, 64, 64}, Layout::kBSHD, DType::kF16, "softcap5", "prefix", true));
  cases.push_back(make_case({1, 8, 2, 100, 100, 80, 80}, Layout::kBHSD, DType::kF32, "relbias",
                            "window", true));
  cases.push_back(make_case({1, 2, 2, 577, 577, 64, 64}, Layout::kBSHD, DType::kF32, "softcap30",
                            "causal", true));
  cases.push_back(make_case({1, 2, 1, 100, 17, 64, 80}, Layout::kSBHD, DType::kBF16, "piecewise",
                            "causalbr", true));
  // Every modifier, each with a different mask, in fp32.
  const std::vector<std::string> modifiers = {"none",    "softcap30", "softcap08", "bias",  "alibi",
                                              "relbias", "gate",      "piecewise", "neginf"};
  const std::vector<std::string> masks = {"none",     "causal", "causalbr", "window",
                                          "document", "prefix", "emptyrows"};
  for (std::size_t i = 0; i < modifiers.size(); ++i) {
    cases.push_back(make_case({1, 4, 2, 100, 77, 64, 64}, Layout::kBSHD, DType::kF32, modifiers[i],
                              masks[i % masks.size()], true));
  }
  return cases;
}

class CpuAgainstReference : public ::testing::TestWithParam<Case> {};

TEST_P(CpuAgainstReference, WithinTheToleranceRule) {
  const conformance::Outcome outcome = conformance::run_case(*make_cpu_engine(), GetParam());
  ASSERT_NE(outcome.status, conformance::Status::kSkipped) << outcome.reason;
  for (const conformance::OutputCheck& check : outcome.checks) {
    EXPECT_TRUE(check.guard_intact) << check.output << ": write outside the buffer";
    EXPECT_LE(check.max_error, check.allowed) << check.output;
  }
  EXPECT_EQ(outcome.status, conformance::Status::kPass) << outcome.reason;
}

std::string case_name(const ::testing::TestParamInfo<Case>& param) { return param.param.name; }

INSTANTIATE_TEST_SUITE_P(Matrix, CpuAgainstReference, ::testing::ValuesIn(matrix_cases()),
                         case_name);

// ---- float32 against float64 ----------------------------------------------------------------

ProblemDesc base_desc(std::int64_t seq_len_q, std::int64_t seq_len_kv) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = seq_len_q;
  desc.seq_len_kv = seq_len_kv;
  desc.head_dim_qk = 64;
  desc.head_dim_v = 80;
  desc.direction = Direction::kForwardBackward;
  return desc;
}

// A score modifier reading two learned tensors (bias and per-head slopes) under a causal mask.
ProblemDesc learned_tensors_desc() {
  ProblemDesc desc = base_desc(100, 77);
  desc.tensors["bias"] = TensorDecl{DType::kF32, {4, 100, 77}};
  desc.tensors["slopes"] = TensorDecl{DType::kF32, {4}};
  desc.score_mod = ir::parse("score + bias[h, q, kv] + slopes[h] * float(kv - q)", desc.scope());
  desc.mask_mod = ir::parse("q + (KV_LEN - Q_LEN) >= kv", desc.scope());
  return desc;
}

void expect_relative(const HostTensor& result, const HostTensor& reference, const char* what) {
  const double allowed = kFp32Relative * std::max(1.0, max_abs_value(reference));
  EXPECT_TRUE(within_tolerance(result, reference, allowed)) << what;
}

// The same inputs for cpu_ref in float64 (the modifier's tensors as they are).
Inputs in_float64(const Inputs& inputs32) {
  Inputs inputs64;
  inputs64.q = inputs32.q.to(DType::kF64);
  inputs64.k = inputs32.k.to(DType::kF64);
  inputs64.v = inputs32.v.to(DType::kF64);
  inputs64.dout = inputs32.dout.to(DType::kF64);
  for (const auto& [name, tensor] : inputs32.tensors) {
    inputs64.tensors.emplace(name, tensor.to(tensor.dtype()));
  }
  return inputs64;
}

// cpu and cpu_ref on the same fp32 inputs (cpu_ref in float64), every output within
// kFp32Relative. `positive_scores` makes every q and k element at least 1 (scores >= 1 at head
// dim 64), for modifiers that are singular at score 0.
void expect_matches_float64(const ProblemDesc& desc32, std::uint64_t seed,
                            bool positive_scores = false) {
  const Problem problem32(desc32);
  ProblemDesc desc64 = desc32;
  desc64.dtype = DType::kF64;
  const Problem problem64(desc64);
  Inputs inputs32 = random_inputs(problem32, seed);
  for (HostTensor* tensor : {&inputs32.q, &inputs32.k}) {
    const TensorView view = tensor->view();
    for (std::int64_t e = 0; positive_scores && e < view.numel(); ++e) {
      view.store(e, 1.0 + std::abs(view.load(e)));
    }
  }
  const Inputs inputs64 = in_float64(inputs32);
  const Outputs ours = run_engine(*make_cpu_engine(), problem32, inputs32);
  const Outputs reference = run_engine(*make_cpu_ref_engine(), problem64, inputs64);
  expect_relative(ours.out, reference.out, "out");
  expect_relative(ours.lse, reference.lse, "lse");
  if (!problem32.wants_backward()) return;
  expect_relative(ours.dq, reference.dq, "dq");
  expect_relative(ours.dk, reference.dk, "dk");
  expect_relative(ours.dv, reference.dv, "dv");
  for (const auto& [name, gradient] : reference.tensor_grads) {
    expect_relative(ours.tensor_grads.at(name), gradient, name.c_str());
  }
}

TEST(CpuFp32, WithinOneInAHundredThousandOfFloat64) {
  expect_matches_float64(learned_tensors_desc(), 3);
  ProblemDesc windowed = base_desc(130, 130);
  windowed.score_mod = ir::parse("30 * tanh(score / 30)");
  windowed.mask_mod = ir::parse("q >= kv && q - kv < 70");
  expect_matches_float64(windowed, 3);
}

// A tensor gradient whose derivative is a leaf: d(score * g[h]) / dg is the score itself (the
// tape's output is then the score leaf), d(score + g[h]) / dg the literal 1.
TEST(CpuFp32, TensorGradientsWhoseDerivativeIsALeaf) {
  for (const char* text :
       {"score * g[h]", "score * (g[h] + 0.25)", "score + g[h]", "g[h]", "score * g[h] * g[h]"}) {
    ProblemDesc desc = base_desc(33, 47);
    desc.tensors["g"] = TensorDecl{DType::kF32, {4}};
    desc.score_mod = ir::parse(text, desc.scope());
    SCOPED_TRACE(text);
    expect_matches_float64(desc, 5);
  }
}

// Query lengths that are not a multiple of the vector width leave padding lanes in the last
// query tile, where the modifier sees a dummy score (0 here: 1 / score is inf). Scores of the
// real queries are at least 1, so the problem is well conditioned.
TEST(CpuFp32, PaddingLanesNeverReachTheGradients) {
  for (std::int64_t seq_len_q : {8, 16, 17, 33, 40, 129}) {
    ProblemDesc desc = base_desc(seq_len_q, 47);
    desc.score_mod = ir::parse("1 / score");
    SCOPED_TRACE(seq_len_q);
    expect_matches_float64(desc, 7, true);
  }
}

// Ragged thd batches, including a sequence with no queries and one with no keys (its queries
// keep nothing: O = 0, LSE = -inf, no gradient).
TEST(CpuFp32, RaggedThdWithEmptySequences) {
  ProblemDesc desc = base_desc(0, 0);
  desc.batch = 3;
  desc.layout = Layout::kTHD;
  desc.cu_seqlens_q = {0, 70, 70, 79};
  desc.cu_seqlens_kv = {0, 4, 7, 7};
  desc.score_mod = ir::parse("score * 0.5 + float(kv - Q_LEN) * 0.125");
  desc.mask_mod = ir::parse("kv <= q");
  expect_matches_float64(desc, 13);
}

// ---- non-finite values and out-of-range integers: the same on cpu and cpu_ref ------------------

// Elementwise: NaN exactly where the reference has NaN, infinities equal, finite values within
// kFp32Relative of the reference's largest finite value.
void expect_same_values(const HostTensor& result, const HostTensor& reference, const char* what) {
  const TensorView got = result.view(), want = reference.view();
  ASSERT_EQ(got.numel(), want.numel()) << what;
  double largest = 1.0;
  for (std::int64_t e = 0; e < want.numel(); ++e) {
    if (std::isfinite(want.load(e))) largest = std::max(largest, std::abs(want.load(e)));
  }
  int mismatches = 0;
  for (std::int64_t e = 0; e < want.numel(); ++e) {
    const double a = got.load(e), b = want.load(e);
    const bool same = std::isnan(b)   ? std::isnan(a)
                      : std::isinf(b) ? a == b
                                      : std::abs(a - b) <= kFp32Relative * largest;
    if (!same && mismatches++ < 3) ADD_FAILURE() << what << "[" << e << "]: " << a << " vs " << b;
  }
  EXPECT_EQ(mismatches, 0) << what;
}

void expect_same_as_reference(const ProblemDesc& desc32, const Inputs& inputs32) {
  ProblemDesc desc64 = desc32;
  desc64.dtype = DType::kF64;
  const Inputs inputs64 = in_float64(inputs32);
  const Outputs ours = run_engine(*make_cpu_engine(), Problem(desc32), inputs32);
  const Outputs reference = run_engine(*make_cpu_ref_engine(), Problem(desc64), inputs64);
  expect_same_values(ours.out, reference.out, "out");
  expect_same_values(ours.lse, reference.lse, "lse");
  expect_same_values(ours.dq, reference.dq, "dq");
  expect_same_values(ours.dk, reference.dk, "dk");
  expect_same_values(ours.dv, reference.dv, "dv");
}

// A modifier value past float32's range is +-inf on every engine: the IR's f32 is float32, and
// cpu_ref (which computes in float64) applies float32's range to every f32 value. `score + 1e39`
// is `score + inf` (every logit +inf: NaN rows); `score * 1e20 * 1e20` overflows for most scores.
TEST(CpuSemantics, ModifierOverflowIsTheSameAsTheReference) {
  for (const char* text :
       {"score + 1e39", "score * 1e20 * 1e20", "where(kv == 3, score * 1e39, score)"}) {
    ProblemDesc desc = base_desc(33, 47);
    desc.score_mod = ir::parse(text, desc.scope());
    SCOPED_TRACE(text);
    expect_same_as_reference(desc, random_inputs(Problem(desc), 17));
  }
}

// An int64 tensor element becomes i32 by two's-complement wrap on every engine (as every i32
// operation wraps): document ids 2^32 x (i % 2) + i / 16 are the ids i / 16 (cpu_ref kept the
// int64 values, so odd and even positions fell into different documents).
TEST(CpuSemantics, Int64ElementsWrapToI32AsOnEveryEngine) {
  ProblemDesc desc = base_desc(64, 64);
  desc.tensors["doc"] = TensorDecl{DType::kI64, {64}};
  desc.mask_mod = ir::parse("doc[q] == doc[kv]", desc.scope());
  desc.score_mod = ir::parse("score + float(doc[kv]) * 0.125", desc.scope());
  Inputs inputs = random_inputs(Problem(desc), 19);
  HostTensor doc(DType::kI64, {64});
  for (std::int64_t i = 0; i < 64; ++i) {
    static_cast<std::int64_t*>(doc.data())[i] = (std::int64_t{1} << 32) * (i % 2) + i / 16;
  }
  inputs.tensors.insert_or_assign("doc", std::move(doc));
  expect_same_as_reference(desc, inputs);
}

// A masked position never contributes, whatever its value (no 0 * NaN), and a non-finite value
// in a kept position reaches exactly what cpu_ref's arithmetic reaches (docs/design.md,
// "Non-finite values"). Each case plants one value in batch 0, kv head 1 (query heads 2 and 3)
// under a causal mask, so the planted key (40) is masked for queries 0..39 and kept for the rest,
// and the planted query row (10) keeps keys 0..10 only. The plain problem runs the fused backward
// where the threads allow; the learned-tensor one the key and query passes with the statistics
// pass (as 16-bit storage does).
void plant(HostTensor& tensor, std::int64_t token, std::int64_t head, double value) {
  const TensorView view = tensor.view();  // (batch, seq, heads, dim)
  ASSERT_EQ(view.shape.size(), 4u);
  for (std::int64_t d = 0; d < view.shape[3]; d += 7) {
    view.store(token * view.strides[1] + head * view.strides[2] + d * view.strides[3], value);
  }
}

TEST(CpuSemantics, MaskedNonFiniteValuesNeverContribute) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Planted {
    const char* name;
    HostTensor Inputs::*tensor;
    std::int64_t token, head;
    double value;
  };
  const Planted planted[] = {{"v key 40 NaN", &Inputs::v, 40, 1, nan},
                             {"v key 40 -inf", &Inputs::v, 40, 1, -inf},
                             {"k key 40 +inf", &Inputs::k, 40, 1, inf},
                             {"q row 10 NaN", &Inputs::q, 10, 3, nan},
                             {"dout row 10 NaN", &Inputs::dout, 10, 2, nan}};
  ProblemDesc plain = base_desc(100, 77);
  plain.mask_mod = ir::parse("kv <= q");
  ProblemDesc learned = learned_tensors_desc();
  learned.mask_mod = ir::parse("kv <= q");
  // -inf from the score modifier removes a position like the mask does.
  ProblemDesc minus_infinity = base_desc(100, 77);
  minus_infinity.score_mod = ir::parse("where(kv > q, -inf, score)");
  const std::pair<const char*, ProblemDesc> problems[] = {
      {"causal", plain}, {"causal, learned tensors", learned}, {"-inf modifier", minus_infinity}};
  for (const auto& [problem_name, desc] : problems) {
    for (const Planted& p : planted) {
      SCOPED_TRACE(std::string(problem_name) + ", " + p.name);
      Inputs inputs = random_inputs(Problem(desc), 23);
      plant(inputs.*p.tensor, p.token, p.head, p.value);
      expect_same_as_reference(desc, inputs);
    }
  }
}

// ---- determinism ------------------------------------------------------------------------------

bool bit_identical(const HostTensor& a, const HostTensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// With learned tensors the backward runs a key pass and a query pass; without, it fuses them
// when there are at least two (batch, kv head) items per thread: 1 and 2 threads fuse, 3 do not,
// and all must agree bit for bit.
TEST(CpuDeterminism, GradientsAreBitIdenticalForAnyThreadCount) {
  ProblemDesc plain = base_desc(100, 77);
  plain.score_mod = ir::parse("30 * tanh(score / 30)");
  plain.mask_mod = ir::parse("q >= kv");
  for (const ProblemDesc& desc : {learned_tensors_desc(), plain}) {
    const Problem problem(desc);
    const Inputs inputs = random_inputs(problem, 5);
    const int threads = omp_get_max_threads();
    std::vector<Outputs> runs;
    for (int count : {1, 2, 2, 3}) {
      omp_set_num_threads(count);
      runs.push_back(run_engine(*make_cpu_engine(), problem, inputs));
    }
    omp_set_num_threads(threads);
    for (std::size_t i = 1; i < runs.size(); ++i) {
      EXPECT_TRUE(bit_identical(runs[i].out, runs[0].out)) << "run " << i;
      EXPECT_TRUE(bit_identical(runs[i].dq, runs[0].dq)) << "run " << i;
      EXPECT_TRUE(bit_identical(runs[i].dk, runs[0].dk)) << "run " << i;
      EXPECT_TRUE(bit_identical(runs[i].dv, runs[0].dv)) << "run " << i;
      for (const auto& [name, gradient] : runs[0].tensor_grads) {
        EXPECT_TRUE(bit_identical(runs[i].tensor_grads.at(name), gradient)) << name << " run " << i;
      }
    }
  }
}

// ---- semantics details ------------------------------------------------------------------------

TEST(CpuSemantics, FullyMaskedRowsGiveZeroOutputAndMinusInfinityLse) {
  ProblemDesc desc = base_desc(70, 70);
  desc.mask_mod = ir::parse("q >= 5 && kv <= q");
  desc.score_mod = ir::parse("where(kv == 0, -inf, score)");  // -inf acts as a mask
  const Problem problem(desc);
  const Inputs inputs = random_inputs(problem, 7);
  const Outputs outputs = run_engine(*make_cpu_engine(), problem, inputs);
  const std::int64_t dim_v = problem.head_dim_v(), dim_qk = problem.head_dim_qk();
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::int64_t h = 0; h < 4; ++h) {
      for (std::int64_t q = 0; q < 70; ++q) {
        const double lse = outputs.lse.at((b * 4 + h) * 70 + q);
        if (q > 5) {
          EXPECT_TRUE(std::isfinite(lse)) << q;
          continue;
        }
        // Rows 0-4 keep nothing; row 5 keeps only kv 0..5 minus the -inf at kv 0.
        if (q == 5) continue;
        EXPECT_EQ(lse, -std::numeric_limits<double>::infinity()) << q;
        for (std::int64_t d = 0; d < dim_v; ++d) {
          EXPECT_EQ(outputs.out.at(((b * 70 + q) * 4 + h) * dim_v + d), 0.0);
        }
        for (std::int64_t d = 0; d < dim_qk; ++d) {
          EXPECT_EQ(outputs.dq.at(((b * 70 + q) * 4 + h) * dim_qk + d), 0.0);
        }
      }
    }
  }
}

// Views with gaps between rows and heads (any strides with a unit last stride) give the same
// result as contiguous ones.
TEST(CpuSemantics, StridedViewsMatchContiguousOnes) {
  ProblemDesc contiguous = base_desc(40, 50);
  contiguous.direction = Direction::kForward;
  contiguous.score_mod = ir::parse("30 * tanh(score / 30)");
  const Problem plain(contiguous);
  const Inputs inputs = random_inputs(plain, 11);
  const Outputs expected = run_engine(*make_cpu_engine(), plain, inputs);

  // bshd with padded heads (+3) and padded dims (+5): strides (S*H', H'*D', D', 1).
  ProblemDesc strided = contiguous;
  const auto padded = [](const HostTensor& tensor, std::vector<std::int64_t>& strides) {
    const std::vector<std::int64_t>& shape = tensor.shape();
    const std::int64_t dim = shape[3] + 5, heads = shape[2] + 3;
    strides = {shape[1] * heads * dim, heads * dim, dim, 1};
    HostTensor storage(tensor.dtype(), {shape[0] * shape[1] * heads * dim});
    for (std::int64_t b = 0; b < shape[0]; ++b) {
      for (std::int64_t s = 0; s < shape[1]; ++s) {
        for (std::int64_t h = 0; h < shape[2]; ++h) {
          for (std::int64_t d = 0; d < shape[3]; ++d) {
            storage.set(b * strides[0] + s * strides[1] + h * strides[2] + d,
                        tensor.at(((b * shape[1] + s) * shape[2] + h) * shape[3] + d));
          }
        }
      }
    }
    return storage;
  };
  std::vector<std::int64_t> q_strides, k_strides, v_strides, o_strides;
  const HostTensor q = padded(inputs.q, q_strides), k = padded(inputs.k, k_strides);
  const HostTensor v = padded(inputs.v, v_strides);
  HostTensor out = padded(expected.out, o_strides);
  strided.q_strides = q_strides;
  strided.k_strides = k_strides;
  strided.v_strides = v_strides;
  strided.o_strides = o_strides;
  const Problem problem(strided);
  const auto view_of = [&](const HostTensor& storage, std::string_view which) {
    TensorView view = problem.expected(which);
    view.data = const_cast<void*>(storage.data());
    return view;
  };
  HostTensor lse(DType::kF32, problem.expected("lse").shape);
  std::memset(out.data(), 0, out.bytes());
  ForwardArgs args{
      view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), view_of(out, "o"), lse.view(), {},
      nullptr};
  make_cpu_engine()->plan(problem)->forward(args);
  std::vector<std::int64_t> ignored;
  EXPECT_TRUE(bit_identical(out, padded(expected.out, ignored)));
  EXPECT_TRUE(bit_identical(lse, expected.lse));
}

TEST(CpuPlan, SkipsTilesTheMaskProvesEmptyAndProvesItsModifier) {
  ProblemDesc desc = base_desc(256, 256);
  desc.mask_mod = ir::parse("q >= kv");
  const Problem problem(desc);
  const auto plan = make_cpu_engine()->plan(problem);
  EXPECT_EQ(plan->info().lowered_hash, problem.modifier_hash());
  EXPECT_EQ(plan->info().signature, problem.signature());
  // A causal tile is skipped when every query precedes every key, unmasked when every query
  // follows every key, mixed otherwise.
  const cpu::TileSizes tiles = cpu::choose_tile_sizes(problem);
  int skipped = 0, unmasked = 0, mixed = 0;
  for (std::int64_t q0 = 0; q0 < 256; q0 += tiles.block_q) {
    for (std::int64_t k0 = 0; k0 < 256; k0 += tiles.block_k) {
      const std::int64_t q_last = std::min<std::int64_t>(256, q0 + tiles.block_q) - 1;
      const std::int64_t k_last = std::min<std::int64_t>(256, k0 + tiles.block_k) - 1;
      if (q_last < k0) {
        ++skipped;
      } else if (q0 >= k_last) {
        ++unmasked;
      } else {
        ++mixed;
      }
    }
  }
  EXPECT_GT(skipped, 0);
  const std::string expected = "tiles skipped " + std::to_string(skipped) + " / unmasked " +
                               std::to_string(unmasked) + " / mixed " + std::to_string(mixed);
  EXPECT_NE(plan->info().description.find(expected), std::string::npos)
      << plan->info().description << " lacks " << expected;
}

TEST(CpuSelection, RanksAboveCpuRefAndLeavesFloat64ToIt) {
  ContextOptions options;
  options.policy = Policy{};
  Context context(options);
  ProblemDesc desc = base_desc(17, 17);
  EXPECT_EQ(context.select(Problem(desc))->info().engine, "cpu");
  desc.dtype = DType::kF64;
  const Problem float64(desc);
  const Support support = make_cpu_engine()->supports(float64);
  EXPECT_FALSE(support.ok());
  EXPECT_NE(support.reason().find("fp64"), std::string::npos) << support.reason();
  EXPECT_EQ(context.select(float64)->info().engine, "cpu_ref");
}

}  // namespace
}  // namespace flexattn::test
