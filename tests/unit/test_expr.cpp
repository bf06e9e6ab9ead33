// The builder side of the IR: typing, promotion, type errors naming the offending
// sub-expression, and the builder operators.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "flexattn/error.hpp"
#include "flexattn/expr.hpp"

namespace flexattn {
namespace {

using ir::Expr;

// Runs `build` and returns the kInvalidArgument message it throws (fails the test otherwise).
template <typename Build>
std::string invalid_message(Build build) {
  try {
    build();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    return error.what();
  }
  ADD_FAILURE() << "no error thrown";
  return {};
}

TEST(Expr, LeavesHaveTheirTypes) {
  EXPECT_EQ(ir::score().type(), Type::kF32);
  EXPECT_EQ(ir::batch().type(), Type::kI32);
  EXPECT_EQ(ir::head().type(), Type::kI32);
  EXPECT_EQ(ir::query().type(), Type::kI32);
  EXPECT_EQ(ir::key().type(), Type::kI32);
  EXPECT_EQ(ir::query_length().type(), Type::kI32);
  EXPECT_EQ(ir::key_length().type(), Type::kI32);
  EXPECT_EQ(ir::infinity().type(), Type::kF32);
  EXPECT_EQ(ir::literal_bool(true).type(), Type::kBool);
  EXPECT_EQ(ir::param("alpha").type(), Type::kF32);
  EXPECT_EQ(Expr(3).type(), Type::kI32);
  EXPECT_EQ(Expr(3.0).type(), Type::kF32);
  EXPECT_EQ(ir::load("doc", Type::kI32, {ir::query()}).type(), Type::kI32);
  EXPECT_EQ(ir::load("bias", Type::kF32, {ir::head(), ir::query()}).type(), Type::kF32);
}

TEST(Expr, ArithmeticPromotes) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  const Expr s = ir::score();
  EXPECT_EQ((q + kv).type(), Type::kI32);
  EXPECT_EQ((q - kv).type(), Type::kI32);
  EXPECT_EQ((q * 2).type(), Type::kI32);
  EXPECT_EQ((q / 2).type(), Type::kI32);
  EXPECT_EQ((q % 2).type(), Type::kI32);
  EXPECT_EQ((q + s).type(), Type::kF32);
  EXPECT_EQ((q * 2.0).type(), Type::kF32);
  EXPECT_EQ((s / q).type(), Type::kF32);
  EXPECT_EQ((-q).type(), Type::kI32);
  EXPECT_EQ((-s).type(), Type::kF32);
  EXPECT_EQ(ir::min(q, kv).type(), Type::kI32);
  EXPECT_EQ(ir::max(q, s).type(), Type::kF32);
  EXPECT_EQ(ir::clamp(q, 0, 128).type(), Type::kI32);
  EXPECT_EQ(ir::clamp(q, 0.0, 128).type(), Type::kF32);
  EXPECT_EQ(ir::abs(q).type(), Type::kI32);
  EXPECT_EQ(ir::abs(s).type(), Type::kF32);
}

TEST(Expr, MathConversionsAndLogic) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  for (Expr e : {ir::exp(q), ir::exp2(q), ir::log(q), ir::log2(q), ir::sqrt(q), ir::rsqrt(q),
                 ir::tanh(q), ir::sigmoid(q), ir::floor(q), ir::to_float(q)}) {
    EXPECT_EQ(e.type(), Type::kF32) << e.to_string();
  }
  EXPECT_EQ(ir::to_int(ir::score()).type(), Type::kI32);
  EXPECT_EQ((q < kv).type(), Type::kBool);
  EXPECT_EQ((q <= ir::score()).type(), Type::kBool);
  EXPECT_EQ((q == kv).type(), Type::kBool);
  EXPECT_EQ(((q < kv) == (q > kv)).type(), Type::kBool);
  EXPECT_EQ((((q < kv) && !(q > kv)) || (q == kv)).type(), Type::kBool);
  EXPECT_EQ(ir::where(q < kv, q, kv).type(), Type::kI32);
  EXPECT_EQ(ir::where(q < kv, q, ir::score()).type(), Type::kF32);
  EXPECT_EQ(ir::where(q < kv, q == kv, q != kv).type(), Type::kBool);
}

TEST(Expr, TypeErrorsNameTheSubExpression) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  const Expr s = ir::score();
  EXPECT_EQ(invalid_message([&] { return s && (q >= kv); }),
            "type error: '&&' needs bool operands, got f32 in \"score && q >= kv\"");
  EXPECT_EQ(invalid_message([&] { return !(q + 1); }),
            "type error: '!' needs a bool operand, got i32 in \"!(q + 1)\"");
  EXPECT_EQ(invalid_message([&] { return (q < kv) + 1; }),
            "type error: '+' needs numeric operands, got bool in \"(q < kv) + 1\"");
  EXPECT_EQ(invalid_message([&] { return ir::tanh(q == kv); }),
            "type error: 'tanh' needs a numeric operand, got bool in \"tanh(q == kv)\"");
  EXPECT_EQ(invalid_message([&] { return (q < kv) == q; }),
            "type error: '==' needs two numeric or two bool operands, got bool and i32 in "
            "\"q < kv == q\"");
  EXPECT_EQ(invalid_message([&] { return ir::where(q, s, s); }),
            "type error: 'where' needs a bool condition, got i32 in \"where(q, score, score)\"");
  EXPECT_EQ(invalid_message([&] { return ir::where(q < kv, s, q < kv); }),
            "type error: 'where' needs two numeric or two bool values, got f32 and bool in "
            "\"where(q < kv, score, q < kv)\"");
  EXPECT_EQ(invalid_message([&] {
              return ir::load("rel", Type::kF32, {ir::head(), s});
            }),
            "type error: index 1 of 'rel' must be i32, got f32 in \"rel[h, score]\"");
  EXPECT_EQ(invalid_message([&] { return ir::to_int(q < kv); }),
            "type error: 'int' needs a numeric operand, got bool in \"int(q < kv)\"");
}

TEST(Expr, TypeErrorInsideALargerExpressionNamesTheInnerPart) {
  const Expr q = ir::query();
  const std::string message =
      invalid_message([&] { return ir::score() + ir::exp(ir::clamp(q, 0, q > 2)); });
  EXPECT_EQ(message,
            "type error: 'clamp' needs numeric operands, got bool in \"clamp(q, 0, q > 2)\"");
}

TEST(Expr, LiteralsAreChecked) {
  EXPECT_EQ(ir::literal_i32(std::numeric_limits<std::int32_t>::max()).node().literal, 2147483647.0);
  EXPECT_EQ(ir::literal_i32(std::numeric_limits<std::int32_t>::min()).node().literal,
            -2147483648.0);
  EXPECT_EQ(invalid_message([] { return ir::literal_i32(std::int64_t{1} << 31); }),
            "integer literal 2147483648 is outside the i32 range");
  invalid_message([] { return ir::literal_i32(-(std::int64_t{1} << 31) - 1); });
  invalid_message([] { return ir::literal_f32(std::numeric_limits<double>::quiet_NaN()); });
  EXPECT_EQ(ir::literal_f32(-std::numeric_limits<double>::infinity()).to_string(), "-inf");
}

TEST(Expr, NamesAreChecked) {
  invalid_message([] { return ir::param("q"); });
  invalid_message([] { return ir::param("2x"); });
  invalid_message([] { return ir::load("", Type::kF32, {ir::query()}); });
  invalid_message([] { return ir::load("bias", Type::kBool, {ir::query()}); });
  invalid_message([] { return ir::load("bias", Type::kF32, {}); });
  invalid_message([] { return ir::load("tanh", Type::kF32, {ir::query()}); });
}

TEST(Expr, MakeChecksArity) {
  EXPECT_EQ(invalid_message([] { return ir::make(Op::kAdd, {ir::query()}); }),
            "'+' takes 2 operands, got 1");
  invalid_message([] { return ir::make(Op::kClamp, {ir::query(), ir::key()}); });
  invalid_message([] { return ir::make(Op::kLiteral, {}); });
  EXPECT_EQ(ir::make(Op::kQuery, {}).op(), Op::kQuery);
}

TEST(Expr, BuilderOperatorsBuildTheRightOps) {
  const Expr a = ir::query();
  const Expr b = ir::key();
  EXPECT_EQ((a + b).op(), Op::kAdd);
  EXPECT_EQ((a - b).op(), Op::kSub);
  EXPECT_EQ((a * b).op(), Op::kMul);
  EXPECT_EQ((a / b).op(), Op::kDiv);
  EXPECT_EQ((a % b).op(), Op::kMod);
  EXPECT_EQ((-a).op(), Op::kNeg);
  EXPECT_EQ((a < b).op(), Op::kLess);
  EXPECT_EQ((a <= b).op(), Op::kLessEqual);
  EXPECT_EQ((a > b).op(), Op::kGreater);
  EXPECT_EQ((a >= b).op(), Op::kGreaterEqual);
  EXPECT_EQ((a == b).op(), Op::kEqual);
  EXPECT_EQ((a != b).op(), Op::kNotEqual);
  EXPECT_EQ(((a < b) && (a > b)).op(), Op::kAnd);
  EXPECT_EQ(((a < b) || (a > b)).op(), Op::kOr);
  EXPECT_EQ((!(a < b)).op(), Op::kNot);
  EXPECT_EQ(ir::where(a < b, a, b).op(), Op::kWhere);
  EXPECT_EQ(ir::to_float(a).op(), Op::kToFloat);
  EXPECT_EQ(ir::to_int(a).op(), Op::kToInt);
  ASSERT_EQ((a - b).node().args.size(), 2u);
  EXPECT_EQ((a - b).node().args[0].op(), Op::kQuery);
  EXPECT_EQ((a - b).node().args[1].op(), Op::kKey);
}

TEST(Expr, TraceBuildsAScoreModifier) {
  const Expr softcap = ir::trace([](Expr s) { return 30.0 * tanh(s / 30.0); });
  EXPECT_EQ(softcap.type(), Type::kF32);
  EXPECT_EQ(softcap.op(), Op::kMul);
  EXPECT_EQ(softcap.to_string(), "30 * tanh(score / 30)");
}

TEST(Expr, ToStringUsesMinimalParentheses) {
  const Expr q = ir::query();
  const Expr kv = ir::key();
  EXPECT_EQ((q - (kv - 1)).to_string(), "q - (kv - 1)");
  EXPECT_EQ(((q - kv) - 1).to_string(), "q - kv - 1");
  EXPECT_EQ(((q + kv) * 2).to_string(), "(q + kv) * 2");
  EXPECT_EQ((q + kv * 2).to_string(), "q + kv * 2");
  EXPECT_EQ(((q >= kv) && (q - kv < 32)).to_string(), "q >= kv && q - kv < 32");
  EXPECT_EQ((((q > kv) || (q < kv)) && (q == kv)).to_string(), "(q > kv || q < kv) && q == kv");
  EXPECT_EQ((-(q + kv)).to_string(), "-(q + kv)");
  EXPECT_EQ((q * -3).to_string(), "q * -3");
  EXPECT_EQ(ir::load("rel", Type::kF32, {ir::head(), ir::clamp(kv - q + 64, 0, 128)}).to_string(),
            "rel[h, clamp(kv - q + 64, 0, 128)]");
  EXPECT_EQ((q + 2.5).to_string(), "q + 2.5");
  EXPECT_EQ((q + 2.0).to_string(), "q + 2.0");
  EXPECT_EQ(ir::to_float(q).to_string(), "float(q)");
  EXPECT_EQ((ir::score() + ir::to_float(q)).to_string(), "score + q");
  EXPECT_EQ((ir::to_float(q) / ir::to_float(kv)).to_string(), "float(q) / kv");
}

}  // namespace
}  // namespace flexattn
