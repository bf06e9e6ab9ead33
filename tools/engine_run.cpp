// Choosing a plan across devices, making inputs, running a plan (with data moved to and from the
// engine's device), and the float64 reference the --check and demo compare with.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>
#include <set>

#include "cli.hpp"

namespace flexattn::cli {

namespace {

// Streams of the random inputs, so q, k, v and dout differ for one seed.
enum class Stream : std::uint64_t { kQ = 1, kK, kV, kDout };

// Tile edge of the kept-fraction estimate: small enough that a causal diagonal costs little
// (the mixed tiles along it count half), large enough to stay cheap for long sequences.
constexpr std::int64_t kMaskTile = 64;

HostTensor random_like(const TensorView& expected, std::uint64_t seed, Stream stream) {
  HostTensor tensor(expected.dtype, expected.shape);
  tensor.fill_normal(hash_combine(seed, static_cast<std::uint64_t>(stream)));
  return tensor;
}

HostTensor zeros_like(const TensorView& expected) {
  return HostTensor(expected.dtype, expected.shape);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Host tensors as views an engine can use: the host memory itself for CPU engines, device copies
// otherwise (outputs are copied back by finish()).
class Staging {
 public:
  Staging(const DeviceMemory* memory, Device device) : memory_(memory), device_(device) {}
  ~Staging() {
    for (void* pointer : allocations_) memory_->release(pointer);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  TensorView input(const HostTensor& host) {
    TensorView view = host.view();
    if (memory_ == nullptr) return view;
    view.data = allocate(host.bytes());
    memory_->copy_to_device(view.data, host.data(), host.bytes());
    view.device = device_;
    return view;
  }

  TensorView output(HostTensor& host) {
    TensorView view = input(host);  // zero-filled, like the host tensor
    if (memory_ != nullptr) outputs_.push_back({view.data, &host});
    return view;
  }

  void synchronize() const {
    if (memory_ != nullptr) memory_->synchronize();
  }

  // Device scratch lent to every call (what a framework passes from its allocator), so a timed
  // call does not allocate; none for CPU engines or a plan that needs none.
  Workspace workspace(std::size_t bytes) {
    if (memory_ == nullptr || bytes == 0) return {};
    return Workspace{allocate(bytes), bytes};
  }

  void finish() {
    synchronize();
    for (const auto& [device_pointer, host] : outputs_) {
      memory_->copy_to_host(host->data(), device_pointer, host->bytes());
    }
  }

 private:
  void* allocate(std::size_t bytes) {
    void* pointer = memory_->allocate(bytes);
    allocations_.push_back(pointer);
    return pointer;
  }

  const DeviceMemory* memory_;
  Device device_;
  std::vector<void*> allocations_;
  std::vector<std::pair<void*, HostTensor*>> outputs_;
};

// Names of the floating-point tensors the modifiers read (their gradients are computed).
std::vector<std::string> float_tensors_read(const Problem& problem) {
  std::set<std::string> names;
  for (const Graph* graph : {&problem.score_mod(), &problem.mask_mod()}) {
    for (const std::string& name : graph->tensors()) {
      if (is_floating(problem.desc().tensors.at(name).dtype)) names.insert(name);
    }
  }
  return {names.begin(), names.end()};
}

}  // namespace

Selection select_plan(Context& context, const ProblemDesc& desc) {
  const Policy& policy = context.options().policy;
  std::vector<Device> devices;
  for (const auto& engine : context.engines()) {
    if (!policy.allows(engine->name()) || !engine->available()) continue;
    if (std::find(devices.begin(), devices.end(), engine->device()) == devices.end()) {
      devices.push_back(engine->device());
    }
  }
  if (devices.empty()) {
    const auto* forced = policy.force.empty() ? nullptr : context.find_engine(policy.force);
    devices.push_back(forced != nullptr ? (*forced)->device() : Device::kCpu);
  }
  std::optional<Error> first_failure;
  for (Device device : devices) {
    Problem problem = problem_on(desc, device);
    try {
      std::shared_ptr<const Plan> plan = context.select(problem);
      const auto* engine = context.find_engine(plan->info().engine);
      return Selection{std::move(problem), std::move(plan), engine != nullptr ? *engine : nullptr};
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kUnsupported) throw;
      if (!first_failure) first_failure = error;
    }
  }
  if (devices.size() == 1) throw *first_failure;
  // Several devices failed: say why each engine refused the problem on its own device.
  std::string message = fmt::format("no engine can run this problem ({})",
                                    problem_summary(problem_on(desc, Device::kCpu)));
  for (const Verdict& verdict : explain_all(context, desc)) {
    std::string reason = policy.refusal(verdict.engine);
    if (reason.empty()) reason = verdict.support.reason();
    message += fmt::format("\n  {}: {}", verdict.engine, reason);
  }
  throw_unsupported(message);
}

std::vector<Verdict> explain_all(const Context& context, const ProblemDesc& desc) {
  std::map<Device, Problem> problems;
  std::vector<Verdict> verdicts;
  for (const auto& engine : context.engines()) {
    auto found = problems.find(engine->device());
    if (found == problems.end()) {
      found = problems.emplace(engine->device(), problem_on(desc, engine->device())).first;
    }
    Verdict verdict;
    verdict.engine = std::string(engine->name());
    verdict.allowed = context.options().policy.allows(engine->name());
    verdict.support = engine->supports(found->second);
    verdicts.push_back(std::move(verdict));
  }
  return verdicts;
}

Inputs make_inputs(const Problem& problem, Setup& setup, std::uint64_t seed,
                   const std::string& dout_file) {
  Inputs inputs;
  inputs.q = setup.q ? std::move(*setup.q) : random_like(problem.expected("q"), seed, Stream::kQ);
  inputs.k = setup.k ? std::move(*setup.k) : random_like(problem.expected("k"), seed, Stream::kK);
  inputs.v = setup.v ? std::move(*setup.v) : random_like(problem.expected("v"), seed, Stream::kV);
  if (problem.wants_backward()) {
    const TensorView expected = problem.expected("dout");
    if (dout_file.empty()) {
      inputs.dout = random_like(expected, seed, Stream::kDout);
    } else {
      HostTensor dout = read_npy(dout_file);
      if (dout.shape() != expected.shape) {
        throw_invalid(fmt::format("shape mismatch: --dout '{}' is {} but the output is {}",
                                  dout_file, dout.view().describe(), expected.describe()));
      }
      inputs.dout = dout.to(problem.dtype());
    }
  }
  inputs.tensors = std::move(setup.tensors);
  if (problem.kv_cache()) {
    const KvCacheDesc& cache = *problem.kv_cache();
    inputs.cache_lens = HostTensor(DType::kI32, problem.expected("cache_lens").shape);
    for (std::int64_t b = 0; b < problem.batch(); ++b) {
      inputs.cache_lens.set(b, static_cast<double>(setup.cache_lens[static_cast<std::size_t>(b)]));
    }
    if (setup.page_table) {
      inputs.page_table = std::move(*setup.page_table);
    } else {  // every sequence its own pages, in a seeded random order
      inputs.page_table = HostTensor(DType::kI32, problem.expected("page_table").shape);
      std::vector<std::int32_t> order(static_cast<std::size_t>(cache.pages));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
      for (std::int64_t i = 0; i < inputs.page_table.numel(); ++i) {
        inputs.page_table.set(i, order[static_cast<std::size_t>(i % cache.pages)]);
      }
    }
  }
  return inputs;
}

Outputs run_plan(const Selection& selection, const Inputs& inputs, int repeat) {
  const Problem& problem = selection.problem;
  const Plan& plan = *selection.plan;
  Staging staging(selection.engine->memory(), selection.engine->device());
  Outputs outputs;
  outputs.out = zeros_like(problem.expected("o"));
  outputs.lse = zeros_like(problem.expected("lse"));

  ForwardArgs forward;
  forward.q = staging.input(inputs.q);
  forward.k = staging.input(inputs.k);
  forward.v = staging.input(inputs.v);
  forward.out = staging.output(outputs.out);
  forward.lse = staging.output(outputs.lse);
  for (const auto& [name, tensor] : inputs.tensors) forward.tensors[name] = staging.input(tensor);
  if (problem.kv_cache()) {
    forward.page_table = staging.input(inputs.page_table);
    forward.cache_lens = staging.input(inputs.cache_lens);
  }

  forward.workspace = staging.workspace(plan.workspace_bytes(Pass::kForward));

  // CPU engines: the median of `repeat` calls. GPU engines: `repeat` calls enqueued back to back
  // and the time per call once the device has finished them, as the peers' timings (CUDA events
  // around calls launched back to back) count it: the device's time, without one launch and one
  // synchronisation per call.
  const bool back_to_back = problem.device() != Device::kCpu;
  const auto call_seconds = [&](const auto& body) {
    const int calls = std::max(repeat, 1);
    if (back_to_back) {
      staging.synchronize();
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) body();
      staging.synchronize();
      return seconds_since(start) / calls;
    }
    std::vector<double> times;
    for (int i = 0; i < calls; ++i) {
      const auto start = std::chrono::steady_clock::now();
      body();
      times.push_back(seconds_since(start));
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  outputs.forward_seconds = call_seconds([&] { plan.forward(forward); });

  if (problem.wants_backward()) {
    outputs.dq = zeros_like(problem.expected("dq"));
    outputs.dk = zeros_like(problem.expected("dk"));
    outputs.dv = zeros_like(problem.expected("dv"));
    const DType gradient_dtype = problem.dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
    for (const std::string& name : float_tensors_read(problem)) {
      outputs.tensor_grads.emplace(
          name, HostTensor(gradient_dtype, problem.desc().tensors.at(name).shape));
    }
    BackwardArgs backward;
    backward.q = forward.q;
    backward.k = forward.k;
    backward.v = forward.v;
    backward.out = forward.out;
    backward.lse = forward.lse;
    backward.dout = staging.input(inputs.dout);
    backward.dq = staging.output(outputs.dq);
    backward.dk = staging.output(outputs.dk);
    backward.dv = staging.output(outputs.dv);
    backward.tensors = forward.tensors;
    for (auto& [name, gradient] : outputs.tensor_grads) {
      backward.tensor_grads[name] = staging.output(gradient);
    }
    backward.workspace = staging.workspace(plan.workspace_bytes(Pass::kBackward));
    outputs.backward_seconds = call_seconds([&] { plan.backward(backward); });
  }
  staging.finish();
  return outputs;
}

Outputs run_reference(const Problem& problem, const Inputs& inputs) {
  std::shared_ptr<const Engine> reference;
  for (const auto& engine : builtin_engines()) {
    if (engine->name() == "cpu_ref") reference = engine;
  }
  if (!reference) throw_internal("this build has no cpu_ref engine");
  ProblemDesc desc = problem.desc();
  desc.dtype = DType::kF64;
  desc.device = Device::kCpu;
  desc.q_strides = desc.k_strides = desc.v_strides = desc.o_strides = std::nullopt;
  const Problem reference_problem(desc);
  Inputs converted;
  converted.q = inputs.q.to(DType::kF64);
  converted.k = inputs.k.to(DType::kF64);
  converted.v = inputs.v.to(DType::kF64);
  if (problem.wants_backward()) converted.dout = inputs.dout.to(DType::kF64);
  for (const auto& [name, tensor] : inputs.tensors) {
    converted.tensors.emplace(name, tensor.to(tensor.dtype()));
  }
  if (problem.kv_cache()) {
    converted.page_table = inputs.page_table.to(DType::kI32);
    converted.cache_lens = inputs.cache_lens.to(DType::kI32);
  }
  Selection selection{reference_problem, reference->plan(reference_problem), reference};
  return run_plan(selection, converted, 1);
}

double max_abs_error(const HostTensor& a, const HostTensor& b) {
  if (a.shape() != b.shape()) {
    throw_internal(fmt::format("comparing {} with {}", a.view().describe(), b.view().describe()));
  }
  const TensorView x = a.view(), y = b.view();
  double worst = 0.0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double u = x.load(i), w = y.load(i);
    if (u == w) continue;                          // equal infinities
    if (std::isnan(u) && std::isnan(w)) continue;  // both undefined: they agree
    const double error = std::abs(u - w);
    if (std::isnan(error)) return error;
    worst = std::max(worst, error);
  }
  return worst;
}

double max_abs_value(const HostTensor& tensor) {
  const TensorView view = tensor.view();
  double largest = 0.0;
  for (std::int64_t i = 0; i < view.numel(); ++i) {
    const double value = std::abs(view.load(i));
    if (std::isfinite(value)) largest = std::max(largest, value);
  }
  return largest;
}

CacheWork cache_work(const Problem& problem, const Inputs& inputs) {
  CacheWork work;
  if (!problem.kv_cache()) return work;
  work.paged = true;
  const double element = static_cast<double>(size_of(problem.dtype()));
  const auto dims = static_cast<double>(problem.head_dim_qk() + problem.head_dim_v());
  for (std::int64_t b = 0; b < problem.batch(); ++b) {
    const double length = inputs.cache_lens.at(b);
    work.kv_bytes += length * static_cast<double>(problem.heads_kv()) * dims * element;
    work.flops += 2.0 * dims * length * static_cast<double>(problem.seq_len_q_of(b)) *
                  static_cast<double>(problem.heads_q());
  }
  return work;
}

double kept_fraction(const Problem& problem) {
  const Graph& mask = problem.mask_mod();
  if (mask.is_literal()) return mask.node(mask.root()).literal != 0.0 ? 1.0 : 0.0;
  const LeafRanges ranges = problem.leaf_ranges();
  double kept = 0.0;
  for (std::int64_t q = 0; q < problem.seq_len_q(); q += kMaskTile) {
    for (std::int64_t kv = 0; kv < problem.seq_len_kv(); kv += kMaskTile) {
      const TileRect tile{q, std::min(q + kMaskTile, problem.seq_len_q()), kv,
                          std::min(kv + kMaskTile, problem.seq_len_kv())};
      const double area = static_cast<double>((tile.query_end - q) * (tile.key_end - kv));
      switch (classify_tile(mask, ranges, tile)) {
        case TileClass::kAllTrue:
          kept += area;
          break;
        case TileClass::kMixed:
          kept += 0.5 * area;
          break;
        case TileClass::kAllFalse:
          break;
      }
    }
  }
  return kept /
         (static_cast<double>(problem.seq_len_q()) * static_cast<double>(problem.seq_len_kv()));
}

void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs,
                        const std::vector<std::pair<std::string, std::string>>& inputs) {
  // (flag, path, resolved file) of every named input and output, inputs first.
  struct Named {
    std::string flag, path, file;
  };
  std::vector<Named> seen;
  for (const auto& [flag, path] : inputs) {
    if (!path.empty()) seen.push_back({flag, path, resolved_file(path)});
  }
  const std::size_t input_count = seen.size();
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    check_output_file(path);
    std::error_code error;
    const std::string file = resolved_file(path);
    for (std::size_t i = 0; i < seen.size(); ++i) {
      const bool same = seen[i].file == file ||
                        std::filesystem::equivalent(seen[i].path, path, error);  // hard links
      if (!same) continue;
      if (i < input_count) {
        throw_invalid(fmt::format("{} '{}' is the input of {} ('{}'): outputs never replace inputs",
                                  flag, path, seen[i].flag, seen[i].path));
      }
      throw_invalid(fmt::format("{} '{}' and {} '{}' name the same file", seen[i].flag,
                                seen[i].path, flag, path));
    }
    seen.push_back({flag, path, file});
  }
}

}  // namespace flexattn::cli
