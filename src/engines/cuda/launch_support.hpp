// What the cuda engine's plans and the non-finite repair (repair.hpp) share: the kernels' views
// and parameters of a problem, device copies of small int lists, the backward scratch's
// alignment, and kernel launches.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engines/cuda/codegen.hpp"
#include "engines/cuda/driver.hpp"
#include "engines/cuda/kernels/params.cuh"
#include "flexattn/engine.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cuda {

// Grid limits of y (heads) and z (batch); x allows 2^31 - 1.
inline constexpr std::int64_t kMaxGridYZ = 65535;
// Each part of a call's device scratch starts on the boundary cuMemAlloc guarantees.
inline constexpr std::size_t kScratchAlignment = 256;

inline std::int64_t ceil_div(std::int64_t value, std::int64_t divisor) {
  return (value + divisor - 1) / divisor;
}

// Whether the launch grids of `problem` fit (batch and heads within kMaxGridYZ, token counts
// within int).
Support launch_limits(const Problem& problem);

// (batch, token, head) strides of a Q/K/V/O view (or of its gradient) in the problem's layout.
flexattn_kernels::SequenceView sequence_view(const Problem& problem, std::string_view which);

// A device copy of `values` (an empty list still gets an address: a kernel argument is never
// null).
DeviceBuffer upload_ints(const std::shared_ptr<const Driver>& driver,
                         const std::vector<int>& values);
std::vector<int> to_ints(const std::vector<std::int64_t>& values);
const int* device_ints(const DeviceBuffer& buffer);

// `bytes` rounded up to kScratchAlignment.
std::size_t align_scratch(std::size_t bytes);

// The forward parameters every kernel of a problem shares (views without data, lengths,
// scale, parameters); thd's sequence offsets are uploaded into `cu_seqlens_q` and
// `cu_seqlens_kv`, which must outlive every launch with them.
flexattn_kernels::ForwardParams base_forward_params(const Problem& problem,
                                                    const ModifierBindings& bindings,
                                                    const std::shared_ptr<const Driver>& driver,
                                                    DeviceBuffer& cu_seqlens_q,
                                                    DeviceBuffer& cu_seqlens_kv);

// Points the views of `p` at the call's Q, K, V and O, and its LSE at `lse`.
void bind_views(const ForwardArgs& args, float* lse, flexattn_kernels::ForwardParams& p);
// The same for a backward call: its forward views, LSE, dO, dQ, dK and dV.
void bind_views(const BackwardArgs& args, flexattn_kernels::BackwardParams& p);

// Points the modifier's tensor slots of `p` at the call's tensors (bindings.tensors order).
void bind_tensors(const ModifierBindings& bindings,
                  const std::map<std::string, TensorView>& tensors,
                  flexattn_kernels::ForwardParams& p);

struct Grid {
  unsigned x, y, z;
};

// Launches `function` with its one argument block `params` (the driver copies it at launch).
template <class Params>
void launch(const Driver& driver, CUfunction function, Grid grid, int threads, int shared_bytes,
            CUstream stream, Params* params, std::string_view what) {
  std::array<void*, 1> kernel_args = {params};
  driver.check(driver.api().launch_kernel(
                   function, grid.x, grid.y, grid.z, static_cast<unsigned>(threads), 1, 1,
                   static_cast<unsigned>(shared_bytes), stream, kernel_args.data(), nullptr),
               fmt::format("cuLaunchKernel ({})", what));
}

}  // namespace flexattn::cuda
