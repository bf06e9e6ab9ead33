// The cudnn engine's plan proof (docs/design.md section 4): the score modifier, the mask and the
// modifier's derivative are rebuilt as IR graphs from an operation graph read back from its
// descriptors (readback.hpp) and from the values the variant pack passes for its by-value
// scalars, by a table inverse to lowering.cpp's, without consulting the request. The request is
// then brought to the form cuDNN can hold (parameters and lengths substituted, fp32 constants,
// exp2, log2 and clamp written as the operations that compute them, loads indexed by the axes
// they vary along) and compared with it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "engines/cudnn/guards.hpp"
#include "engines/cudnn/readback.hpp"
#include "flexattn/graph.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cudnn {

// What the variant pack binds to uids that are not computed by the graph.
struct BoundValues {
  std::map<std::int64_t, const void*> host;     // by-value scalars (float, int32 or bool)
  std::map<std::int64_t, std::string> tensors;  // tensors a modifier reads, by name
};

// The modifiers an operation graph computes.
struct ReadBackModifiers {
  Graph score_mod;
  Graph mask = Graph::always_true();
  double scale = 0.0;  // the by-value factor of the first matmul's output
  // Backward graphs: what multiplies dS (the literal 1 when nothing does), and the mask that
  // keeps non-finite derivatives out of masked elements (always true when there is no select).
  std::optional<Graph> derivative;
  Graph derivative_keep = Graph::always_true();
  std::string to_string() const;
};

// Throws Error(kInternal) naming what it cannot find or map back (an operation graph that is not
// an attention graph, a pointwise mode with no IR form).
ReadBackModifiers rebuild_modifiers(const GraphRecord& record, const BoundValues& bound,
                                    GraphKind kind);

// `graph` of `problem` in the form an operation graph can hold (see the header comment).
Graph cudnn_normal_form(const Graph& graph, const Problem& problem);

struct Proof {
  bool holds = false;
  std::string mismatch;  // the first part that differs, when it does not hold
  // The problem's modifier_hash (and backward hash) when it holds; the hash of what was read back
  // otherwise, which the request's cannot equal.
  std::uint64_t lowered_hash = 0;
  std::uint64_t lowered_backward_hash = 0;  // Problem::backward_hash when it holds, else 0
  std::uint64_t read_back_hash = 0;
};

Proof prove(const ReadBackModifiers& forward, const std::optional<ReadBackModifiers>& backward,
            const Problem& problem);

}  // namespace flexattn::cudnn
