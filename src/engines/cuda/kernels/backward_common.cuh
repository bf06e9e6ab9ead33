// What every backward kernel shares: the delta pre-pass (rowsum(dO * O)), the per-element
// gradient of the logit, the fixed-point accumulation of tensor gradients, and the finalize pass
// that turns those accumulators into the gradient tensors.
//
// The backward adds to the generated Modifier (codegen.cpp) when the problem wants gradients:
//   static constexpr bool kIdentityDerivative;  // d score_mod / d score is the constant 1
//   static constexpr bool kBoundedDerivative;   // ... is finite at every finite score
//   static constexpr bool kHasTensorGrads;      // some float tensor load has a derivative
//   static constexpr int kLocalGradSlots;       // >= 1: per-thread accumulators (see below)
//   static float score_grad(const Invariants&, const ForwardParams&, const Coordinates&,
//                           float score, int q, int kv);
//   static float score_grad_from_dot(const Invariants&, const ForwardParams&, const Coordinates&,
//                                    float dot, int q, int kv);  // score_grad(dot * scale)
//   static void tensor_grads(const Invariants&, const BackwardParams&, const Coordinates&,
//                            float score, int q, int kv, float dlogit,
//                            GradSum (&local)[kLocalGradSlots]);
//   static void flush_tensor_grads(const Invariants&, const BackwardParams&, const Coordinates&,
//                                  GradSum (&local)[kLocalGradSlots]);
// tensor_grads adds dlogit * d score_mod / d load for every float tensor load whose gradient is
// wanted (grad_fixed[slot] != null): a load whose index depends only on (b, h) goes into
// `local` (fixed point, summed per thread), the others straight into grad_fixed by atomicAdd.
// flush_tensor_grads is called once by every thread of the block at the end (for one (b, h)):
// it sums `local` over the warp and lane 0 adds it at the load's index. `score` is the score
// before the modifier (scale * q.k), `q` and `kv` positions inside the sequence.
#pragma once

#include "forward_common.cuh"
#include "params.cuh"
#include "tile_ops.cuh"

namespace flexattn_kernels {

__device__ __forceinline__ float* delta_address(const BackwardParams& p, int batch, int head,
                                                int token) {
  return p.delta + batch * p.fwd.lse_batch_stride + head * p.fwd.lse_head_stride + token;
}
__device__ __forceinline__ const float* lse_row(const BackwardParams& p, int batch, int head,
                                                int token) {
  return p.fwd.lse + batch * p.fwd.lse_batch_stride + head * p.fwd.lse_head_stride + token;
}
__device__ __forceinline__ float* lse2_address(const BackwardParams& p, int batch, int head,
                                               int token) {
  return p.lse2 + batch * p.fwd.lse_batch_stride + head * p.fwd.lse_head_stride + token;
}

// A sum of gradient contributions: fixed point (each saturates beyond +-2^31) and the non-finite
// values among them (GradAccumulator's flags).
struct GradSum {
  long long fixed = 0;
  unsigned flags = 0;
  __device__ __forceinline__ GradSum& operator+=(const GradSum& other) {
    fixed += other.fixed;
    flags |= other.flags;
    return *this;
  }
};
__device__ __forceinline__ GradSum to_fixed(float value) {
  GradSum result;
  if (value != value) {
    result.flags = kGradNan;
  } else if (value == positive_infinity()) {
    result.flags = kGradPlusInf;
  } else if (value == negative_infinity()) {
    result.flags = kGradMinusInf;
  } else {
    result.fixed = __float2ll_rn(value * kGradFixedScale);
  }
  return result;
}
__device__ __forceinline__ void add_fixed(GradAccumulator* address, const GradSum& value) {
  if (value.fixed != 0) atomicAdd(&address->fixed, static_cast<unsigned long long>(value.fixed));
  if (value.flags != 0) atomicOr(&address->flags, static_cast<unsigned long long>(value.flags));
}
// Sum over the warp (integer: the order does not matter).
__device__ __forceinline__ GradSum warp_sum_fixed(GradSum value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value.fixed += __shfl_xor_sync(0xffffffffu, value.fixed, offset);
    value.flags |= __shfl_xor_sync(0xffffffffu, value.flags, offset);
  }
  return value;
}

// P = exp(logit - lse) in the log2 domain: logit2 = logit * log2(e), lse2 = lse * log2(e)
// (BackwardParams::lse2). 0 where the element is masked (logit2 -inf), and in a row that kept no
// key or lies past the queries, whose lse2 is +inf.
__device__ __forceinline__ float probability_log2(float logit2, float lse2) {
  return fast_exp2(logit2 - lse2);
}

// The backward's mask on mixed and boundary tiles: the mask and the key bound (masked_logit), and
// the rows whose lse2 is +inf: a query row past the sequence (padding of the last q block) or a
// row that kept no key. Their P must be 0, but a padding row's logit is the modifier at a dummy
// score (1 / score is inf at score 0) and exp2(inf - inf) is NaN, which dK, dV and the tensor
// gradients would sum. So they are masked like any other element; the callers treat a q block
// that crosses the end of the queries as a boundary tile.
// One predicate and one select per element (a conditional around masked_logit compiled to code
// that cost the causal forward+backward 12% at head dim 128 on an H200).
template <class Modifier>
__device__ __forceinline__ float backward_masked_logit(
    float logit2, float lse2, const ForwardParams& p,
    const typename Modifier::Invariants& invariants, const Coordinates& at, int q, int kv) {
  bool keep = (kv < at.kv_len) & (lse2 != positive_infinity());
  if constexpr (Modifier::kHasMask) {
    keep = keep & Modifier::mask_mod(invariants, p, at, q, ir_min(kv, at.kv_len - 1));
  }
  return keep ? logit2 : negative_infinity();
}

// unmasked_then_masked: the tensor-core kernels compute every element of a tile with the same
// code, the modifier on the unmasked logit (kv clamped into the sequence, a no-op inside it), then
// the mask as a select on mixed and boundary tiles, and the derivative unconditionally with a
// select for dlogit == 0 (keeps 0 * inf or NaN of masked elements out). Per-element branches
// between a masked and an unmasked copy of the modifier (the first version) made the compiler
// keep both copies and serialise the elements' tanh chains: causal softcap's dK/dV and dQ kernels
// took as long as non-causal ones on half the tiles (Nsight Compute on the H200, 2026-12-02).

// The gradient of the loss with respect to the score (before the modifier) of one kept
// element, from the probability P, dP = dO . V and delta = rowsum(dO * O):
//   dlogit = P (dP - delta),  dscore = dlogit * d score_mod / d score.
template <class Modifier>
__device__ __forceinline__ float score_gradient(float dlogit,
                                                const typename Modifier::Invariants& invariants,
                                                const ForwardParams& p, const Coordinates& at,
                                                float score, int q, int kv) {
  if constexpr (Modifier::kIdentityDerivative) {
    return dlogit;
  } else {
    return dlogit * Modifier::score_grad(invariants, p, at, score, q, kv);
  }
}
// The same from the raw dot product (score = dot * scale), as the tensor-core kernels' logits
// (score_mod_log2): the generated score_grad_from_dot merges the same constant multiplications, so
// what the derivative shares with the logit (softcap's tanh) is computed once.
// kSmall: the small-tanh variant (a tile small_tanh_tile admitted).
template <class Modifier, bool kSmall = false>
__device__ __forceinline__ float score_gradient_from_dot(
    float dlogit, const typename Modifier::Invariants& invariants, const ForwardParams& p,
    const Coordinates& at, float dot, int q, int kv) {
  if constexpr (Modifier::kIdentityDerivative) {
    return dlogit;
  } else if constexpr (kSmall) {
    return dlogit * Modifier::score_grad_from_dot_small(invariants, p, at, dot, q, kv);
  } else {
    return dlogit * Modifier::score_grad_from_dot(invariants, p, at, dot, q, kv);
  }
}

// exact_delta_rows: delta = rowsum(dO * O) equals rowsum(P * dP) only up to the rounding of the
// stored O (one bf16/fp16 rounding). dQ, dK and dV (stored in that dtype) do not notice, but a
// tensor gradient sums dlogit = P (dP - delta) over whole rows, where the exact terms cancel and
// the residual (sum_kv P dP - delta, one rounding of O per row) is multiplied by the derivative
// (e.g. kv - q for ALiBi slopes) and summed over the sequence: measured on the H200 up to 2x the
// fp32 tolerance. So when tensor gradients are wanted (BackwardParams::tensor_grads_wanted), the
// dQ kernels recompute delta as rowsum(P * dP) in a first pass over the row's tiles (two extra
// mma per tile) before computing dQ and the tensor gradients with it; dK and dV keep the delta of
// this kernel. The same pass sums P itself and renormalises the row by it (LSE += log(sum P),
// delta /= sum P): the stored LSE carries the forward's rounding, which scales a whole row of P,
// and a tensor gradient summed over rows with different such factors no longer cancels.
//
// delta[b, h, q] = sum_d dO[b, q, h, d] * O[b, q, h, d] in fp32 (O and dO as stored), and
// lse2[b, h, q] (BackwardParams::lse2). One warp per row at a time; grid (ceil(seq_len_q /
// kDeltaRows), heads_q, batch), kDeltaThreads threads.
template <class Tag, int kHeadDimV>
__device__ __forceinline__ void backward_delta(const BackwardParams& p) {
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan span = sequence_span(p.fwd, batch);
  constexpr int kWarps = kDeltaThreads / kWarpSize;
  for (int row = warp; row < kDeltaRows; row += kWarps) {
    const int token = blockIdx.x * kDeltaRows + row;
    if (token >= span.q_len) break;
    const long long o_base = batch * p.fwd.o.batch_stride +
                             (span.q_offset + token) * p.fwd.o.token_stride +
                             head * p.fwd.o.head_stride;
    const long long do_base = batch * p.dout.batch_stride +
                              (span.q_offset + token) * p.dout.token_stride +
                              head * p.dout.head_stride;
    float sum = 0.0f;
    for (int d = lane; d < kHeadDimV; d += kWarpSize) {
      sum += load_as_float(Tag{}, p.fwd.o.data, o_base + d) *
             load_as_float(Tag{}, p.dout.data, do_base + d);
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      *delta_address(p, batch, head, span.q_offset + token) = sum;
      const float lse = *lse_row(p, batch, head, span.q_offset + token);
      *lse2_address(p, batch, head, span.q_offset + token) =
          lse == negative_infinity() ? positive_infinity() : lse * kLog2e;
    }
  }
}

// gradient[i] = fixed[i] * 2^-32, as float or double, or the non-finite value that reached it
// (NaN, or +inf and -inf both: NaN). Grid (ceil(count / kFinalizeThreads)).
__device__ __forceinline__ void backward_finalize(const FinalizeParams& p) {
  const long long index = static_cast<long long>(blockIdx.x) * kFinalizeThreads + threadIdx.x;
  if (index >= p.count) return;
  const GradAccumulator accumulator = p.fixed[index];
  double value = static_cast<double>(static_cast<long long>(accumulator.fixed)) * kGradFixedInverse;
  const unsigned long long infinities = accumulator.flags & (kGradPlusInf | kGradMinusInf);
  if ((accumulator.flags & kGradNan) != 0 || infinities == (kGradPlusInf | kGradMinusInf)) {
    value = static_cast<double>(__int_as_float(0x7fc00000));
  } else if (infinities == kGradPlusInf) {
    value = static_cast<double>(positive_infinity());
  } else if (infinities == kGradMinusInf) {
    value = static_cast<double>(negative_infinity());
  }
  if (p.out_is_f64 != 0) {
    static_cast<double*>(p.out)[index] = value;
  } else {
    static_cast<float*>(p.out)[index] = static_cast<float>(value);
  }
}

// ---- rows recomputed exactly (see repair_forward_rows in forward_common.cuh) -------------------
//
// A dQ, dK or dV row that a removed position's 0 times a NaN or inf operand made NaN is computed
// again by one warp in fp32, skipping every removed position (the mask, a -inf modified score,
// P = 0), from the stored LSE and delta. Tensor gradients are not recomputed: the scatter skips
// removed positions itself (dq_gradient_elements).

// The contribution of element (q, kv) to the backward: P, and dS without the softmax scale. Both
// 0 where the position is removed (`kept` false); the same in every lane.
struct ExactElement {
  float probability;
  float dscore;
  bool kept;
};
template <class Tag, class Modifier, int kDimQk, int kDimV>
__device__ __forceinline__ ExactElement
exact_element(const BackwardParams& bp, const typename Modifier::Invariants& invariants,
              const Coordinates& at, const SequenceSpan& span, int batch, int head, int q, int kv,
              const WarpRow<kDimQk>& query, const WarpRow<kDimQk>& key, const WarpRow<kDimV>& value,
              const WarpRow<kDimV>& output_gradient) {
  const ForwardParams& p = bp.fwd;
  ExactElement result{0.0f, 0.0f, false};
  // In the natural domain with P and dlogit in double, as the fp32 kernels' precise path: a
  // recomputed row must meet the fp32 tolerance too.
  const float dot = OrderedDot<Tag>::kValue ? query.ordered_dot(key) : query.dot(key);
  const float logit = element_logit<Modifier, true, false>(dot, p, invariants, at, q, kv);
  if (logit == negative_infinity()) return result;
  // The LSE is -inf in a row that kept no key: P 0. A NaN row's NaN P is kept.
  const float lse = *lse_row(bp, batch, head, span.q_offset + q);
  if (lse == negative_infinity()) return result;
  const double probability = exp(static_cast<double>(logit) - static_cast<double>(lse));
  if (probability == 0.0) return result;
  const float dp =
      OrderedDot<Tag>::kValue ? output_gradient.ordered_dot(value) : output_gradient.dot(value);
  const double delta = *delta_address(bp, batch, head, span.q_offset + q);
  const float dlogit = static_cast<float>(probability * (static_cast<double>(dp) - delta));
  const float dscore = score_gradient<Modifier>(dlogit, invariants, p, at, dot * p.scale, q, kv);
  result.probability = static_cast<float>(probability);
  result.dscore = Modifier::kBoundedDerivative || dlogit != 0.0f ? dscore : 0.0f;
  result.kept = true;
  return result;
}

// dQ of query `row` of head `head` over every key of the sequence (mask evaluated at each).
template <class Tag, class Modifier, int kDimQk, int kDimV>
__device__ __forceinline__ void exact_dq_row(const BackwardParams& bp,
                                             const typename Modifier::Invariants& invariants,
                                             const Coordinates& at, const SequenceSpan& span,
                                             int batch, int head, int row, int lane) {
  const ForwardParams& p = bp.fwd;
  const int head_kv = head / p.heads_per_kv;
  WarpRow<kDimQk> query;
  query.load(Tag{}, p.q.data, row_index(p.q, batch, span.q_offset + row, head), lane);
  WarpRow<kDimV> output_gradient;
  output_gradient.load(Tag{}, bp.dout.data, row_index(bp.dout, batch, span.q_offset + row, head),
                       lane);
  WarpRow<kDimQk> dq;
  dq.zero();
  for (int kv = 0; kv < span.kv_len; ++kv) {
    WarpRow<kDimQk> key;
    key.load(Tag{}, p.k.data, row_index(p.k, batch, span.kv_offset + kv, head_kv), lane);
    WarpRow<kDimV> value;
    value.load(Tag{}, p.v.data, row_index(p.v, batch, span.kv_offset + kv, head_kv), lane);
    const ExactElement element = exact_element<Tag, Modifier>(
        bp, invariants, at, span, batch, head, row, kv, query, key, value, output_gradient);
    if (element.kept) dq.add(element.dscore, key);
  }
  dq.store(Tag{}, bp.dq.data, row_index(bp.dq, batch, span.q_offset + row, head), lane, p.scale);
}

// dK and/or dV of key `kv` of kv head `head_kv`, over every query of every head of its GQA group.
template <class Tag, class Modifier, int kDimQk, int kDimV, bool kWantDk, bool kWantDv>
__device__ __forceinline__ void exact_dkdv_row(const BackwardParams& bp, const SequenceSpan& span,
                                               int batch, int head_kv, int kv, int lane) {
  const ForwardParams& p = bp.fwd;
  WarpRow<kDimQk> key;
  key.load(Tag{}, p.k.data, row_index(p.k, batch, span.kv_offset + kv, head_kv), lane);
  WarpRow<kDimV> value;
  value.load(Tag{}, p.v.data, row_index(p.v, batch, span.kv_offset + kv, head_kv), lane);
  WarpRow<kDimQk> dk;
  WarpRow<kDimV> dv;
  dk.zero();
  dv.zero();
  for (int member = 0; member < p.heads_per_kv; ++member) {
    const int head = head_kv * p.heads_per_kv + member;
    const Coordinates at{batch, head, span.q_len, span.kv_len};
    const typename Modifier::Invariants invariants = Modifier::prepare(p, at);
    for (int q = 0; q < span.q_len; ++q) {
      WarpRow<kDimQk> query;
      query.load(Tag{}, p.q.data, row_index(p.q, batch, span.q_offset + q, head), lane);
      WarpRow<kDimV> output_gradient;
      output_gradient.load(Tag{}, bp.dout.data, row_index(bp.dout, batch, span.q_offset + q, head),
                           lane);
      const ExactElement element = exact_element<Tag, Modifier>(
          bp, invariants, at, span, batch, head, q, kv, query, key, value, output_gradient);
      if (!element.kept) continue;
      if constexpr (kWantDv) dv.add(element.probability, output_gradient);
      if constexpr (kWantDk) dk.add(element.dscore, query);
    }
  }
  if constexpr (kWantDk) {
    dk.store(Tag{}, bp.dk.data, row_index(bp.dk, batch, span.kv_offset + kv, head_kv), lane,
             p.scale);
  }
  if constexpr (kWantDv) {
    dv.store(Tag{}, bp.dv.data, row_index(bp.dv, batch, span.kv_offset + kv, head_kv), lane, 1.0f);
  }
}

// After a dQ block stored rows [q_start, q_start + rows) and `flagged` (barrier_any of its
// non-finite results) is set: its warps recompute the rows whose stored dQ holds NaN or inf.
template <class Tag, class Modifier, int kDimQk, int kDimV>
__device__ __forceinline__ void repair_dq_rows(const BackwardParams& bp, const SequenceSpan& span,
                                               int batch, int head, int q_start, int rows, int warp,
                                               int warps) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  const Coordinates at{batch, head, span.q_len, span.kv_len};
  const typename Modifier::Invariants invariants = Modifier::prepare(bp.fwd, at);
  for (int r = warp; r < rows && q_start + r < span.q_len; r += warps) {
    const int row = q_start + r;
    if (stored_row_non_finite<Tag, kDimQk>(
            bp.dq.data, row_index(bp.dq, batch, span.q_offset + row, head), lane)) {
      exact_dq_row<Tag, Modifier, kDimQk, kDimV>(bp, invariants, at, span, batch, head, row, lane);
    }
  }
}

// The same for a dK/dV block's keys [kv_start, kv_start + rows): the rows where a stored output
// it wrote (kWantDk, kWantDv) holds NaN or inf.
template <class Tag, class Modifier, int kDimQk, int kDimV, bool kWantDk, bool kWantDv>
__device__ __forceinline__ void repair_dkdv_rows(const BackwardParams& bp, const SequenceSpan& span,
                                                 int batch, int head_kv, int kv_start, int rows,
                                                 int warp, int warps) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  for (int r = warp; r < rows && kv_start + r < span.kv_len; r += warps) {
    const int kv = kv_start + r;
    bool bad = false;
    if constexpr (kWantDk) {
      bad = stored_row_non_finite<Tag, kDimQk>(
          bp.dk.data, row_index(bp.dk, batch, span.kv_offset + kv, head_kv), lane);
    }
    if constexpr (kWantDv) {
      bad = bad || stored_row_non_finite<Tag, kDimV>(
                       bp.dv.data, row_index(bp.dv, batch, span.kv_offset + kv, head_kv), lane);
    }
    if (bad) {
      exact_dkdv_row<Tag, Modifier, kDimQk, kDimV, kWantDk, kWantDv>(bp, span, batch, head_kv, kv,
                                                                     lane);
    }
  }
}

// Whether a thread's accumulators hold NaN or inf.
template <int kRows, int kColumns>
__device__ __forceinline__ bool any_non_finite(const float (&values)[kRows][kColumns]) {
  bool bad = false;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
#pragma unroll
    for (int e = 0; e < kColumns; ++e) bad |= non_finite(values[j][e]);
  }
  return bad;
}
template <int kCount>
__device__ __forceinline__ bool any_non_finite(const float (&values)[kCount]) {
  bool bad = false;
#pragma unroll
  for (int i = 0; i < kCount; ++i) bad |= non_finite(values[i]);
  return bad;
}

}  // namespace flexattn_kernels
