#include "engines/cudnn/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "flexattn/error.hpp"

namespace flexattn::cudnn {
namespace {

// EXECUTION_PLAN_HANDLE (400) is marked deprecated in the 9.x headers but still read by the
// releases we target; named by value so the deprecation warning stays off.
constexpr auto kExecutionPlanHandle = static_cast<cudnnBackendAttributeName_t>(400);
constexpr std::int64_t kMaxKnobs = CUDNN_KNOB_TYPE_COUNTS;
// The start of a plan's JSON form, enough to name its engine in a message.
constexpr std::size_t kJsonExcerpt = 400;

std::string plan_json(const Descriptor& plan) {
  const Library& library = plan.library();
  std::int64_t count = 0;
  if (library.api().get_attribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
                                  CUDNN_TYPE_CHAR, 0, &count, nullptr) != CUDNN_STATUS_SUCCESS ||
      count <= 0) {
    return "unavailable";
  }
  std::string text(static_cast<std::size_t>(count), '\0');
  if (library.api().get_attribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
                                  CUDNN_TYPE_CHAR, count, &count,
                                  text.data()) != CUDNN_STATUS_SUCCESS) {
    return "unavailable";
  }
  return text.substr(0, std::min(text.find('\0'), kJsonExcerpt));
}

}  // namespace

EngineChoice read_choice(const Descriptor& engine_config) {
  EngineChoice choice;
  std::vector<Descriptor> engines = engine_config.get_descriptors(
      CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_BACKEND_ENGINE_DESCRIPTOR, 1, "ENGINECFG_ENGINE");
  if (engines.empty()) throw Error(ErrorCode::kCudnn, "cuDNN engine config without an engine");
  choice.global_index =
      engines.front().get_int64(CUDNN_ATTR_ENGINE_GLOBAL_INDEX, "ENGINE_GLOBAL_INDEX");
  std::vector<Descriptor> knobs = engine_config.get_descriptors(
      CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, kMaxKnobs,
      "ENGINECFG_KNOB_CHOICES");
  for (const Descriptor& knob : knobs) {
    cudnnBackendKnobType_t type{};
    knob.get(CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &type, "KNOB_TYPE");
    const std::int64_t value = knob.get_int64(CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, "KNOB_VALUE");
    choice.knobs.emplace_back(static_cast<std::int64_t>(type), value);
  }
  return choice;
}

std::vector<Candidate> engine_candidates(const std::shared_ptr<const Library>& library,
                                         const Descriptor& operation_graph) {
  std::vector<Candidate> candidates;
  std::set<std::string> seen;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Descriptor heuristics(library, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    heuristics.set_descriptor(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, operation_graph,
                              "ENGINEHEUR_OPERATION_GRAPH");
    heuristics.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "ENGINEHEUR_MODE");
    const cudnnStatus_t status = heuristics.try_finalize();
    // A mode that has nothing for this graph is an answer, not an error.
    if (is_not_supported(status)) continue;
    library->check(status, "finalize 'engine heuristics'");
    std::int64_t count = 0;
    library->check(library->api().get_attribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
                   "count ENGINEHEUR_RESULTS");
    if (count <= 0) continue;
    std::vector<Descriptor> configs =
        heuristics.get_descriptors(CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, count, "ENGINEHEUR_RESULTS");
    for (Descriptor& config : configs) {
      EngineChoice choice = read_choice(config);
      if (!seen.insert(choice.tag()).second) continue;
      candidates.push_back(Candidate{std::move(config), std::move(choice), static_cast<int>(mode)});
    }
  }
  return candidates;
}

std::vector<Candidate> screen(std::vector<Candidate> candidates, GraphKind kind,
                              const ScreeningPolicy& policy, std::vector<std::string>& rejected) {
  std::vector<Candidate> kept;
  for (Candidate& candidate : candidates) {
    if (const std::string pattern = policy.exclusions.match(candidate.choice); !pattern.empty()) {
      rejected.push_back(
          fmt::format("{} excluded (pattern '{}')", candidate.choice.tag(), pattern));
      continue;
    }
    if (!policy.allow_unverified &&
        !is_verified(kind, candidate.choice, policy.release, policy.compute_capability)) {
      rejected.push_back(fmt::format(
          "{} not verified for {} graphs on cuDNN {} sm_{} (verified: {})", candidate.choice.tag(),
          to_string(kind), policy.release_text, policy.compute_capability, verified_engines(kind)));
      continue;
    }
    kept.push_back(std::move(candidate));
  }
  return kept;
}

std::optional<FinalizedPlan> finalize_plan(const std::shared_ptr<const Library>& library,
                                           cudnnHandle_t handle,
                                           const std::vector<Candidate>& candidates, GraphKind kind,
                                           const ScreeningPolicy& policy,
                                           std::vector<std::string>& declined) {
  for (std::size_t rank = 0; rank < candidates.size(); ++rank) {
    const Candidate& candidate = candidates[rank];
    Descriptor plan(library, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR,
                    fmt::format("execution plan {}", candidate.choice.tag()));
    plan.set(kExecutionPlanHandle, CUDNN_TYPE_HANDLE, 1, &handle, "EXECUTION_PLAN_HANDLE");
    plan.set_descriptor(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, candidate.config,
                        "EXECUTION_PLAN_ENGINE_CONFIG");
    const cudnnStatus_t status = plan.try_finalize();
    if (status != CUDNN_STATUS_SUCCESS) {
      declined.push_back(
          fmt::format("{} declined: {}", candidate.choice.tag(), library->describe(status)));
      continue;
    }
    // The post-planning check: the engine the plan will run, read from the plan itself.
    EngineChoice chosen = candidate.choice;
    std::string readback = "read back from the plan";
    try {
      std::vector<Descriptor> configs = plan.get_descriptors(
          CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, 1,
          "EXECUTION_PLAN_ENGINE_CONFIG");
      if (configs.empty()) throw Error(ErrorCode::kCudnn, "no engine config in the plan");
      chosen = read_choice(configs.front());
    } catch (const Error& error) {
      readback = fmt::format("not readable from the plan ({}); plan JSON: {}", error.what(),
                             plan_json(plan));
      // cuDNN 9.19 answers the read-back (first device run); a release that does not leaves the
      // engine unproven, which only qualifying runs accept.
      if (!policy.allow_unverified) {
        throw Error(ErrorCode::kCudnn,
                    fmt::format("cudnn: the engine of the finalized {} plan is {} (asked for {})",
                                to_string(kind), readback, candidate.choice.tag()));
      }
    }
    if (const std::string pattern = policy.exclusions.match(chosen); !pattern.empty()) {
      throw Error(ErrorCode::kCudnn,
                  fmt::format("cudnn: the finalized {} plan runs engine {}, excluded by pattern "
                              "'{}' (asked for {})",
                              to_string(kind), chosen.tag(), pattern, candidate.choice.tag()));
    }
    if (!policy.allow_unverified &&
        !is_verified(kind, chosen, policy.release, policy.compute_capability)) {
      throw Error(ErrorCode::kCudnn,
                  fmt::format("cudnn: the finalized {} plan runs engine {}, which no device run "
                              "has verified on cuDNN {} (verified: {}; asked for {})",
                              to_string(kind), chosen.tag(), policy.release_text,
                              verified_engines(kind), candidate.choice.tag()));
    }
    FinalizedPlan result{std::move(plan), std::move(chosen), 0, rank, std::move(readback)};
    result.workspace_bytes = result.plan.get_int64(CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                   "EXECUTION_PLAN_WORKSPACE_SIZE");
    return result;
  }
  return std::nullopt;
}

}  // namespace flexattn::cudnn
