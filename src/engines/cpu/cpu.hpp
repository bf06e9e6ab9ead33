// `cpu`: fused, tiled, multi-threaded, vectorised attention in float32 (fp32, fp16 and bf16
// storage), forward and backward, with the modifier compiled to a vector tape once per plan.
#pragma once

#include <memory>

#include "flexattn/engine.hpp"

namespace flexattn {

std::shared_ptr<const Engine> make_cpu_engine();

}  // namespace flexattn
