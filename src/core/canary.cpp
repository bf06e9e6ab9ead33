// The plan canary (canary.hpp): choose discriminating inputs, run the plan once on its device,
// compare the sampled rows with cpu_ref.
#include "core/canary.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>

#include "core/canary_sampling.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::detail {

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// Tolerance = kToleranceFactor x (storage rounding + accumulation rounding x score size) x
// magnitude (canary.hpp). Four roundings leave room for the roundings of P and dS to the storage
// dtype that tensor-core engines do (FlashAttention does), and for the output's own rounding.
constexpr double kToleranceFactor = 4;
// fp32 accumulation with the fast exp2 of GPU kernels: a few units in 2^-24, taken as 2^-22.
constexpr double kAccumulationRounding = 0x1p-22;
// dq/dk/dv rows: the magnitude is at least this fraction of the output's largest value, so a row
// whose terms cancel is not held to a tolerance below its terms' rounding.
constexpr double kRowFloorFraction = 1.0 / 8;
// q is scaled by these factors, in order, until every applicable variant is discriminated.
constexpr double kQueryScales[] = {1, 2, 4, 8, 16};

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return 0x1p-53;
    case DType::kF32:
      return 0x1p-24;
    case DType::kF16:
      return 0x1p-11;
    case DType::kBF16:
      return 0x1p-8;
    case DType::kI32:
    case DType::kI64:
      break;
  }
  throw_internal(fmt::format("canary: no rounding rule for storage dtype {}", to_string(dtype)));
}

double largest_abs(const std::vector<double>& values) {
  double largest = 0;
  for (double value : values) {
    if (std::isfinite(value)) largest = std::max(largest, std::abs(value));
  }
  return largest;
}

// The allowed error of every element of each row, from the request's reference.
using Tolerances = std::vector<std::vector<double>>;  // [output][row]

Tolerances tolerances(const Problem& problem, const SampledOutputs& reference,
                      const CanaryInputs& inputs, const Sample& sample) {
  // Query-row outputs (out, lse, dq) take their row's score size; dk, dv and the tensor
  // gradients, which sum over the sampled rows, the largest.
  const std::vector<double> sizes = score_sizes(problem, inputs, sample);
  const GradientTermSizes terms = gradient_term_sizes(problem, inputs, sample, reference);
  const double largest_size = *std::max_element(sizes.begin(), sizes.end());
  const auto accumulation = [&](double size) { return kAccumulationRounding * (1 + size); };
  const auto rounding = [&](double size) {
    return unit_roundoff(problem.dtype()) + accumulation(size);
  };
  // Per sampled query row (pairs in order): the largest |v| of its pair's kv head.
  std::vector<double> value_magnitude;
  for (const SampledPair& pair : sample.pairs) {
    double largest = 0;
    for (std::int64_t kv = 0; kv < pair.kv_len; ++kv) {
      const std::int64_t base = row_offset(problem, inputs.v_view, true, pair.b, pair.h_kv, kv);
      for (std::int64_t i = 0; i < problem.head_dim_v(); ++i) {
        largest = std::max(largest, std::abs(inputs.v_view.load(base + i)));
      }
    }
    value_magnitude.insert(value_magnitude.end(), pair.rows.size(), largest);
  }
  Tolerances result;
  for (const OutputRows& output : reference) {
    std::vector<double> allowed;
    double output_largest = 0;
    for (const auto& row : output.rows) output_largest = std::max(output_largest, largest_abs(row));
    for (std::size_t r = 0; r < output.rows.size(); ++r) {
      double magnitude = 0;
      if (output.output == "out") {
        allowed.push_back(kToleranceFactor * rounding(sizes[r]) * value_magnitude[r]);
      } else if (output.output == "lse") {
        allowed.push_back(kToleranceFactor * accumulation(sizes[r]));
      } else if (output.output == "dq" || output.output == "dk" || output.output == "dv") {
        // The row's result, or the sum of its terms' sizes where they cancel.
        const std::vector<double>& term_sizes = output.output == "dq"   ? terms.dq
                                                : output.output == "dk" ? terms.dk
                                                                        : terms.dv;
        magnitude = std::max(
            {largest_abs(output.rows[r]), kRowFloorFraction * output_largest, term_sizes.at(r)});
        const double size = output.output == "dq" ? sizes[r] : largest_size;
        allowed.push_back(kToleranceFactor * rounding(size) * magnitude);
      } else {
        allowed.push_back(kToleranceFactor * rounding(largest_size) * output_largest);
      }
    }
    result.push_back(std::move(allowed));
  }
  return result;
}

// The element furthest past its tolerance.
struct Worst {
  double ratio = 0, error = 0, allowed = 0;
  std::string output, where;
};

double element_error(double candidate, double reference) {
  if (candidate == reference) return 0;  // also equal infinities (-inf LSE of an empty row)
  if (std::isnan(candidate) && std::isnan(reference)) return 0;  // NaN agrees with NaN only
  if (!std::isfinite(candidate) || !std::isfinite(reference)) return kInfinity;
  return std::abs(candidate - reference);
}

Worst compare(const SampledOutputs& candidate, const SampledOutputs& reference,
              const Tolerances& allowed) {
  Worst worst;
  for (std::size_t o = 0; o < reference.size(); ++o) {
    for (std::size_t r = 0; r < reference[o].rows.size(); ++r) {
      const std::vector<double>& expected = reference[o].rows[r];
      const std::vector<double>& got = candidate[o].rows[r];
      for (std::size_t i = 0; i < expected.size(); ++i) {
        const double error = element_error(got[i], expected[i]);
        const double limit = allowed[o][r];
        const double ratio = error == 0 ? 0 : (limit > 0 ? error / limit : kInfinity);
        if (ratio > worst.ratio) {
          worst = Worst{ratio, error, limit, reference[o].output, reference[o].where[r]};
        }
      }
    }
  }
  return worst;
}

bool is_constant(const Graph& graph, double value) {
  return graph.is_literal() && graph.node(graph.root()).literal == value;
}

std::vector<Variant> applicable_variants(const Problem& problem) {
  std::vector<Variant> variants;
  if (!problem.score_mod().is_identity_score()) variants.push_back(Variant::kScoreModDropped);
  // A mask the interval analysis proves keeps every element of this problem (causal with one
  // query row at the bottom right) is the same function as no mask.
  TileRect everything{0, problem.seq_len_q(), 0, problem.seq_len_kv()};
  if (problem.kv_cache()) {  // the canary cache's query and key positions
    everything = {problem.seq_len_kv(), 0, 0, 0};
    for (std::int64_t b = 0; b < problem.batch(); ++b) {
      const std::int64_t length = canary_cache_length(problem, b);
      const std::int64_t first = std::max<std::int64_t>(0, length - problem.seq_len_q_of(b));
      everything.query_begin = std::min(everything.query_begin, first);
      everything.query_end = std::max(everything.query_end, length);
      everything.key_end = std::max(everything.key_end, length);
    }
  }
  if (classify_tile(problem.mask_mod(), problem.leaf_ranges(), everything) != TileClass::kAllTrue) {
    variants.push_back(Variant::kMaskDropped);
  }
  if (problem.wants_backward() && !is_constant(derivative_wrt_score(problem.score_mod()), 1.0)) {
    variants.push_back(Variant::kDerivativeReplacedByOne);
  }
  return variants;
}

// A host buffer and, for an engine with its own memory, the device copy the plan reads or writes.
class Staging {
 public:
  explicit Staging(const DeviceMemory* memory, Device device) : memory_(memory), device_(device) {}
  ~Staging() {
    for (void* pointer : allocations_) memory_->release(pointer);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // The view the plan gets of `host` (whose strided view is `host_view`).
  TensorView stage(const HostTensor& host, TensorView host_view) {
    bytes_ += host.bytes();
    if (memory_ == nullptr) return host_view;
    void* pointer = memory_->allocate(host.bytes());
    allocations_.push_back(pointer);
    memory_->copy_to_device(pointer, host.data(), host.bytes());
    host_view.data = pointer;
    host_view.device = device_;
    return host_view;
  }
  void fetch(HostTensor& host, const TensorView& staged) const {
    if (memory_ == nullptr) return;
    memory_->copy_to_host(host.data(), staged.data, host.bytes());
  }
  void synchronize() const {
    if (memory_ != nullptr) memory_->synchronize();
  }
  std::size_t bytes() const { return bytes_; }

 private:
  const DeviceMemory* memory_;
  Device device_;
  std::vector<void*> allocations_;
  std::size_t bytes_ = 0;
};

// An output buffer filled with NaN (all bits set in every float dtype), so a row the plan never
// writes fails the comparison.
HostTensor poisoned_buffer(const TensorView& expected, TensorView& view) {
  HostTensor buffer = buffer_for(expected, view);
  std::memset(buffer.data(), 0xFF, buffer.bytes());
  return buffer;
}

std::vector<double> read_row(const TensorView& view, std::int64_t base, std::int64_t dim) {
  std::vector<double> values(static_cast<std::size_t>(dim));
  for (std::int64_t i = 0; i < dim; ++i) values[static_cast<std::size_t>(i)] = view.load(base + i);
  return values;
}

struct PlanRun {
  SampledOutputs outputs;
  double seconds = 0;
  std::size_t bytes = 0;
};

// Runs the plan on the canary inputs and reads back the sampled rows, in reference_outputs' order.
PlanRun run_plan(const Engine& engine, const Plan& plan, const CanaryInputs& inputs,
                 const Sample& sample) {
  const Problem& problem = plan.problem();
  Staging staging(engine.memory(), engine.device());
  TensorView out_view, lse_view;
  HostTensor out = poisoned_buffer(problem.expected("o"), out_view);
  HostTensor lse = poisoned_buffer(problem.expected("lse"), lse_view);
  ForwardArgs forward;
  forward.q = staging.stage(inputs.q, inputs.q_view);
  forward.k = staging.stage(inputs.k, inputs.k_view);
  forward.v = staging.stage(inputs.v, inputs.v_view);
  forward.out = staging.stage(out, out_view);
  forward.lse = staging.stage(lse, lse_view);
  for (const auto& [name, tensor] : inputs.tensors) {
    forward.tensors[name] = staging.stage(tensor, tensor.view());
  }
  if (problem.kv_cache()) {
    forward.page_table = staging.stage(inputs.page_table, inputs.page_table.view());
    forward.cache_lens = staging.stage(inputs.cache_lens, inputs.cache_lens.view());
  }

  const bool backward = problem.wants_backward();
  TensorView dq_view, dk_view, dv_view;
  HostTensor dq, dk, dv;
  std::map<std::string, HostTensor> gradients;
  BackwardArgs args;
  if (backward) {
    dq = poisoned_buffer(problem.expected("dq"), dq_view);
    dk = poisoned_buffer(problem.expected("dk"), dk_view);
    dv = poisoned_buffer(problem.expected("dv"), dv_view);
    args.q = forward.q, args.k = forward.k, args.v = forward.v;
    args.out = forward.out, args.lse = forward.lse, args.tensors = forward.tensors;
    args.dout = staging.stage(inputs.dout, inputs.dout_view);
    args.dq = staging.stage(dq, dq_view);
    args.dk = staging.stage(dk, dk_view);
    args.dv = staging.stage(dv, dv_view);
    for (const std::string& name : problem.score_mod().tensors()) {
      const TensorDecl& decl = problem.desc().tensors.at(name);
      if (!is_floating(decl.dtype)) continue;
      auto [slot, inserted] = gradients.emplace(name, HostTensor(DType::kF32, decl.shape));
      std::memset(slot->second.data(), 0xFF, slot->second.bytes());
      args.tensor_grads[name] = staging.stage(slot->second, slot->second.view());
    }
  }

  PlanRun run;
  const auto start = std::chrono::steady_clock::now();
  plan.forward(forward);
  if (backward) plan.backward(args);
  staging.synchronize();
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.bytes = staging.bytes();

  staging.fetch(out, forward.out);
  staging.fetch(lse, forward.lse);
  OutputRows out_rows{"out", {}, {}}, lse_rows{"lse", {}, {}}, dq_rows{"dq", {}, {}};
  for (const SampledPair& pair : sample.pairs) {
    for (std::int64_t row : pair.rows) {
      out_rows.rows.push_back(read_row(out_view,
                                       row_offset(problem, out_view, false, pair.b, pair.h, row),
                                       problem.head_dim_v()));
      lse_rows.rows.push_back({lse_view.load(lse_offset(problem, lse_view, pair.b, pair.h, row))});
    }
  }
  run.outputs = {std::move(out_rows), std::move(lse_rows)};
  if (!backward) return run;

  staging.fetch(dq, args.dq);
  staging.fetch(dk, args.dk);
  staging.fetch(dv, args.dv);
  for (const SampledPair& pair : sample.pairs) {
    for (std::int64_t row : pair.rows) {
      dq_rows.rows.push_back(read_row(dq_view,
                                      row_offset(problem, dq_view, false, pair.b, pair.h, row),
                                      problem.head_dim_qk()));
    }
  }
  OutputRows dk_rows{"dk", {}, {}}, dv_rows{"dv", {}, {}};
  for (const SampledKvHead& kv_head : sample.kv_heads) {
    for (std::int64_t kv = 0; kv < kv_head.kv_len; ++kv) {
      dk_rows.rows.push_back(
          read_row(dk_view, row_offset(problem, dk_view, true, kv_head.b, kv_head.h_kv, kv),
                   problem.head_dim_qk()));
      dv_rows.rows.push_back(
          read_row(dv_view, row_offset(problem, dv_view, true, kv_head.b, kv_head.h_kv, kv),
                   problem.head_dim_v()));
    }
  }
  run.outputs.push_back(std::move(dq_rows));
  run.outputs.push_back(std::move(dk_rows));
  run.outputs.push_back(std::move(dv_rows));
  for (auto& [name, gradient] : gradients) {
    staging.fetch(gradient, args.tensor_grads.at(name));
    std::vector<double> values(static_cast<std::size_t>(gradient.numel()));
    for (std::int64_t e = 0; e < gradient.numel(); ++e) {
      values[static_cast<std::size_t>(e)] = gradient.at(e);
    }
    run.outputs.push_back(OutputRows{"d" + name, {}, {std::move(values)}});
  }
  return run;
}

// The reference and the variants' distances from it at one input scale.
struct Attempt {
  double scale = 1;
  CanaryInputs inputs;
  SampledOutputs reference;
  Tolerances allowed;
  std::vector<CanaryVariant> variants;
  double weakest = kInfinity;  // the smallest variant ratio (infinite when none applies)
};

Attempt attempt(const Problem& problem, const Sample& sample, double scale,
                const CanaryOptions& options) {
  Attempt result;
  result.scale = scale;
  result.inputs = make_canary_inputs(problem, sample, scale, options.zero_queries);
  result.reference = reference_outputs(problem, result.inputs, sample, Variant::kRequest);
  result.allowed = tolerances(problem, result.reference, result.inputs, sample);
  for (Variant variant : applicable_variants(problem)) {
    const SampledOutputs mutant = reference_outputs(problem, result.inputs, sample, variant);
    const double ratio = compare(mutant, result.reference, result.allowed).ratio;
    result.variants.push_back(CanaryVariant{std::string(to_string(variant)), ratio});
    result.weakest = std::min(result.weakest, ratio);
  }
  return result;
}

}  // namespace

CanaryResult run_canary(const Engine& engine, const Plan& plan, const CanaryOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const Problem& problem = plan.problem();
  const Sample sample = sample_rows(problem);

  std::optional<Attempt> best;
  for (double scale : kQueryScales) {
    Attempt candidate = attempt(problem, sample, scale, options);
    const bool better = !best || candidate.weakest > best->weakest;
    if (better) best = std::move(candidate);
    if (best->weakest >= kDiscriminationFactor) break;
  }

  CanaryResult result;
  result.input_scale = best->scale;
  result.variants = best->variants;
  for (const CanaryVariant& variant : best->variants) {
    if (variant.ratio >= kDiscriminationFactor) continue;
    result.note += fmt::format("{}{} is only {:.3g} tolerances away",
                               result.note.empty() ? "" : "; ", variant.name, variant.ratio);
  }
  if (!result.note.empty()) {
    result.note = fmt::format(
        "the canary inputs do not discriminate every mutant at any q scale up to {} ({}; "
        "compared at q scale {})",
        kQueryScales[std::size(kQueryScales) - 1], result.note, best->scale);
  }

  const PlanRun run = run_plan(engine, plan, best->inputs, sample);
  result.plan_seconds = run.seconds;
  result.bytes = run.bytes;
  const Worst worst = compare(run.outputs, best->reference, best->allowed);
  result.largest_error_ratio = worst.ratio;
  if (worst.ratio > 1) {
    result.passed = false;
    result.reason = fmt::format(
        "canary: engine {} computed {} {:.3g} away from cpu_ref where {:.3g} is allowed ({}; {}, "
        "q scaled by {})",
        plan.info().engine, worst.output, worst.error, worst.allowed, worst.where,
        to_string(problem.dtype()), best->scale);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace flexattn::detail
