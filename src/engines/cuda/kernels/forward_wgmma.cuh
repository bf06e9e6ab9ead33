// Flash-attention-2 forward on Hopper's warpgroup tensor cores (wgmma, sm_90a; bf16/fp16 storage,
// fp32 accumulation; docs/engines.md, "Forward on sm_90"): the mma.sync kernel's pipeline
// (forward_mma.cuh) with both products on wgmma.
//
// A thread block of kWarpgroups warpgroups computes kBlockM = 64 * kWarpgroups query rows of one
// (batch, head); warpgroup g owns rows 64 g .. 64 g + 63, and warp w (of the block) rows 16 w ..
// 16 w + 15 as in the mma.sync kernel, so the element code, the online softmax and the epilogue
// are that kernel's. Q stays in shared memory; K and V tiles of kBlockN keys stream through
// kStages buffers filled by cp.async. All tiles use the 128-byte-swizzled panel layout
// (SwizzledPanels) that the wgmma descriptors read. Per kv tile j and warpgroup, pipelined
// (kPipelined) so the element work of one tile runs while the tensor cores multiply the previous
// one's P V:
//   issue S_j = Q K_j^T          wgmma m64 n kBlockN k16, Q and K from shared memory (K-major)
//   issue O += P_{j-1} V_{j-1}   wgmma m64 n head_dim_v k16, P from registers, V MN-major
//   wait for S_j; logits and softmax of tile j (probabilities, row max and sums)
//   wait for O; rescale O by the change of the row max; P_j = the probabilities as bf16/fp16
// and after the last tile O += P V of it. Tile j's K, tile j - 1's V and tile j + 1's copy are
// in flight at once: three stages. Without kPipelined each product is waited for before its
// result is read (two stages); only the block's other warpgroup overlaps the element work.
// Head dims: q/k 64, 128, 192 or 256 (one to four panels; S takes 16 values of each per k-step),
// v 64, 128 or 256 (P V is one wgmma of N = head_dim_v per 16 keys; at 256 O is 128 fp32 a
// thread, which is why wide head dims take 64-key tiles: S is then 32).
// Copies: either all threads cp.async the next tile and the block meets at __syncthreads every
// tile, or (kProducer, the head-dim-128 default) a third warpgroup copies and hands each stage
// over through a "full" and an "empty" mbarrier, and the computing warpgroups never meet per tile.
#pragma once

#include "forward_mma.cuh"
#include "wgmma_ops.cuh"

namespace flexattn_kernels {

template <class ElementTag, int kHeadDimQk, int kHeadDimV, int kBlockN_, int kStages_,
          bool kPipelined_, int kSharedBytes_, bool kTakeTurns_ = false, int kWarpgroups_ = 2,
          int kMinBlocks_ = 1, bool kStageTensor_ = false, bool kProducer_ = false>
struct WgmmaConfig {
  using Tag = ElementTag;
  static constexpr int kDimQk = kHeadDimQk;
  static constexpr int kDimV = kHeadDimV;
  // Warpgroups per block (1 or 2; the engine chooses 2), and blocks per multiprocessor the
  // registers must allow (tile_plan.cpp).
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int kWarpgroupRows = 64;  // the M of every wgmma
  static constexpr int kWarps = 4 * kWarpgroups;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kTilesPerWarp = 1;  // 16-row accumulator tiles per warp
  static constexpr int kRowsPerWarp = 16;
  static constexpr int kBlockM = kWarpgroupRows * kWarpgroups;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // Whether tile j's element work overlaps tile j - 1's P V (see above), or each product is
  // waited for right away.
  static constexpr bool kPipelined = kPipelined_;
  // Pipelined only: whether warpgroup 1 issues its products of a tile after warpgroup 0 has
  // issued its own (a named barrier), so the tensor cores finish warpgroup 0's S first and its
  // element work starts while warpgroup 1's products run, instead of both waiting for both.
  static constexpr bool kTakeTurns = kTakeTurns_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kChunksQk = kHeadDimQk / kChunkElements;
  static constexpr int kChunksV = kHeadDimV / kChunkElements;
  static constexpr int kRealChunksV = kChunksV;     // head dims are whole panels: nothing padded
  static constexpr int kStepsQk = kHeadDimQk / 16;  // k-steps of Q K^T
  static constexpr int kStepsKv = kBlockN / 16;     // k-steps of P V
  static constexpr int kScoreTiles = kBlockN / 8;   // 8-column accumulator tiles of S
  static constexpr int kOutputTiles = kHeadDimV / 8;
  using QLayout = SwizzledPanels<kBlockM, kChunksQk>;
  using KLayout = SwizzledPanels<kBlockN, kChunksQk>;
  using VLayout = SwizzledPanels<kBlockN, kChunksV>;
  static constexpr int kStagingChunks = kChunksQk > kChunksV ? kChunksQk : kChunksV;
  static constexpr int kQBytes = kBlockM * kStagingChunks * kChunkBytes;  // Q, then O staging
  static constexpr int kKBytes = kBlockN * kChunksQk * kChunkBytes;
  static constexpr int kVBytes = kBlockN * kChunksV * kChunkBytes;
  // The swizzle is a function of address bits 4-9: tiles start on 1024-byte boundaries, and the
  // dynamic shared memory is rounded up to one inside its first 1024 bytes.
  static constexpr int kAlignment = 1024;
  // With kStageTensor the modifier's staged tensor (Modifier::kStagedTensor, 16-bit, indexed
  // [..., q, kv]) travels beside K and V: a (kBlockM, kBlockN) tile per stage, read by the element
  // code from shared memory instead of one global load per score.
  static constexpr bool kStageTensor = kStageTensor_;
  using StagedLayout = SwizzledPanels<kBlockM, kBlockN / kChunkElements>;
  static constexpr int kStagedBytes = kStageTensor ? kBlockM * kBlockN * 2 : 0;
  // With kProducer a third warpgroup (threads kThreads .. kBlockThreads - 1, after the two that
  // compute) copies K, V and the staged tensor into the stages and hands each stage over through
  // shared-memory barriers: "full" (its copies landed) and "empty" (every computing warp is done
  // with it). The computing warpgroups then never meet at a block barrier per tile, and
  // setmaxnreg moves the producer's registers to them. Without it all threads copy and compute.
  static constexpr bool kProducer = kProducer_;
  static constexpr int kProducerThreads = kProducer ? 128 : 0;
  static constexpr int kBlockThreads = kThreads + kProducerThreads;  // the launch's threads
  static constexpr int kLoaderThreads = kProducer ? kProducerThreads : kThreads;
  // 128 x 40 + 256 x 232 = 384 x 168: the registers the launch gives the block.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static constexpr int kBarrierBytes = kProducer ? 64 : 0;  // full[kStages], empty[kStages]
  static constexpr int kSharedBytes =
      kAlignment + kQBytes + kStages * (kKBytes + kVBytes + kStagedBytes) + kBarrierBytes;

  // Whole 64-value panels; v is P V's N, a width wgmma_from_registers has (64, 128, 256).
  static_assert((kHeadDimQk == 64 || kHeadDimQk == 128 || kHeadDimQk == 192 || kHeadDimQk == 256) &&
                    (kHeadDimV == 64 || kHeadDimV == 128 || kHeadDimV == 256),
                "the wgmma kernel takes head dims q/k 64, 128, 192, 256 and v 64, 128, 256");
  static_assert(kBlockN == 64 || kBlockN == 128, "kv tiles are one wgmma of width 64 or 128");
  static_assert(kQBytes % kAlignment == 0 && kKBytes % kAlignment == 0 && kVBytes % kAlignment == 0,
                "every tile starts on a 1024-byte boundary");
  static_assert(kStages >= (kPipelined ? 3 : 2),
                "double buffering; pipelined: K of tile j, V of tile j - 1 and tile j + 1's copy");
  static_assert(kSharedBytes == kSharedBytes_, "the host's shared-memory size (tile_plan.cpp)");
  static_assert(kPipelined || !kTakeTurns, "turns are taken in the pipelined loop");
  static_assert(kWarpgroups == 1 || kWarpgroups == 2, "one or two warpgroups per block");
  static_assert(kWarpgroups == 2 || !kTakeTurns, "turns are taken between two warpgroups");
  static_assert(kMinBlocks == 1 || kMinBlocks == 2, "one or two blocks per multiprocessor");
  static_assert(!kProducer || (kWarpgroups == 2 && kMinBlocks == 1 && kStages <= 4),
                "a producer serves two computing warpgroups, one block per multiprocessor");
  static_assert(!kProducer ||
                    kProducerThreads * kProducerRegisters + kThreads * kConsumerRegisters <=
                        kBlockThreads * (65536 / kBlockThreads / 8 * 8),
                "the register split fits the launch's registers");
};

// Named barrier 2: the computing warpgroups of a block with a producer (which has left by then).
constexpr int kConsumerBarrier = 2;

// Named barrier 1 (0 is __syncthreads'): warpgroup 0 arrives once it has issued a tile's
// products, warpgroup 1 waits there before issuing its own; one arrival and one wait per tile.
// A hardware barrier completes on its count, whoever arrives: were warpgroup 0 to arrive for
// tile j + 1 before warpgroup 1 waited for tile j, the two arrivals would complete a phase alone
// and warpgroup 1 would wait for one arrival too many at the end. Without a producer the per-tile
// __syncthreads rules that out. With one, barrier 3 does, the other way: warpgroup 1 arrives once
// it has issued tile j, and warpgroup 0 waits there after issuing tile j + 1, before it arrives
// for it (by then warpgroup 1 issued tile j long ago: no stall in the steady state). (Waiting
// there before issuing instead, strict alternation, measured 1 - 3% slower, 2026-12-03.)
constexpr int kTurnBarrier = 1;
constexpr int kTurnBackBarrier = 3;

// kTakeTurns: warpgroup 1 issues a tile's products after warpgroup 0 has issued its own.
template <class Config>
__device__ __forceinline__ void await_turn(int warpgroup) {
  if constexpr (Config::kTakeTurns) {
    if (warpgroup == 1) named_barrier_sync<kTurnBarrier>(Config::kThreads);
  }
}
// After issuing a tile's products. `first`: the block's first tile; `more`: another tile follows
// (with a producer, warpgroup 0 waits for warpgroup 1's arrival on barrier 3 for the previous tile
// before it arrives for this one).
template <class Config>
__device__ __forceinline__ void pass_turn(int warpgroup, bool first, bool more) {
  if constexpr (Config::kTakeTurns) {
    if (warpgroup == 0) {
      if constexpr (Config::kProducer) {
        // Warpgroup 1 issued tile - 1.
        if (!first) named_barrier_sync<kTurnBackBarrier>(Config::kThreads);
      }
      named_barrier_arrive<kTurnBarrier>(Config::kThreads);
    } else if constexpr (Config::kProducer) {
      if (more) named_barrier_arrive<kTurnBackBarrier>(Config::kThreads);
    }
  }
}

// Issues (and commits) O += P V for one kv tile: P as register A fragments (one per 16 keys),
// V (kBlockN keys x head_dim_v, panels) as the MN-major B operand. The caller has run
// fence_operands on P and O and wgmma_fence before the first wgmma of the group: an ordinary
// instruction defining a wgmma's registers while an earlier wgmma is in flight makes ptxas
// serialize every wgmma of the kernel (its warning C7515).
template <class Config, int kOutputCount>
__device__ __forceinline__ void issue_probability_value(float (&output_flat)[kOutputCount],
                                                        unsigned (&p_fragment)[Config::kStepsKv][4],
                                                        unsigned v_tile) {
  constexpr int kPanelRowBytes = kSwizzleRows * kChunkBytes;
  const unsigned long long v_descriptor =
      matrix_descriptor(v_tile, Config::VLayout::kPanelBytes, kSwizzleRows * kPanelRowBytes);
#pragma unroll
  for (int step = 0; step < Config::kStepsKv; ++step) {
    wgmma_from_registers(typename Config::Tag{}, output_flat, p_fragment[step],
                         advance_descriptor(v_descriptor, step * 16 * kPanelRowBytes), 1);
  }
  wgmma_commit();
}

// The (q block, head, batch) a forward block computes. Blocks with the most kv tiles (the last
// rows under causal masks) start first. With p.batch_fastest they are numbered in launch order
// with the batch fastest: the blocks of one (q block, head) in every batch run together, so a
// tensor without a batch index is read from L2 by all but the first. (Numbering the
// staged-tensor kernel's blocks batch-fastest, so an [h, q, kv] bias is read once per head and
// from L2 for the other batches, measured no change: bias 361.0 -> 360.2 TFLOP/s at D 128,
// 206.0 -> 206.1 at D 64, H200 2026-12-03.)
struct ForwardBlock {
  int q_block;
  int head;
  int batch;
};
__device__ __forceinline__ ForwardBlock forward_block(const ForwardParams& p) {
  ForwardBlock place{static_cast<int>(gridDim.x - 1 - blockIdx.x), static_cast<int>(blockIdx.y),
                     static_cast<int>(blockIdx.z)};
  if (p.batch_fastest != 0) {
    const unsigned launched = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    place.batch = static_cast<int>(launched % gridDim.z);
    const unsigned rest = launched / gridDim.z;
    place.q_block = static_cast<int>(gridDim.x - 1 - rest % gridDim.x);
    place.head = static_cast<int>(rest / gridDim.x);
  }
  return place;
}

// A kProducer block's stage barriers, from `barriers`: the kStages full barriers, then the kStages
// empty ones (8 bytes each).
template <int kStages>
__device__ __forceinline__ unsigned full_barrier(unsigned barriers, int stage) {
  return barriers + 8 * stage;
}
template <int kStages>
__device__ __forceinline__ unsigned empty_barrier(unsigned barriers, int stage) {
  return barriers + 8 * (kStages + stage);
}

// Each stage's full barrier counts the producer's threads, its empty barrier lane 0 of each
// computing warp.
template <class Config>
__device__ __forceinline__ void init_stage_barriers(unsigned barriers) {
  for (int stage = 0; stage < Config::kStages; ++stage) {
    barrier_init(full_barrier<Config::kStages>(barriers, stage), Config::kProducerThreads);
    barrier_init(empty_barrier<Config::kStages>(barriers, stage), Config::kWarps);
  }
}

// The producer warpgroup of a kProducer block (`loader`: its thread 0 .. 127): tile i of the
// block's list into stage i % kStages once the computing warps released the tile kStages before
// it (phase i / kStages - 1 of the stage's empty barrier); a tile is announced (its full barrier)
// once its copies landed, one tile later, so two tiles' copies are in flight.
// `load_tile(entry_index, stage, loader)` issues one tile's copies.
template <class Config, class LoadTile>
__device__ __forceinline__ void produce_tiles(const EntryRange& entries, unsigned barriers,
                                              int loader, const LoadTile& load_tile) {
  constexpr int kStages = Config::kStages;
  const int count = entries.end - entries.begin;
  for (int iteration = 0; iteration < count; ++iteration) {
    const int stage = iteration % kStages;
    if (iteration >= kStages) {
      barrier_wait(empty_barrier<kStages>(barriers, stage), (iteration / kStages - 1) & 1);
    }
    load_tile(entries.begin + iteration, stage, loader);
    commit_copies();
    if (iteration > 0) {
      wait_copies<1>();      // tile iteration - 1 landed
      fence_async_shared();  // and is visible to the wgmma reads
      barrier_arrive(full_barrier<kStages>(barriers, (iteration - 1) % kStages));
    }
  }
  if (count > 0) {
    wait_copies<0>();
    fence_async_shared();
    barrier_arrive(full_barrier<kStages>(barriers, (count - 1) % kStages));
  }
}

// After the last tile: O and LSE stored through the Q tile's shared memory once every computing
// warp is done with Q (and, without a producer, with K and V), and rows that came out non-finite
// recomputed (repair_forward_rows).
template <class Config, class Modifier, class KeyRows>
__device__ __forceinline__ void finish_forward_rows(const ForwardParams& p, unsigned char* shared,
                                                    float (&output)[1][Config::kOutputTiles][4],
                                                    float (&row_max)[1][2], float (&row_sum)[1][2],
                                                    const SequenceSpan& span, int batch, int head,
                                                    int q_start, int thread, int warp,
                                                    const KeyRows& keys) {
  using Tag = typename Config::Tag;
  to_log2_units(row_max, Modifier::kForwardToLog2);
  if constexpr (Config::kProducer) {
    // Every computing warp is done with Q: its buffer now stages O.
    named_barrier_sync<kConsumerBarrier>(Config::kThreads);
    if (store_output<Config, kConsumerBarrier>(p, shared, output, row_max, row_sum, span, batch,
                                               head, q_start, thread)) {
      repair_forward_rows<Tag, Modifier, Config::kDimQk, Config::kDimV>(
          p, span, batch, head, q_start, Config::kBlockM, warp, Config::kWarps, keys);
    }
  } else {
    wait_copies<0>();
    __syncthreads();  // every warp is done with Q, K and V: the Q buffer now stages O
    if (store_output<Config>(p, shared, output, row_max, row_sum, span, batch, head, q_start,
                             thread)) {
      repair_forward_rows<Tag, Modifier, Config::kDimQk, Config::kDimV>(
          p, span, batch, head, q_start, Config::kBlockM, warp, Config::kWarps, keys);
    }
  }
}

// ---- chunked prefill against a paged KV cache (forward_prefill_wgmma) --------------------------
//
// The same kernel over a paged cache (DecodeParams; the pools' views in d.fwd.k and d.fwd.v): a
// block takes 128 queries of one head of one sequence, as on a dense problem, and its keys are
// the sequence's cache_lens[b] cached ones, read through the page table. The queries sit at the
// end of the cache (positions cache_len - q_len + i, the modifiers' `q`); `KV_LEN` is the cache
// length. The kv tiles come from no host list (the lengths stay on the device): without a mask
// every tile of the cache; with one, the tiles where it keeps some element of the block's rows,
// found by evaluating it (prefill_tile_list), each visited with the mask evaluated per element.
// A length outside {0} U [q_len, capacity] or a used page id outside [0, pages) is never
// dereferenced: the sequence's rows come out NaN, with LSE NaN (as the decode kernels').

// Where key `key` of a sequence lies in the pools: its page (from the sequence's page-table row)
// and slot (page_shift: a power-of-two page size takes no division).
struct PagedSlot {
  int page;
  int slot;
  __device__ __forceinline__ long long row(const SequenceView& pool, int head_kv) const {
    return page * pool.batch_stride + slot * pool.token_stride + head_kv * pool.head_stride;
  }
};
__device__ __forceinline__ PagedSlot paged_slot(const DecodeParams& d, const int* table, int key) {
  if (d.page_shift >= 0) {
    return PagedSlot{__ldg(table + (key >> d.page_shift)), key & (d.page_size - 1)};
  }
  return PagedSlot{__ldg(table + key / d.page_size), key % d.page_size};
}

// A paged sequence's keys for exact_forward_row (repairing non-finite rows), and its queries'
// positions.
struct PagedKeyRows {
  const DecodeParams& d;
  const int* table;  // the sequence's page-table row
  int shift;         // cache_len - q_len
  __device__ __forceinline__ long long key(const ForwardParams& p, int kv, int head_kv) const {
    return paged_slot(d, table, kv).row(p.k, head_kv);
  }
  __device__ __forceinline__ long long value(const ForwardParams& p, int kv, int head_kv) const {
    return paged_slot(d, table, kv).row(p.v, head_kv);
  }
  __device__ __forceinline__ int position(int row) const { return shift + row; }
};

// Keys [first, first + kRows) of the sequence into a K and a V tile (the swizzled panel layouts)
// through its page-table row; keys at or past `end` are zero-filled (their scores are removed),
// never read. Warp w of the kThreads loaders copies rows w * kWarpRows ..: lane l reads the page
// of row l once, before any copy, and each copy takes its row's place in the pools from that lane
// (a shuffle), so a tile's page-table reads are all in flight at once instead of each copy
// waiting for its own. With pages of one token that took the prefill from 168 to 239 TFLOP/s on
// an H100; with pages of 16 it stayed at 244 (docs/performance.md).
//
// Where a warp's 32 lanes copy whole rows (K's and V's chunks of a row number 16 or 32), each
// lane copies the same chunk of every row it visits (paged_row_copies): its tile, pool and
// swizzle are set once, and a copy costs a shuffle, a few adds and the cp.async. The general
// order (below) computes every copy's row, chunk and swizzle.
template <class Config, int kRows, int kThreads, bool kSameLayout>
__device__ __forceinline__ void paged_row_copies(const DecodeParams& d, int first, int end,
                                                 unsigned k_tile, unsigned v_tile, int warp_first,
                                                 int lane, long long k_row, long long v_row) {
  using Layout = typename Config::KLayout;
  static_assert(Layout::kRowBytes == Config::VLayout::kRowBytes &&
                    Layout::kPanelBytes == Config::VLayout::kPanelBytes,
                "K's and V's panels hold the same rows alike");
  constexpr int kChunksK = Config::kChunksQk;
  constexpr int kRowCopies = kChunksK + Config::kChunksV;
  constexpr int kWarpRows = kRows / (kThreads / kWarpSize);
  constexpr int kRowsPerStep = kWarpSize / kRowCopies;  // 1 or 2, a power of two
  static_assert(kWarpSize % kRowCopies == 0 && kSwizzleRows % kRowsPerStep == 0 &&
                    kWarpRows % kSwizzleRows == 0,
                "whole rows a step, a warp's rows in whole swizzle periods");
  constexpr long long kValueBytes = 2;  // bf16 / fp16
  const int sub_row = lane / kRowCopies;  // the lane's row within a step
  const int copy = lane % kRowCopies;
  const bool key = copy < kChunksK;
  const int chunk = key ? copy : copy - kChunksK;
  // Row first_row + r of the tile: Layout::offset(first_row + r, chunk) is row_base + r * 128 +
  // ((chunk % 8) ^ ((first_row + r) % 8)) * 16, where first_row % 8 is sub_row (warp_first is a
  // multiple of 8) and r a multiple of kRowsPerStep > sub_row, so (first_row + r) % 8 is
  // sub_row ^ (r % 8).
  const int first_row = warp_first + sub_row;
  const unsigned row_base = (key ? k_tile : v_tile) +
                            static_cast<unsigned>(chunk / kSwizzleRows) * Layout::kPanelBytes +
                            static_cast<unsigned>(first_row) * Layout::kRowBytes;
  const int swizzle = (chunk % kSwizzleRows) ^ sub_row;
  // The lane's chunk in its pool, and the rows' places in bytes.
  const char* pool = static_cast<const char*>(key ? d.fwd.k.data : d.fwd.v.data) +
                     chunk * kChunkBytes;
  const long long k_place = k_row * kValueBytes;
  const long long v_place = v_row * kValueBytes;
  const int rows_inside = end - first - first_row;  // step rows r < rows_inside are keys
#pragma unroll 4
  for (int r = 0; r < kWarpRows; r += kRowsPerStep) {
    const int holder = r + sub_row;  // the lane that read this row's place
    long long place = __shfl_sync(0xffffffffu, k_place, holder);
    if constexpr (!kSameLayout) {
      const long long v_at = __shfl_sync(0xffffffffu, v_place, holder);
      if (!key) place = v_at;
    }
    const unsigned destination = row_base + static_cast<unsigned>(r) * Layout::kRowBytes +
                                 (static_cast<unsigned>(swizzle ^ r) % kSwizzleRows) * kChunkBytes;
    // Rows past `end` have place 0 (never read: their copies zero-fill).
    copy_chunk_async(destination, pool + place, r < rows_inside);
  }
}

template <class Config, int kRows, int kThreads>
__device__ __forceinline__ void load_paged_rows_async(const DecodeParams& d, const int* table,
                                                      int head_kv, int first, int end,
                                                      unsigned k_tile, unsigned v_tile,
                                                      int thread) {
  constexpr int kChunksK = Config::kChunksQk;
  constexpr int kChunksV = Config::kChunksV;
  constexpr int kRowCopies = kChunksK + kChunksV;
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kWarpRows = kRows / kWarps;
  static_assert(kRows % kWarps == 0 && kWarpRows <= kWarpSize, "a lane holds each row's place");
  static_assert(kWarpRows * kRowCopies % kWarpSize == 0, "every lane copies as often");
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int warp_first = warp * kWarpRows;
  const SequenceView& k_pool = d.fwd.k;
  const SequenceView& v_pool = d.fwd.v;
  // The pools share their layout (the usual case): one row offset serves both.
  const bool same_layout = k_pool.batch_stride == v_pool.batch_stride &&
                           k_pool.token_stride == v_pool.token_stride &&
                           k_pool.head_stride == v_pool.head_stride;
  long long k_row = 0;
  long long v_row = 0;
  if (lane < kWarpRows && first + warp_first + lane < end) {
    const PagedSlot at = paged_slot(d, table, first + warp_first + lane);
    k_row = at.row(k_pool, head_kv);
    v_row = at.row(v_pool, head_kv);
  }
  if constexpr (kWarpSize % kRowCopies == 0 && kWarpRows % kSwizzleRows == 0) {
    if (same_layout) {
      paged_row_copies<Config, kRows, kThreads, true>(d, first, end, k_tile, v_tile, warp_first,
                                                      lane, k_row, v_row);
    } else {
      paged_row_copies<Config, kRows, kThreads, false>(d, first, end, k_tile, v_tile, warp_first,
                                                       lane, k_row, v_row);
    }
    return;
  }
  const auto* k_base = static_cast<const unsigned short*>(k_pool.data);
  const auto* v_base = static_cast<const unsigned short*>(v_pool.data);
#pragma unroll 1
  for (int step = 0; step < kWarpRows * kRowCopies / kWarpSize; ++step) {
    const int index = step * kWarpSize + lane;
    const int r = index / kRowCopies;
    const int copy = index % kRowCopies;
    const long long k_at = __shfl_sync(0xffffffffu, k_row, r);
    const long long v_at = same_layout ? k_at : __shfl_sync(0xffffffffu, v_row, r);
    const int row = warp_first + r;
    const bool inside = first + row < end;
    const bool key = copy < kChunksK;
    const int chunk = key ? copy : copy - kChunksK;
    const unsigned destination = key ? k_tile + Config::KLayout::offset(row, chunk)
                                     : v_tile + Config::VLayout::offset(row, chunk);
    const unsigned short* source = key ? k_base + k_at : v_base + v_at;
    copy_chunk_async(destination, inside ? source + chunk * kChunkElements : source, inside);
  }
}

// Whether the sequence's length or a page id it uses is out of range (the same in every thread;
// a block barrier).
template <int kThreads>
__device__ __forceinline__ bool paged_sequence_poisoned(const DecodeParams& d, const int* table,
                                                        int q_len, int cache_len, int thread) {
  const int capacity = d.max_pages * d.page_size;
  bool poisoned = !(cache_len == 0 || (cache_len >= q_len && cache_len <= capacity));
  if (!poisoned && cache_len > 0) {
    const int used = (cache_len - 1) / d.page_size + 1;
    for (int entry = thread; entry < used; entry += kThreads) {
      const int page = table[entry];
      poisoned |= page < 0 || page >= d.pages;
    }
  }
  return barrier_any<-1>(poisoned, kThreads);
}

// A poisoned sequence's rows [q_start, q_start + kRows): O and LSE NaN.
template <class Tag, int kRows, int kDimV, int kThreads>
__device__ __forceinline__ void store_nan_rows(const ForwardParams& p, const SequenceSpan& span,
                                               int batch, int head, int q_start, int thread) {
  const float nan = __int_as_float(0x7fc00000);
  for (int index = thread; index < kRows * kDimV; index += kThreads) {
    const int row = q_start + index / kDimV;
    if (row < span.q_len) {
      store_from_float(Tag{}, p.o.data,
                       row_index(p.o, batch, span.q_offset + row, head) + index % kDimV, nan);
    }
  }
  if (p.lse != nullptr) {
    for (int r = thread; r < kRows && q_start + r < span.q_len; r += kThreads) {
      *lse_address(p, batch, head, span.q_offset + q_start + r) = nan;
    }
  }
}

// With a mask: the kv tiles (of kBlockN keys, before kv_len) where it keeps some element of the
// block's rows (queries q_start .. of one head, at positions shift + q_start ..), in key order,
// into `list` (shared memory); returns how many. All kThreads threads take part: warp w
// evaluates tiles w, w + warps, ..., lane l rows l % 16 (+ 16, ...) over half the tile's keys,
// stopping at the first kept element; the flags are compacted in order by warp 0. Ends with a
// block barrier.
template <class Config, class Modifier, int kThreads>
__device__ __forceinline__ int prefill_tile_list(const ForwardParams& p, const Coordinates& at,
                                                 int q_start, int shift, int tiles,
                                                 unsigned short* list, int thread) {
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kHalf = kBlockN / 2;
  constexpr int kRowGroups = Config::kBlockM / 16;
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kFlagWords = kPrefillListCapacity / kWarpSize;
  static_assert(kFlagWords <= kWarpSize, "warp 0 compacts the flags one word a lane");
  __shared__ unsigned flags[kFlagWords];
  __shared__ int listed;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  for (int word = thread; word < kFlagWords; word += kThreads) flags[word] = 0u;
  __syncthreads();
  const typename Modifier::Invariants invariants = Modifier::prepare(p, at);
  for (int t = warp; t < tiles; t += kWarps) {
    const int key0 = t * kBlockN + (lane / 16) * kHalf;
    const int key_end = ir_min(key0 + kHalf, at.kv_len);
    bool keep = false;
#pragma unroll 1
    for (int i = 0; i < kRowGroups && !keep; ++i) {
      const int row = q_start + lane % 16 + 16 * i;
      if (row < at.q_len) {
        for (int kv = key0; kv < key_end && !keep; ++kv) {
          keep = Modifier::mask_mod(invariants, p, at, shift + row, kv);
        }
      }
    }
    if (__any_sync(0xffffffffu, keep) != 0 && lane == 0)
      atomicOr(&flags[t / kWarpSize], 1u << (t % kWarpSize));
  }
  __syncthreads();
  if (warp == 0) {
    const unsigned bits = lane < kFlagWords ? flags[lane] : 0u;
    const int count = __popc(bits);
    int before = count;  // inclusive prefix sum over the lanes
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, before, offset);
      if (lane >= offset) before += other;
    }
    int slot = before - count;
    for (unsigned rest = bits; rest != 0u; rest &= rest - 1u) {
      list[slot++] = static_cast<unsigned short>(lane * kWarpSize + __ffs(rest) - 1);
    }
    if (lane == kWarpSize - 1) listed = before;
  }
  __syncthreads();
  return listed;
}

// Chunked prefill: the block's sequence as the cache holds it (`span`'s keys become the
// cache_len cached ones from position 0, and `shift` = cache_len - q_len places its queries), with
// `page_table` its row of the table; or false once the block has stored NaN rows for a sequence
// whose length or page ids are out of range (paged_sequence_poisoned).
template <class Config>
__device__ __forceinline__ bool start_paged_block(const ForwardParams& p, const DecodeParams& paged,
                                                  int batch, int head, int q_start, int thread,
                                                  SequenceSpan& span, int& shift,
                                                  const int*& page_table) {
  page_table = paged.page_table + static_cast<long long>(batch) * paged.max_pages;
  const int cache_len = paged.cache_lens[batch];
  if (paged_sequence_poisoned<Config::kBlockThreads>(paged, page_table, span.q_len, cache_len,
                                                     thread)) {
    store_nan_rows<typename Config::Tag, Config::kBlockM, Config::kDimV, Config::kBlockThreads>(
        p, span, batch, head, q_start, thread);
    return false;
  }
  span.kv_offset = 0;
  span.kv_len = cache_len;
  shift = cache_len - span.q_len;
  return true;
}

// Where a block's K and V rows (and its staged tensor's) come from: the dense views from the
// sequence's first key, or (kPaged) the pools through the sequence's page-table row.
struct KvTileSources {
  const unsigned short* k;  // dense: the sequence's key 0 in its kv head
  const unsigned short* v;
  const unsigned short* staged;  // kStageTensor: the block's first row of the staged tensor
  const DecodeParams* paged;     // kPaged: the pools and the page table
  const int* page_table;         // kPaged: the sequence's row of it
  int head_kv;
  int kv_len;
  int q_rows;  // the block's query rows (for the staged tensor's tile)
};

// Copies the kv tile starting at key kv_start into one stage's K and V tiles (and staged tile):
// `loader` of the Config::kLoaderThreads threads that copy.
template <class Config, class Modifier, bool kPaged>
__device__ __forceinline__ void copy_kv_tile(const ForwardParams& p, const KvTileSources& from,
                                             int kv_start, unsigned k_tile, unsigned v_tile,
                                             unsigned staged_tile, int loader) {
  constexpr int kLoaders = Config::kLoaderThreads;
  constexpr int kBlockN = Config::kBlockN;
  if constexpr (kPaged) {
    load_paged_rows_async<Config, kBlockN, kLoaders>(*from.paged, from.page_table, from.head_kv,
                                                     kv_start, from.kv_len, k_tile, v_tile, loader);
  } else {
    const int rows_valid = from.kv_len - kv_start;
    load_rows_async<kBlockN, typename Config::KLayout, Config::kChunksQk, kLoaders>(
        k_tile, from.k + kv_start * p.k.token_stride, p.k.token_stride, rows_valid,
        Config::kChunksQk, loader);
    load_rows_async<kBlockN, typename Config::VLayout, Config::kChunksV, kLoaders>(
        v_tile, from.v + kv_start * p.v.token_stride, p.v.token_stride, rows_valid,
        Config::kChunksV, loader);
    if constexpr (Config::kStageTensor) {
      // Rows past the queries and columns past the keys are zero-filled (their scores are
      // masked); the row length is a multiple of 8, so chunks are whole.
      constexpr int kStagedChunks = kBlockN / kChunkElements;
      load_rows_async<Config::kBlockM, typename Config::StagedLayout, kStagedChunks, kLoaders>(
          staged_tile, from.staged + kv_start, Modifier::kStagedRowStride, from.q_rows,
          ir_min(kStagedChunks, (from.kv_len - kv_start) / kChunkElements), loader);
    }
  }
}

// With Config::kStageTensor, the block's first row (query q_start) of the tensor the modifier
// stages, in global memory; else null.
template <class Config, class Modifier>
__device__ __forceinline__ const unsigned short* staged_rows(const ForwardParams& p,
                                                             const Coordinates& at, int q_start) {
  if constexpr (Config::kStageTensor) {
    static_assert(Modifier::kStagedTensor >= 0, "the modifier reads a stageable tensor");
    return static_cast<const unsigned short*>(p.tensors[Modifier::kStagedTensor].data) +
           Modifier::staged_origin(Modifier::prepare(p, at), p, at) +
           static_cast<long long>(q_start) * Modifier::kStagedRowStride;
  } else {
    return nullptr;
  }
}

// The computing threads' first copies: the block's `q_rows` rows of Q into `q_tile` (visible to
// both warpgroups on return when a producer copies K and V), and without a producer the first kv
// tiles (`load_tile(entry_index, stage, thread)`): tile 0 when pipelined (each iteration copies
// the next one), else the first kStages - 1.
template <class Config, class LoadTile>
__device__ __forceinline__ void load_query_and_first_tiles(const ForwardParams& p, unsigned q_tile,
                                                           const unsigned short* q_source,
                                                           int q_rows, const EntryRange& entries,
                                                           int thread, const LoadTile& load_tile) {
  load_rows_async<Config::kBlockM, typename Config::QLayout, Config::kChunksQk, Config::kThreads>(
      q_tile, q_source, p.q.token_stride, q_rows, Config::kChunksQk, thread);
  commit_copies();
  if constexpr (Config::kProducer) {
    wait_copies<0>();
    fence_async_shared();
    named_barrier_sync<kConsumerBarrier>(Config::kThreads);  // Q visible to both warpgroups
  } else if constexpr (Config::kPipelined) {
    if (entries.begin < entries.end) load_tile(entries.begin, 0, thread);
    commit_copies();
  } else {
#pragma unroll
    for (int stage = 0; stage < Config::kStages - 1; ++stage) {
      if (entries.begin + stage < entries.end) load_tile(entries.begin + stage, stage, thread);
      commit_copies();
    }
  }
}

// The wgmma forward of a dense problem (kPaged false: `paged` unused), or of chunked prefill
// against a paged cache (kPaged, forward_prefill_wgmma).
template <class Config, class Modifier, bool kPaged = false>
__device__ __forceinline__ void forward_wgmma(const ForwardParams& p,
                                              const DecodeParams* paged = nullptr) {
  using Tag = typename Config::Tag;
  using KLayout = typename Config::KLayout;
  constexpr int kBlockM = Config::kBlockM;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kStages = Config::kStages;
  constexpr int kThreads = Config::kThreads;
  constexpr int kScoreTiles = Config::kScoreTiles;
  constexpr int kOutputTiles = Config::kOutputTiles;
  constexpr int kPanelRowBytes = kSwizzleRows * kChunkBytes;      // 128
  constexpr int kCoreGroupBytes = kSwizzleRows * kPanelRowBytes;  // 8 rows: a descriptor stride
  constexpr int kStepBytes = 16 * 2;  // one k-step of 16 values along a K-major row
  const AlignedShared aligned = aligned_shared_memory<Config::kAlignment>();
  const unsigned aligned_start = aligned.address;
  unsigned char* shared = aligned.pointer;

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group = lane / 4;      // accumulator row within an 8-row half
  const int quad_lane = lane % 4;  // accumulator column pair
  const int warpgroup = warp / 4;
  const ForwardBlock place = forward_block(p);
  const int q_block = place.q_block;
  const int head = place.head;
  const int batch = place.batch;
  SequenceSpan span = sequence_span(p, batch);
  const int q_start = q_block * kBlockM;
  if (q_start >= span.q_len) return;
  const int head_kv = head / p.heads_per_kv;
  // Paged: the sequence's page-table row, and its queries' offset from position 0.
  const int* page_table = nullptr;
  int shift = 0;
  if constexpr (kPaged) {
    static_assert(!Config::kStageTensor, "a paged cache stages no modifier tensor");
    if (!start_paged_block<Config>(p, *paged, batch, head, q_start, thread, span, shift,
                                   page_table)) {
      return;
    }
  }
  const Coordinates at{batch, head, span.q_len, span.kv_len};

  const unsigned short* q_source =
      view_row<const unsigned short>(p.q, batch, span.q_offset + q_start, head);
  const unsigned short* k_source =
      view_row<const unsigned short>(p.k, batch, span.kv_offset, head_kv);
  const unsigned short* v_source =
      view_row<const unsigned short>(p.v, batch, span.kv_offset, head_kv);
  const unsigned q_tile = aligned_start;                         // (kBlockM, qk) panels
  const unsigned k_tiles = q_tile + Config::kQBytes;             // kStages x (kBlockN, qk)
  const unsigned v_tiles = k_tiles + kStages * Config::kKBytes;  // kStages x (kBlockN, v)
  // kStages x (kBlockM, kBlockN) of the staged tensor (kStageTensor), and its rows in global
  // memory.
  const unsigned staged_tiles = v_tiles + kStages * Config::kVBytes;
  // With kProducer: the stages' full and empty barriers.
  const unsigned barriers = staged_tiles + kStages * Config::kStagedBytes;
  const unsigned short* staged_source = staged_rows<Config, Modifier>(p, at, q_start);

  // The kv tiles to visit, each kv_tile << 1 | mixed: the host's list (tile_entries), or paged,
  // every tile of the cache or (with a mask) those listed in `paged_list`, all mixed.
  EntryRange entries{0, 0};
  const unsigned short* paged_list = nullptr;
  if constexpr (kPaged) {
    entries.end = (span.kv_len + kBlockN - 1) / kBlockN;
    if constexpr (Modifier::kHasMask) {
      __shared__ unsigned short list[kPrefillListCapacity];
      entries.end = prefill_tile_list<Config, Modifier, Config::kBlockThreads>(
          p, at, q_start, shift, entries.end, list, thread);
      paged_list = list;
    }
  } else {
    entries = visited_tiles(p, q_start, kBlockN, span.kv_len);
  }
  const auto tile_entry = [&](int entry_index) {
    if constexpr (kPaged) {
      return Modifier::kHasMask ? static_cast<int>(paged_list[entry_index]) << 1 | 1
                                : entry_index << 1;
    } else {
      return p.tile_entries[entry_index];
    }
  };

  // Copies kv tile `entry_index` into `stage`: `loader` of the kLoaderThreads threads that copy.
  const KvTileSources sources{k_source,   v_source, staged_source, paged,
                              page_table, head_kv,  span.kv_len,   span.q_len - q_start};
  auto load_keys_and_values = [&](int entry_index, int stage, int loader) {
    copy_kv_tile<Config, Modifier, kPaged>(
        p, sources, entry_kv_tile(tile_entry(entry_index)) * kBlockN,
        k_tiles + stage * Config::kKBytes, v_tiles + stage * Config::kVBytes,
        staged_tiles + stage * Config::kStagedBytes, loader);
  };

  if constexpr (Config::kProducer) {
    if (thread == 0) init_stage_barriers<Config>(barriers);
    __syncthreads();  // the barriers initialised; the last block-wide barrier
    if (warpgroup == Config::kWarpgroups) {
      release_registers<Config::kProducerRegisters>();
      produce_tiles<Config>(entries, barriers, thread - kThreads, load_keys_and_values);
      return;
    }
    claim_registers<Config::kConsumerRegisters>();
  }

  load_query_and_first_tiles<Config>(p, q_tile, q_source, span.q_len - q_start, entries, thread,
                                     load_keys_and_values);
  // With kProducer: waits until tile `iteration` (of this block's list) is in its stage.
  auto await_stage = [&](int iteration) {
    barrier_wait(full_barrier<kStages>(barriers, iteration % kStages), (iteration / kStages) & 1);
  };
  // With kProducer: this warp is done with the stage of tile `iteration` (its products waited for).
  auto release_stage = [&](int iteration) {
    if constexpr (Config::kProducer) {
      if (lane == 0) barrier_arrive(empty_barrier<kStages>(barriers, iteration % kStages));
    }
  };

  float output[1][kOutputTiles][4];  // (rows, head_dim_v) accumulators
  float row_max[1][2];               // log2 domain
  float row_sum[1][2];               // this thread's share of the row sum
  int query[1][2];                   // the rows' positions, clamped into the sequence
  start_rows(output, row_max, row_sum, query, q_start + warp * Config::kRowsPerWarp + group,
             span.q_len);
  if constexpr (kPaged) {
    query[0][0] += shift;
    query[0][1] += shift;
  }
  const typename Modifier::Invariants invariants = Modifier::prepare(p, at);
  // The accumulators as the flat lists wgmma takes.
  float(&output_flat)[kOutputTiles * 4] = reinterpret_cast<float(&)[kOutputTiles * 4]>(output);
  // This warpgroup's 64 rows of Q.
  const unsigned long long q_descriptor = matrix_descriptor(
      q_tile + warpgroup * Config::kWarpgroupRows * kPanelRowBytes, 16, kCoreGroupBytes);

  // P of the previous tile as the A fragments of P V, and the V tile it multiplies.
  unsigned p_fragment[Config::kStepsKv][4];
  unsigned previous_v_tile = 0;
  float score[1][kScoreTiles][4];
  float(&score_flat)[kScoreTiles * 4] = reinterpret_cast<float(&)[kScoreTiles * 4]>(score);

  // (The kernels' lambdas take typed parameters: NVRTC treats a generic lambda's call operator
  // as a host function and refuses it, where nvcc compiles it; 2026-12-03.)
  // The operands of the wgmma group issued next (S, and O and P for P V), then the fence.
  auto fence_before_products = [&]() {
    fence_operands(score_flat);
    fence_operands(output_flat);
#pragma unroll
    for (int step = 0; step < Config::kStepsKv; ++step) fence_operands(p_fragment[step]);
    wgmma_fence();
  };
  // Issues (and commits) S = Q K^T, (64, kBlockN) per warpgroup.
  auto issue_scores = [&](int stage) {
    const unsigned long long k_descriptor =
        matrix_descriptor(k_tiles + stage * Config::kKBytes, 16, kCoreGroupBytes);
#pragma unroll
    for (int step = 0; step < Config::kStepsQk; ++step) {
      const unsigned along = (step % 4) * kStepBytes;
      const unsigned panel = step / 4;
      wgmma_from_shared(
          Tag{}, score_flat,
          advance_descriptor(q_descriptor, panel * Config::QLayout::kPanelBytes + along),
          advance_descriptor(k_descriptor, panel * KLayout::kPanelBytes + along), step > 0);
    }
    wgmma_commit();
  };
  // Logits and the softmax's probabilities of a finished S; O untouched (it may be in flight).
  // `try_small`: whether the tile may take the modifier's small-tanh functions (compute_logits).
  // `first`: the row's first tile (it sets a fixed reference, kStaticReference).
  auto probabilities = [&](int entry_index, float(&correction)[1][2], int stage, bool try_small,
                           bool first) {
    const int entry = tile_entry(entry_index);
    const int kv_start = entry_kv_tile(entry) * kBlockN;
    const int kv_first = kv_start + 2 * quad_lane;
    const StagedTile staged{staged_tiles + stage * Config::kStagedBytes,
                            static_cast<int>(Config::StagedLayout::kPanelBytes),
                            warp * Config::kRowsPerWarp};
    const StagedTile* staged_tile = Config::kStageTensor ? &staged : nullptr;
    if (entry_is_mixed(entry) || kv_start + kBlockN > span.kv_len) {
      compute_logits<Modifier, true>(score, p, invariants, at, query, kv_first, staged_tile);
    } else {
      compute_logits<Modifier, false>(score, p, invariants, at, query, kv_first, staged_tile,
                                      try_small);
    }
    if constexpr (Modifier::kStaticReference) {
      fixed_reference_probabilities<Modifier>(score, row_max, row_sum, first);
      return false;  // O is never rescaled
    } else {
      return softmax_probabilities(score, row_max, row_sum, correction, Modifier::kForwardToLog2);
    }
  };
  // O rescaled for the tile's new reference (never with a fixed one).
  auto rescale = [&](const float(&correction)[1][2], bool max_changed) {
    if constexpr (!Modifier::kStaticReference) rescale_output(output, correction, max_changed);
  };
  // P of the tile as A fragments: two adjacent 8-key slices of S form one.
  auto pack_probabilities = [&](int stage) {
#pragma unroll
    for (int step = 0; step < Config::kStepsKv; ++step) {
      p_fragment[step][0] = pack_pair(Tag{}, score[0][2 * step][0], score[0][2 * step][1]);
      p_fragment[step][1] = pack_pair(Tag{}, score[0][2 * step][2], score[0][2 * step][3]);
      p_fragment[step][2] = pack_pair(Tag{}, score[0][2 * step + 1][0], score[0][2 * step + 1][1]);
      p_fragment[step][3] = pack_pair(Tag{}, score[0][2 * step + 1][2], score[0][2 * step + 1][3]);
    }
    previous_v_tile = v_tiles + stage * Config::kVBytes;
  };
  // O += P V of the packed tile, waited for.
  auto multiply_values = [&]() {
    fence_before_products();
    issue_probability_value<Config>(output_flat, p_fragment, previous_v_tile);
    wgmma_wait<0>();
    fence_operands(output_flat);
  };

  if constexpr (Config::kPipelined) {
    // Waits for tile `entry_index` and starts the copy of the next one; returns its stage.
    auto begin_tile = [&](int entry_index) {
      const int iteration = entry_index - entries.begin;
      if constexpr (Config::kProducer) {
        await_stage(iteration);
      } else {
        wait_copies<0>();      // tile `iteration` (its copy was the last one committed)
        fence_async_shared();  // this thread's copies, visible to the wgmma reads after the barrier
        // Tile `iteration` visible to all; the stage refilled below held tile iteration - 2,
        // whose P V every warpgroup waited for in the previous iteration.
        __syncthreads();
        if (entry_index + 1 < entries.end) {
          load_keys_and_values(entry_index + 1, (iteration + 1) % kStages, thread);
        }
        commit_copies();
      }
      return iteration % kStages;
    };
    // The first tile on its own: nothing in flight beside its S. (A P V issued on only some
    // iterations of one loop makes ptxas serialize every wgmma of the kernel, warning C7515.)
    if (entries.begin < entries.end) {
      const int stage = begin_tile(entries.begin);
      await_turn<Config>(warpgroup);
      fence_before_products();
      issue_scores(stage);
      pass_turn<Config>(warpgroup, true, entries.begin + 1 < entries.end);
      wgmma_wait<0>();
      fence_operands(score_flat);
      float correction[1][2];
      probabilities(entries.begin, correction, stage, false, true);  // O is 0: no rescaling
      pack_probabilities(stage);
    }
    for (int entry_index = entries.begin + 1; entry_index < entries.end; ++entry_index) {
      const int stage = begin_tile(entry_index);
      await_turn<Config>(warpgroup);
      fence_before_products();
      issue_scores(stage);
      issue_probability_value<Config>(output_flat, p_fragment, previous_v_tile);  // tile - 1
      pass_turn<Config>(warpgroup, false, entry_index + 1 < entries.end);
      wgmma_wait<1>();  // S is done; P V may still run
      fence_operands(score_flat);
      float correction[1][2];
      const bool max_changed = probabilities(entry_index, correction, stage, true, false);
      wgmma_wait<0>();
      fence_operands(output_flat);
      release_stage(entry_index - 1 - entries.begin);  // its V was read by the P V just waited for
      rescale(correction, max_changed);
      pack_probabilities(stage);
    }
    if (entries.begin < entries.end) multiply_values();
  } else {
    // Each product waited for before its result is read (head dim 64: measured faster).
    for (int entry_index = entries.begin; entry_index < entries.end; ++entry_index) {
      const int iteration = entry_index - entries.begin;
      const int stage = iteration % kStages;
      if constexpr (Config::kProducer) {
        await_stage(iteration);
      } else {
        wait_copies<kStages - 2>();
        fence_async_shared();  // this thread's copies, visible to the wgmma reads after the barrier
        __syncthreads();  // tile `iteration` visible; the buffer refilled below is no longer read
        if (entry_index + kStages - 1 < entries.end) {
          load_keys_and_values(entry_index + kStages - 1, (iteration + kStages - 1) % kStages,
                               thread);
        }
        commit_copies();
      }
      fence_before_products();
      issue_scores(stage);
      wgmma_wait<0>();
      fence_operands(score_flat);
      float correction[1][2];
      const bool max_changed =
          probabilities(entry_index, correction, stage, true, entry_index == entries.begin);
      rescale(correction, max_changed);
      pack_probabilities(stage);
      multiply_values();
      release_stage(iteration);  // K, V and the staged tile read
    }
  }
  if constexpr (kPaged) {
    finish_forward_rows<Config, Modifier>(p, shared, output, row_max, row_sum, span, batch, head,
                                          q_start, thread, warp,
                                          PagedKeyRows{*paged, page_table, shift});
  } else {
    finish_forward_rows<Config, Modifier>(p, shared, output, row_max, row_sum, span, batch, head,
                                          q_start, thread, warp,
                                          DenseKeyRows{batch, span.kv_offset});
  }
}

// Chunked prefill against a paged KV cache on the wgmma forward (above): grid (query blocks of
// the longest sequence, query heads, batch), one split.
template <class Config, class Modifier>
__device__ __forceinline__ void forward_prefill_wgmma(const DecodeParams& d) {
  forward_wgmma<Config, Modifier, true>(d.fwd, &d);
}

}  // namespace flexattn_kernels
