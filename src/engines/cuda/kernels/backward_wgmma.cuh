// The backward's dK/dV kernel on Hopper's warpgroup tensor cores (wgmma, sm_90a; bf16/fp16,
// head dims 64 and 128; 256 and 192/128 are backward_wgmma_wide.cuh's; docs/engines.md,
// "Backward on sm_90"): backward_dkdv_mma's pipeline with its four products per tile on wgmma, in
// the layouts the forward proved (forward_wgmma.cuh).
//
// A block owns kBlockKv = 128 keys of one kv head (two warpgroups of 64; warp w holds keys
// 16 w .. 16 w + 15, so the accumulator layout per warp is the mma.sync kernel's and the element
// pipeline is shared: dkdv_elements). K and V stay in shared memory; for every query head of the
// GQA group and every 64-row q block of the kv-major tile list, Q, dO, LSE and delta stream
// through three stages (cp.async). Per q block and warpgroup:
//   S^T  = K Q^T      wgmma m64 n64 k16, K (A) and Q (B) from shared memory, K-major
//   dP^T = V dO^T     the same with V and dO
//   element pipeline: S^T -> P^T, dP^T -> dS^T (dkdv_elements)
//   dV  += P^T dO     wgmma m64 n(head_dim_v) k16, P^T from registers, dO MN-major
//   dK  += dS^T Q     wgmma m64 n(head_dim_qk) k16, dS^T from registers, Q MN-major
// Each group of products is waited for before its results are read. The two warpgroups run half
// a q block apart (one block barrier per q block): warpgroup 0 issues dV/dK of q block i - 1 and
// S^T/dP^T of q block i as one group, then runs q block i's element work, while warpgroup 1 runs
// q block i - 1's element work and then issues its own group; so the tensor cores run one
// warpgroup's products while the other computes elements.
//
// backward_dq_wgmma: a block owns kDqBlockQ = 128 query rows of one head (two warpgroups of 64)
// and walks the q-major tile list (128 x 64) like the forward, K and V in three stages:
//   S = Q K^T, dP = dO V^T   wgmma m64 n64 k16, both operands from shared memory (K-major)
//   the element pipeline of backward_dq_mma (dq_delta_elements, dq_gradient_elements)
//   dQ += dS K               wgmma m64 n(head_dim_qk) k16, dS from registers, K MN-major
// with the same exact-delta pass and tensor-gradient scatter when a tensor gradient is wanted,
// and the warpgroups half a kv tile apart as in the dK/dV kernel.
//
// Neither kernel branches around a product within a wgmma group, and `warpgroup` is broadcast
// from lane 0: otherwise ptxas serializes every wgmma of the kernel (its C7515 and C7520 notes).
#pragma once

#include "backward_mma.cuh"
#include "wgmma_ops.cuh"

namespace flexattn_kernels {

template <class ElementTag, int kHeadDimQk_, int kHeadDimV_, int kSharedBytes_, int kSharedDq_>
struct BackwardWgmmaConfig {
  using Tag = ElementTag;
  static constexpr int kHeadDimQk = kHeadDimQk_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kWarpgroups = 2;
  static constexpr int kWarpgroupRows = 64;
  static constexpr int kWarps = 4 * kWarpgroups;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockKv = kWarpgroupRows * kWarpgroups;  // 128 keys
  static constexpr int kBlockQ = 64;
  static constexpr int kStages = 3;  // see the dK/dV loop: two q blocks read, one loading
  static constexpr int kChunksQk = kHeadDimQk / kChunkElements;
  static constexpr int kChunksV = kHeadDimV / kChunkElements;
  static constexpr int kStepsQk = kHeadDimQk / 16;
  static constexpr int kStepsV = kHeadDimV / 16;
  static constexpr int kStepsQ = kBlockQ / 16;  // k-steps of dV and dK (over the queries)
  static constexpr int kTilesQ = kBlockQ / 8;   // 8-column accumulator tiles of S^T and dP^T
  static constexpr int kTilesQk = kHeadDimQk / 8;
  static constexpr int kTilesV = kHeadDimV / 8;
  using KLayout = SwizzledPanels<kBlockKv, kChunksQk>;
  using VLayout = SwizzledPanels<kBlockKv, kChunksV>;
  using QLayout = SwizzledPanels<kBlockQ, kChunksQk>;
  using DoLayout = SwizzledPanels<kBlockQ, kChunksV>;
  static constexpr int kKBytes = kBlockKv * kChunksQk * kChunkBytes;
  static constexpr int kVBytes = kBlockKv * kChunksV * kChunkBytes;
  static constexpr int kQBytes = kBlockQ * kChunksQk * kChunkBytes;
  static constexpr int kDoBytes = kBlockQ * kChunksV * kChunkBytes;
  static constexpr int kRowStageBytes =
      2 * kBlockQ * static_cast<int>(sizeof(float));  // lse2, delta
  static constexpr int kAlignment = 1024;             // the panels' swizzle (forward_wgmma.cuh)
  static constexpr int kStreamBytes = kStages * (kQBytes + kDoBytes);
  static constexpr int kSharedBytes =
      kAlignment + kKBytes + kVBytes + kStreamBytes + kStages * kRowStageBytes;

  static_assert((kHeadDimQk == 64 || kHeadDimQk == 128) && (kHeadDimV == 64 || kHeadDimV == 128),
                "the wgmma backward takes head dims 64 and 128");
  static_assert(kQBytes % kAlignment == 0 && kDoBytes % kAlignment == 0, "panels stay aligned");
  // The epilogue stages dK and dV (128 rows each, swizzled rows) where Q and dO streamed.
  static_assert(kStreamBytes >= kBlockKv * (kChunksQk + kChunksV) * kChunkBytes,
                "dK and dV fit the streaming stages");
  static_assert(kSharedBytes == kSharedBytes_, "the host's shared-memory size (tile_plan.cpp)");

  // The dQ kernel: two warpgroups of 64 query rows (128), kv tiles of 64 keys in kStages stages.
  static constexpr int kDqBlockQ = kWarpgroupRows * kWarpgroups;
  static constexpr int kDqBlockKv = 64;
  static constexpr int kDqTilesKv = kDqBlockKv / 8;   // 8-column accumulator tiles of S and dP
  static constexpr int kDqStepsKv = kDqBlockKv / 16;  // k-steps of dQ += dS K
  using DqQLayout = SwizzledPanels<kDqBlockQ, kChunksQk>;
  using DqDoLayout = SwizzledPanels<kDqBlockQ, kChunksV>;
  using DqKLayout = SwizzledPanels<kDqBlockKv, kChunksQk>;
  using DqVLayout = SwizzledPanels<kDqBlockKv, kChunksV>;
  static constexpr int kDqQBytes = kDqBlockQ * kChunksQk * kChunkBytes;
  static constexpr int kDqDoBytes = kDqBlockQ * kChunksV * kChunkBytes;
  static constexpr int kDqKBytes = kDqBlockKv * kChunksQk * kChunkBytes;
  static constexpr int kDqVBytes = kDqBlockKv * kChunksV * kChunkBytes;
  static constexpr int kDqStreamBytes = kStages * (kDqKBytes + kDqVBytes);
  static constexpr int kSharedDq = kAlignment + kDqQBytes + kDqDoBytes + kDqStreamBytes;
  static_assert(kDqStreamBytes >= kDqBlockQ * kChunksQk * kChunkBytes,
                "dQ fits the K and V stages");
  static_assert(kSharedDq == kSharedDq_, "the host's dQ shared-memory size (tile_plan.cpp)");
};

// d (64 x N) = A B^T over kSteps k-steps of 16, A and B K-major in swizzled panels of 64 values
// (kPanelBytesA and kPanelBytesB apart); d's earlier values discarded.
template <int kSteps, int kPanelBytesA, int kPanelBytesB, class Tag, int kCount>
__device__ __forceinline__ void wgmma_k_major(Tag tag, float (&d)[kCount], unsigned long long a,
                                              unsigned long long b) {
  constexpr unsigned kStepBytes = 16 * 2;  // one k-step of 16 values along a K-major row
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const unsigned along = (step % 4) * kStepBytes;
    const unsigned panel = step / 4;
    wgmma_from_shared(tag, d, advance_descriptor(a, panel * kPanelBytesA + along),
                      advance_descriptor(b, panel * kPanelBytesB + along), step > 0);
  }
}

// S^T = K Q^T and dP^T = V dO^T of one q block, 64 keys x 64 queries per warpgroup: the
// warpgroup's keys of K and V as K-major A operands (descriptors), the q block's Q and dO
// stages (shared addresses) as K-major B. Issued into the open wgmma group.
template <class Config>
__device__ __forceinline__ void issue_transposed_scores(float (&st)[Config::kTilesQ * 4],
                                                        float (&dpt)[Config::kTilesQ * 4],
                                                        unsigned long long k_descriptor,
                                                        unsigned long long v_descriptor,
                                                        unsigned q_tile, unsigned do_tile) {
  using Tag = typename Config::Tag;
  constexpr int kCoreGroupBytes = kSwizzleRows * kSwizzleRows * kChunkBytes;
  wgmma_k_major<Config::kStepsQk, Config::KLayout::kPanelBytes, Config::QLayout::kPanelBytes>(
      Tag{}, st, k_descriptor, matrix_descriptor(q_tile, 16, kCoreGroupBytes));
  wgmma_k_major<Config::kStepsV, Config::VLayout::kPanelBytes, Config::DoLayout::kPanelBytes>(
      Tag{}, dpt, v_descriptor, matrix_descriptor(do_tile, 16, kCoreGroupBytes));
}

// dV += P^T dO and dK += dS^T Q of one q block (k = its 64 queries): P^T and dS^T from
// registers (pa, sa), the q block's dO and Q stages as MN-major B operands. Issued into the open
// wgmma group.
template <class Config>
__device__ __forceinline__ void issue_key_gradients(float (&dk)[Config::kTilesQk * 4],
                                                    float (&dv)[Config::kTilesV * 4],
                                                    const unsigned (&pa)[Config::kStepsQ][4],
                                                    const unsigned (&sa)[Config::kStepsQ][4],
                                                    unsigned q_tile, unsigned do_tile) {
  using Tag = typename Config::Tag;
  constexpr int kPanelRowBytes = kSwizzleRows * kChunkBytes;
  constexpr int kCoreGroupBytes = kSwizzleRows * kPanelRowBytes;
  const unsigned long long do_values =
      matrix_descriptor(do_tile, Config::DoLayout::kPanelBytes, kCoreGroupBytes);
  const unsigned long long q_values =
      matrix_descriptor(q_tile, Config::QLayout::kPanelBytes, kCoreGroupBytes);
#pragma unroll
  for (int step = 0; step < Config::kStepsQ; ++step) {
    wgmma_from_registers(Tag{}, dv, pa[step],
                         advance_descriptor(do_values, step * 16 * kPanelRowBytes), 1);
  }
#pragma unroll
  for (int step = 0; step < Config::kStepsQ; ++step) {
    wgmma_from_registers(Tag{}, dk, sa[step],
                         advance_descriptor(q_values, step * 16 * kPanelRowBytes), 1);
  }
}

// One whole wgmma group: fence, the products `issue` makes, commit, wait. The kernels pick
// among such groups with branches; a branch around a product inside a group would make ptxas
// serialize every wgmma of the kernel.
template <class Issue>
__device__ __forceinline__ void wgmma_group(const Issue& issue) {
  wgmma_fence();
  issue();
  wgmma_commit();
  wgmma_wait<0>();
}

// ---- what the dK/dV kernels share (this one and backward_wgmma_wide.cuh's) ---------------------

// The q blocks visiting kv tile `kv_tile` (the kv-major list), without those past this
// sequence's queries (thd): entries begin .. begin + per_head of every head of the GQA group,
// `total` in all.
struct VisitingBlocks {
  int begin;
  int per_head;
  int total;
};
__device__ __forceinline__ VisitingBlocks visiting_q_blocks(const BackwardParams& bp,
                                                            const SequenceSpan& span, int kv_tile,
                                                            int block_q) {
  const int begin = bp.kv_tile_offsets[kv_tile];
  int end = bp.kv_tile_offsets[kv_tile + 1];
  while (end > begin && (bp.kv_tile_entries[end - 1] >> 1) * block_q >= span.q_len) --end;
  const int per_head = end - begin;
  return {begin, per_head, per_head * bp.fwd.heads_per_kv};
}

// K and V rows [kv_start, kv_start + kBlockKv) of kv head `head_kv` into the block's resident
// tiles (copies issued, not committed).
template <class Config>
__device__ __forceinline__ void load_resident_keys(const ForwardParams& p, const SequenceSpan& span,
                                                   int batch, int head_kv, int kv_start,
                                                   unsigned k_tile, unsigned v_tile, int thread) {
  load_rows_async<Config::kBlockKv, typename Config::KLayout, Config::kChunksQk, Config::kThreads>(
      k_tile, view_row<const unsigned short>(p.k, batch, span.kv_offset + kv_start, head_kv),
      p.k.token_stride, span.kv_len - kv_start, Config::kChunksQk, thread);
  load_rows_async<Config::kBlockKv, typename Config::VLayout, Config::kChunksV, Config::kThreads>(
      v_tile, view_row<const unsigned short>(p.v, batch, span.kv_offset + kv_start, head_kv),
      p.v.token_stride, span.kv_len - kv_start, Config::kChunksV, thread);
}

// Q, dO, lse2 and delta of visiting q block `iteration` into stage `stage` (copies issued, not
// committed; lse2 +inf and delta 0 past the queries).
template <class Config>
__device__ __forceinline__ void load_query_block(const BackwardParams& bp, const SequenceSpan& span,
                                                 int batch, int head_kv,
                                                 const VisitingBlocks& blocks, int iteration,
                                                 int stage, unsigned q_tiles, unsigned do_tiles,
                                                 unsigned row_tiles, int thread) {
  constexpr int kBlockQ = Config::kBlockQ;
  constexpr int kThreads = Config::kThreads;
  const ForwardParams& p = bp.fwd;
  const int head = head_kv * p.heads_per_kv + iteration / blocks.per_head;
  const int q_start =
      (bp.kv_tile_entries[blocks.begin + iteration % blocks.per_head] >> 1) * kBlockQ;
  const int rows_valid = span.q_len - q_start;
  load_rows_async<kBlockQ, typename Config::QLayout, Config::kChunksQk, kThreads>(
      q_tiles + stage * Config::kQBytes,
      view_row<const unsigned short>(p.q, batch, span.q_offset + q_start, head), p.q.token_stride,
      rows_valid, Config::kChunksQk, thread);
  load_rows_async<kBlockQ, typename Config::DoLayout, Config::kChunksV, kThreads>(
      do_tiles + stage * Config::kDoBytes,
      view_row<const unsigned short>(bp.dout, batch, span.q_offset + q_start, head),
      bp.dout.token_stride, rows_valid, Config::kChunksV, thread);
  if (thread < 2 * kBlockQ) {  // lse2, then delta: one float per thread
    const int row = thread % kBlockQ;
    const bool lse = thread < kBlockQ;
    const float* source = lse ? lse2_address(bp, batch, head, span.q_offset + q_start)
                              : delta_address(bp, batch, head, span.q_offset + q_start);
    stage_row_float(row_tiles + stage * Config::kRowStageBytes + thread * sizeof(float),
                    source + row, row < rows_valid, lse ? positive_infinity() : 0.0f);
  }
}

// Stores the staged dK and dV rows of the block's keys and, where a thread's accumulators held
// NaN or inf (`flagged`, barrier_any), recomputes those rows exactly (repair_dkdv_rows).
template <class Config, class Modifier>
__device__ __forceinline__ void store_key_gradients(const BackwardParams& bp,
                                                    const SequenceSpan& span, int batch,
                                                    int head_kv, int kv_start,
                                                    const unsigned char* dk_stage,
                                                    const unsigned char* dv_stage, bool flagged,
                                                    int warp, int thread) {
  const int rows_valid = span.kv_len - kv_start;
  store_staged<Config::kChunksQk, Config::kChunksQk, Config::kThreads, Config::kBlockKv>(
      dk_stage, view_row<unsigned short>(bp.dk, batch, span.kv_offset + kv_start, head_kv),
      bp.dk.token_stride, rows_valid, thread);
  store_staged<Config::kChunksV, Config::kChunksV, Config::kThreads, Config::kBlockKv>(
      dv_stage, view_row<unsigned short>(bp.dv, batch, span.kv_offset + kv_start, head_kv),
      bp.dv.token_stride, rows_valid, thread);
  if (flagged) {
    __syncthreads();  // the stores are visible to the warps that read them back
    repair_dkdv_rows<typename Config::Tag, Modifier, Config::kHeadDimQk, Config::kHeadDimV, true,
                     true>(bp, span, batch, head_kv, kv_start, Config::kBlockKv, warp,
                           Config::kWarps);
  }
}

template <class Config, class Modifier>
__device__ __forceinline__ void backward_dkdv_wgmma(const BackwardParams& bp) {
  using Tag = typename Config::Tag;
  constexpr int kThreads = Config::kThreads;
  constexpr int kBlockQ = Config::kBlockQ;
  constexpr int kTilesQ = Config::kTilesQ;
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
  // Broadcast from lane 0, so the compiler knows it is uniform across the warp: the products
  // issued on a branch of it are then not serialized (ptxas's "WG.AR in divergent path").
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);
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
  const unsigned row_tiles = do_tiles + Config::kStages * Config::kDoBytes;
  unsigned char* stream_area = shared + Config::kKBytes + Config::kVBytes;
  const float* row_floats = reinterpret_cast<const float*>(stream_area + Config::kStreamBytes);

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
  kv_row[0] = kv_start + warp * 16 + group;
  kv_row[1] = kv_row[0] + 8;
  const bool kv_boundary = kv_start + Config::kBlockKv > span.kv_len;
  // This warpgroup's 64 keys of K and V as K-major A operands.
  const unsigned long long k_descriptor = matrix_descriptor(
      k_tile + warpgroup * Config::kWarpgroupRows * kPanelRowBytes, 16, kCoreGroupBytes);
  const unsigned long long v_descriptor = matrix_descriptor(
      v_tile + warpgroup * Config::kWarpgroupRows * kPanelRowBytes, 16, kCoreGroupBytes);

  int prepared_head = -1;
  typename Modifier::Invariants invariants{};
  // The element pipeline of q block `iteration` (st becomes P^T, dpt dS^T), then P^T and dS^T
  // packed as the A fragments of dV and dK.
  float st[kTilesQ][4];
  float dpt[kTilesQ][4];
  float(&st_flat)[kTilesQ * 4] = reinterpret_cast<float(&)[kTilesQ * 4]>(st);
  float(&dpt_flat)[kTilesQ * 4] = reinterpret_cast<float(&)[kTilesQ * 4]>(dpt);
  unsigned pa[Config::kStepsQ][4];
  unsigned sa[Config::kStepsQ][4];
  auto run_elements = [&](int iteration) {
    const int stage = iteration % Config::kStages;
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
    dkdv_elements<Modifier, true>(st, dpt, p, invariants, at, span, kv_row, q_start,
                                  entry_is_mixed(entry) || kv_boundary || q_boundary, lse2_stage,
                                  lse2_stage + kBlockQ, quad_lane);
#pragma unroll
    for (int step = 0; step < Config::kStepsQ; ++step) {
      pack_fragment<Tag>(pa[step], st, step);
      pack_fragment<Tag>(sa[step], dpt, step);
      fence_operands(pa[step]);
      fence_operands(sa[step]);
    }
  };

  // The warpgroups run half an interval apart, so that one's element work overlaps the
  // other's products on the tensor cores. Interval i (one block barrier each):
  //   warpgroup 0: products (dV/dK of q block i - 1, S^T/dP^T of q block i), then q block i's
  //                element work;
  //   warpgroup 1: q block i - 1's element work (its S^T/dP^T came at the end of the last
  //                interval), then the same products.
  // Intervals 0 .. total: the first has no dV/dK, the last no S^T/dP^T. q blocks i - 1 and i
  // are read during interval i while i + 1 loads: three stages.
  // No interval at all without a q block (dK and dV stay zero).
  static_assert(Config::kStages >= 3, "two q blocks in use and one loading");
  for (int interval = 0; total > 0 && interval <= total; ++interval) {
    wait_copies<0>();
    fence_async_shared();  // this thread's copies, visible to the wgmma reads after the barrier
    __syncthreads();       // q block `interval` visible; interval - 2's stage no longer read
    if (interval + 1 < total) load_queries(interval + 1, (interval + 1) % Config::kStages);
    commit_copies();
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      if ((half == 0) != (warpgroup == 0)) {
        const int iteration = interval - warpgroup;
        if (iteration >= 0 && iteration < total) run_elements(iteration);
        continue;
      }
      fence_operands(dk_flat);
      fence_operands(dv_flat);
      auto gradients = [&]() {  // of q block interval - 1
        const int last = (interval + Config::kStages - 1) % Config::kStages;
        issue_key_gradients<Config>(dk_flat, dv_flat, pa, sa, q_tiles + last * Config::kQBytes,
                                    do_tiles + last * Config::kDoBytes);
      };
      auto scores = [&]() {  // of q block `interval`
        const int stage = interval % Config::kStages;
        issue_transposed_scores<Config>(st_flat, dpt_flat, k_descriptor, v_descriptor,
                                        q_tiles + stage * Config::kQBytes,
                                        do_tiles + stage * Config::kDoBytes);
      };
      if (interval == 0) {
        wgmma_group(scores);
      } else if (interval == total) {
        wgmma_group(gradients);
      } else {
        wgmma_group([&]() {
          gradients();
          scores();
        });
      }
      fence_operands(dk_flat);
      fence_operands(dv_flat);
      fence_operands(st_flat);
      fence_operands(dpt_flat);
#pragma unroll
      for (int step = 0; step < Config::kStepsQ; ++step) {
        fence_operands(pa[step]);  // read by dV/dK until the wait: not reused before it
        fence_operands(sa[step]);
      }
    }
  }
  wait_copies<0>();
  __syncthreads();  // every warp is done with the stages: they now stage dK and dV

  unsigned char* dk_stage = stream_area;
  unsigned char* dv_stage = dk_stage + Config::kBlockKv * Config::kChunksQk * kChunkBytes;
  stage_rows<Tag, Config::kChunksQk>(dk_stage, dk, warp * 16, group, quad_lane, p.scale);
  stage_rows<Tag, Config::kChunksV>(dv_stage, dv, warp * 16, group, quad_lane, 1.0f);
  // see repair_dkdv_rows
  const bool flagged = barrier_any<-1>(any_non_finite(dk) || any_non_finite(dv), kThreads);
  store_key_gradients<Config, Modifier>(bp, span, batch, head_kv, kv_start, dk_stage, dv_stage,
                                        flagged, warp, thread);
}

template <class Config, class Modifier>
__device__ __forceinline__ void backward_dq_wgmma(const BackwardParams& bp) {
  using Tag = typename Config::Tag;
  constexpr int kThreads = Config::kThreads;
  constexpr int kBlockQ = Config::kDqBlockQ;
  constexpr int kBlockKv = Config::kDqBlockKv;
  constexpr int kTilesKv = Config::kDqTilesKv;
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
  // Broadcast from lane 0, so the compiler knows it is uniform across the warp: the products
  // issued on a branch of it are then not serialized (ptxas's "WG.AR in divergent path").
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int q_block = gridDim.x - 1 - blockIdx.x;  // the longest lists (causal) start first
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p, batch);
  const int q_start = q_block * kBlockQ;
  if (q_start >= span.q_len) return;
  const int head_kv = head / p.heads_per_kv;
  const Coordinates at{batch, head, span.q_len, span.kv_len};

  const unsigned q_tile = aligned_start;
  const unsigned do_tile = q_tile + Config::kDqQBytes;
  const unsigned k_tiles = do_tile + Config::kDqDoBytes;
  const unsigned v_tiles = k_tiles + Config::kStages * Config::kDqKBytes;
  const unsigned short* k_source =
      view_row<const unsigned short>(p.k, batch, span.kv_offset, head_kv);
  const unsigned short* v_source =
      view_row<const unsigned short>(p.v, batch, span.kv_offset, head_kv);

  const EntryRange entries = visited_tiles(p, q_start, kBlockKv, span.kv_len);
  const int q_rows_valid = span.q_len - q_start;
  const bool q_boundary = q_rows_valid < kBlockQ;  // every tile masks the padding rows
  load_rows_async<kBlockQ, typename Config::DqQLayout, Config::kChunksQk, kThreads>(
      q_tile, view_row<const unsigned short>(p.q, batch, span.q_offset + q_start, head),
      p.q.token_stride, q_rows_valid, Config::kChunksQk, thread);
  load_rows_async<kBlockQ, typename Config::DqDoLayout, Config::kChunksV, kThreads>(
      do_tile, view_row<const unsigned short>(bp.dout, batch, span.q_offset + q_start, head),
      bp.dout.token_stride, q_rows_valid, Config::kChunksV, thread);
  commit_copies();

  auto load_keys_and_values = [&](int entry_index, int stage) {
    const int kv_start = entry_kv_tile(p.tile_entries[entry_index]) * kBlockKv;
    const int rows_valid = span.kv_len - kv_start;
    load_rows_async<kBlockKv, typename Config::DqKLayout, Config::kChunksQk, kThreads>(
        k_tiles + stage * Config::kDqKBytes, k_source + kv_start * p.k.token_stride,
        p.k.token_stride, rows_valid, Config::kChunksQk, thread);
    load_rows_async<kBlockKv, typename Config::DqVLayout, Config::kChunksV, kThreads>(
        v_tiles + stage * Config::kDqVBytes, v_source + kv_start * p.v.token_stride,
        p.v.token_stride, rows_valid, Config::kChunksV, thread);
  };
  if (entries.begin < entries.end) load_keys_and_values(entries.begin, 0);
  commit_copies();

  // This thread's two rows: position (clamped), validity, LSE (log2 domain) and delta.
  int query[2];
  bool row_valid[2];
  float lse2[2];
  float delta[2];
  dq_rows(bp, batch, head, span, q_start + warp * 16 + group, query, row_valid, lse2, delta);
  const typename Modifier::Invariants invariants = Modifier::prepare(p, at);
  GradSum local[Modifier::kLocalGradSlots];
#pragma unroll
  for (int k = 0; k < Modifier::kLocalGradSlots; ++k) local[k] = GradSum{};

  float dq[Config::kTilesQk][4];
  zero_accumulators(dq);
  float(&dq_flat)[Config::kTilesQk * 4] = reinterpret_cast<float(&)[Config::kTilesQk * 4]>(dq);
  // This warpgroup's 64 rows of Q and dO as K-major A operands.
  const unsigned long long q_descriptor = matrix_descriptor(
      q_tile + warpgroup * Config::kWarpgroupRows * kPanelRowBytes, 16, kCoreGroupBytes);
  const unsigned long long do_descriptor = matrix_descriptor(
      do_tile + warpgroup * Config::kWarpgroupRows * kPanelRowBytes, 16, kCoreGroupBytes);

  // When tensor gradients are wanted, a first pass recomputes delta as rowsum(P * dP) and
  // renormalises P by its own row sum (see exact_delta_rows in backward_common.cuh); the second
  // pass computes the gradients.
  const bool tensor_grads = Modifier::kHasTensorGrads && bp.tensor_grads_wanted != 0;
  const int first_pass = tensor_grads ? 0 : 1;
  float row_pdp[2] = {0.0f, 0.0f};
  float row_p[2] = {0.0f, 0.0f};
  float s[kTilesKv][4];
  float dp[kTilesKv][4];
  float(&s_flat)[kTilesKv * 4] = reinterpret_cast<float(&)[kTilesKv * 4]>(s);
  float(&dp_flat)[kTilesKv * 4] = reinterpret_cast<float(&)[kTilesKv * 4]>(dp);
  unsigned sa[Config::kDqStepsKv][4];  // dS as the A fragments of dQ += dS K
  const int count = entries.end - entries.begin;
  // As in the dK/dV kernel, the warpgroups run half an interval apart: in interval i warpgroup
  // 0 issues dQ += dS K of kv tile i - 1 and S, dP of kv tile i, then runs tile i's element
  // work; warpgroup 1 runs tile i - 1's element work, then issues the same products. Intervals
  // 0 .. count; kv tiles i - 1 and i are read during interval i while i + 1 loads.
  static_assert(Config::kStages >= 3, "two kv tiles in use and one loading");
  for (int pass = first_pass; pass < 2; ++pass) {
    const bool delta_pass = pass == 0;
    if (pass == 1 && first_pass == 0) {
      wait_copies<0>();
      __syncthreads();  // every warp is done with the last K/V stages of the first pass
      renormalise_dq_rows(row_pdp, row_p, row_valid, lse2, delta);
      if (count > 0) load_keys_and_values(entries.begin, 0);
      commit_copies();
    }
    for (int interval = 0; interval <= count; ++interval) {
      wait_copies<0>();
      fence_async_shared();  // this thread's copies, visible to the wgmma reads after the barrier
      __syncthreads();       // kv tile `interval` visible; interval - 2's stage no longer read
      if (interval + 1 < count) {
        load_keys_and_values(entries.begin + interval + 1, (interval + 1) % Config::kStages);
      }
      commit_copies();
#pragma unroll 1
      for (int half = 0; half < 2; ++half) {
        if ((half == 0) != (warpgroup == 0)) {
          // Element work of kv tile `iteration`; the pass and the scatter are decided per tile
          // (see backward_dq_mma).
          const int iteration = interval - warpgroup;
          if (iteration < 0 || iteration >= count) continue;
          const int entry = p.tile_entries[entries.begin + iteration];
          const int kv_start = entry_kv_tile(entry) * kBlockKv;
          const bool check =
              entry_is_mixed(entry) || kv_start + kBlockKv > span.kv_len || q_boundary;
          if (delta_pass) {
            dq_delta_elements<Modifier>(s, dp, p, invariants, at, span, query, lse2, kv_start,
                                        check, quad_lane, row_pdp, row_p);
            continue;
          }
          if (tensor_grads) {
            dq_gradient_elements<Modifier, true>(s, dp, bp, invariants, at, span, query, lse2,
                                                 delta, kv_start, check, quad_lane, local);
          } else {
            dq_gradient_elements<Modifier, false>(s, dp, bp, invariants, at, span, query, lse2,
                                                  delta, kv_start, check, quad_lane, local);
          }
#pragma unroll
          for (int step = 0; step < Config::kDqStepsKv; ++step) {
            pack_fragment<Tag>(sa[step], dp, step);
            fence_operands(sa[step]);
          }
          continue;
        }
        fence_operands(dq_flat);
        // dQ += dS K of kv tile interval - 1 (k = its 64 keys; K as the MN-major B operand).
        auto issue_gradient = [&]() {
          const unsigned long long k_values = matrix_descriptor(
              k_tiles + (interval + Config::kStages - 1) % Config::kStages * Config::kDqKBytes,
              Config::DqKLayout::kPanelBytes, kCoreGroupBytes);
#pragma unroll
          for (int step = 0; step < Config::kDqStepsKv; ++step) {
            wgmma_from_registers(Tag{}, dq_flat, sa[step],
                                 advance_descriptor(k_values, step * 16 * kPanelRowBytes), 1);
          }
        };
        // S = Q K^T and dP = dO V^T of kv tile `interval`: 64 queries x 64 keys per warpgroup.
        auto issue_scores = [&]() {
          const int stage = interval % Config::kStages;
          wgmma_k_major<Config::kStepsQk, Config::DqQLayout::kPanelBytes,
                        Config::DqKLayout::kPanelBytes>(
              Tag{}, s_flat, q_descriptor,
              matrix_descriptor(k_tiles + stage * Config::kDqKBytes, 16, kCoreGroupBytes));
          wgmma_k_major<Config::kStepsV, Config::DqDoLayout::kPanelBytes,
                        Config::DqVLayout::kPanelBytes>(
              Tag{}, dp_flat, do_descriptor,
              matrix_descriptor(v_tiles + stage * Config::kDqVBytes, 16, kCoreGroupBytes));
        };
        const bool gradient = !delta_pass && interval > 0;
        const bool scores = interval < count;
        if (gradient && scores) {
          wgmma_group([&]() {
            issue_gradient();
            issue_scores();
          });
        } else if (gradient) {
          wgmma_group(issue_gradient);
        } else if (scores) {
          wgmma_group(issue_scores);
        }
        fence_operands(dq_flat);
        fence_operands(s_flat);
        fence_operands(dp_flat);
#pragma unroll
        for (int step = 0; step < Config::kDqStepsKv; ++step) {
          fence_operands(sa[step]);  // read by dQ until the wait: not reused before it
        }
      }
    }
  }  // passes
  if constexpr (Modifier::kHasTensorGrads) {
    if (tensor_grads) Modifier::flush_tensor_grads(invariants, bp, at, local);
  }
  wait_copies<0>();
  __syncthreads();  // every warp is done with Q and K: the K/V stages now stage dQ

  unsigned char* dq_stage = shared + Config::kDqQBytes + Config::kDqDoBytes;
  stage_rows<Tag, Config::kChunksQk>(dq_stage, dq, warp * 16, group, quad_lane, p.scale);
  const bool flagged = barrier_any<-1>(any_non_finite(dq), kThreads);  // see repair_dq_rows
  store_staged<Config::kChunksQk, Config::kChunksQk, kThreads, kBlockQ>(
      dq_stage, view_row<unsigned short>(bp.dq, batch, span.q_offset + q_start, head),
      bp.dq.token_stride, q_rows_valid, thread);
  if (flagged) {
    __syncthreads();  // the stores are visible to the warps that read them back
    repair_dq_rows<Tag, Modifier, Config::kHeadDimQk, Config::kHeadDimV>(
        bp, span, batch, head, q_start, kBlockQ, warp, Config::kWarps);
  }
}

}  // namespace flexattn_kernels
