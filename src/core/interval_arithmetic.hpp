// Internal: the interval arithmetic behind intervals.cpp, one function per kind of IR operation.
// A Range is an inclusive interval plus whether the value may be NaN (f32 only). See
// intervals.cpp for the soundness contract.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>

#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::interval_math {

constexpr double kI32Min = -2147483648.0;
constexpr double kI32Max = 2147483647.0;
constexpr double kInfinity = std::numeric_limits<double>::infinity();
constexpr double kLargestFloat = static_cast<double>(std::numeric_limits<float>::max());
// An f32 `a % b` computed as a - b * floor(a / b) rounds the quotient and the product once each
// (2^-24 relative to |a| each); 2^-21 leaves a margin over their sum.
constexpr double kFloatModSlack = 1.0 / (1 << 21);

struct Range {
  Interval interval;
  bool may_be_nan = false;
};

inline bool is_empty(const Range& range) { return range.interval.lo > range.interval.hi; }
inline bool contains_zero(const Range& range) { return range.interval.contains(0.0); }
inline bool has_infinity(const Range& range) {
  return std::isinf(range.interval.lo) || std::isinf(range.interval.hi);
}
inline Range empty_range() { return {{kInfinity, -kInfinity}, false}; }
inline Range unknown_float() { return {{-kInfinity, kInfinity}, true}; }
inline Range whole_i32() { return {{kI32Min, kI32Max}, false}; }
inline Range bool_range(bool can_be_false, bool can_be_true) {
  return {{can_be_false ? 0.0 : 1.0, can_be_true ? 1.0 : 0.0}, false};
}
inline Range hull(const Range& a, const Range& b) {
  return {{std::min(a.interval.lo, b.interval.lo), std::max(a.interval.hi, b.interval.hi)},
          a.may_be_nan || b.may_be_nan};
}

// ---- the float grid ----------------------------------------------------------------------

// The largest float <= x (x not NaN).
inline double float_at_or_below(double x) {
  if (x > kLargestFloat) return std::isinf(x) ? x : kLargestFloat;
  if (x < -kLargestFloat) return -kInfinity;
  float rounded = static_cast<float>(x);
  if (static_cast<double>(rounded) > x) {
    rounded = std::nextafter(rounded, -std::numeric_limits<float>::infinity());
  }
  return static_cast<double>(rounded);
}

inline double float_at_or_above(double x) { return -float_at_or_below(-x); }

inline double float_step(double x, double direction) {
  if (std::isinf(x)) return x;
  return static_cast<double>(std::nextafter(static_cast<float>(x), static_cast<float>(direction)));
}

// Widens `range` outwards to the float grid, then `extra_steps` more floats each way.
inline Range round_to_float_grid(Range range, int extra_steps) {
  if (is_empty(range)) return range;
  double lo = float_at_or_below(range.interval.lo);
  double hi = float_at_or_above(range.interval.hi);
  for (int step = 0; step < extra_steps; ++step) {
    lo = float_step(lo, -kInfinity);
    hi = float_step(hi, kInfinity);
  }
  return {{lo, hi}, range.may_be_nan};
}

inline Range literal(double value, Type type) {
  if (std::isnan(value)) return unknown_float();
  const Range exact{{value, value}, false};
  return type == Type::kF32 ? round_to_float_grid(exact, 0) : exact;
}

// ---- i32 ----------------------------------------------------------------------------------

// i32 arithmetic wraps (as on the engines): a result that can leave the range can be anything.
inline Range wrap_i32(const Range& range) {
  if (range.interval.lo < kI32Min || range.interval.hi > kI32Max) return whole_i32();
  return range;
}

// A leaf's range, restricted to integers of the i32 range.
inline Range integer_leaf(const Interval& interval) {
  if (interval.lo > interval.hi) return empty_range();
  const double lo = std::ceil(interval.lo);
  const double hi = std::floor(interval.hi);
  if (lo > hi) return empty_range();
  return {{std::clamp(lo, kI32Min, kI32Max), std::clamp(hi, kI32Min, kI32Max)}, false};
}

inline std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  std::int64_t quotient = a / b;
  if (a % b != 0 && ((a < 0) != (b < 0))) --quotient;
  return quotient;
}

inline std::int64_t floor_mod(std::int64_t a, std::int64_t b) { return a - b * floor_div(a, b); }

inline std::int64_t as_integer(double value) { return static_cast<std::int64_t>(value); }

inline Range negate_any(const Range& a) { return {{-a.interval.hi, -a.interval.lo}, a.may_be_nan}; }

inline Range add_i32(const Range& a, const Range& b) {
  return wrap_i32({{a.interval.lo + b.interval.lo, a.interval.hi + b.interval.hi}, false});
}

inline Range from_candidates(std::initializer_list<double> candidates) {
  double lo = kInfinity;
  double hi = -kInfinity;
  for (double value : candidates) {
    if (std::isnan(value)) continue;
    lo = std::min(lo, value);
    hi = std::max(hi, value);
  }
  if (lo > hi) return unknown_float();
  return {{lo, hi}, false};
}

inline Range mul_i32(const Range& a, const Range& b) {
  const Interval x = a.interval;
  const Interval y = b.interval;
  return wrap_i32(from_candidates({x.lo * y.lo, x.lo * y.hi, x.hi * y.lo, x.hi * y.hi}));
}

// The nonzero divisors of `b`: its negative part and its positive part (either may be empty).
inline Interval negative_part(const Range& b) {
  return {b.interval.lo, std::min(b.interval.hi, -1.0)};
}
inline Interval positive_part(const Range& b) {
  return {std::max(b.interval.lo, 1.0), b.interval.hi};
}

// Floor division (x / 0 == 0). For a divisor of one sign the quotient is monotone in each
// operand, so its extremes lie at the corners.
inline Range div_i32(const Range& a, const Range& b) {
  const std::int64_t a_lo = as_integer(a.interval.lo);
  const std::int64_t a_hi = as_integer(a.interval.hi);
  Range result = empty_range();
  for (const Interval part : {negative_part(b), positive_part(b)}) {
    if (part.lo > part.hi) continue;
    const std::int64_t lo = as_integer(part.lo);
    const std::int64_t hi = as_integer(part.hi);
    result = hull(result, from_candidates({static_cast<double>(floor_div(a_lo, lo)),
                                           static_cast<double>(floor_div(a_lo, hi)),
                                           static_cast<double>(floor_div(a_hi, lo)),
                                           static_cast<double>(floor_div(a_hi, hi))}));
  }
  if (contains_zero(b)) result = hull(result, Range{{0.0, 0.0}, false});
  return wrap_i32(result);
}

// Floor modulo (sign of the divisor, x % 0 == 0).
inline Range mod_i32(const Range& a, const Range& b) {
  const std::int64_t a_lo = as_integer(a.interval.lo);
  const std::int64_t a_hi = as_integer(a.interval.hi);
  Range result = empty_range();
  const Interval positive = positive_part(b);
  if (positive.lo <= positive.hi) {
    const std::int64_t lo = as_integer(positive.lo);
    const std::int64_t hi = as_integer(positive.hi);
    Range part{{0.0, static_cast<double>(hi - 1)}, false};
    if (lo == hi && floor_div(a_lo, lo) == floor_div(a_hi, lo)) {
      // One divisor and no wrap-around inside a: the remainder is a shifted a.
      part.interval = {static_cast<double>(floor_mod(a_lo, lo)),
                       static_cast<double>(floor_mod(a_hi, lo))};
    } else if (a_lo >= 0 && a_hi < lo) {
      part.interval = a.interval;  // 0 <= x < y: x % y == x
    } else if (a_lo >= 0) {
      part.interval.hi = std::min(part.interval.hi, static_cast<double>(a_hi));  // x % y <= x
    }
    result = hull(result, part);
  }
  const Interval negative = negative_part(b);
  if (negative.lo <= negative.hi) {
    const std::int64_t lo = as_integer(negative.lo);
    const std::int64_t hi = as_integer(negative.hi);
    Range part{{static_cast<double>(lo + 1), 0.0}, false};
    if (lo == hi && floor_div(a_lo, lo) == floor_div(a_hi, lo)) {
      part.interval = {static_cast<double>(floor_mod(a_lo, lo)),
                       static_cast<double>(floor_mod(a_hi, lo))};
    } else if (a_hi <= 0 && a_lo > hi) {
      part.interval = a.interval;  // y < x <= 0: x % y == x
    } else if (a_hi <= 0) {
      part.interval.lo = std::max(part.interval.lo, static_cast<double>(a_lo));  // x % y >= x
    }
    result = hull(result, part);
  }
  if (contains_zero(b)) result = hull(result, Range{{0.0, 0.0}, false});
  return result;
}

// ---- f32 ----------------------------------------------------------------------------------

inline Range add_f32(const Range& a, const Range& b) {
  const Interval x = a.interval;
  const Interval y = b.interval;
  double lo = x.lo + y.lo;
  double hi = x.hi + y.hi;
  if (std::isnan(lo)) lo = -kInfinity;  // -inf + inf: some sums are NaN, the others unbounded
  if (std::isnan(hi)) hi = kInfinity;
  const bool infinities_cancel =
      (x.hi == kInfinity && y.lo == -kInfinity) || (x.lo == -kInfinity && y.hi == kInfinity);
  return round_to_float_grid({{lo, hi}, a.may_be_nan || b.may_be_nan || infinities_cancel}, 0);
}

// 0 * inf corners are NaN and skipped: the other corners bound the non-NaN products.
inline Range mul_f32(const Range& a, const Range& b) {
  const Interval x = a.interval;
  const Interval y = b.interval;
  Range result = from_candidates({x.lo * y.lo, x.lo * y.hi, x.hi * y.lo, x.hi * y.hi});
  result.may_be_nan = a.may_be_nan || b.may_be_nan || (contains_zero(a) && has_infinity(b)) ||
                      (contains_zero(b) && has_infinity(a));
  return round_to_float_grid(result, 0);
}

inline Range div_f32(const Range& a, const Range& b) {
  if (contains_zero(b)) return unknown_float();
  const Interval x = a.interval;
  const Interval y = b.interval;
  Range result = from_candidates({x.lo / y.lo, x.lo / y.hi, x.hi / y.lo, x.hi / y.hi});
  result.may_be_nan = a.may_be_nan || b.may_be_nan || (has_infinity(a) && has_infinity(b));
  return round_to_float_grid(result, 0);
}

// a - b * floor(a / b): within [0, b] for b > 0 and [b, 0] for b < 0 (closed: rounding), and `a`
// itself when |a| < |b| with the divisor's sign; widened by the rounding of the f32 formula.
inline Range mod_f32(const Range& a, const Range& b) {
  const Interval x = a.interval;
  Range result = empty_range();
  const Interval positive{std::max(b.interval.lo, 0.0), b.interval.hi};
  if (positive.hi > 0.0) {
    const bool a_below_divisor = x.lo >= 0.0 && x.hi < positive.lo;
    result = hull(result, a_below_divisor ? Range{x, false} : Range{{0.0, positive.hi}, false});
  }
  const Interval negative{b.interval.lo, std::min(b.interval.hi, 0.0)};
  if (negative.lo < 0.0) {
    const bool a_above_divisor = x.hi <= 0.0 && x.lo > negative.hi;
    result = hull(result, a_above_divisor ? Range{x, false} : Range{{negative.lo, 0.0}, false});
  }
  if (contains_zero(b)) result = hull(result, Range{{0.0, 0.0}, false});
  const double slack = std::max(std::abs(x.lo), std::abs(x.hi)) * kFloatModSlack;
  result.interval.lo -= slack;
  result.interval.hi += slack;
  if (std::isnan(result.interval.lo)) result.interval.lo = -kInfinity;
  if (std::isnan(result.interval.hi)) result.interval.hi = kInfinity;
  result.may_be_nan =
      a.may_be_nan || b.may_be_nan || has_infinity(a) || has_infinity(b) || contains_zero(b);
  return round_to_float_grid(result, 0);
}

inline Range absolute(const Range& a) {
  const Interval x = a.interval;
  if (x.lo >= 0.0) return a;
  if (x.hi <= 0.0) return negate_any(a);
  return {{0.0, std::max(-x.lo, x.hi)}, a.may_be_nan};
}

inline Range floor_range(const Range& a) {
  return {{std::floor(a.interval.lo), std::floor(a.interval.hi)}, a.may_be_nan};
}

// int(x): truncation toward zero, NaN -> 0, saturating to the i32 range.
inline Range to_int_range(const Range& a) {
  auto saturate = [](double value) { return std::clamp(std::trunc(value), kI32Min, kI32Max); };
  Range result{{saturate(a.interval.lo), saturate(a.interval.hi)}, false};
  if (a.may_be_nan) result = hull(result, Range{{0.0, 0.0}, false});
  return result;
}

// Library functions are not correctly rounded: their bounds get one more float step each way,
// then are cut back to the function's natural range.
inline Range finish_library_result(Range result, Interval natural) {
  result = round_to_float_grid(result, 1);
  result.interval.lo = std::max(result.interval.lo, natural.lo);
  result.interval.hi = std::min(result.interval.hi, natural.hi);
  return result;
}

// exp, exp2, tanh, sigmoid: increasing everywhere, values within `natural`.
template <typename Function>
Range increasing_function(const Range& a, Function function, Interval natural) {
  return finish_library_result({{function(a.interval.lo), function(a.interval.hi)}, a.may_be_nan},
                               natural);
}

// log, log2, sqrt, rsqrt: defined on x >= 0 (NaN below), monotone there.
template <typename Function>
Range nonnegative_domain_function(const Range& a, Function function, bool decreasing,
                                  Interval natural) {
  if (a.interval.hi < 0.0) return unknown_float();
  const double lo = std::max(a.interval.lo, 0.0);
  const double hi = a.interval.hi;
  const Range result{{function(decreasing ? hi : lo), function(decreasing ? lo : hi)},
                     a.may_be_nan || a.interval.lo < 0.0};
  return finish_library_result(result, natural);
}

// ---- comparisons, logic, selection --------------------------------------------------------

// a < b (or a <= b). A NaN operand makes the comparison false.
inline Range compare_less(const Range& a, const Range& b, bool or_equal) {
  const Interval x = a.interval;
  const Interval y = b.interval;
  const bool always = or_equal ? x.hi <= y.lo : x.hi < y.lo;
  const bool never = or_equal ? x.lo > y.hi : x.lo >= y.hi;
  const bool may_be_nan = a.may_be_nan || b.may_be_nan;
  return bool_range(!always || may_be_nan, !never);
}

inline Range compare_equal(const Range& a, const Range& b) {
  const Interval x = a.interval;
  const Interval y = b.interval;
  const bool always = x.lo == x.hi && y.lo == y.hi && x.lo == y.lo;
  const bool never = x.hi < y.lo || y.hi < x.lo;
  return bool_range(!always || a.may_be_nan || b.may_be_nan, !never);
}

inline Range logical_not(const Range& a) {
  return {{1.0 - a.interval.hi, 1.0 - a.interval.lo}, false};
}
inline Range logical_and(const Range& a, const Range& b) {
  return {{std::min(a.interval.lo, b.interval.lo), std::min(a.interval.hi, b.interval.hi)}, false};
}
inline Range logical_or(const Range& a, const Range& b) {
  return {{std::max(a.interval.lo, b.interval.lo), std::max(a.interval.hi, b.interval.hi)}, false};
}

inline Range select(const Range& condition, const Range& if_true, const Range& if_false) {
  if (condition.interval.lo >= 1.0) return if_true;
  if (condition.interval.hi <= 0.0) return if_false;
  return hull(if_true, if_false);
}

// min/max of a NaN operand may give either operand or NaN, depending on the implementation.
inline Range minimum(const Range& a, const Range& b) {
  if (a.may_be_nan || b.may_be_nan) return hull(a, b);
  return {{std::min(a.interval.lo, b.interval.lo), std::min(a.interval.hi, b.interval.hi)}, false};
}
inline Range maximum(const Range& a, const Range& b) {
  if (a.may_be_nan || b.may_be_nan) return hull(a, b);
  return {{std::max(a.interval.lo, b.interval.lo), std::max(a.interval.hi, b.interval.hi)}, false};
}

}  // namespace flexattn::interval_math
