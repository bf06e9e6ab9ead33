// `flexattn explain`: what flexattn makes of a problem: the canonical modifiers, their hash and
// derivatives, and the verdict of every engine (nothing is run).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "cli.hpp"

namespace flexattn::cli {

namespace {

struct TensorDerivative {
  std::string load;        // "bias[h, q, kv]"
  std::string derivative;  // IR text
};

struct Derivatives {
  std::string wrt_score;  // IR text, or why it could not be formed
  std::vector<TensorDerivative> wrt_tensors;
};

Derivatives derivatives_of(const Graph& score_mod) {
  Derivatives result;
  try {
    result.wrt_score = derivative_wrt_score(score_mod).to_string();
    for (const LoadDerivative& load : derivatives_wrt_tensors(score_mod)) {
      std::vector<std::string> indices;
      for (const Graph& index : load.indices) indices.push_back(index.to_string());
      result.wrt_tensors.push_back({fmt::format("{}[{}]", load.tensor, fmt::join(indices, ", ")),
                                    load.derivative.to_string()});
    }
  } catch (const Error& error) {
    result.wrt_score = fmt::format("(not differentiable: {})", error.what());
  }
  return result;
}

// The engine selection would choose: the first one the policy allows that supports the problem.
const Verdict* would_select(const std::vector<Verdict>& verdicts) {
  for (const Verdict& verdict : verdicts) {
    if (verdict.allowed && verdict.support) return &verdict;
  }
  return nullptr;
}

}  // namespace

void add_explain_command(CLI::App& app, ProblemFlags& problem, bool& json) {
  CLI::App* explain = app.add_subcommand(
      "explain",
      "show the canonical modifier, its hash and derivatives, and every engine's verdict");
  add_problem_flags(*explain, problem);
  explain->add_flag("--json", json, "print a machine-readable summary");
}

int explain_command(const ProblemFlags& flags, bool json) {
  const Setup setup = build_setup(flags);
  const Context context(context_options(flags.engine, flags.planted_faults));
  const Problem problem = problem_on(setup.desc, Device::kCpu);
  const std::vector<Verdict> verdicts = explain_all(context, setup.desc);
  const Verdict* selected = would_select(verdicts);
  const Derivatives derivatives = derivatives_of(problem.score_mod());
  const Policy& policy = context.options().policy;

  if (json) {
    nlohmann::ordered_json engines = nlohmann::ordered_json::array();
    for (const Verdict& verdict : verdicts) {
      engines.push_back({{"name", verdict.engine},
                         {"allowed", verdict.allowed},
                         {"policy", policy.refusal(verdict.engine)},
                         {"supported", verdict.support.ok()},
                         {"reason", verdict.support.reason()}});
    }
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    for (const TensorDerivative& derivative : derivatives.wrt_tensors) {
      tensors.push_back({{"load", derivative.load}, {"derivative", derivative.derivative}});
    }
    const nlohmann::ordered_json summary = {
        {"problem", problem_summary(problem)},
        {"signature", problem.signature()},
        {"score_mod", problem.score_mod().to_string()},
        {"mask_mod", problem.mask_mod().to_string()},
        {"modifier_hash", hash_to_hex(problem.modifier_hash())},
        {"derivative_wrt_score", derivatives.wrt_score},
        {"derivatives_wrt_tensors", tensors},
        {"engines", engines},
        {"selected", selected != nullptr ? nlohmann::ordered_json(selected->engine) : nullptr},
    };
    fmt::print("{}\n", summary.dump(2));
    return 0;
  }

  fmt::print("problem        {}\n", problem_summary(problem));
  fmt::print("score_mod      {}\n", problem.score_mod().to_string());
  fmt::print("mask_mod       {}\n", problem.mask_mod().to_string());
  fmt::print("modifier hash  {} (score_mod, mask_mod and scale {})\n",
             hash_to_hex(problem.modifier_hash()), problem.scale());
  fmt::print("d score_mod / d score: {}\n", derivatives.wrt_score);
  for (const TensorDerivative& derivative : derivatives.wrt_tensors) {
    fmt::print("d score_mod / d {}: {}\n", derivative.load, derivative.derivative);
  }
  fmt::print("engines, in preference order (* = selected):\n");
  std::size_t width = 0;
  for (const Verdict& verdict : verdicts) width = std::max(width, verdict.engine.size());
  for (const Verdict& verdict : verdicts) {
    std::string text = verdict.support ? "supported" : "no: " + verdict.support.reason();
    if (!verdict.allowed) text += "; " + policy.refusal(verdict.engine);
    fmt::print("  {} {:<{}}  {}\n", &verdict == selected ? '*' : ' ', verdict.engine, width, text);
  }
  if (selected == nullptr) fmt::print("no engine can run this problem\n");
  return 0;
}

}  // namespace flexattn::cli
