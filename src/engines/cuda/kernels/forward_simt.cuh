// The general forward kernel on the fp32 units: float32 storage (where tensor cores would change
// the precision), and 16-bit problems whose head dims or strides the tensor-core kernel cannot
// take (head dims not a multiple of 8). Exact fp32 arithmetic, natural-log softmax.
//
// A block of kWarps warps covers kBlockM = kWarps * kRowsPerWarp query rows; K and V tiles of
// kBlockN keys go through shared memory as float. Each lane owns kKeysPerLane keys of the tile
// (for the scores) and every 32nd output column (for O).
#pragma once

#include "forward_common.cuh"
#include "tile_ops.cuh"

namespace flexattn_kernels {

template <class ElementTag, int kHeadDimQk_, int kHeadDimV_>
struct SimtConfig {
  using Tag = ElementTag;
  static constexpr int kHeadDimQk = kHeadDimQk_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kWarps = 4;
  static constexpr int kRowsPerWarp = 4;  // rows sharing each K element read from shared memory
  static constexpr int kBlockM = kWarps * kRowsPerWarp;
  static constexpr int kBlockN = 64;  // the tile list's kv tile
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kKeysPerLane = kBlockN / kWarpSize;
  static constexpr int kColumnsPerLane = (kHeadDimV + kWarpSize - 1) / kWarpSize;
  // One float of padding per K row: the 32 lanes read 32 different rows without bank conflicts.
  static constexpr int kKeyStride = kHeadDimQk + 1;
  static constexpr int kSharedBytes =
      (kBlockM * kHeadDimQk + kBlockN * kKeyStride + kBlockN * kHeadDimV) * sizeof(float);
};

template <class Config, class Modifier>
__device__ __forceinline__ void forward_simt(const ForwardParams& p) {
  using Tag = typename Config::Tag;
  constexpr int kRows = Config::kRowsPerWarp;
  constexpr int kBlockM = Config::kBlockM;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kThreads = Config::kThreads;
  constexpr int kDimQk = Config::kHeadDimQk;
  constexpr int kDimV = Config::kHeadDimV;
  constexpr int kColumns = Config::kColumnsPerLane;
  extern __shared__ __align__(128) unsigned char shared[];
  float* q_tile = reinterpret_cast<float*>(shared);       // (kBlockM, kDimQk)
  float* k_tile = q_tile + kBlockM * kDimQk;              // (kBlockN, kKeyStride)
  float* v_tile = k_tile + kBlockN * Config::kKeyStride;  // (kBlockN, kDimV)

  const int thread = threadIdx.x;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int q_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p, batch);
  const int q_start = q_block * kBlockM;
  if (q_start >= span.q_len) return;
  const int head_kv = head / p.heads_per_kv;
  const Coordinates at{batch, head, span.q_len, span.kv_len};
  const EntryRange entries = visited_tiles(p, q_start, kBlockN, span.kv_len);

  for (int index = thread; index < kBlockM * kDimQk; index += kThreads) {
    const int row = index / kDimQk;
    const int column = index % kDimQk;
    const int position = q_start + row;
    q_tile[index] = position < span.q_len
                        ? load_as_float(Tag{}, p.q.data,
                                        batch * p.q.batch_stride +
                                            (span.q_offset + position) * p.q.token_stride +
                                            head * p.q.head_stride + column)
                        : 0.0f;
  }

  float output[kRows][kColumns];
  float row_max[kRows];  // natural-log domain
  float row_sum[kRows];  // this lane's share
  int query[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) output[r][c] = 0.0f;
    row_max[r] = negative_infinity();
    row_sum[r] = 0.0f;
    query[r] = ir_min(q_start + warp * kRows + r, span.q_len - 1);
  }
  const typename Modifier::Invariants invariants = Modifier::prepare(p, at);
  const long long k_base =
      batch * p.k.batch_stride + span.kv_offset * p.k.token_stride + head_kv * p.k.head_stride;
  const long long v_base =
      batch * p.v.batch_stride + span.kv_offset * p.v.token_stride + head_kv * p.v.head_stride;

  for (int entry_index = entries.begin; entry_index < entries.end; ++entry_index) {
    const int entry = p.tile_entries[entry_index];
    const int kv_start = entry_kv_tile(entry) * kBlockN;
    __syncthreads();  // the previous tile is consumed (and Q is visible on the first pass)
    for (int index = thread; index < kBlockN * kDimQk; index += kThreads) {
      const int row = index / kDimQk;
      const int column = index % kDimQk;
      const int key = kv_start + row;
      k_tile[row * Config::kKeyStride + column] =
          key < span.kv_len
              ? load_as_float(Tag{}, p.k.data, k_base + key * p.k.token_stride + column)
              : 0.0f;
    }
    for (int index = thread; index < kBlockN * kDimV; index += kThreads) {
      const int row = index / kDimV;
      const int column = index % kDimV;
      const int key = kv_start + row;
      v_tile[index] = key < span.kv_len
                          ? load_as_float(Tag{}, p.v.data, v_base + key * p.v.token_stride + column)
                          : 0.0f;
    }
    __syncthreads();
    const bool check = entry_is_mixed(entry) || kv_start + kBlockN > span.kv_len;

#pragma unroll
    for (int part = 0; part < Config::kKeysPerLane; ++part) {
      const int key_row = part * kWarpSize + lane;
      float logit[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) logit[r] = 0.0f;
      for (int column = 0; column < kDimQk; ++column) {
        const float key_value = k_tile[key_row * Config::kKeyStride + column];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          logit[r] = fmaf(q_tile[(warp * kRows + r) * kDimQk + column], key_value, logit[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int kv = kv_start + key_row;
        logit[r] =
            check
                ? element_logit<Modifier, true, false>(logit[r], p, invariants, at, query[r], kv)
                : element_logit<Modifier, false, false>(logit[r], p, invariants, at, query[r], kv);
        const float new_max = fmaxf(row_max[r], warp_max(logit[r]));
        const float subtract = safe_max(new_max);
        const float correction = expf(row_max[r] - subtract);
        row_max[r] = new_max;
        logit[r] = expf(logit[r] - subtract);  // now the probability (unnormalised)
        row_sum[r] = row_sum[r] * correction + logit[r];
#pragma unroll
        for (int c = 0; c < kColumns; ++c) output[r][c] *= correction;
      }
      for (int source_lane = 0; source_lane < kWarpSize; ++source_lane) {
        const float* value_row = v_tile + (part * kWarpSize + source_lane) * kDimV;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float probability = __shfl_sync(0xffffffffu, logit[r], source_lane);
#pragma unroll
          for (int c = 0; c < kColumns; ++c) {
            const int column = c * kWarpSize + lane;
            if (column < kDimV) output[r][c] = fmaf(probability, value_row[column], output[r][c]);
          }
        }
      }
    }
  }

  bool non_finite_output = false;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int position = q_start + warp * kRows + r;
    if (position >= span.q_len) continue;
    const RowResult result = finish_row_natural(row_max[r], warp_sum(row_sum[r]));
    const long long o_row = batch * p.o.batch_stride +
                            (span.q_offset + position) * p.o.token_stride + head * p.o.head_stride;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = c * kWarpSize + lane;
      if (column < kDimV) {
        const float value = output[r][c] * result.inverse_sum;
        non_finite_output |= non_finite(value);
        store_from_float(Tag{}, p.o.data, o_row + column, value);
      }
    }
    if (p.lse != nullptr && lane == 0) {
      *lse_address(p, batch, head, span.q_offset + position) = result.lse;
    }
  }
  // A weight 0 times a NaN or inf value (docs/design.md, non-finite values): see
  // repair_forward_rows.
  if (barrier_any<-1>(non_finite_output, kThreads)) {
    repair_forward_rows<Tag, Modifier, kDimQk, kDimV>(p, span, batch, head, q_start, kBlockM, warp,
                                                      Config::kWarps);
  }
}

}  // namespace flexattn_kernels
