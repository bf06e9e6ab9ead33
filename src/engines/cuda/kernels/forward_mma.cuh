// Flash-attention-2 forward on tensor cores (bf16/fp16 storage, fp32 accumulation).
//
// One thread block computes kBlockM query rows of one (batch, head). Each warp owns
// kTilesPerWarp * 16 rows. Q stays in shared memory; K and V tiles of kBlockN keys stream through
// kStages shared-memory buffers filled by cp.async, so the copy of tile j+1 overlaps the math of
// tile j. Per kv tile:
//   S = Q K^T                 (ldmatrix + mma, fp32 accumulators in registers)
//   S = logits(S)             (scale, generated score_mod, generated mask on mixed tiles, bounds)
//   online softmax in exp2 form (row max and sum in registers, the old O rescaled)
//   O += P V                  (P re-packed from the S accumulators, V through ldmatrix.trans)
// The tile list (which kv tiles to visit, which need the mask) comes from the host's interval
// analysis of the mask; a tile absent from it is never loaded.
#pragma once

#include "forward_common.cuh"
#include "tile_ops.cuh"

namespace flexattn_kernels {

template <class ElementTag, int kHeadDimQk, int kHeadDimV, int kPaddedQk, int kPaddedV,
          int kTilesPerWarp_, int kWarps_, int kBlockN_, int kStages_, int kMinBlocks_>
struct MmaConfig {
  using Tag = ElementTag;
  static constexpr int kDimQk = kHeadDimQk;  // the real head dims (the padded ones: kPadded*)
  static constexpr int kDimV = kHeadDimV;
  static constexpr int kTilesPerWarp = kTilesPerWarp_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kRowsPerWarp = 16 * kTilesPerWarp;
  static constexpr int kBlockM = kRowsPerWarp * kWarps;
  // Shared-memory rows hold the padded head dim (a multiple of 64: 8 swizzled 16-byte chunks).
  static constexpr int kChunksQk = kPaddedQk / kChunkElements;
  static constexpr int kChunksV = kPaddedV / kChunkElements;
  // Real data, in chunks; and the chunks the mma steps read (whole 16-column steps).
  static constexpr int kRealChunksQk = kHeadDimQk / kChunkElements;
  static constexpr int kRealChunksV = kHeadDimV / kChunkElements;
  static constexpr int kStepsQk = (kHeadDimQk + 15) / 16;  // k-steps of Q K^T
  static constexpr int kStepsV = (kHeadDimV + 15) / 16;    // 16-column steps of O
  static constexpr int kLoadedChunksQk = 2 * kStepsQk;
  static constexpr int kLoadedChunksV = 2 * kStepsV;
  static constexpr int kOutputTiles = 2 * kStepsV;  // 8-column accumulator tiles of O
  static constexpr int kScoreTiles = kBlockN / 8;   // 8-column accumulator tiles of S
  static constexpr int kStagingChunks = kChunksQk > kChunksV ? kChunksQk : kChunksV;
  static constexpr int kQBytes = kBlockM * kStagingChunks * kChunkBytes;  // Q, then O staging
  static constexpr int kKBytes = kBlockN * kChunksQk * kChunkBytes;
  static constexpr int kVBytes = kBlockN * kChunksV * kChunkBytes;
  static constexpr int kSharedBytes = kQBytes + kStages * (kKBytes + kVBytes);

  static_assert(kHeadDimQk % kChunkElements == 0 && kHeadDimV % kChunkElements == 0,
                "head dims of the tensor-core kernel are multiples of 8");
  static_assert(kPaddedQk % 64 == 0 && kPaddedV % 64 == 0, "padded dims are multiples of 64");
  static_assert(kBlockN % 16 == 0, "kv tiles are whole mma k-steps");
  static_assert(kStages >= 2, "at least double buffering");
};

struct alignas(16) SharedChunk {
  unsigned words[4];
};

// Two 8-column chunks (`chunk`, `chunk + 1`) of the staged tile in this warp's 16 rows from
// `row0`, in the accumulator layout, with one ldmatrix.x4: pair[half + 2 c] holds this thread's
// two columns of chunk `chunk + c` in its row group + 8 half. Lane l gives the address of row
// l % 8 of matrix l / 8 (rows 128 bytes apart in a panel, 16-byte chunks at chunk ^ (row % 8)).
__device__ __forceinline__ void staged_pairs(const StagedTile& tile, int row0, int chunk,
                                             unsigned (&pair)[4]) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int matrix = lane / 8;
  const int row = row0 + (matrix % 2) * 8 + lane % 8;
  const int c = chunk + matrix / 2;
  const int offset = (c / 8) * tile.panel_bytes + row * 128 + ((c % 8) ^ (row % 8)) * 16;
  load_matrix_x4(pair, tile.address + static_cast<unsigned>(offset));
}

// Scale, modify, mask: the S accumulators become log2-domain logits divided by
// Modifier::kForwardToLog2 (score_mod_forward; kSmall: with the modifier's small-tanh functions,
// see compute_logits).
template <class Modifier, bool kCheck, bool kSmall, int kTiles, int kScoreTiles>
__device__ __forceinline__ void compute_logits_with(float (&score)[kTiles][kScoreTiles][4],
                                                    const ForwardParams& p,
                                                    const typename Modifier::Invariants& invariants,
                                                    const Coordinates& at,
                                                    const int (&query)[kTiles][2], int kv_first,
                                                    const StagedTile* staged) {
  // The staged tile's values of this thread's columns (8 j + 2 (lane % 4) and the next, from the
  // tile's first key: kv_first is that key plus 2 (lane % 4)), two 16-bit values per row half.
  // The unclamped rows and columns: past the queries and keys the tile holds zeros, and those
  // scores are masked or not stored.
  static_assert(kScoreTiles % 2 == 0, "staged reads take 16 columns at a time");
  unsigned pair[kTiles][kScoreTiles][2];
  if (staged != nullptr) {  // known at compile time once inlined
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
      for (int j = 0; j < kScoreTiles; j += 2) {
        unsigned four[4];
        staged_pairs(*staged, staged->warp_row + 16 * i, j, four);
        pair[i][j][0] = four[0];
        pair[i][j][1] = four[1];
        pair[i][j + 1][0] = four[2];
        pair[i][j + 1][1] = four[3];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int j = 0; j < kScoreTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kv = kv_first + j * 8 + e % 2;
        if (staged != nullptr) {
          const unsigned bits = pair[i][j][e / 2];
          const StagedElement element{
              static_cast<unsigned short>(e % 2 == 0 ? bits & 0xffffu : bits >> 16)};
          score[i][j][e] = element_logit<Modifier, kCheck, true, kSmall, true>(
              score[i][j][e], p, invariants, at, query[i][e / 2], kv, &element);
        } else {
          score[i][j][e] = element_logit<Modifier, kCheck, true, kSmall, true>(
              score[i][j][e], p, invariants, at, query[i][e / 2], kv);
        }
      }
    }
  }
}

// The same, on a tile whose scores keep every tanh argument of the modifier small
// (small_tanh_tile) with the small-tanh functions: softcap's scores then cost one MUFU
// instruction (the softmax's exp2) instead of three. Only where it pays for its code (each copy
// of the element code adds to the NVRTC compile): `try_small` (a constant at each call: the
// main loop, not the first tile on its own) and tiles that need no mask (kCheck false; mixed and
// boundary tiles are few).
template <class Modifier, bool kCheck, int kTiles, int kScoreTiles>
__device__ __forceinline__ void compute_logits(float (&score)[kTiles][kScoreTiles][4],
                                               const ForwardParams& p,
                                               const typename Modifier::Invariants& invariants,
                                               const Coordinates& at, const int (&query)[kTiles][2],
                                               int kv_first, const StagedTile* staged = nullptr,
                                               bool try_small = true) {
  static_assert(!Modifier::kSmallTanh || Modifier::kForwardToLog2 == 1.0f,
                "the small-tanh functions are in log2 units, as score_mod_forward must be");
  if constexpr (Modifier::kSmallTanh && !kCheck) {
    if (try_small &&
        small_tanh_tile<Modifier, kTiles * kScoreTiles * 4>(&score[0][0][0], invariants, p)) {
      compute_logits_with<Modifier, kCheck, true>(score, p, invariants, at, query, kv_first,
                                                  staged);
      return;
    }
  }
  compute_logits_with<Modifier, kCheck, false>(score, p, invariants, at, query, kv_first, staged);
}

// How far (log2 units) a tile's max may pass the row's reference max before the reference moves:
// below it, the probabilities exp2(S - reference) stay under 2^kMaxSlack (exact in fp32, and as
// precise in bf16/fp16, whose relative spacing does not depend on the magnitude), and neither O
// nor the row sum is rescaled. A running max grows on most early tiles of a row (each new record,
// by a little), which made most tiles rescale O; with the slack, few do.
constexpr float kMaxSlack = 8.0f;

// The max of one row half's logits in a tile, across the quad of threads that hold the row.
template <int kScoreTiles>
__device__ __forceinline__ float row_tile_max(const float (&score)[kScoreTiles][4], int half) {
  float tile_max = negative_infinity();
#pragma unroll
  for (int j = 0; j < kScoreTiles; ++j) {
    tile_max = fmaxf(tile_max, fmaxf(score[j][2 * half], score[j][2 * half + 1]));
  }
  return quad_max(tile_max);
}

// P = exp2(S * to_log2 - subtract) in place of one row half's logits; returns `sum` plus them.
template <int kScoreTiles>
__device__ __forceinline__ float exponentiate_row(float (&score)[kScoreTiles][4], int half,
                                                  float subtract, float to_log2, float sum) {
#pragma unroll
  for (int j = 0; j < kScoreTiles; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float probability = fast_exp2(fmaf(score[j][2 * half + c], to_log2, -subtract));
      score[j][2 * half + c] = probability;
      sum += probability;
    }
  }
  return sum;
}

// Online softmax of one kv tile in exp2 form, first half: the row's reference max (the max of
// its logits so far, or up to kMaxSlack below it), P = exp2(S - reference) in place of the
// logits, the row sums, and in `correction` the factor that rescales what was accumulated under
// the old reference. Returns whether a row of this thread changed its reference. The logits and
// row_max are in log2 units times 1 / to_log2 (Modifier::kForwardToLog2: 1, or log2 e for a
// natural-units score_mod_forward; a constant, so 1 costs nothing).
template <int kTiles, int kScoreTiles>
__device__ __forceinline__ bool softmax_probabilities(float (&score)[kTiles][kScoreTiles][4],
                                                      float (&row_max)[kTiles][2],
                                                      float (&row_sum)[kTiles][2],
                                                      float (&correction)[kTiles][2],
                                                      float to_log2) {
  bool max_changed = false;
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // -inf + kMaxSlack is -inf: a row's first finite logits set its reference.
      const float seen = row_tile_max(score[i], half);
      const float new_max = seen > row_max[i][half] + kMaxSlack / to_log2 ? seen : row_max[i][half];
      const float subtract = safe_max(new_max) * to_log2;
      correction[i][half] = fast_exp2(row_max[i][half] * to_log2 - subtract);
      max_changed = max_changed || new_max != row_max[i][half];
      row_max[i][half] = new_max;
      row_sum[i][half] = exponentiate_row(score[i], half, subtract, to_log2,
                                          row_sum[i][half] * correction[i][half]);
    }
  }
  return max_changed;
}

// Second half: the old O rescaled, skipped when no row of the warp changed its max.
template <int kTiles, int kOutputTiles>
__device__ __forceinline__ void rescale_output(float (&output)[kTiles][kOutputTiles][4],
                                               const float (&correction)[kTiles][2],
                                               bool max_changed) {
  if (__any_sync(0xffffffffu, max_changed)) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
      for (int j = 0; j < kOutputTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) output[i][j][e] *= correction[i][e / 2];
      }
    }
  }
}

// The row maxima in log2 units, for the epilogue's LSE (softmax_probabilities' `to_log2`).
template <int kTiles>
__device__ __forceinline__ void to_log2_units(float (&row_max)[kTiles][2], float to_log2) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    row_max[i][0] *= to_log2;  // -inf stays -inf
    row_max[i][1] *= to_log2;
  }
}

// The softmax with a reference fixed after a row's first tile (Modifier::kStaticReference):
// when the code generator (codegen.cpp, static_reference_members) knows every logit lies in
// [lo, hi] with hi - lo at most 96 log2 units (a softcap: 30 tanh(score / 30) lies in [-30, 30])
// and P's storage type has fp32's exponent range (bf16, fp32), a row's first tile sets its
// reference to its max logit and no later tile moves it: P = exp2(S - reference) stays a normal
// number in [2^-96, 2^96] (a row sum of up to 2^31 such terms stays finite; bf16's relative
// spacing does not depend on the magnitude, so P is as precise as under a running max), and the
// later tiles need no row max, no cross-lane max and no rescaling of O. The first tile's largest
// P is exactly 1, as under a running max, so a row whose keys all lie in its first tile (a short
// row, a single key) gets its dominant term without a bf16 rounding its fp32 row sum does not
// share. (A reference fixed at hi made such rows up to 2^-8 off: ten small softcap conformance
// cases failed on the H200, 2026-12-03. A reference raised to at least hi - 64 did the same to
// rows whose every logit lies below it: a one-key softcap row with score -20 failed its backward
// on the H100, 2026-12-06.) A row whose first tile keeps no key takes hi - kStaticHeadroom.
// Nothing is ever rescaled: O and the row sum are 0 before the first tile, and the reference
// does not move after it.
constexpr float kStaticHeadroom = 64.0f;

template <bool kFirst, int kTiles, int kScoreTiles>
__device__ __forceinline__ void bounded_softmax_probabilities(
    float (&score)[kTiles][kScoreTiles][4], float (&row_max)[kTiles][2],
    float (&row_sum)[kTiles][2], float bound_log2, float to_log2) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if constexpr (kFirst) {
        const float tile_max = row_tile_max(score[i], half);
        row_max[i][half] = tile_max == negative_infinity()
                               ? (bound_log2 - kStaticHeadroom) / to_log2
                               : tile_max;
      }
      row_sum[i][half] =
          exponentiate_row(score[i], half, row_max[i][half] * to_log2, to_log2, row_sum[i][half]);
    }
  }
}

// The same for a Modifier with kStaticReference; `first`: the row's first tile.
template <class Modifier, int kTiles, int kScoreTiles>
__device__ __forceinline__ void fixed_reference_probabilities(
    float (&score)[kTiles][kScoreTiles][4], float (&row_max)[kTiles][2],
    float (&row_sum)[kTiles][2], bool first) {
  constexpr float kBound = Modifier::kStaticReferenceLog2;
  constexpr float kToLog2 = Modifier::kForwardToLog2;
  if (first) {
    bounded_softmax_probabilities<true>(score, row_max, row_sum, kBound, kToLog2);
  } else {
    bounded_softmax_probabilities<false>(score, row_max, row_sum, kBound, kToLog2);
  }
}

// Both halves, for a kernel whose O is not in flight.
template <int kTiles, int kScoreTiles, int kOutputTiles>
__device__ __forceinline__ void online_softmax(float (&score)[kTiles][kScoreTiles][4],
                                               float (&row_max)[kTiles][2],
                                               float (&row_sum)[kTiles][2],
                                               float (&output)[kTiles][kOutputTiles][4],
                                               float to_log2) {
  float correction[kTiles][2];
  const bool max_changed = softmax_probabilities(score, row_max, row_sum, correction, to_log2);
  rescale_output(output, correction, max_changed);
}

// The block's epilogue, once every warp is done with the shared tiles: normalises O, writes the
// LSE, stages O (as the storage type) in shared memory and stores the rows inside the sequence
// with coalesced 16-byte stores. Config names the warps' rows (kRowsPerWarp, kTilesPerWarp).
// kBarrier: the named barrier of the Config::kThreads threads that run it (a block with a producer
// warpgroup), or -1 for __syncthreads. Returns whether some output value is NaN or inf, the same
// in every thread; then, after a barrier that makes the stores visible, repair_forward_rows.
template <class Config, int kBarrier = -1>
__device__ __forceinline__ bool store_output(
    const ForwardParams& p, unsigned char* shared,
    const float (&output)[Config::kTilesPerWarp][Config::kOutputTiles][4],
    const float (&row_max)[Config::kTilesPerWarp][2],
    const float (&row_sum)[Config::kTilesPerWarp][2], const SequenceSpan& span, int batch, int head,
    int q_start, int thread) {
  using Tag = typename Config::Tag;
  constexpr int kTiles = Config::kTilesPerWarp;
  constexpr int kOutputTiles = Config::kOutputTiles;
  constexpr int kBlockM = Config::kBlockM;
  constexpr int kThreads = Config::kThreads;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group = lane / 4;
  const int quad_lane = lane % 4;
  // Normalise, write the LSE, stage O (as storage type) in shared memory.
  bool non_finite_output = false;
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const RowResult result = finish_row_log2(row_max[i][half], quad_sum(row_sum[i][half]));
      const int row = warp * Config::kRowsPerWarp + i * 16 + group + half * 8;
      if (p.lse != nullptr && quad_lane == 0 && q_start + row < span.q_len) {
        *lse_address(p, batch, head, span.q_offset + q_start + row) = result.lse;
      }
#pragma unroll
      for (int j = 0; j < kOutputTiles; ++j) {
        const float low = output[i][j][2 * half] * result.inverse_sum;
        const float high = output[i][j][2 * half + 1] * result.inverse_sum;
        non_finite_output |= non_finite(low) | non_finite(high);
        const unsigned packed = pack_pair(Tag{}, low, high);
        *reinterpret_cast<unsigned*>(shared + swizzled_offset<Config::kChunksV>(row, j) +
                                     quad_lane * sizeof(unsigned)) = packed;
      }
    }
  }
  // The staging barrier also tells every thread whether a value is NaN or inf.
  const bool flagged = barrier_any<kBarrier>(non_finite_output, kThreads);

  // Coalesced 16-byte stores of the rows inside the sequence.
  unsigned short* o_destination =
      view_row<unsigned short>(p.o, batch, span.q_offset + q_start, head);
  constexpr int kStoreChunks = kBlockM * Config::kRealChunksV;
  for (int index = thread; index < kStoreChunks; index += kThreads) {
    const int row = index / Config::kRealChunksV;
    const int chunk = index % Config::kRealChunksV;
    if (q_start + row < span.q_len) {
      *reinterpret_cast<SharedChunk*>(o_destination + row * p.o.token_stride +
                                      chunk * kChunkElements) =
          *reinterpret_cast<const SharedChunk*>(shared +
                                                swizzled_offset<Config::kChunksV>(row, chunk));
    }
  }
  // Only a flagged block waits for its stores (repair_forward_rows reads them back).
  if (flagged) barrier_any<kBarrier>(true, kThreads);
  return flagged;
}

// A thread's accumulators before the first tile: O 0, no row max or sum yet, and the positions of
// its rows (`first_row`, 8 below it, and the same 16 further per accumulator tile), clamped into
// the sequence.
template <int kTiles, int kOutputTiles>
__device__ __forceinline__ void start_rows(float (&output)[kTiles][kOutputTiles][4],
                                           float (&row_max)[kTiles][2], float (&row_sum)[kTiles][2],
                                           int (&query)[kTiles][2], int first_row, int q_len) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int j = 0; j < kOutputTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) output[i][j][e] = 0.0f;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_max[i][half] = negative_infinity();
      row_sum[i][half] = 0.0f;
      query[i][half] = ir_min(first_row + i * 16 + half * 8, q_len - 1);
    }
  }
}

template <class Config, class Modifier>
__device__ __forceinline__ void forward_mma(const ForwardParams& p) {
  using Tag = typename Config::Tag;
  constexpr int kTiles = Config::kTilesPerWarp;
  constexpr int kBlockM = Config::kBlockM;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kStages = Config::kStages;
  constexpr int kThreads = Config::kThreads;
  constexpr int kScoreTiles = Config::kScoreTiles;
  constexpr int kOutputTiles = Config::kOutputTiles;
  extern __shared__ __align__(128) unsigned char shared[];

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group = lane / 4;      // accumulator row within an 8-row half
  const int quad_lane = lane % 4;  // accumulator column pair
  // Blocks with the most kv tiles (the last rows under causal masks) start first.
  const int q_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p, batch);
  const int q_start = q_block * kBlockM;
  if (q_start >= span.q_len) return;
  const int head_kv = head / p.heads_per_kv;
  const Coordinates at{batch, head, span.q_len, span.kv_len};

  const unsigned short* q_source =
      view_row<const unsigned short>(p.q, batch, span.q_offset + q_start, head);
  const unsigned short* k_source =
      view_row<const unsigned short>(p.k, batch, span.kv_offset, head_kv);
  const unsigned short* v_source =
      view_row<const unsigned short>(p.v, batch, span.kv_offset, head_kv);
  const unsigned q_tile = shared_address(shared);                // (kBlockM, padded qk)
  const unsigned k_tiles = q_tile + Config::kQBytes;             // kStages x (kBlockN, qk)
  const unsigned v_tiles = k_tiles + kStages * Config::kKBytes;  // kStages x (kBlockN, v)

  const EntryRange entries = visited_tiles(p, q_start, kBlockN, span.kv_len);

  load_tile_async<kBlockM, Config::kChunksQk, Config::kLoadedChunksQk, kThreads>(
      q_tile, q_source, p.q.token_stride, span.q_len - q_start, Config::kRealChunksQk, thread);
  commit_copies();

  auto load_keys_and_values = [&](int entry_index, int stage) {
    const int kv_start = entry_kv_tile(p.tile_entries[entry_index]) * kBlockN;
    const int rows_valid = span.kv_len - kv_start;
    load_tile_async<kBlockN, Config::kChunksQk, Config::kLoadedChunksQk, kThreads>(
        k_tiles + stage * Config::kKBytes, k_source + kv_start * p.k.token_stride, p.k.token_stride,
        rows_valid, Config::kRealChunksQk, thread);
    load_tile_async<kBlockN, Config::kChunksV, Config::kLoadedChunksV, kThreads>(
        v_tiles + stage * Config::kVBytes, v_source + kv_start * p.v.token_stride, p.v.token_stride,
        rows_valid, Config::kRealChunksV, thread);
  };
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) {
    if (entries.begin + stage < entries.end) load_keys_and_values(entries.begin + stage, stage);
    commit_copies();
  }

  float output[kTiles][kOutputTiles][4];  // (rows, head_dim_v) accumulators
  float row_max[kTiles][2];               // log2 domain
  float row_sum[kTiles][2];               // this thread's share of the row sum
  int query[kTiles][2];                   // the rows' positions, clamped into the sequence
  start_rows(output, row_max, row_sum, query, q_start + warp * Config::kRowsPerWarp + group,
             span.q_len);
  const typename Modifier::Invariants invariants = Modifier::prepare(p, at);
  // ldmatrix row addresses: Q rows of this warp, K rows (n-major B), V rows (k-major B).
  const LaneOffsets<Config::kChunksQk> q_lane(warp * Config::kRowsPerWarp + lane % 16, lane / 16);
  const LaneOffsets<Config::kChunksQk> k_lane((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const LaneOffsets<Config::kChunksV> v_lane(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

  for (int entry_index = entries.begin; entry_index < entries.end; ++entry_index) {
    const int iteration = entry_index - entries.begin;
    const int stage = iteration % kStages;
    wait_copies<kStages - 2>();
    __syncthreads();  // tile `iteration` visible; the buffer refilled below is no longer read
    if (entry_index + kStages - 1 < entries.end) {
      load_keys_and_values(entry_index + kStages - 1, (iteration + kStages - 1) % kStages);
    }
    commit_copies();
    const unsigned k_tile = k_tiles + stage * Config::kKBytes;
    const unsigned v_tile = v_tiles + stage * Config::kVBytes;
    const int entry = p.tile_entries[entry_index];
    const int kv_start = entry_kv_tile(entry) * kBlockN;

    // S = Q K^T: (rows, kBlockN) per warp.
    float score[kTiles][kScoreTiles][4];
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
      for (int j = 0; j < kScoreTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) score[i][j][e] = 0.0f;
      }
    }
#pragma unroll
    for (int step = 0; step < Config::kStepsQk; ++step) {
      unsigned q_fragment[kTiles][4];
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        load_matrix_x4(q_fragment[i], q_tile + q_lane.at(step, i * 16));
      }
#pragma unroll
      for (int pair = 0; pair < kScoreTiles / 2; ++pair) {
        unsigned k_fragment[4];  // b0, b1 of key tile 2*pair, then of 2*pair + 1
        load_matrix_x4(k_fragment, k_tile + k_lane.at(step, pair * 16));
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          mma_16x8x16(Tag{}, score[i][2 * pair], q_fragment[i], k_fragment[0], k_fragment[1]);
          mma_16x8x16(Tag{}, score[i][2 * pair + 1], q_fragment[i], k_fragment[2], k_fragment[3]);
        }
      }
    }

    const int kv_first = kv_start + 2 * quad_lane;
    if (entry_is_mixed(entry) || kv_start + kBlockN > span.kv_len) {
      compute_logits<Modifier, true>(score, p, invariants, at, query, kv_first);
    } else {
      compute_logits<Modifier, false>(score, p, invariants, at, query, kv_first);
    }

    if constexpr (Modifier::kStaticReference) {
      fixed_reference_probabilities<Modifier>(score, row_max, row_sum, iteration == 0);
    } else {
      online_softmax(score, row_max, row_sum, output, Modifier::kForwardToLog2);
    }

    // O += P V: the S accumulators of two adjacent key tiles form one A fragment.
#pragma unroll
    for (int step = 0; step < kBlockN / 16; ++step) {
      unsigned p_fragment[kTiles][4];
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        p_fragment[i][0] = pack_pair(Tag{}, score[i][2 * step][0], score[i][2 * step][1]);
        p_fragment[i][1] = pack_pair(Tag{}, score[i][2 * step][2], score[i][2 * step][3]);
        p_fragment[i][2] = pack_pair(Tag{}, score[i][2 * step + 1][0], score[i][2 * step + 1][1]);
        p_fragment[i][3] = pack_pair(Tag{}, score[i][2 * step + 1][2], score[i][2 * step + 1][3]);
      }
#pragma unroll
      for (int pair = 0; pair < Config::kStepsV; ++pair) {
        unsigned v_fragment[4];  // b0, b1 of value columns 16*pair..+7, then of +8..+15
        load_matrix_x4_transposed(v_fragment, v_tile + v_lane.at(pair, step * 16));
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          mma_16x8x16(Tag{}, output[i][2 * pair], p_fragment[i], v_fragment[0], v_fragment[1]);
          mma_16x8x16(Tag{}, output[i][2 * pair + 1], p_fragment[i], v_fragment[2], v_fragment[3]);
        }
      }
    }
  }
  wait_copies<0>();
  __syncthreads();  // every warp is done with Q, K and V: the Q buffer now stages O

  to_log2_units(row_max, Modifier::kForwardToLog2);
  if (store_output<Config>(p, shared, output, row_max, row_sum, span, batch, head, q_start,
                           thread)) {
    repair_forward_rows<Tag, Modifier, Config::kDimQk, Config::kDimV>(
        p, span, batch, head, q_start, Config::kBlockM, thread / kWarpSize,
        Config::kThreads / kWarpSize);
  }
}

}  // namespace flexattn_kernels
