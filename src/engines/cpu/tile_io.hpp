// Moving tiles between the problem's strided views (any layout, fp32/fp16/bf16) and the engine's
// dense float32 tile buffers.
#pragma once

#include <cstdint>

#include "flexattn/problem.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn::cpu {

// Where the rows of one (batch, head) sequence of a Q/K/V/O-like view live: every layout places
// consecutive positions of a sequence at a constant stride.
struct SequenceRows {
  std::int64_t first = 0;   // element offset of position 0, dimension 0
  std::int64_t stride = 0;  // elements between consecutive positions
};
// query_side: the view is indexed by query positions (q, o, dout, dq), else by key positions.
SequenceRows sequence_rows(const Problem& problem, const TensorView& view, bool query_side,
                           std::int64_t batch, std::int64_t head);

// Offset of the (batch, head, query) entry of an LSE-shaped (contiguous) statistic: (batch,
// heads_q, seq_len_q), or (heads_q, total tokens) for thd.
std::int64_t statistic_offset(const Problem& problem, std::int64_t batch, std::int64_t head,
                              std::int64_t query);

// A block of rows [begin, begin + count) x columns [0, columns) of one sequence.
struct RowBlock {
  SequenceRows rows;
  std::int64_t begin = 0, count = 0, columns = 0;
};

// A tile of rows as dense float32, in `buffer` (count * columns floats). Always a copy, even of
// fp32 views: rows of a bshd/sbhd view lie heads * head_dim apart, a power-of-two stride that
// maps a tile's rows onto a few L1 sets; packed, the products run about 20% faster (measured,
// docs/performance.md).
struct RowsView {
  const float* rows = nullptr;
  std::int64_t ld = 0;  // elements between rows
};
RowsView float_rows(const TensorView& view, const RowBlock& block, float* buffer);

// Reads the block as float32 into out (row-major, leading dimension ld): out[r * ld + c] for
// r < out_rows, c < out_columns, zero outside the block.
void read_rows(const TensorView& view, const RowBlock& block, float* out, std::int64_t ld,
               std::int64_t out_rows, std::int64_t out_columns);

// Asks the CPU to start loading the block's rows into its caches (software prefetches of every
// cache line of them), so a later read_rows finds them there.
void prefetch_rows(const TensorView& view, const RowBlock& block);

// Reads the block transposed and scaled: out[c * ld + r] = scale * x[r][c] for c < columns and
// r < out_rows (zero for r >= count). `scratch` holds count * columns floats.
void read_rows_transposed(const TensorView& view, const RowBlock& block, float scale, float* out,
                          std::int64_t ld, std::int64_t out_rows, float* scratch);

// Writes in[r * ld + c] (r < count, c < columns), rounded to the view's dtype.
void write_rows(const TensorView& view, const RowBlock& block, const float* in, std::int64_t ld);

// Writes scale * in[c * ld + r] to row r, column c of the block (the transposed tile).
// `scratch` holds `columns` floats.
void write_rows_transposed(const TensorView& view, const RowBlock& block, const float* in,
                           std::int64_t ld, float scale, float* scratch);

}  // namespace flexattn::cpu
