// `cudnn`: cuDNN's fused attention through its backend C API, with the score modifier and the
// mask lowered to cuDNN pointwise operations. cuDNN is opened at run time (libcudnn.so.9), so the
// library builds and loads without it. Problems live on Device::kCuda.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engines/cudnn/fault.hpp"
#include "flexattn/engine.hpp"

namespace flexattn {

struct CudnnOptions {
  // cuDNN engine names or tags never to run, as globs ("eng2", "eng1?_k*"); the patterns of
  // FLEXATTN_CUDNN_EXCLUDE (comma-separated) are added to these.
  std::vector<std::string> exclude;
  // Accept engines that no device run has verified. For qualifying a new cuDNN release only:
  // with it the post-planning check no longer rejects an engine the verified list lacks.
  bool allow_unverified_engines = false;
};

std::shared_ptr<const Engine> make_cudnn_engine(CudnnOptions options = {});

// The part of supports() that needs neither libcudnn nor a device: the constraints (for an sm_90
// device) and the lowering of the modifiers (and of the score modifier's derivative) to cuDNN
// pointwise modes. For unit tests of the lowering table on any machine built with cuDNN headers.
Support check_cudnn_lowering(const Problem& problem);

// The part of planning that needs libcudnn but no device: the constraints (for an sm_90 device),
// the lowering of the modifiers, and the construction of every tensor and operation descriptor of
// the forward (and backward) graph. Operation graphs, heuristics and plans need a device and are
// not built. For tests on machines with cuDNN installed and no GPU; `summary` describes the
// graphs built.
Support check_cudnn_graphs_without_device(const Problem& problem, std::string& summary);

// The plan proof on machines with cuDNN installed and no GPU: builds the descriptors of the
// forward (and backward) graph of `problem` with `fault` emitted into them, reads the modifiers
// back from the descriptors (proof.hpp) and proves them against the problem. The derivative is
// lowered also for the backward classes the engine refuses, so their graphs' proof is tested.
struct CudnnGraphProof {
  Support proof = Support::no("not proven");
  bool fault_applied = false;  // whether `fault` found something to break
  std::string read_back;       // the modifiers read back
};
CudnnGraphProof prove_cudnn_graphs_without_device(
    const Problem& problem, CudnnLoweringFault fault = CudnnLoweringFault::kNone);

}  // namespace flexattn
