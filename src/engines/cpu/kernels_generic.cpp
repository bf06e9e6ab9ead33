// The portable tile vocabulary: plain loops the compiler may vectorise for the baseline ISA.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "engines/cpu/kernels.hpp"
#include "flexattn/dtype.hpp"

namespace flexattn::cpu {
namespace {

void gemm_generic(const GemmOperands& g) {
  for (std::int64_t i = 0; i < g.m; ++i) {
    float* c_row = g.c + i * g.ldc;  // (n,)
    if (!g.accumulate) {
      for (std::int64_t j = 0; j < g.n; ++j) c_row[j] = 0.0f;
    }
    for (std::int64_t p = 0; p < g.k; ++p) {
      const float a = g.a[i * g.a_row_stride + p * g.a_column_stride];
      const float* b_row = g.b + p * g.ldb;  // (n,)
      for (std::int64_t j = 0; j < g.n; ++j) c_row[j] += a * b_row[j];
    }
  }
}

void narrow_accumulate_generic(const NarrowOperands& g) {
  for (std::int64_t i = 0; i < g.m; ++i) {
    float* c_row = g.c + i * g.ldc;
    for (std::int64_t p = 0; p < g.k; ++p) {
      const float a = g.a[p * g.lda + i];
      const float* b_row = g.b + p * g.ldb;
      for (std::int64_t j = 0; j < g.n; ++j) c_row[j] += a * b_row[j];
    }
  }
}

void exp_generic(const float* in, float* out, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = std::exp(in[i]);
}

void tanh_generic(const float* in, float* out, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = std::tanh(in[i]);
}

void sigmoid_generic(const float* in, float* out, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = 1.0f / (1.0f + std::exp(-in[i]));
}

void exp_shifted_generic(float* tile, std::int64_t rows, std::int64_t width, std::int64_t ld,
                         const float* shift, const float* scale) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = tile + r * ld;  // (width,)
    for (std::int64_t c = 0; c < width; ++c) {
      row[c] = std::exp(row[c] - shift[c]);
      if (scale != nullptr) row[c] *= scale[c];
    }
  }
}

bool softmax_step_generic(float* tile, std::int64_t rows, std::int64_t width, std::int64_t ld,
                          float* row_max, float* row_sum, float* alpha) {
  constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
  bool rescale = false;
  for (std::int64_t c = 0; c < width; ++c) {
    float new_max = row_max[c];
    for (std::int64_t r = 0; r < rows; ++r) new_max = std::max(new_max, tile[r * ld + c]);
    const float shift = new_max == kNegativeInfinity ? 0.0f : new_max;
    alpha[c] = std::exp(row_max[c] - shift);
    rescale = rescale || alpha[c] != 1.0f;
    float sum = 0.0f;
    for (std::int64_t r = 0; r < rows; ++r) {
      tile[r * ld + c] = std::exp(tile[r * ld + c] - shift);
      sum += tile[r * ld + c];
    }
    row_sum[c] = alpha[c] * row_sum[c] + sum;
    row_max[c] = new_max;
  }
  return rescale;
}

void scale_columns_generic(float* tile, std::int64_t rows, std::int64_t width, std::int64_t ld,
                           const float* scale) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < width; ++c) tile[r * ld + c] *= scale[c];
  }
}

void column_dot_generic(const float* a, const float* b, std::int64_t rows, std::int64_t width,
                        std::int64_t ld, float* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < width; ++c) {
      const float term = a[r * ld + c] * b[r * ld + c];
      out[c] += a[r * ld + c] != 0.0f ? term : 0.0f;
    }
  }
}

void softmax_gradient_generic(const float* probs, const float* dmod, float* ds, float* ds_raw,
                              std::int64_t rows, std::int64_t width, std::int64_t ld,
                              const float* delta) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < width; ++c) {
      const std::int64_t at = r * ld + c;
      const bool kept = probs[at] != 0.0f;
      const float value = probs[at] * (ds[at] - delta[c]);
      ds[at] = kept ? value : 0.0f;
      ds_raw[at] = kept ? (dmod == nullptr ? value : value * dmod[at]) : 0.0f;
    }
  }
}

void half_to_float_generic(const std::uint16_t* in, float* out, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = to_float(Half{in[i]});
}

// An OR of integer compares of the exponent bits (all ones for NaN and +-inf only), which
// vectorises with baseline SSE2 (an unsigned maximum, which SSE2 lacks, scanned 1.8 to 3.5 times
// slower).
bool any_non_finite_generic(const float* values, std::int64_t count, std::int64_t stride) {
  constexpr std::uint32_t kExponentBits = 0x7f800000u;
  std::uint32_t any = 0;
  for (std::int64_t i = 0; i < count; ++i) {
    any |= static_cast<std::uint32_t>(
        (std::bit_cast<std::uint32_t>(values[i * stride]) & kExponentBits) == kExponentBits);
  }
  return any != 0;
}

void bfloat16_to_float_generic(const std::uint16_t* in, float* out, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = to_float(BFloat16{in[i]});
}

}  // namespace

const Kernels& generic_kernels() {
  static const Kernels kGeneric{"generic",
                                gemm_generic,
                                narrow_accumulate_generic,
                                exp_generic,
                                tanh_generic,
                                sigmoid_generic,
                                exp_shifted_generic,
                                softmax_step_generic,
                                scale_columns_generic,
                                column_dot_generic,
                                softmax_gradient_generic,
                                any_non_finite_generic,
                                half_to_float_generic,
                                bfloat16_to_float_generic};
  return kGeneric;
}

const Kernels& kernels() {
  static const Kernels* const kBest = [] {
    const Kernels* avx2 = avx2_kernels();
    return avx2 != nullptr ? avx2 : &generic_kernels();
  }();
  return *kBest;
}

}  // namespace flexattn::cpu
