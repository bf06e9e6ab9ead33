// The element-wise ops of the tape (see tape_ops.hpp). The loops are written once and compiled
// twice: for the baseline ISA and, inlined into a function with an AVX2 `target` attribute, for
// AVX2 (8 lanes per instruction); the choice is made once, from the CPU.
#include "engines/cpu/tape_ops.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engines/cpu/kernels.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cpu {

namespace {

// i32 arithmetic wraps to 32 bits (two's complement), like `evaluate`.
inline std::int32_t wrap(std::int64_t value) {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(static_cast<std::uint64_t>(value)));
}

inline std::int32_t floor_divide(std::int32_t a, std::int32_t b) {
  if (b == 0) return 0;
  const std::int64_t wide_a = a, wide_b = b;
  std::int64_t quotient = wide_a / wide_b;
  if (wide_a % wide_b != 0 && ((wide_a < 0) != (wide_b < 0))) --quotient;
  return wrap(quotient);
}

inline std::int32_t floor_modulo(std::int32_t a, std::int32_t b) {
  if (b == 0) return 0;
  const std::int64_t wide_b = b;
  std::int64_t remainder = static_cast<std::int64_t>(a) % wide_b;
  if (remainder != 0 && ((remainder < 0) != (wide_b < 0))) remainder += wide_b;
  return wrap(remainder);
}

inline float floor_modulo(float a, float b) {
  if (b == 0.0f) return 0.0f;
  float remainder = std::fmod(a, b);
  if (remainder != 0.0f && ((remainder < 0.0f) != (b < 0.0f))) remainder += b;
  return remainder;
}

// int(x): truncation toward zero, NaN -> 0, saturating to the i32 range.
inline std::int32_t to_int(float value) {
  constexpr float kTwoTo31 = 2147483648.0f;
  if (std::isnan(value)) return 0;
  if (value <= -kTwoTo31) return std::numeric_limits<std::int32_t>::min();
  if (value >= kTwoTo31) return std::numeric_limits<std::int32_t>::max();
  return static_cast<std::int32_t>(value);
}

// min/max with fmin/fmax semantics (a NaN operand yields the other one), written so they vectorise.
inline float min_f(float a, float b) { return (a < b || b != b) ? a : b; }
inline float max_f(float a, float b) { return (a > b || b != b) ? a : b; }

template <typename Out, typename In, typename F>
[[gnu::always_inline]] inline void map1(Out* out, const In* a, std::int64_t n, F f) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = f(a[i]);
}

template <typename Out, typename In, typename F>
[[gnu::always_inline]] inline void map2(Out* out, const In* a, const In* b, std::int64_t n, F f) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
}

template <typename T, typename F>
[[gnu::always_inline]] inline void map3(T* out, const T* a, const T* b, const T* c, std::int64_t n,
                                        F f) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = f(a[i], b[i], c[i]);
}

inline std::int32_t truth(bool value) { return value ? 1 : 0; }

[[gnu::always_inline]] inline void execute_body(const Instruction& in, const LaneArrays& arrays) {
  const std::int64_t n = arrays.lanes;
  const bool f32 = in.type == Type::kF32;
  const bool float_operands = in.operand_type == Type::kF32;
  float* out_f = f32 ? arrays.write_floats[in.result.index] : nullptr;
  std::int32_t* out_i = f32 ? nullptr : arrays.write_ints[in.result.index];
  const auto fa = [&](std::size_t i) { return arrays.read_floats[in.args[i].index]; };
  const auto ia = [&](std::size_t i) { return arrays.read_ints[in.args[i].index]; };
  const Kernels& k = kernels();
  switch (in.op) {
    case Op::kScore:
    case Op::kBatch:
    case Op::kHead:
    case Op::kQuery:
    case Op::kKey:
    case Op::kQueryLen:
    case Op::kKeyLen:
    case Op::kLiteral:
    case Op::kParam:
      throw_internal(
          fmt::format("cpu tape: leaf '{}' lowered as an instruction", to_string(in.op)));
    case Op::kLoad:
      throw_internal("cpu tape: loads are gathered by the runner");
    case Op::kAdd:
      if (f32) return map2(out_f, fa(0), fa(1), n, [](float a, float b) { return a + b; });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return wrap(std::int64_t{a} + b); });
    case Op::kSub:
      if (f32) return map2(out_f, fa(0), fa(1), n, [](float a, float b) { return a - b; });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return wrap(std::int64_t{a} - b); });
    case Op::kMul:
      if (f32) return map2(out_f, fa(0), fa(1), n, [](float a, float b) { return a * b; });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return wrap(std::int64_t{a} * b); });
    case Op::kDiv:
      if (f32) return map2(out_f, fa(0), fa(1), n, [](float a, float b) { return a / b; });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return floor_divide(a, b); });
    case Op::kMod:
      if (f32) {
        return map2(out_f, fa(0), fa(1), n, [](float a, float b) { return floor_modulo(a, b); });
      }
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return floor_modulo(a, b); });
    case Op::kNeg:
      if (f32) return map1(out_f, fa(0), n, [](float a) { return -a; });
      return map1(out_i, ia(0), n, [](std::int32_t a) { return wrap(-std::int64_t{a}); });
    case Op::kLess:
      if (float_operands)
        return map2(out_i, fa(0), fa(1), n, [](float a, float b) { return truth(a < b); });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return truth(a < b); });
    case Op::kLessEqual:
      if (float_operands)
        return map2(out_i, fa(0), fa(1), n, [](float a, float b) { return truth(a <= b); });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return truth(a <= b); });
    case Op::kGreater:
      if (float_operands)
        return map2(out_i, fa(0), fa(1), n, [](float a, float b) { return truth(a > b); });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return truth(a > b); });
    case Op::kGreaterEqual:
      if (float_operands)
        return map2(out_i, fa(0), fa(1), n, [](float a, float b) { return truth(a >= b); });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return truth(a >= b); });
    case Op::kEqual:
      if (float_operands)
        return map2(out_i, fa(0), fa(1), n, [](float a, float b) { return truth(a == b); });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return truth(a == b); });
    case Op::kNotEqual:
      if (float_operands)
        return map2(out_i, fa(0), fa(1), n, [](float a, float b) { return truth(a != b); });
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return truth(a != b); });
    case Op::kAnd:
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return truth(a != 0 && b != 0); });
    case Op::kOr:
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return truth(a != 0 || b != 0); });
    case Op::kNot:
      return map1(out_i, ia(0), n, [](std::int32_t a) { return truth(a == 0); });
    case Op::kWhere: {
      const std::int32_t* condition = ia(0);
      if (f32) {
        const float *a = fa(1), *b = fa(2);
        for (std::int64_t i = 0; i < n; ++i) out_f[i] = condition[i] != 0 ? a[i] : b[i];
      } else {
        const std::int32_t *a = ia(1), *b = ia(2);
        for (std::int64_t i = 0; i < n; ++i) out_i[i] = condition[i] != 0 ? a[i] : b[i];
      }
      return;
    }
    case Op::kMin:
      if (f32) return map2(out_f, fa(0), fa(1), n, min_f);
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return std::min(a, b); });
    case Op::kMax:
      if (f32) return map2(out_f, fa(0), fa(1), n, max_f);
      return map2(out_i, ia(0), ia(1), n,
                  [](std::int32_t a, std::int32_t b) { return std::max(a, b); });
    case Op::kClamp:
      if (f32) {
        return map3(out_f, fa(0), fa(1), fa(2), n,
                    [](float x, float lo, float hi) { return min_f(max_f(x, lo), hi); });
      }
      return map3(out_i, ia(0), ia(1), ia(2), n,
                  [](std::int32_t x, std::int32_t lo, std::int32_t hi) {
                    return std::min(std::max(x, lo), hi);
                  });
    case Op::kAbs:
      if (f32) return map1(out_f, fa(0), n, [](float a) { return std::fabs(a); });
      return map1(out_i, ia(0), n,
                  [](std::int32_t a) { return wrap(a < 0 ? -std::int64_t{a} : a); });
    case Op::kExp:
      return k.exp(fa(0), out_f, n);
    case Op::kExp2:
      return map1(out_f, fa(0), n, [](float a) { return std::exp2(a); });
    case Op::kLog:
      return map1(out_f, fa(0), n, [](float a) { return std::log(a); });
    case Op::kLog2:
      return map1(out_f, fa(0), n, [](float a) { return std::log2(a); });
    case Op::kSqrt:
      return map1(out_f, fa(0), n, [](float a) { return std::sqrt(a); });
    case Op::kRsqrt:
      return map1(out_f, fa(0), n, [](float a) { return 1.0f / std::sqrt(a); });
    case Op::kTanh:
      return k.tanh(fa(0), out_f, n);
    case Op::kSigmoid:
      return k.sigmoid(fa(0), out_f, n);
    case Op::kFloor:
      return map1(out_f, fa(0), n, [](float a) { return std::floor(a); });
    case Op::kToFloat:
      if (float_operands) return map1(out_f, fa(0), n, [](float a) { return a; });
      return map1(out_f, ia(0), n, [](std::int32_t a) { return static_cast<float>(a); });
    case Op::kToInt:
      if (float_operands) return map1(out_i, fa(0), n, [](float a) { return to_int(a); });
      return map1(out_i, ia(0), n, [](std::int32_t a) { return a; });
  }
}

void execute_generic(const Instruction& instruction, const LaneArrays& arrays) {
  execute_body(instruction, arrays);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"), flatten)) void execute_avx2(const Instruction& instruction,
                                                               const LaneArrays& arrays) {
  execute_body(instruction, arrays);
}
#endif

using ExecuteFunction = void (*)(const Instruction&, const LaneArrays&);

ExecuteFunction best_execute() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx2_kernels() != nullptr) return execute_avx2;
#endif
  return execute_generic;
}

}  // namespace

void execute_instruction(const Instruction& instruction, const LaneArrays& arrays) {
  static const ExecuteFunction kExecute = best_execute();
  kExecute(instruction, arrays);
}

}  // namespace flexattn::cpu
