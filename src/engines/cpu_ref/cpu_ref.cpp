// `cpu_ref`: attention exactly as docs/design.md section 2 writes it, in float64, one query row at
// a time. Slow by design; every other engine is compared with it.
//
// Memory: one row of scores per thread plus the K/V rows of one (batch, kv head), never the whole
// (seq_len_q, seq_len_kv) score matrix.
// Determinism: every output element is written by exactly one task; tensor gradients, which any
// task may touch, are accumulated per task and reduced in task order, so results do not depend on
// the number of threads.
#include "engines/cpu_ref/cpu_ref.hpp"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <vector>

#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn {

namespace {

constexpr std::string_view kEngineName = "cpu_ref";
constexpr std::string_view kScoreDerivativeOneName = "cpu_ref_score_derivative_one";
constexpr double kNegativeInfinity = -std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

std::size_t to_size(std::int64_t value) { return static_cast<std::size_t>(value); }

// Runs body(i) for i in [0, count) on OpenMP threads; each i must write disjoint memory. The first
// exception is rethrown after the loop (exceptions must not leave an OpenMP region).
template <typename Body>
void parallel_for(std::int64_t count, const Body& body) {
  std::exception_ptr failure;
  std::mutex failure_mutex;
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < count; ++i) {
    try {
      body(i);
    } catch (...) {
      const std::lock_guard lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

// Element offset of row (b, h, s) of a Q/K/V/O-like view in the problem's layout.
class RowIndexer {
 public:
  RowIndexer(const TensorView& view, Layout layout, const std::vector<std::int64_t>& offsets)
      : strides_(view.strides), layout_(layout), offsets_(offsets) {}

  std::int64_t operator()(std::int64_t b, std::int64_t h, std::int64_t s) const {
    switch (layout_) {
      case Layout::kBSHD:
        return b * strides_[0] + s * strides_[1] + h * strides_[2];
      case Layout::kSBHD:
        return s * strides_[0] + b * strides_[1] + h * strides_[2];
      case Layout::kBHSD:
        return b * strides_[0] + h * strides_[1] + s * strides_[2];
      case Layout::kTHD:
        return (offsets_[to_size(b)] + s) * strides_[0] + h * strides_[1];
    }
    return 0;
  }

 private:
  std::vector<std::int64_t> strides_;
  Layout layout_;
  const std::vector<std::int64_t>& offsets_;
};

// Element offset of LSE entry (b, h, q): (batch, heads_q, seq_len_q) or thd (heads_q, tokens).
std::int64_t lse_offset(const Problem& problem, const TensorView& lse, std::int64_t b,
                        std::int64_t h, std::int64_t q) {
  if (problem.layout() == Layout::kTHD) {
    return h * lse.strides[0] + (problem.desc().cu_seqlens_q[to_size(b)] + q) * lse.strides[1];
  }
  return b * lse.strides[0] + h * lse.strides[1] + q * lse.strides[2];
}

// Reads rows [0, length) of (b, h) into a dense (length, dim) double buffer.
void read_rows(const TensorView& view, const RowIndexer& index, std::int64_t b, std::int64_t h,
               std::int64_t length, std::int64_t dim, std::vector<double>& rows) {
  rows.resize(to_size(length * dim));
  for (std::int64_t s = 0; s < length; ++s) {
    const std::int64_t base = index(b, h, s);
    for (std::int64_t i = 0; i < dim; ++i) rows[to_size(s * dim + i)] = view.load(base + i);
  }
}

void write_rows(const TensorView& view, const RowIndexer& index, std::int64_t b, std::int64_t h,
                std::int64_t length, std::int64_t dim, const std::vector<double>& rows) {
  for (std::int64_t s = 0; s < length; ++s) {
    const std::int64_t base = index(b, h, s);
    for (std::int64_t i = 0; i < dim; ++i) view.store(base + i, rows[to_size(s * dim + i)]);
  }
}

double dot(const double* a, const double* b, std::int64_t count) {
  double sum = 0.0;
  for (std::int64_t i = 0; i < count; ++i) sum += a[i] * b[i];
  return sum;
}

// The modifiers as the plan lowered them, with the derivatives the backward pass needs.
struct Lowering {
  Graph score_mod;
  Graph mask_mod;
  Graph score_derivative;
  std::vector<LoadDerivative> load_derivatives;
  bool identity_score = false;
  bool keep_all = false;
  bool score_derivative_one = false;  // the test-only mutant: d score_mod / d score taken as 1
};

// One (batch, query head) pair: its sequence lengths and the K/V rows of its kv head.
struct HeadRows {
  std::int64_t b = 0, h = 0, q_len = 0, kv_len = 0;
  std::int64_t q_offset = 0;  // a KV cache's: the position of the first query, kv_len - q_len
  std::vector<double> k;      // (kv_len, head_dim_qk)
  std::vector<double> v;      // (kv_len, head_dim_v)
};

// The scores of one query row: raw (scaled) and modified, -inf where a key is not kept.
struct RowScores {
  std::vector<double> raw, modified;
  double lse = kNegativeInfinity;  // -inf: no key kept; NaN when a modified score is NaN
  bool any_kept() const { return lse != kNegativeInfinity && !std::isnan(lse); }
};

// Per-task accumulators of the tensor gradients (dense, C order, one per LoadDerivative).
using GradientBuffers = std::vector<std::vector<double>>;

class CpuRefPlan final : public Plan {
 public:
  CpuRefPlan(PlanInfo info, Problem problem, Lowering lowering)
      : Plan(std::move(info)), problem_(std::move(problem)), lowering_(std::move(lowering)) {}

  const Problem& problem() const override { return problem_; }

 protected:
  void run_forward(const ForwardArgs& args) const override;
  void run_backward(const BackwardArgs& args) const override;

 private:
  Bindings bind(const std::map<std::string, TensorView>& tensors) const;
  EvalPoint point(const HeadRows& rows, std::int64_t q, std::int64_t kv, double score) const;
  // With `cache` (a KV cache problem's run), the rows come through its page table and the
  // length from its cache_lens.
  void load_head(const TensorView& k, const TensorView& v, std::int64_t b, std::int64_t h,
                 HeadRows& rows, const ForwardArgs* cache = nullptr) const;
  void score_row(const HeadRows& rows, std::int64_t q, const std::vector<double>& q_row,
                 const Bindings& bindings, RowScores& scores) const;
  // Backward of one (batch, kv head): dQ of its query heads, dK, dV, tensor-gradient parts.
  void backward_task(const BackwardArgs& args, const Bindings& bindings, std::int64_t task,
                     GradientBuffers* gradients) const;
  std::int64_t gradient_offset(const LoadDerivative& load, const EvalPoint& at,
                               const Bindings& bindings) const;

  Problem problem_;
  Lowering lowering_;
};

Bindings CpuRefPlan::bind(const std::map<std::string, TensorView>& tensors) const {
  Bindings bindings;
  bindings.params = problem_.desc().params;
  for (const auto& [name, view] : tensors) {
    if (problem_.desc().tensors.contains(name)) bindings.tensors[name] = view;
  }
  return bindings;
}

EvalPoint CpuRefPlan::point(const HeadRows& rows, std::int64_t q, std::int64_t kv,
                            double score) const {
  EvalPoint at;
  at.score = score;
  at.batch = rows.b;
  at.head = rows.h;
  at.query = rows.q_offset + q;
  at.key = kv;
  at.query_length = rows.q_len;
  at.key_length = rows.kv_len;
  return at;
}

void CpuRefPlan::load_head(const TensorView& k, const TensorView& v, std::int64_t b, std::int64_t h,
                           HeadRows& rows, const ForwardArgs* cache) const {
  const ProblemDesc& d = problem_.desc();
  const std::int64_t h_kv = h / (d.heads_q / d.heads_kv);
  rows.b = b;
  rows.h = h;
  rows.q_len = problem_.seq_len_q_of(b);
  if (cache != nullptr) {  // token s of the sequence: page page_table[b, s / page_size]
    const std::int64_t page_size = d.kv_cache->page_size, max_pages = d.kv_cache->max_pages;
    rows.kv_len = cache->cache_lens.load_index(b);
    rows.q_offset = rows.kv_len == 0 ? 0 : rows.kv_len - rows.q_len;
    const auto gather = [&](const TensorView& pool, std::int64_t dim, std::vector<double>& out) {
      out.resize(to_size(rows.kv_len * dim));
      for (std::int64_t s = 0; s < rows.kv_len; ++s) {
        const std::int64_t page = cache->page_table.load_index(b * max_pages + s / page_size);
        const std::int64_t base =
            page * pool.strides[0] + (s % page_size) * pool.strides[1] + h_kv * pool.strides[2];
        for (std::int64_t i = 0; i < dim; ++i) out[to_size(s * dim + i)] = pool.load(base + i);
      }
    };
    gather(k, d.head_dim_qk, rows.k);
    gather(v, d.head_dim_v, rows.v);
    return;
  }
  rows.kv_len = problem_.seq_len_kv_of(b);
  read_rows(k, RowIndexer(k, d.layout, d.cu_seqlens_kv), b, h_kv, rows.kv_len, d.head_dim_qk,
            rows.k);
  read_rows(v, RowIndexer(v, d.layout, d.cu_seqlens_kv), b, h_kv, rows.kv_len, d.head_dim_v,
            rows.v);
}

void CpuRefPlan::score_row(const HeadRows& rows, std::int64_t q, const std::vector<double>& q_row,
                           const Bindings& bindings, RowScores& scores) const {
  const std::int64_t dim = problem_.head_dim_qk();
  scores.raw.assign(to_size(rows.kv_len), 0.0);
  scores.modified.assign(to_size(rows.kv_len), kNegativeInfinity);
  double max = kNegativeInfinity;
  bool saw_nan = false;
  for (std::int64_t kv = 0; kv < rows.kv_len; ++kv) {
    if (!lowering_.keep_all &&
        evaluate(lowering_.mask_mod, point(rows, q, kv, 0.0), bindings) == 0.0) {
      continue;
    }
    const double raw = problem_.scale() * dot(q_row.data(), &rows.k[to_size(kv * dim)], dim);
    const double modified = lowering_.identity_score
                                ? raw
                                : evaluate(lowering_.score_mod, point(rows, q, kv, raw), bindings);
    scores.raw[to_size(kv)] = raw;
    scores.modified[to_size(kv)] = modified;
    saw_nan = saw_nan || std::isnan(modified);
    max = std::max(max, modified);
  }
  if (saw_nan) {
    scores.lse = kNan;
  } else if (max == kNegativeInfinity) {
    scores.lse = kNegativeInfinity;
  } else {
    double sum = 0.0;
    for (double modified : scores.modified) {
      if (modified != kNegativeInfinity) sum += std::exp(modified - max);
    }
    scores.lse = max + std::log(sum);
  }
}

void CpuRefPlan::run_forward(const ForwardArgs& args) const {
  const ProblemDesc& d = problem_.desc();
  const Bindings bindings = bind(args.tensors);
  const RowIndexer q_index(args.q, d.layout, d.cu_seqlens_q);
  const RowIndexer o_index(args.out, d.layout, d.cu_seqlens_q);
  const std::int64_t dim_v = d.head_dim_v;

  parallel_for(d.batch * d.heads_q, [&](std::int64_t task) {
    HeadRows rows;
    load_head(args.k, args.v, task / d.heads_q, task % d.heads_q, rows,
              d.kv_cache ? &args : nullptr);
    std::vector<double> q_rows, out_rows(to_size(rows.q_len * dim_v), 0.0);
    read_rows(args.q, q_index, rows.b, rows.h, rows.q_len, d.head_dim_qk, q_rows);
    std::vector<double> q_row;
    RowScores scores;
    for (std::int64_t q = 0; q < rows.q_len; ++q) {
      q_row.assign(q_rows.begin() + q * d.head_dim_qk, q_rows.begin() + (q + 1) * d.head_dim_qk);
      score_row(rows, q, q_row, bindings, scores);
      double* out = &out_rows[to_size(q * dim_v)];  // (head_dim_v,), zero for no kept key
      if (std::isnan(scores.lse)) std::fill(out, out + dim_v, kNan);
      for (std::int64_t kv = 0; scores.any_kept() && kv < rows.kv_len; ++kv) {
        const double modified = scores.modified[to_size(kv)];
        if (modified == kNegativeInfinity) continue;
        const double probability = std::exp(modified - scores.lse);
        const double* v_row = &rows.v[to_size(kv * dim_v)];
        for (std::int64_t i = 0; i < dim_v; ++i) out[i] += probability * v_row[i];
      }
      if (!args.lse.empty()) {
        args.lse.store(lse_offset(problem_, args.lse, rows.b, rows.h, q), scores.lse);
      }
    }
    write_rows(args.out, o_index, rows.b, rows.h, rows.q_len, dim_v, out_rows);
  });
}

std::int64_t CpuRefPlan::gradient_offset(const LoadDerivative& load, const EvalPoint& at,
                                         const Bindings& bindings) const {
  const std::vector<std::int64_t>& shape = problem_.desc().tensors.at(load.tensor).shape;
  std::int64_t offset = 0;
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    const auto index = static_cast<std::int64_t>(evaluate(load.indices[axis], at, bindings));
    if (index < 0 || index >= shape[axis]) {
      throw_internal(fmt::format("cpu_ref: gradient index {} of '{}' outside [0, {})", index,
                                 load.tensor, shape[axis]));
    }
    offset = offset * shape[axis] + index;
  }
  return offset;
}

void CpuRefPlan::backward_task(const BackwardArgs& args, const Bindings& bindings,
                               std::int64_t task, GradientBuffers* gradients) const {
  const ProblemDesc& d = problem_.desc();
  const std::int64_t group = d.heads_q / d.heads_kv;
  const std::int64_t b = task / d.heads_kv, h_kv = task % d.heads_kv;
  const std::int64_t dim_qk = d.head_dim_qk, dim_v = d.head_dim_v;
  const RowIndexer q_index(args.q, d.layout, d.cu_seqlens_q);
  const RowIndexer dout_index(args.dout, d.layout, d.cu_seqlens_q);
  const RowIndexer dq_index(args.dq, d.layout, d.cu_seqlens_q);
  const double scale = problem_.scale();

  HeadRows rows;
  load_head(args.k, args.v, b, h_kv * group, rows);
  std::vector<double> dk_rows(to_size(rows.kv_len * dim_qk), 0.0);  // (kv_len, head_dim_qk)
  std::vector<double> dv_rows(to_size(rows.kv_len * dim_v), 0.0);   // (kv_len, head_dim_v)
  std::vector<double> q_rows, dout_rows, dq_rows, q_row;
  std::vector<double> dp(to_size(rows.kv_len));
  RowScores scores;
  for (std::int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h) {
    rows.h = h;
    read_rows(args.q, q_index, b, h, rows.q_len, dim_qk, q_rows);
    read_rows(args.dout, dout_index, b, h, rows.q_len, dim_v, dout_rows);
    dq_rows.assign(to_size(rows.q_len * dim_qk), 0.0);
    for (std::int64_t q = 0; q < rows.q_len; ++q) {
      q_row.assign(q_rows.begin() + q * dim_qk, q_rows.begin() + (q + 1) * dim_qk);
      score_row(rows, q, q_row, bindings, scores);
      // No kept key: this row adds nothing (zero dQ row). A NaN LSE (a NaN modified score, or
      // every kept score +inf) runs the arithmetic below with it: P is NaN, so the row's dQ and
      // the dK, dV and tensor gradients of every key it keeps are NaN, the gradients it reaches.
      if (scores.lse == kNegativeInfinity) continue;
      const double* dout = &dout_rows[to_size(q * dim_v)];
      // dP = dO V^T; rowsum(dO * O) == sum_kv P dP.
      double row_sum = 0.0;
      for (std::int64_t kv = 0; kv < rows.kv_len; ++kv) {
        const double modified = scores.modified[to_size(kv)];
        if (modified == kNegativeInfinity) continue;
        dp[to_size(kv)] = dot(dout, &rows.v[to_size(kv * dim_v)], dim_v);
        row_sum += std::exp(modified - scores.lse) * dp[to_size(kv)];
      }
      double* dq = &dq_rows[to_size(q * dim_qk)];
      for (std::int64_t kv = 0; kv < rows.kv_len; ++kv) {
        const double modified = scores.modified[to_size(kv)];
        if (modified == kNegativeInfinity) continue;
        const double probability = std::exp(modified - scores.lse);
        double* dv = &dv_rows[to_size(kv * dim_v)];
        for (std::int64_t i = 0; i < dim_v; ++i) dv[i] += probability * dout[i];
        const double ds = probability * (dp[to_size(kv)] - row_sum);  // d loss / d modified
        if (ds == 0.0) continue;
        const EvalPoint at = point(rows, q, kv, scores.raw[to_size(kv)]);
        const double slope = lowering_.identity_score || lowering_.score_derivative_one
                                 ? 1.0
                                 : evaluate(lowering_.score_derivative, at, bindings);
        const double ds_raw = ds * slope * scale;  // d loss / d (q . k)
        const double* k_row = &rows.k[to_size(kv * dim_qk)];
        double* dk = &dk_rows[to_size(kv * dim_qk)];
        for (std::int64_t i = 0; i < dim_qk; ++i) {
          dq[i] += ds_raw * k_row[i];
          dk[i] += ds_raw * q_row[to_size(i)];
        }
        for (std::size_t n = 0; gradients != nullptr && n < gradients->size(); ++n) {
          const LoadDerivative& load = lowering_.load_derivatives[n];
          const double derivative = evaluate(load.derivative, at, bindings);
          (*gradients)[n][to_size(gradient_offset(load, at, bindings))] += ds * derivative;
        }
      }
    }
    write_rows(args.dq, dq_index, b, h, rows.q_len, dim_qk, dq_rows);
  }
  write_rows(args.dk, RowIndexer(args.dk, d.layout, d.cu_seqlens_kv), b, h_kv, rows.kv_len, dim_qk,
             dk_rows);
  write_rows(args.dv, RowIndexer(args.dv, d.layout, d.cu_seqlens_kv), b, h_kv, rows.kv_len, dim_v,
             dv_rows);
}

void CpuRefPlan::run_backward(const BackwardArgs& args) const {
  const ProblemDesc& d = problem_.desc();
  const Bindings bindings = bind(args.tensors);
  const std::int64_t tasks = d.batch * d.heads_kv;
  const std::vector<LoadDerivative>& loads = lowering_.load_derivatives;

  bool tensor_grads_wanted = false;
  for (const LoadDerivative& load : loads) {
    tensor_grads_wanted = tensor_grads_wanted || args.tensor_grads.contains(load.tensor);
  }
  GradientBuffers totals;  // one dense buffer per load derivative, when any gradient is wanted
  if (!tensor_grads_wanted) {
    parallel_for(tasks, [&](std::int64_t task) { backward_task(args, bindings, task, nullptr); });
  } else {
    for (const LoadDerivative& load : loads) {
      std::int64_t numel = 1;
      for (std::int64_t extent : d.tensors.at(load.tensor).shape) numel *= extent;
      totals.emplace_back(to_size(numel), 0.0);
    }
    // Tasks run in chunks of one per thread, each into its own buffers, which are then added to
    // the totals in task order: the summation order is the same for any thread count.
    const std::int64_t chunk = std::max(1, omp_get_max_threads());
    std::vector<GradientBuffers> buffers(to_size(chunk), totals);
    for (std::int64_t first = 0; first < tasks; first += chunk) {
      const std::int64_t size = std::min(chunk, tasks - first);
      parallel_for(size, [&](std::int64_t i) {
        GradientBuffers& mine = buffers[to_size(i)];
        for (auto& buffer : mine) std::fill(buffer.begin(), buffer.end(), 0.0);
        backward_task(args, bindings, first + i, &mine);
      });
      for (std::int64_t i = 0; i < size; ++i) {
        for (std::size_t n = 0; n < totals.size(); ++n) {
          const std::vector<double>& part = buffers[to_size(i)][n];
          for (std::size_t e = 0; e < part.size(); ++e) totals[n][e] += part[e];
        }
      }
    }
  }
  // Requested gradients: the sum over every load of the tensor (zero when the score modifier
  // does not differentiate it, e.g. a tensor only the mask reads).
  for (const auto& [name, gradient] : args.tensor_grads) {
    std::vector<double> sum(to_size(gradient.numel()), 0.0);
    for (std::size_t n = 0; n < totals.size(); ++n) {
      if (loads[n].tensor != name) continue;
      for (std::size_t e = 0; e < sum.size(); ++e) sum[e] += totals[n][e];
    }
    for (std::size_t e = 0; e < sum.size(); ++e) {
      gradient.store(static_cast<std::int64_t>(e), sum[e]);
    }
  }
}

class CpuRefEngine final : public Engine {
 public:
  explicit CpuRefEngine(ScoreDerivative score_derivative) : score_derivative_(score_derivative) {}
  std::string_view name() const override {
    return score_derivative_ == ScoreDerivative::kExact ? kEngineName : kScoreDerivativeOneName;
  }
  Support available() const override { return Support::yes(); }
  bool reads_kv_cache() const override { return true; }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    if (problem.device() != Device::kCpu) {
      result.support = Support::no("cpu_ref computes on the CPU only");
      return result;
    }
    Lowering lowering;
    lowering.score_mod = problem.score_mod();
    lowering.mask_mod = problem.mask_mod();
    lowering.identity_score = lowering.score_mod.is_identity_score();
    lowering.score_derivative_one = score_derivative_ == ScoreDerivative::kReplacedByOne;
    const GraphNode& mask_root = lowering.mask_mod.node(lowering.mask_mod.root());
    lowering.keep_all = lowering.mask_mod.is_literal() && mask_root.literal != 0.0;
    if (problem.wants_backward()) {
      try {
        lowering.score_derivative = derivative_wrt_score(lowering.score_mod);
        lowering.load_derivatives = derivatives_wrt_tensors(lowering.score_mod);
      } catch (const Error& error) {
        result.support =
            Support::no(fmt::format("cannot differentiate the score modifier: {}", error.what()));
        return result;
      }
    }
    result.support = Support::yes();
    if (stage == Stage::kCheck) return result;

    PlanInfo info;
    info.engine = std::string(name());
    info.description = fmt::format(
        "float64 reference, one query row at a time, OpenMP over (batch, head), {} threads",
        omp_get_max_threads());
    // cpu_ref has no lowering: it evaluates the canonical graphs themselves, so its proof is the
    // hash of the graphs its evaluator holds (the plan's Lowering), taken where the plan keeps
    // them. The test-only mutant evaluates 1 in place of score_derivative yet claims it
    // (cpu_ref.hpp).
    info.lowered_hash = modifier_hash(lowering.score_mod, lowering.mask_mod, problem.scale());
    if (problem.wants_backward()) {
      info.lowered_backward_hash =
          backward_hash(lowering.score_derivative, lowering.load_derivatives);
    }
    info.signature = problem.signature();
    result.plan = std::make_unique<CpuRefPlan>(std::move(info), problem, std::move(lowering));
    return result;
  }

 private:
  ScoreDerivative score_derivative_;
};

}  // namespace

std::shared_ptr<const Engine> make_cpu_ref_engine() {
  return internal::make_cpu_ref_engine(ScoreDerivative::kExact);
}

std::shared_ptr<const Engine> internal::make_cpu_ref_engine(ScoreDerivative score_derivative) {
  return std::make_shared<CpuRefEngine>(score_derivative);
}

}  // namespace flexattn
