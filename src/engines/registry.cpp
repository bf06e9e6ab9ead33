// The one list of built-in engines, in preference order (fastest first). cudnn leads: where it
// can compute a problem within tolerance it is the fastest (665.8 TFLOP/s forward on the H200,
// docs/engines.md), and it refuses everything else with a reason, so selection falls through to
// cuda, then the CPU engines.
#include "engines/cpu/cpu.hpp"
#include "engines/cpu_ref/cpu_ref.hpp"
#if FLEXATTN_HAVE_CUDA
#include "engines/cuda/cuda_engine.hpp"
#endif
#if FLEXATTN_HAVE_CUDNN
#include "engines/cudnn/cudnn_engine.hpp"
#endif
#include "flexattn/context.hpp"

namespace flexattn {

std::vector<std::shared_ptr<const Engine>> builtin_engines() {
  std::vector<std::shared_ptr<const Engine>> engines;
#if FLEXATTN_HAVE_CUDNN
  engines.push_back(make_cudnn_engine());
#endif
#if FLEXATTN_HAVE_CUDA
  engines.push_back(make_cuda_engine());
#endif
  engines.push_back(make_cpu_engine());
  engines.push_back(make_cpu_ref_engine());
  return engines;
}

}  // namespace flexattn
