// Times a GPU engine (`cuda`, or `cudnn` where this build registers it) on the GPU with CUDA
// events (warm-up, then the median of repeated launches): the forward pass, and forward+backward
// (a forward, then the backward that reads its output and LSE, timed together). TFLOP/s are
// counted as FlashAttention and the peers count them: forward 4 B H Sq Skv D, halved for causal
// masks; backward 2.5x the forward; forward+backward 3.5x. Also measures plan time: cold (a fresh
// engine instance; for cuda an NVRTC compile into an empty disk cache) and, for cuda, warm
// (another fresh instance, whose kernel comes from the disk cache).
//
//   bench_cuda_forward [--quick | --sweep | --dims [--head-dims D,...]] [--pass fwd|fwdbwd|both]
//                      [--engine cuda|cudnn] [--json out.json] [--only KEY,...]
// --sweep: the forward sequence sweep alone; --dims: head dims 256, 192/128, 96, 80 and 32 alone
// (--head-dims: only those q/k head dims, e.g. 192 or 256,192).
// --only keeps the problems whose key is listed (e.g. d128/causal/softcap; with --dims, e.g.
// d256/none/softcap or d192v128/none/none; sweep rows never match): a short run of a few rows,
// e.g. under a profiler (scripts/gpu kernel-times).
//
// An engine this build lacks or this machine cannot run, and a problem the engine refuses, are
// reported as skip lines (with the engine's reason), not errors. A problem the engine fails on is
// an error line (and row); the other problems are still timed, and the exit status is 1.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "flexattn/flexattn.hpp"

namespace {

using flexattn::DType;
using flexattn::ProblemDesc;

constexpr int kWarmupLaunches = 5;
constexpr int kTimedLaunches = 20;
// FlashAttention's count: the backward does five products of the forward's size where the
// forward does two.
constexpr double kBackwardFlopsRatio = 2.5;

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw std::runtime_error(fmt::format("{} failed: {}", call, cudaGetErrorString(status)));
  }
}

enum class Pass { kForward, kForwardBackward };

const char* pass_name(Pass pass) {
  switch (pass) {
    case Pass::kForward:
      return "fwd";
    case Pass::kForwardBackward:
      return "fwdbwd";
  }
  return "?";
}

struct Variant {
  std::string name;
  std::string score_mod;  // IR text; empty for none
  std::string tensor;     // the extra tensor it reads: "slopes" (heads), "bias" (heads, seq, seq)
  bool learned = false;   // the backward also computes the tensor's gradient
};

const Variant kNone{"none", "", "", false};
const Variant kSoftcap{"softcap", "30 * tanh(score / 30)", "", false};
// Softcap whose tanh arguments exceed 0.6 in every tile (cap 0.5 on N(0, 1) scores): the kernels
// take the exponential tanh everywhere, where softcap 30 on these inputs takes its small form
// (small_tanh_tile). The same work per element as softcap 30 on scores beyond 18.
const Variant kSoftcapWide{"softcap_wide", "0.5 * tanh(score / 0.5)", "", false};
const Variant kAlibi{"alibi", "score + slopes[h] * (kv - q)", "slopes", false};
const Variant kBias{"bias", "score + bias[h, q, kv]", "bias", false};
const Variant kAlibiGrad{"alibi_grad", kAlibi.score_mod, "slopes", true};
const Variant kBiasGrad{"bias_grad", kBias.score_mod, "bias", true};

struct Config {
  std::int64_t batch, heads, seq, head_dim;
  bool causal;
  Variant variant;
  Pass pass;
  std::int64_t head_dim_v = 0;  // 0: head_dim (MLA's 192/128 sets it)

  std::int64_t dim_v() const { return head_dim_v == 0 ? head_dim : head_dim_v; }
  // "128", or "192/128" where V is narrower.
  std::string dims_text() const {
    return dim_v() == head_dim ? std::to_string(head_dim) : fmt::format("{}/{}", head_dim, dim_v());
  }
};

struct Result {
  double median_ms = 0.0;
  double tflops = 0.0;
  double plan_cold_s = 0.0;
  double plan_warm_s = -1.0;  // negative: not measured
  std::string description;
  std::string skipped;  // the engine's reason when it refuses the problem
  std::string error;    // what the engine threw on a problem it supports
};

// A new instance of the named built-in engine (empty memory caches), or null.
std::shared_ptr<const flexattn::Engine> fresh_engine(const std::string& name) {
  for (const auto& engine : flexattn::builtin_engines()) {
    if (engine->name() == name) return engine;
  }
  return nullptr;
}

ProblemDesc describe(const Config& c) {
  ProblemDesc desc;
  desc.batch = c.batch;
  desc.heads_q = c.heads;
  desc.seq_len_q = c.seq;
  desc.head_dim_qk = c.head_dim;
  desc.head_dim_v = c.dim_v();
  desc.layout = flexattn::Layout::kBHSD;
  desc.dtype = DType::kBF16;
  desc.device = flexattn::Device::kCuda;
  desc.direction = c.pass == Pass::kForward ? flexattn::Direction::kForward
                                            : flexattn::Direction::kForwardBackward;
  desc.want_lse = true;
  if (c.variant.tensor == "slopes") desc.tensors["slopes"] = {DType::kF32, {c.heads}};
  if (c.variant.tensor == "bias") desc.tensors["bias"] = {DType::kBF16, {c.heads, c.seq, c.seq}};
  if (!c.variant.score_mod.empty()) {
    desc.score_mod = flexattn::ir::parse(c.variant.score_mod, desc.scope());
  }
  if (c.causal) desc.mask_mod = flexattn::ir::parse("q >= kv", desc.scope());
  return desc;
}

// What an input buffer holds: N(0, 1) values (never zeros: they run faster), or ALiBi's slopes
// 2^(-8 (h + 1) / heads), as the peers use (random slopes would make every row's softmax a spike).
enum class Contents { kUnset, kNormal, kAlibiSlopes };

// A device buffer of a view's shape and dtype: an input with `contents`, or an output (kUnset).
struct DeviceTensor {
  DeviceTensor(const flexattn::DeviceMemory& memory, flexattn::TensorView layout, Contents contents,
               std::uint64_t seed)
      : memory_(memory), view(std::move(layout)) {
    flexattn::HostTensor host(view.dtype, view.shape);
    view.data = memory_.allocate(host.bytes());
    view.device = flexattn::Device::kCuda;
    switch (contents) {
      case Contents::kUnset:
        return;
      case Contents::kNormal:
        host.fill_normal(seed);
        break;
      case Contents::kAlibiSlopes:
        for (std::int64_t h = 0; h < host.numel(); ++h) {
          host.set(
              h, std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(host.numel())));
        }
        break;
    }
    memory_.copy_to_device(view.data, host.data(), host.bytes());
  }
  ~DeviceTensor() { memory_.release(view.data); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  const flexattn::DeviceMemory& memory_;
  flexattn::TensorView view;
};

// Random inputs on the device, made once per (role, dtype, shape) and shared by every problem of
// the run: filling them on the host is slower than everything timed (the dense bias alone is
// 268M values).
class InputCache {
 public:
  explicit InputCache(const flexattn::DeviceMemory& memory) : memory_(memory) {}
  const flexattn::TensorView& get(const std::string& role, const flexattn::TensorView& layout) {
    const std::string key = fmt::format("{} {}", role, layout.describe());
    auto found = tensors_.find(key);
    if (found == tensors_.end()) {
      const std::uint64_t seed = tensors_.size() + 1;
      const Contents contents = role == "slopes" ? Contents::kAlibiSlopes : Contents::kNormal;
      found = tensors_.emplace(key, std::make_unique<DeviceTensor>(memory_, layout, contents, seed))
                  .first;
    }
    return found->second->view;
  }

 private:
  const flexattn::DeviceMemory& memory_;
  std::map<std::string, std::unique_ptr<DeviceTensor>> tensors_;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Median milliseconds of `work` over kTimedLaunches, after kWarmupLaunches untimed calls.
template <class Work>
double median_ms(Work work) {
  for (int i = 0; i < kWarmupLaunches; ++i) work();
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::vector<cudaEvent_t> events(2 * kTimedLaunches);
  for (cudaEvent_t& event : events) check(cudaEventCreate(&event), "cudaEventCreate");
  for (int i = 0; i < kTimedLaunches; ++i) {
    check(cudaEventRecord(events[2 * i]), "cudaEventRecord");
    work();
    check(cudaEventRecord(events[2 * i + 1]), "cudaEventRecord");
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::vector<float> times(kTimedLaunches);
  for (int i = 0; i < kTimedLaunches; ++i) {
    check(cudaEventElapsedTime(&times[i], events[2 * i], events[2 * i + 1]),
          "cudaEventElapsedTime");
  }
  for (cudaEvent_t event : events) cudaEventDestroy(event);
  std::sort(times.begin(), times.end());
  return times[kTimedLaunches / 2];
}

Result run(const std::string& engine_name, const Config& config, InputCache& inputs) {
  Result result;
  const flexattn::Problem problem(describe(config));
  // Cold: a fresh engine (for cuda also an empty disk cache: FLEXATTN_CACHE_DIR is a new folder).
  // Warm: cuda only, whose compiled kernels outlive an engine instance in the disk cache; other
  // engines keep nothing across instances, so planning again would only double the run's time.
  const bool has_disk_cache = engine_name == "cuda";
  auto engine = fresh_engine(engine_name);
  if (const flexattn::Support support = engine->supports(problem); !support) {
    result.skipped = support.reason();
    return result;
  }
  auto start = std::chrono::steady_clock::now();
  std::unique_ptr<flexattn::Plan> plan = engine->plan(problem);
  result.plan_cold_s = seconds_since(start);
  if (has_disk_cache) {
    plan.reset();
    engine = fresh_engine(engine_name);
    start = std::chrono::steady_clock::now();
    plan = engine->plan(problem);
    result.plan_warm_s = seconds_since(start);
  }
  result.description = plan->info().description;

  const flexattn::DeviceMemory& memory = *engine->memory();
  const auto output = [&](const flexattn::TensorView& layout) {
    return std::make_unique<DeviceTensor>(memory, layout, Contents::kUnset, 0);
  };
  flexattn::ForwardArgs args;
  args.q = inputs.get("q", problem.expected("q"));
  args.k = inputs.get("k", problem.expected("k"));
  args.v = inputs.get("v", problem.expected("v"));
  const auto out = output(problem.expected("o"));
  const auto lse = output(problem.expected("lse"));
  args.out = out->view;
  args.lse = lse->view;
  for (const auto& [name, decl] : problem.desc().tensors) {
    flexattn::TensorView view;
    view.dtype = decl.dtype;
    view.shape = decl.shape;
    view.strides = flexattn::contiguous_strides(decl.shape);
    args.tensors[name] = inputs.get(name, view);
  }

  // 2 B H S^2 (D_qk + D_v): Q K^T and P V (4 B H S^2 D where both are D).
  double flops = 2.0 * static_cast<double>(config.batch * config.heads) *
                 static_cast<double>(config.seq) * static_cast<double>(config.seq) *
                 static_cast<double>(config.head_dim + config.dim_v()) *
                 (config.causal ? 0.5 : 1.0);
  if (config.pass == Pass::kForward) {
    result.median_ms = median_ms([&] { plan->forward(args); });
  } else {
    const auto dq = output(problem.expected("dq"));
    const auto dk = output(problem.expected("dk"));
    const auto dv = output(problem.expected("dv"));
    std::unique_ptr<DeviceTensor> learned_gradient;
    flexattn::BackwardArgs backward;
    backward.q = args.q;
    backward.k = args.k;
    backward.v = args.v;
    backward.out = args.out;
    backward.lse = args.lse;
    backward.dout = inputs.get("dout", problem.expected("dout"));
    backward.dq = dq->view;
    backward.dk = dk->view;
    backward.dv = dv->view;
    backward.tensors = args.tensors;
    if (config.variant.learned) {
      flexattn::TensorView view = args.tensors.at(config.variant.tensor);
      view.dtype = DType::kF32;
      learned_gradient = output(view);
      backward.tensor_grads[config.variant.tensor] = learned_gradient->view;
    }
    result.median_ms = median_ms([&] {
      plan->forward(args);
      plan->backward(backward);
    });
    flops *= 1.0 + kBackwardFlopsRatio;
  }
  result.tflops = flops / (result.median_ms * 1e-3) / 1e12;
  return result;
}

// The key --only matches: d<head dim>/<causal|none>/<variant>.
std::string problem_key(const Config& c) {
  return fmt::format("d{}{}/{}/{}", c.head_dim,
                     c.dim_v() == c.head_dim ? std::string() : fmt::format("v{}", c.dim_v()),
                     c.causal ? "causal" : "none", c.variant.name);
}

// The warm plan time in seconds, or `absent` where it was not measured.
std::string warm_text(const Result& r, const char* absent) {
  return r.plan_warm_s < 0.0 ? absent : fmt::format("{:.4f}", r.plan_warm_s);
}

// A JSON string literal of `text` (reasons may hold quotes and paths).
std::string json_text(const std::string& text) {
  std::string quoted = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') quoted += '\\';
    quoted += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
  }
  return quoted + "\"";
}

std::string json_row(const std::string& engine, const std::string& group, const Config& c,
                     const Result& r) {
  const std::string common = fmt::format(
      R"("group": "{}", "engine": "{}", "pass": "{}", "name": "{}_{}", "variant": "{}", )"
      R"("B": {}, "H": {}, "S": {}, "D": {}, "Dv": {}, "causal": {})",
      group, engine, pass_name(c.pass), engine, c.variant.name, c.variant.name, c.batch, c.heads,
      c.seq, c.head_dim, c.dim_v(), c.causal ? "true" : "false");
  if (!r.error.empty()) return fmt::format(R"({{{}, "error": {}}})", common, json_text(r.error));
  if (!r.skipped.empty()) {
    return fmt::format(R"({{{}, "skipped": {}}})", common, json_text(r.skipped));
  }
  return fmt::format(
      R"({{{}, "ms": {:.5f}, "tflops": {:.2f}, "plan_cold_s": {:.4f}, "plan_warm_s": {}}})", common,
      r.median_ms, r.tflops, r.plan_cold_s, warm_text(r, "null"));
}

void write_json(const std::string& path, const std::string& engine, const std::string& skipped,
                const std::vector<std::string>& rows) {
  if (path.empty()) return;
  std::ofstream file(path);
  file << "{\"device\": \"cuda\", \"engine\": " << json_text(engine);
  if (!skipped.empty()) file << ", \"skipped\": " << json_text(skipped);
  file << ", \"rows\": [\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    file << "  " << rows[i] << (i + 1 < rows.size() ? ",\n" : "\n");
  }
  file << "]}\n";
}

// The head dims beside 64 and 128 that models use (Gemma's 256, MLA's 192 with a 128-wide V, 96
// and 80, 32), timed alone with --dims: no modifier and softcap 30, no mask and causal, the main
// shapes otherwise. {q/k, v}.
constexpr std::pair<std::int64_t, std::int64_t> kOtherHeadDims[] = {
    {256, 256}, {192, 128}, {96, 96}, {80, 80}, {32, 32}};

// The problems of a run. main: the issue's shapes, every modifier, forward and forward+backward
// (--quick times forward+backward at head dim 128 only, to stay within a short run; the
// full run adds the learned-tensor gradients). sweep (full run only): constant tokens per launch
// (batch x seq = 32k), as the plot's peers are measured. dims (--dims only): kOtherHeadDims.
std::vector<std::pair<std::string, Config>> configs(bool quick, bool forward, bool backward,
                                                    bool dims) {
  std::vector<std::pair<std::string, Config>> result;
  if (dims) {
    for (const auto& [head_dim, head_dim_v] : kOtherHeadDims) {
      for (bool causal : {false, true}) {
        for (const Variant& variant : {kNone, kSoftcap}) {
          if (forward) {
            result.push_back({"dims", Config{4, 16, 4096, head_dim, causal, variant, Pass::kForward,
                                             head_dim_v}});
          }
          if (backward) {
            result.push_back({"dims", Config{4, 16, 4096, head_dim, causal, variant,
                                             Pass::kForwardBackward, head_dim_v}});
          }
        }
      }
    }
    return result;
  }
  for (std::int64_t head_dim : {128, 64}) {
    for (bool causal : {false, true}) {
      std::vector<Variant> variants = {kNone, kSoftcap, kAlibi, kBias};
      if (head_dim == 128 && !causal) variants.insert(variants.begin() + 2, kSoftcapWide);
      for (const Variant& variant : variants) {
        if (forward) {
          result.push_back(
              {"main", Config{4, 16, 4096, head_dim, causal, variant, Pass::kForward}});
        }
        if (backward && (!quick || head_dim == 128)) {
          result.push_back(
              {"main", Config{4, 16, 4096, head_dim, causal, variant, Pass::kForwardBackward}});
        }
      }
      if (backward && !quick && head_dim == 128) {
        for (const Variant& variant : {kAlibiGrad, kBiasGrad}) {
          result.push_back(
              {"main", Config{4, 16, 4096, head_dim, causal, variant, Pass::kForwardBackward}});
        }
      }
    }
  }
  if (!quick && forward) {
    constexpr std::int64_t kTokens = 32768;
    for (std::int64_t seq : {512, 1024, 2048, 4096, 8192, 16384}) {
      for (bool causal : {false, true}) {
        for (const Variant& variant : {kNone, kSoftcap}) {
          result.push_back(
              {"sweep", Config{kTokens / seq, 16, seq, 128, causal, variant, Pass::kForward}});
        }
      }
    }
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  bool sweep_only = false;  // --sweep: the sequence sweep alone (for the plot)
  bool dims = false;        // --dims: the other head dims alone
  std::string json_path, pass = "both", engine_name = "cuda";
  std::set<std::string> only;
  std::set<std::int64_t> head_dims;  // --head-dims: the --dims rows of these q/k head dims
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (arg == "--pass" && i + 1 < argc) {
      pass = argv[++i];
    } else if (arg == "--engine" && i + 1 < argc) {
      engine_name = argv[++i];
    } else if (arg == "--sweep") {
      sweep_only = true;
    } else if (arg == "--dims") {
      dims = true;
    } else if (arg == "--head-dims" && i + 1 < argc) {
      std::stringstream list(argv[++i]);
      for (std::string dim; std::getline(list, dim, ',');) {
        char* end = nullptr;
        const long long value = std::strtoll(dim.c_str(), &end, 10);
        if (dim.empty() || *end != '\0' || value <= 0) {
          fmt::print(stderr, "bench_cuda_forward: --head-dims takes head dims such as 256,192\n");
          return 2;
        }
        head_dims.insert(value);
      }
    } else if (arg == "--only" && i + 1 < argc) {
      std::stringstream list(argv[++i]);
      for (std::string key; std::getline(list, key, ',');) {
        if (!key.empty()) only.insert(key);
      }
    } else {
      fmt::print(stderr,
                 "usage: bench_cuda_forward [--quick | --sweep | --dims [--head-dims D,...]] "
                 "[--pass fwd|fwdbwd|both] "
                 "[--engine cuda|cudnn] [--json out.json] [--only d128/causal/softcap,...]\n");
      return 2;
    }
  }
  if (pass != "fwd" && pass != "fwdbwd" && pass != "both") {
    fmt::print(stderr, "bench_cuda_forward: --pass must be fwd, fwdbwd or both\n");
    return 2;
  }
  if (!head_dims.empty() && !dims) {
    fmt::print(stderr, "bench_cuda_forward: --head-dims selects among the --dims rows\n");
    return 2;
  }
  if (dims && (quick || sweep_only)) {
    fmt::print(stderr,
               "bench_cuda_forward: --dims times the other head dims alone (no --quick or "
               "--sweep)\n");
    return 2;
  }
  if (sweep_only && (quick || !only.empty() || pass == "fwdbwd")) {
    fmt::print(stderr,
               "bench_cuda_forward: --sweep times the forward sweep alone (no --quick, "
               "--only or --pass fwdbwd)\n");
    return 2;
  }
  try {
    const auto cache = std::filesystem::temp_directory_path() /
                       fmt::format("flexattn_bench_cache_{}", static_cast<long>(getpid()));
    std::filesystem::remove_all(cache);
    setenv("FLEXATTN_CACHE_DIR", cache.c_str(), 1);
    // NVRTC 12.9+ keeps its own cache of compiled programs (in the driver's compute cache,
    // shared by every process of the machine), so a "cold" plan after the GPU tests compiled the
    // same source took 0.03 s. CUDA_CACHE_DISABLE=1, read when NVRTC first initialises, makes
    // the cold column a real compile; it also turns off the driver's PTX JIT cache, which no
    // engine of ours uses (the kernels are loaded as cubins).
    setenv("CUDA_CACHE_DISABLE", "1", 1);
    const auto engine = fresh_engine(engine_name);
    std::string unavailable;
    if (engine == nullptr) {
      unavailable = fmt::format("this build has no engine named '{}'", engine_name);
    } else if (const flexattn::Support available = engine->available(); !available) {
      unavailable = available.reason();
    }
    if (!unavailable.empty()) {
      fmt::print("skip: {}: {}\n", engine_name, unavailable);
      write_json(json_path, engine_name, unavailable, {});
      return 0;
    }
    InputCache inputs(*engine->memory());

    std::vector<std::string> rows;
    fmt::print("{:<6} {:<6} {:<6} {:<10} {:>3} {:>3} {:>6} {:>7} {:>6} {:>9} {:>8} {:>9} {:>9}\n",
               "group", "engine", "pass", "variant", "B", "H", "S", "D", "causal", "ms", "TFLOP/s",
               "cold s", "warm s");
    bool described_forward = false, described_backward = false;
    int errors = 0;
    for (const auto& [group, config] : configs(quick, pass != "fwdbwd", pass != "fwd", dims)) {
      if (!only.empty() && (group == "sweep" || only.count(problem_key(config)) == 0)) continue;
      if (sweep_only && group != "sweep") continue;
      if (!head_dims.empty() && head_dims.count(config.head_dim) == 0) continue;
      Result r;
      try {
        r = run(engine_name, config, inputs);
      } catch (const std::exception& error) {  // one problem's failure: still time the others
        r.error = error.what();
        ++errors;
      }
      if (!r.error.empty()) {
        fmt::print("error: {} {} {} D {} {}: {}\n", engine_name, pass_name(config.pass),
                   config.variant.name, config.dims_text(), config.causal ? "causal" : "no mask",
                   r.error);
      } else if (!r.skipped.empty()) {
        fmt::print("skip: {} {} {} D {} {}: {}\n", engine_name, pass_name(config.pass),
                   config.variant.name, config.dims_text(), config.causal ? "causal" : "no mask",
                   r.skipped);
      } else {
        fmt::print(
            "{:<6} {:<6} {:<6} {:<10} {:>3} {:>3} {:>6} {:>7} {:>6} {:>9.4f} {:>8.1f} {:>9.3f} "
            "{:>9}\n",
            group, engine_name, pass_name(config.pass), config.variant.name, config.batch,
            config.heads, config.seq, config.dims_text(), config.causal ? "yes" : "no", r.median_ms,
            r.tflops, r.plan_cold_s, warm_text(r, "-"));
        bool& described = config.pass == Pass::kForward ? described_forward : described_backward;
        if (!described) {
          fmt::print("       plan: {}\n", r.description);
          described = true;
        }
      }
      std::fflush(stdout);
      rows.push_back(json_row(engine_name, group, config, r));
    }
    write_json(json_path, engine_name, "", rows);
    std::filesystem::remove_all(cache);
    if (errors > 0) {
      fmt::print(stderr, "bench_cuda_forward: {} problem(s) failed\n", errors);
      return 1;
    }
  } catch (const std::exception& error) {
    fmt::print(stderr, "bench_cuda_forward: {}\n", error.what());
    return 1;
  }
  return 0;
}
