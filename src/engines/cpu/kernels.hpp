// The tile vocabulary of the `cpu` engine: a small matrix product, the exponential and the other
// transcendental functions over arrays, and 16-bit float conversion. Every operation has a
// portable version and, where the CPU has AVX2 and FMA, a vectorised one; `kernels()` picks the
// best set once, at run time (no -march flags: the same binary runs everywhere).
#pragma once

#include <cstdint>
#include <string_view>

namespace flexattn::cpu {

// Width of one vector register in floats (AVX2: 256 bits). Tile widths along the vector
// dimension are padded to a multiple of it so every product and row operation runs whole vectors.
inline constexpr std::int64_t kVectorWidth = 8;

// C (m x n) = A (m x k) * B (k x n), or C += A * B when `accumulate`.
// A is read as A(i, p) = a[i * a_row_stride + p * a_column_stride], so one kernel serves both A
// and A transposed; B and C are row-major with leading dimensions ldb and ldc; n must be a
// multiple of kVectorWidth.
struct GemmOperands {
  std::int64_t m = 0, n = 0, k = 0;
  const float* a = nullptr;
  std::int64_t a_row_stride = 0, a_column_stride = 0;
  const float* b = nullptr;
  std::int64_t ldb = 0;
  float* c = nullptr;
  std::int64_t ldc = 0;
  bool accumulate = false;
};

using GemmFunction = void (*)(const GemmOperands& operands);

// O^T += V^T P^T for at most kVectorWidth query columns (a decoding step's rows), vectorised
// along the head dim instead of the columns, so a column past n costs nothing:
// C(i, j) += sum_p A(p, i) B(p, j) with A(p, i) = a[p * lda + i] (V's rows) and B(p, j) =
// b[p * ldb + j] (P^T's rows), C row-major with ldc; columns past n are untouched. n <=
// kVectorWidth. Each element's terms are summed in p order, as in GemmFunction.
struct NarrowOperands {
  std::int64_t m = 0, n = 0, k = 0;
  const float* a = nullptr;
  std::int64_t lda = 0;
  const float* b = nullptr;
  std::int64_t ldb = 0;
  float* c = nullptr;
  std::int64_t ldc = 0;
};
using NarrowFunction = void (*)(const NarrowOperands& operands);
// out[i] = f(in[i]) for i < count; in and out may be the same array.
using UnaryFunction = void (*)(const float* in, float* out, std::int64_t count);
// tile[r * ld + c] = exp(tile[r * ld + c] - shift[c]) * scale[c] for r < rows, c < width (a
// multiple of kVectorWidth); scale null: 1.
using ExpShiftedFunction = void (*)(float* tile, std::int64_t rows, std::int64_t width,
                                    std::int64_t ld, const float* shift, const float* scale);
// One online-softmax step over a score tile (rows x width, width a multiple of kVectorWidth), for
// every column c (one query): new_max = max(row_max[c], max over r of tile[r][c]); shift =
// new_max, or 0 while nothing is kept (-inf) so exp gives 0 rather than NaN; alpha[c] =
// exp(row_max[c] - shift); tile[r][c] = exp(tile[r][c] - shift); row_sum[c] = alpha[c] *
// row_sum[c] + sum over r of tile[r][c]; row_max[c] = new_max. Returns whether any alpha[c] != 1
// (the caller then rescales its accumulator).
using SoftmaxStepFunction = bool (*)(float* tile, std::int64_t rows, std::int64_t width,
                                     std::int64_t ld, float* row_max, float* row_sum, float* alpha);
// tile[r * ld + c] *= scale[c] for r < rows, c < width (a multiple of kVectorWidth).
using ScaleColumnsFunction = void (*)(float* tile, std::int64_t rows, std::int64_t width,
                                      std::int64_t ld, const float* scale);
// out[c] += sum over r < rows of a[r * ld + c] * b[r * ld + c], for c < width (a multiple of
// kVectorWidth); a term with a == 0 is skipped (exactly 0 whatever b holds, NaN included).
using ColumnDotFunction = void (*)(const float* a, const float* b, std::int64_t rows,
                                   std::int64_t width, std::int64_t ld, float* out);
// The softmax backward of a tile: with p = probs[r][c], on entry ds holds dP; on exit
// ds[r][c] = p (dP - delta[c]) and ds_raw[r][c] = ds[r][c] * dmod[r][c] (dmod null: 1), both
// exactly 0 where p == 0 whatever dP or dmod hold there.
using SoftmaxGradientFunction = void (*)(const float* probs, const float* dmod, float* ds,
                                         float* ds_raw, std::int64_t rows, std::int64_t width,
                                         std::int64_t ld, const float* delta);
// Whether any of `count` floats, `stride` apart, is NaN or +-inf.
using AnyNonFiniteFunction = bool (*)(const float* values, std::int64_t count, std::int64_t stride);
// out[i] = float(IEEE binary16 bits in[i]), or of bfloat16 bits in[i].
using HalfToFloatFunction = void (*)(const std::uint16_t* in, float* out, std::int64_t count);

struct Kernels {
  std::string_view isa;  // "avx2+fma" or "generic"
  GemmFunction gemm;
  NarrowFunction narrow_accumulate;
  UnaryFunction exp, tanh, sigmoid;
  ExpShiftedFunction exp_shifted;
  SoftmaxStepFunction softmax_step;
  ScaleColumnsFunction scale_columns;
  ColumnDotFunction column_dot;
  SoftmaxGradientFunction softmax_gradient;
  AnyNonFiniteFunction any_non_finite;
  HalfToFloatFunction half_to_float, bfloat16_to_float;
};

// The best set for this CPU (chosen once with __builtin_cpu_supports).
const Kernels& kernels();
// The portable set (what `kernels()` returns on CPUs without AVX2/FMA); tests compare the two.
const Kernels& generic_kernels();
// The AVX2/FMA set, or null when this CPU lacks AVX2, FMA or F16C.
const Kernels* avx2_kernels();

}  // namespace flexattn::cpu
