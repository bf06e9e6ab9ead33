// The backward's kernels at head dims 256 and 192/128 on Hopper's warpgroup tensor cores (wgmma,
// sm_90a; bf16/fp16; docs/engines.md, "Backward at head dims 256 and 192/128 on sm_90"). They
// share backward_wgmma.cuh's operand helpers and the dK/dV kernel's loads and stores.
//
// At head dim 256 a warpgroup cannot hold 64 keys' dK and dV (256 accumulators a thread), so the
// two warpgroups of a block share its 64 keys and split the work the other way (also for MLA's
// 192/128, where warpgroup 0 takes dK's first 128 columns and warpgroup 1 the last 64):
//   S^T, dP^T   warpgroup w computes the block's 64 keys against queries 32 w .. 32 w + 31 of the
//               q block (wgmma m64 n32 k16 over the whole head dim; K, V as A, Q and dO as B,
//               all K-major from shared memory), and runs the element pipeline on them;
//   exchange    both write their P^T and dS^T columns to shared memory (one 64 x 64 tile each,
//               the storage type, K-major panels), then a block barrier;
//   dV, dK      warpgroup w accumulates its columns of dV += P^T dO and dK += dS^T Q over all
//               64 queries (A = P^T or dS^T, B = dO or Q MN-major, both from shared memory): at
//               256, columns 128 w .. 128 w + 127 of each, 64 + 64 accumulators a thread.
// K and V (32 KB each at 256) stay resident; Q, dO, LSE and delta of the q blocks stream through
// two stages (the next q block loads while one is computed).
//
// backward_dq_wgmma_wide, the same split for dQ: a block owns 64 query rows of one head (Q and
// dO resident) and walks the q-major tile list, K and V in two stages; warpgroup w computes S and
// dP for keys 32 w .. 32 w + 31 of each tile (m64n32), writes its dS columns to shared memory,
// and after a block barrier accumulates its columns of dQ += dS K over all 64 keys. With
// tensor gradients, the exact-delta pass's row sums of the two warpgroups are added through
// shared memory in a fixed order.
#pragma once

#include "backward_wgmma.cuh"

namespace flexattn_kernels {

template <class ElementTag, int kHeadDimQk_, int kHeadDimV_, int kSharedBytes_, int kSharedDq_>
struct BackwardWgmmaWideConfig {
  using Tag = ElementTag;
  static constexpr int kHeadDimQk = kHeadDimQk_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kWarpgroups = 2;
  static constexpr int kWarps = 4 * kWarpgroups;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockKv = 64;
  static constexpr int kBlockQ = 64;
  static constexpr int kSliceQ = kBlockQ / kWarpgroups;  // a warpgroup's queries of S^T
  static constexpr int kStages = 2;
  static constexpr int kChunksQk = kHeadDimQk / kChunkElements;
  static constexpr int kChunksV = kHeadDimV / kChunkElements;
  static constexpr int kChunksQ = kBlockQ / kChunkElements;  // a P^T / dS^T row: 64 queries
  static constexpr int kStepsQk = kHeadDimQk / 16;
  static constexpr int kStepsV = kHeadDimV / 16;
  static constexpr int kStepsQ = kBlockQ / 16;     // k-steps of dV and dK
  static constexpr int kTilesSlice = kSliceQ / 8;  // 8-column tiles of S^T and dP^T
  // A warpgroup's columns of dK (and dQ) and of dV, in 64-column panels: warpgroup 0 the first
  // half (rounded up), warpgroup 1 the rest. Accumulators are sized for warpgroup 0's.
  static constexpr int kPanelsQk = kHeadDimQk / 64;
  static constexpr int kPanelsV = kHeadDimV / 64;
  static constexpr int kFirstPanelsQk = (kPanelsQk + 1) / 2;
  static constexpr int kSecondPanelsQk = kPanelsQk - kFirstPanelsQk;
  static constexpr int kFirstPanelsV = (kPanelsV + 1) / 2;
  static constexpr int kSecondPanelsV = kPanelsV - kFirstPanelsV;
  static constexpr int kTilesQk = kFirstPanelsQk * 8;
  static constexpr int kTilesV = kFirstPanelsV * 8;
  // Both warpgroups take as many columns (256): one branch of products serves both.
  static constexpr bool kEvenSplit =
      kFirstPanelsQk == kSecondPanelsQk && kFirstPanelsV == kSecondPanelsV;
  using KLayout = SwizzledPanels<kBlockKv, kChunksQk>;
  using VLayout = SwizzledPanels<kBlockKv, kChunksV>;
  using QLayout = SwizzledPanels<kBlockQ, kChunksQk>;
  using DoLayout = SwizzledPanels<kBlockQ, kChunksV>;
  using ExchangeLayout = SwizzledPanels<kBlockKv, kChunksQ>;
  static constexpr int kKBytes = kBlockKv * kChunksQk * kChunkBytes;
  static constexpr int kVBytes = kBlockKv * kChunksV * kChunkBytes;
  static constexpr int kQBytes = kBlockQ * kChunksQk * kChunkBytes;
  static constexpr int kDoBytes = kBlockQ * kChunksV * kChunkBytes;
  static constexpr int kExchangeBytes = kBlockKv * kChunksQ * kChunkBytes;  // P^T, then dS^T
  static constexpr int kRowStageBytes = 2 * kBlockQ * static_cast<int>(sizeof(float));
  static constexpr int kAlignment = 1024;
  static constexpr int kStreamBytes = kStages * (kQBytes + kDoBytes);
  static constexpr int kSharedBytes =
      kAlignment + kKBytes + kVBytes + kStreamBytes + 2 * kExchangeBytes + kStages * kRowStageBytes;

  static_assert((kHeadDimQk == 256 && kHeadDimV == 256) || (kHeadDimQk == 192 && kHeadDimV == 128),
                "the wide wgmma backward takes head dims 256 and 192/128");
  static_assert(kFirstPanelsQk <= 2 && kFirstPanelsV <= 2 && kSecondPanelsQk >= 1 &&
                    kSecondPanelsV >= 1,
                "a warpgroup's columns are one m64n64 or m64n128 product");
  // Every tile a descriptor reads starts on the swizzle's 1024 bytes, as does a warpgroup's
  // 32-row slice of one.
  static_assert(kKBytes % kAlignment == 0 && kVBytes % kAlignment == 0 &&
                    kQBytes % kAlignment == 0 && kDoBytes % kAlignment == 0 &&
                    kExchangeBytes % kAlignment == 0 &&
                    kSliceQ * kSwizzleRows * kChunkBytes % kAlignment == 0,
                "tiles stay aligned");
  static_assert(kStreamBytes >= kBlockKv * (kChunksQk + kChunksV) * kChunkBytes,
                "dK and dV fit the streaming stages");
  static_assert(kSharedBytes == kSharedBytes_, "the host's shared-memory size (tile_plan.cpp)");

  // The dQ kernel: Q and dO resident (64 rows), K and V (64 keys) in kStages stages, the dS
  // exchange tile, and the two warpgroups' row sums of the exact-delta pass (sum P dP, sum P).
  static constexpr int kDqSlicesKv = kBlockKv / kWarpgroups;  // a warpgroup's keys of S and dP
  static constexpr int kDqKvStreamBytes = kStages * (kKBytes + kVBytes);
  static constexpr int kRowSumBytes = kWarpgroups * kBlockQ * 2 * static_cast<int>(sizeof(float));
  static constexpr int kSharedDq =
      kAlignment + kQBytes + kDoBytes + kDqKvStreamBytes + kExchangeBytes + kRowSumBytes;
  static_assert(kDqKvStreamBytes >= kBlockQ * kChunksQk * kChunkBytes, "dQ fits the K/V stages");
  static_assert(kSharedDq == kSharedDq_, "the host's dQ shared-memory size (tile_plan.cpp)");
};

// The first kTiles accumulator tiles of `acc` (warpgroup 1's share, where it has fewer columns).
template <int kTiles, int kTotal>
__device__ __forceinline__ auto leading_tiles(float (&acc)[kTotal][4]) -> float (&)[kTiles][4] {
  static_assert(kTiles <= kTotal, "a share of the accumulators");
  return reinterpret_cast<float(&)[kTiles][4]>(acc);
}

// acc += A B over kSteps k-steps of 16: A (64 x 16 kSteps) K-major in shared memory, B MN-major
// (16 kSteps rows, acc's columns): one wgmma per k-step, into the open group.
template <class Tag, int kSteps, int kTiles>
__device__ __forceinline__ void accumulate_from_shared(float (&acc)[kTiles][4],
                                                       unsigned long long a, unsigned long long b) {
  constexpr int kPanelRowBytes = kSwizzleRows * kChunkBytes;  // 128
  float(&flat)[kTiles * 4] = reinterpret_cast<float(&)[kTiles * 4]>(acc);
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    wgmma_from_shared_mn(Tag{}, flat, advance_descriptor(a, step * 32),
                         advance_descriptor(b, step * 16 * kPanelRowBytes), 1);
  }
}

template <class Config, class Modifier>
__device__ __forceinline__ void backward_dkdv_wgmma_wide(const BackwardParams& bp) {
  using Tag = typename Config::Tag;
  constexpr int kThreads = Config::kThreads;
  constexpr int kBlockQ = Config::kBlockQ;
  constexpr int kSliceQ = Config::kSliceQ;
  constexpr int kTilesSlice = Config::kTilesSlice;
  constexpr int kPanelRowBytes = kSwizzleRows * kChunkBytes;      // 128
  constexpr int kCoreGroupBytes = kSwizzleRows * kPanelRowBytes;  // 8 rows: a descriptor stride
  const ForwardParams& p = bp.fwd;
  const AlignedShared aligned = aligned_shared_memory<Config::kAlignment>();
  const unsigned aligned_start = aligned.address;
  unsigned char* shared = aligned.pointer;

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group = lane / 4;
  const int quad_lane = lane % 4;
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);  // uniform (see above)
  const int warp_in_group = warp % 4;
  const int kv_tile = blockIdx.x;
  const int head_kv = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p, batch);
  const int kv_start = kv_tile * Config::kBlockKv;
  if (kv_start >= span.kv_len) return;

  const unsigned k_tile = aligned_start;
  const unsigned v_tile = k_tile + Config::kKBytes;
  const unsigned q_tiles = v_tile + Config::kVBytes;
  const unsigned do_tiles = q_tiles + Config::kStages * Config::kQBytes;
  const unsigned pt_tile = do_tiles + Config::kStages * Config::kDoBytes;
  const unsigned dst_tile = pt_tile + Config::kExchangeBytes;
  const unsigned row_tiles = dst_tile + Config::kExchangeBytes;
  unsigned char* stream_area = shared + Config::kKBytes + Config::kVBytes;
  unsigned char* pt_area = stream_area + Config::kStreamBytes;
  unsigned char* dst_area = pt_area + Config::kExchangeBytes;
  const float* row_floats = reinterpret_cast<const float*>(dst_area + Config::kExchangeBytes);

  load_resident_keys<Config>(p, span, batch, head_kv, kv_start, k_tile, v_tile, thread);
  commit_copies();

  const VisitingBlocks blocks = visiting_q_blocks(bp, span, kv_tile, kBlockQ);
  const int begin = blocks.begin;
  const int per_head = blocks.per_head;
  const int total = blocks.total;
  auto load_queries = [&](int iteration, int stage) {
    load_query_block<Config>(bp, span, batch, head_kv, blocks, iteration, stage, q_tiles, do_tiles,
                             row_tiles, thread);
  };
  if (total > 0) load_queries(0, 0);
  commit_copies();

  float dk[Config::kTilesQk][4];
  float dv[Config::kTilesV][4];
  zero_accumulators(dk);
  zero_accumulators(dv);
  float(&dk_flat)[Config::kTilesQk * 4] = reinterpret_cast<float(&)[Config::kTilesQk * 4]>(dk);
  float(&dv_flat)[Config::kTilesV * 4] = reinterpret_cast<float(&)[Config::kTilesV * 4]>(dv);

  int kv_row[2];  // this thread's keys (accumulator rows)
  kv_row[0] = kv_start + warp_in_group * 16 + group;
  kv_row[1] = kv_row[0] + 8;
  const bool kv_boundary = kv_start + Config::kBlockKv > span.kv_len;
  // The block's 64 keys of K and V as K-major A operands (both warpgroups use all of them).
  const unsigned long long k_descriptor = matrix_descriptor(k_tile, 16, kCoreGroupBytes);
  const unsigned long long v_descriptor = matrix_descriptor(v_tile, 16, kCoreGroupBytes);
  // P^T and dS^T (keys x the q block's 64 queries) as K-major A operands.
  const unsigned long long pt_descriptor = matrix_descriptor(pt_tile, 16, kCoreGroupBytes);
  const unsigned long long dst_descriptor = matrix_descriptor(dst_tile, 16, kCoreGroupBytes);
  // This warpgroup's query slice within a Q or dO stage (rows kSliceQ w ..), and its first
  // column panel of dK and dV within one.
  const unsigned slice_rows = warpgroup * kSliceQ * kPanelRowBytes;
  const unsigned q_columns = warpgroup * Config::kFirstPanelsQk * Config::QLayout::kPanelBytes;
  const unsigned do_columns = warpgroup * Config::kFirstPanelsV * Config::DoLayout::kPanelBytes;

  int prepared_head = -1;
  typename Modifier::Invariants invariants{};
  float st[kTilesSlice][4];
  float dpt[kTilesSlice][4];
  float(&st_flat)[kTilesSlice * 4] = reinterpret_cast<float(&)[kTilesSlice * 4]>(st);
  float(&dpt_flat)[kTilesSlice * 4] = reinterpret_cast<float(&)[kTilesSlice * 4]>(dpt);

  // q block i: its stage became visible at the first barrier (block i - 1's products, which
  // read the other stage and the exchange tiles, were waited for before it), so block i + 1
  // loads into the other stage meanwhile.
  for (int iteration = 0; iteration < total; ++iteration) {
    const int stage = iteration % Config::kStages;
    wait_copies<0>();
    fence_async_shared();  // this thread's copies, visible to the wgmma reads after the barrier
    __syncthreads();
    if (iteration + 1 < total) load_queries(iteration + 1, (iteration + 1) % Config::kStages);
    commit_copies();

    const unsigned q_stage = q_tiles + stage * Config::kQBytes;
    const unsigned do_stage = do_tiles + stage * Config::kDoBytes;
    fence_operands(st_flat);
    fence_operands(dpt_flat);
    wgmma_group([&]() {
      wgmma_k_major<Config::kStepsQk, Config::KLayout::kPanelBytes, Config::QLayout::kPanelBytes>(
          Tag{}, st_flat, k_descriptor,
          matrix_descriptor(q_stage + slice_rows, 16, kCoreGroupBytes));
      wgmma_k_major<Config::kStepsV, Config::VLayout::kPanelBytes, Config::DoLayout::kPanelBytes>(
          Tag{}, dpt_flat, v_descriptor,
          matrix_descriptor(do_stage + slice_rows, 16, kCoreGroupBytes));
    });
    fence_operands(st_flat);
    fence_operands(dpt_flat);

    const int head = head_kv * p.heads_per_kv + iteration / per_head;
    const int entry = bp.kv_tile_entries[begin + iteration % per_head];
    const Coordinates at{batch, head, span.q_len, span.kv_len};
    if (head != prepared_head) {
      invariants = Modifier::prepare(p, at);
      prepared_head = head;
    }
    const float* lse2_stage = row_floats + stage * 2 * kBlockQ;
    const int q_start = (entry >> 1) * kBlockQ;
    const bool q_boundary = q_start + kBlockQ > span.q_len;
    const int slice = warpgroup * kSliceQ;
    dkdv_elements<Modifier, true>(st, dpt, p, invariants, at, span, kv_row, q_start + slice,
                                  entry_is_mixed(entry) || kv_boundary || q_boundary,
                                  lse2_stage + slice, lse2_stage + kBlockQ + slice, quad_lane);
    const int chunk0 = warpgroup * (kSliceQ / kChunkElements);
    stage_columns<Tag, typename Config::ExchangeLayout>(pt_area, st, warp_in_group * 16, chunk0,
                                                        group, quad_lane, 1.0f);
    stage_columns<Tag, typename Config::ExchangeLayout>(dst_area, dpt, warp_in_group * 16, chunk0,
                                                        group, quad_lane, 1.0f);
    fence_async_shared();  // the exchange tiles, visible to both warpgroups' wgmma reads
    __syncthreads();

    fence_operands(dk_flat);
    fence_operands(dv_flat);
    const unsigned long long do_values =
        matrix_descriptor(do_stage + do_columns, Config::DoLayout::kPanelBytes, kCoreGroupBytes);
    const unsigned long long q_values =
        matrix_descriptor(q_stage + q_columns, Config::QLayout::kPanelBytes, kCoreGroupBytes);
    if (Config::kEvenSplit || warpgroup == 0) {  // one copy of the products where both agree
      wgmma_group([&]() {
        accumulate_from_shared<Tag, Config::kStepsQ>(dv, pt_descriptor, do_values);
        accumulate_from_shared<Tag, Config::kStepsQ>(dk, dst_descriptor, q_values);
      });
    } else {
      wgmma_group([&]() {
        accumulate_from_shared<Tag, Config::kStepsQ>(leading_tiles<Config::kSecondPanelsV * 8>(dv),
                                                     pt_descriptor, do_values);
        accumulate_from_shared<Tag, Config::kStepsQ>(leading_tiles<Config::kSecondPanelsQk * 8>(dk),
                                                     dst_descriptor, q_values);
      });
    }
    fence_operands(dk_flat);
    fence_operands(dv_flat);
  }
  wait_copies<0>();
  __syncthreads();  // every warp is done with the stages: they now stage dK and dV

  unsigned char* dk_stage = stream_area;
  unsigned char* dv_stage = dk_stage + Config::kBlockKv * Config::kChunksQk * kChunkBytes;
  using DkStage = SwizzledRows<Config::kChunksQk>;
  using DvStage = SwizzledRows<Config::kChunksV>;
  if (warpgroup == 0) {
    stage_columns<Tag, DkStage>(dk_stage, dk, warp_in_group * 16, 0, group, quad_lane, p.scale);
    stage_columns<Tag, DvStage>(dv_stage, dv, warp_in_group * 16, 0, group, quad_lane, 1.0f);
  } else {
    stage_columns<Tag, DkStage>(dk_stage, leading_tiles<Config::kSecondPanelsQk * 8>(dk),
                                warp_in_group * 16, Config::kFirstPanelsQk * 8, group, quad_lane,
                                p.scale);
    stage_columns<Tag, DvStage>(dv_stage, leading_tiles<Config::kSecondPanelsV * 8>(dv),
                                warp_in_group * 16, Config::kFirstPanelsV * 8, group, quad_lane,
                                1.0f);
  }
  // see repair_dkdv_rows
  const bool flagged = barrier_any<-1>(any_non_finite(dk) || any_non_finite(dv), kThreads);
  store_key_gradients<Config, Modifier>(bp, span, batch, head_kv, kv_start, dk_stage, dv_stage,
                                        flagged, warp, thread);
}

template <class Config, class Modifier>
__device__ __forceinline__ void backward_dq_wgmma_wide(const BackwardParams& bp) {
  using Tag = typename Config::Tag;
  constexpr int kThreads = Config::kThreads;
  constexpr int kBlockQ = Config::kBlockQ;
  constexpr int kBlockKv = Config::kBlockKv;
  constexpr int kSliceKv = Config::kDqSlicesKv;
  constexpr int kTilesSlice = kSliceKv / 8;
  constexpr int kPanelRowBytes = kSwizzleRows * kChunkBytes;      // 128
  constexpr int kCoreGroupBytes = kSwizzleRows * kPanelRowBytes;  // 8 rows: a descriptor stride
  const ForwardParams& p = bp.fwd;
  const AlignedShared aligned = aligned_shared_memory<Config::kAlignment>();
  const unsigned aligned_start = aligned.address;
  unsigned char* shared = aligned.pointer;

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group = lane / 4;
  const int quad_lane = lane % 4;
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);  // uniform (see above)
  const int warp_in_group = warp % 4;
  const int q_block = gridDim.x - 1 - blockIdx.x;  // the longest lists (causal) start first
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p, batch);
  const int q_start = q_block * kBlockQ;
  if (q_start >= span.q_len) return;
  const int head_kv = head / p.heads_per_kv;
  const Coordinates at{batch, head, span.q_len, span.kv_len};

  const unsigned q_tile = aligned_start;
  const unsigned do_tile = q_tile + Config::kQBytes;
  const unsigned k_tiles = do_tile + Config::kDoBytes;
  const unsigned v_tiles = k_tiles + Config::kStages * Config::kKBytes;
  const unsigned ds_tile = v_tiles + Config::kStages * Config::kVBytes;
  unsigned char* kv_area = shared + Config::kQBytes + Config::kDoBytes;
  unsigned char* ds_area = kv_area + Config::kDqKvStreamBytes;
  float* row_sums = reinterpret_cast<float*>(ds_area + Config::kExchangeBytes);
  const unsigned short* k_source =
      view_row<const unsigned short>(p.k, batch, span.kv_offset, head_kv);
  const unsigned short* v_source =
      view_row<const unsigned short>(p.v, batch, span.kv_offset, head_kv);

  const EntryRange entries = visited_tiles(p, q_start, kBlockKv, span.kv_len);
  const int q_rows_valid = span.q_len - q_start;
  const bool q_boundary = q_rows_valid < kBlockQ;  // every tile masks the padding rows
  load_rows_async<kBlockQ, typename Config::QLayout, Config::kChunksQk, kThreads>(
      q_tile, view_row<const unsigned short>(p.q, batch, span.q_offset + q_start, head),
      p.q.token_stride, q_rows_valid, Config::kChunksQk, thread);
  load_rows_async<kBlockQ, typename Config::DoLayout, Config::kChunksV, kThreads>(
      do_tile, view_row<const unsigned short>(bp.dout, batch, span.q_offset + q_start, head),
      bp.dout.token_stride, q_rows_valid, Config::kChunksV, thread);
  commit_copies();

  auto load_keys_and_values = [&](int entry_index, int stage) {
    const int kv_start = entry_kv_tile(p.tile_entries[entry_index]) * kBlockKv;
    const int rows_valid = span.kv_len - kv_start;
    load_rows_async<kBlockKv, typename Config::KLayout, Config::kChunksQk, kThreads>(
        k_tiles + stage * Config::kKBytes, k_source + kv_start * p.k.token_stride, p.k.token_stride,
        rows_valid, Config::kChunksQk, thread);
    load_rows_async<kBlockKv, typename Config::VLayout, Config::kChunksV, kThreads>(
        v_tiles + stage * Config::kVBytes, v_source + kv_start * p.v.token_stride, p.v.token_stride,
        rows_valid, Config::kChunksV, thread);
  };
  const int count = entries.end - entries.begin;
  if (count > 0) load_keys_and_values(entries.begin, 0);
  commit_copies();

  // This thread's two rows: position (clamped), validity, LSE (log2 domain) and delta.
  int query[2];
  bool row_valid[2];
  float lse2[2];
  float delta[2];
  const int first_row = warp_in_group * 16 + group;
  dq_rows(bp, batch, head, span, q_start + first_row, query, row_valid, lse2, delta);
  const typename Modifier::Invariants invariants = Modifier::prepare(p, at);
  GradSum local[Modifier::kLocalGradSlots];
#pragma unroll
  for (int k = 0; k < Modifier::kLocalGradSlots; ++k) local[k] = GradSum{};

  float dq[Config::kTilesQk][4];
  zero_accumulators(dq);
  float(&dq_flat)[Config::kTilesQk * 4] = reinterpret_cast<float(&)[Config::kTilesQk * 4]>(dq);
  // The block's 64 rows of Q and dO as K-major A operands; dS (queries x the tile's 64 keys) as
  // K-major A; this warpgroup's key slice of a K or V stage, and its first column panel of K.
  const unsigned long long q_descriptor = matrix_descriptor(q_tile, 16, kCoreGroupBytes);
  const unsigned long long do_descriptor = matrix_descriptor(do_tile, 16, kCoreGroupBytes);
  const unsigned long long ds_descriptor = matrix_descriptor(ds_tile, 16, kCoreGroupBytes);
  const unsigned slice_rows = warpgroup * kSliceKv * kPanelRowBytes;
  const unsigned k_columns = warpgroup * Config::kFirstPanelsQk * Config::KLayout::kPanelBytes;
  const int slice = warpgroup * kSliceKv;

  // With tensor gradients, a first pass recomputes delta as rowsum(P * dP) and renormalises P by
  // its own row sum (see exact_delta_rows in backward_common.cuh); the second pass computes the
  // gradients.
  const bool tensor_grads = Modifier::kHasTensorGrads && bp.tensor_grads_wanted != 0;
  const int first_pass = tensor_grads ? 0 : 1;
  float row_pdp[2] = {0.0f, 0.0f};
  float row_p[2] = {0.0f, 0.0f};
  float s[kTilesSlice][4];
  float dp[kTilesSlice][4];
  float(&s_flat)[kTilesSlice * 4] = reinterpret_cast<float(&)[kTilesSlice * 4]>(s);
  float(&dp_flat)[kTilesSlice * 4] = reinterpret_cast<float(&)[kTilesSlice * 4]>(dp);
  for (int pass = first_pass; pass < 2; ++pass) {
    const bool delta_pass = pass == 0;
    if (pass == 1 && first_pass == 0) {
      wait_copies<0>();
      // Each warpgroup saw half of every tile's keys: the row sums of both, added in warpgroup
      // order, renormalise the rows (as renormalise_dq_rows).
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float sum_pdp = quad_sum(row_pdp[half]);
        const float sum_p = quad_sum(row_p[half]);
        if (quad_lane == 0) {
          float* sums = row_sums + (warpgroup * kBlockQ + first_row + half * 8) * 2;
          sums[0] = sum_pdp;
          sums[1] = sum_p;
        }
      }
      __syncthreads();  // the sums are visible; every warp is done with the last K/V stages
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float* first = row_sums + (first_row + half * 8) * 2;
        const float* second = first + kBlockQ * 2;
        const float sum_pdp = first[0] + second[0];
        const float sum_p = first[1] + second[1];
        if (row_valid[half] && sum_p > 0.0f) {
          lse2[half] += log2f(sum_p);
          delta[half] = sum_pdp / sum_p;
        }
      }
      if (count > 0) load_keys_and_values(entries.begin, 0);
      commit_copies();
    }
    for (int iteration = 0; iteration < count; ++iteration) {
      const int stage = iteration % Config::kStages;
      wait_copies<0>();
      fence_async_shared();  // this thread's copies, visible to the wgmma reads after the barrier
      __syncthreads();       // tile `iteration` visible; the other stage and dS no longer read
      if (iteration + 1 < count) {
        load_keys_and_values(entries.begin + iteration + 1, (iteration + 1) % Config::kStages);
      }
      commit_copies();

      const unsigned k_stage = k_tiles + stage * Config::kKBytes;
      const unsigned v_stage = v_tiles + stage * Config::kVBytes;
      fence_operands(s_flat);
      fence_operands(dp_flat);
      wgmma_group([&]() {
        wgmma_k_major<Config::kStepsQk, Config::QLayout::kPanelBytes, Config::KLayout::kPanelBytes>(
            Tag{}, s_flat, q_descriptor,
            matrix_descriptor(k_stage + slice_rows, 16, kCoreGroupBytes));
        wgmma_k_major<Config::kStepsV, Config::DoLayout::kPanelBytes, Config::VLayout::kPanelBytes>(
            Tag{}, dp_flat, do_descriptor,
            matrix_descriptor(v_stage + slice_rows, 16, kCoreGroupBytes));
      });
      fence_operands(s_flat);
      fence_operands(dp_flat);

      const int entry = p.tile_entries[entries.begin + iteration];
      const int kv_start = entry_kv_tile(entry) * kBlockKv;
      const bool check = entry_is_mixed(entry) || kv_start + kBlockKv > span.kv_len || q_boundary;
      if (delta_pass) {
        dq_delta_elements<Modifier>(s, dp, p, invariants, at, span, query, lse2, kv_start + slice,
                                    check, quad_lane, row_pdp, row_p);
        continue;
      }
      if (tensor_grads) {
        dq_gradient_elements<Modifier, true>(s, dp, bp, invariants, at, span, query, lse2, delta,
                                             kv_start + slice, check, quad_lane, local);
      } else {
        dq_gradient_elements<Modifier, false>(s, dp, bp, invariants, at, span, query, lse2, delta,
                                              kv_start + slice, check, quad_lane, local);
      }
      stage_columns<Tag, typename Config::ExchangeLayout>(ds_area, dp, warp_in_group * 16,
                                                          warpgroup * (kSliceKv / kChunkElements),
                                                          group, quad_lane, 1.0f);
      fence_async_shared();  // dS, visible to both warpgroups' wgmma reads
      __syncthreads();

      fence_operands(dq_flat);
      const unsigned long long k_values =
          matrix_descriptor(k_stage + k_columns, Config::KLayout::kPanelBytes, kCoreGroupBytes);
      if (Config::kEvenSplit || warpgroup == 0) {
        wgmma_group(
            [&]() { accumulate_from_shared<Tag, Config::kStepsQ>(dq, ds_descriptor, k_values); });
      } else {
        wgmma_group([&]() {
          accumulate_from_shared<Tag, Config::kStepsQ>(
              leading_tiles<Config::kSecondPanelsQk * 8>(dq), ds_descriptor, k_values);
        });
      }
      fence_operands(dq_flat);
    }
  }  // passes
  if constexpr (Modifier::kHasTensorGrads) {
    if (tensor_grads) Modifier::flush_tensor_grads(invariants, bp, at, local);
  }
  wait_copies<0>();
  __syncthreads();  // every warp is done with K and V: their stages now stage dQ

  using DqStage = SwizzledRows<Config::kChunksQk>;
  if (warpgroup == 0) {
    stage_columns<Tag, DqStage>(kv_area, dq, warp_in_group * 16, 0, group, quad_lane, p.scale);
  } else {
    stage_columns<Tag, DqStage>(kv_area, leading_tiles<Config::kSecondPanelsQk * 8>(dq),
                                warp_in_group * 16, Config::kFirstPanelsQk * 8, group, quad_lane,
                                p.scale);
  }
  const bool flagged = barrier_any<-1>(any_non_finite(dq), kThreads);  // see repair_dq_rows
  store_staged<Config::kChunksQk, Config::kChunksQk, kThreads, kBlockQ>(
      kv_area, view_row<unsigned short>(bp.dq, batch, span.q_offset + q_start, head),
      bp.dq.token_stride, q_rows_valid, thread);
  if (flagged) {
    __syncthreads();  // the stores are visible to the warps that read them back
    repair_dq_rows<Tag, Modifier, Config::kHeadDimQk, Config::kHeadDimV>(
        bp, span, batch, head, q_start, kBlockQ, warp, Config::kWarps);
  }
}

}  // namespace flexattn_kernels
