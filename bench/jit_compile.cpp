// flexattn_bench_jit: the cold compile time of the `cuda` engine's generated kernels on this
// machine's CPU (NVRTC only: no GPU needed), the plan-time cost a new modifier pays before its
// first call. For each row (bf16, batch 4, heads 16, sequence 4096, as bench_cuda_forward):
// - forward: the forward plan's module;
// - fwd+bwd, one program: the forward+backward plan's translation unit compiled whole (its five
//   kernels in one NVRTC program);
// - fwd+bwd, two at once: the same unit as the engine compiles it, the forward's and the backward's
//   modules (codegen.hpp's kForwardModuleDefine, kBackwardModuleDefine) on two threads at once.
// Medians of --repeats compiles, each into no cache.
//
//   flexattn_bench_jit [--repeats N] [--capability 90]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <future>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "engines/cuda/codegen.hpp"
#include "engines/cuda/cuda_engine.hpp"
#include "engines/cuda/kernel_cache.hpp"
#include "flexattn/flexattn.hpp"

namespace {

using flexattn::DType;
using flexattn::Problem;
using flexattn::ProblemDesc;

struct Row {
  std::string name;
  std::int64_t head_dim;
  std::string score_mod;  // IR text; empty for none
  bool causal;
};

Problem make_problem(const Row& row, bool backward) {
  ProblemDesc desc;
  desc.batch = 4;
  desc.heads_q = 16;
  desc.seq_len_q = 4096;
  desc.head_dim_qk = row.head_dim;
  desc.head_dim_v = row.head_dim;
  desc.layout = flexattn::Layout::kBHSD;
  desc.dtype = DType::kBF16;
  desc.device = flexattn::Device::kCuda;
  desc.direction = backward ? flexattn::Direction::kForwardBackward : flexattn::Direction::kForward;
  desc.want_lse = true;
  if (!row.score_mod.empty()) desc.score_mod = flexattn::ir::parse(row.score_mod, desc.scope());
  if (row.causal) desc.mask_mod = flexattn::ir::parse("q >= kv", desc.scope());
  return Problem(std::move(desc));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The median of `repeats` timings of `compile`.
template <class Compile>
double median_seconds(int repeats, const Compile& compile) {
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    compile();
    times.push_back(seconds_since(start));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int run(int argc, char** argv) {
  int repeats = 3;
  int capability = 90;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if ((arg == "--repeats" || arg == "--capability") && i + 1 < argc) {
      const int value = std::atoi(argv[++i]);
      if (value <= 0) {
        fmt::print(stderr, "error: {} takes a positive number\n", arg);
        return 2;
      }
      (arg == "--repeats" ? repeats : capability) = value;
    } else {
      fmt::print(stderr, "usage: flexattn_bench_jit [--repeats N] [--capability 90]\n");
      return 2;
    }
  }
  if (const flexattn::Support nvrtc = flexattn::cuda::nvrtc_availability(); !nvrtc) {
    fmt::print(stderr, "error: NVRTC is not available: {}\n", nvrtc.reason());
    return 1;
  }
  fmt::print("NVRTC {}, compute capability {}, {} hardware threads; medians of {} cold compiles\n",
             flexattn::cuda::nvrtc_version(), capability, std::thread::hardware_concurrency(),
             repeats);
  fmt::print("{:<22} {:>9} {:>21} {:>21}\n", "row", "forward", "fwd+bwd one program",
             "fwd+bwd two at once");
  const std::vector<Row> rows = {
      {"d128 none", 128, "", false},  {"d128 softcap", 128, "30 * tanh(score / 30)", false},
      {"d128 causal", 128, "", true}, {"d128 causal softcap", 128, "30 * tanh(score / 30)", true},
      {"d64 none", 64, "", false},    {"d256 softcap", 256, "30 * tanh(score / 30)", false}};
  namespace cuda = flexattn::cuda;
  for (const Row& row : rows) {
    const cuda::PlanSource forward = cuda::plan_source(make_problem(row, false), capability);
    const cuda::PlanSource both = cuda::plan_source(make_problem(row, true), capability);
    if (!forward.reason.empty() || !both.reason.empty()) {
      fmt::print("{:<22} not served: {}\n", row.name,
                 forward.reason.empty() ? both.reason : forward.reason);
      continue;
    }
    const double forward_s = median_seconds(repeats, [&] {
      cuda::compile_to_cubin(forward.source, "forward.cu", capability, forward.suffix);
    });
    const double whole_s = median_seconds(
        repeats, [&] { cuda::compile_to_cubin(both.source, "whole.cu", capability, both.suffix); });
    const double split_s = median_seconds(repeats, [&] {
      std::future<std::vector<char>> backward = std::async(std::launch::async, [&] {
        return cuda::compile_to_cubin(both.source, "backward.cu", capability, both.suffix,
                                      cuda::kBackwardModuleDefine);
      });
      cuda::compile_to_cubin(both.source, "forward.cu", capability, both.suffix,
                             cuda::kForwardModuleDefine);
      backward.get();
    });
    fmt::print("{:<22} {:>7.2f} s {:>19.2f} s {:>19.2f} s\n", row.name, forward_s, whole_s,
               split_s);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    fmt::print(stderr, "error: {}\n", error.what());
    return 1;
  }
}
