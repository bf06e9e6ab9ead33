// flexattn_bench_cpu: speed and memory of the `cpu` engine on this machine (DESIGN.md section 6),
// side by side with the machine's single-precision GEMM rate measured in the same run.
//
//   flexattn_bench_cpu [--iters N] [--seq S] [--heads H] [--dim D] [--skip-ref] [--skip-memory]
//
// Prints, for softcap 30 and softcap 30 + causal (fp32, batch 1, bshd): forward and
// forward+backward medians (ms, GFLOP/s, ratio to OpenBLAS sgemm), the speed-up over cpu_ref
// (timed on a slice and extrapolated, which it says), the tile-product rate of the engine's own
// micro-kernel against OpenBLAS on the same tile, and the peak resident memory of forwards at
// two lengths (each in a child process).
#include <cblas.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engines/cpu/cpu.hpp"
#include "engines/cpu/kernels.hpp"
#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/flexattn.hpp"

namespace {

using flexattn::DType;
using flexattn::HostTensor;
using flexattn::Problem;
using flexattn::ProblemDesc;

struct Options {
  int iters = 5;
  std::int64_t seq = 2048, heads = 8, dim = 64;
  bool reference = true, memory = true;
  std::int64_t memory_child = 0;  // internal: run one forward at this length and exit
};

// Median of `iters` timed calls after one warm-up call, in milliseconds.
double median_ms(int iters, const std::function<void()>& run) {
  run();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    const std::chrono::duration<double, std::milli> elapsed =
        std::chrono::steady_clock::now() - start;
    times.push_back(elapsed.count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double gflops(double flops, double ms) { return flops / (ms * 1e6); }

ProblemDesc bench_desc(const Options& options, std::int64_t seq, std::string_view modifier,
                       flexattn::Direction direction) {
  ProblemDesc desc;
  desc.batch = 1;
  desc.heads_q = options.heads;
  desc.seq_len_q = seq;
  desc.head_dim_qk = options.dim;
  desc.layout = flexattn::Layout::kBSHD;
  desc.dtype = DType::kF32;
  desc.direction = direction;
  flexattn::apply_modifier(flexattn::find_modifier(modifier), desc);
  return desc;
}

// Inputs and outputs of one problem, and closures running forward / forward+backward.
struct Workload {
  explicit Workload(const Problem& problem, DType dtype) {
    const auto make = [&](std::string_view which, std::uint64_t seed) {
      HostTensor tensor(dtype, problem.expected(which).shape);
      if (seed != 0) tensor.fill_normal(seed);
      return tensor;
    };
    q = make("q", 1), k = make("k", 2), v = make("v", 3), dout = make("o", 4);
    out = make("o", 0), dq = make("q", 0), dk = make("k", 0), dv = make("v", 0);
    lse = HostTensor(problem.expected("lse").dtype, problem.expected("lse").shape);
  }
  flexattn::ForwardArgs forward_args() const {
    return {q.view(), k.view(), v.view(), out.view(), lse.view(), {}, nullptr};
  }
  flexattn::BackwardArgs backward_args() const {
    flexattn::BackwardArgs args;
    args.q = q.view(), args.k = k.view(), args.v = v.view(), args.out = out.view();
    args.lse = lse.view(), args.dout = dout.view();
    args.dq = dq.view(), args.dk = dk.view(), args.dv = dv.view();
    return args;
  }
  HostTensor q, k, v, dout, out, lse, dq, dk, dv;
};

// OpenBLAS sgemm (all threads) on M = N = seq, K chosen so the FLOPs equal the forward's.
double sgemm_gflops(const Options& options, double forward_flops) {
  const auto m = static_cast<int>(options.seq);
  const int k = std::max(1, static_cast<int>(forward_flops / (2.0 * m * m)));
  std::vector<float> a(static_cast<std::size_t>(m) * k, 0.5f), b(a.size(), 0.25f);
  std::vector<float> c(static_cast<std::size_t>(m) * m, 0.0f);
  const double ms = median_ms(options.iters, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, k, 1.0f, a.data(), k, b.data(), m,
                0.0f, c.data(), m);
  });
  fmt::print("OpenBLAS sgemm {}x{}x{} ({} threads): {:.2f} ms, {:.1f} GFLOP/s\n", m, m, k,
             openblas_get_num_threads(), ms, gflops(2.0 * m * m * k, ms));
  return gflops(2.0 * m * m * k, ms);
}

// The engine's tile product against OpenBLAS on the same 64 x 64 x 64 tile, one thread, data in
// cache: the measurement behind the engine's choice of its own micro-kernel.
void tile_product_rates() {
  constexpr int kTile = 64;
  constexpr int kRepeats = 20000;
  std::vector<float> a(kTile * kTile, 0.5f), b(a.size(), 0.25f), c(a.size(), 0.0f);
  const double flops = 2.0 * kTile * kTile * kTile * kRepeats;
  const flexattn::cpu::Kernels& kernels = flexattn::cpu::kernels();
  const double own_ms = median_ms(3, [&] {
    for (int r = 0; r < kRepeats; ++r) {
      kernels.gemm(
          {kTile, kTile, kTile, a.data(), kTile, 1, b.data(), kTile, c.data(), kTile, r > 0});
    }
  });
  const int threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  const double blas_ms = median_ms(3, [&] {
    for (int r = 0; r < kRepeats; ++r) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kTile, kTile, kTile, 1.0f, a.data(),
                  kTile, b.data(), kTile, r > 0 ? 1.0f : 0.0f, c.data(), kTile);
    }
  });
  openblas_set_num_threads(threads);
  fmt::print(
      "tile product 64x64x64, 1 thread: own {} kernel {:.1f} GFLOP/s, OpenBLAS {:.1f} "
      "GFLOP/s\n",
      kernels.isa, gflops(flops, own_ms), gflops(flops, blas_ms));
}

void bench_variant(const Options& options, std::string_view modifier, double kept_fraction,
                   double sgemm_rate) {
  const auto engine = flexattn::make_cpu_engine();
  const Problem forward(bench_desc(options, options.seq, modifier, flexattn::Direction::kForward));
  const Problem both(
      bench_desc(options, options.seq, modifier, flexattn::Direction::kForwardBackward));
  const auto forward_plan = engine->plan(forward);
  const auto both_plan = engine->plan(both);
  const Workload work(forward, DType::kF32);
  const double forward_ms =
      median_ms(options.iters, [&] { forward_plan->forward(work.forward_args()); });
  const double both_ms = median_ms(options.iters, [&] {
    both_plan->forward(work.forward_args());
    both_plan->backward(work.backward_args());
  });
  const double forward_rate = gflops(flexattn::attention_flops(forward, kept_fraction), forward_ms);
  const double both_rate = gflops(flexattn::attention_flops(both, kept_fraction), both_ms);
  fmt::print("{}: {}\n", modifier, forward_plan->info().description);
  fmt::print("  forward          {:9.2f} ms {:7.1f} GFLOP/s  {:5.1f}% of sgemm\n", forward_ms,
             forward_rate, 100.0 * forward_rate / sgemm_rate);
  fmt::print("  forward+backward {:9.2f} ms {:7.1f} GFLOP/s  {:5.1f}% of sgemm\n", both_ms,
             both_rate, 100.0 * both_rate / sgemm_rate);
  if (!options.reference) return;
  // cpu_ref on a slice (a quarter of the length: 1/16 of the pairs), extrapolated by FLOPs.
  constexpr std::int64_t kSliceDivisor = 4;
  const std::int64_t slice = std::max<std::int64_t>(1, options.seq / kSliceDivisor);
  const Problem reference(bench_desc(options, slice, modifier, flexattn::Direction::kForward));
  const auto reference_plan = flexattn::make_cpu_ref_engine()->plan(reference);
  const Workload reference_work(reference, DType::kF32);
  const double reference_ms =
      median_ms(1, [&] { reference_plan->forward(reference_work.forward_args()); });
  const double extrapolated = reference_ms * flexattn::attention_flops(forward, 1.0) /
                              flexattn::attention_flops(reference, 1.0);
  fmt::print(
      "  cpu_ref forward  {:9.2f} ms at seq {} -> {:.0f} ms extrapolated to seq {}: cpu "
      "is {:.0f}x faster\n",
      reference_ms, slice, extrapolated, options.seq, extrapolated / forward_ms);
}

// Peak resident set of one forward at `seq`, measured in a child process (a fresh image, so
// earlier allocations of this process do not count).
long child_peak_kib(const char* self, std::int64_t seq, const Options& options) {
  const std::string length = std::to_string(seq), heads = std::to_string(options.heads);
  const std::string dim = std::to_string(options.dim);
  const pid_t pid = fork();
  if (pid == 0) {
    execl(self, self, "--memory-child", length.c_str(), "--heads", heads.c_str(), "--dim",
          dim.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  rusage usage{};
  if (pid < 0 || wait4(pid, &status, 0, &usage) != pid || !WIFEXITED(status) ||
      WEXITSTATUS(status) != 0) {
    fmt::print(stderr, "memory child for seq {} failed\n", seq);
    return -1;
  }
  return usage.ru_maxrss;
}

void memory_check(const char* self, const Options& options) {
  constexpr std::int64_t kShort = 8192, kLong = 16384;
  constexpr double kKibPerMib = 1024.0;
  const auto short_kib = static_cast<double>(child_peak_kib(self, kShort, options));
  const auto long_kib = static_cast<double>(child_peak_kib(self, kLong, options));
  fmt::print(
      "peak RSS of a forward (softcap, heads {}, dim {}): seq {} {:.1f} MiB, seq {} {:.1f} "
      "MiB, ratio {:.2f} (quadratic would be about 4)\n",
      options.heads, options.dim, kShort, short_kib / kKibPerMib, kLong, long_kib / kKibPerMib,
      long_kib / short_kib);
}

int memory_child(const Options& options) {
  const Problem problem(
      bench_desc(options, options.memory_child, "softcap", flexattn::Direction::kForward));
  const auto plan = flexattn::make_cpu_engine()->plan(problem);
  const Workload work(problem, DType::kF32);
  plan->forward(work.forward_args());
  return 0;
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const auto next = [&] {
      if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{} needs a value", arg));
      return std::stoll(argv[++i]);
    };
    if (arg == "--iters") {
      options.iters = static_cast<int>(next());
    } else if (arg == "--seq") {
      options.seq = next();
    } else if (arg == "--heads") {
      options.heads = next();
    } else if (arg == "--dim") {
      options.dim = next();
    } else if (arg == "--skip-ref") {
      options.reference = false;
    } else if (arg == "--skip-memory") {
      options.memory = false;
    } else if (arg == "--memory-child") {
      options.memory_child = next();
    } else {
      throw std::invalid_argument(fmt::format("unknown argument {}", arg));
    }
  }
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options options = parse(argc, argv);
    if (options.memory_child > 0) return memory_child(options);
    fmt::print("fp32, batch 1, heads {}, seq {}, head dim {}, bshd; median of {} after warm-up\n",
               options.heads, options.seq, options.dim, options.iters);
    const Problem dense(bench_desc(options, options.seq, "softcap", flexattn::Direction::kForward));
    const double sgemm_rate = sgemm_gflops(options, flexattn::attention_flops(dense, 1.0));
    tile_product_rates();
    constexpr double kCausalKept = 0.5;  // DESIGN.md section 6: halve for causal
    bench_variant(options, "softcap", 1.0, sgemm_rate);
    bench_variant(options, "softcap_causal", kCausalKept, sgemm_rate);
    if (options.memory) memory_check(argv[0], options);
    return 0;
  } catch (const std::exception& error) {
    fmt::print(stderr, "flexattn_bench_cpu: {}\n", error.what());
    return 1;
  }
}
