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
#include "forward_mma.cuh"
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

// What both paged-cache kernels know of their block's sequence (batch = blockIdx.z, kv head =
// blockIdx.y): its queries (bshd or thd), their rows (the GQA group's heads times the new tokens)
// and its cache length.
struct DecodeSequence {
  int batch;
  int head_kv;
  int q_offset;
  int q_len;
  int group;
  int rows_total;
  int cache_len;

  __device__ __forceinline__ explicit DecodeSequence(const DecodeParams& d)
      : batch(static_cast<int>(blockIdx.z)),
        head_kv(static_cast<int>(blockIdx.y)),
        q_offset(0),
        q_len(d.fwd.seq_len_q),
        group(d.fwd.heads_per_kv),
        rows_total(0),
        cache_len(d.cache_lens[blockIdx.z]) {
    if (d.fwd.cu_seqlens_q != nullptr) {
      q_offset = d.fwd.cu_seqlens_q[batch];
      q_len = d.fwd.cu_seqlens_q[batch + 1] - q_offset;
    }
    rows_total = group * q_len;
  }
  // Row `row`'s query head, token (in the queries' view) and position in the sequence.
  __device__ __forceinline__ int head(int row) const { return head_kv * group + row % group; }
  __device__ __forceinline__ int token(int row) const { return q_offset + row / group; }
  __device__ __forceinline__ int position(int row) const { return cache_len - q_len + row / group; }
};

// The keys [begin, end) of split `split`, and whether this thread found the sequence invalid: a
// length outside {0} U [q_len, capacity], or a used page id outside the pool among the entries
// it read (each used entry of the range is read by one of the block's kThreads threads; the
// caller ORs `poisoned` over the block). An invalid sequence's range is empty: nothing of it is
// ever read.
struct DecodeKeyRange {
  int begin;
  int end;
  bool poisoned;
};
template <int kThreads>
__device__ __forceinline__ DecodeKeyRange decode_key_range(const DecodeParams& d,
                                                           const DecodeSequence& sequence,
                                                           int split, int thread) {
  const int cache_len = sequence.cache_len;
  const int capacity = d.max_pages * d.page_size;
  DecodeKeyRange range;
  range.poisoned = !(cache_len == 0 || (cache_len >= sequence.q_len && cache_len <= capacity));
  range.begin = split * d.keys_per_split;
  range.end = range.poisoned ? range.begin : ir_min(range.begin + d.keys_per_split, cache_len);
  if (range.begin < range.end) {
    for (int entry = range.begin / d.page_size + thread; entry <= (range.end - 1) / d.page_size;
         entry += kThreads) {
      const int page = d.page_table[static_cast<long long>(sequence.batch) * d.max_pages + entry];
      range.poisoned |= page < 0 || page >= d.pages;
    }
  }
  return range;
}

// Where a finished row goes: O and the LSE with one split, else the split's partial rows (fp32)
// for the combine kernel.
template <class Tag, int kDimV>
struct DecodeRowStore {
  const DecodeParams& d;
  int batch;
  int token;
  int head;
  long long index;  // O's row offset, or the partial row

  __device__ __forceinline__ DecodeRowStore(const DecodeParams& params,
                                            const DecodeSequence& sequence, int row, int split)
      : d(params), batch(sequence.batch), token(sequence.token(row)), head(sequence.head(row)) {
    if (d.splits == 1) {
      index = row_index(d.fwd.o, batch, token, head);
    } else {
      const int flat = d.fwd.cu_seqlens_q != nullptr ? token : batch * d.fwd.seq_len_q + token;
      index = (static_cast<long long>(split) * d.heads_q + head) * d.tokens_q + flat;
    }
  }
  __device__ __forceinline__ void value(int column, float x) const {
    if (d.splits == 1) {
      store_from_float(Tag{}, d.fwd.o.data, index + column, x);
    } else {
      d.partial_o[index * kDimV + column] = x;
    }
  }
  __device__ __forceinline__ void lse(float x) const {
    if (d.splits > 1) {
      d.partial_lse[index] = x;
    } else if (d.fwd.lse != nullptr) {
      *lse_address(d.fwd, batch, head, token) = x;
    }
  }
};

}  // namespace decode_detail

// The rows [row_first, row_first + kRows) of the block's sequence and kv head (DecodeSequence)
// over the keys of split `split`.
template <class Config, class Modifier>
__device__ __forceinline__ void forward_decode_rows(const DecodeParams& d, int row_first,
                                                    int split) {
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
  const DecodeSequence sequence(d);
  const int head_kv = sequence.head_kv;
  const int batch = sequence.batch;
  const int q_len = sequence.q_len;
  const int rows_total = sequence.rows_total;
  const int cache_len = sequence.cache_len;
  if (row_first >= rows_total) return;
  // The used page-table entries of this range, each read once per block before any key is.
  const DecodeKeyRange range = decode_key_range<kThreads>(d, sequence, split, thread);
  bool poisoned = range.poisoned;
  const int kv_begin = range.begin;
  const int kv_end = range.end;

  // The block's query rows, their heads, positions and invariants.
  int heads[kRows];
  int positions[kRows];
  for (int index = thread; index < kRows * kDimQk; index += kThreads) {
    const int r = index / kDimQk;
    const int row = row_first + r;
    queries[index] =
        row < rows_total ? load_as_float(Tag{}, p.q.data,
                                         row_index(p.q, batch, sequence.token(row),
                                                   sequence.head(row)) +
                                             index % kDimQk)
                         : 0.0f;
  }
  typename Modifier::Invariants invariants[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = ir_min(row_first + r, rows_total - 1);  // a row past the end repeats the last
    heads[r] = sequence.head(row);
    positions[r] = sequence.position(row);
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
    const DecodeRowStore<Tag, kDimV> store(d, sequence, row, split);
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = value_column<Config>(lane, c);
      if (Config::kContiguousColumns || column < kDimV) {
        store.value(column, merged[c] * result.inverse_sum);
      }
    }
    if (lane == 0) store.lse(result.lse);
  }
}

template <class Config, class Modifier>
__device__ __forceinline__ void forward_decode(const DecodeParams& d) {
  const int row_block = static_cast<int>(blockIdx.x) / d.splits;
  forward_decode_rows<Config, Modifier>(d, row_block * Config::kRows,
                                        static_cast<int>(blockIdx.x) % d.splits);
}

// ---- the tensor-core variant (bf16/fp16, head dims multiples of 8) ------------------------------
//
// The block's kRows query rows (the GQA group's heads times the new tokens, packed into the M
// dimension of mma.sync m16n8k16, rows past the sequence's zero) against one split's keys in
// tiles of kBlockN = 64: all threads copy a tile's K and V rows through the page table into a
// ring of kStages shared-memory buffers (cp.async, 16 bytes a copy, the ring kStages - 1 tiles
// ahead). Decoding (kRows = 16): warp w takes keys 16 w .. 16 w + 15 of each tile for all 16
// rows; chunked prefill (kRows = 64): warp w takes rows 16 w .. 16 w + 15 with all of the tile's
// keys, so one tile load serves four times the rows. Each warp:
//   S = Q K^T (Q's fragments kept in registers), the logits (scale, score_mod, mask, key bounds)
//   per row with its own head's invariants, an online softmax per warp, O += P V.
// With a mask, each pass over up to kListCapacity tiles first lists the tiles where the mask keeps
// some element of the block's rows (list_kept_tiles), and only those are loaded: a sliding
// window reads its window, not the cache, and a causal chunk stops at its last position. The
// warps' rows are merged through shared memory (decoding: the four key ranges of each row, as in
// the fp32 kernel). The products multiply a removed key's weight 0 by its value, so a NaN or inf
// value at a masked position would poison the rows; a block whose finite-input rows come out
// non-finite is computed again by the fp32 kernel (Fallback), which skips removed positions
// (docs/design.md, non-finite values).
template <class ElementTag, int kHeadDimQk_, int kHeadDimV_, int kPaddedQk_, int kPaddedV_,
          int kStages_, int kRows_ = 16>
struct DecodeMmaConfig {
  using Tag = ElementTag;
  static constexpr int kHeadDimQk = kHeadDimQk_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kMinBlocks = 1;
  static constexpr int kRows = kRows_;
  static constexpr int kBlockN = 64;
  // 16 rows (decoding): the warps share them and split each tile's keys, 16 each (one mma step),
  // and their rows are merged at the end. 64 rows (chunked prefill, many new tokens): warp w
  // owns rows 16 w .. 16 w + 15 and multiplies them with all of a tile's keys; nothing to merge.
  static constexpr bool kRowSplit = kRows > 16;
  static constexpr int kWarpKeys = kRowSplit ? kBlockN : kBlockN / kWarps;
  static constexpr int kScoreTiles = kWarpKeys / 8;  // 8-key accumulator tiles per warp
  static constexpr int kMergeWarps = kRowSplit ? 1 : kWarps;  // warps holding a part of a row
  static constexpr int kListCapacity = 512;  // tiles per pass of the kept-tile list
  static constexpr int kStages = kStages_;
  static constexpr int kChunksQk = kPaddedQk_ / kChunkElements;
  static constexpr int kChunksV = kPaddedV_ / kChunkElements;
  static constexpr int kRealChunksQk = kHeadDimQk / kChunkElements;
  static constexpr int kRealChunksV = kHeadDimV / kChunkElements;
  static constexpr int kStepsQk = (kHeadDimQk + 15) / 16;
  static constexpr int kStepsV = (kHeadDimV + 15) / 16;
  static constexpr int kLoadedChunksQk = 2 * kStepsQk;
  static constexpr int kLoadedChunksV = 2 * kStepsV;
  static constexpr int kOutputTiles = 2 * kStepsV;
  static constexpr int kQBytes = kRows * kChunksQk * kChunkBytes;
  static constexpr int kKBytes = kBlockN * kChunksQk * kChunkBytes;
  static constexpr int kVBytes = kBlockN * kChunksV * kChunkBytes;
  // The merge: each warp's part of the rows (max, sum, then the padded output columns).
  static constexpr int kMergeRowFloats = 2 * kStepsV * 8 + 2;
  static constexpr int kMergeBytes =
      kMergeWarps * kRows * kMergeRowFloats * static_cast<int>(sizeof(float));
  static constexpr int kLoopBytes = kQBytes + kStages * (kKBytes + kVBytes);
  using Fallback = DecodeConfig<Tag, kHeadDimQk, kHeadDimV, 8, true>;
  static constexpr int kOwnBytes =
      kLoopBytes > kQBytes + kMergeBytes ? kLoopBytes : kQBytes + kMergeBytes;
  static constexpr int kSharedBytes =
      kOwnBytes > Fallback::kSharedBytes ? kOwnBytes : Fallback::kSharedBytes;

  static_assert(kHeadDimQk % kChunkElements == 0 && kHeadDimV % kChunkElements == 0,
                "head dims of the tensor-core decode kernel are multiples of 8");
  static_assert(kPaddedQk_ % 64 == 0 && kPaddedV_ % 64 == 0, "padded dims are multiples of 64");
  static_assert(kStages >= 2, "at least double buffering");
  static_assert(kRows == 16 || kRows == kWarps * 16, "16 shared rows, or 16 rows per warp");
};

namespace decode_detail {

// Tile `first` .. `first + kBlockN - 1` of the keys: K and V rows through the page table into
// the swizzled buffers, zeros for keys at or past `end` (never read) and for padding chunks.
template <class Config>
__device__ __forceinline__ void load_paged_tile_async(const DecodeParams& d, int batch,
                                                      int head_kv, int first, int end,
                                                      unsigned k_tile, unsigned v_tile,
                                                      int thread) {
  constexpr int kChunks = Config::kLoadedChunksQk > Config::kLoadedChunksV
                              ? Config::kLoadedChunksQk
                              : Config::kLoadedChunksV;
  constexpr int kCopies = Config::kBlockN * kChunks;
  const ForwardParams& p = d.fwd;
  const auto* k_base = static_cast<const unsigned short*>(p.k.data);
  const auto* v_base = static_cast<const unsigned short*>(p.v.data);
#pragma unroll
  for (int index = thread; index < kCopies; index += Config::kThreads) {
    const int row = index / kChunks;
    const int chunk = index % kChunks;
    const int key = first + row;
    const bool inside = key < end;
    int page = 0;
    int slot = 0;
    if (inside) {
      page = __ldg(d.page_table + static_cast<long long>(batch) * d.max_pages + key / d.page_size);
      slot = key % d.page_size;
    }
    if (chunk < Config::kLoadedChunksQk) {
      const bool valid = inside && chunk < Config::kRealChunksQk;
      const long long offset = page * p.k.batch_stride + slot * p.k.token_stride +
                               head_kv * p.k.head_stride + chunk * kChunkElements;
      copy_chunk_async(k_tile + swizzled_offset<Config::kChunksQk>(row, chunk),
                       valid ? k_base + offset : k_base, valid);
    }
    if (chunk < Config::kLoadedChunksV) {
      const bool valid = inside && chunk < Config::kRealChunksV;
      const long long offset = page * p.v.batch_stride + slot * p.v.token_stride +
                               head_kv * p.v.head_stride + chunk * kChunkElements;
      copy_chunk_async(v_tile + swizzled_offset<Config::kChunksV>(row, chunk),
                       valid ? v_base + offset : v_base, valid);
    }
  }
}

// With a mask: lists the tiles of [first, first + count kBlockN) (keys before `end`) where the
// mask keeps some element of the block's rows, in key order (indices from first's tile) in
// `list`, and returns how many. One warp per tile, lane l evaluating rows l % 16 (+ 16, ...) over
// half the tile's keys (stopping at the first kept one); warp 0 compacts the flags in order with
// ballots.
// The mask sees only positions inside the sequence. Ends with a barrier.
template <class Config, class Modifier>
__device__ __forceinline__ int list_kept_tiles(const ForwardParams& p,
                                               const DecodeSequence& sequence, int row_first,
                                               int first, int end, int count,
                                               unsigned short* list) {
  __shared__ unsigned char kept[Config::kListCapacity];
  __shared__ int listed;
  constexpr int kHalf = Config::kBlockN / 2;
  constexpr int kRowGroups = Config::kRows / 16;
  const int thread = static_cast<int>(threadIdx.x);
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  int row[kRowGroups];
  int q[kRowGroups];
  Coordinates at[kRowGroups];
  typename Modifier::Invariants invariants[kRowGroups];
#pragma unroll
  for (int i = 0; i < kRowGroups; ++i) {
    row[i] = row_first + lane % 16 + 16 * i;
    const int clamped = ir_min(row[i], sequence.rows_total - 1);
    at[i] = Coordinates{sequence.batch, sequence.head(clamped), sequence.q_len, sequence.cache_len};
    invariants[i] = Modifier::prepare(p, at[i]);
    q[i] = sequence.position(clamped);
  }
  for (int t = warp; t < count; t += Config::kWarps) {
    const int key0 = first + t * Config::kBlockN + (lane / 16) * kHalf;
    bool keep = false;
#pragma unroll
    for (int i = 0; i < kRowGroups; ++i) {
      if (row[i] < sequence.rows_total) {
        for (int j = 0; j < kHalf && !keep; ++j) {
          const int kv = key0 + j;
          keep = kv < end && Modifier::mask_mod(invariants[i], p, at[i], q[i], kv);
        }
      }
    }
    const bool any = __any_sync(0xffffffffu, keep) != 0;
    if (lane == 0) kept[t] = any ? 1 : 0;
  }
  __syncthreads();
  if (warp == 0) {
    int total = 0;
    for (int base = 0; base < count; base += kWarpSize) {
      const int t = base + lane;
      const bool mine = t < count && kept[t] != 0;
      const unsigned ballot = __ballot_sync(0xffffffffu, mine);
      if (mine) {
        list[total + __popc(ballot & ((1u << lane) - 1u))] = static_cast<unsigned short>(t);
      }
      total += __popc(ballot);
    }
    if (lane == 0) listed = total;
  }
  __syncthreads();
  return listed;
}

// The end of a forward_decode_mma block: each warp's rows (max in log2 units, sum, output
// columns; the warp's rows start at row_offset of the block's) go through the shared memory past
// the Q tile (the stages, which every warp is done with), are merged over the warps that hold a
// part of them, then stored as the split's partial rows or as O and LSE. A row that comes out
// non-finite sends the whole block again through the fp32 kernel, which skips removed positions.
template <class Config, class Modifier>
__device__ __forceinline__ void merge_and_store_rows(
    const DecodeParams& d, const DecodeSequence& sequence, unsigned char* shared, int row_first,
    int row_offset, int split, bool poisoned, const float (&output)[1][Config::kOutputTiles][4],
    const float (&row_max)[1][2], const float (&row_sum)[1][2]) {
  using Tag = typename Config::Tag;
  constexpr int kRows = Config::kRows;
  constexpr int kWarps = Config::kMergeWarps;
  constexpr int kThreads = Config::kThreads;
  constexpr int kDimV = Config::kHeadDimV;
  constexpr int kOutputTiles = Config::kOutputTiles;
  const int thread = static_cast<int>(threadIdx.x);
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group_row = lane / 4;
  const int quad_lane = lane % 4;
  const int rows_total = sequence.rows_total;

  // Each warp's rows: max (log2 units), sum, output columns.
  constexpr int kRowFloats = Config::kMergeRowFloats;
  float* merge = reinterpret_cast<float*>(shared + Config::kQBytes);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int part = Config::kRowSplit ? 0 : warp;
    float* slot = merge + (part * kRows + row_offset + group_row + 8 * half) * kRowFloats;
    const float sum = quad_sum(row_sum[0][half]);
    if (quad_lane == 0) {
      slot[0] = row_max[0][half] * Modifier::kForwardToLog2;  // -inf stays -inf
      slot[1] = sum;
    }
#pragma unroll
    for (int j = 0; j < kOutputTiles; ++j) {
      slot[2 + j * 8 + 2 * quad_lane] = output[0][j][2 * half];
      slot[2 + j * 8 + 2 * quad_lane + 1] = output[0][j][2 * half + 1];
    }
  }
  __syncthreads();
  // Row r = thread / kLanesPerRow of the block, columns thread % kLanesPerRow, + kLanesPerRow,
  // ...: merged, then stored.
  constexpr int kLanesPerRow = kThreads / kRows;
  constexpr int kColumns = (kDimV + kLanesPerRow - 1) / kLanesPerRow;
  const int r = thread / kLanesPerRow;
  const int part = thread % kLanesPerRow;
  const int row = row_first + r;
  float merged[kColumns];
#pragma unroll
  for (int c = 0; c < kColumns; ++c) merged[c] = 0.0f;
  float merged_max = negative_infinity();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    merged_max = fmaxf(merged_max, merge[(w * kRows + r) * kRowFloats]);
  }
  const float subtract = safe_max(merged_max);
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float* slot = merge + (w * kRows + r) * kRowFloats;
    if (slot[1] == 0.0f) continue;  // kept no key (output 0); a NaN sum is merged
    const float factor = fast_exp2(slot[0] - subtract);
    sum = fmaf(factor, slot[1], sum);
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = c * kLanesPerRow + part;
      if (column < kDimV) merged[c] = fmaf(factor, slot[2 + column], merged[c]);
    }
  }
  const RowResult result = finish_row_log2(merged_max, sum);
  bool bad = false;
  if (row < rows_total && !poisoned) {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) bad |= non_finite(merged[c] * result.inverse_sum);
  }
  // A non-finite row: the whole block again on the fp32 units, which skip removed positions.
  if (barrier_any<-1>(bad, kThreads)) {
    constexpr int kFallbackRows = Config::Fallback::kRows;
    static_assert(kRows % kFallbackRows == 0, "the fp32 kernel's blocks tile the rows");
    if constexpr (kRows == 2 * kFallbackRows) {
      // Decoding's two calls written out: as the loop below, the 16-row kernel took 255
      // registers and spilled at head dim 128 (232 and none written out; ptxas, sm_90a).
      forward_decode_rows<typename Config::Fallback, Modifier>(d, row_first, split);
      __syncthreads();  // the first rows' shared memory is no longer read
      forward_decode_rows<typename Config::Fallback, Modifier>(d, row_first + kFallbackRows,
                                                               split);
    } else {
#pragma unroll 1
      for (int first = 0; first < kRows; first += kFallbackRows) {
        if (first > 0) __syncthreads();  // the previous rows' shared memory is no longer read
        forward_decode_rows<typename Config::Fallback, Modifier>(d, row_first + first, split);
      }
    }
    return;
  }
  if (row >= rows_total) return;
  const float nan = __int_as_float(0x7fc00000);
  const float lse = poisoned ? nan : result.lse;
  const float scale = poisoned ? nan : result.inverse_sum;
  const DecodeRowStore<Tag, kDimV> store(d, sequence, row, split);
#pragma unroll
  for (int c = 0; c < kColumns; ++c) {
    const int column = c * kLanesPerRow + part;
    if (column < kDimV) store.value(column, merged[c] * scale);
  }
  if (part == 0) store.lse(lse);
}

}  // namespace decode_detail

template <class Config, class Modifier>
__device__ __forceinline__ void forward_decode_mma(const DecodeParams& d) {
  using Tag = typename Config::Tag;
  using namespace decode_detail;
  constexpr int kRows = Config::kRows;
  constexpr int kThreads = Config::kThreads;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kStages = Config::kStages;
  constexpr int kDimQk = Config::kHeadDimQk;
  constexpr int kOutputTiles = Config::kOutputTiles;
  extern __shared__ __align__(128) unsigned char shared[];

  const ForwardParams& p = d.fwd;
  const int thread = static_cast<int>(threadIdx.x);
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int group_row = lane / 4;  // accumulator row within an 8-row half
  const int quad_lane = lane % 4;
  const int split = static_cast<int>(blockIdx.x) % d.splits;
  const int row_first = static_cast<int>(blockIdx.x) / d.splits * kRows;
  const DecodeSequence sequence(d);
  const int head_kv = sequence.head_kv;
  const int batch = sequence.batch;
  const int q_len = sequence.q_len;
  const int rows_total = sequence.rows_total;
  const int cache_len = sequence.cache_len;
  if (row_first >= rows_total) return;
  const DecodeKeyRange range = decode_key_range<kThreads>(d, sequence, split, thread);
  bool poisoned = range.poisoned;
  const int kv_begin = range.begin;
  const int kv_end = range.end;

  const unsigned q_tile = shared_address(shared);
  const unsigned k_tiles = q_tile + Config::kQBytes;
  const unsigned v_tiles = k_tiles + kStages * Config::kKBytes;
  // Q's 16 rows (as stored, any strides) into the swizzled tile, zeros past the rows and dims.
  for (int index = thread; index < kRows * Config::kChunksQk * kChunkElements;
       index += kThreads) {
    const int r = index / (Config::kChunksQk * kChunkElements);
    const int column = index % (Config::kChunksQk * kChunkElements);
    const int row = row_first + r;
    unsigned short bits = 0;
    if (row < rows_total && column < kDimQk) {
      bits = static_cast<const unsigned short*>(
          p.q.data)[row_index(p.q, batch, sequence.token(row), sequence.head(row)) + column];
    }
    *reinterpret_cast<unsigned short*>(
        shared + swizzled_offset<Config::kChunksQk>(r, column / kChunkElements) +
        (column % kChunkElements) * 2) = bits;
  }
  // Also makes Q visible.
  poisoned = barrier_any<-1>(poisoned, kThreads);
  const int end = poisoned ? kv_begin : kv_end;
  const int tiles = (end - kv_begin + kBlockN - 1) / kBlockN;

  // The warp's rows (all 16 of the block's, or its own 16) and keys of each tile (16 of them, or
  // all).
  const int row_offset = Config::kRowSplit ? warp * 16 : 0;
  const int key_offset = Config::kRowSplit ? 0 : warp * Config::kWarpKeys;
  // This thread's rows group_row and group_row + 8 of the warp's: head, position, invariants.
  int query[1][2];
  Coordinates at[2];
  typename Modifier::Invariants invariants[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = ir_min(row_first + row_offset + group_row + 8 * half, rows_total - 1);
    at[half] = Coordinates{batch, sequence.head(row), q_len, cache_len};
    query[0][half] = sequence.position(row);
    invariants[half] = Modifier::prepare(p, at[half]);
  }
  unsigned q_fragment[Config::kStepsQk][4];
  {
    const LaneOffsets<Config::kChunksQk> q_lane(row_offset + lane % 16, lane / 16);
#pragma unroll
    for (int step = 0; step < Config::kStepsQk; ++step) {
      load_matrix_x4(q_fragment[step], q_tile + q_lane.at(step, 0));
    }
  }
  const LaneOffsets<Config::kChunksQk> k_lane((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  const LaneOffsets<Config::kChunksV> v_lane(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

  float output[1][kOutputTiles][4];
  float row_max[1][2];
  float row_sum[1][2];
#pragma unroll
  for (int j = 0; j < kOutputTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) output[0][j][e] = 0.0f;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_max[0][half] = negative_infinity();
    row_sum[0][half] = 0.0f;
  }

  // The split's tiles in passes of up to kListCapacity: with a mask, first the list of the tiles
  // where it keeps some element (a tile it removes entirely is never loaded), in key order.
  constexpr int kListCapacity = Config::kListCapacity;
  __shared__ unsigned short tile_list[kListCapacity];
  for (int pass_first = 0; pass_first < tiles; pass_first += kListCapacity) {
    const int pass_tiles = ir_min(kListCapacity, tiles - pass_first);
    int listed = pass_tiles;
    if constexpr (Modifier::kHasMask) {
      listed = list_kept_tiles<Config, Modifier>(p, sequence, row_first,
                                                 kv_begin + pass_first * kBlockN, end, pass_tiles,
                                                 tile_list);
    }
    // The key where listed tile i starts.
    const auto tile_start = [&](int i) {
      const int tile = Modifier::kHasMask ? static_cast<int>(tile_list[i]) : i;
      return kv_begin + (pass_first + tile) * kBlockN;
    };
#pragma unroll
    for (int stage = 0; stage < kStages - 1; ++stage) {
      if (stage < listed) {
        load_paged_tile_async<Config>(d, batch, head_kv, tile_start(stage), end,
                                      k_tiles + stage * Config::kKBytes,
                                      v_tiles + stage * Config::kVBytes, thread);
      }
      commit_copies();
    }
    for (int index = 0; index < listed; ++index) {
      const int stage = index % kStages;
      wait_copies<kStages - 2>();
      __syncthreads();  // tile `index` visible; the buffer refilled below is no longer read
      if (index + kStages - 1 < listed) {
        const int next = (index + kStages - 1) % kStages;
        load_paged_tile_async<Config>(d, batch, head_kv, tile_start(index + kStages - 1), end,
                                      k_tiles + next * Config::kKBytes,
                                      v_tiles + next * Config::kVBytes, thread);
      }
      commit_copies();
      const unsigned k_tile = k_tiles + stage * Config::kKBytes;
      const unsigned v_tile = v_tiles + stage * Config::kVBytes;
      const int warp_first = tile_start(index) + key_offset;
      constexpr int kScoreTiles = Config::kScoreTiles;
      float score[1][kScoreTiles][4];
#pragma unroll
      for (int j = 0; j < kScoreTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) score[0][j][e] = 0.0f;
      }
#pragma unroll
      for (int step = 0; step < Config::kStepsQk; ++step) {
#pragma unroll
        for (int pair = 0; pair < kScoreTiles / 2; ++pair) {
          unsigned k_fragment[4];
          load_matrix_x4(k_fragment, k_tile + k_lane.at(step, key_offset + pair * 16));
          mma_16x8x16(Tag{}, score[0][2 * pair], q_fragment[step], k_fragment[0], k_fragment[1]);
          mma_16x8x16(Tag{}, score[0][2 * pair + 1], q_fragment[step], k_fragment[2],
                      k_fragment[3]);
        }
      }
      // Logits, each row with its own head; keys at or past `end` (the split's or the cache's)
      // are removed.
#pragma unroll
      for (int j = 0; j < kScoreTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kv = warp_first + j * 8 + 2 * quad_lane + e % 2;
          const int half = e / 2;
          const float logit = element_logit<Modifier, true, true, false, true>(
              score[0][j][e], p, invariants[half], at[half], query[0][half], kv);
          score[0][j][e] = kv < end ? logit : negative_infinity();
        }
      }
      online_softmax(score, row_max, row_sum, output, Modifier::kForwardToLog2);
      // O += P V, 16 keys a step: the S accumulators of two adjacent key tiles form one A
      // fragment.
#pragma unroll
      for (int step = 0; step < kScoreTiles / 2; ++step) {
        unsigned p_fragment[4];
        p_fragment[0] = pack_pair(Tag{}, score[0][2 * step][0], score[0][2 * step][1]);
        p_fragment[1] = pack_pair(Tag{}, score[0][2 * step][2], score[0][2 * step][3]);
        p_fragment[2] = pack_pair(Tag{}, score[0][2 * step + 1][0], score[0][2 * step + 1][1]);
        p_fragment[3] = pack_pair(Tag{}, score[0][2 * step + 1][2], score[0][2 * step + 1][3]);
#pragma unroll
        for (int pair = 0; pair < Config::kStepsV; ++pair) {
          unsigned v_fragment[4];
          load_matrix_x4_transposed(v_fragment,
                                    v_tile + v_lane.at(pair, key_offset + step * 16));
          mma_16x8x16(Tag{}, output[0][2 * pair], p_fragment, v_fragment[0], v_fragment[1]);
          mma_16x8x16(Tag{}, output[0][2 * pair + 1], p_fragment, v_fragment[2], v_fragment[3]);
        }
      }
    }
    wait_copies<0>();
    __syncthreads();  // the pass's stages and list are no longer read
  }
  // Every warp is done with the tiles (the last pass ended with a barrier): the merge reuses them.
  merge_and_store_rows<Config, Modifier>(d, sequence, shared, row_first, row_offset, split,
                                         poisoned, output, row_max, row_sum);
}

// Merges the splits' partial rows (forward_decode with d.splits > 1): one block per (head, query
// token), weights exp(lse_s - max_s lse_s); a split that kept no key (LSE -inf) adds nothing, a
// NaN one makes the row NaN. Warp w sums splits w, w + kWarps, ... (so a row's partial rows are
// read kWarps at a time, not one after another), then warp 0 adds the warps' sums in order.
template <class Tag, int kDimV>
__device__ __forceinline__ void decode_combine(const DecodeParams& d) {
  constexpr int kWarps = kDecodeCombineThreads / kWarpSize;
  constexpr int kColumns = (kDimV + kWarpSize - 1) / kWarpSize;
  // Each warp's weighted columns, then its sum of weights.
  __shared__ float parts[kWarps][kColumns * kWarpSize + 1];
  const ForwardParams& p = d.fwd;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const long long row_id = blockIdx.x;
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
  float merged[kColumns];
#pragma unroll
  for (int c = 0; c < kColumns; ++c) merged[c] = 0.0f;
  float sum = 0.0f;
  // This warp's splits, 32 of their weights at a time, one per lane, then broadcast: the partial
  // rows' loads do not wait on their weight's load.
  const int own_count = (d.splits - warp + kWarps - 1) / kWarps;
  for (int base = 0; base < own_count; base += kWarpSize) {
    const int own = base + lane;
    const float own_weight =
        own < own_count ? expf(d.partial_lse[(own * kWarps + warp) * stride + row_id] - subtract)
                        : 0.0f;
    const int count = ir_min(kWarpSize, own_count - base);
#pragma unroll 4
    for (int j = 0; j < count; ++j) {
      const float weight = __shfl_sync(0xffffffffu, own_weight, j);
      if (weight == 0.0f) continue;  // the same in every lane
      sum += weight;
      const float* row = d.partial_o + (((base + j) * kWarps + warp) * stride + row_id) * kDimV;
#pragma unroll
      for (int c = 0; c < kColumns; ++c) {
        const int column = c * kWarpSize + lane;
        if (column < kDimV) merged[c] = fmaf(weight, row[column], merged[c]);
      }
    }
  }
  // The warps' sums through shared memory, added by warp 0 in warp order (the same bits on every
  // run).
#pragma unroll
  for (int c = 0; c < kColumns; ++c) parts[warp][c * kWarpSize + lane] = merged[c];
  if (lane == 0) parts[warp][kColumns * kWarpSize] = sum;
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int c = 0; c < kColumns; ++c) merged[c] = parts[0][c * kWarpSize + lane];
  sum = parts[0][kColumns * kWarpSize];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) merged[c] += parts[w][c * kWarpSize + lane];
    sum += parts[w][kColumns * kWarpSize];
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
