// Fuzz: random well-typed score modifiers (bounded depth, every op) on small problems, every
// built-in engine against cpu_ref, forward and backward. The seed of a failing expression is
// printed; FLEXATTN_FUZZ_SEED=N replays one, FLEXATTN_FUZZ_COUNT=N runs more.
//
// Generated expressions avoid two things that are ambiguity, not bugs: NaN-producing domains
// (log of negatives, division by ~0) and comparisons of score-derived floats, whose outcome may
// flip between float32 and float64 evaluation of the same expression.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "flexattn/conformance.hpp"
#include "flexattn/context.hpp"
#include "flexattn/expr.hpp"

namespace flexattn::conformance {
namespace {

// A small deterministic generator (splitmix64), the same on every platform.
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<std::uint64_t>(n)); }

 private:
  std::uint64_t state_;
};

class ExpressionGenerator {
 public:
  explicit ExpressionGenerator(std::uint64_t seed) : random_(seed) {}

  // f32 that may depend on the score; bounded in magnitude so exp() and products stay finite.
  std::string f32(int depth) {
    if (depth == 0) {
      switch (random_.below(4)) {
        case 0:
          return "score";
        case 1:
          return "slopes[h]";
        case 2:
          return "bias[h, q, kv]";
        default:
          return literal();
      }
    }
    const std::string a = f32(depth - 1);
    const std::string b = f32(depth - 1);
    switch (random_.below(19)) {
      case 0:
        return "(" + a + " + " + b + ")";
      case 1:
        return "(" + a + " - " + b + ")";
      case 2:
        return "tanh(" + a + ") * " + b;
      case 3:
        return a + " / (abs(" + b + ") + 1)";
      case 4:
        return "-" + a;
      case 5:
        return "where(" + boolean(depth - 1) + ", " + a + ", " + b + ")";
      case 6:
        return "min(" + a + ", " + b + ")";
      case 7:
        return "max(" + a + ", " + b + ")";
      case 8:
        return "clamp(" + a + ", -2, 3)";
      case 9:
        return "exp(tanh(" + a + "))";
      case 10:
        return "exp2(tanh(" + a + "))";
      case 11:
        return "log(abs(" + a + ") + 1)";
      case 12:
        return "log2(abs(" + a + ") + 0.5)";
      case 13:
        return "sqrt(abs(" + a + ") + 0.25)";
      case 14:
        return "rsqrt(abs(" + a + ") + 1)";
      case 15:
        return "sigmoid(" + a + ")";
      case 16:
        return "(" + a + " + float(" + i32(depth - 1) + ") * 0.125)";
      case 17:
        return "(" + a + " + floor(float(" + i32(depth - 1) + ") * 0.5))";
      default:
        return "(" + a + " + float(" + i32(depth - 1) + ") % 1.5)";
    }
  }

  std::string i32(int depth) {
    static const char* const kLeaves[] = {"b", "h", "q", "kv", "Q_LEN", "KV_LEN", "3", "-2"};
    if (depth == 0) return kLeaves[random_.below(8)];
    const std::string a = i32(depth - 1);
    const std::string b = i32(depth - 1);
    switch (random_.below(10)) {
      case 0:
        return "(" + a + " + " + b + ")";
      case 1:
        return "(" + a + " - " + b + ")";
      case 2:
        return "(" + a + " * " + b + ")";
      case 3:
        return "(" + a + " / 3)";
      case 4:
        return "(" + a + " % 5)";
      case 5:
        return "abs(" + a + ")";
      case 6:
        return "min(" + a + ", " + b + ")";
      case 7:
        return "clamp(" + a + ", 0, 7)";
      case 8:
        return "int(float(" + a + ") * 0.5)";
      default:
        return "where(" + boolean(depth - 1) + ", " + a + ", " + b + ")";
    }
  }

  std::string boolean(int depth) {
    const std::string a = i32(depth > 0 ? depth - 1 : 0);
    const std::string b = i32(depth > 0 ? depth - 1 : 0);
    switch (random_.below(depth == 0 ? 6 : 9)) {
      case 0:
        return "(" + a + " < " + b + ")";
      case 1:
        return "(" + a + " <= " + b + ")";
      case 2:
        return "(" + a + " > " + b + ")";
      case 3:
        return "(" + a + " >= " + b + ")";
      case 4:
        return "(" + a + " == " + b + ")";
      case 5:
        return "(" + a + " != " + b + ")";
      case 6:
        return "(" + boolean(depth - 1) + " && " + boolean(depth - 1) + ")";
      case 7:
        return "(" + boolean(depth - 1) + " || " + boolean(depth - 1) + ")";
      default:
        return "!" + boolean(depth - 1);
    }
  }

 private:
  std::string literal() {
    static const char* const kLiterals[] = {"0.5", "2", "-1.25", "0.1"};
    return kLiterals[random_.below(4)];
  }
  Random random_;
};

std::uint64_t environment_number(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  return text == nullptr ? fallback : std::strtoull(text, nullptr, 10);
}

TEST(Fuzz, RandomModifiersMatchTheReference) {
  constexpr int kMaxDepth = 3;
  const std::uint64_t first = environment_number("FLEXATTN_FUZZ_SEED", 1);
  const std::uint64_t count =
      std::getenv("FLEXATTN_FUZZ_SEED") != nullptr ? 1 : environment_number("FLEXATTN_FUZZ_COUNT", 24);
  const Shape shape{1, 2, 1, 19, 23, 16, 16};
  int compared = 0;
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    ExpressionGenerator generator(seed);
    const std::string expression =
        generator.f32(1 + static_cast<int>(seed % kMaxDepth));
    const bool backward = seed % 2 == 0;
    const Case test_case = custom_case(shape, Layout::kBSHD, DType::kF32, expression,
                                       seed % 3 == 0 ? "causal" : "none", backward);
    for (const auto& engine : builtin_engines()) {
      if (engine->name() == "cpu_ref") continue;
      const Outcome outcome = run_case(*engine, test_case, seed);
      if (outcome.status == Status::kSkipped) continue;
      ++compared;
      EXPECT_EQ(outcome.status, Status::kPass)
          << engine->name() << " seed " << seed << " (FLEXATTN_FUZZ_SEED=" << seed
          << "): " << expression << ": " << outcome.reason;
    }
  }
  if (compared == 0) GTEST_SKIP() << "no engine besides cpu_ref in this build";
}

// The generator itself: every expression it makes parses (well-typed) for a range of seeds.
TEST(Fuzz, GeneratedExpressionsAreWellTyped) {
  ir::Scope scope;
  scope.tensors["bias"] = {Type::kF32, 3};
  scope.tensors["slopes"] = {Type::kF32, 1};
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    ExpressionGenerator generator(seed);
    const std::string expression = generator.f32(3);
    EXPECT_NO_THROW(ir::parse(expression, scope)) << expression;
  }
}

}  // namespace
}  // namespace flexattn::conformance
