// The plain same-precision attention of the conformance runner: one query row at a time,
// rounding exactly where a plain implementation in the storage dtype rounds.
#include <cmath>
#include <limits>
#include <vector>

#include "check/check_internal.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::conformance::detail {

std::int64_t LayoutIndex::offset(const TensorView& view, bool query_side, std::int64_t b,
                                 std::int64_t head, std::int64_t position, std::int64_t d) const {
  const std::vector<std::int64_t>& st = view.strides;
  switch (problem_.layout()) {
    case Layout::kBSHD:
      return b * st[0] + position * st[1] + head * st[2] + d * st[3];
    case Layout::kSBHD:
      return position * st[0] + b * st[1] + head * st[2] + d * st[3];
    case Layout::kBHSD:
      return b * st[0] + head * st[1] + position * st[2] + d * st[3];
    case Layout::kTHD: {
      const auto& cu = query_side ? problem_.desc().cu_seqlens_q : problem_.desc().cu_seqlens_kv;
      return (cu[static_cast<std::size_t>(b)] + position) * st[0] + head * st[1] + d * st[2];
    }
  }
  throw_internal("unknown layout");
}

std::int64_t LayoutIndex::lse_offset(std::int64_t b, std::int64_t head,
                                     std::int64_t position) const {
  if (problem_.layout() == Layout::kTHD) {
    const auto& cu = problem_.desc().cu_seqlens_q;
    return head * problem_.total_tokens_q() + cu[static_cast<std::size_t>(b)] + position;
  }
  return (b * problem_.heads_q() + head) * problem_.seq_len_q() + position;
}

namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Rounds an fp32 value to the storage dtype (and back to fp32).
float round_to(DType dtype, float value) {
  switch (dtype) {
    case DType::kF16:
      return to_float(to_half(value));
    case DType::kBF16:
      return to_float(to_bfloat16(value));
    case DType::kF64:
    case DType::kF32:
    case DType::kI32:
    case DType::kI64:
      return value;
  }
  return value;
}

// Everything one query row needs: its modified scores, kept flags and probabilities.
struct Row {
  std::vector<float> score;  // modified score s' (fp32); -inf where not kept
  std::vector<float> raw;    // scale * dot (fp32), before the modifier
  std::vector<float> prob;   // softmax over kept keys (fp32)
  float lse = kNegativeInfinity;
};

class PlainAttention {
 public:
  PlainAttention(const Problem& problem, const std::map<std::string, TensorView>& tensors)
      : problem_(problem), index_(problem) {
    bindings_.params = problem.desc().params;
    bindings_.tensors = tensors;
  }

  // Fills `row` for (b, h, query position).
  void compute_row(const ForwardArgs& in, std::int64_t b, std::int64_t h, std::int64_t position,
                   Row& row, std::vector<double>& scratch) const {
    const std::int64_t group = problem_.heads_q() / problem_.heads_kv();
    const std::int64_t h_kv = h / group;
    const std::int64_t q_len = problem_.seq_len_q_of(b);
    const std::int64_t kv_len = key_length(in, b);
    row.score.assign(static_cast<std::size_t>(kv_len), kNegativeInfinity);
    row.raw.assign(static_cast<std::size_t>(kv_len), 0.0f);
    row.prob.assign(static_cast<std::size_t>(kv_len), 0.0f);
    const float scale = static_cast<float>(problem_.scale());
    EvalPoint point;
    point.batch = b;
    point.head = h;
    point.query = query_offset(in, b) + position;
    point.query_length = q_len;
    point.key_length = kv_len;
    float row_max = kNegativeInfinity;
    for (std::int64_t kv = 0; kv < kv_len; ++kv) {
      point.key = kv;
      if (evaluate(problem_.mask_mod(), point, bindings_) == 0.0) continue;
      float dot = 0.0f;
      for (std::int64_t d = 0; d < problem_.head_dim_qk(); ++d) {
        dot += static_cast<float>(in.q.load(index_.offset(in.q, true, b, h, position, d))) *
               static_cast<float>(in.k.load(key_offset(in, in.k, b, h_kv, kv, d)));
      }
      const float raw = scale * dot;
      point.score = raw;
      evaluate_all(problem_.score_mod(), point, bindings_, scratch);
      const float modified =
          static_cast<float>(scratch[static_cast<std::size_t>(problem_.score_mod().root())]);
      row.raw[static_cast<std::size_t>(kv)] = raw;
      row.score[static_cast<std::size_t>(kv)] = modified;
      if (modified > row_max) row_max = modified;
    }
    if (row_max == kNegativeInfinity) {
      row.lse = kNegativeInfinity;  // no kept key: O = 0, LSE = -inf
      return;
    }
    float sum = 0.0f;
    for (std::size_t kv = 0; kv < row.score.size(); ++kv) {
      const float p = row.score[kv] == kNegativeInfinity ? 0.0f : std::exp(row.score[kv] - row_max);
      row.prob[kv] = p;
      sum += p;
    }
    for (float& p : row.prob) p /= sum;
    row.lse = row_max + std::log(sum);
  }

  void forward(const ForwardArgs& args) const {
    const DType dtype = problem_.dtype();
    const std::int64_t dv = problem_.head_dim_v();
    const std::int64_t group = problem_.heads_q() / problem_.heads_kv();
    const std::int64_t rows = problem_.batch() * problem_.heads_q();
#pragma omp parallel for schedule(dynamic)
    for (std::int64_t bh = 0; bh < rows; ++bh) {
      const std::int64_t b = bh / problem_.heads_q();
      const std::int64_t h = bh % problem_.heads_q();
      Row row;
      std::vector<double> scratch;
      std::vector<float> acc(static_cast<std::size_t>(dv));
      for (std::int64_t position = 0; position < problem_.seq_len_q_of(b); ++position) {
        compute_row(args, b, h, position, row, scratch);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (std::size_t kv = 0; kv < row.prob.size(); ++kv) {
          const float p = round_to(dtype, row.prob[kv]);
          if (p == 0.0f) continue;
          for (std::int64_t d = 0; d < dv; ++d) {
            acc[static_cast<std::size_t>(d)] +=
                p * static_cast<float>(args.v.load(
                        key_offset(args, args.v, b, h / group, static_cast<std::int64_t>(kv), d)));
          }
        }
        for (std::int64_t d = 0; d < dv; ++d) {
          args.out.store(index_.offset(args.out, true, b, h, position, d),
                         round_to(dtype, acc[static_cast<std::size_t>(d)]));
        }
        if (!args.lse.empty()) args.lse.store(index_.lse_offset(b, h, position), row.lse);
      }
    }
  }

  // magnitudes: plain_backward_magnitudes instead of the gradients.
  void backward(const BackwardArgs& args, bool magnitudes) const;
  // plain_backward_rounding_sigma.
  void rounding_sigma(const BackwardArgs& args) const;

 private:
  // A KV cache's run: sequence b's length from cache_lens, its queries at the cache's end, its
  // keys through the page table.
  std::int64_t key_length(const ForwardArgs& in, std::int64_t b) const {
    return problem_.kv_cache() ? in.cache_lens.load_index(b) : problem_.seq_len_kv_of(b);
  }
  std::int64_t query_offset(const ForwardArgs& in, std::int64_t b) const {
    const std::int64_t length = problem_.kv_cache() ? in.cache_lens.load_index(b) : 0;
    return length == 0 ? 0 : length - problem_.seq_len_q_of(b);
  }
  std::int64_t key_offset(const ForwardArgs& in, const TensorView& view, std::int64_t b,
                          std::int64_t h_kv, std::int64_t kv, std::int64_t d) const {
    if (!problem_.kv_cache()) return index_.offset(view, false, b, h_kv, kv, d);
    const KvCacheDesc& cache = *problem_.kv_cache();
    const std::int64_t page = in.page_table.load_index(b * cache.max_pages + kv / cache.page_size);
    const std::vector<std::int64_t>& st = view.strides;
    return page * st[0] + (kv % cache.page_size) * st[1] + h_kv * st[2] + d * st[3];
  }

  const Problem& problem_;
  LayoutIndex index_;
  Bindings bindings_;
};

// Backward, parallel over (b, kv head) so dK/dV of a group are owned by one thread; dQ rows are
// owned by their (b, h); tensor gradients are reduced per thread then summed in a fixed order.
void PlainAttention::backward(const BackwardArgs& args, bool magnitudes) const {
  const DType dtype = problem_.dtype();
  // The magnitudes: every term by its absolute value, nothing rounded to the storage dtype.
  const auto term = [magnitudes](float value) { return magnitudes ? std::fabs(value) : value; };
  const auto stored = [magnitudes, dtype](float value) {
    return magnitudes ? value : round_to(dtype, value);
  };
  const std::int64_t dqk = problem_.head_dim_qk();
  const std::int64_t dv = problem_.head_dim_v();
  const std::int64_t group = problem_.heads_q() / problem_.heads_kv();
  const float scale = static_cast<float>(problem_.scale());
  const Graph d_score = derivative_wrt_score(problem_.score_mod());
  const std::vector<LoadDerivative> d_tensors = derivatives_wrt_tensors(problem_.score_mod());
  const std::int64_t groups = problem_.batch() * problem_.heads_kv();

  // Per-group tensor-gradient partials, summed in group order afterwards (deterministic).
  std::vector<std::map<std::string, std::vector<double>>> partials(
      static_cast<std::size_t>(groups));
  ForwardArgs in;
  in.q = args.q;
  in.k = args.k;
  in.v = args.v;

#pragma omp parallel for schedule(dynamic)
  for (std::int64_t g = 0; g < groups; ++g) {
    const std::int64_t b = g / problem_.heads_kv();
    const std::int64_t h_kv = g % problem_.heads_kv();
    const std::int64_t kv_len = problem_.seq_len_kv_of(b);
    std::vector<float> dk(static_cast<std::size_t>(kv_len * dqk), 0.0f);
    std::vector<float> dvv(static_cast<std::size_t>(kv_len * dv), 0.0f);
    auto& partial = partials[static_cast<std::size_t>(g)];
    for (const auto& [name, grad] : args.tensor_grads) {
      partial[name].assign(static_cast<std::size_t>(grad.numel()), 0.0);
    }
    Row row;
    std::vector<double> scratch;
    std::vector<float> dq(static_cast<std::size_t>(dqk));
    for (std::int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h) {
      for (std::int64_t position = 0; position < problem_.seq_len_q_of(b); ++position) {
        compute_row(in, b, h, position, row, scratch);
        std::fill(dq.begin(), dq.end(), 0.0f);
        if (row.lse != kNegativeInfinity) {
          // D = rowsum(dO * O)
          float delta = 0.0f;
          for (std::int64_t d = 0; d < dv; ++d) {
            delta += term(static_cast<float>(
                              args.dout.load(index_.offset(args.dout, true, b, h, position, d))) *
                          static_cast<float>(
                              args.out.load(index_.offset(args.out, true, b, h, position, d))));
          }
          EvalPoint point;
          point.batch = b;
          point.head = h;
          point.query = position;
          point.query_length = problem_.seq_len_q_of(b);
          point.key_length = kv_len;
          for (std::int64_t kv = 0; kv < kv_len; ++kv) {
            const float p = row.prob[static_cast<std::size_t>(kv)];
            if (p == 0.0f) continue;
            float dp = 0.0f;
            for (std::int64_t d = 0; d < dv; ++d) {
              const float dout = static_cast<float>(
                  args.dout.load(index_.offset(args.dout, true, b, h, position, d)));
              dp += term(dout * static_cast<float>(
                                    args.v.load(index_.offset(args.v, false, b, h_kv, kv, d))));
              dvv[static_cast<std::size_t>(kv * dv + d)] += stored(p) * term(dout);
            }
            const float ds_modified = p * (magnitudes ? dp + delta : dp - delta);
            point.key = kv;
            point.score = row.raw[static_cast<std::size_t>(kv)];
            const float ds =
                stored(ds_modified * term(static_cast<float>(evaluate(d_score, point, bindings_))));
            for (std::int64_t d = 0; d < dqk; ++d) {
              dq[static_cast<std::size_t>(d)] +=
                  ds * term(static_cast<float>(
                           args.k.load(index_.offset(args.k, false, b, h_kv, kv, d))));
              dk[static_cast<std::size_t>(kv * dqk + d)] +=
                  ds * term(static_cast<float>(
                           args.q.load(index_.offset(args.q, true, b, h, position, d))));
            }
            for (const LoadDerivative& load : d_tensors) {
              auto found = partial.find(load.tensor);
              if (found == partial.end()) continue;
              const TensorView& grad = args.tensor_grads.at(load.tensor);
              std::int64_t flat = 0;
              for (std::size_t i = 0; i < load.indices.size(); ++i) {
                const auto at =
                    static_cast<std::int64_t>(evaluate(load.indices[i], point, bindings_));
                flat = flat * grad.shape[i] + at;
              }
              const double derivative = evaluate(load.derivative, point, bindings_);
              found->second[static_cast<std::size_t>(flat)] +=
                  static_cast<double>(ds_modified) *
                  (magnitudes ? std::fabs(derivative) : derivative);
            }
          }
        }
        for (std::int64_t d = 0; d < dqk; ++d) {
          args.dq.store(index_.offset(args.dq, true, b, h, position, d),
                        stored(scale * dq[static_cast<std::size_t>(d)]));
        }
      }
    }
    for (std::int64_t kv = 0; kv < kv_len; ++kv) {
      for (std::int64_t d = 0; d < dqk; ++d) {
        args.dk.store(index_.offset(args.dk, false, b, h_kv, kv, d),
                      stored(scale * dk[static_cast<std::size_t>(kv * dqk + d)]));
      }
      for (std::int64_t d = 0; d < dv; ++d) {
        args.dv.store(index_.offset(args.dv, false, b, h_kv, kv, d),
                      stored(dvv[static_cast<std::size_t>(kv * dv + d)]));
      }
    }
  }
  for (const auto& [name, grad] : args.tensor_grads) {
    for (std::int64_t i = 0; i < grad.numel(); ++i) {
      double sum = 0.0;
      for (const auto& partial : partials) sum += partial.at(name)[static_cast<std::size_t>(i)];
      grad.store(i, static_cast<float>(sum));
    }
  }
}

// Under the random-rounding model a value rounded to the storage dtype carries a relative error
// uniform in [-u, u] (u half the dtype's epsilon), of variance u^2 / 3, independent of every other
// rounding. For one query row:
//   D's error: sum_d dO_d (O's rounding)_d + sum_kv P_kv (P's rounding)_kv dP_kv, variance
//     u^2 / 3 (sum_d (dO_d O_d)^2 + sum_kv (P_kv dP_kv)^2), shared by every dS of the row;
//   dS_kv = P_kv (dP_kv - D) g_kv (g: the score derivative) then takes the row's D error times
//     P_kv g_kv, and its own rounding, variance u^2 / 3 dS_kv^2.
// dK[kv, d] = scale sum_q dS_q,kv Q_q,d sums independent rows; dQ[q, d] = scale sum_kv dS_kv K_kv,d
// takes the row's D error coherently (sum_kv P g K inside the square). A row that keeps one key
// has no rounding in D.
void PlainAttention::rounding_sigma(const BackwardArgs& args) const {
  const double u = machine_epsilon(problem_.dtype()) / 2.0;
  const double variance = u * u / 3.0;  // of one rounding, relative
  const std::int64_t dqk = problem_.head_dim_qk();
  const std::int64_t dv = problem_.head_dim_v();
  const std::int64_t group = problem_.heads_q() / problem_.heads_kv();
  const double scale = problem_.scale();
  const Graph d_score = derivative_wrt_score(problem_.score_mod());
  const std::int64_t groups = problem_.batch() * problem_.heads_kv();
  ForwardArgs in;
  in.q = args.q;
  in.k = args.k;
  in.v = args.v;

#pragma omp parallel for schedule(dynamic)
  for (std::int64_t g = 0; g < groups; ++g) {
    const std::int64_t b = g / problem_.heads_kv();
    const std::int64_t h_kv = g % problem_.heads_kv();
    const std::int64_t kv_len = problem_.seq_len_kv_of(b);
    std::vector<double> dk_variance(static_cast<std::size_t>(kv_len * dqk), 0.0);
    std::vector<double> dp(static_cast<std::size_t>(kv_len));
    std::vector<double> coherent(static_cast<std::size_t>(dqk));  // sum_kv P g K
    std::vector<double> dq_variance(static_cast<std::size_t>(dqk));
    Row row;
    std::vector<double> scratch;
    EvalPoint point;
    point.batch = b;
    point.key_length = kv_len;
    for (std::int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h) {
      point.head = h;
      for (std::int64_t position = 0; position < problem_.seq_len_q_of(b); ++position) {
        compute_row(in, b, h, position, row, scratch);
        std::fill(coherent.begin(), coherent.end(), 0.0);
        std::fill(dq_variance.begin(), dq_variance.end(), 0.0);
        double delta_variance = 0.0;
        if (row.lse != kNegativeInfinity) {
          const auto dout_at = [&](std::int64_t d) {
            return args.dout.load(index_.offset(args.dout, true, b, h, position, d));
          };
          double delta = 0.0;
          std::int64_t kept = 0;
          for (std::int64_t d = 0; d < dv; ++d) {
            const double term =
                dout_at(d) * args.out.load(index_.offset(args.out, true, b, h, position, d));
            delta += term;
            delta_variance += variance * term * term;
          }
          for (std::int64_t kv = 0; kv < kv_len; ++kv) {
            const double p = row.prob[static_cast<std::size_t>(kv)];
            if (p == 0.0) continue;
            double sum = 0.0;
            for (std::int64_t d = 0; d < dv; ++d) {
              sum += dout_at(d) * args.v.load(index_.offset(args.v, false, b, h_kv, kv, d));
            }
            dp[static_cast<std::size_t>(kv)] = sum;
            delta_variance += variance * (p * sum) * (p * sum);
            ++kept;
          }
          // One kept key: P = 1 and O = V, exact in any order of rounding.
          if (kept == 1) delta_variance = 0.0;
          point.query = position;
          point.query_length = problem_.seq_len_q_of(b);
          for (std::int64_t kv = 0; kv < kv_len; ++kv) {
            const double p = row.prob[static_cast<std::size_t>(kv)];
            if (p == 0.0) continue;
            point.key = kv;
            point.score = row.raw[static_cast<std::size_t>(kv)];
            const double derivative = evaluate(d_score, point, bindings_);
            const double weight = p * derivative;  // of D's error in dS
            const double ds = weight * (dp[static_cast<std::size_t>(kv)] - delta);
            const double own = variance * ds * ds;  // dS's own rounding
            for (std::int64_t d = 0; d < dqk; ++d) {
              const double query = args.q.load(index_.offset(args.q, true, b, h, position, d));
              const double key = args.k.load(index_.offset(args.k, false, b, h_kv, kv, d));
              dk_variance[static_cast<std::size_t>(kv * dqk + d)] +=
                  (weight * weight * delta_variance + own) * query * query;
              coherent[static_cast<std::size_t>(d)] += weight * key;
              dq_variance[static_cast<std::size_t>(d)] += own * key * key;
            }
          }
        }
        for (std::int64_t d = 0; d < dqk; ++d) {
          const double c = coherent[static_cast<std::size_t>(d)];
          args.dq.store(
              index_.offset(args.dq, true, b, h, position, d),
              scale * std::sqrt(c * c * delta_variance + dq_variance[static_cast<std::size_t>(d)]));
        }
      }
    }
    for (std::int64_t kv = 0; kv < kv_len; ++kv) {
      for (std::int64_t d = 0; d < dqk; ++d) {
        args.dk.store(index_.offset(args.dk, false, b, h_kv, kv, d),
                      scale * std::sqrt(dk_variance[static_cast<std::size_t>(kv * dqk + d)]));
      }
    }
  }
}

}  // namespace

void plain_forward(const Problem& problem, const ForwardArgs& args) {
  PlainAttention(problem, args.tensors).forward(args);
}

void plain_backward(const Problem& problem, const BackwardArgs& args) {
  PlainAttention(problem, args.tensors).backward(args, false);
}

void plain_backward_magnitudes(const Problem& problem, const BackwardArgs& args) {
  PlainAttention(problem, args.tensors).backward(args, true);
}

void plain_backward_rounding_sigma(const Problem& problem, const BackwardArgs& args) {
  PlainAttention(problem, args.tensors).rounding_sigma(args);
}

}  // namespace flexattn::conformance::detail
