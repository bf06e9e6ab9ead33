// The conformance tolerance (docs/design.md section 5), judged per element: an output element
// passes when |engine - reference| <= atol + rtol * |reference|, with atol and rtol twice those of
// the plain same-precision implementation of the same case, plus a rounding floor per dtype.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "check/check_internal.hpp"

namespace flexattn::conformance::detail {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();
// The engine may be twice as far off as the plain implementation (the flash-attention rule).
constexpr double kPlainErrorFactor = 2.0;

struct Point {
  double magnitude;  // |reference|
  double error;      // |plain - reference|
};

// (z - o) x (a - o): positive when o -> a -> z turns left.
double cross(const Point& o, const Point& a, const Point& z) {
  return (a.magnitude - o.magnitude) * (z.error - o.error) -
         (a.error - o.error) * (z.magnitude - o.magnitude);
}

// The line atol + rtol * m (atol, rtol >= 0) above every point with the smallest value at the
// mean magnitude: the upper convex hull's edge over the mean, so the bound is as tight as the
// plain errors allow where most elements are.
Tolerance tightest_line_above(std::vector<Point> points) {
  Tolerance line;
  if (points.empty()) return line;
  double mean = 0.0, largest_error = 0.0, largest_ratio = 0.0;
  for (const Point& p : points) {
    mean += p.magnitude;
    largest_error = std::max(largest_error, p.error);
    if (p.magnitude > 0.0) largest_ratio = std::max(largest_ratio, p.error / p.magnitude);
  }
  mean /= static_cast<double>(points.size());
  std::sort(points.begin(), points.end(), [](const Point& a, const Point& b) {
    return a.magnitude < b.magnitude || (a.magnitude == b.magnitude && a.error > b.error);
  });
  std::vector<Point> hull;  // upper hull, magnitudes increasing
  for (const Point& p : points) {
    if (!hull.empty() && hull.back().magnitude == p.magnitude) continue;  // lower error, same m
    while (hull.size() >= 2 && cross(hull[hull.size() - 2], hull.back(), p) >= 0.0) {
      hull.pop_back();
    }
    hull.push_back(p);
  }
  std::size_t edge = 0;
  while (edge + 2 < hull.size() && hull[edge + 1].magnitude < mean) ++edge;
  if (hull.size() < 2) {
    line.atol = largest_error;
    return line;
  }
  const Point& left = hull[edge];
  const Point& right = hull[edge + 1];
  const double slope = (right.error - left.error) / (right.magnitude - left.magnitude);
  if (slope <= 0.0) {  // errors do not grow with the magnitude: a flat bound
    line.atol = largest_error;
    return line;
  }
  line.rtol = slope;
  line.atol = left.error - slope * left.magnitude;
  if (line.atol < 0.0) {  // the edge passes below zero at magnitude 0: a line through 0
    line.atol = 0.0;
    line.rtol = largest_ratio;
  }
  return line;
}

}  // namespace

double machine_epsilon(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return std::numeric_limits<double>::epsilon();
    case DType::kF32:
    case DType::kI32:
    case DType::kI64:
      return std::numeric_limits<float>::epsilon();
    case DType::kF16:
      return 0x1p-10;  // 10 fraction bits
    case DType::kBF16:
      return 0x1p-7;  // 7 fraction bits
  }
  return 0.0;
}

double Tolerance::allowed(std::int64_t element, double reference) const {
  if (!std::isfinite(reference)) return 0.0;  // an infinite reference must be matched exactly
  const double extra = floor ? (*floor)[static_cast<std::size_t>(element)] : 0.0;
  return atol + rtol * std::fabs(reference) + extra;
}

std::shared_ptr<const std::vector<double>> cancellation_floor(const TensorView& magnitudes) {
  auto floor = std::make_shared<std::vector<double>>(static_cast<std::size_t>(magnitudes.numel()));
  for (std::int64_t i = 0; i < magnitudes.numel(); ++i) {
    const double magnitude = magnitudes.load(i);
    (*floor)[static_cast<std::size_t>(i)] =
        std::isfinite(magnitude) ? kPlainErrorFactor * machine_epsilon(DType::kF32) * magnitude
                                 : 0.0;
  }
  return floor;
}

std::shared_ptr<const std::vector<double>> gradient_floor(const TensorView& magnitudes,
                                                          const TensorView& sigma) {
  auto floor = std::make_shared<std::vector<double>>(*cancellation_floor(magnitudes));
  for (std::int64_t i = 0; i < sigma.numel(); ++i) {
    const double deviation = sigma.load(i);
    if (std::isfinite(deviation))
      (*floor)[static_cast<std::size_t>(i)] += kRoundingSigmas * deviation;
  }
  return floor;
}

double element_error(double value, double reference) {
  if (std::isnan(value) && std::isnan(reference)) return 0.0;  // both undefined: they agree
  if (std::isnan(value) || std::isnan(reference)) return kInfinity;
  if (value == reference) return 0.0;  // also equal infinities (LSE of empty rows)
  return std::fabs(value - reference);
}

Tolerance derive_tolerance(const TensorView& plain, const TensorView& reference,
                           DType rounding_dtype) {
  std::vector<Point> points;
  points.reserve(static_cast<std::size_t>(reference.numel()));
  double magnitude = 0.0;
  for (std::int64_t i = 0; i < reference.numel(); ++i) {
    const double r = reference.load(i);
    if (!std::isfinite(r)) continue;
    magnitude = std::max(magnitude, std::fabs(r));
    const double error = element_error(plain.load(i), r);
    // A plain element that fails outright sets no tolerance (it would allow anything).
    if (std::isfinite(error)) points.push_back({std::fabs(r), error});
  }
  const Tolerance plain_line = tightest_line_above(std::move(points));
  Tolerance tolerance;
  // Rounding floors: one rounding of the element in its own precision (twice the half-ulp), and
  // one float32 rounding of the largest element (accumulation is at least float32).
  tolerance.rtol = kPlainErrorFactor * plain_line.rtol + machine_epsilon(rounding_dtype);
  tolerance.atol = kPlainErrorFactor * plain_line.atol + machine_epsilon(DType::kF32) * magnitude;
  return tolerance;
}

OutputCheck compare(std::string name, const TensorView& got, const TensorView& reference,
                    const Tolerance& tolerance, bool guard_intact) {
  OutputCheck check;
  check.output = std::move(name);
  check.guard_intact = guard_intact;
  check.atol = tolerance.atol;
  check.rtol = tolerance.rtol;
  const std::int64_t count = reference.numel();
  std::int64_t outside = 0;
  double worst_ratio = -1.0;
  for (std::int64_t i = 0; i < count; ++i) {
    const double r = reference.load(i);
    const double value = got.load(i);
    const double error = element_error(value, r);
    const double allowed = tolerance.allowed(i, r);
    if (!(error <= allowed)) ++outside;
    const double ratio = error == 0.0 ? 0.0 : allowed > 0.0 ? error / allowed : kInfinity;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      check.max_error = error;
      check.allowed = allowed;
      check.worst_index = i;
      check.worst_value = value;
      check.worst_reference = r;
    }
  }
  check.fraction_outside =
      count == 0 ? 0.0 : static_cast<double>(outside) / static_cast<double>(count);
  return check;
}

}  // namespace flexattn::conformance::detail

namespace flexattn::conformance {

void plain_forward(const Problem& problem, const ForwardArgs& args) {
  detail::plain_forward(problem, args);
}

void plain_backward(const Problem& problem, const BackwardArgs& args) {
  detail::plain_backward(problem, args);
}

OutputCheck compare_output(std::string name, const TensorView& got, const TensorView& plain,
                           const TensorView& reference, DType rounding_dtype) {
  const detail::Tolerance tolerance = detail::derive_tolerance(plain, reference, rounding_dtype);
  return detail::compare(std::move(name), got, reference, tolerance, true);
}

}  // namespace flexattn::conformance
