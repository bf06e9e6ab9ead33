// Which forward and backward kernels and tile shapes serve a problem (small pure functions, each
// constant with its why), and which kv tiles each query block visits (the mask's interval
// analysis), in query-major order and transposed to kv-major order for the backward.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexattn/problem.hpp"

namespace flexattn::cuda {

enum class KernelKind {
  kMma,    // tensor cores (mma.sync, sm_80+), bf16/fp16 storage (kernels/forward_mma.cuh)
  kWgmma,  // Hopper's warpgroup tensor cores (sm_90a), head dims 64 to 256 (forward_wgmma.cuh)
  kSimt,   // fp32 units: fp32 storage, or head dims the tensor-core kernel cannot take
  kDecode,  // queries against a paged KV cache (kernels/decode.cuh): tensor cores or fp32 units
};

// The kernels' element type tag of a storage dtype ("flexattn_kernels::BFloat16Tag").
const char* element_tag(DType dtype);

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
  int class_block_q =
      0;           // query rows per classified block of the tile list (a multiple of block_m)
  int stages = 0;  // mma: K/V shared-memory buffers in flight
  bool pipelined = false;  // wgmma: tile j's element work overlaps tile j - 1's P V
  bool take_turns = false;  // wgmma, pipelined: warpgroup 1 issues its products after 0's
  bool stage_tensor = false;  // wgmma: the modifier's stageable tensor (codegen.hpp) in shared memory
  // wgmma: a third warpgroup copies K and V and hands the stages over through mbarriers (the
  // `warps` count only the two that compute; threads() adds its 128).
  bool producer = false;
  // decode: the K rows and the lanes' V columns are read 16 bytes (or the columns' width) at a
  // time; the views' strides allow it and the engine checks the addresses at each call.
  bool vector_loads = false;
  // decode: the tensor-core variant (mma.sync over 16 packed query rows, DecodeMmaConfig).
  bool tensor_cores = false;
  // decode, sm_90: chunked prefill on the wgmma forward (forward_prefill_wgmma, WgmmaConfig; the
  // wgmma fields above describe it).
  bool paged_wgmma = false;
  int min_blocks = 0;      // mma: thread blocks per multiprocessor the registers must allow
  int shared_bytes = 0;

  int threads() const;
  // wgmma: whether the loop can take turns (pipelined, two warpgroups).
  bool turns_possible() const;
  // The C++ type of the kernel configuration ("flexattn_kernels::MmaConfig<...>").
  std::string config_type() const;
  std::string describe() const;  // "mma bf16, 128x64 tiles, 4 warps, 2 stages, qk 80->128, v 80"
  // The kernel template ("forward_mma", ...) and the NVRTC architecture suffix its instructions
  // need ("a" for sm_90a: wgmma), which the kernel cache adds to its key.
  std::string kernel_template() const;
  std::string architecture_suffix() const;
};

// The kernel for `problem`, or an empty `reason` explaining why the engine cannot serve it.
// `capability` is the device's compute capability (90 for sm_90), 0 when unknown: only a known
// sm_90 gets the wgmma kernel; `allow_wgmma` false keeps the mma.sync kernel there too (the
// engine's FLEXATTN_CUDA_WGMMA=0 setting).
struct KernelSelection {
  KernelChoice choice;
  std::string reason;  // empty when a kernel fits
};
KernelSelection choose_kernel(const Problem& problem, int capability, bool allow_wgmma = true);

// The wgmma forward with the modifier's stageable tensor (codegen.hpp: stageable_tensor) staged
// in shared memory beside K and V, a tile per stage: the loop without pipelining, two stages;
// head dim 128: 128-key tiles, one block per multiprocessor; head dim 64: 64-key tiles, two
// blocks; wider head dims: their 64-key tiles, one block (what the engine does wherever it fits).
// Returns why it cannot (choice unchanged), or empty. Other kernel kinds are left alone.
std::string stage_wgmma_tensor(KernelChoice& choice);

// The same kernel shape without the staged tensor: the forward the engine runs for a call whose
// staged tensor is not 16-byte aligned (it must walk the same tile list on the same grid).
KernelChoice without_staged_tensor(const KernelChoice& staged);

// For every classified query block c (class_block_q rows), the kv tiles to visit:
// entries[offsets[c] .. offsets[c + 1]), each kv_tile << 1 | mixed (the mask must be evaluated
// per element). Tiles the mask removes entirely are absent; tiles it keeps entirely are not mixed.
struct TileList {
  int class_block_q = 0;
  int block_n = 0;
  std::vector<int> offsets;
  std::vector<int> entries;
  std::int64_t query_blocks = 0;
  std::int64_t kv_tiles = 0;
  std::int64_t tiles = 0;    // all (query block, kv tile) pairs
  std::int64_t skipped = 0;  // removed by the mask
  std::int64_t mixed = 0;    // visited with the mask evaluated
};
// Throws Error(kUnsupported) when the list would be too large to hold.
TileList classify_tiles(const Problem& problem, int class_block_q, int block_n);

// The same pairs in kv-major order (the backward's dK/dV kernel owns a kv tile): for kv tile t,
// entries[offsets[t] .. offsets[t + 1]) are the query blocks that visit it, ascending, each
// q_block << 1 | mixed.
struct KvTileList {
  std::vector<int> offsets;  // kv_tiles + 1
  std::vector<int> entries;
};
KvTileList transpose_tiles(const TileList& list);

// ---- backward ----------------------------------------------------------------------------------

// The backward kernels (dK/dV and dQ) of one kind: kernels/backward_mma.cuh or backward_simt.cuh.
struct BackwardChoice {
  KernelKind kind = KernelKind::kMma;
  DType dtype = DType::kBF16;
  int head_dim_qk = 0;
  int head_dim_v = 0;
  int padded_qk = 0;  // mma: shared-memory row width (a multiple of 64); simt: the head dim
  int padded_v = 0;
  int block_q = 0;   // query rows per block (and per classified block of the tile list)
  int block_kv = 0;  // keys per kv tile
  int threads = 0;
  int min_blocks = 0;   // mma: thread blocks per multiprocessor the registers must allow; simt: 0
  int shared_dkdv = 0;  // dynamic shared memory of the dK/dV kernel, bytes
  int shared_dq = 0;    // of the dQ kernel
  // mma: dK/dV blocks per kv tile: 1, or 2 (one for dV, one for dK) where both accumulators do
  // not fit a thread's registers (padded qk + padded v > 256)
  int dkdv_parts = 1;
  std::string why;      // why this kind ("fp32 storage", "head dims 17 and 17 are not ...")
  // Both kernels on wgmma (kernels/backward_wgmma.cuh; sm_90, head dims 64/128), each with its
  // own block, threads and tile list: dK/dV block_q x dkdv_block_kv (kv-major), dQ
  // dq_block_q x block_kv (q-major). Without wgmma they are block_q, block_kv and `threads`.
  bool wgmma = false;
  int dkdv_block_kv = 0;  // keys per dK/dV block
  int dq_block_q = 0;     // query rows per dQ block
  int dkdv_threads = 0;
  int dq_threads = 0;
  int shared_wgmma_dkdv = 0;  // the wgmma kernels' dynamic shared memory, bytes
  int shared_wgmma_dq = 0;
  // Head dims 256 and 192/128 on sm_90: both kernels on wgmma with the two warpgroups of a block
  // splitting the columns (kernels/backward_wgmma_wide.cuh):
  // 64 keys per dK/dV block, 64 rows per dQ block (the mma.sync tile lists), one part, 256 threads
  // each, shared_wgmma_dkdv and shared_wgmma_dq bytes.
  bool wgmma_wide = false;

  // The dynamic shared memory each kernel is launched with (wgmma or not).
  int dkdv_shared_bytes() const { return wgmma || wgmma_wide ? shared_wgmma_dkdv : shared_dkdv; }
  int dq_shared_bytes() const { return wgmma || wgmma_wide ? shared_wgmma_dq : shared_dq; }

  // The C++ type of the kernel configuration ("flexattn_kernels::BackwardMmaConfig<...>").
  std::string config_type() const;
  // The wgmma kernels' ("flexattn_kernels::BackwardWgmmaConfig<...>"; with `wgmma`), or the
  // wide ones' ("flexattn_kernels::BackwardWgmmaWideConfig<...>"; with wgmma_wide).
  std::string wgmma_config_type() const;
  // "a" when the kernels need sm_90a (wgmma).
  std::string architecture_suffix() const;
  // "backward_dkdv_mma" / "backward_dkdv_simt" and the dQ counterparts.
  std::string dkdv_template() const;
  std::string dq_template() const;
  std::string describe() const;
};

struct BackwardSelection {
  BackwardChoice choice;
  std::string reason;  // empty when a kernel fits
};
// `capability` and `allow_wgmma` as for choose_kernel: only a known sm_90 gets the wgmma dK/dV
// kernel.
BackwardSelection choose_backward_kernel(const Problem& problem, int capability = 0,
                                         bool allow_wgmma = true);

}  // namespace flexattn::cuda
