// Decoding and chunked prefill against a paged KV cache (docs/design.md, "Paged KV cache"): few
// query rows per sequence against many cached keys, a bandwidth-bound problem, on the fp32 units.
//
// A block takes kRows query rows of one (batch, kv head): the query heads of the GQA group times
// the sequence's new tokens, row r being member r % group of query r / group, so one read of a
// key serves the whole group. The block's keys are one of the sequence's `splits` key ranges
// (flash-decoding: the split count fills the multiprocessors where batch x kv heads does not);
// each of its kWarps warps walks every kWarps-th chunk of 32 keys of that range, a lane per key
// for the scores and every lane over the value columns for P V, keeping its own online softmax;
// the warps' results are merged through shared memory, and with several splits the combine
// kernel merges the splits' by their LSE. K chunks pass through shared memory as float; V rows
// are read straight from the pool, coalesced across the lanes.
//
// Non-finite values: a removed position (mask, a -inf modified score, a key past the cache
// length) contributes nothing, its weight is not multiplied by its value (docs/design.md). A
// cache length outside {0} U [q_len, capacity] or a used page id outside [0, pages) is never
// dereferenced: the rows of that sequence come out NaN, with LSE NaN.
#pragma once

#include "forward_common.cuh"
#include "tile_ops.cuh"

namespace flexattn_kernels {

// kVector: the K rows are read 16 bytes at a time (head_dim_qk a multiple of 8 16-bit or 4 fp32
// values, strides and addresses to match: the engine checks); else one element at a time.
template <class ElementTag, int kHeadDimQk_, int kHeadDimV_, int kRows_, bool kVector_>
struct DecodeConfig {
  using Tag = ElementTag;
  static constexpr int kHeadDimQk = kHeadDimQk_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kRows = kRows_;
  static constexpr bool kVector = kVector_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kMinBlocks = 1;
  static constexpr int kChunk = kWarpSize;  // keys per warp step: a lane per key
  // float4 rows (a multiple of 4 plus 4: the lanes' float4 reads of one column fall in different
  // banks) where the head dim allows, else one float of padding.
  static constexpr bool kFloat4Rows = kHeadDimQk % 4 == 0;
  static constexpr int kKeyStride = kFloat4Rows ? kHeadDimQk + 4 : kHeadDimQk + 1;
  // The value columns of a lane: kColumns contiguous ones (lane * kColumns ...) when the head dim
  // is a multiple of 32, else columns lane, lane + 32, ...
  static constexpr bool kContiguousColumns = kHeadDimV % kWarpSize == 0;
  static constexpr int kColumns = (kHeadDimV + kWarpSize - 1) / kWarpSize;
  static constexpr int kKeyFloats = kWarps * kChunk * kKeyStride;
  // The merge: each warp's row maxima, sums and unnormalised output rows.
  static constexpr int kMergeFloats = kWarps * kRows * (kColumns * kWarpSize + 2);
  static constexpr int kSharedBytes =
      (kRows * kHeadDimQk + (kKeyFloats > kMergeFloats ? kKeyFloats : kMergeFloats)) *
      static_cast<int>(sizeof(float));
};

namespace decode_detail {

// Offset of key `key` (a position in sequence `batch`) of kv head `head_kv` in a pool view.
__device__ __forceinline__ long long key_offset(const DecodeParams& d, const SequenceView& view,
                                                int batch, int head_kv, int key) {
  const int page = __ldg(d.page_table + static_cast<long long>(batch) * d.max_pages +
                         key / d.page_size);
  return page * view.batch_stride + (key % d.page_size) * view.token_stride +
         head_kv * view.head_stride;
}

// kCount consecutive storage values at `offset` (16-byte aligned), as float.
template <int kCount, class Tag>
__device__ __forceinline__ void load_vector(Tag, const void* base, long long offset,
                                            float (&out)[kCount]) {
  static_assert(kCount == 8, "16 bytes of bf16 or fp16");
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(base) +
                                                         offset));
  const unsigned short halves[8] = {
      static_cast<unsigned short>(raw.x & 0xffffu), static_cast<unsigned short>(raw.x >> 16),
      static_cast<unsigned short>(raw.y & 0xffffu), static_cast<unsigned short>(raw.y >> 16),
      static_cast<unsigned short>(raw.z & 0xffffu), static_cast<unsigned short>(raw.z >> 16),
      static_cast<unsigned short>(raw.w & 0xffffu), static_cast<unsigned short>(raw.w >> 16)};
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = load_as_float(Tag{}, halves, i);
}
template <int kCount>
__device__ __forceinline__ void load_vector(Float32Tag, const void* base, long long offset,
                                            float (&out)[kCount]) {
  static_assert(kCount == 4, "16 bytes of fp32");
  const float4 raw = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(base) + offset));
  out[0] = raw.x, out[1] = raw.y, out[2] = raw.z, out[3] = raw.w;
}
template <class Tag>
struct VectorWidth {
  static constexpr int kValue = 8;
};
template <>
struct VectorWidth<Float32Tag> {
  static constexpr int kValue = 4;
};

// The loads a lane keeps in flight: the largest divisor of kCount up to 8.
template <int kCount, int kTry = 8>
struct LoadsInFlight {
  static constexpr int kValue = kCount % kTry == 0 ? kTry : LoadsInFlight<kCount, kTry - 1>::kValue;
};
template <int kCount>
struct LoadsInFlight<kCount, 1> {
  static constexpr int kValue = 1;
};

// The warp's chunk of 32 keys from `first` into `keys` (row j: key first + j, as float), zeros
// for keys at or past `end`.
template <class Config>
__device__ __forceinline__ void load_key_chunk(const DecodeParams& d, int batch, int head_kv,
                                               int first, int end, float* keys, int lane) {
  using Tag = typename Config::Tag;
  constexpr int kDim = Config::kHeadDimQk;
  constexpr int kStride = Config::kKeyStride;
  const SequenceView& view = d.fwd.k;
  if constexpr (Config::kVector) {
    constexpr int kWidth = VectorWidth<Tag>::kValue;
    constexpr int kParts = kDim / kWidth;           // vectors per key row
    constexpr int kPerLane = kParts;  // 32 rows * kParts vectors over 32 lanes
    constexpr int kBatch = LoadsInFlight<kPerLane>::kValue;
    static_assert(kDim % kWidth == 0 && kPerLane % kBatch == 0, "whole vectors per lane");
#pragma unroll
    for (int start = 0; start < kPerLane; start += kBatch) {
      float values[kBatch][kWidth];
      int rows[kBatch];
      int parts[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int index = (start + j) * kWarpSize + lane;
        rows[j] = index / kParts;
        parts[j] = index % kParts;
        const int key = first + rows[j];
        if (key < end) {
          load_vector<kWidth>(Tag{}, view.data,
                              key_offset(d, view, batch, head_kv, key) + parts[j] * kWidth,
                              values[j]);
        } else {
#pragma unroll
          for (int e = 0; e < kWidth; ++e) values[j][e] = 0.0f;
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        float* row = keys + rows[j] * kStride + parts[j] * kWidth;
#pragma unroll
        for (int e = 0; e < kWidth; e += 4) {
          *reinterpret_cast<float4*>(row + e) =
              make_float4(values[j][e], values[j][e + 1], values[j][e + 2], values[j][e + 3]);
        }
      }
    }
  } else {
    for (int j = 0; j < Config::kChunk; ++j) {
      const int key = first + j;
      const long long offset = key < end ? key_offset(d, view, batch, head_kv, key) : 0;
      for (int column = lane; column < kDim; column += kWarpSize) {
        keys[j * kStride + column] =
            key < end ? load_as_float(Tag{}, view.data, offset + column) : 0.0f;
      }
    }
  }
}

// dots[r] = q_r . k for this lane's key row `key_row` (query rows in `queries`, kRows x kDim).
template <class Config>
__device__ __forceinline__ void key_dots(const float* queries, const float* key_row,
                                         float (&dots)[Config::kRows]) {
  constexpr int kDim = Config::kHeadDimQk;
#pragma unroll
  for (int r = 0; r < Config::kRows; ++r) dots[r] = 0.0f;
  if constexpr (Config::kFloat4Rows) {
#pragma unroll 4
    for (int column = 0; column < kDim; column += 4) {
      const float4 k = *reinterpret_cast<const float4*>(key_row + column);
#pragma unroll
      for (int r = 0; r < Config::kRows; ++r) {
        const float4 q = *reinterpret_cast<const float4*>(queries + r * kDim + column);
        dots[r] = fmaf(q.x, k.x, dots[r]);
        dots[r] = fmaf(q.y, k.y, dots[r]);
        dots[r] = fmaf(q.z, k.z, dots[r]);
        dots[r] = fmaf(q.w, k.w, dots[r]);
      }
    }
  } else {
#pragma unroll 4
    for (int column = 0; column < kDim; ++column) {
      const float k = key_row[column];
#pragma unroll
      for (int r = 0; r < Config::kRows; ++r) dots[r] = fmaf(queries[r * kDim + column], k, dots[r]);
    }
  }
}

// The column of the lane's c-th value.
template <class Config>
__device__ __forceinline__ int value_column(int lane, int c) {
  return Config::kContiguousColumns ? lane * Config::kColumns + c : c * kWarpSize + lane;
}

// The lane's value columns (Config::kColumns) of the row at `offset`, as float (0 past the dim).
template <class Config>
__device__ __forceinline__ void load_value_columns(const void* data, long long offset, int lane,
                                                   float (&values)[Config::kColumns]) {
  using Tag = typename Config::Tag;
  constexpr int kColumns = Config::kColumns;
  constexpr bool kFloat = VectorWidth<Tag>::kValue == 4;
  constexpr int kBytes = kColumns * (kFloat ? 4 : 2);
  if constexpr (Config::kVector && Config::kContiguousColumns &&
                (kBytes == 4 || kBytes == 8 || kBytes == 16)) {
    // One load of the lane's contiguous columns (aligned: the engine checks the strides).
    unsigned words[kBytes / 4];
    const char* address = static_cast<const char*>(data) +
                          (offset + static_cast<long long>(lane) * kColumns) * (kFloat ? 4 : 2);
    if constexpr (kBytes == 16) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(address));
      words[0] = raw.x, words[1] = raw.y, words[2] = raw.z, words[3] = raw.w;
    } else if constexpr (kBytes == 8) {
      const uint2 raw = __ldg(reinterpret_cast<const uint2*>(address));
      words[0] = raw.x, words[1] = raw.y;
    } else {
      words[0] = __ldg(reinterpret_cast<const unsigned*>(address));
    }
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      if constexpr (kFloat) {
        values[c] = __int_as_float(static_cast<int>(words[c]));
      } else {
        const auto bits = static_cast<unsigned short>((words[c / 2] >> (16 * (c % 2))) & 0xffffu);
        values[c] = load_as_float(Tag{}, &bits, 0);
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = value_column<Config>(lane, c);
      values[c] = Config::kContiguousColumns || column < Config::kHeadDimV
                      ? load_as_float(Tag{}, data, offset + column)
                      : 0.0f;
    }
  }
}

}  // namespace decode_detail

template <class Config, class Modifier>
__device__ __forceinline__ void forward_decode(const DecodeParams& d) {
  using Tag = typename Config::Tag;
  using namespace decode_detail;
  constexpr int kRows = Config::kRows;
  constexpr int kWarps = Config::kWarps;
  constexpr int kThreads = Config::kThreads;
  constexpr int kDimQk = Config::kHeadDimQk;
  constexpr int kDimV = Config::kHeadDimV;
  constexpr int kColumns = Config::kColumns;
  constexpr int kChunk = Config::kChunk;
  extern __shared__ __align__(128) unsigned char shared[];
  float* queries = reinterpret_cast<float*>(shared);  // (kRows, kDimQk)
  float* work = queries + kRows * kDimQk;             // key chunks, then the merge

  const ForwardParams& p = d.fwd;
  const int thread = static_cast<int>(threadIdx.x);
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int split = static_cast<int>(blockIdx.x) % d.splits;
  const int row_block = static_cast<int>(blockIdx.x) / d.splits;
  const int head_kv = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  int q_offset = 0;
  int q_len = p.seq_len_q;
  if (p.cu_seqlens_q != nullptr) {
    q_offset = p.cu_seqlens_q[batch];
    q_len = p.cu_seqlens_q[batch + 1] - q_offset;
  }
  const int group = p.heads_per_kv;
  const int rows_total = group * q_len;
  const int row_first = row_block * kRows;
  if (row_first >= rows_total) return;

  const int cache_len = d.cache_lens[batch];
  const int capacity = d.max_pages * d.page_size;
  bool poisoned = !(cache_len == 0 || (cache_len >= q_len && cache_len <= capacity));
  const int kv_begin = split * d.keys_per_split;
  const int kv_end = poisoned ? kv_begin : ir_min(kv_begin + d.keys_per_split, cache_len);
  // The used page-table entries of this range, each read once per block before any key is.
  if (kv_begin < kv_end) {
    for (int entry = kv_begin / d.page_size + thread; entry <= (kv_end - 1) / d.page_size;
         entry += kThreads) {
      const int page = d.page_table[static_cast<long long>(batch) * d.max_pages + entry];
      poisoned |= page < 0 || page >= d.pages;
    }
  }

  // The block's query rows, their heads, positions and invariants.
  int heads[kRows];
  int positions[kRows];
  for (int index = thread; index < kRows * kDimQk; index += kThreads) {
    const int r = index / kDimQk;
    const int row = row_first + r;
    queries[index] =
        row < rows_total
            ? load_as_float(Tag{}, p.q.data,
                            row_index(p.q, batch, q_offset + row / group,
                                      head_kv * group + row % group) +
                                index % kDimQk)
            : 0.0f;
  }
  typename Modifier::Invariants invariants[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = ir_min(row_first + r, rows_total - 1);  // a row past the end repeats the last
    heads[r] = head_kv * group + row % group;
    positions[r] = cache_len - q_len + row / group;
    invariants[r] = Modifier::prepare(p, Coordinates{batch, heads[r], q_len, cache_len});
  }
  // Also makes the query rows visible.
  poisoned = barrier_any<-1>(poisoned, kThreads);

  float output[kRows][kColumns];
  float row_max[kRows];  // natural-log domain
  float row_sum[kRows];  // this lane's share
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) output[r][c] = 0.0f;
    row_max[r] = negative_infinity();
    row_sum[r] = 0.0f;
  }
  float* keys = work + warp * kChunk * Config::kKeyStride;
  const int end = poisoned ? kv_begin : kv_end;
  for (int first = kv_begin + warp * kChunk; first < end; first += kWarps * kChunk) {
    __syncwarp();  // the previous chunk's rows are read
    load_key_chunk<Config>(d, batch, head_kv, first, end, keys, lane);
    const int key = first + lane;
    const long long value_offset =
        key < end ? key_offset(d, p.v, batch, head_kv, key) : static_cast<long long>(-1);
    __syncwarp();
    float weights[kRows];
    key_dots<Config>(queries, keys + lane * Config::kKeyStride, weights);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const Coordinates at{batch, heads[r], q_len, cache_len};
      // A key past the cache length, the mask and score_mod's -inf give -inf (masked_logit).
      const float logit = element_logit<Modifier, true, false>(weights[r], p, invariants[r], at,
                                                               positions[r], key);
      const float new_max = fmaxf(row_max[r], warp_max(logit));
      const float subtract = safe_max(new_max);
      const float correction = expf(row_max[r] - subtract);
      row_max[r] = new_max;
      weights[r] = expf(logit - subtract);  // the unnormalised probability
      row_sum[r] = row_sum[r] * correction + weights[r];
#pragma unroll
      for (int c = 0; c < kColumns; ++c) output[r][c] *= correction;
    }
    const int keys_here = ir_min(kChunk, end - first);
    for (int source = 0; source < keys_here; ++source) {
      float weight[kRows];
      bool any = false;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        weight[r] = __shfl_sync(0xffffffffu, weights[r], source);
        any |= weight[r] != 0.0f;
      }
      if (!any) continue;  // the same in every lane: a removed key is not read
      const long long offset = __shfl_sync(0xffffffffu, value_offset, source);
      float values[kColumns];
      load_value_columns<Config>(p.v.data, offset, lane, values);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (weight[r] == 0.0f) continue;  // no 0 * NaN
#pragma unroll
        for (int c = 0; c < kColumns; ++c) output[r][c] = fmaf(weight[r], values[c], output[r][c]);
      }
    }
  }

  // Merge the warps' rows: each writes its maxima, sums and outputs, then warp w finishes rows
  // w, w + kWarps, ...
  constexpr int kRowFloats = kColumns * kWarpSize + 2;
  __syncthreads();  // every warp is done with its key chunks (the merge reuses them)
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float* slot = work + (warp * kRows + r) * kRowFloats;
    const float sum = warp_sum(row_sum[r]);
    if (lane == 0) {
      slot[0] = row_max[r];
      slot[1] = sum;
    }
#pragma unroll
    for (int c = 0; c < kColumns; ++c) slot[2 + c * kWarpSize + lane] = output[r][c];
  }
  __syncthreads();
  for (int r = warp; r < kRows; r += kWarps) {
    const int row = row_first + r;
    if (row >= rows_total) break;
    float merged_max = negative_infinity();
    for (int w = 0; w < kWarps; ++w) merged_max = fmaxf(merged_max, work[(w * kRows + r) * kRowFloats]);
    const float subtract = safe_max(merged_max);
    float sum = 0.0f;
    float merged[kColumns];
#pragma unroll
    for (int c = 0; c < kColumns; ++c) merged[c] = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float* slot = work + (w * kRows + r) * kRowFloats;
      // A warp that kept no key has sum 0 and output 0. One whose kept logits were all NaN has
      // max -inf (fmaxf skips NaN) and a NaN sum: its factor 0 times NaN keeps the row NaN.
      if (slot[1] == 0.0f) continue;
      const float factor = expf(slot[0] - subtract);
      sum = fmaf(factor, slot[1], sum);
#pragma unroll
      for (int c = 0; c < kColumns; ++c) merged[c] = fmaf(factor, slot[2 + c * kWarpSize + lane], merged[c]);
    }
    RowResult result = finish_row_natural(merged_max, sum);
    if (poisoned) result = RowResult{__int_as_float(0x7fc00000), __int_as_float(0x7fc00000)};
    const int token = q_offset + row / group;
    const int head = head_kv * group + row % group;
    if (d.splits == 1) {
      const long long o_row = row_index(p.o, batch, token, head);
#pragma unroll
      for (int c = 0; c < kColumns; ++c) {
        const int column = value_column<Config>(lane, c);
        if (Config::kContiguousColumns || column < kDimV) {
          store_from_float(Tag{}, p.o.data, o_row + column, merged[c] * result.inverse_sum);
        }
      }
      if (p.lse != nullptr && lane == 0) *lse_address(p, batch, head, token) = result.lse;
    } else {
      const int flat = p.cu_seqlens_q != nullptr ? token : batch * p.seq_len_q + token;
      const long long partial_row =
          (static_cast<long long>(split) * d.heads_q + head) * d.tokens_q + flat;
#pragma unroll
      for (int c = 0; c < kColumns; ++c) {
        const int column = value_column<Config>(lane, c);
        if (Config::kContiguousColumns || column < kDimV) {
          d.partial_o[partial_row * kDimV + column] = merged[c] * result.inverse_sum;
        }
      }
      if (lane == 0) d.partial_lse[partial_row] = result.lse;
    }
  }
}

// Merges the splits' partial rows (forward_decode with d.splits > 1): one warp per (head, query
// token), weights exp(lse_s - max_s lse_s); a split that kept no key (LSE -inf) adds nothing, a
// NaN one makes the row NaN.
template <class Tag, int kDimV>
__device__ __forceinline__ void decode_combine(const DecodeParams& d) {
  const ForwardParams& p = d.fwd;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const long long row_id = static_cast<long long>(blockIdx.x) * kDecodeCombineRows +
                           static_cast<int>(threadIdx.x) / kWarpSize;
  const int heads_q = d.heads_q;
  if (row_id >= static_cast<long long>(heads_q) * d.tokens_q) return;
  const int head = static_cast<int>(row_id / d.tokens_q);
  const int flat = static_cast<int>(row_id % d.tokens_q);
  const long long stride = static_cast<long long>(heads_q) * d.tokens_q;  // one split's rows
  float merged_max = negative_infinity();
  for (int s = lane; s < d.splits; s += kWarpSize) {
    merged_max = fmaxf(merged_max, d.partial_lse[s * stride + row_id]);
  }
  merged_max = warp_max(merged_max);
  const float subtract = safe_max(merged_max);
  constexpr int kColumns = (kDimV + kWarpSize - 1) / kWarpSize;
  float merged[kColumns];
#pragma unroll
  for (int c = 0; c < kColumns; ++c) merged[c] = 0.0f;
  float sum = 0.0f;
  for (int s = 0; s < d.splits; ++s) {
    const float weight = expf(d.partial_lse[s * stride + row_id] - subtract);
    if (weight == 0.0f) continue;
    sum += weight;
    const float* row = d.partial_o + (s * stride + row_id) * kDimV;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = c * kWarpSize + lane;
      if (column < kDimV) merged[c] = fmaf(weight, row[column], merged[c]);
    }
  }
  const RowResult result = finish_row_natural(merged_max, sum);
  // The row's (batch, token): thd rows count through the sequences (views without a batch
  // stride), fixed-length ones batch-major.
  const int batch = p.cu_seqlens_q != nullptr ? 0 : flat / p.seq_len_q;
  const int token = p.cu_seqlens_q != nullptr ? flat : flat % p.seq_len_q;
  const long long o_row = row_index(p.o, batch, token, head);
#pragma unroll
  for (int c = 0; c < kColumns; ++c) {
    const int column = c * kWarpSize + lane;
    if (column < kDimV) store_from_float(Tag{}, p.o.data, o_row + column, merged[c] * result.inverse_sum);
  }
  if (p.lse != nullptr && lane == 0) *lse_address(p, batch, head, token) = result.lse;
}

}  // namespace flexattn_kernels
