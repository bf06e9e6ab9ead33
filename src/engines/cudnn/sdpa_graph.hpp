// The fused-attention operation graphs, laid out the way cuDNN's fused engines recognise them
// (the composite graphs of the cuDNN frontend): forward Q K^T -> scale -> modifier -> mask ->
// softmax (max, sub, exp, sum, log-sum-exp stats, div) -> P V, and backward with the modifier's
// derivative applied to dS. Q, K, V, O are strided views, so bshd, sbhd and bhsd need no copy.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engines/cudnn/backend.hpp"
#include "engines/cudnn/lowering.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cudnn {

// The modifier as lowered for this problem: the canonical score and mask modifiers (the graphs
// whose hash the plan records) and the score modifier's derivative for the backward pass.
struct ModifierLowering {
  GraphLowering score;
  GraphLowering mask;
  GraphLowering derivative;
  bool has_score_mod = false;   // not the identity
  bool has_mask = false;        // not the constant true
  bool has_derivative = false;  // the derivative is not the constant 1
};

// Plans the lowering of the problem's modifiers (no cuDNN call).
Support lower_modifiers(const Problem& problem, ModifierLowering& lowering);

// What the variant pack binds to each tensor uid at run time.
struct Binding {
  enum class Kind { kQ, kK, kV, kO, kStats, kDOut, kDQ, kDK, kDV, kTensor, kHost, kScratch };
  Kind kind = Kind::kQ;
  std::int64_t uid = 0;
  std::string tensor;      // kTensor: the name in ForwardArgs/BackwardArgs::tensors
  void* host = nullptr;    // kHost: a by-value scalar
  std::size_t offset = 0;  // kScratch: byte offset in the engine's scratch area
};

struct SdpaGraph {
  std::unique_ptr<GraphBuilder> builder;
  std::vector<Binding> bindings;
  std::size_t scratch_bytes = 0;         // fp32 tensors the engine places after cuDNN's workspace
  std::size_t stats_scratch_offset = 0;  // forward: where stats go when no lse is requested
  std::string summary;                   // "forward graph: 23 ops (modifier 3, mask 4)"
  bool fault_applied = false;            // tests of the plan proof: the fault was emitted
};

// `fault` is for tests of the plan proof only.
SdpaGraph build_forward_graph(std::shared_ptr<const Library> library, const Problem& problem,
                              const ModifierLowering& lowering,
                              CudnnLoweringFault fault = CudnnLoweringFault::kNone);
SdpaGraph build_backward_graph(std::shared_ptr<const Library> library, const Problem& problem,
                               const ModifierLowering& lowering,
                               CudnnLoweringFault fault = CudnnLoweringFault::kNone);

}  // namespace flexattn::cudnn
