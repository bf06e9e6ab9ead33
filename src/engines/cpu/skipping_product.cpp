#include "engines/cpu/skipping_product.hpp"

#include <cmath>

#include "engines/cpu/plan.hpp"

namespace flexattn::cpu {

FiniteTiles::FiniteTiles(const Problem& problem, bool query_side, std::int64_t block)
    : heads_(query_side ? problem.heads_q() : problem.heads_kv()) {
  std::int64_t entries = 0;
  for (std::int64_t b = 0; b < problem.batch(); ++b) {
    const std::int64_t length = query_side ? problem.seq_len_q_of(b) : problem.seq_len_kv_of(b);
    tiles_.push_back(ceil_div(length, block));
    first_.push_back(entries);
    entries += heads_ * tiles_.back();
  }
  states_ = std::vector<std::atomic<std::uint8_t>>(to_size(entries));
}

FiniteTiles::FiniteTiles(const std::vector<std::int64_t>& lengths, std::int64_t heads,
                         std::int64_t block)
    : heads_(heads) {
  std::int64_t entries = 0;
  for (const std::int64_t length : lengths) {
    tiles_.push_back(ceil_div(length, block));
    first_.push_back(entries);
    entries += heads_ * tiles_.back();
  }
  states_ = std::vector<std::atomic<std::uint8_t>>(to_size(entries));
}

bool FiniteTiles::at(std::int64_t batch, std::int64_t head, std::int64_t tile, const float* rows,
                     std::int64_t ld, std::int64_t count, std::int64_t columns) const {
  const std::size_t b = to_size(batch);
  std::atomic<std::uint8_t>& state = states_[to_size(first_[b] + head * tiles_[b] + tile)];
  const std::uint8_t known = state.load(std::memory_order_relaxed);
  if (known != kUnknown) return known == kFinite;
  bool found = false;
  for (std::int64_t r = 0; !found && r < count; ++r) {
    found = kernels().any_non_finite(rows + r * ld, columns, 1);
  }
  state.store(found ? kNonFinite : kFinite, std::memory_order_relaxed);
  return !found;
}

void gemm_skipping_zeros(const Kernels& kernel, const GemmOperands& g, DataOperand data,
                         bool data_finite, std::vector<float>& scratch) {
  if (data_finite) {
    kernel.gemm(g);
    return;
  }
  // The data tile: (rows x columns), element (r, c) at values[r * row_stride + c * column_stride].
  const bool data_is_a = data == DataOperand::kA;
  const std::int64_t rows = data_is_a ? g.m : g.k;
  const std::int64_t columns = data_is_a ? g.k : g.n;
  const float* values = data_is_a ? g.a : g.b;
  const std::int64_t row_stride = data_is_a ? g.a_row_stride : g.ldb;
  const std::int64_t column_stride = data_is_a ? g.a_column_stride : 1;
  // Scanned along its contiguous direction.
  bool finite = true;
  if (column_stride == 1) {
    for (std::int64_t r = 0; finite && r < rows; ++r) {
      finite = !kernel.any_non_finite(values + r * row_stride, columns, 1);
    }
  } else {
    for (std::int64_t c = 0; finite && c < columns; ++c) {
      finite = !kernel.any_non_finite(values + c * column_stride, rows, row_stride);
    }
  }
  if (finite) {
    kernel.gemm(g);
    return;
  }

  // The product on the cleaned data (dense, row-major), then each non-finite entry's terms.
  scratch.resize(static_cast<std::size_t>(rows * columns));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < columns; ++c) {
      const float value = values[r * row_stride + c * column_stride];
      scratch[static_cast<std::size_t>(r * columns + c)] = std::isfinite(value) ? value : 0.0f;
    }
  }
  GemmOperands cleaned = g;
  if (data_is_a) {
    cleaned.a = scratch.data();
    cleaned.a_row_stride = columns;
    cleaned.a_column_stride = 1;
  } else {
    cleaned.b = scratch.data();
    cleaned.ldb = columns;
  }
  kernel.gemm(cleaned);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < columns; ++c) {
      const float value = values[r * row_stride + c * column_stride];
      if (std::isfinite(value)) continue;
      if (data_is_a) {  // A(r, c) reaches C(r, j) through B(c, j)
        for (std::int64_t j = 0; j < g.n; ++j) {
          const float coefficient = g.b[c * g.ldb + j];
          if (coefficient != 0.0f) g.c[r * g.ldc + j] += value * coefficient;
        }
      } else {  // B(r, c) reaches C(i, c) through A(i, r)
        for (std::int64_t i = 0; i < g.m; ++i) {
          const float coefficient = g.a[i * g.a_row_stride + r * g.a_column_stride];
          if (coefficient != 0.0f) g.c[i * g.ldc + c] += coefficient * value;
        }
      }
    }
  }
}

}  // namespace flexattn::cpu
