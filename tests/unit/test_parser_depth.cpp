// The parser's depth limit: an expression at its limit (256 levels) parses and goes through every
// recursive walk of the IR (printing, canonicalisation, derivatives, interval analysis,
// evaluation, both CPU engines forward and backward); one level deeper is a one-line error naming
// the limit, and so are ten thousand levels, which overflowed the stack before the limit.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

// The parser's limit (kMaxParseDepth in src/core/parser.cpp).
constexpr int kLimit = 256;
// Deep enough to overflow an 8 MiB stack in a recursive descent without a limit.
constexpr int kHostileDepth = 11000;
// The printer's cut (64 KiB) plus its note.
constexpr std::size_t kLongestText = (std::size_t{1} << 16) + 100;

std::string repeated(const std::string& text, int count) {
  std::string result;
  for (int i = 0; i < count; ++i) result += text;
  return result;
}

// Each form builds a score modifier whose nesting or tree height is `depth` (give or take one
// for the forms that grow by two levels at a time). Canonicalisation folds some of them
// (abs(abs(x)),
// - - x, ((x)), x + 1 + 1); the others reach the engines at full height.
struct DeepForm {
  const char* name;
  std::string (*text)(int depth);
};

const DeepForm kForms[] = {
    {"nested abs",
     [](int depth) { return repeated("abs(", depth - 1) + "score" + repeated(")", depth - 1); }},
    {"nested abs of differences",
     [](int depth) {
       return repeated("abs(1 - ", (depth - 1) / 2) + "score" + repeated(")", (depth - 1) / 2);
     }},
    {"nested where",
     [](int depth) {
       return repeated("where(q > kv, 0.5 * ", (depth - 1) / 2) + "score" +
              repeated(", score)", (depth - 1) / 2);
     }},
    {"nested tanh",
     [](int depth) { return repeated("tanh(", depth - 1) + "score" + repeated(")", depth - 1); }},
    {"unary minus", [](int depth) { return repeated("-", depth - 1) + "score"; }},
    {"parentheses",
     [](int depth) { return repeated("(", depth - 1) + "score" + repeated(")", depth - 1); }},
    {"left-leaning sum", [](int depth) { return "score" + repeated(" + 1", depth - 1); }},
    {"right-leaning product",
     [](int depth) {
       return repeated("score * (", depth - 1) + "score" + repeated(")", depth - 1);
     }},
};

std::string parse_error(const std::string& text) {
  try {
    ir::parse(text);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    return error.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

ProblemDesc tiny_desc(const ir::Expr& score_mod) {
  ProblemDesc desc;
  desc.batch = 1, desc.heads_q = 1, desc.seq_len_q = 5, desc.seq_len_kv = 3, desc.head_dim_qk = 4;
  desc.score_mod = score_mod;
  const int levels = kLimit / 2 - 1;
  desc.mask_mod =
      ir::parse("q + 1 >= " + repeated("abs(1 - ", levels) + "kv" + repeated(")", levels));
  desc.direction = Direction::kForwardBackward;
  return desc;
}

TEST(ParserDepth, EveryWalkSurvivesAnExpressionAtTheLimit) {
  for (const DeepForm& form : kForms) {
    SCOPED_TRACE(form.name);
    const ir::Expr expr = ir::parse(form.text(kLimit));
    EXPECT_FALSE(expr.to_string().empty());
    const Graph graph(expr);
    EXPECT_FALSE(graph.to_string().empty());
    const Graph derivative = derivative_wrt_score(graph);
    // Repeating shared nodes, the derivative's text would be exponentially long; it is cut.
    EXPECT_FALSE(derivative.to_string().empty());
    EXPECT_LT(derivative.to_string().size(), kLongestText);
    LeafRanges ranges;
    ranges.query = ranges.key = {0.0, 4.0};
    ranges.query_length = ranges.key_length = {5.0, 5.0};
    EXPECT_EQ(node_intervals(graph, ranges).size(), graph.nodes().size());
    EvalPoint point;
    point.score = 0.25;
    EXPECT_FALSE(std::isnan(evaluate(graph, point, {})));

    ProblemDesc desc = tiny_desc(expr);
    const Problem problem(desc);
    const test::Inputs inputs = test::random_inputs(problem, 1);
    // Engines that generate code (cuda, forward and backward) do so without a device.
    desc.device = Device::kCuda;
    desc.dtype = DType::kBF16;
    const Problem on_device(desc);
    for (const std::shared_ptr<const Engine>& engine : builtin_engines()) {
      SCOPED_TRACE(engine->name());
      const std::string source = engine->generated_source(on_device);
      if (engine->name() == "cuda") {
        EXPECT_FALSE(source.empty());
      }
    }
    for (const char* engine : {"cpu", "cpu_ref"}) {
      SCOPED_TRACE(engine);
      const test::Outputs outputs =
          test::run_engine(*test::builtin_engine(engine), problem, inputs);
      EXPECT_EQ(outputs.out.shape(), problem.expected("o").shape);
    }
  }
}

TEST(ParserDepth, OneLevelPastTheLimitIsAnError) {
  for (const DeepForm& form : kForms) {
    SCOPED_TRACE(form.name);
    const std::string message = parse_error(form.text(kLimit + 1));
    EXPECT_NE(message.find("nested deeper than 256 levels"), std::string::npos) << message;
  }
  EXPECT_NE(parse_error(repeated("!", kLimit) + "(q >= kv)").find("nested deeper"),
            std::string::npos);
  EXPECT_NE(
      parse_error("q >= " + repeated("abs(1 - ", kLimit / 2) + "kv" + repeated(")", kLimit / 2))
          .find("nested deeper"),
      std::string::npos);
}

TEST(ParserDepth, HostileDepthIsAShortError) {
  for (const DeepForm& form : kForms) {
    SCOPED_TRACE(form.name);
    const std::string message = parse_error(form.text(kHostileDepth));
    EXPECT_NE(message.find("nested deeper than 256 levels"), std::string::npos);
    // The message quotes a prefix of the text, not all of it.
    EXPECT_LT(message.size(), 300u) << message;
  }
}

}  // namespace
}  // namespace flexattn
