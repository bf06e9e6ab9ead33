// The tile vocabulary for CPUs with AVX2 and FMA (x86-64). Only the functions below are compiled
// for AVX2 (a `target` attribute, not a global -m flag), so nothing shared with the portable code
// is built with instructions an older CPU lacks.
//
// The matrix product is a register-blocked micro-kernel: a 6 x 16 block of C lives in 12 ymm
// registers while the k loop streams one row of B (2 vectors) and broadcasts 6 values of A, so
// every iteration issues 12 FMAs for 8 loads, enough to keep both FMA pipes of a Zen or Skylake
// core busy. 6 x 16 is the largest block whose accumulators, B row and broadcast fit in the 16
// ymm registers.
#include "engines/cpu/kernels.hpp"

#if defined(__x86_64__) && defined(__GNUC__)

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "flexattn/dtype.hpp"

#define FLEXATTN_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace flexattn::cpu {
namespace {

constexpr int kFloats = 8;        // floats per ymm register
constexpr int kBlockRows = 6;     // rows of C per micro-kernel (see the file comment)
constexpr int kBlockVectors = 2;  // vectors of C per row per micro-kernel (16 floats)

template <int kRows, int kVectors>
FLEXATTN_AVX2 inline void micro_kernel(const GemmOperands& g, std::int64_t i0, std::int64_t j0) {
  // Operands in locals: nothing the loop reads may alias C, so the accumulators stay in registers.
  const std::int64_t k = g.k, ldb = g.ldb, ldc = g.ldc;
  const std::int64_t a_row = g.a_row_stride, a_column = g.a_column_stride;
  const float* a = g.a + i0 * a_row;
  const float* b = g.b + j0;
  float* c = g.c + i0 * ldc + j0;
  __m256 acc[kRows][kVectors];  // C[i0 : i0 + kRows, j0 : j0 + kFloats kVectors]
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) {
      acc[r][v] = g.accumulate ? _mm256_loadu_ps(c + r * ldc + kFloats * v) : _mm256_setzero_ps();
    }
  }
  for (std::int64_t p = 0; p < k; ++p) {
    __m256 b_row[kVectors];
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) b_row[v] = _mm256_loadu_ps(b + p * ldb + kFloats * v);
    const float* a_column_p = a + p * a_column;
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m256 a_value = _mm256_broadcast_ss(a_column_p + r * a_row);
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_fmadd_ps(a_value, b_row[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(c + r * ldc + kFloats * v, acc[r][v]);
  }
}

template <int kVectors>
FLEXATTN_AVX2 void row_blocks(const GemmOperands& g, std::int64_t j0) {
  std::int64_t i = 0;
  for (; i + kBlockRows <= g.m; i += kBlockRows) micro_kernel<kBlockRows, kVectors>(g, i, j0);
  switch (g.m - i) {
    case 5:
      micro_kernel<5, kVectors>(g, i, j0);
      break;
    case 4:
      micro_kernel<4, kVectors>(g, i, j0);
      break;
    case 3:
      micro_kernel<3, kVectors>(g, i, j0);
      break;
    case 2:
      micro_kernel<2, kVectors>(g, i, j0);
      break;
    case 1:
      micro_kernel<1, kVectors>(g, i, j0);
      break;
    default:
      break;
  }
}

// Column panels outermost: one panel of B (k x 16) stays in L1 while every row block uses it.
FLEXATTN_AVX2 void gemm_avx2(const GemmOperands& g) {
  std::int64_t j = 0;
  for (; j + kFloats * kBlockVectors <= g.n; j += kFloats * kBlockVectors)
    row_blocks<kBlockVectors>(g, j);
  for (; j < g.n; j += kFloats) row_blocks<1>(g, j);
}

// ---- the narrow product (kernels.hpp): at most 8 columns, vectorised along the rows of C ----

// A maskload/maskstore mask of lanes [0, count), count in 0 .. 8.
FLEXATTN_AVX2 inline __m256i first_lanes(std::int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// x[r] lane j becomes x[j] lane r.
FLEXATTN_AVX2 inline void transpose8(__m256 (&x)[kFloats]) {
  const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]);
  const __m256 t1 = _mm256_unpackhi_ps(x[0], x[1]);
  const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]);
  const __m256 t3 = _mm256_unpackhi_ps(x[2], x[3]);
  const __m256 t4 = _mm256_unpacklo_ps(x[4], x[5]);
  const __m256 t5 = _mm256_unpackhi_ps(x[4], x[5]);
  const __m256 t6 = _mm256_unpacklo_ps(x[6], x[7]);
  const __m256 t7 = _mm256_unpackhi_ps(x[6], x[7]);
  // u_c: column c of rows 0 .. 3 (low half) and column c + 4 (high half); u_{c+4} rows 4 .. 7
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  x[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  x[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  x[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  x[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  x[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  x[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  x[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  x[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Rows i0 .. i0 + 8 kVectors - 1 of C += A^T B with kN columns: a vector of A's row p (8
// consecutive i) times B(p, j) broadcast, summed over p in registers, then transposed into C's
// rows.
template <int kN, int kVectors>
FLEXATTN_AVX2 inline void narrow_accumulate_rows(const NarrowOperands& g, std::int64_t i0) {
  const std::int64_t k = g.k, lda = g.lda, ldb = g.ldb;
  const float* a = g.a + i0;
  __m256 acc[kVectors][kN];
#pragma GCC unroll 4
  for (int v = 0; v < kVectors; ++v) {
#pragma GCC unroll 8
    for (int j = 0; j < kN; ++j) acc[v][j] = _mm256_setzero_ps();
  }
  for (std::int64_t p = 0; p < k; ++p) {
    __m256 a_part[kVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) a_part[v] = _mm256_loadu_ps(a + p * lda + kFloats * v);
    const float* b_row = g.b + p * ldb;
#pragma GCC unroll 8
    for (int j = 0; j < kN; ++j) {
      const __m256 b_value = _mm256_broadcast_ss(b_row + j);
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) acc[v][j] = _mm256_fmadd_ps(a_part[v], b_value, acc[v][j]);
    }
  }
  const __m256i mask = first_lanes(kN);
#pragma GCC unroll 4
  for (int v = 0; v < kVectors; ++v) {
    __m256 rows[kFloats];
#pragma GCC unroll 8
    for (int j = 0; j < kFloats; ++j) rows[j] = j < kN ? acc[v][j] : _mm256_setzero_ps();
    transpose8(rows);
#pragma GCC unroll 8
    for (int r = 0; r < kFloats; ++r) {
      float* c_row = g.c + (i0 + kFloats * v + r) * g.ldc;
      _mm256_maskstore_ps(c_row, mask, _mm256_add_ps(_mm256_maskload_ps(c_row, mask), rows[r]));
    }
  }
}

template <int kN>
FLEXATTN_AVX2 void narrow_accumulate_columns(const NarrowOperands& g) {
  // Accumulators (kVectors x kN), A's vectors and one broadcast within the 16 ymm registers.
  constexpr int kVectors = kN <= 2 ? 4 : kN <= 4 ? 2 : 1;
  std::int64_t i = 0;
  for (; i + kFloats * kVectors <= g.m; i += kFloats * kVectors) {
    narrow_accumulate_rows<kN, kVectors>(g, i);
  }
  for (; i + kFloats <= g.m; i += kFloats) narrow_accumulate_rows<kN, 1>(g, i);
  for (; i < g.m; ++i) {  // rows past the last whole vector
    float* c_row = g.c + i * g.ldc;
    for (std::int64_t p = 0; p < g.k; ++p) {
      const float a = g.a[p * g.lda + i];
      for (int j = 0; j < kN; ++j) c_row[j] += a * g.b[p * g.ldb + j];
    }
  }
}

FLEXATTN_AVX2 void narrow_accumulate_avx2(const NarrowOperands& g) {
  static constexpr NarrowFunction kByColumns[] = {
      narrow_accumulate_columns<1>, narrow_accumulate_columns<2>, narrow_accumulate_columns<3>,
      narrow_accumulate_columns<4>, narrow_accumulate_columns<5>, narrow_accumulate_columns<6>,
      narrow_accumulate_columns<7>, narrow_accumulate_columns<8>};
  if (g.n > 0) kByColumns[std::min<std::int64_t>(g.n, kFloats) - 1](g);
}

// exp(x) for 8 floats: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, and the
// degree-6 minimax polynomial of Cephes' expf (max error about 1 ulp). exp(-inf) and everything
// below the smallest normal float is exactly 0 (the softmax relies on masked scores giving 0);
// above the largest finite result it is +inf; NaN stays NaN.
FLEXATTN_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 kMaxArgument = _mm256_set1_ps(88.3762626647949f);     // log(2^127.5)
  const __m256 kOverflow = _mm256_set1_ps(88.72283905206835f);       // log(FLT_MAX)
  const __m256 kUnderflow = _mm256_set1_ps(-87.33654475055310898f);  // log(FLT_MIN)
  const __m256 kLog2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 kLn2High = _mm256_set1_ps(0.693359375f);  // ln 2 split so n * kLn2High is exact
  const __m256 kLn2Low = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 clamped = _mm256_max_ps(_mm256_min_ps(x, kMaxArgument), kUnderflow);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, kLog2e),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, kLn2High, clamped);
  r = _mm256_fnmadd_ps(n, kLn2Low, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  constexpr int kExponentBias = 127;
  constexpr int kMantissaBits = 23;
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(kExponentBias)), kMantissaBits);
  __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  result = _mm256_blendv_ps(result, _mm256_setzero_ps(), _mm256_cmp_ps(x, kUnderflow, _CMP_LT_OQ));
  result =
      _mm256_blendv_ps(result, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, kOverflow, _CMP_GT_OQ));
  return _mm256_blendv_ps(result, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// tanh(x) for 8 floats, as Cephes' tanhf: an odd polynomial for |x| < 0.625 (where the
// exponential form would cancel), 1 - 2 / (exp(2|x|) + 1) with the sign of x elsewhere.
FLEXATTN_AVX2 inline __m256 tanh8(__m256 x) {
  const __m256 kSmall = _mm256_set1_ps(0.625f);
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256 magnitude = _mm256_andnot_ps(sign_mask, x);
  const __m256 is_small = _mm256_cmp_ps(magnitude, kSmall, _CMP_LT_OQ);
  constexpr int kAllLanes = 0xff;
  const int small_lanes = _mm256_movemask_ps(is_small);
  __m256 small = _mm256_setzero_ps();
  if (small_lanes != 0) {
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    if (small_lanes == kAllLanes) return small;  // softcaps keep most scores here
  }
  const __m256 e = exp8(_mm256_add_ps(magnitude, magnitude));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 large_magnitude =
      _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  const __m256 large = _mm256_or_ps(large_magnitude, _mm256_and_ps(sign_mask, x));
  return _mm256_blendv_ps(large, small, is_small);
}

FLEXATTN_AVX2 inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(one, _mm256_add_ps(one, e));
}

template <__m256 (*kFunction)(__m256)>
FLEXATTN_AVX2 void apply_unary(const float* in, float* out, std::int64_t count) {
  std::int64_t i = 0;
  for (; i + kFloats <= count; i += kFloats)
    _mm256_storeu_ps(out + i, kFunction(_mm256_loadu_ps(in + i)));
  if (i < count) {  // the tail through one padded vector, so it rounds like the rest
    alignas(32) float buffer[kFloats] = {};
    for (std::int64_t t = i; t < count; ++t) buffer[t - i] = in[t];
    _mm256_store_ps(buffer, kFunction(_mm256_load_ps(buffer)));
    for (std::int64_t t = i; t < count; ++t) out[t] = buffer[t - i];
  }
}

FLEXATTN_AVX2 void exp_avx2(const float* in, float* out, std::int64_t count) {
  apply_unary<exp8>(in, out, count);
}
FLEXATTN_AVX2 void tanh_avx2(const float* in, float* out, std::int64_t count) {
  apply_unary<tanh8>(in, out, count);
}
FLEXATTN_AVX2 void sigmoid_avx2(const float* in, float* out, std::int64_t count) {
  apply_unary<sigmoid8>(in, out, count);
}

FLEXATTN_AVX2 void exp_shifted_avx2(float* tile, std::int64_t rows, std::int64_t width,
                                    std::int64_t ld, const float* shift, const float* scale) {
  for (std::int64_t c = 0; c < width; c += kFloats) {
    const __m256 shift_vector = _mm256_loadu_ps(shift + c);
    const __m256 scale_vector =
        scale == nullptr ? _mm256_set1_ps(1.0f) : _mm256_loadu_ps(scale + c);
    for (std::int64_t r = 0; r < rows; ++r) {
      float* at = tile + r * ld + c;
      const __m256 value = exp8(_mm256_sub_ps(_mm256_loadu_ps(at), shift_vector));
      _mm256_storeu_ps(at, _mm256_mul_ps(value, scale_vector));
    }
  }
}

FLEXATTN_AVX2 bool softmax_step_avx2(float* tile, std::int64_t rows, std::int64_t width,
                                     std::int64_t ld, float* row_max, float* row_sum,
                                     float* alpha) {
  const __m256 negative_infinity = _mm256_set1_ps(-INFINITY);
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 any_rescale = _mm256_setzero_ps();
  for (std::int64_t c = 0; c < width; c += kFloats) {
    const __m256 old_max = _mm256_loadu_ps(row_max + c);
    __m256 new_max = old_max;
    for (std::int64_t r = 0; r < rows; ++r) {
      new_max = _mm256_max_ps(new_max, _mm256_loadu_ps(tile + r * ld + c));
    }
    const __m256 shift = _mm256_blendv_ps(new_max, _mm256_setzero_ps(),
                                          _mm256_cmp_ps(new_max, negative_infinity, _CMP_EQ_OQ));
    const __m256 scale = exp8(_mm256_sub_ps(old_max, shift));
    any_rescale = _mm256_or_ps(any_rescale, _mm256_cmp_ps(scale, one, _CMP_NEQ_UQ));
    __m256 sum = _mm256_setzero_ps();
    for (std::int64_t r = 0; r < rows; ++r) {
      float* at = tile + r * ld + c;
      const __m256 value = exp8(_mm256_sub_ps(_mm256_loadu_ps(at), shift));
      _mm256_storeu_ps(at, value);
      sum = _mm256_add_ps(sum, value);
    }
    _mm256_storeu_ps(alpha + c, scale);
    _mm256_storeu_ps(row_sum + c, _mm256_fmadd_ps(scale, _mm256_loadu_ps(row_sum + c), sum));
    _mm256_storeu_ps(row_max + c, new_max);
  }
  return _mm256_movemask_ps(any_rescale) != 0;
}

FLEXATTN_AVX2 void scale_columns_avx2(float* tile, std::int64_t rows, std::int64_t width,
                                      std::int64_t ld, const float* scale) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < width; c += kFloats) {
      float* at = tile + r * ld + c;
      _mm256_storeu_ps(at, _mm256_mul_ps(_mm256_loadu_ps(at), _mm256_loadu_ps(scale + c)));
    }
  }
}

FLEXATTN_AVX2 void column_dot_avx2(const float* a, const float* b, std::int64_t rows,
                                   std::int64_t width, std::int64_t ld, float* out) {
  const __m256 zero = _mm256_setzero_ps();
  for (std::int64_t c = 0; c < width; c += kFloats) {
    __m256 sum = _mm256_loadu_ps(out + c);
    for (std::int64_t r = 0; r < rows; ++r) {
      const __m256 coefficient = _mm256_loadu_ps(a + r * ld + c);
      const __m256 kept = _mm256_cmp_ps(coefficient, zero, _CMP_NEQ_UQ);
      const __m256 term = _mm256_mul_ps(coefficient, _mm256_loadu_ps(b + r * ld + c));
      sum = _mm256_add_ps(sum, _mm256_and_ps(kept, term));
    }
    _mm256_storeu_ps(out + c, sum);
  }
}

FLEXATTN_AVX2 void softmax_gradient_avx2(const float* probs, const float* dmod, float* ds,
                                         float* ds_raw, std::int64_t rows, std::int64_t width,
                                         std::int64_t ld, const float* delta) {
  const __m256 zero = _mm256_setzero_ps();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < width; c += kFloats) {
      const std::int64_t at = r * ld + c;
      const __m256 p = _mm256_loadu_ps(probs + at);
      const __m256 kept = _mm256_cmp_ps(p, zero, _CMP_NEQ_UQ);
      const __m256 value =
          _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(ds + at), _mm256_loadu_ps(delta + c)));
      const __m256 raw = dmod == nullptr ? value : _mm256_mul_ps(value, _mm256_loadu_ps(dmod + at));
      _mm256_storeu_ps(ds + at, _mm256_and_ps(kept, value));
      _mm256_storeu_ps(ds_raw + at, _mm256_and_ps(kept, raw));
    }
  }
}

FLEXATTN_AVX2 void half_to_float_avx2(const std::uint16_t* in, float* out, std::int64_t count) {
  std::int64_t i = 0;
  for (; i + kFloats <= count; i += kFloats) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(bits));
  }
  for (; i < count; ++i) out[i] = to_float(Half{in[i]});
}

// Contiguous values 8 at a time; strided ones and the tail through the portable scan.
FLEXATTN_AVX2 bool any_non_finite_avx2(const float* values, std::int64_t count,
                                       std::int64_t stride) {
  if (stride != 1) return generic_kernels().any_non_finite(values, count, stride);
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  __m256i any = _mm256_setzero_si256();
  std::int64_t i = 0;
  for (; i + kFloats <= count; i += kFloats) {
    const __m256i bits = _mm256_and_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i)), exponent);
    any = _mm256_or_si256(any, _mm256_cmpeq_epi32(bits, exponent));
  }
  return _mm256_testz_si256(any, any) == 0 ||
         generic_kernels().any_non_finite(values + i, count - i, 1);
}

// bfloat16 is the high half of a float: widen to 32 bits and shift.
FLEXATTN_AVX2 void bfloat16_to_float_avx2(const std::uint16_t* in, float* out, std::int64_t count) {
  std::int64_t i = 0;
  for (; i + kFloats <= count; i += kFloats) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i,
                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
  }
  for (; i < count; ++i) out[i] = to_float(BFloat16{in[i]});
}

}  // namespace

const Kernels* avx2_kernels() {
  static const bool kSupported = [] {
    __builtin_cpu_init();
    // "avx2" also checks that the OS saves the ymm registers. F16C is read from CPUID leaf 1
    // (ECX), since Clang's __builtin_cpu_supports does not know "f16c".
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  }();
  static const Kernels kAvx2{"avx2+fma",
                             gemm_avx2,
                             narrow_accumulate_avx2,
                             exp_avx2,
                             tanh_avx2,
                             sigmoid_avx2,
                             exp_shifted_avx2,
                             softmax_step_avx2,
                             scale_columns_avx2,
                             column_dot_avx2,
                             softmax_gradient_avx2,
                             any_non_finite_avx2,
                             half_to_float_avx2,
                             bfloat16_to_float_avx2};
  return kSupported ? &kAvx2 : nullptr;
}

}  // namespace flexattn::cpu

#else  // not x86-64 with GCC/Clang: the portable set only

namespace flexattn::cpu {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace flexattn::cpu

#endif
