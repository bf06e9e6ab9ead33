// From an operation graph to an execution plan: the heuristics' engine configs, screened by the
// exclusion list and the verified-engine list, finalized in preference order, and the engine the
// finalized plan will really run read back from the plan itself.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engines/cudnn/backend.hpp"
#include "engines/cudnn/guards.hpp"

namespace flexattn::cudnn {

struct Candidate {
  Descriptor config;  // CUDNN_BACKEND_ENGINECFG_DESCRIPTOR
  EngineChoice choice;
  int heuristic_mode = 0;
};

// The heuristics' engine configs (modes A, then FALLBACK), best first, without duplicates.
std::vector<Candidate> engine_candidates(const std::shared_ptr<const Library>& library,
                                         const Descriptor& operation_graph);

// The engine and knobs of an engine config.
EngineChoice read_choice(const Descriptor& engine_config);

struct ScreeningPolicy {
  ExclusionList exclusions;
  bool allow_unverified = false;
  std::size_t release = 0;     // the loaded cuDNN, as cudnnGetVersion() gives it
  std::string release_text;    // "9.19.0"
  int compute_capability = 0;  // of the device the plans run on
};

// Keeps the candidates the policy allows; `rejected` gets one line per refused one.
std::vector<Candidate> screen(std::vector<Candidate> candidates, GraphKind kind,
                              const ScreeningPolicy& policy, std::vector<std::string>& rejected);

struct FinalizedPlan {
  Descriptor plan;  // CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR
  EngineChoice choice;
  std::int64_t workspace_bytes = 0;
  std::size_t rank = 0;  // position among the screened candidates
  std::string readback;  // how `choice` was established
};

// Finalizes the first candidate cuDNN accepts, then checks the engine the plan records against
// the policy and throws Error(kCudnn) if it is excluded, unverified or cannot be read back (cuDNN
// may not swap in an engine behind the caller's back). Empty when every candidate was declined;
// `declined` lists them.
std::optional<FinalizedPlan> finalize_plan(const std::shared_ptr<const Library>& library,
                                           cudnnHandle_t handle,
                                           const std::vector<Candidate>& candidates, GraphKind kind,
                                           const ScreeningPolicy& policy,
                                           std::vector<std::string>& declined);

}  // namespace flexattn::cudnn
