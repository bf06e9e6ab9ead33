// What every forward kernel shares: where a sequence lives, the list of kv tiles a query block
// visits, and the element pipeline `score -> score_mod -> mask -> bounds`.
//
// A generated modifier is a struct with this interface (see codegen.cpp):
//   static constexpr bool kIdentityScore;  // score_mod is `score`
//   static constexpr bool kHasMask;        // mask_mod is not the constant `true`
//   struct Invariants;                     // values that depend only on (b, h, lengths)
//   static Invariants prepare(const ForwardParams&, const Coordinates&);
//   static float score_mod(const Invariants&, const ForwardParams&, const Coordinates&,
//                          float score, int q, int kv);
//   static float score_mod_log2(const Invariants&, const ForwardParams&, const Coordinates&,
//                               float dot, int q, int kv, const StagedElement*);
//                               // score_mod(dot * scale) * log2(e)
//   static constexpr float kForwardToLog2;  // 1, or log2(e) (never with kSmallTanh)
//   static float score_mod_forward(...);  // score_mod_log2 / kForwardToLog2 (the forward's)
//   static constexpr bool kStaticReference;  // every logit <= kStaticReferenceLog2 (log2
//   static constexpr float kStaticReferenceLog2;  // units): the softmax's reference is fixed
//                               // after a row's first tile (bounded_softmax_probabilities)
//   static constexpr int kStagedTensor;  // the tensor slot read from a StagedElement, or -1
//   static long long staged_origin(const Invariants&, const ForwardParams&, const Coordinates&);
//                               // its element [..., 0, 0] (only with kStagedTensor >= 0)
//   static bool mask_mod(const Invariants&, const ForwardParams&, const Coordinates&, int q,
//                        int kv);
#pragma once

#include "device_math.cuh"
#include "params.cuh"
#include "tile_ops.cuh"

namespace flexattn_kernels {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The (b, h) a thread block works on and that batch entry's sequence lengths.
struct Coordinates {
  int batch;
  int head;
  int q_len;
  int kv_len;
};

// A modifier tensor tile staged in shared memory by the wgmma forward (KernelChoice::stage_tensor:
// a 16-bit tensor indexed [..., q, kv], e.g. a dense bias): the block's rows and the kv tile's
// columns, in 64-value panels of panel_bytes with the 128-byte swizzle (SwizzledPanels).
struct StagedTile {
  unsigned address;  // shared-memory address, 1024-byte aligned
  int panel_bytes;
  int warp_row;  // the first of this warp's 16 accumulator rows in the tile
};
// One element of it, already read: the generated score_mod_log2 takes its value when given one,
// else it reads the tensor in global memory.
struct StagedElement {
  unsigned short bits;
};
__device__ __forceinline__ float staged_bf16(const StagedElement& element) {
  return bf16_bits_to_float(element.bits);
}
__device__ __forceinline__ float staged_f16(const StagedElement& element) {
  return half_bits_to_float(element.bits);
}

struct SequenceSpan {
  int q_offset;  // first token of the sequence (thd), else 0
  int q_len;
  int kv_offset;
  int kv_len;
};

__device__ __forceinline__ SequenceSpan sequence_span(const ForwardParams& p, int batch) {
  SequenceSpan span;
  if (p.cu_seqlens_q != nullptr) {
    span.q_offset = p.cu_seqlens_q[batch];
    span.q_len = p.cu_seqlens_q[batch + 1] - span.q_offset;
  } else {
    span.q_offset = 0;
    span.q_len = p.seq_len_q;
  }
  if (p.cu_seqlens_kv != nullptr) {
    span.kv_offset = p.cu_seqlens_kv[batch];
    span.kv_len = p.cu_seqlens_kv[batch + 1] - span.kv_offset;
  } else {
    span.kv_offset = 0;
    span.kv_len = p.seq_len_kv;
  }
  return span;
}

// Address of element (batch, token, head, 0) of a view.
template <class T>
__device__ __forceinline__ T* view_row(const SequenceView& view, int batch, int token, int head) {
  return static_cast<T*>(view.data) + batch * view.batch_stride + token * view.token_stride +
         head * view.head_stride;
}

// The kv tiles a query block visits: [begin, end) into p.tile_entries, without tiles that start
// past this sequence's keys (thd sequences shorter than the longest).
struct EntryRange {
  int begin;
  int end;
};
__device__ __forceinline__ EntryRange visited_tiles(const ForwardParams& p, int q_start,
                                                    int block_n, int kv_len) {
  const int classified_block = q_start / p.class_block_q;
  EntryRange range{p.tile_offsets[classified_block], p.tile_offsets[classified_block + 1]};
  while (range.end > range.begin && (p.tile_entries[range.end - 1] >> 1) * block_n >= kv_len) {
    --range.end;
  }
  return range;
}

__device__ __forceinline__ int entry_kv_tile(int entry) { return entry >> 1; }
__device__ __forceinline__ bool entry_is_mixed(int entry) { return (entry & 1) != 0; }

// The mask and the key bound applied to a logit computed without them (`kv` may lie past the
// keys; the mask sees it clamped): the logit, or -inf where the element is not kept.
template <class Modifier>
__device__ __forceinline__ float masked_logit(float logit, const ForwardParams& p,
                                              const typename Modifier::Invariants& invariants,
                                              const Coordinates& at, int q, int kv) {
  bool keep = kv < at.kv_len;
  if constexpr (Modifier::kHasMask) {
    keep = keep && Modifier::mask_mod(invariants, p, at, q, ir_min(kv, at.kv_len - 1));
  }
  return keep ? logit : negative_infinity();
}

// The logit of one element: score = scale * dot, then score_mod, then the mask and the key
// bounds (only when kCheck: mixed or boundary tiles). `q` is already clamped into the sequence;
// with kCheck, `kv` may lie past it and is clamped before the modifier reads anything, so a
// modifier only ever sees indices its load analysis covers. kLog2Domain: the logit times log2(e),
// from the generated score_mod_log2 (which merges constant multiplications). kSmall: its
// small-tanh variant, for a tile that small_tanh_tile admitted. kForward (the forward's
// softmax): score_mod_forward, the logit times log2(e) / Modifier::kForwardToLog2.
template <class Modifier, bool kCheck, bool kLog2Domain, bool kSmall = false, bool kForward = false>
__device__ __forceinline__ float element_logit(float dot, const ForwardParams& p,
                                               const typename Modifier::Invariants& invariants,
                                               const Coordinates& at, int q, int kv,
                                               const StagedElement* staged = nullptr) {
  const int kv_inside = kCheck ? ir_min(kv, at.kv_len - 1) : kv;
  float logit;
  if constexpr (Modifier::kIdentityScore) {
    logit = dot * (kLog2Domain ? p.scale_log2 : p.scale);
  } else if constexpr (kSmall) {
    static_assert(kLog2Domain && Modifier::kSmallTanh, "the small variant is of score_mod_log2");
    logit = Modifier::score_mod_log2_small(invariants, p, at, dot, q, kv_inside, staged);
  } else if constexpr (kLog2Domain && kForward) {
    logit = Modifier::score_mod_forward(invariants, p, at, dot, q, kv_inside, staged);
  } else if constexpr (kLog2Domain) {
    logit = Modifier::score_mod_log2(invariants, p, at, dot, q, kv_inside, staged);
  } else {
    logit = Modifier::score_mod(invariants, p, at, dot * p.scale, q, kv_inside);
  }
  if constexpr (kCheck) logit = masked_logit<Modifier>(logit, p, invariants, at, q, kv);
  return logit;
}

// Whether the warp's tile of dot products (this thread's kCount: `dots`) may take the small-tanh
// functions (Modifier::kSmallTanh): the bound of |dot| over the warp keeps every tanh argument
// below kTanhSmallLimit. One vote per tile, so the branch on it is uniform across the warp; NaN
// dots do not raise the bound (both tanh forms give NaN for them), infinite ones refuse.
template <class Modifier, int kCount>
__device__ __forceinline__ bool small_tanh_tile(const float* dots,
                                                const typename Modifier::Invariants& invariants,
                                                const ForwardParams& p) {
  float bound[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four chains instead of one long one
#pragma unroll
  for (int i = 0; i < kCount; ++i) bound[i % 4] = fmaxf(bound[i % 4], fabsf(dots[i]));
  const float largest = fmaxf(fmaxf(bound[0], bound[1]), fmaxf(bound[2], bound[3]));
  return __all_sync(0xffffffffu, Modifier::tanh_args_small(invariants, p, largest));
}

// Finishes a row: (normaliser, log-sum-exp) from the running max and sum. A row that kept no key
// has sum 0: its output is 0 and its LSE -inf. A row whose kept logits include NaN, or a +inf
// (exp(inf - inf)), has a NaN sum and gets NaN output and LSE (docs/design.md, non-finite values),
// so the test is `!= 0`, which NaN passes, not `> 0`.
struct RowResult {
  float inverse_sum;
  float lse;
};
__device__ __forceinline__ RowResult finish_row_log2(float row_max, float row_sum) {
  if (row_sum != 0.0f) return RowResult{1.0f / row_sum, (row_max + log2f(row_sum)) * kLn2};
  return RowResult{0.0f, negative_infinity()};
}
__device__ __forceinline__ RowResult finish_row_natural(float row_max, float row_sum) {
  if (row_sum != 0.0f) return RowResult{1.0f / row_sum, row_max + logf(row_sum)};
  return RowResult{0.0f, negative_infinity()};
}

// The max to subtract: a row whose every logit so far is -inf subtracts 0, so exp gives 0, not
// NaN.
__device__ __forceinline__ float safe_max(float row_max) {
  return row_max == negative_infinity() ? 0.0f : row_max;
}

__device__ __forceinline__ float* lse_address(const ForwardParams& p, int batch, int head,
                                              int token) {
  return p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + token;
}

// ---- rows recomputed exactly (docs/design.md, non-finite values) ------------------------------
//
// The tensor-core products multiply a removed position's weight 0 by its operand, so a NaN or
// inf in a Q, K, V or dO row that the mask removes for some rows makes those rows' results NaN,
// where the reference's are finite. Such a product never turns a finite result into another
// finite one: a result row that comes out finite is right, and one that does not is computed
// again, after the block's stores, by one warp in fp32 that skips every removed position (the
// reference's semantics; a row the mathematics makes NaN or inf comes out so again). The check
// is a few compares per thread and one block barrier; the rows are recomputed only where an input
// holds NaN or inf.

// Whether x is NaN or +-inf.
__device__ __forceinline__ bool non_finite(float x) { return !(fabsf(x) <= 3.402823466e38f); }

// The OR of `value` over the threads of the barrier, which is also a barrier: global and shared
// memory writes before it are visible to those threads after it. kBarrier: a named barrier of
// `threads` threads (a block with a producer warpgroup), or -1 for the whole block.
template <int kBarrier>
__device__ __forceinline__ bool barrier_any(bool value, int threads) {
  if constexpr (kBarrier < 0) {
    return __syncthreads_or(value ? 1 : 0) != 0;
  } else {
    unsigned result;
    asm volatile(
        "{\n .reg .pred in, out;\n setp.ne.u32 in, %1, 0;\n"
        " barrier.red.or.pred out, %2, %3, in;\n selp.u32 %0, 1, 0, out;\n}"
        : "=r"(result)
        : "r"(value ? 1u : 0u), "n"(kBarrier), "r"(threads)
        : "memory");
    return result != 0;
  }
}

// Index of element (batch, token, head, 0) of a view (`token` counts from the start of the batch
// entry, thd offsets included).
__device__ __forceinline__ long long row_index(const SequenceView& view, int batch, int token,
                                               int head) {
  return batch * view.batch_stride + token * view.token_stride + head * view.head_stride;
}

// A row of kDim values spread over a warp: lane l holds columns l, l + 32, ... (0 past kDim).
template <int kDim>
struct WarpRow {
  static constexpr int kColumns = (kDim + kWarpSize - 1) / kWarpSize;
  float value[kColumns];

  template <class Tag>
  __device__ __forceinline__ void load(Tag, const void* data, long long first, int lane) {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = c * kWarpSize + lane;
      value[c] = kDim % kWarpSize == 0 || column < kDim ? load_as_float(Tag{}, data, first + column)
                                                        : 0.0f;
    }
  }
  template <class Tag>
  __device__ __forceinline__ void store(Tag, void* data, long long first, int lane,
                                        float factor) const {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = c * kWarpSize + lane;
      if (kDim % kWarpSize == 0 || column < kDim) {
        store_from_float(Tag{}, data, first + column, value[c] * factor);
      }
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) value[c] = 0.0f;
  }
  // The dot product with another row, the same in every lane.
  __device__ __forceinline__ float dot(const WarpRow& other) const {
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) sum = fmaf(value[c], other.value[c], sum);
    return warp_sum(sum);
  }
  // The dot product as the fp32-unit kernels compute it (forward_simt, dot_with_rows): one fma
  // chain over the columns in order, from 0, so the logit is bit for bit theirs; the same in every
  // lane. Two shuffles a column: for recomputed rows only.
  __device__ __forceinline__ float ordered_dot(const WarpRow& other) const {
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
#pragma unroll 1
      for (int source = 0; source < kWarpSize && c * kWarpSize + source < kDim; ++source) {
        sum = fmaf(__shfl_sync(0xffffffffu, value[c], source),
                   __shfl_sync(0xffffffffu, other.value[c], source), sum);
      }
    }
    return sum;
  }
  // this += weight * other
  __device__ __forceinline__ void add(float weight, const WarpRow& other) {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) value[c] = fmaf(weight, other.value[c], value[c]);
  }
};

// Whether the stored row (kDim values of a view, as Tag) holds NaN or inf; the same in every lane.
template <class Tag, int kDim>
__device__ __forceinline__ bool stored_row_non_finite(const void* data, long long first, int lane) {
  WarpRow<kDim> row;
  row.load(Tag{}, data, first, lane);
  bool bad = false;
#pragma unroll
  for (int c = 0; c < WarpRow<kDim>::kColumns; ++c) bad |= non_finite(row.value[c]);
  return __any_sync(0xffffffffu, bad) != 0;
}

// Whether a problem of this storage is served by the fp32-unit kernels (forward_simt,
// backward_simt), whose logits the rows computed here reproduce bit for bit: q . k as one fma
// chain over the columns in order (WarpRow::ordered_dot), the modifier in the natural domain.
// The backward's P = exp(logit - LSE) must use the logit that made the stored LSE, whichever
// kernel stored it: with another summation order, the logits of the conformance matrix's softcap
// 30 case (scores of standard deviation 16) differ by up to 1e-5, and so does each P relative to
// itself; dV then erred 2.5 to 4.6 times a plain fp32 implementation (emulated in numpy), where
// the tolerance allows 2. The tensor-core kernels' order cannot be reproduced, nor need it be at
// 16-bit tolerances.
template <class Tag>
struct OrderedDot {
  static constexpr bool kValue = false;
};
template <>
struct OrderedDot<Float32Tag> {
  static constexpr bool kValue = true;
};

// Where exact_forward_row finds a sequence's keys and values (element indices of their rows in
// the k and v views, for kv head head_kv) and a query row's position (the modifiers' `q`): a
// dense sequence's keys from kv_offset, queries at positions 0, 1, ... (PagedKeyRows,
// forward_wgmma.cuh: through a page table, queries aligned to the end of the cache).
struct DenseKeyRows {
  int batch;
  int kv_offset;
  __device__ __forceinline__ long long key(const ForwardParams& p, int kv, int head_kv) const {
    return row_index(p.k, batch, kv_offset + kv, head_kv);
  }
  __device__ __forceinline__ long long value(const ForwardParams& p, int kv, int head_kv) const {
    return row_index(p.v, batch, kv_offset + kv, head_kv);
  }
  __device__ __forceinline__ int position(int row) const { return row; }
};

// Output row `row` (a query of the sequence) of head `head`, and its LSE, computed by one warp
// in fp32 over every key of the sequence, the mask evaluated at every one, with online softmax
// in the log2 domain (the natural domain for fp32 storage, as forward_simt: OrderedDot); a
// removed position (mask, or a -inf modified score) is skipped. `keys`: DenseKeyRows or
// PagedKeyRows.
template <class Tag, class Modifier, int kDimQk, int kDimV, class KeyRows>
__device__ __forceinline__ void exact_forward_row(const ForwardParams& p,
                                                  const typename Modifier::Invariants& invariants,
                                                  const Coordinates& at, const SequenceSpan& span,
                                                  int batch, int head, int row, int lane,
                                                  const KeyRows& keys) {
  const int head_kv = head / p.heads_per_kv;
  const int position = keys.position(row);
  WarpRow<kDimQk> query;
  query.load(Tag{}, p.q.data, row_index(p.q, batch, span.q_offset + row, head), lane);
  WarpRow<kDimV> output;
  output.zero();
  float row_max = negative_infinity();
  float row_sum = 0.0f;
  for (int kv = 0; kv < span.kv_len; ++kv) {
    WarpRow<kDimQk> key;
    key.load(Tag{}, p.k.data, keys.key(p, kv, head_kv), lane);
    // fp32: the natural domain and dot order of forward_simt (OrderedDot); else log2.
    constexpr bool kNatural = OrderedDot<Tag>::kValue;
    const float logit = kNatural ? element_logit<Modifier, true, false>(
                                       query.ordered_dot(key), p, invariants, at, position, kv)
                                 : element_logit<Modifier, true, true>(
                                       query.dot(key), p, invariants, at, position, kv);
    if (logit == negative_infinity()) continue;
    // fmaxf ignores a NaN logit; its weight exp(NaN) makes the sum NaN.
    const float new_max = fmaxf(row_max, logit);
    const float correction = kNatural ? expf(row_max - new_max) : exp2f(row_max - new_max);
    const float weight = kNatural ? expf(logit - new_max) : exp2f(logit - new_max);
    row_max = new_max;
    row_sum = row_sum * correction + weight;
#pragma unroll
    for (int c = 0; c < WarpRow<kDimV>::kColumns; ++c) output.value[c] *= correction;
    if (weight != 0.0f) {
      WarpRow<kDimV> value;
      value.load(Tag{}, p.v.data, keys.value(p, kv, head_kv), lane);
      output.add(weight, value);
    }
  }
  const RowResult result = OrderedDot<Tag>::kValue ? finish_row_natural(row_max, row_sum)
                                                   : finish_row_log2(row_max, row_sum);
  output.store(Tag{}, p.o.data, row_index(p.o, batch, span.q_offset + row, head), lane,
               result.inverse_sum);
  if (p.lse != nullptr && lane == 0) {
    *lse_address(p, batch, head, span.q_offset + row) = result.lse;
  }
}

// After a forward block stored rows [q_start, q_start + rows) and `flagged` (barrier_any of the
// threads' non-finite results) is set: the warps recompute the rows whose stored output holds NaN
// or inf. `warp` and `warps`: this warp among the threads that stored. The keys: a dense
// sequence's, or `keys` (PagedKeyRows).
template <class Tag, class Modifier, int kDimQk, int kDimV, class KeyRows>
__device__ __forceinline__ void repair_forward_rows(const ForwardParams& p,
                                                    const SequenceSpan& span, int batch, int head,
                                                    int q_start, int rows, int warp, int warps,
                                                    const KeyRows& keys) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  const Coordinates at{batch, head, span.q_len, span.kv_len};
  const typename Modifier::Invariants invariants = Modifier::prepare(p, at);
  for (int r = warp; r < rows && q_start + r < span.q_len; r += warps) {
    const int row = q_start + r;
    if (stored_row_non_finite<Tag, kDimV>(p.o.data,
                                          row_index(p.o, batch, span.q_offset + row, head), lane)) {
      exact_forward_row<Tag, Modifier, kDimQk, kDimV>(p, invariants, at, span, batch, head, row,
                                                      lane, keys);
    }
  }
}
template <class Tag, class Modifier, int kDimQk, int kDimV>
__device__ __forceinline__ void repair_forward_rows(const ForwardParams& p,
                                                    const SequenceSpan& span, int batch, int head,
                                                    int q_start, int rows, int warp, int warps) {
  repair_forward_rows<Tag, Modifier, kDimQk, kDimV>(p, span, batch, head, q_start, rows, warp,
                                                    warps, DenseKeyRows{batch, span.kv_offset});
}

}  // namespace flexattn_kernels
