// Lowering a canonical modifier graph (the score or mask modifier, or a derivative) to cuDNN
// pointwise operations. It happens in two steps so that supports() can answer without cuDNN:
// plan_lowering() decides, by a table over every IR op, which cuDNN modes compute each node and
// refuses (naming the op) whatever has no faithful form; emit_lowering() adds those operations to
// an operation graph.
#pragma once

#include <cudnn_graph.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engines/cudnn/backend.hpp"
#include "engines/cudnn/fault.hpp"
#include "flexattn/engine.hpp"
#include "flexattn/graph.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cudnn {

// An operand of one cuDNN pointwise step: a node argument, an earlier step of the same node, or
// a constant introduced by the recipe (such as ln 2 in exp2).
struct Operand {
  enum class Kind { kArgument, kStep, kConstant };
  Kind kind = Kind::kArgument;
  std::size_t index = 0;  // kArgument: position in the node's args; kStep: step index
  double value = 0.0;     // kConstant (f32)
};

struct Step {
  cudnnPointwiseMode_t mode = CUDNN_POINTWISE_IDENTITY;
  cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  std::vector<Operand> operands;  // X, B, T
  Type result = Type::kF32;
};

// How one node is computed.
struct NodePlan {
  enum class Kind { kConstant, kScore, kIndex, kLoad, kSteps };
  Kind kind = Kind::kConstant;
  Type type = Type::kF32;
  double constant = 0.0;    // kConstant (bool: 0 or 1)
  std::int64_t axis = 0;    // kIndex: 0 batch, 1 head, 2 query, 3 key
  std::vector<Step> steps;  // kSteps
};

// A tensor a modifier reads, as a broadcast 4-D (batch, head, query, key) cuDNN tensor.
struct LoadBinding {
  std::string tensor;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  std::vector<std::int64_t> dims, strides;
};

struct GraphLowering {
  Graph graph;
  std::vector<NodePlan> nodes;                // by node index
  std::map<std::int32_t, LoadBinding> loads;  // by node index
  std::size_t operations = 0;                 // cuDNN ops emitted for non-constant nodes
  bool root_is_constant() const {
    return nodes[static_cast<std::size_t>(graph.root())].kind == NodePlan::Kind::kConstant;
  }
};

// Plans the lowering of `graph`, a canonical modifier of `problem` (or a derivative of one).
// Support::no names the first op or pattern that has no faithful cuDNN form.
Support plan_lowering(const Graph& graph, const Problem& problem, GraphLowering& lowering);

// The state shared by the lowerings emitted into one operation graph.
struct EmitContext {
  GraphBuilder* builder = nullptr;
  TensorId score = -1;  // the scaled score (batch, heads_q, seq_len_q, seq_len_kv), fp32
  std::map<std::string, TensorId> inputs;                      // tensors read, by binding key
  std::vector<std::pair<std::int64_t, std::string>> bindings;  // (uid, tensor name)
  std::map<std::int64_t, TensorId> indices;                    // GEN_INDEX outputs by axis
  CudnnLoweringFault fault = CudnnLoweringFault::kNone;        // tests of the plan proof only
  bool fault_applied = false;
};

// Adds the planned operations; returns the tensor holding the root's value (a by-value scalar for
// a constant root).
TensorId emit_lowering(const GraphLowering& lowering, EmitContext& context,
                       const std::string& prefix);

cudnnDataType_t cudnn_type(Type type);

}  // namespace flexattn::cudnn
