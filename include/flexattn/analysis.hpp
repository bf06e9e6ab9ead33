// What the IR knows about itself: evaluation at a point, symbolic derivatives, and interval
// analysis (tensor-load bounds and mask tile classification).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "flexattn/export.hpp"
#include "flexattn/graph.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn {

// ---- evaluation ----------------------------------------------------------------------------

struct EvalPoint {
  double score = 0.0;
  std::int64_t batch = 0, head = 0, query = 0, key = 0;
  std::int64_t query_length = 0, key_length = 0;
};

struct Bindings {
  std::map<std::string, double> params;
  std::map<std::string, TensorView> tensors;  // CPU views
};

// Evaluates in float64: f32 nodes in double precision, i32 nodes with exact integer semantics
// (floor division/modulo, x / 0 == 0). bool results are 0.0 / 1.0. A load index outside its tensor
// throws Error(kInternal): the problem's load analysis must have proven or clamped every index.
FLEXATTN_API double evaluate(const Graph& graph, const EvalPoint& point, const Bindings& bindings);

// Evaluates every node; `values` is resized to nodes().size(). For engines that want the
// intermediate values (e.g. the loaded values for tensor gradients).
FLEXATTN_API void evaluate_all(const Graph& graph, const EvalPoint& point, const Bindings& bindings,
                               std::vector<double>& values);

// ---- differentiation -----------------------------------------------------------------------

// d score_mod / d score, as a canonical f32 graph (0 where the modifier is piecewise constant).
FLEXATTN_API Graph derivative_wrt_score(const Graph& score_mod);

// For every distinct float tensor load `name[i...]` in the score modifier: the index expressions
// and d score_mod / d (the loaded value). The tensor's gradient is the sum, over every kept
// (b, h, q, kv), of dS * derivative scattered to the index.
struct LoadDerivative {
  std::string tensor;
  std::vector<Graph> indices;  // i32 graphs over the leaves
  Graph derivative;            // f32 graph over the leaves (may read score and tensors)
};
FLEXATTN_API std::vector<LoadDerivative> derivatives_wrt_tensors(const Graph& score_mod);

// ---- interval analysis ---------------------------------------------------------------------

// An inclusive interval; f32 intervals may be infinite. Empty when lo > hi.
struct Interval {
  double lo = 0.0;
  double hi = 0.0;
  bool contains(double x) const { return lo <= x && x <= hi; }
};

// Ranges of the leaves over the region analysed. Ragged (thd) batches give Q_LEN/KV_LEN ranges.
struct LeafRanges {
  Interval batch, head, query, key, query_length, key_length;
};

// Where a load's index range stands against its tensor's extent.
enum class LoadSafety { kInBounds, kClamped };

// Checks every tensor load of `graph` against `shapes` (name -> shape). Throws
// Error(kInvalidArgument) when an index that does not depend on loaded data can leave the tensor
// ("index 1 of rel[h, kv - q + 64] ranges over [-63, 191] but rel has 129 entries along
// dimension 1"), or on a rank mismatch / unbound tensor. Index expressions that depend on loaded
// data cannot be decided and are wrapped in clamp(index, 0, extent - 1). Returns the rewritten
// graph (equal to the input when nothing needed clamping).
FLEXATTN_API Graph
check_and_clamp_loads(const Graph& graph, const LeafRanges& ranges,
                      const std::map<std::string, std::vector<std::int64_t>>& shapes);

// The interval every node of `graph` can take over `ranges` (index by node). Loads of float
// tensors and data-dependent values are (-inf, inf); bool nodes are within [0, 1].
FLEXATTN_API std::vector<Interval> node_intervals(const Graph& graph, const LeafRanges& ranges);

enum class TileClass { kAllFalse, kAllTrue, kMixed };
FLEXATTN_API std::string_view to_string(TileClass tile_class);

// Classifies a bool mask over the rectangle query in [query_begin, query_end) x key in
// [key_begin, key_end) (half-open), with the other leaves over `ranges`. kAllFalse: every element
// is masked out (the tile can be skipped); kAllTrue: none is (the mask need not be evaluated).
// Sound: kMixed whenever the analysis cannot decide.
struct TileRect {
  std::int64_t query_begin, query_end, key_begin, key_end;
};
FLEXATTN_API TileClass classify_tile(const Graph& mask, const LeafRanges& ranges,
                                     const TileRect& tile);

}  // namespace flexattn
