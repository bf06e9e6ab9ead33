// Times the cuda engine's forward pass on the GPU with CUDA events (warm-up, then the median of
// repeated launches) and reports TFLOP/s with DESIGN.md's count (4 B H Sq Skv D, halved for
// causal masks, as the peers count). Also measures plan time: cold (NVRTC compile into an empty
// disk cache) and warm (a fresh engine instance whose kernel comes from the disk cache).
//
//   bench_cuda_forward [--quick] [--json out.json]
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "flexattn/flexattn.hpp"

namespace {

using flexattn::DType;
using flexattn::ProblemDesc;

constexpr int kWarmupLaunches = 5;
constexpr int kTimedLaunches = 20;

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw std::runtime_error(fmt::format("{} failed: {}", call, cudaGetErrorString(status)));
  }
}

struct Variant {
  std::string name;
  std::string score_mod;  // IR text; empty for none
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
      {"none", ""},
      {"softcap", "30 * tanh(score / 30)"},
      {"alibi", "score + slopes[h] * (kv - q)"},
      {"bias", "score + bias[h, q, kv]"},
  };
  return all;
}

struct Config {
  std::int64_t batch, heads, seq, head_dim;
  bool causal;
  Variant variant;
};

struct Result {
  Config config;
  double median_ms = 0.0;
  double tflops = 0.0;
  double plan_cold_s = 0.0;
  double plan_warm_s = 0.0;
  std::string description;
};

std::shared_ptr<const flexattn::Engine> fresh_cuda_engine() {
  for (const auto& engine : flexattn::builtin_engines()) {
    if (engine->name() == "cuda") return engine;
  }
  throw std::runtime_error("this build has no cuda engine");
}

ProblemDesc describe(const Config& c) {
  ProblemDesc desc;
  desc.batch = c.batch;
  desc.heads_q = c.heads;
  desc.seq_len_q = c.seq;
  desc.head_dim_qk = c.head_dim;
  desc.layout = flexattn::Layout::kBHSD;
  desc.dtype = DType::kBF16;
  desc.device = flexattn::Device::kCuda;
  desc.want_lse = true;
  if (c.variant.name == "alibi") desc.tensors["slopes"] = {DType::kF32, {c.heads}};
  if (c.variant.name == "bias") desc.tensors["bias"] = {DType::kBF16, {c.heads, c.seq, c.seq}};
  if (!c.variant.score_mod.empty()) {
    desc.score_mod = flexattn::ir::parse(c.variant.score_mod, desc.scope());
  }
  if (c.causal) desc.mask_mod = flexattn::ir::parse("q >= kv", desc.scope());
  return desc;
}

// A device buffer filled with N(0, 1) values of the tensor's dtype (never zeros: they run faster).
struct DeviceTensor {
  DeviceTensor(const flexattn::DeviceMemory& memory, flexattn::TensorView layout,
               std::uint64_t seed)
      : memory_(memory), view(std::move(layout)) {
    flexattn::HostTensor host(view.dtype, view.shape);
    host.fill_normal(seed);
    view.data = memory_.allocate(host.bytes());
    view.device = flexattn::Device::kCuda;
    memory_.copy_to_device(view.data, host.data(), host.bytes());
  }
  ~DeviceTensor() { memory_.release(view.data); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  const flexattn::DeviceMemory& memory_;
  flexattn::TensorView view;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

Result run(const Config& config) {
  Result result;
  result.config = config;
  const flexattn::Problem problem(describe(config));
  // Cold: a fresh engine and an empty disk cache (FLEXATTN_CACHE_DIR is a new folder).
  auto start = std::chrono::steady_clock::now();
  fresh_cuda_engine()->plan(problem);
  result.plan_cold_s = seconds_since(start);
  const auto engine = fresh_cuda_engine();
  start = std::chrono::steady_clock::now();
  const std::unique_ptr<flexattn::Plan> plan = engine->plan(problem);
  result.plan_warm_s = seconds_since(start);
  result.description = plan->info().description;

  const flexattn::DeviceMemory& memory = *engine->memory();
  DeviceTensor q(memory, problem.expected("q"), 1), k(memory, problem.expected("k"), 2);
  DeviceTensor v(memory, problem.expected("v"), 3), out(memory, problem.expected("o"), 4);
  DeviceTensor lse(memory, problem.expected("lse"), 5);
  std::vector<std::unique_ptr<DeviceTensor>> tensors;
  flexattn::ForwardArgs args;
  args.q = q.view;
  args.k = k.view;
  args.v = v.view;
  args.out = out.view;
  args.lse = lse.view;
  std::uint64_t seed = 6;
  for (const auto& [name, decl] : problem.desc().tensors) {
    flexattn::TensorView view;
    view.dtype = decl.dtype;
    view.shape = decl.shape;
    view.strides = flexattn::contiguous_strides(decl.shape);
    tensors.push_back(std::make_unique<DeviceTensor>(memory, view, seed++));
    args.tensors[name] = tensors.back()->view;
  }

  for (int i = 0; i < kWarmupLaunches; ++i) plan->forward(args);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::vector<cudaEvent_t> events(2 * kTimedLaunches);
  for (cudaEvent_t& event : events) check(cudaEventCreate(&event), "cudaEventCreate");
  for (int i = 0; i < kTimedLaunches; ++i) {
    check(cudaEventRecord(events[2 * i]), "cudaEventRecord");
    plan->forward(args);
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
  result.median_ms = times[kTimedLaunches / 2];
  // The peers' count: 4 B H S^2 D, halved under a causal mask.
  const double flops = 4.0 * static_cast<double>(config.batch * config.heads) *
                       static_cast<double>(config.seq) * static_cast<double>(config.seq) *
                       static_cast<double>(config.head_dim) * (config.causal ? 0.5 : 1.0);
  result.tflops = flops / (result.median_ms * 1e-3) / 1e12;
  return result;
}

std::string json_row(const Result& r, const std::string& group) {
  return fmt::format(
      R"({{"group": "{}", "name": "cuda_{}", "B": {}, "H": {}, "S": {}, "D": {}, "causal": {}, )"
      R"("ms": {:.5f}, "tflops": {:.2f}, "plan_cold_s": {:.4f}, "plan_warm_s": {:.4f}}})",
      group, r.config.variant.name, r.config.batch, r.config.heads, r.config.seq,
      r.config.head_dim, r.config.causal ? "true" : "false", r.median_ms, r.tflops,
      r.plan_cold_s, r.plan_warm_s);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") quick = true;
    if (arg == "--json" && i + 1 < argc) json_path = argv[++i];
  }
  try {
    const auto cache = std::filesystem::temp_directory_path() /
                       fmt::format("flexattn_bench_cache_{}", static_cast<long>(getpid()));
    std::filesystem::remove_all(cache);
    setenv("FLEXATTN_CACHE_DIR", cache.c_str(), 1);
    const auto engine = fresh_cuda_engine();
    if (!engine->available()) throw std::runtime_error(engine->available().reason());

    std::vector<std::pair<std::string, Config>> configs;
    for (std::int64_t head_dim : {128, 64}) {
      for (bool causal : {false, true}) {
        for (const Variant& variant : variants()) {
          configs.push_back({"main", Config{4, 16, 4096, head_dim, causal, variant}});
        }
      }
    }
    if (!quick) {
      // Constant tokens per launch (batch x seq = 32k), as the plot's peers are measured.
      constexpr std::int64_t kTokens = 32768;
      for (std::int64_t seq : {512, 1024, 2048, 4096, 8192, 16384}) {
        for (bool causal : {false, true}) {
          for (const Variant& variant : {variants()[0], variants()[1]}) {
            configs.push_back({"sweep", Config{kTokens / seq, 16, seq, 128, causal, variant}});
          }
        }
      }
    }
    std::vector<std::string> rows;
    fmt::print("{:<6} {:<8} {:>3} {:>3} {:>6} {:>4} {:>6} {:>9} {:>8} {:>9} {:>9}\n", "group",
               "variant", "B", "H", "S", "D", "causal", "ms", "TFLOP/s", "cold s", "warm s");
    for (const auto& [group, config] : configs) {
      const Result r = run(config);
      fmt::print("{:<6} {:<8} {:>3} {:>3} {:>6} {:>4} {:>6} {:>9.4f} {:>8.1f} {:>9.3f} {:>9.4f}\n",
                 group, config.variant.name, config.batch, config.heads, config.seq,
                 config.head_dim, config.causal ? "yes" : "no", r.median_ms, r.tflops,
                 r.plan_cold_s, r.plan_warm_s);
      std::fflush(stdout);
      if (group == "main" && config.head_dim == 128 && !config.causal &&
          config.variant.name == "none") {
        fmt::print("       plan: {}\n", r.description);
      }
      rows.push_back(json_row(r, group));
    }
    if (!json_path.empty()) {
      std::ofstream file(json_path);
      file << "{\"device\": \"" << "cuda" << "\", \"rows\": [\n";
      for (std::size_t i = 0; i < rows.size(); ++i) {
        file << "  " << rows[i] << (i + 1 < rows.size() ? ",\n" : "\n");
      }
      file << "]}\n";
    }
    std::filesystem::remove_all(cache);
  } catch (const std::exception& error) {
    fmt::print(stderr, "bench_cuda_forward: {}\n", error.what());
    return 1;
  }
  return 0;
}
