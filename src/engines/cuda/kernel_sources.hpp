// The kernel templates of src/engines/cuda/kernels, embedded at build time (embed_sources.cmake):
// params.cuh, device_math.cuh, tile_ops.cuh, forward_common.cuh, forward_mma.cuh and
// forward_simt.cuh as one self-contained text, to which codegen appends the generated modifier
// and the kernel entry point.
#pragma once

#include <string_view>

namespace flexattn::cuda {

std::string_view kernel_library_source();

}  // namespace flexattn::cuda
