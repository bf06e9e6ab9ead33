// Flash-attention-2 backward on tensor cores (bf16/fp16 storage, fp32 accumulation), in two
// deterministic kernels that each own what they write (no atomics on dQ, dK or dV):
//
//   dkdv: a block owns 64 keys of one kv head. K and V stay in shared memory; for every query
//         head of the GQA group and every q block that visits the tile (the kv-major tile list),
//         Q, dO, LSE and delta stream through two shared-memory stages (cp.async), and each warp
//         computes, for its 16 keys:
//           S^T = K Q^T, P^T = exp(logits - LSE)        (the forward's element pipeline)
//           dV += P^T dO
//           dP^T = V dO^T, dS^T = P^T (dP^T - delta) * d score_mod / d score
//           dK += dS^T Q                                 (scaled by the softmax scale at the end)
//         Above 256 accumulator columns (head dims qk + v, padded), dK and dV of one 16-key warp
//         tile no longer fit its registers: each 64-key tile then has two blocks, one computing
//         S^T, P^T and dV, the other the whole chain for dK (BackwardMmaConfig::kDkdvParts).
//   dq:   a block owns 64 query rows of one head and walks the q-major tile list like the
//         forward, with K and V in two stages: S = Q K^T, P, dP = dO V^T, dS, dQ += dS K; it also
//         scatters the modifier's tensor gradients (Modifier::tensor_grads).
//
// P and dS enter the second mma of each pair rounded to the storage type, as FlashAttention
// does; everything is accumulated in fp32. Fragment layouts: tile_ops.cuh.
#pragma once

#include "backward_common.cuh"
#include "forward_common.cuh"
#include "forward_mma.cuh"
#include "tile_ops.cuh"

namespace flexattn_kernels {

template <class ElementTag, int kHeadDimQk_, int kHeadDimV_, int kPaddedQk, int kPaddedV,
          int kSharedDkdv_, int kSharedDq_, int kDkdvParts_>
struct BackwardMmaConfig {
  using Tag = ElementTag;
  static constexpr int kHeadDimQk = kHeadDimQk_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockQ = 64;   // = 16 rows per warp (dq)
  static constexpr int kBlockKv = 64;  // = 16 keys per warp (dkdv)
  static constexpr int kStages = 2;
  static constexpr int kChunksQk = kPaddedQk / kChunkElements;
  static constexpr int kChunksV = kPaddedV / kChunkElements;
  static constexpr int kRealChunksQk = kHeadDimQk / kChunkElements;
  static constexpr int kRealChunksV = kHeadDimV / kChunkElements;
  static constexpr int kStepsQk = (kHeadDimQk + 15) / 16;
  static constexpr int kStepsV = (kHeadDimV + 15) / 16;
  static constexpr int kLoadedChunksQk = 2 * kStepsQk;
  static constexpr int kLoadedChunksV = 2 * kStepsV;
  static constexpr int kTilesQk = 2 * kStepsQk;  // 8-column accumulator tiles of dK / dQ
  static constexpr int kTilesV = 2 * kStepsV;    // 8-column accumulator tiles of dV
  static constexpr int kTileQkBytes = 64 * kChunksQk * kChunkBytes;  // 64 rows of Q or K
  static constexpr int kTileVBytes = 64 * kChunksV * kChunkBytes;    // 64 rows of V or dO
  static constexpr int kRowStageBytes = 2 * 64 * static_cast<int>(sizeof(float));  // lse2, delta
  static constexpr int kSharedDkdv = kTileQkBytes + kTileVBytes +
                                     kStages * (kTileQkBytes + kTileVBytes) +
                                     kStages * kRowStageBytes;
  static constexpr int kSharedDq =
      kTileQkBytes + kTileVBytes + kStages * (kTileQkBytes + kTileVBytes);

  // Accumulator columns a warp may hold for its 16 rows (128 fp32 registers a thread): the dK/dV
  // kernel holds padded qk + v of them, or splits the tile into a dV and a dK block.
  static constexpr int kAccumulatorColumns = 256;
  static constexpr int kDkdvParts = kPaddedQk + kPaddedV > kAccumulatorColumns ? 2 : 1;

  static_assert(kDkdvParts == kDkdvParts_, "host and kernel disagree on the dK/dV blocks per tile");
  static_assert(kSharedDkdv == kSharedDkdv_, "host and kernel disagree on dkdv shared memory");
  static_assert(kSharedDq == kSharedDq_, "host and kernel disagree on dq shared memory");
  static_assert(kHeadDimQk % kChunkElements == 0 && kHeadDimV % kChunkElements == 0,
                "head dims of the tensor-core kernels are multiples of 8");
  static_assert(kPaddedQk % 64 == 0 && kPaddedV % 64 == 0, "padded dims are multiples of 64");
  static_assert(kPaddedQk <= kAccumulatorColumns && kPaddedV <= kAccumulatorColumns,
                "the accumulators hold head dims <= 256");
};

// Copies one float, or zero-fills it when `valid` is false.
__device__ __forceinline__ void copy_float_async(unsigned destination, const float* source,
                                                 bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(destination), "l"(source),
               "r"(valid ? 4 : 0)
               : "memory");
}

// One float of a q block's row stage (lse2 or delta of one query): copied from `source` when the
// query is in the sequence, else `fallback` stored (+inf for lse2, 0 for delta). Either is visible
// to the other threads after the block's next barrier, like the tiles' copies.
__device__ __forceinline__ void stage_row_float(unsigned destination, const float* source,
                                                bool valid, float fallback) {
  if (valid) {
    copy_float_async(destination, source, true);
  } else {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(destination), "f"(fallback) : "memory");
  }
}

template <int kTiles>
__device__ __forceinline__ void zero_accumulators(float (&tiles)[kTiles][4]) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) tiles[j][e] = 0.0f;
  }
}

// The warp's 16 x (8 kTiles) tile of A B^T over kSteps k-steps of 16: A's 16 rows (this warp's)
// from `a_tile` at lane offsets `a`, B's 8 kTiles rows (n-major) from `b_tile` at lane offsets
// `b`. Overwrites `product`.
template <class Tag, int kSteps, int kTiles, class OffsetsA, class OffsetsB>
__device__ __forceinline__ void product_a_bt(float (&product)[kTiles][4], unsigned a_tile,
                                             const OffsetsA& a, unsigned b_tile,
                                             const OffsetsB& b) {
  zero_accumulators(product);
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    unsigned a_fragment[4];
    load_matrix_x4(a_fragment, a_tile + a.at(step, 0));
#pragma unroll
    for (int pair = 0; pair < kTiles / 2; ++pair) {
      unsigned b_fragment[4];
      load_matrix_x4(b_fragment, b_tile + b.at(step, pair * 16));
      mma_16x8x16(Tag{}, product[2 * pair], a_fragment, b_fragment[0], b_fragment[1]);
      mma_16x8x16(Tag{}, product[2 * pair + 1], a_fragment, b_fragment[2], b_fragment[3]);
    }
  }
}

// The A fragment (16 x 16, rounded to the storage type) of k-step `step` from the accumulator
// tiles of an earlier product: its 8-column tiles 2 step and 2 step + 1.
template <class Tag, int kTiles>
__device__ __forceinline__ void pack_fragment(unsigned (&fragment)[4],
                                              const float (&tiles)[kTiles][4], int step) {
  fragment[0] = pack_pair(Tag{}, tiles[2 * step][0], tiles[2 * step][1]);
  fragment[1] = pack_pair(Tag{}, tiles[2 * step][2], tiles[2 * step][3]);
  fragment[2] = pack_pair(Tag{}, tiles[2 * step + 1][0], tiles[2 * step + 1][1]);
  fragment[3] = pack_pair(Tag{}, tiles[2 * step + 1][2], tiles[2 * step + 1][3]);
}

// accumulator += A B for k-step `step`: A in registers (pack_fragment), B's rows k-major from
// `b_tile` at lane offsets `b` (transposing ldmatrix), 2 kPairs 8-column tiles.
template <class Tag, int kPairs, int kTiles, class OffsetsB>
__device__ __forceinline__ void accumulate_a_b(float (&accumulator)[kTiles][4],
                                               const unsigned (&a_fragment)[4], unsigned b_tile,
                                               const OffsetsB& b, int step) {
#pragma unroll
  for (int pair = 0; pair < kPairs; ++pair) {
    unsigned b_fragment[4];
    load_matrix_x4_transposed(b_fragment, b_tile + b.at(pair, step * 16));
    mma_16x8x16(Tag{}, accumulator[2 * pair], a_fragment, b_fragment[0], b_fragment[1]);
    mma_16x8x16(Tag{}, accumulator[2 * pair + 1], a_fragment, b_fragment[2], b_fragment[3]);
  }
}

// Stages a warp's 16 accumulator rows (storage type, times `factor`) at rows row0.. and chunks
// chunk0.. of a tile laid out as `Layout`.
template <class Tag, class Layout, int kTiles>
__device__ __forceinline__ void stage_columns(unsigned char* tile, const float (&acc)[kTiles][4],
                                              int row0, int chunk0, int group, int quad_lane,
                                              float factor) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + group + half * 8;
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      const unsigned packed =
          pack_pair(Tag{}, acc[j][2 * half] * factor, acc[j][2 * half + 1] * factor);
      *reinterpret_cast<unsigned*>(tile + Layout::offset(row, chunk0 + j) +
                                   quad_lane * sizeof(unsigned)) = packed;
    }
  }
}

// The same at chunk 0 of a whole-row swizzled tile (SwizzledRows).
template <class Tag, int kChunks, int kTiles>
__device__ __forceinline__ void stage_rows(unsigned char* tile, const float (&acc)[kTiles][4],
                                           int row0, int group, int quad_lane, float factor) {
  stage_columns<Tag, SwizzledRows<kChunks>>(tile, acc, row0, 0, group, quad_lane, factor);
}

// Coalesced 16-byte stores of `rows_valid` of kRows staged rows to a view.
template <int kChunks, int kRealChunks, int kThreads, int kRows = 64>
__device__ __forceinline__ void store_staged(const unsigned char* tile, unsigned short* destination,
                                             long long token_stride, int rows_valid, int thread) {
  constexpr int kStoreChunks = kRows * kRealChunks;
  for (int index = thread; index < kStoreChunks; index += kThreads) {
    const int row = index / kRealChunks;
    const int chunk = index % kRealChunks;
    if (row < rows_valid) {
      *reinterpret_cast<SharedChunk*>(destination + row * token_stride + chunk * kChunkElements) =
          *reinterpret_cast<const SharedChunk*>(tile + swizzled_offset<kChunks>(row, chunk));
    }
  }
}

// The dK/dV kernels' element pipeline on one warp's (16 keys x 8 kTilesQ queries) accumulator
// tiles: S^T becomes P^T and dP^T becomes dS^T (including d score_mod / d score). `check`: the
// tile is mixed or crosses the end of the keys, so the mask and the bounds apply.
template <class Modifier, bool kSmall, bool kGradient, int kTilesQ>
__device__ __forceinline__ void dkdv_elements_with(float (&st)[kTilesQ][4],
                                                   float (&dpt)[kTilesQ][4], const ForwardParams& p,
                                                   const typename Modifier::Invariants& invariants,
                                                   const Coordinates& at, const SequenceSpan& span,
                                                   const int (&kv_row)[2], int q_start, bool check,
                                                   const float* lse2_stage,
                                                   const float* delta_stage, int quad_lane) {
#pragma unroll
  for (int j = 0; j < kTilesQ; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int column = j * 8 + 2 * quad_lane + e % 2;  // query row within the q block
      const int q_inside = ir_min(q_start + column, span.q_len - 1);
      const int kv = kv_row[e / 2];
      const int kv_inside = ir_min(kv, span.kv_len - 1);
      const float dot = st[j][e];
      // Straight-line element code (see unmasked_then_masked in backward_common.cuh).
      float logit2 =
          element_logit<Modifier, false, true, kSmall>(dot, p, invariants, at, q_inside, kv_inside);
      if (check) {
        logit2 = backward_masked_logit<Modifier>(logit2, lse2_stage[column], p, invariants, at,
                                                 q_inside, kv);
      }
      // lse2: +inf past the queries (stage_row_float) and in empty rows.
      const float probability = probability_log2(logit2, lse2_stage[column]);
      st[j][e] = probability;
      if constexpr (kGradient) {
        const float dlogit = probability * (dpt[j][e] - delta_stage[column]);
        const float dscore = score_gradient_from_dot<Modifier, kSmall>(dlogit, invariants, p, at,
                                                                       dot, q_inside, kv_inside);
        dpt[j][e] = Modifier::kBoundedDerivative || dlogit != 0.0f ? dscore : 0.0f;
      }
    }
  }
}
// With the small-tanh functions on an unmasked tile that admits them (small_tanh_tile; the masked
// and boundary tiles take the general form, so the small one carries no mask code: the forward's
// choice, docs/engines.md). Without kGradient only st becomes P^T (dpt is not read).
template <class Modifier, bool kGradient, int kTilesQ>
__device__ __forceinline__ void dkdv_elements(float (&st)[kTilesQ][4], float (&dpt)[kTilesQ][4],
                                              const ForwardParams& p,
                                              const typename Modifier::Invariants& invariants,
                                              const Coordinates& at, const SequenceSpan& span,
                                              const int (&kv_row)[2], int q_start, bool check,
                                              const float* lse2_stage, const float* delta_stage,
                                              int quad_lane) {
  if constexpr (Modifier::kSmallTanh) {
    if (!check && small_tanh_tile<Modifier, kTilesQ * 4>(&st[0][0], invariants, p)) {
      dkdv_elements_with<Modifier, true, kGradient>(st, dpt, p, invariants, at, span, kv_row,
                                                    q_start, false, lse2_stage, delta_stage,
                                                    quad_lane);
      return;
    }
  }
  dkdv_elements_with<Modifier, false, kGradient>(st, dpt, p, invariants, at, span, kv_row, q_start,
                                                 check, lse2_stage, delta_stage, quad_lane);
}

// What one dK/dV block computes: both (kDkdvParts 1), or one of them.
enum class DkdvOutputs { kBoth, kDv, kDk };

// One dK/dV block of kv tile `kv_tile`: kOutputs says which of dK and dV it computes (and so
// whether it needs V, dP^T and dS^T at all).
template <class Config, class Modifier, DkdvOutputs kOutputs>
__device__ __forceinline__ void backward_dkdv_mma_part(const BackwardParams& bp, int kv_tile) {
  using Tag = typename Config::Tag;
  constexpr int kThreads = Config::kThreads;
  constexpr int kTilesQ = Config::kBlockQ / 8;  // 8-column tiles of S^T (query columns)
  constexpr bool kWantDv = kOutputs != DkdvOutputs::kDk;
  constexpr bool kWantDk = kOutputs != DkdvOutputs::kDv;
  const ForwardParams& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char shared[];

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group = lane / 4;
  const int quad_lane = lane % 4;
  const int head_kv = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p, batch);
  const int kv_start = kv_tile * Config::kBlockKv;
  if (kv_start >= span.kv_len) return;

  const unsigned k_tile = shared_address(shared);
  const unsigned v_tile = k_tile + Config::kTileQkBytes;
  const unsigned q_tiles = v_tile + Config::kTileVBytes;
  const unsigned do_tiles = q_tiles + Config::kStages * Config::kTileQkBytes;
  const unsigned row_tiles = do_tiles + Config::kStages * Config::kTileVBytes;
  const float* row_floats = reinterpret_cast<const float*>(
      shared + Config::kTileQkBytes + Config::kTileVBytes +
      Config::kStages * (Config::kTileQkBytes + Config::kTileVBytes));

  load_tile_async<64, Config::kChunksQk, Config::kLoadedChunksQk, kThreads>(
      k_tile, view_row<const unsigned short>(p.k, batch, span.kv_offset + kv_start, head_kv),
      p.k.token_stride, span.kv_len - kv_start, Config::kRealChunksQk, thread);
  if constexpr (kWantDk) {  // dP^T = V dO^T
    load_tile_async<64, Config::kChunksV, Config::kLoadedChunksV, kThreads>(
        v_tile, view_row<const unsigned short>(p.v, batch, span.kv_offset + kv_start, head_kv),
        p.v.token_stride, span.kv_len - kv_start, Config::kRealChunksV, thread);
  }
  commit_copies();

  // The q blocks visiting this tile, without those past this sequence's queries (thd).
  int begin = bp.kv_tile_offsets[kv_tile];
  int end = bp.kv_tile_offsets[kv_tile + 1];
  while (end > begin && (bp.kv_tile_entries[end - 1] >> 1) * Config::kBlockQ >= span.q_len) --end;
  const int per_head = end - begin;
  const int total = per_head * p.heads_per_kv;

  auto load_queries = [&](int iteration, int stage) {
    const int head = head_kv * p.heads_per_kv + iteration / per_head;
    const int q_start = (bp.kv_tile_entries[begin + iteration % per_head] >> 1) * Config::kBlockQ;
    const int rows_valid = span.q_len - q_start;
    load_tile_async<64, Config::kChunksQk, Config::kLoadedChunksQk, kThreads>(
        q_tiles + stage * Config::kTileQkBytes,
        view_row<const unsigned short>(p.q, batch, span.q_offset + q_start, head), p.q.token_stride,
        rows_valid, Config::kRealChunksQk, thread);
    load_tile_async<64, Config::kChunksV, Config::kLoadedChunksV, kThreads>(
        do_tiles + stage * Config::kTileVBytes,
        view_row<const unsigned short>(bp.dout, batch, span.q_offset + q_start, head),
        bp.dout.token_stride, rows_valid, Config::kRealChunksV, thread);
    const int row = thread % 64;
    const bool lse = thread < 64;
    const float* source = lse ? lse2_address(bp, batch, head, span.q_offset + q_start)
                              : delta_address(bp, batch, head, span.q_offset + q_start);
    stage_row_float(row_tiles + stage * Config::kRowStageBytes + thread * sizeof(float),
                    source + row, row < rows_valid, lse ? positive_infinity() : 0.0f);
  };
  if (total > 0) load_queries(0, 0);
  commit_copies();

  // (one tile where unused: no array is empty)
  float dk[kWantDk ? Config::kTilesQk : 1][4];
  float dv[kWantDv ? Config::kTilesV : 1][4];
  zero_accumulators(dk);
  zero_accumulators(dv);

  // ldmatrix lane addresses: K / V rows of this warp as A; Q / dO rows as n-major B (S^T, dP^T);
  // Q / dO rows as k-major B (dK, dV).
  const LaneOffsets<Config::kChunksQk> k_a(warp * 16 + lane % 16, lane / 16);
  const LaneOffsets<Config::kChunksV> v_a(warp * 16 + lane % 16, lane / 16);
  const LaneOffsets<Config::kChunksQk> q_n((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const LaneOffsets<Config::kChunksV> do_n((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const LaneOffsets<Config::kChunksQk> q_k(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  const LaneOffsets<Config::kChunksV> do_k(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

  int kv_row[2];  // this thread's keys (accumulator rows), clamped into the sequence
  kv_row[0] = kv_start + warp * 16 + group;
  kv_row[1] = kv_row[0] + 8;
  const bool kv_boundary = kv_start + Config::kBlockKv > span.kv_len;

  int prepared_head = -1;
  typename Modifier::Invariants invariants{};
  for (int iteration = 0; iteration < total; ++iteration) {
    const int stage = iteration % Config::kStages;
    wait_copies<0>();
    __syncthreads();  // this iteration's Q/dO visible; the other stage is no longer read
    if (iteration + 1 < total) load_queries(iteration + 1, (iteration + 1) % Config::kStages);
    commit_copies();

    const int head = head_kv * p.heads_per_kv + iteration / per_head;
    const int entry = bp.kv_tile_entries[begin + iteration % per_head];
    const int q_start = (entry >> 1) * Config::kBlockQ;
    const Coordinates at{batch, head, span.q_len, span.kv_len};
    if (head != prepared_head) {
      invariants = Modifier::prepare(p, at);
      prepared_head = head;
    }
    const unsigned q_tile = q_tiles + stage * Config::kTileQkBytes;
    const unsigned do_tile = do_tiles + stage * Config::kTileVBytes;
    const float* lse2_stage = row_floats + stage * 2 * 64;
    const float* delta_stage = lse2_stage + 64;

    // S^T = K Q^T and dP^T = V dO^T: 16 keys x 64 queries per warp.
    float st[kTilesQ][4];
    product_a_bt<Tag, Config::kStepsQk>(st, k_tile, k_a, q_tile, q_n);
    float dpt[kTilesQ][4];
    if constexpr (kWantDk) product_a_bt<Tag, Config::kStepsV>(dpt, v_tile, v_a, do_tile, do_n);

    // Element pipeline: st becomes P^T, dpt becomes dS^T.
    const bool q_boundary = q_start + Config::kBlockQ > span.q_len;
    dkdv_elements<Modifier, kWantDk>(st, dpt, p, invariants, at, span, kv_row, q_start,
                                     entry_is_mixed(entry) || kv_boundary || q_boundary, lse2_stage,
                                     delta_stage, quad_lane);

    // dV += P^T dO and dK += dS^T Q (k = the 64 queries).
#pragma unroll
    for (int step = 0; step < Config::kBlockQ / 16; ++step) {
      if constexpr (kWantDv) {
        unsigned pa[4];
        pack_fragment<Tag>(pa, st, step);
        accumulate_a_b<Tag, Config::kStepsV>(dv, pa, do_tile, do_k, step);
      }
      if constexpr (kWantDk) {
        unsigned sa[4];
        pack_fragment<Tag>(sa, dpt, step);
        accumulate_a_b<Tag, Config::kStepsQk>(dk, sa, q_tile, q_k, step);
      }
    }
  }
  wait_copies<0>();
  __syncthreads();  // every warp is done with the stages: they now stage dK and dV

  unsigned char* dk_stage = shared + Config::kTileQkBytes + Config::kTileVBytes;
  unsigned char* dv_stage = dk_stage + Config::kStages * Config::kTileQkBytes;
  if constexpr (kWantDk) {
    stage_rows<Tag, Config::kChunksQk>(dk_stage, dk, warp * 16, group, quad_lane, p.scale);
  }
  if constexpr (kWantDv) {
    stage_rows<Tag, Config::kChunksV>(dv_stage, dv, warp * 16, group, quad_lane, 1.0f);
  }
  // The staging barrier also tells every thread whether a value is NaN or inf (a removed
  // position's 0 times a NaN or inf operand: see repair_dkdv_rows).
  bool non_finite_result = false;
  if constexpr (kWantDk) non_finite_result |= any_non_finite(dk);
  if constexpr (kWantDv) non_finite_result |= any_non_finite(dv);
  const bool flagged = barrier_any<-1>(non_finite_result, kThreads);
  const int rows_valid = span.kv_len - kv_start;
  if constexpr (kWantDk) {
    store_staged<Config::kChunksQk, Config::kRealChunksQk, kThreads>(
        dk_stage, view_row<unsigned short>(bp.dk, batch, span.kv_offset + kv_start, head_kv),
        bp.dk.token_stride, rows_valid, thread);
  }
  if constexpr (kWantDv) {
    store_staged<Config::kChunksV, Config::kRealChunksV, kThreads>(
        dv_stage, view_row<unsigned short>(bp.dv, batch, span.kv_offset + kv_start, head_kv),
        bp.dv.token_stride, rows_valid, thread);
  }
  if (flagged) {
    __syncthreads();  // the stores are visible to the warps that read them back
    repair_dkdv_rows<Tag, Modifier, Config::kHeadDimQk, Config::kHeadDimV, kWantDk, kWantDv>(
        bp, span, batch, head_kv, kv_start, Config::kBlockKv, warp, Config::kWarps);
  }
}

// The dK/dV kernel: blockIdx.x is the kv tile, or with two parts per tile, twice the tile plus
// the part (even: dV, odd: dK; the two blocks of a tile run side by side and share its loads in
// L2).
template <class Config, class Modifier>
__device__ __forceinline__ void backward_dkdv_mma(const BackwardParams& bp) {
  if constexpr (Config::kDkdvParts == 1) {
    backward_dkdv_mma_part<Config, Modifier, DkdvOutputs::kBoth>(bp, blockIdx.x);
  } else if (blockIdx.x % 2 == 0) {
    backward_dkdv_mma_part<Config, Modifier, DkdvOutputs::kDv>(bp, blockIdx.x / 2);
  } else {
    backward_dkdv_mma_part<Config, Modifier, DkdvOutputs::kDk>(bp, blockIdx.x / 2);
  }
}

// The dQ kernels' element pipeline on one warp's (16 queries x 8 kTilesKv keys) accumulator
// tiles of S and dP, straight-line (see unmasked_then_masked in backward_common.cuh). `check`:
// the tile is mixed or crosses the end of the keys or of the queries. dq_logit: one element's
// log2-domain logit (`lse2`: its row's).
template <class Modifier, bool kSmall, int kTilesKv>
__device__ __forceinline__ float dq_logit(const float (&s)[kTilesKv][4], int j, int e,
                                          const ForwardParams& p,
                                          const typename Modifier::Invariants& invariants,
                                          const Coordinates& at, const int (&query)[2], int kv,
                                          int kv_inside, float lse2, bool check) {
  float logit2 = element_logit<Modifier, false, true, kSmall>(s[j][e], p, invariants, at,
                                                              query[e / 2], kv_inside);
  if (check) {
    logit2 = backward_masked_logit<Modifier>(logit2, lse2, p, invariants, at, query[e / 2], kv);
  }
  return logit2;
}

// The dQ kernels' rows of one thread (`first_row` and first_row + 8, the accumulator layout):
// position clamped into the sequence, validity, LSE in the log2 domain and delta.
__device__ __forceinline__ void dq_rows(const BackwardParams& bp, int batch, int head,
                                        const SequenceSpan& span, int first_row, int (&query)[2],
                                        bool (&row_valid)[2], float (&lse2)[2], float (&delta)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = first_row + half * 8;
    row_valid[half] = row < span.q_len;
    query[half] = ir_min(row, span.q_len - 1);
    lse2[half] =
        row_valid[half] ? *lse2_address(bp, batch, head, span.q_offset + row) : positive_infinity();
    delta[half] = row_valid[half] ? *delta_address(bp, batch, head, span.q_offset + row) : 0.0f;
  }
}

// After the delta pass (see exact_delta_rows in backward_common.cuh): each row's P renormalised
// by its own sum (LSE += log2 sum P) and delta = sum P dP / sum P, from the quads' partial sums.
__device__ __forceinline__ void renormalise_dq_rows(const float (&row_pdp)[2],
                                                    const float (&row_p)[2],
                                                    const bool (&row_valid)[2], float (&lse2)[2],
                                                    float (&delta)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float sum_pdp = quad_sum(row_pdp[half]);
    const float sum_p = quad_sum(row_p[half]);
    if (row_valid[half] && sum_p > 0.0f) {
      lse2[half] += log2f(sum_p);
      delta[half] = sum_pdp / sum_p;
    }
  }
}

// The delta pass (tensor gradients wanted; see exact_delta_rows in backward_common.cuh): sums
// P dP and P per row.
template <class Modifier, bool kSmall, int kTilesKv>
__device__ __forceinline__ void dq_delta_elements_with(
    const float (&s)[kTilesKv][4], const float (&dp)[kTilesKv][4], const ForwardParams& p,
    const typename Modifier::Invariants& invariants, const Coordinates& at,
    const SequenceSpan& span, const int (&query)[2], const float (&lse2)[2], int kv_start,
    bool check, int quad_lane, float (&row_pdp)[2], float (&row_p)[2]) {
#pragma unroll
  for (int j = 0; j < kTilesKv; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int kv = kv_start + j * 8 + 2 * quad_lane + e % 2;
      const float probability = probability_log2(
          dq_logit<Modifier, kSmall>(s, j, e, p, invariants, at, query, kv,
                                     ir_min(kv, span.kv_len - 1), lse2[e / 2], check),
          lse2[e / 2]);
      // P 0: a removed position, whose dP may be NaN (a NaN or inf V or dO it does not keep).
      row_pdp[e / 2] += probability != 0.0f ? probability * dp[j][e] : 0.0f;
      row_p[e / 2] += probability;
    }
  }
}
// With the small-tanh functions on an unmasked tile that admits them (as dkdv_elements).
template <class Modifier, int kTilesKv>
__device__ __forceinline__ void dq_delta_elements(
    const float (&s)[kTilesKv][4], const float (&dp)[kTilesKv][4], const ForwardParams& p,
    const typename Modifier::Invariants& invariants, const Coordinates& at,
    const SequenceSpan& span, const int (&query)[2], const float (&lse2)[2], int kv_start,
    bool check, int quad_lane, float (&row_pdp)[2], float (&row_p)[2]) {
  if constexpr (Modifier::kSmallTanh) {
    if (!check && small_tanh_tile<Modifier, kTilesKv * 4>(&s[0][0], invariants, p)) {
      dq_delta_elements_with<Modifier, true>(s, dp, p, invariants, at, span, query, lse2, kv_start,
                                             false, quad_lane, row_pdp, row_p);
      return;
    }
  }
  dq_delta_elements_with<Modifier, false>(s, dp, p, invariants, at, span, query, lse2, kv_start,
                                          check, quad_lane, row_pdp, row_p);
}

// The gradient pass: dp becomes dS; with kScatter, each element also adds its tensor gradients
// (a constant in each call, so no branch on it inside the element loop).
template <class Modifier, bool kScatter, bool kSmall, int kTilesKv>
__device__ __forceinline__ void dq_gradient_elements_with(
    const float (&s)[kTilesKv][4], float (&dp)[kTilesKv][4], const BackwardParams& bp,
    const typename Modifier::Invariants& invariants, const Coordinates& at,
    const SequenceSpan& span, const int (&query)[2], const float (&lse2)[2],
    const float (&delta)[2], int kv_start, bool check, int quad_lane,
    GradSum (&local)[Modifier::kLocalGradSlots]) {
  const ForwardParams& p = bp.fwd;
#pragma unroll
  for (int j = 0; j < kTilesKv; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int half = e / 2;
      const int kv = kv_start + j * 8 + 2 * quad_lane + e % 2;
      const int kv_inside = ir_min(kv, span.kv_len - 1);
      const float logit2 = dq_logit<Modifier, kSmall>(s, j, e, p, invariants, at, query, kv,
                                                      kv_inside, lse2[half], check);
      const float probability = probability_log2(logit2, lse2[half]);
      const float dlogit = probability * (dp[j][e] - delta[half]);
      const float dscore = score_gradient_from_dot<Modifier, kSmall>(
          dlogit, invariants, p, at, s[j][e], query[half], kv_inside);
      // A removed position adds nothing, whatever its dP (a NaN or inf V or dO it does not keep)
      // or its row's LSE (NaN) hold; dS and dQ get that from repair_dq_rows.
      if (Modifier::kHasTensorGrads && kScatter && dlogit != 0.0f && probability != 0.0f &&
          logit2 != negative_infinity()) {
        Modifier::tensor_grads(invariants, bp, at, s[j][e] * p.scale, query[half], kv_inside,
                               dlogit, local);
      }
      dp[j][e] = Modifier::kBoundedDerivative || dlogit != 0.0f ? dscore : 0.0f;
    }
  }
}
// With the small-tanh functions on an unmasked tile that admits them (as dkdv_elements).
template <class Modifier, bool kScatter, int kTilesKv>
__device__ __forceinline__ void dq_gradient_elements(
    const float (&s)[kTilesKv][4], float (&dp)[kTilesKv][4], const BackwardParams& bp,
    const typename Modifier::Invariants& invariants, const Coordinates& at,
    const SequenceSpan& span, const int (&query)[2], const float (&lse2)[2],
    const float (&delta)[2], int kv_start, bool check, int quad_lane,
    GradSum (&local)[Modifier::kLocalGradSlots]) {
  if constexpr (Modifier::kSmallTanh) {
    if (!check && small_tanh_tile<Modifier, kTilesKv * 4>(&s[0][0], invariants, bp.fwd)) {
      dq_gradient_elements_with<Modifier, kScatter, true>(
          s, dp, bp, invariants, at, span, query, lse2, delta, kv_start, false, quad_lane, local);
      return;
    }
  }
  dq_gradient_elements_with<Modifier, kScatter, false>(s, dp, bp, invariants, at, span, query, lse2,
                                                       delta, kv_start, check, quad_lane, local);
}

template <class Config, class Modifier>
__device__ __forceinline__ void backward_dq_mma(const BackwardParams& bp) {
  using Tag = typename Config::Tag;
  constexpr int kThreads = Config::kThreads;
  constexpr int kTilesKv = Config::kBlockKv / 8;  // 8-column tiles of S (key columns)
  const ForwardParams& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char shared[];

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group = lane / 4;
  const int quad_lane = lane % 4;
  const int q_block = gridDim.x - 1 - blockIdx.x;  // the longest lists (causal) start first
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p, batch);
  const int q_start = q_block * Config::kBlockQ;
  if (q_start >= span.q_len) return;
  const int head_kv = head / p.heads_per_kv;
  const Coordinates at{batch, head, span.q_len, span.kv_len};

  const unsigned q_tile = shared_address(shared);
  const unsigned do_tile = q_tile + Config::kTileQkBytes;
  const unsigned k_tiles = do_tile + Config::kTileVBytes;
  const unsigned v_tiles = k_tiles + Config::kStages * Config::kTileQkBytes;
  const unsigned short* k_source =
      view_row<const unsigned short>(p.k, batch, span.kv_offset, head_kv);
  const unsigned short* v_source =
      view_row<const unsigned short>(p.v, batch, span.kv_offset, head_kv);

  const EntryRange entries = visited_tiles(p, q_start, Config::kBlockKv, span.kv_len);
  const int q_rows_valid = span.q_len - q_start;
  const bool q_boundary = q_rows_valid < Config::kBlockQ;  // every tile masks the padding rows
  load_tile_async<64, Config::kChunksQk, Config::kLoadedChunksQk, kThreads>(
      q_tile, view_row<const unsigned short>(p.q, batch, span.q_offset + q_start, head),
      p.q.token_stride, q_rows_valid, Config::kRealChunksQk, thread);
  load_tile_async<64, Config::kChunksV, Config::kLoadedChunksV, kThreads>(
      do_tile, view_row<const unsigned short>(bp.dout, batch, span.q_offset + q_start, head),
      bp.dout.token_stride, q_rows_valid, Config::kRealChunksV, thread);
  commit_copies();

  auto load_keys_and_values = [&](int entry_index, int stage) {
    const int kv_start = entry_kv_tile(p.tile_entries[entry_index]) * Config::kBlockKv;
    const int rows_valid = span.kv_len - kv_start;
    load_tile_async<64, Config::kChunksQk, Config::kLoadedChunksQk, kThreads>(
        k_tiles + stage * Config::kTileQkBytes, k_source + kv_start * p.k.token_stride,
        p.k.token_stride, rows_valid, Config::kRealChunksQk, thread);
    load_tile_async<64, Config::kChunksV, Config::kLoadedChunksV, kThreads>(
        v_tiles + stage * Config::kTileVBytes, v_source + kv_start * p.v.token_stride,
        p.v.token_stride, rows_valid, Config::kRealChunksV, thread);
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

  const LaneOffsets<Config::kChunksQk> q_a(warp * 16 + lane % 16, lane / 16);
  const LaneOffsets<Config::kChunksV> do_a(warp * 16 + lane % 16, lane / 16);
  const LaneOffsets<Config::kChunksQk> k_n((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const LaneOffsets<Config::kChunksV> v_n((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const LaneOffsets<Config::kChunksQk> k_k(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

  // When tensor gradients are wanted, a first pass recomputes delta as rowsum(P * dP) and
  // renormalises P by its own row sum (see exact_delta_rows in backward_common.cuh); the second
  // pass computes the gradients.
  const bool tensor_grads = Modifier::kHasTensorGrads && bp.tensor_grads_wanted != 0;
  const int first_pass = tensor_grads ? 0 : 1;
  float row_pdp[2] = {0.0f, 0.0f};
  float row_p[2] = {0.0f, 0.0f};
  for (int pass = first_pass; pass < 2; ++pass) {
    const bool delta_pass = pass == 0;
    if (pass == 1 && first_pass == 0) {
      wait_copies<0>();
      __syncthreads();  // every warp is done with the last K/V stage of the first pass
      renormalise_dq_rows(row_pdp, row_p, row_valid, lse2, delta);
      if (entries.begin < entries.end) load_keys_and_values(entries.begin, 0);
      commit_copies();
    }
    for (int entry_index = entries.begin; entry_index < entries.end; ++entry_index) {
      const int iteration = entry_index - entries.begin;
      const int stage = iteration % Config::kStages;
      wait_copies<0>();
      __syncthreads();  // tile `iteration` visible; the other stage is no longer read
      if (entry_index + 1 < entries.end) {
        load_keys_and_values(entry_index + 1, (iteration + 1) % Config::kStages);
      }
      commit_copies();
      const unsigned k_tile = k_tiles + stage * Config::kTileQkBytes;
      const unsigned v_tile = v_tiles + stage * Config::kTileVBytes;
      const int entry = p.tile_entries[entry_index];
      const int kv_start = entry_kv_tile(entry) * Config::kBlockKv;

      // S = Q K^T and dP = dO V^T: 16 queries x 64 keys per warp.
      float s[kTilesKv][4];
      product_a_bt<Tag, Config::kStepsQk>(s, q_tile, q_a, k_tile, k_n);
      float dp[kTilesKv][4];
      product_a_bt<Tag, Config::kStepsV>(dp, do_tile, do_a, v_tile, v_n);

      const bool check =
          entry_is_mixed(entry) || kv_start + Config::kBlockKv > span.kv_len || q_boundary;
      // The pass (exact delta or gradients) and whether tensor gradients are scattered are
      // decided per tile, outside the element loop: a branch per element would split the loop's
      // straight-line code (unmasked_then_masked).
      if (delta_pass) {
        dq_delta_elements<Modifier>(s, dp, p, invariants, at, span, query, lse2, kv_start, check,
                                    quad_lane, row_pdp, row_p);
        continue;
      }
      if (tensor_grads) {
        dq_gradient_elements<Modifier, true>(s, dp, bp, invariants, at, span, query, lse2, delta,
                                             kv_start, check, quad_lane, local);
      } else {
        dq_gradient_elements<Modifier, false>(s, dp, bp, invariants, at, span, query, lse2, delta,
                                              kv_start, check, quad_lane, local);
      }

      // dQ += dS K (k = the 64 keys).
#pragma unroll
      for (int step = 0; step < Config::kBlockKv / 16; ++step) {
        unsigned sa[4];
        pack_fragment<Tag>(sa, dp, step);
        accumulate_a_b<Tag, Config::kStepsQk>(dq, sa, k_tile, k_k, step);
      }
    }
  }  // passes
  if constexpr (Modifier::kHasTensorGrads) {
    if (tensor_grads) Modifier::flush_tensor_grads(invariants, bp, at, local);
  }
  wait_copies<0>();
  __syncthreads();  // every warp is done with Q and K: the K stages now stage dQ

  unsigned char* dq_stage = shared + Config::kTileQkBytes + Config::kTileVBytes;
  stage_rows<Tag, Config::kChunksQk>(dq_stage, dq, warp * 16, group, quad_lane, p.scale);
  const bool flagged = barrier_any<-1>(any_non_finite(dq), kThreads);  // see repair_dq_rows
  store_staged<Config::kChunksQk, Config::kRealChunksQk, kThreads>(
      dq_stage, view_row<unsigned short>(bp.dq, batch, span.q_offset + q_start, head),
      bp.dq.token_stride, q_rows_valid, thread);
  if (flagged) {
    __syncthreads();  // the stores are visible to the warps that read them back
    repair_dq_rows<Tag, Modifier, Config::kHeadDimQk, Config::kHeadDimV>(
        bp, span, batch, head, q_start, Config::kBlockQ, warp, Config::kWarps);
  }
}

}  // namespace flexattn_kernels
