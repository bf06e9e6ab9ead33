// The guards of the cudnn engine: the release table (cuDNN versions with known attention bugs),
// the documented constraints of the fused attention engines, the exclusion list of cuDNN engines
// and the list of engines a device run has verified. They exist because cuDNN chooses the kernel
// that runs a graph, and a kernel that ignores part of the graph computes the wrong function
// without an error (docs/design.md section 1).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flexattn/engine.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cudnn {

// A cuDNN engine and its knob settings, as the heuristics offer it or a plan records it.
struct EngineChoice {
  std::int64_t global_index = -1;
  std::vector<std::pair<std::int64_t, std::int64_t>> knobs;  // (knob type, value)
  std::string name() const;                                  // "eng5"
  std::string tag() const;  // "eng5_k2=1_k3=0", the cuDNN frontend's plan-name format
};

enum class GraphKind { kForward, kBackward };
std::string_view to_string(GraphKind kind);

// Engine name patterns (globs over name() or tag()) that must never run: from the API and from
// FLEXATTN_CUDNN_EXCLUDE (comma-separated, e.g. "eng2,eng1?_k*").
struct ExclusionList {
  std::vector<std::string> patterns;
  static std::vector<std::string> from_environment();
  // The first pattern that matches, empty when none does.
  std::string match(const EngineChoice& choice) const;
};

// Engines a device run of the conformance matrix has verified for a kind of graph: the engine tag
// (global index and knobs), the cuDNN release (a cudnnGetVersion() value, patch level included)
// and the compute capability must all match (verified_engines.inc).
bool is_verified(GraphKind kind, const EngineChoice& choice, std::size_t release,
                 int compute_capability);
std::string verified_engines(GraphKind kind);  // "eng2_k24=7 on cuDNN 9.19.0 sm_90"

// The release table. `modifier_graph` is whether the graph carries a score modifier or a mask.
Support check_release(std::size_t version, const std::string& version_text, const Problem& problem,
                      bool modifier_graph);

// The documented constraints of cuDNN's fused attention: sm80+, fp16/bf16, head dims, layouts,
// unit last strides, the backward's limits.
Support check_constraints(const Problem& problem, int compute_capability);

}  // namespace flexattn::cudnn
