#include "engines/cuda/source_proof.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <numbers>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "engines/cuda/lifted_evaluate.hpp"
#include "engines/cuda/source_lift.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cuda {
namespace {

constexpr double kLog2e = std::numbers::log2e;
// Points per proof: each function is evaluated at every one. The deterministic scores (magnitudes
// from 1e-3 to 1e4 of both signs, the literals of the modifier where branches switch) come
// first; the rest are drawn from a fixed generator.
constexpr int kPoints = 320;
constexpr std::uint64_t kSeed = 0x5eedc0deULL;
// Score magnitudes every proof visits (with both signs and 0): small-tanh limits, softcaps,
// overflow of exp at float32 and beyond.
constexpr double kMagnitudes[] = {1e-3, 0.05, 0.3,  0.59,  1.0,    2.0, 5.0,
                                  13.0, 30.0, 77.0, 250.0, 1000.0, 1e4};
// Relative offsets around each literal of the modifier (a branch like `score > 0.5` switches
// there): the literal itself and just beside it.
constexpr double kBesideLiteral = 1e-5;

[[noreturn]] void fail(std::string what) { throw LiftedEvaluationError{std::move(what)}; }

// Agreement of a lifted value with the request's float64 value.
enum class Agreement { kAgree, kDiffer, kUndecided };
Agreement agreement(const LiftedValue& lifted, double request) {
  if (lifted.ambiguous || !std::isfinite(lifted.error)) return Agreement::kUndecided;
  if (std::isnan(request)) return std::isnan(lifted.value) ? Agreement::kAgree : Agreement::kDiffer;
  if (std::isinf(request)) return lifted.value == request ? Agreement::kAgree : Agreement::kDiffer;
  if (!std::isfinite(lifted.value)) return Agreement::kDiffer;
  // The request's own float64 rounding is far below the float32 bound; the floor covers 0 == 0.
  return std::fabs(lifted.value - request) <= lifted.error + 1e-300 ? Agreement::kAgree
                                                                    : Agreement::kDiffer;
}

// One function's tally: how many points it was evaluated at and how many decided.
struct Tally {
  int evaluated = 0;
  int decided = 0;
};

class Prover {
 public:
  Prover(const Problem& problem, const ModifierBindings& bindings, const LiftedModifier& modifier)
      : problem_(problem),
        bindings_(bindings),
        modifier_(modifier),
        evaluator_(modifier, environment_) {
    environment_.scale = problem.scale();
    for (const std::string& name : bindings.params) {
      environment_.params.push_back(problem.desc().params.at(name));
      request_params_[name] = problem.desc().params.at(name);
    }
    for (std::size_t slot = 0; slot < bindings.tensors.size(); ++slot) {
      const TensorDecl& decl = problem.desc().tensors.at(bindings.tensors[slot]);
      tensors_[bindings.tensors[slot]] = {decl.dtype, decl.shape,
                                          static_cast<std::int64_t>(slot) + 1};
      environment_.tensors.push_back(tensors_[bindings.tensors[slot]]);
    }
    score_mod_ = synthetic_loads(problem.score_mod());
    literal_sources_.push_back(&problem.score_mod());
    mask_mod_ = synthetic_loads(problem.mask_mod());
    if (problem.wants_backward()) {
      derivative_ = derivative_wrt_score(problem.score_mod());
      literal_sources_.push_back(&derivative_);
      derivative_ = synthetic_loads(derivative_);
      for (LoadDerivative& load : derivatives_wrt_tensors(problem.score_mod())) {
        const auto decl = problem.desc().tensors.find(load.tensor);
        if (decl != problem.desc().tensors.end() && is_floating(decl->second.dtype)) {
          for (Graph& index : load.indices) index = synthetic_loads(index);
          load.derivative = synthetic_loads(load.derivative);
          load_derivatives_.push_back(std::move(load));
        }
      }
    }
  }

  // The first failure, or empty.
  std::string prove() {
    const std::vector<double> scores = score_values();
    std::mt19937_64 generator(kSeed + 1);
    for (int i = 0; i < kPoints; ++i) {
      LiftedPoint point = coordinates(generator, i);
      point.score = scores[static_cast<std::size_t>(i) % scores.size()];
      point.dot = point.score / problem_.scale();
      evaluator_.prepare(point);
      forward(point);
      if (problem_.wants_backward()) backward(point);
    }
    for (const auto& [name, tally] : tallies_) {
      // A function whose values are mostly within their error of a branch proves little.
      if (tally.evaluated > 0 && 2 * tally.decided < tally.evaluated) {
        return fmt::format("{} is decided at only {} of {} points", name, tally.decided,
                           tally.evaluated);
      }
    }
    for (const char* required : {"score_mod", "score_mod_log2", "mask_mod"}) {
      if (tallies_[required].decided == 0)
        return fmt::format("{} is decided at no point", required);
    }
    if (flag("kSmallTanh") && tallies_["score_mod_log2_small"].decided == 0) {
      return "tanh_args_small admits no point: the small-tanh function is never proven";
    }
    return {};
  }

 private:
  // `graph` with each load replaced by the synthetic element function of its indices
  // (synthetic_element), so the request reads what the lifted loads read, with no buffer.
  Graph synthetic_loads(const Graph& graph) const {
    std::map<const ir::ExprNode*, ir::Expr> done;
    return Graph(rewrite(graph.to_expr(), done));
  }
  ir::Expr rewrite(const ir::Expr& expr, std::map<const ir::ExprNode*, ir::Expr>& done) const {
    if (const auto found = done.find(expr.pointer().get()); found != done.end())
      return found->second;
    const ir::ExprNode& node = expr.node();
    std::vector<ir::Expr> args;
    for (const ir::Expr& arg : node.args) args.push_back(rewrite(arg, done));
    ir::Expr result = expr;
    if (node.op == Op::kLoad) {
      const SyntheticTensor& tensor = tensors_.at(node.name);
      const ir::Expr prime = ir::literal_i32(kElementHashPrime);
      ir::Expr hash = ir::literal_i32(tensor.salt);
      for (const ir::Expr& index : args) {
        hash = (hash * ir::literal_i32(kElementHashBase) + index % prime) % prime;
      }
      result = is_floating(tensor.dtype) ? ir::to_float(hash % ir::literal_i32(kElementLevels) -
                                                        ir::literal_i32(kElementLevels / 2)) *
                                               ir::literal_f32(kElementStep)
                                         : hash % ir::literal_i32(kElementIds);
    } else if (!args.empty()) {
      result = ir::make(node.op, std::move(args));
    }
    done.emplace(expr.pointer().get(), result);
    return result;
  }

  bool flag(const std::string& name) const {
    const auto found = modifier_.flags.find(name);
    if (found == modifier_.flags.end()) fail(fmt::format("the constant {} is missing", name));
    return found->second;
  }
  double integer(const std::string& name) const {
    const auto found = modifier_.integers.find(name);
    if (found == modifier_.integers.end()) fail(fmt::format("the constant {} is missing", name));
    return found->second;
  }
  double float_constant(const std::string& name) const {
    const auto found = modifier_.constants.find(name);
    if (found == modifier_.constants.end()) fail(fmt::format("the constant {} is missing", name));
    return modifier_.nodes[static_cast<std::size_t>(found->second)].number;
  }

  // The scores of the points: 0, the magnitudes of both signs, each f32 literal of score_mod and
  // its derivative and beside it, then random magnitudes of both signs.
  std::vector<double> score_values() const {
    std::vector<double> scores = {0.0};
    for (double magnitude : kMagnitudes) {
      scores.push_back(magnitude);
      scores.push_back(-magnitude);
    }
    std::set<double> literals;
    for (const Graph* graph : literal_sources_) {
      for (const GraphNode& node : graph->nodes()) {
        if (node.op == Op::kLiteral && node.type == Type::kF32 && std::isfinite(node.literal)) {
          literals.insert(node.literal);
        }
      }
    }
    for (double literal : literals) {
      for (double beside : {1.0, 1.0 + kBesideLiteral, 1.0 - kBesideLiteral}) {
        scores.push_back(literal * beside);
      }
    }
    std::mt19937_64 generator(kSeed + 2);
    std::uniform_real_distribution<double> exponent(-3.0, 4.0);
    while (scores.size() < static_cast<std::size_t>(kPoints)) {
      const double magnitude = std::pow(10.0, exponent(generator));
      scores.push_back((generator() & 1U) != 0 ? magnitude : -magnitude);
    }
    return scores;
  }

  // (b, h, q, kv) inside the problem: every fourth point on the diagonal, others near it, at the
  // ends of the sequences or anywhere.
  LiftedPoint coordinates(std::mt19937_64& generator, int i) const {
    LiftedPoint point;
    const auto pick = [&](std::int64_t extent) {
      return static_cast<std::int64_t>(generator() % static_cast<std::uint64_t>(extent));
    };
    point.batch = pick(problem_.batch());
    point.head = pick(problem_.heads_q());
    point.q_len = problem_.seq_len_q_of(point.batch);
    point.kv_len = problem_.seq_len_kv_of(point.batch);
    point.q = pick(point.q_len);
    switch (i % 4) {
      case 0:
        point.kv = std::min(point.q, point.kv_len - 1);
        break;
      case 1:
        point.kv = std::clamp<std::int64_t>(point.q + pick(9) - 4, 0, point.kv_len - 1);
        break;
      case 2:
        point.q = (generator() & 1U) != 0 ? 0 : point.q_len - 1;
        point.kv = (generator() & 1U) != 0 ? 0 : point.kv_len - 1;
        break;
      default:
        point.kv = pick(point.kv_len);
        break;
    }
    return point;
  }

  double request(const Graph& graph, const LiftedPoint& point, double score) const {
    EvalPoint at;
    at.score = score;
    at.batch = point.batch;
    at.head = point.head;
    at.query = point.q;
    at.key = point.kv;
    at.query_length = point.q_len;
    at.key_length = point.kv_len;
    return evaluate(graph, at, Bindings{request_params_, {}});
  }

  void check(const std::string& name, const LiftedValue& lifted, double expected,
             const LiftedPoint& point) {
    Tally& tally = tallies_[name];
    ++tally.evaluated;
    const Agreement result = agreement(lifted, expected);
    if (result == Agreement::kUndecided) return;
    ++tally.decided;
    if (result == Agreement::kDiffer) {
      fail(fmt::format(
          "{} gives {} (error bound {:.3g}) where the request gives {} at score {}, dot {}, b {}, "
          "h {}, q {}, kv {}",
          name, lifted.value, lifted.error, expected, point.score, point.dot, point.batch,
          point.head, point.q, point.kv));
    }
  }

  // The tensor-core logit functions at `point` (staged or not).
  void logits(LiftedPoint point, double expected_log2) {
    const std::string suffix = point.staged ? " (staged)" : "";
    check("score_mod_log2" + suffix, evaluator_.function("score_mod_log2", point), expected_log2,
          point);
    LiftedValue forward = evaluator_.function("score_mod_forward", point);
    const double to_log2 = float_constant("kForwardToLog2");
    forward = {forward.value * to_log2,
               std::fabs(to_log2) * forward.error +
                   2.0 * kUlpsPerOperation * kUnitRoundoff * std::fabs(forward.value * to_log2),
               forward.ambiguous};
    check("score_mod_forward" + suffix, forward, expected_log2, point);
    if (flag("kSmallTanh")) {
      point.bound = std::fabs(point.dot);
      const LiftedValue small = evaluator_.function("tanh_args_small", point);
      if (!small.ambiguous && small.value != 0.0) {
        check("score_mod_log2_small" + suffix, evaluator_.function("score_mod_log2_small", point),
              expected_log2, point);
      }
    }
  }

  void forward(const LiftedPoint& point) {
    // With kIdentityScore the kernels compute `dot * scale` themselves and call no score
    // function; score_mod is proven all the same (it is generated for every problem).
    const bool identity = flag("kIdentityScore");
    const double score = request(score_mod_, point, point.score);
    check("score_mod", evaluator_.function("score_mod", point), score, point);
    const double expected_log2 = kLog2e * request(score_mod_, point, problem_.scale() * point.dot);
    if (identity) {
      // The kernels' own `dot * p.scale_log2`, one rounding of the scale and one of the product.
      const double logit = point.dot * static_cast<float>(problem_.scale() * kLog2e);
      check("kIdentityScore", {logit, 3.0 * kUnitRoundoff * std::fabs(logit), false}, expected_log2,
            point);
    }
    logits(point, expected_log2);
    if (integer("kStagedTensor") >= 0) {
      LiftedPoint staged = point;
      staged.staged = true;
      logits(staged, expected_log2);
    }
    if (flag("kStaticReference") && std::isfinite(expected_log2)) {
      const double top = float_constant("kStaticReferenceLog2");
      if (expected_log2 > top + kUlpsPerOperation * kUnitRoundoff * std::fabs(top)) {
        fail(fmt::format("kStaticReferenceLog2 {} is below the logit {} at score {}", top,
                         expected_log2, problem_.scale() * point.dot));
      }
    }
    const double keep = request(mask_mod_, point, point.score);
    check("mask_mod",
          flag("kHasMask") ? evaluator_.function("mask_mod", point) : LiftedValue{1.0, 0.0, false},
          keep, point);
  }

  void backward(const LiftedPoint& point) {
    const bool identity = flag("kIdentityDerivative");
    const LiftedValue one{1.0, 0.0, false};
    const double derivative = request(derivative_, point, point.score);
    // With kIdentityDerivative the kernels take 1 and call neither score_grad function; both
    // are proven all the same.
    if (identity) check("kIdentityDerivative", one, derivative, point);
    check("score_grad", evaluator_.function("score_grad", point), derivative, point);
    if (flag("kBoundedDerivative") && std::isfinite(point.score) && !std::isfinite(derivative)) {
      fail(fmt::format("kBoundedDerivative, but d score_mod / d score is {} at score {}",
                       derivative, point.score));
    }
    const double derivative_dot = request(derivative_, point, problem_.scale() * point.dot);
    check("score_grad_from_dot", evaluator_.function("score_grad_from_dot", point), derivative_dot,
          point);
    if (flag("kSmallTanh")) {
      LiftedPoint bounded = point;
      bounded.bound = std::fabs(point.dot);
      const LiftedValue small = evaluator_.function("tanh_args_small", bounded);
      if (!small.ambiguous && small.value != 0.0) {
        check("score_grad_from_dot_small",
              evaluator_.function("score_grad_from_dot_small", bounded), derivative_dot, point);
      }
    }
    tensor_grads(point);
  }

  // Every tensor element tensor_grads adds to at `point`, with the sum of what it adds, against
  // the request's load derivatives at the same elements.
  void tensor_grads(const LiftedPoint& point) {
    std::map<std::pair<int, std::int64_t>, LiftedValue> lifted;
    if (flag("kHasTensorGrads")) {
      const auto found = modifier_.functions.find("tensor_grads");
      if (found == modifier_.functions.end()) fail("tensor_grads is missing");
      for (const LiftedGradient& gradient : found->second.gradients) {
        const LiftedValue offset = evaluator_.node(gradient.offset, point);
        const LiftedValue value = evaluator_.node(gradient.value, point);
        if (offset.ambiguous) {
          ++tallies_["tensor_grads"].evaluated;
          return;
        }
        LiftedValue& sum = lifted[{gradient.slot, static_cast<std::int64_t>(offset.value)}];
        sum = {sum.value + value.value, sum.error + value.error, sum.ambiguous || value.ambiguous};
      }
    }
    std::map<std::pair<int, std::int64_t>, double> expected;
    for (const LoadDerivative& load : load_derivatives_) {
      const auto slot = static_cast<int>(
          std::find(bindings_.tensors.begin(), bindings_.tensors.end(), load.tensor) -
          bindings_.tensors.begin());
      const std::vector<std::int64_t> strides =
          contiguous_strides(problem_.desc().tensors.at(load.tensor).shape);
      std::int64_t offset = 0;
      for (std::size_t k = 0; k < load.indices.size(); ++k) {
        offset +=
            static_cast<std::int64_t>(request(load.indices[k], point, point.score)) * strides[k];
      }
      expected[{slot, offset}] += request(load.derivative, point, point.score);
    }
    std::set<std::pair<int, std::int64_t>> elements;
    for (const auto& entry : lifted) elements.insert(entry.first);
    for (const auto& entry : expected) elements.insert(entry.first);
    for (const auto& element : elements) {
      const auto found = lifted.find(element);
      const LiftedValue value = found == lifted.end() ? LiftedValue{} : found->second;
      const auto wanted = expected.find(element);
      check(fmt::format("tensor_grads of {}[{}]",
                        element.first < static_cast<int>(bindings_.tensors.size())
                            ? bindings_.tensors[static_cast<std::size_t>(element.first)]
                            : std::string("?"),
                        element.second),
            value, wanted == expected.end() ? 0.0 : wanted->second, point);
    }
  }

  const Problem& problem_;
  const ModifierBindings& bindings_;
  const LiftedModifier& modifier_;
  LiftedEnvironment environment_;
  LiftedEvaluator evaluator_;
  std::map<std::string, SyntheticTensor> tensors_;
  std::map<std::string, double> request_params_;
  // The request's graphs with synthetic loads, and the graphs whose literals are scores to visit.
  Graph score_mod_;
  Graph mask_mod_;
  Graph derivative_;
  std::vector<const Graph*> literal_sources_;
  std::vector<LoadDerivative> load_derivatives_;
  std::map<std::string, Tally> tallies_;
};

}  // namespace

SourceProof prove_modifier_source(const Problem& problem, const ModifierBindings& bindings,
                                  std::string_view source) {
  SourceProof proof;
  proof.points = kPoints;
  const LiftResult lifted = lift_modifier_source(source);
  if (!lifted.modifier) {
    proof.failure = "the generated source does not lift: " + lifted.failure;
    return proof;
  }
  try {
    Prover prover(problem, bindings, *lifted.modifier);
    proof.failure = prover.prove();
  } catch (const LiftedEvaluationError& error) {
    proof.failure = error.what;
  } catch (const Error& error) {
    proof.failure = fmt::format("the request cannot be evaluated: {}", error.what());
  } catch (const std::exception& error) {
    // A plan whose proof cannot be computed proves nothing; planning itself goes on.
    proof.failure = fmt::format("the proof failed: {}", error.what());
  }
  proof.proven = proof.failure.empty();
  return proof;
}

ProofHashes proof_hashes(const Problem& problem, const SourceProof& proof) {
  ProofHashes hashes;
  if (!proof.proven) return hashes;
  hashes.lowered_hash = problem.modifier_hash();
  hashes.lowered_backward_hash = problem.backward_hash();
  return hashes;
}

}  // namespace flexattn::cuda
