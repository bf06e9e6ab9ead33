// Rows of results another engine computed, recomputed exactly where they hold NaN or inf (the
// cudnn engine's non-finite repair, docs/engines.md "Non-finite inputs"). That engine's products
// multiply a removed position's weight 0 by its operand as the tensor-core kernels here do, so a
// result it leaves finite is right and a NaN or inf one is computed again by one warp per row
// with repair_forward_rows, repair_dq_rows and repair_dkdv_rows. Each block takes kRepairRows
// rows of one (batch, head); a row whose stored values are finite costs one read of that row.
#pragma once

namespace flexattn_kernels {

// Launch geometry: kRepairRows and kRepairThreads (params.cuh).

// O and the LSE of query rows (grid over seq_len_q and heads_q).
template <class Tag, class Modifier, int kDimQk, int kDimV>
__device__ __forceinline__ void repair_forward(const ForwardParams& p) {
  const int batch = static_cast<int>(blockIdx.z);
  const int head = static_cast<int>(blockIdx.y);
  const SequenceSpan span = sequence_span(p, batch);
  const int q_start = static_cast<int>(blockIdx.x) * kRepairRows;
  if (q_start >= span.q_len) return;
  repair_forward_rows<Tag, Modifier, kDimQk, kDimV>(p, span, batch, head, q_start, kRepairRows,
                                                    static_cast<int>(threadIdx.x) / kWarpSize,
                                                    kRepairThreads / kWarpSize);
}

// dQ of query rows (grid over seq_len_q and heads_q); reads the delta of backward_delta.
template <class Tag, class Modifier, int kDimQk, int kDimV>
__device__ __forceinline__ void repair_dq(const BackwardParams& p) {
  const int batch = static_cast<int>(blockIdx.z);
  const int head = static_cast<int>(blockIdx.y);
  const SequenceSpan span = sequence_span(p.fwd, batch);
  const int q_start = static_cast<int>(blockIdx.x) * kRepairRows;
  if (q_start >= span.q_len) return;
  repair_dq_rows<Tag, Modifier, kDimQk, kDimV>(p, span, batch, head, q_start, kRepairRows,
                                               static_cast<int>(threadIdx.x) / kWarpSize,
                                               kRepairThreads / kWarpSize);
}

// dK and dV of key rows (grid over seq_len_kv and heads_kv); reads the delta of backward_delta.
template <class Tag, class Modifier, int kDimQk, int kDimV>
__device__ __forceinline__ void repair_dkdv(const BackwardParams& p) {
  const int batch = static_cast<int>(blockIdx.z);
  const int head_kv = static_cast<int>(blockIdx.y);
  const SequenceSpan span = sequence_span(p.fwd, batch);
  const int kv_start = static_cast<int>(blockIdx.x) * kRepairRows;
  if (kv_start >= span.kv_len) return;
  repair_dkdv_rows<Tag, Modifier, kDimQk, kDimV, true, true>(
      p, span, batch, head_kv, kv_start, kRepairRows, static_cast<int>(threadIdx.x) / kWarpSize,
      kRepairThreads / kWarpSize);
}

}  // namespace flexattn_kernels
