// Tile reads and writes through the problem's strides (see tile_io.hpp).
#include "engines/cpu/tile_io.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "engines/cpu/kernels.hpp"
#include "flexattn/dtype.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cpu {

namespace {

// Converts `count` elements of the view's dtype starting at element `offset` to float32.
void convert_to_float(const TensorView& view, std::int64_t offset, std::int64_t count, float* out) {
  switch (view.dtype) {
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(view.data) + offset,
                  static_cast<std::size_t>(count) * sizeof(float));
      return;
    case DType::kF16:
      kernels().half_to_float(static_cast<const std::uint16_t*>(view.data) + offset, out, count);
      return;
    case DType::kBF16:
      kernels().bfloat16_to_float(static_cast<const std::uint16_t*>(view.data) + offset, out,
                                  count);
      return;
    case DType::kF64: {
      const double* in = static_cast<const double*>(view.data) + offset;
      for (std::int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(in[i]);
      return;
    }
    case DType::kI32:
    case DType::kI64:
      break;
  }
  throw_internal(fmt::format("cpu: cannot read {} rows", to_string(view.dtype)));
}

void convert_from_float(const float* in, std::int64_t count, const TensorView& view,
                        std::int64_t offset) {
  switch (view.dtype) {
    case DType::kF32:
      std::memcpy(static_cast<float*>(view.data) + offset, in,
                  static_cast<std::size_t>(count) * sizeof(float));
      return;
    case DType::kF16: {
      Half* out = static_cast<Half*>(view.data) + offset;
      for (std::int64_t i = 0; i < count; ++i) out[i] = to_half(in[i]);
      return;
    }
    case DType::kBF16: {
      BFloat16* out = static_cast<BFloat16*>(view.data) + offset;
      for (std::int64_t i = 0; i < count; ++i) out[i] = to_bfloat16(in[i]);
      return;
    }
    case DType::kF64: {
      double* out = static_cast<double*>(view.data) + offset;
      for (std::int64_t i = 0; i < count; ++i) out[i] = in[i];
      return;
    }
    case DType::kI32:
    case DType::kI64:
      break;
  }
  throw_internal(fmt::format("cpu: cannot write {} rows", to_string(view.dtype)));
}

std::int64_t row_offset(const RowBlock& block, std::int64_t r) {
  return block.rows.first + (block.begin + r) * block.rows.stride;
}

}  // namespace

SequenceRows sequence_rows(const Problem& problem, const TensorView& view, bool query_side,
                           std::int64_t batch, std::int64_t head) {
  const std::vector<std::int64_t>& st = view.strides;
  switch (problem.layout()) {
    case Layout::kBSHD:
      return {batch * st[0] + head * st[2], st[1]};
    case Layout::kSBHD:
      return {batch * st[1] + head * st[2], st[0]};
    case Layout::kBHSD:
      return {batch * st[0] + head * st[1], st[2]};
    case Layout::kTHD: {
      const std::vector<std::int64_t>& offsets =
          query_side ? problem.desc().cu_seqlens_q : problem.desc().cu_seqlens_kv;
      return {offsets[static_cast<std::size_t>(batch)] * st[0] + head * st[1], st[0]};
    }
  }
  throw_internal("cpu: unknown layout");
}

std::int64_t statistic_offset(const Problem& problem, std::int64_t batch, std::int64_t head,
                              std::int64_t query) {
  if (problem.layout() == Layout::kTHD) {
    return head * problem.total_tokens_q() +
           problem.desc().cu_seqlens_q[static_cast<std::size_t>(batch)] + query;
  }
  return (batch * problem.heads_q() + head) * problem.seq_len_q() + query;
}

RowsView float_rows(const TensorView& view, const RowBlock& block, float* buffer) {
  read_rows(view, block, buffer, block.columns, block.count, block.columns);
  return {buffer, block.columns};
}

void read_rows(const TensorView& view, const RowBlock& block, float* out, std::int64_t ld,
               std::int64_t out_rows, std::int64_t out_columns) {
  const std::int64_t columns = std::min(block.columns, out_columns);
  for (std::int64_t r = 0; r < out_rows; ++r) {
    float* row = out + r * ld;  // (out_columns,)
    std::int64_t filled = 0;
    if (r < block.count) {
      convert_to_float(view, row_offset(block, r), columns, row);
      filled = columns;
    }
    std::fill(row + filled, row + out_columns, 0.0f);
  }
}

void prefetch_rows(const TensorView& view, const RowBlock& block) {
  constexpr std::int64_t kLineBytes = 64;
  const auto element = static_cast<std::int64_t>(size_of(view.dtype));
  const std::int64_t bytes = block.columns * element;
  const auto* base = static_cast<const char*>(view.data);
  for (std::int64_t r = 0; r < block.count; ++r) {
    const char* row = base + row_offset(block, r) * element;
    for (std::int64_t at = 0; at < bytes; at += kLineBytes) __builtin_prefetch(row + at, 0, 1);
  }
}

void read_rows_transposed(const TensorView& view, const RowBlock& block, float scale, float* out,
                          std::int64_t ld, std::int64_t out_rows, float* scratch) {
  read_rows(view, block, scratch, block.columns, block.count, block.columns);
  for (std::int64_t c = 0; c < block.columns; ++c) {
    float* column = out + c * ld;  // (out_rows,)
    for (std::int64_t r = 0; r < block.count; ++r) {
      column[r] = scale * scratch[r * block.columns + c];
    }
    std::fill(column + block.count, column + out_rows, 0.0f);
  }
}

void write_rows(const TensorView& view, const RowBlock& block, const float* in, std::int64_t ld) {
  for (std::int64_t r = 0; r < block.count; ++r) {
    convert_from_float(in + r * ld, block.columns, view, row_offset(block, r));
  }
}

void write_rows_transposed(const TensorView& view, const RowBlock& block, const float* in,
                           std::int64_t ld, float scale, float* scratch) {
  for (std::int64_t r = 0; r < block.count; ++r) {
    for (std::int64_t c = 0; c < block.columns; ++c) scratch[c] = scale * in[c * ld + r];
    convert_from_float(scratch, block.columns, view, row_offset(block, r));
  }
}

}  // namespace flexattn::cpu
