// Scalar vocabulary of the generated modifier code and the kernels: the IR's integer and
// floating-point semantics (docs/design.md section 3) and the 16-bit storage conversions. Written
// without any header so NVRTC needs no include path.
#pragma once

namespace flexattn_kernels {

__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

// ---- IR semantics ----------------------------------------------------------------------------

// i32 arithmetic wraps to 32 bits (two's complement), as the IR's evaluator defines it.
__device__ __forceinline__ int ir_add(int a, int b) {
  return static_cast<int>(static_cast<unsigned>(a) + static_cast<unsigned>(b));
}
__device__ __forceinline__ int ir_sub(int a, int b) {
  return static_cast<int>(static_cast<unsigned>(a) - static_cast<unsigned>(b));
}
__device__ __forceinline__ int ir_mul(int a, int b) {
  return static_cast<int>(static_cast<unsigned>(a) * static_cast<unsigned>(b));
}
__device__ __forceinline__ int ir_neg(int a) {
  return static_cast<int>(0u - static_cast<unsigned>(a));
}
__device__ __forceinline__ float ir_add(float a, float b) { return a + b; }
__device__ __forceinline__ float ir_sub(float a, float b) { return a - b; }
__device__ __forceinline__ float ir_mul(float a, float b) { return a * b; }
__device__ __forceinline__ float ir_neg(float a) { return -a; }

// i32 division rounds toward negative infinity (Python's //); x / 0 == 0.
__device__ __forceinline__ int ir_div(int a, int b) {
  if (b == 0) return 0;
  if (b == -1) return ir_neg(a);  // INT_MIN / -1 wraps instead of trapping
  int quotient = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --quotient;
  return quotient;
}
__device__ __forceinline__ float ir_div(float a, float b) { return a / b; }

// Modulo takes the sign of the divisor (Python's %); x % 0 == 0.
__device__ __forceinline__ int ir_mod(int a, int b) {
  if (b == 0 || b == -1) return 0;
  int remainder = a % b;
  if (remainder != 0 && ((remainder < 0) != (b < 0))) remainder += b;
  return remainder;
}
__device__ __forceinline__ float ir_mod(float a, float b) {
  if (b == 0.0f) return 0.0f;
  float remainder = fmodf(a, b);
  if (remainder != 0.0f && ((remainder < 0.0f) != (b < 0.0f))) remainder += b;
  return remainder;
}

__device__ __forceinline__ int ir_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int ir_max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float ir_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ float ir_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ int ir_clamp(int x, int lo, int hi) { return ir_min(ir_max(x, lo), hi); }
__device__ __forceinline__ float ir_clamp(float x, float lo, float hi) {
  return ir_min(ir_max(x, lo), hi);
}
__device__ __forceinline__ int ir_abs(int x) { return x < 0 ? ir_neg(x) : x; }
__device__ __forceinline__ float ir_abs(float x) { return fabsf(x); }
__device__ __forceinline__ float ir_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// tanh(x) without branches, for the tensor-core kernels' element pipelines (softcap runs it on
// every score; the fp32 kernels keep tanhf). For
// |x| >= 0.6: 1 - 2 / (exp(2|x|) + 1) with the hardware's ex2 and reciprocal, carrying the sign;
// it saturates to 1 on its own (exp overflows to inf, the reciprocal to 0), so no clamp. Below 0.6
// that form cancels, and x + x^3 P(x^2) takes over: P is our own fit (weighted least squares,
// reweighted towards minimax, on the relative error of tanh over [0, 0.6]); evaluated in fp32 it
// is within 0.77 ulp of tanh over every float of [2^-14, 0.6] (scripts/tanh-fit.py), and the
// exponential branch is within the few ulp of ex2.approx/rcp.approx, as CUDA's tanhf.
// ir_tanh_small: the polynomial branch alone, which ir_tanh returns exactly when
// |x| < kTanhSmallLimit. The kernels run it on a whole tile when its scores' bound shows every
// argument is below the limit (Modifier::tanh_args_small): the same value per element, without the
// two MUFU instructions of the exponential branch.
constexpr float kTanhSmallLimit = 0.6f;
__device__ __forceinline__ float ir_tanh_small(float x) {
  const float square = x * x;
  float poly = fmaf(-0.0058951606042683125f, square, 0.020795974880456924f);
  poly = fmaf(poly, square, -0.053783830255270004f);
  poly = fmaf(poly, square, 0.13331924378871918f);
  poly = fmaf(poly, square, -0.33333298563957214f);
  return fmaf(x * square, poly, x);
}
__device__ __forceinline__ float ir_tanh(float x) {
  const float magnitude = fabsf(x);
  float exponential;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(exponential) : "f"(magnitude * 2.8853900817779268f));
  float reciprocal;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(reciprocal) : "f"(exponential + 1.0f));
  const float large = copysignf(fmaf(-2.0f, reciprocal, 1.0f), x);
  const float small = ir_tanh_small(x);
  return magnitude >= kTanhSmallLimit ? large : small;
}
// float(x) for an i32 the code generator knows (by the IR's interval analysis at plan time) lies
// in [-2^22, 2^22): x added to the bits of 1.5 * 2^23 is the float 1.5 * 2^23 + x exactly (the
// exponent stays, the ulp is 1), and subtracting 1.5 * 2^23 leaves x. An integer add and a float
// add on the full-rate pipes instead of I2F, which issues at a quarter of their rate on sm_80 and
// sm_90, as the softmax's ex2 does (ALiBi's float(kv - q) on every score).
__device__ __forceinline__ float ir_small_int_to_float(int x) {
  return __int_as_float(static_cast<int>(0x4b400000u + static_cast<unsigned>(x))) - 12582912.0f;
}
__device__ __forceinline__ float ir_rsqrt(float x) { return 1.0f / sqrtf(x); }

// int(x): truncation toward zero, NaN gives 0, saturating to the i32 range.
__device__ __forceinline__ int ir_to_int(float x) {
  if (x != x) return 0;
  return __float2int_rz(x);  // saturates
}

// ---- storage conversions ---------------------------------------------------------------------

struct BFloat16Tag {};
struct HalfTag {};
struct Float32Tag {};

__device__ __forceinline__ float bf16_bits_to_float(unsigned short bits) {
  return __int_as_float(static_cast<int>(static_cast<unsigned>(bits) << 16));
}
__device__ __forceinline__ float half_bits_to_float(unsigned short bits) {
  float value;
  asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(value) : "h"(bits));
  return value;
}
__device__ __forceinline__ unsigned short float_to_bf16_bits(float value) {
  unsigned short bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}
__device__ __forceinline__ unsigned short float_to_half_bits(float value) {
  unsigned short bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}

// Two floats as one register of two 16-bit values (`low` in the low half), rounded to nearest.
__device__ __forceinline__ unsigned pack_pair(BFloat16Tag, float low, float high) {
  unsigned packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
  return packed;
}
__device__ __forceinline__ unsigned pack_pair(HalfTag, float low, float high) {
  unsigned packed;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
  return packed;
}

// Element loads of the storage types, as float.
__device__ __forceinline__ float load_as_float(BFloat16Tag, const void* base, long long index) {
  return bf16_bits_to_float(static_cast<const unsigned short*>(base)[index]);
}
__device__ __forceinline__ float load_as_float(HalfTag, const void* base, long long index) {
  return half_bits_to_float(static_cast<const unsigned short*>(base)[index]);
}
__device__ __forceinline__ float load_as_float(Float32Tag, const void* base, long long index) {
  return static_cast<const float*>(base)[index];
}
__device__ __forceinline__ void store_from_float(BFloat16Tag, void* base, long long index,
                                                 float value) {
  static_cast<unsigned short*>(base)[index] = float_to_bf16_bits(value);
}
__device__ __forceinline__ void store_from_float(HalfTag, void* base, long long index,
                                                 float value) {
  static_cast<unsigned short*>(base)[index] = float_to_half_bits(value);
}
__device__ __forceinline__ void store_from_float(Float32Tag, void* base, long long index,
                                                 float value) {
  static_cast<float*>(base)[index] = value;
}

// ---- extra tensors read by a modifier (read-only for the kernel's lifetime) ------------------

__device__ __forceinline__ float load_tensor_f32(const float* base, long long offset) {
  return __ldg(base + offset);
}
__device__ __forceinline__ float load_tensor_f64(const double* base, long long offset) {
  return static_cast<float>(__ldg(base + offset));
}
__device__ __forceinline__ float load_tensor_bf16(const unsigned short* base, long long offset) {
  return bf16_bits_to_float(__ldg(base + offset));
}
__device__ __forceinline__ float load_tensor_f16(const unsigned short* base, long long offset) {
  return half_bits_to_float(__ldg(base + offset));
}
__device__ __forceinline__ int load_tensor_i32(const int* base, long long offset) {
  return __ldg(base + offset);
}
__device__ __forceinline__ int load_tensor_i64(const long long* base, long long offset) {
  return static_cast<int>(__ldg(base + offset));
}

}  // namespace flexattn_kernels
