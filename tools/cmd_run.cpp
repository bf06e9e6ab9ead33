// `flexattn run`: one problem through the selected engine, with inputs from .npy files or random,
// optional comparison with cpu_ref, and outputs written (atomically, after everything succeeded).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "cli.hpp"
#include "flexattn/conformance.hpp"

namespace flexattn::cli {

namespace {

constexpr double kSecondsToMilliseconds = 1e3;
constexpr double kFlopsToGiga = 1e-9;

struct NamedOutput {
  std::string name;  // "out", "lse", "dq", ..., "d<tensor>"
  std::string path;  // empty: not written
  const HostTensor* tensor;
  const HostTensor* reference = nullptr;
};

std::vector<NamedOutput> named_outputs(const RunFlags& flags, const Problem& problem,
                                       const Outputs& outputs, const Outputs* reference,
                                       const std::map<std::string, std::string>& dtensors) {
  std::vector<NamedOutput> result;
  const auto add = [&](std::string name, std::string path, const HostTensor& tensor,
                       const HostTensor* expected) {
    result.push_back({std::move(name), std::move(path), &tensor, expected});
  };
  add("out", flags.out_file, outputs.out, reference ? &reference->out : nullptr);
  add("lse", flags.lse_file, outputs.lse, reference ? &reference->lse : nullptr);
  if (!problem.wants_backward()) return result;
  add("dq", flags.dq_file, outputs.dq, reference ? &reference->dq : nullptr);
  add("dk", flags.dk_file, outputs.dk, reference ? &reference->dk : nullptr);
  add("dv", flags.dv_file, outputs.dv, reference ? &reference->dv : nullptr);
  for (const auto& [name, gradient] : outputs.tensor_grads) {
    const auto path = dtensors.find(name);
    add("d" + name, path == dtensors.end() ? "" : path->second, gradient,
        reference ? &reference->tensor_grads.at(name) : nullptr);
  }
  return result;
}

// --dtensor NAME=FILE for each float tensor the modifiers read; anything else is an input error.
std::map<std::string, std::string> gradient_files(const RunFlags& flags, const Problem& problem) {
  std::map<std::string, std::string> files;
  std::set<std::string> readable;
  for (const Graph* graph : {&problem.score_mod(), &problem.mask_mod()}) {
    for (const std::string& name : graph->tensors()) {
      if (is_floating(problem.desc().tensors.at(name).dtype)) readable.insert(name);
    }
  }
  for (const std::string& assignment : flags.dtensor_files) {
    auto [name, path] = split_assignment(assignment, "--dtensor");
    if (!readable.contains(name)) {
      throw_invalid(fmt::format(
          "--dtensor '{}': the modifiers read no floating-point tensor '{}' (they read: {})",
          assignment, name,
          readable.empty() ? "none" : fmt::format("{}", fmt::join(readable, ", "))));
    }
    if (!files.emplace(name, path).second) {
      throw_invalid(fmt::format("--dtensor '{}' is given twice", name));
    }
  }
  return files;
}

void check_flag_combinations(const ProblemFlags& problem, const RunFlags& flags) {
  if (!problem.backward) {
    for (const auto& [flag, value] :
         {std::pair<const char*, const std::string*>{"--dout", &flags.dout_file},
          {"--dq", &flags.dq_file},
          {"--dk", &flags.dk_file},
          {"--dv", &flags.dv_file}}) {
      if (!value->empty()) throw_invalid(fmt::format("{} needs --backward", flag));
    }
    if (!flags.dtensor_files.empty()) throw_invalid("--dtensor needs --backward");
  }
  if (flags.repeat < 1)
    throw_invalid(fmt::format("--repeat must be at least 1, not {}", flags.repeat));
  std::vector<std::pair<std::string, std::string>> outputs = {{"--out", flags.out_file},
                                                              {"--lse", flags.lse_file},
                                                              {"--dq", flags.dq_file},
                                                              {"--dk", flags.dk_file},
                                                              {"--dv", flags.dv_file}};
  for (const std::string& assignment : flags.dtensor_files) {
    outputs.emplace_back("--dtensor", split_assignment(assignment, "--dtensor").second);
  }
  std::vector<std::pair<std::string, std::string>> inputs = {
      {"--q", problem.q_file},
      {"--k", problem.k_file},
      {"--v", problem.v_file},
      {"--dout", flags.dout_file},
      {"--page-table", problem.page_table_file}};
  for (const std::string& assignment : problem.tensors) {
    inputs.emplace_back("--tensor",
                        parse_tensor_file(split_assignment(assignment, "--tensor").second).path);
  }
  check_output_paths(outputs, inputs);
}

// Every output against cpu_ref under the conformance rule (per element, the tolerance from the
// plain same-precision implementation run on the same inputs).
std::vector<conformance::OutputCheck> check_outputs(const Problem& problem, const Inputs& inputs,
                                                    const std::vector<NamedOutput>& named) {
  ProblemDesc desc = problem.desc();
  desc.device = Device::kCpu;
  desc.q_strides = desc.k_strides = desc.v_strides = desc.o_strides = std::nullopt;
  const Problem plain_problem(desc);
  const DType dtype = problem.dtype();
  const DType stats_dtype = DType::kF32;
  Outputs plain;
  plain.out = HostTensor(dtype, plain_problem.expected("o").shape);
  plain.lse = HostTensor(stats_dtype, plain_problem.expected("lse").shape);
  ForwardArgs forward{inputs.q.view(),  inputs.k.view(),  inputs.v.view(),
                      plain.out.view(), plain.lse.view(), {},
                      nullptr};
  for (const auto& [name, tensor] : inputs.tensors) forward.tensors[name] = tensor.view();
  if (problem.kv_cache()) {
    forward.page_table = inputs.page_table.view();
    forward.cache_lens = inputs.cache_lens.view();
  }
  conformance::plain_forward(plain_problem, forward);
  if (problem.wants_backward()) {
    plain.dq = HostTensor(dtype, inputs.q.shape());
    plain.dk = HostTensor(dtype, inputs.k.shape());
    plain.dv = HostTensor(dtype, inputs.v.shape());
    BackwardArgs backward;
    backward.q = forward.q, backward.k = forward.k, backward.v = forward.v;
    backward.out = plain.out.view(), backward.lse = plain.lse.view();
    backward.dout = inputs.dout.view();
    backward.dq = plain.dq.view(), backward.dk = plain.dk.view(), backward.dv = plain.dv.view();
    backward.tensors = forward.tensors;
    for (const NamedOutput& output : named) {
      if (output.name.size() < 2 || !inputs.tensors.contains(output.name.substr(1))) continue;
      const std::string tensor = output.name.substr(1);
      plain.tensor_grads.emplace(tensor,
                                 HostTensor(stats_dtype, inputs.tensors.at(tensor).shape()));
      backward.tensor_grads[tensor] = plain.tensor_grads.at(tensor).view();
    }
    conformance::plain_backward(plain_problem, backward);
  }
  std::vector<conformance::OutputCheck> checks;
  for (const NamedOutput& output : named) {
    const bool storage =
        output.name == "out" || output.name == "dq" || output.name == "dk" || output.name == "dv";
    const HostTensor& plain_output = output.name == "out"   ? plain.out
                                     : output.name == "lse" ? plain.lse
                                     : output.name == "dq"  ? plain.dq
                                     : output.name == "dk"  ? plain.dk
                                     : output.name == "dv"
                                         ? plain.dv
                                         : plain.tensor_grads.at(output.name.substr(1));
    checks.push_back(conformance::compare_output(output.name, output.tensor->view(),
                                                 plain_output.view(), output.reference->view(),
                                                 storage ? dtype : stats_dtype));
  }
  return checks;
}

}  // namespace

void add_run_command(CLI::App& app, ProblemFlags& problem, RunFlags& flags) {
  CLI::App* run = app.add_subcommand("run", "run one attention problem and write its outputs");
  add_problem_flags(*run, problem);
  run->add_option("--out", flags.out_file, "output .npy (float64 for fp64, else float32)");
  run->add_option("--lse", flags.lse_file, "log-sum-exp .npy");
  run->add_option("--dout", flags.dout_file,
                  "backward: gradient of the output .npy (default random)");
  run->add_option("--dq", flags.dq_file, "backward: dQ .npy");
  run->add_option("--dk", flags.dk_file, "backward: dK .npy");
  run->add_option("--dv", flags.dv_file, "backward: dV .npy");
  run->add_option("--dtensor", flags.dtensor_files,
                  "backward: gradient of a tensor the score modifier reads, NAME=FILE.npy");
  run->add_flag("--check", flags.check,
                "compare every output with cpu_ref in float64, per element within the conformance "
                "tolerance; on a disagreement exit 4 and write no output file");
  run->add_flag("--json", flags.json, "print a machine-readable summary");
  run->add_option("--repeat", flags.repeat,
                  "runs to time (CPU: median; GPU: back to back; default 1)");
}

int run_command(const ProblemFlags& problem_flags, const RunFlags& flags) {
  check_flag_combinations(problem_flags, flags);
  Setup setup = build_setup(problem_flags);
  const std::map<std::string, std::string> dtensors =
      gradient_files(flags, problem_on(setup.desc, Device::kCpu));
  Context context(context_options(problem_flags.engine, problem_flags.planted_faults));
  const Selection selection = select_plan(context, setup.desc);
  const Problem& problem = selection.problem;
  const Inputs inputs = make_inputs(problem, setup, problem_flags.seed, flags.dout_file);
  const Outputs outputs = run_plan(selection, inputs, flags.repeat);
  std::optional<Outputs> reference;
  if (flags.check) reference = run_reference(problem, inputs);

  const std::vector<NamedOutput> named =
      named_outputs(flags, problem, outputs, reference ? &*reference : nullptr, dtensors);
  std::vector<conformance::OutputCheck> checks;
  if (reference) checks = check_outputs(problem, inputs, named);
  const bool check_passed = std::all_of(
      checks.begin(), checks.end(), [](const conformance::OutputCheck& c) { return c.passed(); });
  // Outputs are written only when everything succeeded, the check included.
  const DType file_dtype = problem.dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
  std::vector<std::string> written;
  if (check_passed) {
    OutputFiles files;  // all or nothing
    for (const NamedOutput& output : named) {
      if (output.path.empty()) continue;
      files.add_npy(output.path, output.tensor->to(file_dtype));
      written.push_back(output.path);
    }
    files.commit();
  }
  std::string check_failure;
  for (const conformance::OutputCheck& check : checks) {
    if (check.passed()) continue;
    check_failure += fmt::format("{}{}: error {:.3g} > allowed {:.3g} at element {}",
                                 check_failure.empty() ? "" : "; ", check.output, check.max_error,
                                 check.allowed, check.worst_index);
  }
  const auto finish = [&]() {
    if (check_passed) return 0;
    std::fflush(stdout);
    fmt::print(stderr, "error: check against cpu_ref failed ({}); no output written\n",
               check_failure);
    return kExitCheckFailed;
  };

  const double kept = problem.kv_cache() ? 1.0 : kept_fraction(problem);
  const double seconds = outputs.forward_seconds + outputs.backward_seconds;
  const CacheWork cache = cache_work(problem, inputs);
  const double gflops =
      (cache.paged ? cache.flops : attention_flops(problem, kept)) * kFlopsToGiga / seconds;
  const PlanInfo& info = selection.plan->info();
  std::vector<std::pair<std::string, double>> errors;
  double worst = 0.0;
  if (reference) {
    for (const NamedOutput& output : named) {
      const double error = max_abs_error(*output.tensor, *output.reference);
      errors.emplace_back(output.name, error);
      worst = std::isnan(error) || std::isnan(worst) ? std::nan("") : std::max(worst, error);
    }
  }
  if (flags.json) {
    nlohmann::ordered_json summary = {
        {"engine", info.engine},
        {"plan", info.description},
        {"problem", problem_summary(problem)},
        {"modifier_hash", hash_to_hex(problem.modifier_hash())},
        {"forward_ms", outputs.forward_seconds * kSecondsToMilliseconds},
    };
    if (problem.wants_backward()) {
      summary["backward_ms"] = outputs.backward_seconds * kSecondsToMilliseconds;
    }
    summary["gflops"] = gflops;
    if (cache.paged) {
      summary["kv_cache_gb_per_s"] = cache.kv_bytes * kFlopsToGiga / seconds;
    } else {
      summary["kept_fraction"] = kept;
    }
    if (reference) {
      nlohmann::ordered_json by_output = nlohmann::ordered_json::object();
      for (const auto& [name, error] : errors) by_output[name] = error;
      summary["check"] = {{"reference", "cpu_ref"},
                          {"max_abs_error", by_output},
                          {"max_error", worst},
                          {"passed", check_passed}};
    }
    summary["outputs"] = written;
    fmt::print("{}\n", summary.dump(2));
    return finish();
  }
  fmt::print("engine    {}\nplan      {}\nproblem   {}\n", info.engine, info.description,
             problem_summary(problem));
  fmt::print("forward   {:.3f} ms\n", outputs.forward_seconds * kSecondsToMilliseconds);
  if (problem.wants_backward()) {
    fmt::print("backward  {:.3f} ms\n", outputs.backward_seconds * kSecondsToMilliseconds);
  }
  if (cache.paged) {
    fmt::print(
        "rate      {:.2f} GB/s of cached K and V read ({:.2f} GFLOP/s over every cached (q, "
        "kv) pair)\n",
        cache.kv_bytes * kFlopsToGiga / seconds, gflops);
  } else {
    fmt::print("rate      {:.2f} GFLOP/s ({:.0f}% of (q, kv) pairs kept)\n", gflops, 100.0 * kept);
  }
  if (reference) {
    std::vector<std::string> parts;
    for (const auto& [name, error] : errors) parts.push_back(fmt::format("{} {:.3g}", name, error));
    fmt::print("check     max abs error vs cpu_ref (float64): {}: {}\n", fmt::join(parts, ", "),
               check_passed ? "ok" : "FAILED");
  }
  if (!written.empty()) fmt::print("wrote     {}\n", fmt::join(written, ", "));
  return finish();
}

}  // namespace flexattn::cli
