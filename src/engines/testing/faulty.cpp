// The planted faulty engines (testing.hpp): plain float64 attention that honours the mask but
// ignores the score modifier, exactly the failure of DESIGN.md section 1. They differ only in the
// hash they report: the dropping engine reports the hash of what it lowered (so the plan proof
// refuses it), the lying one reports the requested hash (so only a comparison catches it).
// Test fixtures: a straightforward loop, forward only.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"
#include "flexattn/testing.hpp"

namespace flexattn::testing {

namespace {

constexpr double kNegativeInfinity = -std::numeric_limits<double>::infinity();

enum class Claim { kHonest, kLying };

// Element offset of row (b, h, s) of a Q/K/V/O-like view in `layout`.
std::int64_t row_offset(const TensorView& view, Layout layout,
                        const std::vector<std::int64_t>& offsets, std::int64_t b, std::int64_t h,
                        std::int64_t s) {
  const std::vector<std::int64_t>& st = view.strides;
  switch (layout) {
    case Layout::kBSHD:
      return b * st[0] + s * st[1] + h * st[2];
    case Layout::kSBHD:
      return s * st[0] + b * st[1] + h * st[2];
    case Layout::kBHSD:
      return b * st[0] + h * st[1] + s * st[2];
    case Layout::kTHD:
      return (offsets[static_cast<std::size_t>(b)] + s) * st[0] + h * st[1];
  }
  return 0;
}

class FaultyPlan final : public Plan {
 public:
  FaultyPlan(PlanInfo info, Problem problem)
      : Plan(std::move(info)), problem_(std::move(problem)) {}
  const Problem& problem() const override { return problem_; }

 protected:
  void run_forward(const ForwardArgs& args) const override;
  void run_backward(const BackwardArgs&) const override {
    throw_unsupported(fmt::format("{}: forward only", info().engine));
  }

 private:
  Problem problem_;
};

void FaultyPlan::run_forward(const ForwardArgs& args) const {
  const ProblemDesc& d = problem_.desc();
  Bindings bindings;
  bindings.params = d.params;
  bindings.tensors = args.tensors;
  const Graph& mask = problem_.mask_mod();
  const std::int64_t group = d.heads_q / d.heads_kv;
  std::vector<double> scores;
  for (std::int64_t b = 0; b < d.batch; ++b) {
    const std::int64_t q_len = problem_.seq_len_q_of(b);
    const std::int64_t kv_len = problem_.seq_len_kv_of(b);
    for (std::int64_t h = 0; h < d.heads_q; ++h) {
      const std::int64_t h_kv = h / group;
      for (std::int64_t q = 0; q < q_len; ++q) {
        const std::int64_t q_row = row_offset(args.q, d.layout, d.cu_seqlens_q, b, h, q);
        scores.assign(static_cast<std::size_t>(kv_len), kNegativeInfinity);
        double max = kNegativeInfinity;
        for (std::int64_t kv = 0; kv < kv_len; ++kv) {
          EvalPoint at{0.0, b, h, q, kv, q_len, kv_len};
          if (evaluate(mask, at, bindings) == 0.0) continue;
          const std::int64_t k_row = row_offset(args.k, d.layout, d.cu_seqlens_kv, b, h_kv, kv);
          double dot = 0.0;
          for (std::int64_t i = 0; i < d.head_dim_qk; ++i) {
            dot += args.q.load(q_row + i) * args.k.load(k_row + i);
          }
          // The fault: the score modifier is never applied.
          scores[static_cast<std::size_t>(kv)] = problem_.scale() * dot;
          max = std::max(max, scores[static_cast<std::size_t>(kv)]);
        }
        double sum = 0.0;
        std::vector<double> out(static_cast<std::size_t>(d.head_dim_v), 0.0);
        if (max != kNegativeInfinity) {
          for (std::int64_t kv = 0; kv < kv_len; ++kv) {
            const double weight = std::exp(scores[static_cast<std::size_t>(kv)] - max);
            if (weight == 0.0) continue;
            sum += weight;
            const std::int64_t v_row = row_offset(args.v, d.layout, d.cu_seqlens_kv, b, h_kv, kv);
            for (std::int64_t i = 0; i < d.head_dim_v; ++i) {
              out[static_cast<std::size_t>(i)] += weight * args.v.load(v_row + i);
            }
          }
        }
        const std::int64_t o_row = row_offset(args.out, d.layout, d.cu_seqlens_q, b, h, q);
        for (std::int64_t i = 0; i < d.head_dim_v; ++i) {
          args.out.store(o_row + i, sum > 0.0 ? out[static_cast<std::size_t>(i)] / sum : 0.0);
        }
        if (!args.lse.empty()) {
          const double lse = sum > 0.0 ? max + std::log(sum) : kNegativeInfinity;
          const std::int64_t offset =
              d.layout == Layout::kTHD
                  ? h * args.lse.strides[0] +
                        (d.cu_seqlens_q[static_cast<std::size_t>(b)] + q) * args.lse.strides[1]
                  : b * args.lse.strides[0] + h * args.lse.strides[1] + q * args.lse.strides[2];
          args.lse.store(offset, lse);
        }
      }
    }
  }
}

class FaultyEngine final : public Engine {
 public:
  FaultyEngine(std::string_view name, Claim claim) : name_(name), claim_(claim) {}
  std::string_view name() const override { return name_; }
  Support available() const override { return Support::yes(); }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    if (problem.wants_backward()) {
      result.support = Support::no("forward only");
      return result;
    }
    result.support = Support::yes();
    if (stage == Stage::kCheck) return result;
    PlanInfo info;
    info.engine = name_;
    // What it really lowered: the identity score modifier and the problem's mask.
    const std::uint64_t lowered =
        modifier_hash(Graph::identity_score(), problem.mask_mod(), problem.scale());
    info.lowered_hash = claim_ == Claim::kHonest ? lowered : problem.modifier_hash();
    info.description = claim_ == Claim::kHonest
                           ? "test fixture: plain float64 attention that drops the score "
                             "modifier and reports the hash of what it lowered"
                           : "test fixture: plain float64 attention that drops the score "
                             "modifier and claims the requested hash";
    info.signature = problem.signature();
    result.plan = std::make_unique<FaultyPlan>(std::move(info), problem);
    return result;
  }

 private:
  std::string name_;
  Claim claim_;
};

}  // namespace

std::shared_ptr<const Engine> make_dropping_engine() {
  return std::make_shared<FaultyEngine>("faulty_drop_mod", Claim::kHonest);
}

std::shared_ptr<const Engine> make_lying_engine() {
  return std::make_shared<FaultyEngine>("faulty_lying_hash", Claim::kLying);
}

std::vector<std::shared_ptr<const Engine>> planted_faulty_engines() {
  return {make_dropping_engine(), make_lying_engine()};
}

}  // namespace flexattn::testing
