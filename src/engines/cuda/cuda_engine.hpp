// `cuda`: fused flash-attention forward kernels for NVIDIA GPUs (sm_80 and newer), with the
// modifier compiled into the kernel at plan time (NVRTC) and cached in memory and on disk.
// Problems live on Device::kCuda: the data pointers of its arguments are device pointers.
#pragma once

#include <memory>
#include <string>

#include "flexattn/engine.hpp"

namespace flexattn {

std::shared_ptr<const Engine> make_cuda_engine();

namespace cuda {

// The translation unit a cuda plan for `problem` compiles on compute capability `capability`
// (the same lowering as plan(), without a device or a compile), and the architecture suffix it
// compiles with ("a": sm_90a). With a backward the unit compiles as two modules
// (codegen.hpp's kForwardModuleDefine and kBackwardModuleDefine). `reason` says why a problem is
// not served (then `source` is empty). For measuring compile times (bench/jit_compile.cpp).
struct PlanSource {
  std::string source;
  std::string suffix;
  std::string reason;
};
PlanSource plan_source(const Problem& problem, int capability);

}  // namespace cuda

}  // namespace flexattn
