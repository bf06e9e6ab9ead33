// The backward kernels on the fp32 units: float32 storage, and 16-bit problems the tensor-core
// backward cannot take (head dims not a multiple of 8, or above 128, up to 256). Exact fp32
// arithmetic; the probability is recomputed in the forward's exp2 domain from the stored LSE.
//
// Both kernels work on 32 x 32 tiles with 4 warps, in two phases per tile:
//   element phase: lane i owns row i of one side (a query row in dK/dV, a key in dQ) and each
//     warp owns 8 rows of the other side, so a thread computes 8 elements of S = Q K^T and
//     dP = dO V^T. Its own row is read at an odd row stride (the 32 lanes hit 32 banks), the
//     warp's 8 rows are read by every lane at once (a broadcast, as float4 when aligned).
//   accumulation phase: the warp's 8 rows of the accumulator (dK and dV, or dQ) are spread over
//     the lanes by column (lane + 32 c); the 8 x 32 element values go through a per-warp buffer
//     in shared memory and are read back as broadcasts.
// No atomics: a block owns its output rows; tensor gradients go through Modifier::tensor_grads.
#pragma once

#include "backward_common.cuh"

namespace flexattn_kernels {

// The host sizes the dynamic shared memory of both kernels as
//   4 * (2 * 32 * (dqk + dv) + 2 * 32 + 2 * 32 * 33) bytes
// (four row tiles, lse and delta, P and dS); this layout uses at most that (see the config).
__host__ __device__ constexpr int backward_simt_shared_bytes(int head_dim_qk, int head_dim_v) {
  return static_cast<int>(sizeof(float)) *
         (2 * 32 * (head_dim_qk + head_dim_v) + 2 * 32 + 2 * 32 * (32 + 1));
}

namespace simt_backward {

// A row stride whose rows start in different banks for 32 consecutive rows: any odd number of
// floats (an even head dim gets one float of padding).
__host__ __device__ constexpr int odd_stride(int head_dim) {
  return head_dim % 2 == 0 ? head_dim + 1 : head_dim;
}

// Rows [0, kRows) of a (token, d) slice of a view, as float, into a tile of row stride kStride.
// `first` is the index of element (row 0, d 0); rows at or past `rows_valid` become zeros.
template <class Tag, int kRows, int kDim, int kStride, int kThreads>
__device__ __forceinline__ void load_rows_as_float(float* tile, const SequenceView& view,
                                                   long long first, int rows_valid, int thread) {
  for (int index = thread; index < kRows * kDim; index += kThreads) {
    const int row = index / kDim;
    const int column = index % kDim;
    tile[row * kStride + column] =
        row < rows_valid ? load_as_float(Tag{}, view.data, first + row * view.token_stride + column)
                         : 0.0f;
  }
}

// sums[j] += own . rows[j] for kRows rows of stride kDim, summed in column order. `own` is read
// one float at a time (its stride is odd), `rows` (the same for the whole warp) four at a time
// when the rows are 16-byte aligned.
template <int kDim, int kRows>
__device__ __forceinline__ void dot_with_rows(const float* own, const float* rows,
                                              float (&sums)[kRows]) {
  if constexpr (kDim % 4 == 0) {
#pragma unroll 2
    for (int d = 0; d < kDim; d += 4) {
      const float own0 = own[d];
      const float own1 = own[d + 1];
      const float own2 = own[d + 2];
      const float own3 = own[d + 3];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const float4 other = *reinterpret_cast<const float4*>(rows + j * kDim + d);
        sums[j] = fmaf(own0, other.x, sums[j]);
        sums[j] = fmaf(own1, other.y, sums[j]);
        sums[j] = fmaf(own2, other.z, sums[j]);
        sums[j] = fmaf(own3, other.w, sums[j]);
      }
    }
  } else {
#pragma unroll 4
    for (int d = 0; d < kDim; ++d) {
      const float own_value = own[d];
#pragma unroll
      for (int j = 0; j < kRows; ++j) sums[j] = fmaf(own_value, rows[j * kDim + d], sums[j]);
    }
  }
}

// The 8 values a lane puts in a warp buffer (two float4 at `slot`), and reading them back.
__device__ __forceinline__ void store_eight(float* slot, const float (&values)[8]) {
  float4* row = reinterpret_cast<float4*>(slot);
  row[0] = make_float4(values[0], values[1], values[2], values[3]);
  row[1] = make_float4(values[4], values[5], values[6], values[7]);
}
__device__ __forceinline__ void load_eight(const float* slot, float (&values)[8]) {
  const float4 low = reinterpret_cast<const float4*>(slot)[0];
  const float4 high = reinterpret_cast<const float4*>(slot)[1];
  values[0] = low.x, values[1] = low.y, values[2] = low.z, values[3] = low.w;
  values[4] = high.x, values[5] = high.y, values[6] = high.z, values[7] = high.w;
}

// accumulator[j][c] += weights[j] * row[c * 32 + lane] for the lane's columns of one tile row
// (kDim columns).
template <int kDim, int kRows, int kColumns>
__device__ __forceinline__ void accumulate_row(float (&accumulator)[kRows][kColumns],
                                               const float (&weights)[kRows], const float* row,
                                               int lane) {
#pragma unroll
  for (int c = 0; c < kColumns; ++c) {
    const int column = c * kWarpSize + lane;
    if (kDim % kWarpSize == 0 || column < kDim) {
      const float value = row[column];
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        accumulator[j][c] = fmaf(weights[j], value, accumulator[j][c]);
    }
  }
}

// What one element (q, kv) contributes. An element not kept (masked, out of range, a query row
// past the sequence, or a row that kept no key) contributes nothing.
struct ElementGradient {
  float probability;
  float dlogit;  // P (dP - delta)
  float dscore;  // dlogit * d score_mod / d score (without the softmax scale)
  bool kept;
};

// `dot` is q . k, `dp` is dO . v; `lse` the row's (natural) LSE and `delta`
// rowsum(dO * O). `q` is clamped into the sequence (`row_valid` says whether it was inside);
// with kCheck, `kv` may lie past the keys and is clamped before the modifier sees it.
// `precise` (the dQ kernel when tensor gradients are wanted) computes P and dlogit in double:
// a tensor gradient sums dlogit * derivative over whole sequences, where a plain fp32
// implementation's own rounding of each P (expf, 2 ulp) and of dP - delta add up; with double
// here, only the fp32 logit, dP and delta carry rounding, and the fp32 tolerance holds (the
// thd ALiBi slopes case of the conformance matrix was 5% beyond it with expf).
template <class Modifier, bool kCheck>
__device__ __forceinline__ ElementGradient
element_gradient(float dot, float dp, float lse, float delta, bool row_valid,
                 const ForwardParams& p, const typename Modifier::Invariants& invariants,
                 const Coordinates& at, int q, int kv, bool precise = false) {
  // P = exp(logit - lse) in the natural domain with expf, as a plain fp32 implementation computes
  // it: the fp32 path's tensor gradients sum P over whole rows, where the log2 domain's extra
  // rounding (logit * log2(e)) and ex2.approx showed up beyond the fp32 tolerance.
  const float logit = element_logit<Modifier, kCheck, false>(dot, p, invariants, at, q, kv);
  ElementGradient result{0.0f, 0.0f, 0.0f, false};
  // A row with LSE -inf kept no key: every P is 0 and so is every gradient (skipping it also
  // keeps 0 * inf from producing NaN).
  if (row_valid && logit != negative_infinity() && lse != negative_infinity()) {
    result.kept = true;
    if (precise) {
      const double probability = exp(static_cast<double>(logit) - static_cast<double>(lse));
      result.probability = static_cast<float>(probability);
      result.dlogit =
          static_cast<float>(probability * (static_cast<double>(dp) - static_cast<double>(delta)));
    } else {
      result.probability = expf(logit - lse);
      result.dlogit = result.probability * (dp - delta);
    }
    const int kv_inside = kCheck ? ir_min(kv, at.kv_len - 1) : kv;
    result.dscore =
        score_gradient<Modifier>(result.dlogit, invariants, p, at, dot * p.scale, q, kv_inside);
  }
  return result;
}

// A kv-major list entry names a q block (q_block << 1 | mixed).
__device__ __forceinline__ int entry_q_block(int entry) { return entry >> 1; }

// Index of element (batch, token, head, 0) of a view.
__device__ __forceinline__ long long view_index(const SequenceView& view, int batch, int token,
                                                int head) {
  return batch * view.batch_stride + token * view.token_stride + head * view.head_stride;
}

// Writes rows first..first + kRows of `view` (head `head`, tokens from `offset`; rows at or past
// `length` are skipped) from the lane's columns of `rows`, times `scale`.
template <class Tag, int kDim, int kRows, int kColumns>
__device__ __forceinline__ void store_rows(const SequenceView& view, int batch, int offset,
                                           int head, int first, int length,
                                           const float (&rows)[kRows][kColumns], float scale,
                                           int lane) {
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    if (first + j >= length) continue;
    const long long base = view_index(view, batch, offset + first + j, head);
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = c * kWarpSize + lane;
      if (column < kDim) store_from_float(Tag{}, view.data, base + column, rows[j][c] * scale);
    }
  }
}

}  // namespace simt_backward

template <class ElementTag, int kHeadDimQk_, int kHeadDimV_, int kSharedDkdv, int kSharedDq>
struct BackwardSimtConfig {
  using Tag = ElementTag;
  static constexpr int kHeadDimQk = kHeadDimQk_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  // One lane per row of the element phase.
  static constexpr int kBlockQ = kWarpSize;
  static constexpr int kBlockKv = kWarpSize;
  static constexpr int kRowsPerWarp = kWarpSize / kWarps;  // accumulator rows a warp owns
  static constexpr int kColumnsQk = (kHeadDimQk + kWarpSize - 1) / kWarpSize;  // per lane
  static constexpr int kColumnsV = (kHeadDimV + kWarpSize - 1) / kWarpSize;
  // Row strides of the tiles whose row a lane reads alone (Q and dO in dK/dV, K and V in dQ);
  // the tiles the warp reads together keep the head dim as stride (16-byte aligned rows).
  static constexpr int kStrideQk = simt_backward::odd_stride(kHeadDimQk);
  static constexpr int kStrideV = simt_backward::odd_stride(kHeadDimV);
  // Per warp, 8 values per row of its 32 lanes: P and dS (dK/dV), dS (dQ).
  static constexpr int kWarpBufferFloats = kWarpSize * kRowsPerWarp;
  static constexpr int kTileFloats = kWarpSize * (kHeadDimQk + kHeadDimV + kStrideQk + kStrideV);
  static constexpr int kUsedDkdv =
      static_cast<int>(sizeof(float)) * (kTileFloats + kWarps * 2 * kWarpBufferFloats);
  static constexpr int kUsedDq =
      static_cast<int>(sizeof(float)) * (kTileFloats + kWarps * kWarpBufferFloats);
  static constexpr int kSharedBytesDkdv = kSharedDkdv;
  static constexpr int kSharedBytesDq = kSharedDq;

  static_assert(kHeadDimQk >= 1 && kHeadDimQk <= 256 && kHeadDimV >= 1 && kHeadDimV <= 256,
                "head dims 1..256");
  static_assert(kSharedDkdv == backward_simt_shared_bytes(kHeadDimQk, kHeadDimV),
                "the host's dK/dV shared bytes follow the interface formula");
  static_assert(kSharedDq == backward_simt_shared_bytes(kHeadDimQk, kHeadDimV),
                "the host's dQ shared bytes follow the interface formula");
  static_assert(kUsedDkdv <= kSharedDkdv && kUsedDq <= kSharedDq,
                "the layout fits the bytes the host allocates");
  static_assert(kRowsPerWarp == 8, "element values move through shared memory as two float4");
};

// dK and dV of kv tile blockIdx.x of kv head blockIdx.y, batch blockIdx.z: over the query heads
// of the group (ascending), over the q blocks of the kv-major tile list (ascending).
template <class Config, class Modifier>
__device__ __forceinline__ void backward_dkdv_simt(const BackwardParams& p) {
  using Tag = typename Config::Tag;
  using namespace simt_backward;  // the helpers above
  constexpr int kDimQk = Config::kHeadDimQk;
  constexpr int kDimV = Config::kHeadDimV;
  constexpr int kBlockQ = Config::kBlockQ;
  constexpr int kBlockKv = Config::kBlockKv;
  constexpr int kRows = Config::kRowsPerWarp;
  constexpr int kThreads = Config::kThreads;
  constexpr int kColumnsQk = Config::kColumnsQk;
  constexpr int kColumnsV = Config::kColumnsV;
  constexpr int kStrideQk = Config::kStrideQk;
  constexpr int kStrideV = Config::kStrideV;

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  extern __shared__ __align__(128) unsigned char shared[];
  float* k_tile = reinterpret_cast<float*>(shared);  // (block_kv, dqk)
  float* v_tile = k_tile + kBlockKv * kDimQk;        // (block_kv, dv)
  float* q_tile = v_tile + kBlockKv * kDimV;         // (block_q, kStrideQk)
  float* do_tile = q_tile + kBlockQ * kStrideQk;     // (block_q, kStrideV)
  float* p_buffer = do_tile + kBlockQ * kStrideV + warp * 2 * Config::kWarpBufferFloats;
  float* ds_buffer = p_buffer + Config::kWarpBufferFloats;  // both (block_q, rows_per_warp)

  const int kv_tile = blockIdx.x;
  const int head_kv = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p.fwd, batch);
  const int kv_start = kv_tile * kBlockKv;
  if (kv_start >= span.kv_len) return;  // thd: past this sequence's keys
  const int kv_rows = span.kv_len - kv_start;
  const bool kv_boundary = kv_rows < kBlockKv;

  load_rows_as_float<Tag, kBlockKv, kDimQk, kDimQk, kThreads>(
      k_tile, p.fwd.k, view_index(p.fwd.k, batch, span.kv_offset + kv_start, head_kv), kv_rows,
      thread);
  load_rows_as_float<Tag, kBlockKv, kDimV, kDimV, kThreads>(
      v_tile, p.fwd.v, view_index(p.fwd.v, batch, span.kv_offset + kv_start, head_kv), kv_rows,
      thread);

  float dk[kRows][kColumnsQk];  // rows warp * 8 + j of the tile, columns lane + 32 c
  float dv[kRows][kColumnsV];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
#pragma unroll
    for (int c = 0; c < kColumnsQk; ++c) dk[j][c] = 0.0f;
#pragma unroll
    for (int c = 0; c < kColumnsV; ++c) dv[j][c] = 0.0f;
  }

  const int entries_begin = p.kv_tile_offsets[kv_tile];
  const int entries_end = p.kv_tile_offsets[kv_tile + 1];
  const float* k_rows = k_tile + warp * kRows * kDimQk;  // (rows_per_warp, dqk)
  const float* v_rows = v_tile + warp * kRows * kDimV;   // (rows_per_warp, dv)
  const int first_kv = kv_start + warp * kRows;

  for (int group = 0; group < p.fwd.heads_per_kv; ++group) {
    const int head = head_kv * p.fwd.heads_per_kv + group;
    const Coordinates at{batch, head, span.q_len, span.kv_len};
    const typename Modifier::Invariants invariants = Modifier::prepare(p.fwd, at);
    for (int entry_index = entries_begin; entry_index < entries_end; ++entry_index) {
      const int entry = p.kv_tile_entries[entry_index];
      const int q_start = simt_backward::entry_q_block(entry) * kBlockQ;
      if (q_start >= span.q_len) break;  // thd: ascending, the rest lie past this sequence
      const int q_rows = ir_min(kBlockQ, span.q_len - q_start);

      // The previous Q, dO and warp buffers are consumed (the first time: nothing to wait for).
      __syncthreads();
      load_rows_as_float<Tag, kBlockQ, kDimQk, kStrideQk, kThreads>(
          q_tile, p.fwd.q, view_index(p.fwd.q, batch, span.q_offset + q_start, head), q_rows,
          thread);
      load_rows_as_float<Tag, kBlockQ, kDimV, kStrideV, kThreads>(
          do_tile, p.dout, view_index(p.dout, batch, span.q_offset + q_start, head), q_rows,
          thread);
      const int q = q_start + lane;  // this lane's query row in the element phase
      const bool row_valid = q < span.q_len;
      const int q_inside = ir_min(q, span.q_len - 1);
      const float row_lse =
          row_valid ? *lse_row(p, batch, head, span.q_offset + q) : negative_infinity();
      const float delta = row_valid ? *delta_address(p, batch, head, span.q_offset + q) : 0.0f;
      __syncthreads();  // Q and dO (and, the first time, K and V) are visible

      // Element phase: S and dP of query row `q` with the warp's 8 keys.
      float dots[kRows];
      float dps[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        dots[j] = 0.0f;
        dps[j] = 0.0f;
      }
      dot_with_rows<kDimQk>(q_tile + lane * kStrideQk, k_rows, dots);
      dot_with_rows<kDimV>(do_tile + lane * kStrideV, v_rows, dps);
      const bool check = entry_is_mixed(entry) || kv_boundary;
      float probabilities[kRows];
      float dscores[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int kv = first_kv + j;
        const ElementGradient element =
            check ? element_gradient<Modifier, true>(dots[j], dps[j], row_lse, delta, row_valid,
                                                     p.fwd, invariants, at, q_inside, kv)
                  : element_gradient<Modifier, false>(dots[j], dps[j], row_lse, delta, row_valid,
                                                      p.fwd, invariants, at, q_inside, kv);
        probabilities[j] = element.probability;
        dscores[j] = element.dscore;
      }
      store_eight(p_buffer + lane * kRows, probabilities);
      store_eight(ds_buffer + lane * kRows, dscores);
      __syncwarp();

      // Accumulation phase: dV += P^T dO and dK += dS^T Q for the warp's 8 keys, query rows in
      // order (rows past the sequence contribute nothing).
      for (int row = 0; row < q_rows; ++row) {
        float probability[kRows];
        float dscore[kRows];
        load_eight(p_buffer + row * kRows, probability);
        load_eight(ds_buffer + row * kRows, dscore);
        accumulate_row<kDimV>(dv, probability, do_tile + row * kStrideV, lane);
        accumulate_row<kDimQk>(dk, dscore, q_tile + row * kStrideQk, lane);
      }
    }
  }

  // Every key row inside the sequence is written, zeros where no query row reached it.
  store_rows<Tag, kDimQk>(p.dk, batch, span.kv_offset, head_kv, first_kv, span.kv_len, dk,
                          p.fwd.scale, lane);
  store_rows<Tag, kDimV>(p.dv, batch, span.kv_offset, head_kv, first_kv, span.kv_len, dv, 1.0f,
                         lane);
  // A removed position's 0 times a NaN or inf operand (see repair_dkdv_rows).
  if (barrier_any<-1>(any_non_finite(dk) || any_non_finite(dv), kThreads)) {
    repair_dkdv_rows<Tag, Modifier, kDimQk, kDimV, true, true>(p, span, batch, head_kv, kv_start,
                                                               kBlockKv, warp, Config::kWarps);
  }
}

// dQ of q block blockIdx.x (from the end, as the forward: heavy causal blocks start first) of
// head blockIdx.y, batch blockIdx.z, over the kv tiles of the q-major tile list; also the tensor
// gradients of every kept element.
template <class Config, class Modifier>
__device__ __forceinline__ void backward_dq_simt(const BackwardParams& p) {
  using Tag = typename Config::Tag;
  using namespace simt_backward;  // the helpers above
  constexpr int kDimQk = Config::kHeadDimQk;
  constexpr int kDimV = Config::kHeadDimV;
  constexpr int kBlockQ = Config::kBlockQ;
  constexpr int kBlockKv = Config::kBlockKv;
  constexpr int kRows = Config::kRowsPerWarp;
  constexpr int kThreads = Config::kThreads;
  constexpr int kColumnsQk = Config::kColumnsQk;
  constexpr int kStrideQk = Config::kStrideQk;
  constexpr int kStrideV = Config::kStrideV;

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  extern __shared__ __align__(128) unsigned char shared[];
  float* q_tile = reinterpret_cast<float*>(shared);  // (block_q, dqk)
  float* do_tile = q_tile + kBlockQ * kDimQk;        // (block_q, dv)
  float* k_tile = do_tile + kBlockQ * kDimV;         // (block_kv, kStrideQk)
  float* v_tile = k_tile + kBlockKv * kStrideQk;     // (block_kv, kStrideV)
  // This warp's dS: (block_kv, rows_per_warp).
  float* ds_buffer = v_tile + kBlockKv * kStrideV + warp * Config::kWarpBufferFloats;

  const int q_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p.fwd, batch);
  const int q_start = q_block * kBlockQ;
  if (q_start >= span.q_len) return;  // thd: past this sequence's queries
  const int q_rows = ir_min(kBlockQ, span.q_len - q_start);
  const int head_kv = head / p.fwd.heads_per_kv;
  const Coordinates at{batch, head, span.q_len, span.kv_len};
  const EntryRange entries = visited_tiles(p.fwd, q_start, kBlockKv, span.kv_len);

  load_rows_as_float<Tag, kBlockQ, kDimQk, kDimQk, kThreads>(
      q_tile, p.fwd.q, view_index(p.fwd.q, batch, span.q_offset + q_start, head), q_rows, thread);
  load_rows_as_float<Tag, kBlockQ, kDimV, kDimV, kThreads>(
      do_tile, p.dout, view_index(p.dout, batch, span.q_offset + q_start, head), q_rows, thread);

  // The warp's 8 query rows: statistics for the element phase, dQ for the accumulation phase.
  const int first_q = q_start + warp * kRows;
  float row_lse[kRows];
  float delta[kRows];
  float dq[kRows][kColumnsQk];  // columns lane + 32 c
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int q = first_q + j;
    const bool row_valid = q < span.q_len;
    row_lse[j] = row_valid ? *lse_row(p, batch, head, span.q_offset + q) : negative_infinity();
    delta[j] = row_valid ? *delta_address(p, batch, head, span.q_offset + q) : 0.0f;
#pragma unroll
    for (int c = 0; c < kColumnsQk; ++c) dq[j][c] = 0.0f;
  }
  GradSum local[Modifier::kLocalGradSlots];
#pragma unroll
  for (int slot = 0; slot < Modifier::kLocalGradSlots; ++slot) local[slot] = GradSum{};

  const typename Modifier::Invariants invariants = Modifier::prepare(p.fwd, at);
  const long long k_base = view_index(p.fwd.k, batch, span.kv_offset, head_kv);
  const long long v_base = view_index(p.fwd.v, batch, span.kv_offset, head_kv);
  const float* q_rows_of_warp = q_tile + warp * kRows * kDimQk;   // (rows_per_warp, dqk)
  const float* do_rows_of_warp = do_tile + warp * kRows * kDimV;  // (rows_per_warp, dv)

  // When tensor gradients are wanted, delta is recomputed as rowsum(P * dP) and P renormalised
  // by its own row sum (exact_delta_rows).
  const bool tensor_grads = Modifier::kHasTensorGrads && p.tensor_grads_wanted != 0;
  if (tensor_grads) {
    float sums[kRows];
    float probability_sums[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      sums[j] = 0.0f;
      probability_sums[j] = 0.0f;
    }
    for (int entry_index = entries.begin; entry_index < entries.end; ++entry_index) {
      const int entry = p.fwd.tile_entries[entry_index];
      const int kv_start = entry_kv_tile(entry) * kBlockKv;
      const int kv_rows = ir_min(kBlockKv, span.kv_len - kv_start);
      __syncthreads();
      load_rows_as_float<Tag, kBlockKv, kDimQk, kStrideQk, kThreads>(
          k_tile, p.fwd.k, k_base + kv_start * p.fwd.k.token_stride, kv_rows, thread);
      load_rows_as_float<Tag, kBlockKv, kDimV, kStrideV, kThreads>(
          v_tile, p.fwd.v, v_base + kv_start * p.fwd.v.token_stride, kv_rows, thread);
      __syncthreads();
      float dots[kRows];
      float dps[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        dots[j] = 0.0f;
        dps[j] = 0.0f;
      }
      dot_with_rows<kDimQk>(k_tile + lane * kStrideQk, q_rows_of_warp, dots);
      dot_with_rows<kDimV>(v_tile + lane * kStrideV, do_rows_of_warp, dps);
      const bool check = entry_is_mixed(entry) || kv_rows < kBlockKv;
      const int kv = kv_start + lane;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int q = first_q + j;
        const ElementGradient element =
            check ? element_gradient<Modifier, true>(dots[j], dps[j], row_lse[j], 0.0f,
                                                     q < span.q_len, p.fwd, invariants, at,
                                                     ir_min(q, span.q_len - 1), kv, true)
                  : element_gradient<Modifier, false>(dots[j], dps[j], row_lse[j], 0.0f,
                                                      q < span.q_len, p.fwd, invariants, at,
                                                      ir_min(q, span.q_len - 1), kv, true);
        sums[j] += element.dlogit;  // P * dP
        probability_sums[j] += element.probability;
      }
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const float sum = warp_sum(sums[j]);
      const float probability_sum = warp_sum(probability_sums[j]);
      if (first_q + j < span.q_len && probability_sum > 0.0f) {
        row_lse[j] += logf(probability_sum);
        delta[j] = sum / probability_sum;
      }
    }
  }

  for (int entry_index = entries.begin; entry_index < entries.end; ++entry_index) {
    const int entry = p.fwd.tile_entries[entry_index];
    const int kv_start = entry_kv_tile(entry) * kBlockKv;
    const int kv_rows = ir_min(kBlockKv, span.kv_len - kv_start);
    __syncthreads();  // the previous K, V and warp buffers are consumed
    load_rows_as_float<Tag, kBlockKv, kDimQk, kStrideQk, kThreads>(
        k_tile, p.fwd.k, k_base + kv_start * p.fwd.k.token_stride, kv_rows, thread);
    load_rows_as_float<Tag, kBlockKv, kDimV, kStrideV, kThreads>(
        v_tile, p.fwd.v, v_base + kv_start * p.fwd.v.token_stride, kv_rows, thread);
    __syncthreads();  // K and V (and, the first time, Q and dO) are visible

    // Element phase: S and dP of key `kv` with the warp's 8 query rows.
    float dots[kRows];
    float dps[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      dots[j] = 0.0f;
      dps[j] = 0.0f;
    }
    dot_with_rows<kDimQk>(k_tile + lane * kStrideQk, q_rows_of_warp, dots);
    dot_with_rows<kDimV>(v_tile + lane * kStrideV, do_rows_of_warp, dps);
    const bool check = entry_is_mixed(entry) || kv_rows < kBlockKv;
    const int kv = kv_start + lane;
    const int kv_inside = ir_min(kv, span.kv_len - 1);
    float dscores[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int q = first_q + j;
      const bool row_valid = q < span.q_len;
      const int q_inside = ir_min(q, span.q_len - 1);
      const ElementGradient element =
          check
              ? element_gradient<Modifier, true>(dots[j], dps[j], row_lse[j], delta[j], row_valid,
                                                 p.fwd, invariants, at, q_inside, kv, tensor_grads)
              : element_gradient<Modifier, false>(dots[j], dps[j], row_lse[j], delta[j], row_valid,
                                                  p.fwd, invariants, at, q_inside, kv,
                                                  tensor_grads);
      dscores[j] = element.dscore;
      if constexpr (Modifier::kHasTensorGrads) {
        if (tensor_grads && element.kept) {
          Modifier::tensor_grads(invariants, p, at, dots[j] * p.fwd.scale, q_inside, kv_inside,
                                 element.dlogit, local);
        }
      }
    }
    store_eight(ds_buffer + lane * kRows, dscores);
    __syncwarp();

    // Accumulation phase: dQ += dS K for the warp's 8 query rows, keys in order (keys past the
    // sequence contribute nothing).
    for (int key = 0; key < kv_rows; ++key) {
      float dscore[kRows];
      load_eight(ds_buffer + key * kRows, dscore);
      accumulate_row<kDimQk>(dq, dscore, k_tile + key * kStrideQk, lane);
    }
  }

  // Every query row inside the sequence is written, zeros where no key reached it.
  store_rows<Tag, kDimQk>(p.dq, batch, span.q_offset, head, first_q, span.q_len, dq, p.fwd.scale,
                          lane);
  if constexpr (Modifier::kHasTensorGrads) {
    if (tensor_grads) Modifier::flush_tensor_grads(invariants, p, at, local);
  }
  if (barrier_any<-1>(any_non_finite(dq), kThreads)) {  // see repair_dq_rows
    repair_dq_rows<Tag, Modifier, kDimQk, kDimV>(p, span, batch, head, q_start, kBlockQ, warp,
                                                 Config::kWarps);
  }
}

}  // namespace flexattn_kernels
