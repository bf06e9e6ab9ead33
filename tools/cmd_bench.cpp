// `flexattn bench [problem flags] --engine NAME [--iters N] [--json]`: forward and (with
// --backward) forward+backward times of N runs after warm-up (CPU engines: the median; GPU engines:
// per run of N enqueued back to back, a workspace lent), in ms and GFLOP/s (FLOPs per
// docs/design.md section 6), next to this machine's single-precision GEMM rate measured in the same
// run (OpenBLAS sgemm of a fixed square size), so the number reads as a fraction of a ceiling.
#include "cmd_bench.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <vector>

#if FLEXATTN_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace flexattn::cli {
namespace {

constexpr double kGiga = 1e9;
constexpr double kMilli = 1e3;

// The sgemm ceiling: one square product of side kCeilingSide, whatever the problem's shape, so
// the percentage is of the machine's sustained GEMM rate (a product shaped like the queries ran
// far below it for short queries: one query row gave thousands of percent). Returns 0 without
// OpenBLAS.
double sgemm_gflops(int iters) {
#if FLEXATTN_HAVE_OPENBLAS
  constexpr std::int64_t kCeilingSide = 1024;  // 2.1 GFLOP: tens of ms, past cache effects
  const std::int64_t m = kCeilingSide, k = kCeilingSide;
  std::vector<float> a(static_cast<std::size_t>(m * k), 0.5f),
      b(static_cast<std::size_t>(k * m), 0.25f), c(static_cast<std::size_t>(m * m));
  std::vector<double> seconds;
  for (int i = 0; i < iters + 1; ++i) {
    const auto start = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(m),
                static_cast<int>(k), 1.0f, a.data(), static_cast<int>(k), b.data(),
                static_cast<int>(m), 0.0f, c.data(), static_cast<int>(m));
    if (i > 0)
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(seconds.begin(),
                   seconds.begin() + static_cast<std::ptrdiff_t>(seconds.size() / 2),
                   seconds.end());
  return 2.0 * static_cast<double>(m * m * k) / seconds[seconds.size() / 2] / kGiga;
#else
  (void)iters;
  return 0.0;
#endif
}

}  // namespace

void add_bench_command(CLI::App& app, ProblemFlags& problem, BenchFlags& flags) {
  CLI::App* bench = app.add_subcommand(
      "bench", "Time an engine on a problem: forward (and forward+backward with --backward)");
  add_problem_flags(*bench, problem);
  bench->add_option("--iters", flags.iters,
                    "timed runs (CPU: median; GPU: back to back; default 10)");
  bench->add_option("--warmup", flags.warmup, "untimed runs first (default 2)");
  bench->add_flag("--json", flags.json, "print a machine-readable summary");
}

int bench_command(const ProblemFlags& problem_flags, const BenchFlags& flags) {
  if (flags.iters < 1)
    throw_invalid(fmt::format("--iters must be at least 1, not {}", flags.iters));
  if (flags.warmup < 0)
    throw_invalid(fmt::format("--warmup must not be negative, not {}", flags.warmup));
  Setup setup = build_setup(problem_flags);
  Context context(context_options(problem_flags.engine, problem_flags.planted_faults));
  const Selection selection = select_plan(context, setup.desc);
  const Problem& problem = selection.problem;
  const Inputs inputs = make_inputs(problem, setup, problem_flags.seed, "");
  if (flags.warmup > 0) run_plan(selection, inputs, flags.warmup);
  const Outputs timed = run_plan(selection, inputs, flags.iters);
  const double sgemm = problem.device() == Device::kCpu ? sgemm_gflops(flags.iters) : 0.0;

  const CacheWork cache = cache_work(problem, inputs);
  const double kept = cache.paged ? 1.0 : kept_fraction(problem);
  const double forward_flops =
      cache.paged ? cache.flops
                  : attention_flops(problem, kept) / (problem.wants_backward() ? 3.5 : 1.0);
  const double forward_gflops = forward_flops / timed.forward_seconds / kGiga;
  const double both_seconds = timed.forward_seconds + timed.backward_seconds;
  const double both_gflops = 3.5 * forward_flops / both_seconds / kGiga;
  const PlanInfo& info = selection.plan->info();
  if (flags.json) {
    nlohmann::json summary = {{"engine", info.engine},
                              {"plan", info.description},
                              {"iters", flags.iters},
                              {"kept_fraction", kept},
                              {"forward_ms", timed.forward_seconds * kMilli},
                              {"forward_gflops", forward_gflops},
                              {"sgemm_gflops", sgemm}};
    if (cache.paged) summary["kv_cache_gb_per_s"] = cache.kv_bytes / timed.forward_seconds / kGiga;
    if (problem.wants_backward()) {
      summary["forward_backward_ms"] = both_seconds * kMilli;
      summary["forward_backward_gflops"] = both_gflops;
    }
    fmt::print("{}\n", summary.dump(1));
    return 0;
  }
  const auto ratio = [&](double gflops) {
    return sgemm > 0.0 ? fmt::format("  {:5.1f}% of sgemm", 100.0 * gflops / sgemm) : std::string();
  };
  fmt::print("engine    {}\nplan      {}\n", info.engine, info.description);
  fmt::print("forward           {:9.3f} ms {:9.1f} GFLOP/s{}\n", timed.forward_seconds * kMilli,
             forward_gflops, ratio(forward_gflops));
  if (problem.wants_backward()) {
    fmt::print("forward+backward  {:9.3f} ms {:9.1f} GFLOP/s{}\n", both_seconds * kMilli,
               both_gflops, ratio(both_gflops));
  }
  if (cache.paged) {
    fmt::print("cached K and V read at {:.2f} GB/s (FLOPs: every cached (q, kv) pair)\n",
               cache.kv_bytes / timed.forward_seconds / kGiga);
  }
  if (sgemm > 0.0) {
    fmt::print("sgemm (OpenBLAS, same run) {:.1f} GFLOP/s\n", sgemm);
  } else if (problem.device() == Device::kCpu) {
    fmt::print("sgemm: not measured (built without OpenBLAS)\n");
  }
  fmt::print("{} of {} runs{} after {} warm-up runs; kept fraction {:.3f}\n",
             problem.device() == Device::kCpu ? "median" : "mean", flags.iters,
             problem.device() == Device::kCpu ? "" : " enqueued back to back", flags.warmup, kept);
  return 0;
}

}  // namespace flexattn::cli
