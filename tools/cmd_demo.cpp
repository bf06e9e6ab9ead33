// `flexattn demo`: a realistic default problem (Gemma-2 style: logit softcap 30 and a causal mask)
// on the best available engine, timed, and checked against cpu_ref on a slice.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "cli.hpp"

namespace flexattn::cli {

namespace {

// Gemma-2-like sizes, small enough for the float64 reference to finish in seconds on two cores.
constexpr std::int64_t kBatch = 2;
constexpr std::int64_t kHeads = 8;
constexpr std::int64_t kSeqLen = 1024;
constexpr std::int64_t kHeadDim = 128;
constexpr std::string_view kModifier = "softcap_causal";
constexpr std::uint64_t kSeed = 2024;
// The slice checked against cpu_ref: batch entry 0, the first heads and query rows. Its indices
// equal those of the full problem, so the modifier sees the same (b, h, q, kv) everywhere.
constexpr std::int64_t kSliceHeads = 2;
constexpr std::int64_t kSliceRows = 64;
constexpr double kSecondsToMilliseconds = 1e3;
constexpr double kFlopsToGiga = 1e-9;

// Allowed max error relative to the largest reference output: four units of the storage dtype's
// rounding (bf16 keeps 8 bits, fp16 11), which a correct engine stays well inside; fp32 allows
// for tensor-core engines that multiply in TF32 (11 bits). A dropped softcap or mask is off by
// tens of percent, far outside any of these.
double relative_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return std::ldexp(1.0, -6);
    case DType::kF16:
      return std::ldexp(1.0, -9);
    case DType::kF32:
      return std::ldexp(1.0, -9);
    case DType::kF64:
    case DType::kI32:
    case DType::kI64:
      break;
  }
  return std::ldexp(1.0, -40);
}

ProblemDesc demo_desc(DType dtype) {
  ProblemDesc desc;
  desc.batch = kBatch;
  desc.heads_q = kHeads;
  desc.seq_len_q = kSeqLen;
  desc.head_dim_qk = kHeadDim;
  desc.layout = Layout::kBSHD;
  desc.dtype = dtype;
  apply_modifier(find_modifier(kModifier), desc);
  return desc;
}

// [0, batch) x [0, seq) x [0, heads) x all of a (B, S, H, D) tensor.
HostTensor slice_bshd(const HostTensor& tensor, std::int64_t batch, std::int64_t seq,
                      std::int64_t heads) {
  TensorView source = tensor.view();
  source.shape = {batch, seq, heads, tensor.shape()[3]};
  HostTensor result(tensor.dtype(), source.shape);
  copy_into(source, result.view());
  return result;
}

// [0, batch) x [0, heads) x [0, seq) of a (B, H, S) log-sum-exp.
HostTensor slice_lse(const HostTensor& lse, std::int64_t batch, std::int64_t heads,
                     std::int64_t seq) {
  TensorView source = lse.view();
  source.shape = {batch, heads, seq};
  HostTensor result(lse.dtype(), source.shape);
  copy_into(source, result.view());
  return result;
}

struct SliceCheck {
  double out_error = 0.0, lse_error = 0.0;
  double out_allowed = 0.0, lse_allowed = 0.0;
  bool passed() const { return out_error <= out_allowed && lse_error <= lse_allowed; }
};

SliceCheck check_slice(const Problem& problem, const Inputs& inputs, const Outputs& outputs) {
  for (const Graph* graph : {&problem.score_mod(), &problem.mask_mod()}) {
    for (const GraphNode& node : graph->nodes()) {
      if (node.op == Op::kQueryLen) {
        throw_internal("demo: a modifier reading Q_LEN cannot be checked on a query slice");
      }
    }
  }
  ProblemDesc desc = problem.desc();
  desc.batch = 1;
  desc.heads_q = desc.heads_kv = kSliceHeads;
  desc.seq_len_q = kSliceRows;
  desc.device = Device::kCpu;
  const Problem sliced(desc);
  Inputs slice;
  slice.q = slice_bshd(inputs.q, 1, kSliceRows, kSliceHeads);
  slice.k = slice_bshd(inputs.k, 1, problem.seq_len_kv(), kSliceHeads);
  slice.v = slice_bshd(inputs.v, 1, problem.seq_len_kv(), kSliceHeads);
  const Outputs reference = run_reference(sliced, slice);
  SliceCheck check;
  check.out_error =
      max_abs_error(slice_bshd(outputs.out, 1, kSliceRows, kSliceHeads), reference.out);
  check.lse_error =
      max_abs_error(slice_lse(outputs.lse, 1, kSliceHeads, kSliceRows), reference.lse);
  const double relative = relative_tolerance(problem.dtype());
  check.out_allowed = relative * std::max(1.0, max_abs_value(reference.out));
  check.lse_allowed = relative * std::max(1.0, max_abs_value(reference.lse));
  return check;
}

// The best engine's plan, in bf16 when it supports bf16, else in fp32.
Selection select_demo(Context& context) {
  try {
    return select_plan(context, demo_desc(DType::kBF16));
  } catch (const Error& error) {
    if (error.code() != ErrorCode::kUnsupported) throw;
  }
  return select_plan(context, demo_desc(DType::kF32));
}

}  // namespace

void add_demo_command(CLI::App& app, DemoFlags& flags) {
  CLI::App* demo = app.add_subcommand(
      "demo", "run Gemma-2 style attention (softcap 30 + causal) on the best engine and check it");
  demo->add_option("--engine", flags.engine, "engine to force, or auto (default auto)");
  demo->add_flag("--json", flags.json, "print a machine-readable summary");
  demo->add_flag("--with-planted-faults", flags.planted_faults,
                 "add the deliberately faulty test engines")
      ->group("");
}

int demo_command(const DemoFlags& flags) {
  Context context(context_options(flags.engine, flags.planted_faults));
  const Selection selection = select_demo(context);
  const Problem& problem = selection.problem;
  Setup no_files;
  const Inputs inputs = make_inputs(problem, no_files, kSeed, "");
  const Outputs outputs = run_plan(selection, inputs, 1);
  const SliceCheck check = check_slice(problem, inputs, outputs);
  const double kept = kept_fraction(problem);
  const double gflops = attention_flops(problem, kept) * kFlopsToGiga / outputs.forward_seconds;
  const PlanInfo& info = selection.plan->info();
  const std::string slice =
      fmt::format("batch 0, heads 0-{}, query rows 0-{}", kSliceHeads - 1, kSliceRows - 1);

  if (flags.json) {
    const nlohmann::ordered_json summary = {
        {"engine", info.engine},
        {"plan", info.description},
        {"problem", problem_summary(problem)},
        {"forward_ms", outputs.forward_seconds * kSecondsToMilliseconds},
        {"gflops", gflops},
        {"kept_fraction", kept},
        {"check",
         {{"reference", "cpu_ref"},
          {"slice", slice},
          {"max_abs_error", {{"out", check.out_error}, {"lse", check.lse_error}}},
          {"allowed", {{"out", check.out_allowed}, {"lse", check.lse_allowed}}},
          {"passed", check.passed()}}},
    };
    fmt::print("{}\n", summary.dump(2));
  } else {
    fmt::print("flexattn demo: Gemma-2 style attention (logit softcap 30, causal mask)\n");
    fmt::print("problem   {}\n", problem_summary(problem));
    fmt::print("engine    {}\nplan      {}\n", info.engine, info.description);
    fmt::print("time      {:.1f} ms (forward)\n", outputs.forward_seconds * kSecondsToMilliseconds);
    fmt::print("rate      {:.2f} GFLOP/s ({:.0f}% of (q, kv) pairs kept by the mask)\n", gflops,
               100.0 * kept);
    fmt::print(
        "check     max abs error vs cpu_ref (float64) on {}: out {:.2e} (allowed {:.2e}), "
        "lse {:.2e} (allowed {:.2e}): {}\n",
        slice, check.out_error, check.out_allowed, check.lse_error, check.lse_allowed,
        check.passed() ? "ok" : "FAILED");
    if (info.engine == "cpu_ref") {
      fmt::print(
          "note      the engine is the reference itself, so the check only shows {} "
          "storage rounding\n",
          to_string(problem.dtype()));
    }
  }
  if (!check.passed()) {
    throw_internal(fmt::format(
        "demo: {} disagrees with cpu_ref on {} (out {:.3g}, allowed {:.3g}; lse {:.3g}, allowed "
        "{:.3g})",
        info.engine, slice, check.out_error, check.out_allowed, check.lse_error,
        check.lse_allowed));
  }
  return 0;
}

}  // namespace flexattn::cli
