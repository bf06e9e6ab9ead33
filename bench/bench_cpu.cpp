// flexattn_bench_cpu: speed and memory of the `cpu` engine on this machine (docs/design.md section
// 6), side by side with the machine's single-precision GEMM rate measured in the same run.
//
//   flexattn_bench_cpu [--iters N] [--seq S] [--heads H] [--dim D] [--skip-ref] [--skip-memory]
//
// Prints, for softcap 30 and softcap 30 + causal (fp32, batch 1, bshd): forward and
// forward+backward medians (ms, GFLOP/s, ratio to the OpenBLAS sgemm rate measured before and
// after them), the speed-up over cpu_ref
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
#include <tuple>
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

// Inputs and outputs of one problem (the backward's only when the problem wants backward).
struct Workload {
  explicit Workload(const Problem& problem, DType dtype) {
    const auto make = [&](std::string_view which, std::uint64_t seed) {
      HostTensor tensor(dtype, problem.expected(which).shape);
      if (seed != 0) tensor.fill_normal(seed);
      return tensor;
    };
    q = make("q", 1), k = make("k", 2), v = make("v", 3), out = make("o", 0);
    lse = HostTensor(problem.expected("lse").dtype, problem.expected("lse").shape);
    if (problem.wants_backward()) {
      dout = make("o", 4), dq = make("q", 0), dk = make("k", 0), dv = make("v", 0);
    }
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

// OpenBLAS sgemm (all threads) on M = N = seq, K chosen so the FLOPs equal the forward's: the
// machine's single-precision GEMM rate, the yardstick of every attention number.
class Sgemm {
 public:
  Sgemm(const Options& options, double forward_flops)
      : m_(static_cast<int>(options.seq)),
        k_(std::max(1, static_cast<int>(forward_flops / (2.0 * m_ * m_)))),
        a_(static_cast<std::size_t>(m_) * static_cast<std::size_t>(k_), 0.5f),
        b_(a_.size(), 0.25f),
        c_(static_cast<std::size_t>(m_) * static_cast<std::size_t>(m_), 0.0f) {}

  double flops() const { return 2.0 * m_ * m_ * k_; }
  void run() {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m_, m_, k_, 1.0f, a_.data(), k_,
                b_.data(), m_, 0.0f, c_.data(), m_);
  }
  std::string describe() const {
    return fmt::format("OpenBLAS sgemm {}x{}x{}, {} threads", m_, m_, k_,
                       openblas_get_num_threads());
  }

 private:
  int m_, k_;
  std::vector<float> a_, b_, c_;
};

// One measured attention pass: its median time and its FLOPs.
struct Measurement {
  std::string name;
  double ms, flops;
};

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
                   std::vector<Measurement>& measurements) {
  const auto engine = flexattn::make_cpu_engine();
  const Problem forward(bench_desc(options, options.seq, modifier, flexattn::Direction::kForward));
  const Problem both(
      bench_desc(options, options.seq, modifier, flexattn::Direction::kForwardBackward));
  const auto forward_plan = engine->plan(forward);
  const auto both_plan = engine->plan(both);
  const Workload work(both, DType::kF32);
  const double forward_ms =
      median_ms(options.iters, [&] { forward_plan->forward(work.forward_args()); });
  const double both_ms = median_ms(options.iters, [&] {
    both_plan->forward(work.forward_args());
    both_plan->backward(work.backward_args());
  });
  fmt::print("{}: {}\n", modifier, forward_plan->info().description);
  measurements.push_back({fmt::format("{} forward", modifier), forward_ms,
                          flexattn::attention_flops(forward, kept_fraction)});
  measurements.push_back({fmt::format("{} forward+backward", modifier), both_ms,
                          flexattn::attention_flops(both, kept_fraction)});
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
  constexpr double kBytesPerMib = 1024.0 * 1024.0, kBytesPerKib = 1024.0;
  // Q, K, V, O (fp32) and the LSE: what any forward must hold, linear in the length.
  const auto tensors_mib = [&](std::int64_t seq) {
    const double elements = static_cast<double>(seq * options.heads * (4 * options.dim + 1));
    return elements * sizeof(float) / kBytesPerMib;
  };
  const double short_mib =
      static_cast<double>(child_peak_kib(self, kShort, options)) * kBytesPerKib / kBytesPerMib;
  const double long_mib =
      static_cast<double>(child_peak_kib(self, kLong, options)) * kBytesPerKib / kBytesPerMib;
  fmt::print(
      "peak RSS of a forward (softcap, heads {}, dim {}): seq {} {:.1f} MiB, seq {} {:.1f} MiB, "
      "ratio {:.2f} (a score matrix would make it about 4); beyond the inputs and outputs: "
      "{:.1f} MiB and {:.1f} MiB\n",
      options.heads, options.dim, kShort, short_mib, kLong, long_mib, long_mib / short_mib,
      short_mib - tensors_mib(kShort), long_mib - tensors_mib(kLong));
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
    Sgemm sgemm(options, flexattn::attention_flops(dense, 1.0));
    const auto sgemm_rate = [&] {
      return gflops(sgemm.flops(), median_ms(options.iters, [&] { sgemm.run(); }));
    };
    const double sgemm_before = sgemm_rate();
    tile_product_rates();
    constexpr double kCausalKept = 0.5;  // docs/design.md section 6: halve for causal
    std::vector<Measurement> measurements;
    bench_variant(options, "softcap", 1.0, measurements);
    bench_variant(options, "softcap_causal", kCausalKept, measurements);
    // The yardstick: the better of two sgemm medians, before and after the attention runs (a
    // shared machine's load drifts; the better rate makes the ratios conservative).
    const double sgemm_after = sgemm_rate();
    const double yardstick = std::max(sgemm_before, sgemm_after);
    fmt::print("{}: {:.1f} GFLOP/s before, {:.1f} after\n", sgemm.describe(), sgemm_before,
               sgemm_after);
    for (const Measurement& m : measurements) {
      fmt::print("  {:<32} {:9.2f} ms {:7.1f} GFLOP/s  {:5.1f}% of sgemm\n", m.name, m.ms,
                 gflops(m.flops, m.ms), 100.0 * gflops(m.flops, m.ms) / yardstick);
    }
    if (options.memory) memory_check(argv[0], options);
    return 0;
  } catch (const std::exception& error) {
    fmt::print(stderr, "flexattn_bench_cpu: {}\n", error.what());
    return 1;
  }
}
