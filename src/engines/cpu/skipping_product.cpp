#include "engines/cpu/skipping_product.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace flexattn::cpu {

namespace {

// The exponent bits of a float: all ones for NaN and +-inf, and only for them.
constexpr std::uint32_t kExponentBits = 0x7f800000u;

// Whether any of `count` floats, `stride` apart, is NaN or infinite (an integer maximum of the
// exponent bits, which vectorises).
bool any_non_finite(const float* values, std::int64_t count, std::int64_t stride) {
  std::uint32_t largest = 0;
  for (std::int64_t i = 0; i < count; ++i) {
    largest = std::max(largest, std::bit_cast<std::uint32_t>(values[i * stride]) & kExponentBits);
  }
  return largest == kExponentBits;
}

}  // namespace

void gemm_skipping_zeros(const Kernels& kernel, const GemmOperands& g, DataOperand data,
                         std::vector<float>& scratch) {
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
      finite = !any_non_finite(values + r * row_stride, columns, 1);
    }
  } else {
    for (std::int64_t c = 0; finite && c < columns; ++c) {
      finite = !any_non_finite(values + c * column_stride, rows, row_stride);
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
