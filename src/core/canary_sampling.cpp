// The plan canary's sampled rows, synthetic inputs and float64 reference (canary_sampling.hpp).
#include "core/canary_sampling.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "core/graph_rebuild.hpp"
#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::detail {

namespace {

std::size_t to_size(std::int64_t value) { return static_cast<std::size_t>(value); }

// Query rows every engine treats specially: the first ones, the boundaries of 64- and 128-row
// tiles (the cpu engine's 128-row tiles, the cuda kernels' 64- and 128-row blocks), the middle and
// the last ones.
std::vector<std::int64_t> sampled_rows(std::int64_t length) {
  std::set<std::int64_t> rows;
  for (std::int64_t row :
       {std::int64_t{0}, std::int64_t{1}, std::int64_t{63}, std::int64_t{64}, std::int64_t{127},
        std::int64_t{128}, length / 2, length - 2, length - 1}) {
    if (row >= 0 && row < length) rows.insert(row);
  }
  return {rows.begin(), rows.end()};
}

// Documents of uneven lengths over [0, length): boundaries at 1/5 and 3/5, so an integer tensor
// used as document ids keeps some keys and masks others in every sampled row's neighbourhood.
std::int64_t document_of(std::int64_t position, std::int64_t length) {
  constexpr std::int64_t kParts = 5;
  if (position * kParts < length) return 0;
  if (position * kParts < 3 * length) return 1;
  return 2;
}

// Seeds of the synthetic inputs: fixed, so a canary is reproducible.
constexpr std::uint64_t kQuerySeed = 0x63616e61;
constexpr std::uint64_t kKeySeed = 0x6b6579;
constexpr std::uint64_t kValueSeed = 0x76616c;
constexpr std::uint64_t kGradientSeed = 0x646f7574;
constexpr std::uint64_t kTensorSeed = 0x74656e73;

// `graph` for the reduced problem of `pair`: b, h, Q_LEN and KV_LEN fixed to the pair's values
// and q read through the table `rows_name` of the sampled rows.
ir::Expr for_pair(const Graph& graph, const SampledPair& pair, const std::string& rows_name) {
  std::vector<ir::Expr> expressions;
  expressions.reserve(graph.nodes().size());
  for (const GraphNode& node : graph.nodes()) {
    std::vector<ir::Expr> args;
    for (std::int32_t arg : node.args) args.push_back(expressions[static_cast<std::size_t>(arg)]);
    if (node.op == Op::kBatch) {
      expressions.push_back(ir::literal_i32(pair.b));
    } else if (node.op == Op::kHead) {
      expressions.push_back(ir::literal_i32(pair.h));
    } else if (node.op == Op::kQuery) {
      expressions.push_back(ir::load(rows_name, Type::kI32, {ir::query()}));
    } else if (node.op == Op::kQueryLen) {
      expressions.push_back(ir::literal_i32(pair.q_len));
    } else if (node.op == Op::kKeyLen) {
      expressions.push_back(ir::literal_i32(pair.kv_len));
    } else {
      expressions.push_back(rebuild_node(node, std::move(args)));
    }
  }
  return expressions[static_cast<std::size_t>(graph.root())];
}

bool is_float_tensor(const Problem& problem, const std::string& name) {
  return is_floating(problem.desc().tensors.at(name).dtype);
}

// Float tensors the score modifier reads: the tensor gradients the backward computes.
std::vector<std::string> differentiated_tensors(const Problem& problem) {
  std::vector<std::string> names;
  for (const std::string& name : problem.score_mod().tensors()) {
    if (is_float_tensor(problem, name)) names.push_back(name);
  }
  return names;
}

HostTensor gather_rows(const Problem& problem, const TensorView& view, bool kv_side, std::int64_t b,
                       std::int64_t head, const std::vector<std::int64_t>& rows, std::int64_t dim) {
  const auto count = static_cast<std::int64_t>(rows.size());
  HostTensor result(DType::kF64, {1, 1, count, dim});
  for (std::int64_t r = 0; r < count; ++r) {
    const std::int64_t base = row_offset(problem, view, kv_side, b, head, rows[to_size(r)]);
    for (std::int64_t i = 0; i < dim; ++i) result.set(r * dim + i, view.load(base + i));
  }
  return result;
}

std::vector<std::int64_t> all_rows(std::int64_t length) {
  std::vector<std::int64_t> rows(to_size(length));
  for (std::int64_t s = 0; s < length; ++s) rows[to_size(s)] = s;
  return rows;
}

std::vector<double> row_of(const HostTensor& tensor, std::int64_t row, std::int64_t dim) {
  std::vector<double> values(to_size(dim));
  for (std::int64_t i = 0; i < dim; ++i) values[to_size(i)] = tensor.at(row * dim + i);
  return values;
}

std::string pair_row(const SampledPair& pair, std::int64_t row) {
  return fmt::format("batch {}, head {}, row {}", pair.b, pair.h, row);
}

}  // namespace

std::int64_t canary_cache_length(const Problem& problem, std::int64_t b) {
  const std::int64_t q_len = problem.seq_len_q_of(b), capacity = problem.seq_len_kv();
  return q_len + (capacity - q_len) * (b + 1) / problem.batch();
}

std::int64_t canary_page(const Problem& problem, std::int64_t b, std::int64_t j) {
  constexpr std::int64_t kScramble = 7919;  // a prime: consecutive entries land far apart
  const KvCacheDesc& cache = *problem.kv_cache();
  return ((b * cache.max_pages + j) * kScramble + 3) % cache.pages;
}

Sample sample_rows(const Problem& problem) {
  Sample sample;
  const std::int64_t last_batch = problem.batch() - 1, last_head = problem.heads_q() - 1;
  const std::int64_t group = problem.heads_q() / problem.heads_kv();
  const std::pair<std::int64_t, std::int64_t> candidates[] = {
      {0, 0}, {last_batch, last_head}, {last_batch / 2, last_head / 2}};
  for (const auto& candidate : candidates) {
    // Named copies, not a structured binding: Clang before 16 cannot capture one in a lambda.
    const std::int64_t b = candidate.first, h = candidate.second;
    const bool seen = std::any_of(sample.pairs.begin(), sample.pairs.end(),
                                  [&](const SampledPair& p) { return p.b == b && p.h == h; });
    if (seen) continue;
    SampledPair pair;
    pair.b = b;
    pair.h = h;
    pair.h_kv = h / group;
    pair.q_len = problem.seq_len_q_of(b);
    pair.kv_len = problem.kv_cache() ? canary_cache_length(problem, b) : problem.seq_len_kv_of(b);
    pair.q_offset = problem.kv_cache() && pair.kv_len > 0 ? pair.kv_len - pair.q_len : 0;
    pair.rows = sampled_rows(pair.q_len);
    sample.pairs.push_back(pair);
    const bool kv_seen =
        std::any_of(sample.kv_heads.begin(), sample.kv_heads.end(),
                    [&](const SampledKvHead& k) { return k.b == b && k.h_kv == pair.h_kv; });
    if (!kv_seen) sample.kv_heads.push_back({b, pair.h_kv, pair.kv_len});
  }
  return sample;
}

HostTensor buffer_for(const TensorView& expected, TensorView& view) {
  std::int64_t span = 1;
  for (std::size_t axis = 0; axis < expected.shape.size(); ++axis) {
    span += (expected.shape[axis] - 1) * expected.strides[axis];
  }
  HostTensor buffer(expected.dtype, {span});
  view = expected;
  view.data = buffer.data();
  view.device = Device::kCpu;
  return buffer;
}

std::int64_t row_offset(const Problem& problem, const TensorView& view, bool kv_side,
                        std::int64_t b, std::int64_t head, std::int64_t s) {
  const std::vector<std::int64_t>& st = view.strides;
  if (kv_side && problem.kv_cache()) {
    const std::int64_t page_size = problem.kv_cache()->page_size;
    return canary_page(problem, b, s / page_size) * st[0] + (s % page_size) * st[1] + head * st[2];
  }
  switch (problem.layout()) {
    case Layout::kBSHD:
      return b * st[0] + s * st[1] + head * st[2];
    case Layout::kSBHD:
      return s * st[0] + b * st[1] + head * st[2];
    case Layout::kBHSD:
      return b * st[0] + head * st[1] + s * st[2];
    case Layout::kTHD: {
      const auto& offsets = kv_side ? problem.desc().cu_seqlens_kv : problem.desc().cu_seqlens_q;
      return (offsets[to_size(b)] + s) * st[0] + head * st[1];
    }
  }
  return 0;
}

std::int64_t lse_offset(const Problem& problem, const TensorView& lse, std::int64_t b,
                        std::int64_t h, std::int64_t q) {
  if (problem.layout() == Layout::kTHD) {
    return h * lse.strides[0] + (problem.desc().cu_seqlens_q[to_size(b)] + q) * lse.strides[1];
  }
  return b * lse.strides[0] + h * lse.strides[1] + q * lse.strides[2];
}

std::string_view to_string(Variant variant) {
  switch (variant) {
    case Variant::kRequest:
      return "the request";
    case Variant::kScoreModDropped:
      return "score_mod dropped";
    case Variant::kMaskDropped:
      return "mask dropped";
    case Variant::kDerivativeReplacedByOne:
      return "derivative replaced by 1";
  }
  return "?";
}

CanaryInputs make_canary_inputs(const Problem& problem, const Sample& sample, double q_scale,
                                bool zero_queries) {
  CanaryInputs inputs;
  inputs.q = buffer_for(problem.expected("q"), inputs.q_view);
  inputs.k = buffer_for(problem.expected("k"), inputs.k_view);
  inputs.v = buffer_for(problem.expected("v"), inputs.v_view);
  if (!zero_queries) inputs.q.fill_normal(kQuerySeed, q_scale);
  inputs.k.fill_normal(kKeySeed);
  inputs.v.fill_normal(kValueSeed);
  if (problem.wants_backward()) {
    inputs.dout = buffer_for(problem.expected("dout"), inputs.dout_view);
    HostTensor values(DType::kF64, {problem.head_dim_v()});
    std::uint64_t seed = kGradientSeed;
    for (const SampledPair& pair : sample.pairs) {
      for (std::int64_t row : pair.rows) {
        values.fill_normal(seed++);
        const std::int64_t base = row_offset(problem, inputs.dout_view, false, pair.b, pair.h, row);
        for (std::int64_t i = 0; i < problem.head_dim_v(); ++i) {
          inputs.dout_view.store(base + i, values.at(i));
        }
      }
    }
  }
  if (problem.kv_cache()) {
    inputs.page_table = HostTensor(DType::kI32, problem.expected("page_table").shape);
    inputs.cache_lens = HostTensor(DType::kI32, problem.expected("cache_lens").shape);
    const std::int64_t max_pages = problem.kv_cache()->max_pages;
    for (std::int64_t b = 0; b < problem.batch(); ++b) {
      inputs.cache_lens.set(b, static_cast<double>(canary_cache_length(problem, b)));
      for (std::int64_t j = 0; j < max_pages; ++j) {
        inputs.page_table.set(b * max_pages + j, static_cast<double>(canary_page(problem, b, j)));
      }
    }
  }
  std::uint64_t tensor_seed = kTensorSeed;
  for (const auto& [name, decl] : problem.desc().tensors) {
    HostTensor tensor(decl.dtype, decl.shape);
    if (is_floating(decl.dtype)) {
      tensor.fill_normal(tensor_seed++);
    } else {
      const std::int64_t last = decl.shape.empty() ? 1 : decl.shape.back();
      for (std::int64_t i = 0; i < tensor.numel(); ++i) {
        tensor.set(i, static_cast<double>(document_of(i % last, last)));
      }
    }
    inputs.tensors.emplace(name, std::move(tensor));
  }
  return inputs;
}

std::vector<double> score_sizes(const Problem& problem, const CanaryInputs& inputs,
                                const Sample& sample) {
  Bindings bindings;
  bindings.params = problem.desc().params;
  for (const auto& [name, tensor] : inputs.tensors) bindings.tensors[name] = tensor.view();
  const Graph slope = derivative_wrt_score(problem.score_mod());
  const std::int64_t dim = problem.head_dim_qk();
  std::vector<double> sizes;
  for (const SampledPair& pair : sample.pairs) {
    const HostTensor k =
        gather_rows(problem, inputs.k_view, true, pair.b, pair.h_kv, all_rows(pair.kv_len), dim);
    const HostTensor q = gather_rows(problem, inputs.q_view, false, pair.b, pair.h, pair.rows, dim);
    for (std::size_t r = 0; r < pair.rows.size(); ++r) {
      double size = 0;
      for (std::int64_t kv = 0; kv < pair.kv_len; ++kv) {
        EvalPoint at{0.0, pair.b,     pair.h,     pair.q_offset + pair.rows[r],
                     kv,  pair.q_len, pair.kv_len};
        if (evaluate(problem.mask_mod(), at, bindings) == 0.0) continue;
        double dot = 0, absolute = 0;
        for (std::int64_t i = 0; i < dim; ++i) {
          const double product = q.at(static_cast<std::int64_t>(r) * dim + i) * k.at(kv * dim + i);
          dot += product;
          absolute += std::abs(product);
        }
        at.score = problem.scale() * dot;
        const double modified = evaluate(problem.score_mod(), at, bindings);
        const double carried = std::abs(evaluate(slope, at, bindings)) * problem.scale() * absolute;
        if (std::isfinite(modified)) size = std::max(size, std::abs(modified));
        if (std::isfinite(carried)) size = std::max(size, carried);
      }
      sizes.push_back(size);
    }
  }
  return sizes;
}

GradientTermSizes gradient_term_sizes(const Problem& problem, const CanaryInputs& inputs,
                                      const Sample& sample, const SampledOutputs& reference) {
  GradientTermSizes sizes;
  if (!problem.wants_backward()) return sizes;
  const auto find = [&](std::string_view name) -> const OutputRows& {
    for (const OutputRows& output : reference) {
      if (output.output == name) return output;
    }
    throw_internal(fmt::format("canary: the reference has no {} rows", name));
  };
  const OutputRows& out = find("out");
  Bindings bindings;
  bindings.params = problem.desc().params;
  for (const auto& [name, tensor] : inputs.tensors) bindings.tensors[name] = tensor.view();
  const Graph slope = derivative_wrt_score(problem.score_mod());
  const std::int64_t dim_qk = problem.head_dim_qk(), dim_v = problem.head_dim_v();
  const double scale = problem.scale();

  // dk and dv rows: every kv row of each sampled kv head, per element until the end.
  std::vector<std::vector<double>> dk_terms, dv_terms;
  std::vector<std::size_t> first_of_head;
  for (const SampledKvHead& kv_head : sample.kv_heads) {
    first_of_head.push_back(dk_terms.size());
    for (std::int64_t kv = 0; kv < kv_head.kv_len; ++kv) {
      dk_terms.emplace_back(to_size(dim_qk), 0.0);
      dv_terms.emplace_back(to_size(dim_v), 0.0);
    }
  }
  std::size_t row_index = 0;  // into the reference's query rows
  for (const SampledPair& pair : sample.pairs) {
    std::size_t first = 0;
    for (std::size_t head = 0; head < sample.kv_heads.size(); ++head) {
      if (sample.kv_heads[head].b == pair.b && sample.kv_heads[head].h_kv == pair.h_kv) {
        first = first_of_head[head];
        break;
      }
    }
    const std::vector<std::int64_t> keys = all_rows(pair.kv_len);
    const HostTensor q =
        gather_rows(problem, inputs.q_view, false, pair.b, pair.h, pair.rows, dim_qk);
    const HostTensor k = gather_rows(problem, inputs.k_view, true, pair.b, pair.h_kv, keys, dim_qk);
    const HostTensor v = gather_rows(problem, inputs.v_view, true, pair.b, pair.h_kv, keys, dim_v);
    const HostTensor dout =
        gather_rows(problem, inputs.dout_view, false, pair.b, pair.h, pair.rows, dim_v);
    std::vector<double> modified(to_size(pair.kv_len)), steepness(to_size(pair.kv_len));
    for (std::size_t r = 0; r < pair.rows.size(); ++r, ++row_index) {
      // P of the row from its own modified scores (float64), masked keys at P = 0.
      double largest = -std::numeric_limits<double>::infinity();
      for (std::int64_t kv = 0; kv < pair.kv_len; ++kv) {
        EvalPoint at{0.0, pair.b,     pair.h,     pair.q_offset + pair.rows[r],
                     kv,  pair.q_len, pair.kv_len};
        modified[to_size(kv)] = -std::numeric_limits<double>::infinity();
        if (evaluate(problem.mask_mod(), at, bindings) == 0.0) continue;
        double dot = 0;
        for (std::int64_t i = 0; i < dim_qk; ++i) {
          dot += q.at(static_cast<std::int64_t>(r) * dim_qk + i) * k.at(kv * dim_qk + i);
        }
        at.score = scale * dot;
        modified[to_size(kv)] = evaluate(problem.score_mod(), at, bindings);
        steepness[to_size(kv)] = std::abs(evaluate(slope, at, bindings));
        if (std::isfinite(modified[to_size(kv)]))
          largest = std::max(largest, modified[to_size(kv)]);
      }
      double total = 0;
      for (double m : modified) total += std::isfinite(m) ? std::exp(m - largest) : 0.0;
      double output_size = 0, delta = 0;  // |dO| . |o| and D = dO . o
      for (std::int64_t i = 0; i < dim_v; ++i) {
        const double d = dout.at(static_cast<std::int64_t>(r) * dim_v + i);
        output_size += std::abs(d) * std::abs(out.rows[row_index][to_size(i)]);
        delta += d * out.rows[row_index][to_size(i)];
      }
      std::vector<double> dq_terms(to_size(dim_qk), 0.0);
      for (std::int64_t kv = 0; kv < pair.kv_len; ++kv) {
        const double m = modified[to_size(kv)];
        if (!std::isfinite(m) || total == 0.0) continue;
        const double p = std::exp(m - largest) / total;
        double dp = 0;  // dO . v
        for (std::int64_t i = 0; i < dim_v; ++i) {
          const double d = dout.at(static_cast<std::int64_t>(r) * dim_v + i);
          dp += d * v.at(kv * dim_v + i);
          dv_terms[first + to_size(kv)][to_size(i)] += p * std::abs(d);
        }
        const double ds = scale * p * (std::abs(dp - delta) + output_size) * steepness[to_size(kv)];
        if (!std::isfinite(ds)) continue;
        for (std::int64_t i = 0; i < dim_qk; ++i) {
          dq_terms[to_size(i)] += ds * std::abs(k.at(kv * dim_qk + i));
          dk_terms[first + to_size(kv)][to_size(i)] +=
              ds * std::abs(q.at(static_cast<std::int64_t>(r) * dim_qk + i));
        }
      }
      sizes.dq.push_back(*std::max_element(dq_terms.begin(), dq_terms.end()));
    }
  }
  for (const auto& row : dk_terms) sizes.dk.push_back(*std::max_element(row.begin(), row.end()));
  for (const auto& row : dv_terms) sizes.dv.push_back(*std::max_element(row.begin(), row.end()));
  return sizes;
}

SampledOutputs reference_outputs(const Problem& problem, const CanaryInputs& inputs,
                                 const Sample& sample, Variant variant) {
  const ProblemDesc& original = problem.desc();
  const std::int64_t dim_qk = problem.head_dim_qk(), dim_v = problem.head_dim_v();
  const bool backward = problem.wants_backward();
  const std::vector<std::string> gradients = differentiated_tensors(problem);
  const auto engine = internal::make_cpu_ref_engine(variant == Variant::kDerivativeReplacedByOne
                                                        ? ScoreDerivative::kReplacedByOne
                                                        : ScoreDerivative::kExact);
  std::string rows_name = "canary_rows";
  while (original.tensors.contains(rows_name)) rows_name += "_";

  OutputRows out{"out", {}, {}}, lse{"lse", {}, {}}, dq{"dq", {}, {}};
  OutputRows dk{"dk", {}, {}}, dv{"dv", {}, {}};
  for (const SampledKvHead& kv_head : sample.kv_heads) {
    for (std::int64_t kv = 0; kv < kv_head.kv_len; ++kv) {
      const std::string where =
          fmt::format("batch {}, kv head {}, row {}", kv_head.b, kv_head.h_kv, kv);
      dk.where.push_back(where);
      dk.rows.emplace_back(to_size(dim_qk), 0.0);
      dv.where.push_back(where);
      dv.rows.emplace_back(to_size(dim_v), 0.0);
    }
  }
  // Every gradient the request differentiates, zero where a variant reads no such tensor.
  std::map<std::string, std::vector<double>> tensor_gradients;
  for (const std::string& name : gradients) {
    std::int64_t numel = 1;
    for (std::int64_t extent : original.tensors.at(name).shape) numel *= extent;
    tensor_gradients[name].assign(to_size(numel), 0.0);
  }

  for (const SampledPair& pair : sample.pairs) {
    const auto count = static_cast<std::int64_t>(pair.rows.size());
    ProblemDesc desc;
    desc.batch = 1;
    desc.heads_q = desc.heads_kv = 1;
    desc.seq_len_q = count;
    desc.seq_len_kv = pair.kv_len;
    desc.head_dim_qk = dim_qk;
    desc.head_dim_v = dim_v;
    desc.layout = Layout::kBHSD;
    desc.dtype = DType::kF64;
    desc.scale = problem.scale();
    desc.params = original.params;
    desc.tensors = original.tensors;
    desc.tensors[rows_name] = TensorDecl{DType::kI32, {count}};
    desc.direction = problem.direction();
    if (variant != Variant::kScoreModDropped) {
      desc.score_mod = for_pair(problem.score_mod(), pair, rows_name);
    }
    if (variant != Variant::kMaskDropped) {
      desc.mask_mod = for_pair(problem.mask_mod(), pair, rows_name);
    }
    const Problem reduced(desc);

    HostTensor rows(DType::kI32, {count});
    for (std::int64_t r = 0; r < count; ++r) {
      rows.set(r, static_cast<double>(pair.q_offset + pair.rows[to_size(r)]));
    }
    const HostTensor q =
        gather_rows(problem, inputs.q_view, false, pair.b, pair.h, pair.rows, dim_qk);
    const std::vector<std::int64_t> keys = all_rows(pair.kv_len);
    const HostTensor k = gather_rows(problem, inputs.k_view, true, pair.b, pair.h_kv, keys, dim_qk);
    const HostTensor v = gather_rows(problem, inputs.v_view, true, pair.b, pair.h_kv, keys, dim_v);
    HostTensor o(DType::kF64, {1, 1, count, dim_v}), l(DType::kF64, {1, 1, count});

    const auto plan = engine->plan(reduced);
    ForwardArgs forward;
    forward.q = q.view(), forward.k = k.view(), forward.v = v.view();
    forward.out = o.view(), forward.lse = l.view();
    for (const auto& [name, tensor] : inputs.tensors) forward.tensors[name] = tensor.view();
    forward.tensors[rows_name] = rows.view();
    plan->forward(forward);
    for (std::int64_t r = 0; r < count; ++r) {
      out.where.push_back(pair_row(pair, pair.rows[to_size(r)]));
      out.rows.push_back(row_of(o, r, dim_v));
      lse.where.push_back(pair_row(pair, pair.rows[to_size(r)]));
      lse.rows.push_back({l.at(r)});
    }
    if (!backward) continue;

    const HostTensor dout =
        gather_rows(problem, inputs.dout_view, false, pair.b, pair.h, pair.rows, dim_v);
    HostTensor dq_rows(DType::kF64, {1, 1, count, dim_qk});
    HostTensor dk_rows(DType::kF64, {1, 1, pair.kv_len, dim_qk});
    HostTensor dv_rows(DType::kF64, {1, 1, pair.kv_len, dim_v});
    std::map<std::string, HostTensor> grads;
    BackwardArgs args;
    args.q = q.view(), args.k = k.view(), args.v = v.view(), args.out = o.view();
    args.lse = l.view(), args.dout = dout.view();
    args.dq = dq_rows.view(), args.dk = dk_rows.view(), args.dv = dv_rows.view();
    args.tensors = forward.tensors;
    const std::vector<std::string> read = reduced.score_mod().tensors();
    for (const std::string& name : gradients) {
      if (std::find(read.begin(), read.end(), name) == read.end()) continue;
      auto [slot, inserted] =
          grads.emplace(name, HostTensor(DType::kF64, original.tensors.at(name).shape));
      args.tensor_grads[name] = slot->second.view();
    }
    plan->backward(args);
    for (std::int64_t r = 0; r < count; ++r) {
      dq.where.push_back(pair_row(pair, pair.rows[to_size(r)]));
      dq.rows.push_back(row_of(dq_rows, r, dim_qk));
    }
    // The pair's kv head: its rows start after those of the kv heads before it.
    std::size_t first = 0;
    for (const SampledKvHead& kv_head : sample.kv_heads) {
      if (kv_head.b == pair.b && kv_head.h_kv == pair.h_kv) break;
      first += to_size(kv_head.kv_len);
    }
    for (std::int64_t kv = 0; kv < pair.kv_len; ++kv) {
      for (std::int64_t i = 0; i < dim_qk; ++i) {
        dk.rows[first + to_size(kv)][to_size(i)] += dk_rows.at(kv * dim_qk + i);
      }
      for (std::int64_t i = 0; i < dim_v; ++i) {
        dv.rows[first + to_size(kv)][to_size(i)] += dv_rows.at(kv * dim_v + i);
      }
    }
    for (const auto& [name, gradient] : grads) {
      std::vector<double>& total = tensor_gradients[name];
      for (std::int64_t e = 0; e < gradient.numel(); ++e) total[to_size(e)] += gradient.at(e);
    }
  }

  SampledOutputs outputs{std::move(out), std::move(lse)};
  if (backward) {
    outputs.push_back(std::move(dq));
    outputs.push_back(std::move(dk));
    outputs.push_back(std::move(dv));
    for (auto& [name, total] : tensor_gradients) {
      outputs.push_back(OutputRows{"d" + name, {"whole tensor"}, {std::move(total)}});
    }
  }
  return outputs;
}

}  // namespace flexattn::detail
