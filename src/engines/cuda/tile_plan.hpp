// Which forward kernel and tile shape serve a problem (small pure functions, each constant with
// its why), and which kv tiles each query block visits (the mask's interval analysis).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexattn/problem.hpp"

namespace flexattn::cuda {

enum class KernelKind {
  kMma,   // tensor cores, bf16/fp16 storage (kernels/forward_mma.cuh)
  kSimt,  // fp32 units: fp32 storage, or head dims the tensor-core kernel cannot take
};

struct KernelChoice {
  KernelKind kind = KernelKind::kMma;
  DType dtype = DType::kBF16;
  int head_dim_qk = 0;
  int head_dim_v = 0;
  int padded_qk = 0;  // shared-memory row width (mma: a multiple of 64)
  int padded_v = 0;
  int tiles_per_warp = 0;  // mma: 16-row accumulator tiles per warp
  int warps = 0;
  int block_m = 0;  // query rows per thread block
  int block_n = 0;  // keys per kv tile
  int class_block_q = 0;  // query rows per classified block of the tile list (a multiple of block_m)
  int stages = 0;   // mma: K/V shared-memory buffers in flight
  int min_blocks = 0;  // mma: thread blocks per multiprocessor the registers must allow
  int shared_bytes = 0;

  int threads() const;
  // The C++ type of the kernel configuration ("flexattn_kernels::MmaConfig<...>").
  std::string config_type() const;
  std::string describe() const;  // "mma bf16, 128x64 tiles, 4 warps, 2 stages, qk 80->128, v 80"
};

// The kernel for `problem`, or an empty `reason` explaining why the engine cannot serve it.
struct KernelSelection {
  KernelChoice choice;
  std::string reason;  // empty when a kernel fits
};
KernelSelection choose_kernel(const Problem& problem);

// For every classified query block c (class_block_q rows), the kv tiles to visit:
// entries[offsets[c] .. offsets[c + 1]), each kv_tile << 1 | mixed (the mask must be evaluated
// per element). Tiles the mask removes entirely are absent; tiles it keeps entirely are not mixed.
struct TileList {
  int class_block_q = 0;
  int block_n = 0;
  std::vector<int> offsets;
  std::vector<int> entries;
  std::int64_t tiles = 0;    // all (query block, kv tile) pairs
  std::int64_t skipped = 0;  // removed by the mask
  std::int64_t mixed = 0;    // visited with the mask evaluated
};
// Throws Error(kUnsupported) when the list would be too large to hold.
TileList classify_tiles(const Problem& problem, int class_block_q, int block_n);

}  // namespace flexattn::cuda
