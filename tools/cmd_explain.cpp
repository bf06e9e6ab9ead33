// `flexattn explain`: what flexattn makes of a problem: the canonical modifiers, their hash and
// derivatives, the verdict of every engine and, with --source, the code engines generate for it
// (nothing is run).
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

struct GeneratedSource {
  std::string engine;
  std::string code;
};

// The code of every engine that generates some (Engine::generated_source), for the problem on
// that engine's device. The cuda engine's translation unit starts with the kernel templates of
// src/engines/cuda/kernels; only what follows its "generated" marker is this problem's own.
std::vector<GeneratedSource> generated_sources(const Context& context, const ProblemDesc& desc) {
  constexpr std::string_view kGeneratedMarker = "// ---- generated";
  std::vector<GeneratedSource> sources;
  for (const auto& engine : context.engines()) {
    std::string code = engine->generated_source(problem_on(desc, engine->device()));
    if (code.empty()) continue;
    if (const std::size_t marker = code.find(kGeneratedMarker); marker != std::string::npos) {
      code.erase(0, marker);
    }
    sources.push_back({std::string(engine->name()), std::move(code)});
  }
  return sources;
}

}  // namespace

void add_explain_command(CLI::App& app, ProblemFlags& problem, ExplainFlags& flags) {
  CLI::App* explain = app.add_subcommand(
      "explain",
      "show the canonical modifier, its hash and derivatives, and every engine's verdict");
  add_problem_flags(*explain, problem);
  explain->add_flag("--json", flags.json, "print a machine-readable summary");
  explain->add_flag("--source", flags.source,
                    "also print the code engines generate for the problem (the cuda engine's "
                    "modifier and kernel entry points)");
}

int explain_command(const ProblemFlags& flags, const ExplainFlags& explain) {
  const bool json = explain.json;
  const Setup setup = build_setup(flags);
  const Context context(context_options(flags.engine, flags.planted_faults));
  const Problem problem = problem_on(setup.desc, Device::kCpu);
  const std::vector<Verdict> verdicts = explain_all(context, setup.desc);
  const Verdict* selected = would_select(verdicts);
  const Derivatives derivatives = derivatives_of(problem.score_mod());
  const Policy& policy = context.options().policy;
  const std::vector<GeneratedSource> sources =
      explain.source ? generated_sources(context, setup.desc) : std::vector<GeneratedSource>();

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
    nlohmann::ordered_json summary = {
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
    if (explain.source) {
      nlohmann::ordered_json generated = nlohmann::ordered_json::object();
      for (const GeneratedSource& source : sources) generated[source.engine] = source.code;
      summary["generated_source"] = generated;
    }
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
  if (explain.source && sources.empty()) fmt::print("no engine generates code\n");
  for (const GeneratedSource& source : sources) {
    fmt::print("code generated by {}:\n{}", source.engine, source.code);
    if (!source.code.ends_with('\n')) fmt::print("\n");
  }
  return 0;
}

}  // namespace flexattn::cli
