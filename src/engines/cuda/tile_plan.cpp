#include "engines/cuda/tile_plan.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "engines/cuda/graph_lowering.hpp"
#include "engines/cuda/kernels/params.cuh"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cuda {
namespace {

constexpr int kWarpSize = 32;
// The tensor-core kernel keeps head dims in 16-byte chunks (8 values of 16 bits).
constexpr int kChunkElements = 8;
// Shared-memory rows are swizzled in groups of 8 chunks, so they are padded to 64 values.
constexpr int kMmaRowMultiple = 64;
// Registers: O needs head_dim_v / 8 * 4 fp32 accumulators per 16-row tile; two tiles per warp
// (which halves the shared-memory reads per mma) fit up to head dim 128, one tile beyond.
constexpr int kLargeHeadDim = 128;
// The largest head dim either kernel holds (shared memory and registers).
constexpr int kMaxHeadDim = 256;
// 64 keys per tile: the S accumulators of a warp (tiles x 64 / 8 x 4 fp32) leave registers for
// O; the same tile for the fp32 kernel, so both read one tile list.
constexpr int kBlockN = 64;
constexpr int kMmaWarps = 4;
// Two stages overlap the copy of tile j+1 with tile j's math; a third does not fit beside
// two blocks per multiprocessor at head dim 128 (96 KB each of 228 KB).
constexpr int kMmaStages = 2;
// The fp32 kernel: 4 warps of 4 rows (each K element read from shared memory serves 4 rows).
constexpr int kSimtWarps = 4;
constexpr int kSimtRowsPerWarp = 4;
// The paged-cache kernel (decode_choice): warps per block and query rows per block at most.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeMaxRows = 8;
// Its tensor-core variant: packed query rows per block (one mma M), keys per tile, the bytes its
// ring of K/V tiles aims at, and the rows of each fp32 kernel call that recomputes a block with
// non-finite rows (DecodeMmaConfig::Fallback).
constexpr int kDecodeMmaRows = 16;
constexpr int kDecodeMmaBlockN = 64;
constexpr int kDecodeRingBytes = 96 * 1024;
constexpr int kDecodeFallbackRows = 8;
// Chunked prefill on the same kernel: with at least kPrefillRows packed rows per sequence and kv
// head (the GQA group times the new tokens) and head dims up to kPrefillMaxDim, each block takes
// kPrefillRows rows, a warp's 16 rows against whole tiles (DecodeMmaConfig::kRowSplit), so each
// tile it loads serves four times the rows. Its ring has the bytes the 16-row kernel's Q and ring
// take together, so two blocks still share a multiprocessor at head dim 128. At head dim 256 the
// 64-row kernel spills (255 registers, 40 bytes of spill stores; ptxas, sm_90a) and one block
// fills a multiprocessor's shared memory, so wider heads keep 16 rows.
constexpr int kPrefillRows = 64;
constexpr int kPrefillMaxDim = 128;
// On sm_90 chunked prefill takes the wgmma forward over the paged cache (prefill_on_wgmma) from
// this many new tokens per sequence: one 128-row block of one query head.
constexpr std::int64_t kPrefillWgmmaTokens = 128;
// The fp32 kernel's rows per classified block: 4 of its blocks share one class row.
constexpr int kSimtClassBlockQ = 64;
// wgmma (kernels/forward_wgmma.cuh): two warpgroups of 64 rows; 128-key tiles (each S = Q K^T is
// one m64n128 product; the accumulators, 64 for S and up to 64 for O per thread, fit the
// registers of 256 threads at one block per multiprocessor). At head dim 128 pipelined (tile j's
// element work while tile j - 1's P V runs: +5 - 7% with softcap and ALiBi, measured), which
// needs three stages of K and V (tile j's K, tile j - 1's V, tile j + 1's copy: 225 KB with Q, of
// the 227 KB a block may have); at head dim 64 the pipelined loop measured 8% slower without a
// modifier (287 vs 311 TFLOP/s), so it waits for each product, with two stages and two blocks
// per multiprocessor (registers capped at 128 a thread): on 64-key tiles 292 -> 352 TFLOP/s
// without a modifier, softcap 155 -> 174, causal 262 -> 301 (H200, 2026-12-02, docs/measurements);
// on 128-key tiles since (the S accumulators in 64 of the 128 registers) 353 -> 389, causal
// 301 -> 333, ALiBi 289 -> 338, causal softcap 186 -> 206, softcap 223 -> 221 (H200, 2026-12-03).
// At head dim 128 a producer warpgroup copies the stages (WgmmaConfig::kProducer): no modifier
// 470 -> 496, softcap 294 -> 299, causal softcap 260 -> 273 (H200, 2026-12-03); not with a staged
// tensor (359 -> 333) nor at head dim 64 (one block instead of two: 351 -> 241).
// Wider head dims (q/k 192 or 256, v 256: Gemma's 256, MLA's 192/128): O at v 256 is 128 fp32 a
// thread, so the kv tiles are 64 keys (S 32 fp32 a thread beside it, one block per
// multiprocessor: 255 registers); K and V of a tile take 64 KB at 256, so two stages (Q 64 KB +
// 2 x 64 KB) and no pipelining, which would need a third; no producer (the loop that waits for
// each product, as at head dim 64).
// Only the head dims it holds unpadded, on the architecture it exists on.
constexpr int kWgmmaBlockM = 128;
constexpr int kWgmmaBlockN = 128;
constexpr int kWgmmaWideBlockN = 64;
constexpr int kWgmmaWarps = 8;
constexpr int kWgmmaPipelinedHeadDim = 128;
constexpr int kWgmmaSmallMinBlocks = 2;     // head dim 64: two blocks per multiprocessor
constexpr int kWgmmaAlignment = 1024;       // the dynamic shared memory rounded up to the swizzle
constexpr int kWgmmaProducerThreads = 128;  // the producer warpgroup (WgmmaConfig::kProducer)
constexpr int kWgmmaBarrierBytes = 64;      // its stages' mbarriers
constexpr int kWgmmaCapability = 90;
constexpr int kWgmmaMaxSharedBytes = 227 * 1024;  // per block on sm_90
// Bound on the tile list (4 bytes an entry): 64 Mi entries, e.g. sequences of about 250k tokens.
constexpr std::int64_t kMaxTileEntries = std::int64_t{1} << 26;

// ---- backward (kernels/backward_mma.cuh, backward_simt.cuh) ----
// Both backward kernels run 4 warps.
constexpr int kBackwardThreads = 128;
// Tensor cores: 64 x 64 tiles, 16 rows per warp; the dK and dV accumulators of a 64-key tile
// (64 x (padded qk + padded v) fp32 over 128 threads) fit the registers up to 256 columns, e.g.
// head dims 128 and 128. Above, each tile has two dK/dV blocks, one for dV and one for dK
// (BackwardMmaConfig::kDkdvParts), up to head dim 256 each (kMaxHeadDim).
constexpr int kBackwardMmaBlock = 64;
constexpr int kBackwardMmaAccumulatorColumns = 256;
// Its accumulators take most of the registers: the launch bounds promise only one block per
// multiprocessor, so a thread may use up to 255 registers (two blocks still fit at that count).
constexpr int kBackwardMmaMinBlocks = 1;
// Q and dO (dK/dV kernel) or K and V (dQ kernel) are double-buffered.
constexpr int kBackwardMmaStages = 2;
// Per stage, the dK/dV kernel also stages lse and delta (two floats per query row).
constexpr int kBackwardRowStatistics = 2;
// fp32 units: 32 x 32 tiles keep P and dS (32 x 33 floats each, padded against bank conflicts)
// in shared memory beside the four row tiles, up to head dim 256.
constexpr int kBackwardSimtBlock = 32;
// wgmma (kernels/backward_wgmma.cuh): two warpgroups of 64 rows per block in both kernels. dK/dV:
// 128 keys, 64-row q blocks, three stages of Q, dO, LSE and delta, K and V resident. dQ: 128 query
// rows, 64-key kv tiles in three stages, Q and dO resident. 1024 bytes to align the swizzled
// panels. Three stages: the warpgroups run half a tile apart, so two tiles are read at once while
// the next one loads.
constexpr int kBackwardWgmmaBlock = 128;
constexpr int kBackwardWgmmaThreads = 256;
constexpr int kBackwardWgmmaStages = 3;
// The wide kernels (head dims 256 and 192/128, BackwardWgmmaWideConfig in
// kernels/backward_wgmma_wide.cuh): dK/dV with 64 keys resident and 64-row q blocks of Q, dO, LSE
// and delta in two stages; dQ with 64 rows of Q and dO resident and 64-key tiles of K and V in two
// stages; each with a 64 x 64 exchange tile per product it passes between the warpgroups (P^T and
// dS^T; dS), and dQ with the warpgroups' row sums (two floats a row each).
constexpr int kBackwardWideStages = 2;
// The head dims (q/k, v) the wide kernels take.
bool wide_backward_head_dims(std::int64_t qk, std::int64_t v) {
  return (qk == 256 && v == 256) || (qk == 192 && v == 128);
}

int round_up(int value, int multiple) { return (value + multiple - 1) / multiple * multiple; }

// Every non-unit stride of q, k, v, o is a whole number of 16-byte chunks, so each row starts
// 16-byte aligned when the data pointer is (checked at run time).
bool strides_chunk_aligned(const Problem& problem) {
  for (const char* which : {"q", "k", "v", "o"}) {
    const TensorView view = problem.expected(which);
    for (std::size_t i = 0; i + 1 < view.strides.size(); ++i) {
      if (view.strides[i] % kChunkElements != 0) return false;
    }
  }
  return true;
}

KernelChoice mma_choice(const Problem& problem) {
  KernelChoice c;
  c.kind = KernelKind::kMma;
  c.dtype = problem.dtype();
  c.head_dim_qk = static_cast<int>(problem.head_dim_qk());
  c.head_dim_v = static_cast<int>(problem.head_dim_v());
  c.padded_qk = round_up(c.head_dim_qk, kMmaRowMultiple);
  c.padded_v = round_up(c.head_dim_v, kMmaRowMultiple);
  const bool large = std::max(c.head_dim_qk, c.head_dim_v) > kLargeHeadDim;
  c.tiles_per_warp = large ? 1 : 2;
  c.warps = kMmaWarps;
  c.block_m = 16 * c.tiles_per_warp * c.warps;
  c.block_n = kBlockN;
  c.stages = kMmaStages;
  c.min_blocks = large ? 1 : 2;
  c.class_block_q = c.block_m;
  constexpr int kBytes = 2;  // bf16 / fp16
  const int staging = std::max(c.padded_qk, c.padded_v);
  c.shared_bytes =
      c.block_m * staging * kBytes + c.stages * c.block_n * (c.padded_qk + c.padded_v) * kBytes;
  return c;
}

// The head dims the wgmma backward holds (kernels/backward_wgmma.cuh).
bool wgmma_head_dim(std::int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// The wgmma forward's (kernels/forward_wgmma.cuh, WgmmaConfig): whole 64-value panels of Q and K,
// and a V width that is one wgmma of P V (N = 64, 128 or 256).
bool wgmma_forward_head_dims(std::int64_t qk, std::int64_t v) {
  return (qk == 64 || qk == 128 || qk == 192 || qk == 256) && (v == 64 || v == 128 || v == 256);
}

// The wgmma forward's shared memory (WgmmaConfig::kSharedBytes): the alignment slack, Q (then
// the O staging), and the stages of K and V.
int wgmma_shared_bytes(const KernelChoice& c) {
  constexpr int kBytes = 2;  // bf16 / fp16
  const int staging = std::max(c.head_dim_qk, c.head_dim_v);
  const int staged = c.stage_tensor ? c.block_m * c.block_n * kBytes : 0;
  const int barriers = c.producer ? kWgmmaBarrierBytes : 0;
  return kWgmmaAlignment + c.block_m * staging * kBytes +
         c.stages * (c.block_n * (c.head_dim_qk + c.head_dim_v) * kBytes + staged) + barriers;
}

// Whether `c`'s blocks fit a multiprocessor's shared memory: 228 KB on sm_90, 1 KB of it reserved
// per block, at most 227 KB for one block.
bool wgmma_shared_fits(const KernelChoice& c) {
  return c.shared_bytes <= kWgmmaMaxSharedBytes &&
         (c.shared_bytes + 1024) * c.min_blocks <= kWgmmaMaxSharedBytes + 1024;
}

KernelChoice wgmma_choice(const Problem& problem) {
  KernelChoice c;
  c.kind = KernelKind::kWgmma;
  c.dtype = problem.dtype();
  c.head_dim_qk = static_cast<int>(problem.head_dim_qk());
  c.head_dim_v = static_cast<int>(problem.head_dim_v());
  c.padded_qk = c.head_dim_qk;
  c.padded_v = c.head_dim_v;
  c.tiles_per_warp = 1;
  c.warps = kWgmmaWarps;
  c.block_m = kWgmmaBlockM;
  const int largest = std::max(c.head_dim_qk, c.head_dim_v);
  const bool wide = largest > kWgmmaPipelinedHeadDim;
  c.pipelined = largest == kWgmmaPipelinedHeadDim;
  c.block_n = wide ? kWgmmaWideBlockN : kWgmmaBlockN;
  c.stages = c.pipelined ? 3 : 2;
  c.min_blocks = c.pipelined || wide ? 1 : kWgmmaSmallMinBlocks;
  c.producer = c.pipelined;
  c.class_block_q = c.block_m;
  c.shared_bytes = wgmma_shared_bytes(c);
  return c;
}

KernelChoice simt_choice(const Problem& problem) {
  KernelChoice c;
  c.kind = KernelKind::kSimt;
  c.dtype = problem.dtype();
  c.head_dim_qk = static_cast<int>(problem.head_dim_qk());
  c.head_dim_v = static_cast<int>(problem.head_dim_v());
  c.padded_qk = c.head_dim_qk;
  c.padded_v = c.head_dim_v;
  c.warps = kSimtWarps;
  c.block_m = kSimtWarps * kSimtRowsPerWarp;
  c.block_n = kBlockN;
  c.class_block_q = kSimtClassBlockQ;
  const int key_stride = c.head_dim_qk + 1;
  c.shared_bytes = static_cast<int>(
      (c.block_m * c.head_dim_qk + c.block_n * key_stride + c.block_n * c.head_dim_v) *
      sizeof(float));
  return c;
}

// The paged-cache kernels (kernels/decode.cuh). On tensor cores (DecodeMmaConfig: bf16/fp16, head
// dims multiples of 8, pool strides whole 16-byte chunks): 16 packed query rows per block (64 for
// chunked prefill, kPrefillRows), tiles of 64 keys in a ring of about kDecodeRingBytes / tile
// bytes stages (2 to 4: at head dim 128, three stages for decoding and two for prefill, two
// blocks per multiprocessor); its shared memory also holds the fp32 kernel that recomputes a
// block with non-finite rows. Else on the fp32 units (DecodeConfig): block_m query
// rows per block (the GQA group times the new tokens, a power of two up to 8), 4 warps over
// chunks of 32 keys.
KernelChoice decode_choice(const Problem& problem) {
  KernelChoice c;
  c.kind = KernelKind::kDecode;
  c.dtype = problem.dtype();
  c.head_dim_qk = static_cast<int>(problem.head_dim_qk());
  c.head_dim_v = static_cast<int>(problem.head_dim_v());
  c.padded_qk = c.head_dim_qk;
  c.padded_v = c.head_dim_v;
  c.warps = kDecodeWarps;
  const std::int64_t rows = problem.heads_q() / problem.heads_kv() * problem.seq_len_q();
  c.block_m = 1;
  while (c.block_m < kDecodeMaxRows && c.block_m < rows) c.block_m *= 2;
  c.block_n = kWarpSize;
  // 16-byte K loads: whole vectors per row, and every pool stride a whole number of them.
  const int width = c.dtype == DType::kF32 ? 4 : 8;
  bool vector = c.head_dim_qk % width == 0;
  for (const char* which : {"k", "v"}) {
    const TensorView view = problem.expected(which);
    for (std::size_t i = 0; i + 1 < view.strides.size(); ++i) {
      vector = vector && view.strides[i] % width == 0;
    }
  }
  c.vector_loads = vector;
  const int key_stride = c.head_dim_qk % 4 == 0 ? c.head_dim_qk + 4 : c.head_dim_qk + 1;
  const int columns = (c.head_dim_v + kWarpSize - 1) / kWarpSize;
  const int key_floats = c.warps * kWarpSize * key_stride;
  // DecodeConfig::kSharedBytes for `block_rows` query rows per block.
  const auto simt_bytes = [&](int block_rows) {
    const int merge_floats = c.warps * block_rows * (columns * kWarpSize + 2);
    return static_cast<int>((block_rows * c.head_dim_qk + std::max(key_floats, merge_floats)) *
                            sizeof(float));
  };
  c.shared_bytes = simt_bytes(c.block_m);
  const bool sixteen_bit = c.dtype == DType::kBF16 || c.dtype == DType::kF16;
  if (sixteen_bit && vector && c.head_dim_qk % kChunkElements == 0 &&
      c.head_dim_v % kChunkElements == 0) {
    c.tensor_cores = true;
    c.block_n = kDecodeMmaBlockN;
    c.padded_qk = (c.head_dim_qk + 63) / 64 * 64;
    c.padded_v = (c.head_dim_v + 63) / 64 * 64;
    const bool prefill =
        rows >= kPrefillRows && std::max(c.padded_qk, c.padded_v) <= kPrefillMaxDim;
    c.block_m = prefill ? kPrefillRows : kDecodeMmaRows;
    const int tile_bytes = kDecodeMmaBlockN * (c.padded_qk + c.padded_v) * 2;
    const int q_bytes = c.block_m * c.padded_qk * 2;
    const int ring_bytes = kDecodeRingBytes + kDecodeMmaRows * c.padded_qk * 2 - q_bytes;
    c.stages = std::clamp(ring_bytes / tile_bytes, 2, 4);
    const int steps_v = (c.head_dim_v + 15) / 16;
    const int merge_warps = prefill ? 1 : c.warps;  // DecodeMmaConfig::kMergeWarps
    const int merge_bytes =
        merge_warps * c.block_m * (2 * steps_v * 8 + 2) * static_cast<int>(sizeof(float));
    c.shared_bytes = std::max(
        {q_bytes + c.stages * tile_bytes, q_bytes + merge_bytes, simt_bytes(kDecodeFallbackRows)});
  }
  return c;
}

// Chunked prefill on sm_90: `decode` (decode_choice's tensor-core kernel) becomes the wgmma
// forward over the paged cache (forward_prefill_wgmma) when every sequence brings at least
// kPrefillWgmmaTokens new tokens (one 128-row block of one query head; a sequence with fewer,
// decoding in a mixed batch above all, is better served by the mma.sync kernel, whose packed GQA
// rows share each key read and whose splits spread a long cache), the head dims are the wgmma
// kernel's, every view's strides are whole 16-byte chunks (Q is copied and O stored 16 bytes at
// a time), and, with a mask, the tiles of the cache's capacity fit the kernel's list
// (kPrefillListCapacity).
void prefill_on_wgmma(const Problem& problem, KernelChoice& decode) {
  std::int64_t fewest_tokens = problem.seq_len_q();
  for (std::int64_t b = 0; b < problem.batch(); ++b) {
    fewest_tokens = std::min(fewest_tokens, problem.seq_len_q_of(b));
  }
  if (!decode.tensor_cores || fewest_tokens < kPrefillWgmmaTokens ||
      !wgmma_forward_head_dims(problem.head_dim_qk(), problem.head_dim_v()) ||
      !strides_chunk_aligned(problem)) {
    return;
  }
  KernelChoice c = wgmma_choice(problem);
  if (!keeps_everything(problem.mask_mod()) &&
      (problem.seq_len_kv() + c.block_n - 1) / c.block_n > flexattn_kernels::kPrefillListCapacity) {
    return;
  }
  c.kind = KernelKind::kDecode;
  c.paged_wgmma = true;
  c.tensor_cores = true;
  c.vector_loads = true;
  c.class_block_q = 0;
  c.take_turns = c.turns_possible();
  decode = c;
}

// What neither the forward nor the backward kernels serve (both hold the same dtypes and head
// dims); empty when the problem is served.
std::string unserved_reason(const Problem& problem) {
  const DType dtype = problem.dtype();
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32) {
    return fmt::format("storage {} is not served (bf16, fp16 and fp32 are)", to_string(dtype));
  }
  const std::int64_t largest = std::max(problem.head_dim_qk(), problem.head_dim_v());
  if (largest > kMaxHeadDim) {
    return fmt::format("head dim {} exceeds the largest the kernels hold ({})", largest,
                       kMaxHeadDim);
  }
  return {};
}

BackwardChoice backward_mma_choice(const Problem& problem) {
  BackwardChoice c;
  c.kind = KernelKind::kMma;
  c.dtype = problem.dtype();
  c.head_dim_qk = static_cast<int>(problem.head_dim_qk());
  c.head_dim_v = static_cast<int>(problem.head_dim_v());
  c.padded_qk = round_up(c.head_dim_qk, kMmaRowMultiple);
  c.padded_v = round_up(c.head_dim_v, kMmaRowMultiple);
  c.block_q = kBackwardMmaBlock;
  c.block_kv = kBackwardMmaBlock;
  c.threads = kBackwardThreads;
  c.min_blocks = kBackwardMmaMinBlocks;
  constexpr int kBytes = 2;  // bf16 / fp16
  // One resident tile (K and V, or Q and dO) and kBackwardMmaStages of the streamed pair.
  const int pair = kBackwardMmaBlock * (c.padded_qk + c.padded_v) * kBytes;
  const int streamed = (1 + kBackwardMmaStages) * pair;
  const int statistics = kBackwardMmaStages * kBackwardRowStatistics * kBackwardMmaBlock *
                         static_cast<int>(sizeof(float));
  c.shared_dkdv = streamed + statistics;
  c.shared_dq = streamed;
  c.dkdv_parts = c.padded_qk + c.padded_v > kBackwardMmaAccumulatorColumns ? 2 : 1;
  c.dkdv_block_kv = c.block_kv;
  c.dq_block_q = c.block_q;
  c.dkdv_threads = c.threads;
  c.dq_threads = c.threads;
  return c;
}

// The wgmma kernels on top of the tensor-core choice `c` (head dims 64/128, sm_90).
void use_wgmma(BackwardChoice& c) {
  c.wgmma = true;
  c.dkdv_parts = 1;
  c.dkdv_block_kv = kBackwardWgmmaBlock;
  c.dq_block_q = kBackwardWgmmaBlock;
  c.dkdv_threads = kBackwardWgmmaThreads;
  c.dq_threads = kBackwardWgmmaThreads;
  constexpr int kBytes = 2;  // bf16 / fp16
  const int dims = c.head_dim_qk + c.head_dim_v;
  const int resident = kWgmmaAlignment + kBackwardWgmmaBlock * dims * kBytes;
  const int streamed = kBackwardWgmmaStages * kBackwardMmaBlock * dims * kBytes;
  c.shared_wgmma_dkdv = resident + streamed +
                        kBackwardWgmmaStages * kBackwardRowStatistics * kBackwardMmaBlock *
                            static_cast<int>(sizeof(float));
  c.shared_wgmma_dq = resident + streamed;
}

// The wide wgmma kernels on top of the mma.sync choice `c` (head dims 256 and 192/128, sm_90).
void use_wgmma_wide(BackwardChoice& c) {
  c.wgmma_wide = true;
  c.dkdv_parts = 1;
  c.dkdv_threads = kBackwardWgmmaThreads;
  c.dq_threads = kBackwardWgmmaThreads;
  constexpr int kBytes = 2;  // bf16 / fp16
  constexpr int kExchange = kBackwardMmaBlock * kBackwardMmaBlock * kBytes;
  constexpr int kRowFloats =
      kBackwardRowStatistics * kBackwardMmaBlock * static_cast<int>(sizeof(float));
  const int pair = kBackwardMmaBlock * (c.head_dim_qk + c.head_dim_v) * kBytes;
  const int resident = kWgmmaAlignment + pair;
  const int streamed = kBackwardWideStages * pair;
  c.shared_wgmma_dkdv = resident + streamed + 2 * kExchange + kBackwardWideStages * kRowFloats;
  c.shared_wgmma_dq = resident + streamed + kExchange + 2 * kRowFloats;  // two warpgroups' sums
}

BackwardChoice backward_simt_choice(const Problem& problem, std::string why) {
  BackwardChoice c;
  c.kind = KernelKind::kSimt;
  c.dtype = problem.dtype();
  c.head_dim_qk = static_cast<int>(problem.head_dim_qk());
  c.head_dim_v = static_cast<int>(problem.head_dim_v());
  c.padded_qk = c.head_dim_qk;
  c.padded_v = c.head_dim_v;
  c.block_q = kBackwardSimtBlock;
  c.block_kv = kBackwardSimtBlock;
  c.threads = kBackwardThreads;
  constexpr int kBlock = kBackwardSimtBlock;
  // Floats: two row tiles of each head dim (Q, K and dO, V), lse and delta, and P and dS.
  const int floats = 2 * kBlock * (c.head_dim_qk + c.head_dim_v) + kBackwardRowStatistics * kBlock +
                     2 * kBlock * (kBlock + 1);
  c.shared_dkdv = floats * static_cast<int>(sizeof(float));
  c.shared_dq = c.shared_dkdv;
  c.dkdv_block_kv = c.block_kv;
  c.dq_block_q = c.block_q;
  c.dkdv_threads = c.threads;
  c.dq_threads = c.threads;
  c.why = std::move(why);
  return c;
}

}  // namespace

const char* element_tag(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "flexattn_kernels::BFloat16Tag";
    case DType::kF16:
      return "flexattn_kernels::HalfTag";
    case DType::kF32:
      return "flexattn_kernels::Float32Tag";
    case DType::kF64:
    case DType::kI32:
    case DType::kI64:
      break;
  }
  throw_internal("cuda engine: no element type for " + std::string(to_string(dtype)));
}

int KernelChoice::threads() const {
  return warps * kWarpSize + (producer ? kWgmmaProducerThreads : 0);
}

bool KernelChoice::turns_possible() const {
  return (kind == KernelKind::kWgmma || paged_wgmma) && pipelined && warps == kWgmmaWarps;
}

std::string KernelChoice::config_type() const {
  if (kind == KernelKind::kWgmma || paged_wgmma) {
    // The trailing arguments only where they differ from their defaults (turns off, two
    // warpgroups, one block per multiprocessor), so the default shapes keep their cache keys.
    std::string tail;
    if (producer) {
      tail = fmt::format(", {}, {}, {}, {}, true", take_turns, warps / 4, min_blocks, stage_tensor);
    } else if (stage_tensor) {
      tail = fmt::format(", {}, {}, {}, true", take_turns, warps / 4, min_blocks);
    } else if (warps != kWgmmaWarps || min_blocks != 1) {
      tail = fmt::format(", {}, {}, {}", take_turns, warps / 4, min_blocks);
    } else if (take_turns) {
      tail = ", true";
    }
    return fmt::format("flexattn_kernels::WgmmaConfig<{}, {}, {}, {}, {}, {}, {}{}>",
                       element_tag(dtype), head_dim_qk, head_dim_v, block_n, stages, pipelined,
                       shared_bytes, tail);
  }
  if (kind == KernelKind::kDecode && tensor_cores) {
    // The row count only where it is not the default 16, so decoding keeps its cache keys.
    return fmt::format("flexattn_kernels::DecodeMmaConfig<{}, {}, {}, {}, {}, {}{}>",
                       element_tag(dtype), head_dim_qk, head_dim_v, padded_qk, padded_v, stages,
                       block_m != kDecodeMmaRows ? fmt::format(", {}", block_m) : "");
  }
  if (kind == KernelKind::kDecode) {
    return fmt::format("flexattn_kernels::DecodeConfig<{}, {}, {}, {}, {}>", element_tag(dtype),
                       head_dim_qk, head_dim_v, block_m, vector_loads);
  }
  if (kind == KernelKind::kMma) {
    return fmt::format("flexattn_kernels::MmaConfig<{}, {}, {}, {}, {}, {}, {}, {}, {}, {}>",
                       element_tag(dtype), head_dim_qk, head_dim_v, padded_qk, padded_v,
                       tiles_per_warp, warps, block_n, stages, min_blocks);
  }
  return fmt::format("flexattn_kernels::SimtConfig<{}, {}, {}>", element_tag(dtype), head_dim_qk,
                     head_dim_v);
}

std::string KernelChoice::kernel_template() const {
  switch (kind) {
    case KernelKind::kMma:
      return "forward_mma";
    case KernelKind::kWgmma:
      return "forward_wgmma";
    case KernelKind::kSimt:
      return "forward_simt";
    case KernelKind::kDecode:
      if (paged_wgmma) return "forward_prefill_wgmma";
      return tensor_cores ? "forward_decode_mma" : "forward_decode";
  }
  throw_internal("cuda: unknown kernel kind");
}

std::string KernelChoice::architecture_suffix() const {
  return kind == KernelKind::kWgmma || paged_wgmma ? "a" : "";
}

std::string KernelChoice::describe() const {
  if (paged_wgmma) {
    KernelChoice forward = *this;
    forward.kind = KernelKind::kWgmma;
    forward.paged_wgmma = false;
    return "paged-cache chunked prefill on the " + forward.describe();
  }
  if (kind == KernelKind::kWgmma) {
    return fmt::format(
        "tensor-core (wgmma, sm_90a) {}, {}x{} tiles, {} warps, {} stages{}{}, head dims {} and "
        "{}, {} KB shared{}{}{}",
        to_string(dtype), block_m, block_n, warps, stages, pipelined ? ", pipelined" : "",
        take_turns ? ", warpgroups take turns" : "", head_dim_qk, head_dim_v, shared_bytes / 1024,
        min_blocks > 1 ? fmt::format(", {} blocks per multiprocessor", min_blocks) : "",
        stage_tensor ? ", modifier tensor staged in shared memory" : "",
        producer ? ", a producer warpgroup loads the stages" : "");
  }
  if (kind == KernelKind::kMma) {
    return fmt::format(
        "tensor-core (mma.sync) {}, {}x{} tiles, {} warps, {} stages, head dims {} (padded {}) "
        "and {} (padded {}), {} KB shared",
        to_string(dtype), block_m, block_n, warps, stages, head_dim_qk, padded_qk, head_dim_v,
        padded_v, shared_bytes / 1024);
  }
  if (kind == KernelKind::kDecode && tensor_cores) {
    return fmt::format(
        "paged-cache {} on tensor cores (mma.sync) {}, {} packed query rows per block, "
        "{}-key tiles, {} stages, {} warps ({}), head dims {} (padded {}) and {} (padded {}), {} "
        "KB shared",
        block_m > kDecodeMmaRows ? "chunked prefill" : "decoding", to_string(dtype), block_m,
        block_n, stages, warps,
        block_m > kDecodeMmaRows ? "16 rows each, whole tiles" : "16 keys of each tile each",
        head_dim_qk, padded_qk, head_dim_v, padded_v, shared_bytes / 1024);
  }
  if (kind == KernelKind::kDecode) {
    return fmt::format(
        "paged-cache decoding on the fp32 units {}, {} query rows per block, {} warps over "
        "chunks of {} keys, head dims {} and {}, {} loads, {} KB shared",
        to_string(dtype), block_m, warps, block_n, head_dim_qk, head_dim_v,
        vector_loads ? "16-byte" : "element", shared_bytes / 1024);
  }
  return fmt::format("fp32 units {}, {}x{} tiles, {} warps, head dims {} and {}, {} KB shared",
                     to_string(dtype), block_m, block_n, warps, head_dim_qk, head_dim_v,
                     shared_bytes / 1024);
}

std::string stage_wgmma_tensor(KernelChoice& choice) {
  if (choice.kind != KernelKind::kWgmma) return {};
  KernelChoice c = choice;
  c.stage_tensor = true;
  c.pipelined = false;
  c.take_turns = false;
  c.producer = false;  // measured slower with the staged tile (359 -> 333 TFLOP/s, bias, D 128)
  c.stages = 2;
  if (std::max(c.head_dim_qk, c.head_dim_v) == 64) {
    // Head dim 64: 64-key tiles (82 KB) at two blocks per multiprocessor, as the staged tile's
    // reads fit 128 registers there: bias 230 -> 278 TFLOP/s against 128-key tiles at one block
    // (the pipelined loop with a producer and three stages: 258; H200, 2026-12-03).
    c.block_n = 64;
    c.min_blocks = 2;
  } else {
    // At head dim 128 the staged tile's reads need registers the two-blocks cap does not leave;
    // wider head dims keep their 64-key tiles (at 256: 225 KB with the staged tiles).
    c.min_blocks = 1;
  }
  c.shared_bytes = wgmma_shared_bytes(c);
  if (!wgmma_shared_fits(c)) {
    return fmt::format("the staged tensor's {} bytes of shared memory do not fit", c.shared_bytes);
  }
  choice = c;
  return {};
}

KernelChoice without_staged_tensor(const KernelChoice& staged) {
  KernelChoice c = staged;
  c.stage_tensor = false;
  if (c.kind == KernelKind::kWgmma) c.shared_bytes = wgmma_shared_bytes(c);
  return c;
}

KernelSelection choose_kernel(const Problem& problem, int capability, bool allow_wgmma) {
  KernelSelection selection;
  selection.reason = unserved_reason(problem);
  if (!selection.reason.empty()) return selection;
  if (problem.kv_cache()) {
    selection.choice = decode_choice(problem);
    if (allow_wgmma && capability == kWgmmaCapability) prefill_on_wgmma(problem, selection.choice);
    return selection;
  }
  const DType dtype = problem.dtype();
  const bool sixteen_bit = dtype == DType::kBF16 || dtype == DType::kF16;
  const bool whole_chunks =
      problem.head_dim_qk() % kChunkElements == 0 && problem.head_dim_v() % kChunkElements == 0;
  const bool tensor_cores = sixteen_bit && whole_chunks && strides_chunk_aligned(problem);
  if (tensor_cores && allow_wgmma && capability == kWgmmaCapability &&
      wgmma_forward_head_dims(problem.head_dim_qk(), problem.head_dim_v())) {
    selection.choice = wgmma_choice(problem);
  } else if (tensor_cores) {
    selection.choice = mma_choice(problem);
  } else {
    selection.choice = simt_choice(problem);
  }
  return selection;
}

std::string BackwardChoice::config_type() const {
  if (kind == KernelKind::kMma) {
    // The mma.sync dK/dV kernel's parts (the wide wgmma kernel, when it replaces it, has one).
    const int mma_parts = padded_qk + padded_v > kBackwardMmaAccumulatorColumns ? 2 : 1;
    return fmt::format("flexattn_kernels::BackwardMmaConfig<{}, {}, {}, {}, {}, {}, {}, {}>",
                       element_tag(dtype), head_dim_qk, head_dim_v, padded_qk, padded_v,
                       shared_dkdv, shared_dq, mma_parts);
  }
  return fmt::format("flexattn_kernels::BackwardSimtConfig<{}, {}, {}, {}, {}>", element_tag(dtype),
                     head_dim_qk, head_dim_v, shared_dkdv, shared_dq);
}

std::string BackwardChoice::wgmma_config_type() const {
  if (wgmma_wide) {
    return fmt::format("flexattn_kernels::BackwardWgmmaWideConfig<{}, {}, {}, {}, {}>",
                       element_tag(dtype), head_dim_qk, head_dim_v, shared_wgmma_dkdv,
                       shared_wgmma_dq);
  }
  return fmt::format("flexattn_kernels::BackwardWgmmaConfig<{}, {}, {}, {}, {}>",
                     element_tag(dtype), head_dim_qk, head_dim_v, shared_wgmma_dkdv,
                     shared_wgmma_dq);
}

std::string BackwardChoice::architecture_suffix() const { return wgmma || wgmma_wide ? "a" : ""; }

std::string BackwardChoice::dkdv_template() const {
  if (wgmma) return "backward_dkdv_wgmma";
  if (wgmma_wide) return "backward_dkdv_wgmma_wide";
  return kind == KernelKind::kMma ? "backward_dkdv_mma" : "backward_dkdv_simt";
}

std::string BackwardChoice::dq_template() const {
  if (wgmma) return "backward_dq_wgmma";
  if (wgmma_wide) return "backward_dq_wgmma_wide";
  return kind == KernelKind::kMma ? "backward_dq_mma" : "backward_dq_simt";
}

std::string BackwardChoice::describe() const {
  if (wgmma) {
    return fmt::format(
        "tensor-core (wgmma, sm_90a) {}, dK/dV {}x{} tiles, dQ {}x{} tiles, {} threads, head dims "
        "{} and {}, {} KB shared (dK/dV) and {} KB (dQ)",
        to_string(dtype), block_q, dkdv_block_kv, dq_block_q, block_kv, dkdv_threads, head_dim_qk,
        head_dim_v, shared_wgmma_dkdv / 1024, shared_wgmma_dq / 1024);
  }
  if (wgmma_wide) {
    return fmt::format(
        "tensor-core (wgmma, sm_90a) {}, dK/dV {}x{} tiles, dQ {}x{} tiles, {} threads, the "
        "warpgroups splitting the columns, head dims {} and {}, {} KB shared (dK/dV) and {} KB "
        "(dQ)",
        to_string(dtype), block_q, dkdv_block_kv, dq_block_q, block_kv, dkdv_threads, head_dim_qk,
        head_dim_v, shared_wgmma_dkdv / 1024, shared_wgmma_dq / 1024);
  }
  if (kind == KernelKind::kMma) {
    return fmt::format(
        "tensor-core (mma.sync) {}, {}x{} tiles, {} threads, head dims {} (padded {}) and {} "
        "(padded {}), {} KB shared (dK/dV) and {} KB (dQ){}",
        to_string(dtype), block_q, block_kv, threads, head_dim_qk, padded_qk, head_dim_v, padded_v,
        shared_dkdv / 1024, shared_dq / 1024,
        dkdv_parts > 1 ? ", dK and dV in separate blocks" : "");
  }
  return fmt::format(
      "fp32 units {} ({}), {}x{} tiles, {} threads, head dims {} and {}, {} KB shared",
      to_string(dtype), why, block_q, block_kv, threads, head_dim_qk, head_dim_v,
      shared_dkdv / 1024);
}

BackwardSelection choose_backward_kernel(const Problem& problem, int capability, bool allow_wgmma) {
  BackwardSelection selection;
  selection.reason = unserved_reason(problem);
  if (!selection.reason.empty()) return selection;
  const DType dtype = problem.dtype();
  if (dtype == DType::kF32) {
    selection.choice = backward_simt_choice(problem, "fp32 storage");
  } else if (problem.head_dim_qk() % kChunkElements != 0 ||
             problem.head_dim_v() % kChunkElements != 0) {
    selection.choice = backward_simt_choice(
        problem, fmt::format("head dims {} and {} are not multiples of {}", problem.head_dim_qk(),
                             problem.head_dim_v(), kChunkElements));
  } else if (!strides_chunk_aligned(problem)) {
    selection.choice = backward_simt_choice(
        problem,
        fmt::format("a stride of q, k, v or o is not a multiple of {} elements", kChunkElements));
  } else {
    selection.choice = backward_mma_choice(problem);
    const bool hopper = allow_wgmma && capability == kWgmmaCapability;
    if (hopper && wgmma_head_dim(problem.head_dim_qk()) && wgmma_head_dim(problem.head_dim_v())) {
      use_wgmma(selection.choice);
    } else if (hopper && wide_backward_head_dims(problem.head_dim_qk(), problem.head_dim_v())) {
      use_wgmma_wide(selection.choice);
    }
  }
  return selection;
}

KvTileList transpose_tiles(const TileList& list) {
  KvTileList transposed;
  const auto kv_tiles = static_cast<std::size_t>(list.kv_tiles);
  // Counting sort by kv tile; walking the query blocks in order keeps each kv tile's ascending.
  transposed.offsets.assign(kv_tiles + 1, 0);
  for (const int entry : list.entries) {
    ++transposed.offsets[static_cast<std::size_t>(entry >> 1) + 1];
  }
  for (std::size_t tile = 0; tile < kv_tiles; ++tile) {
    transposed.offsets[tile + 1] += transposed.offsets[tile];
  }
  std::vector<int> next(transposed.offsets.begin(), transposed.offsets.end() - 1);
  transposed.entries.resize(list.entries.size());
  for (std::size_t block = 0; block + 1 < list.offsets.size(); ++block) {
    for (int i = list.offsets[block]; i < list.offsets[block + 1]; ++i) {
      const int entry = list.entries[static_cast<std::size_t>(i)];
      const auto tile = static_cast<std::size_t>(entry >> 1);
      transposed.entries[static_cast<std::size_t>(next[tile]++)] =
          static_cast<int>(block << 1) | (entry & 1);
    }
  }
  return transposed;
}

TileList classify_tiles(const Problem& problem, int class_block_q, int block_n) {
  TileList list;
  list.class_block_q = class_block_q;
  list.block_n = block_n;
  const std::int64_t seq_q = problem.seq_len_q();
  const std::int64_t seq_kv = problem.seq_len_kv();
  const std::int64_t query_blocks = (seq_q + class_block_q - 1) / class_block_q;
  const std::int64_t kv_tiles = (seq_kv + block_n - 1) / block_n;
  list.query_blocks = query_blocks;
  list.kv_tiles = kv_tiles;
  list.tiles = query_blocks * kv_tiles;
  if (list.tiles > kMaxTileEntries) {
    throw_unsupported(fmt::format("{} x {} tiles exceed the tile list's bound of {} entries",
                                  query_blocks, kv_tiles, kMaxTileEntries));
  }
  const Graph& mask = problem.mask_mod();
  const bool constant = mask.is_literal();
  const bool keep_all = constant && mask.node(mask.root()).literal != 0.0;
  const LeafRanges ranges = problem.leaf_ranges();

  std::vector<TileClass> classes(static_cast<std::size_t>(kv_tiles));
  // Classifies kv tiles [first, last) of one query block: when the analysis decides the whole
  // rectangle, that verdict holds for each of its tiles; otherwise it is halved, down to single
  // tiles (a few calls per query block for causal-like masks instead of one per tile).
  auto classify_range = [&](auto& self, std::int64_t q_begin, std::int64_t q_end,
                            std::int64_t first, std::int64_t last) -> void {
    const TileRect rect{q_begin, q_end, first * block_n, std::min(last * block_n, seq_kv)};
    const TileClass verdict = classify_tile(mask, ranges, rect);
    if (verdict != TileClass::kMixed || last - first == 1) {
      std::fill(classes.begin() + first, classes.begin() + last, verdict);
      return;
    }
    const std::int64_t middle = first + (last - first) / 2;
    self(self, q_begin, q_end, first, middle);
    self(self, q_begin, q_end, middle, last);
  };

  list.offsets.reserve(static_cast<std::size_t>(query_blocks + 1));
  list.offsets.push_back(0);
  for (std::int64_t block = 0; block < query_blocks; ++block) {
    if (constant) {
      std::fill(classes.begin(), classes.end(),
                keep_all ? TileClass::kAllTrue : TileClass::kAllFalse);
    } else {
      const std::int64_t q_begin = block * class_block_q;
      const std::int64_t q_end = std::min(q_begin + class_block_q, seq_q);
      classify_range(classify_range, q_begin, q_end, 0, kv_tiles);
    }
    for (std::int64_t tile = 0; tile < kv_tiles; ++tile) {
      const TileClass verdict = classes[static_cast<std::size_t>(tile)];
      if (verdict == TileClass::kAllFalse) {
        ++list.skipped;
        continue;
      }
      const bool mixed = verdict == TileClass::kMixed;
      list.mixed += mixed ? 1 : 0;
      list.entries.push_back(static_cast<int>(tile << 1) | (mixed ? 1 : 0));
    }
    list.offsets.push_back(static_cast<int>(list.entries.size()));
  }
  return list;
}

}  // namespace flexattn::cuda
