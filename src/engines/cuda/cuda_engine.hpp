// `cuda`: fused flash-attention forward kernels for NVIDIA GPUs (sm_80 and newer), with the
// modifier compiled into the kernel at plan time (NVRTC) and cached in memory and on disk.
// Problems live on Device::kCuda: the data pointers of its arguments are device pointers.
#pragma once

#include <memory>

#include "flexattn/engine.hpp"

namespace flexattn {

std::shared_ptr<const Engine> make_cuda_engine();

}  // namespace flexattn
