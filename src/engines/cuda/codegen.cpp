#include "engines/cuda/codegen.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numbers>
#include <set>
#include <tuple>
#include <utility>

#include "engines/cuda/kernel_sources.hpp"
#include "engines/cuda/kernels/params.cuh"
#include "flexattn/error.hpp"

namespace flexattn::cuda {
namespace {

const char* c_type(Type type) {
  switch (type) {
    case Type::kF32:
      return "float";
    case Type::kI32:
      return "int";
    case Type::kBool:
      return "bool";
  }
  throw_internal("cuda codegen: unknown type");
}

std::string float_literal(double value) {
  const auto single = static_cast<float>(value);
  if (std::isnan(single)) return "__int_as_float(0x7fc00000)";
  if (std::isinf(single)) return single > 0 ? "positive_infinity()" : "negative_infinity()";
  // Hexadecimal: exact, so the kernel sees the f32 value the IR's literal rounds to.
  return fmt::format("({:a}f)", single);
}

std::string int_literal(double value) {
  const auto integer = static_cast<std::int64_t>(value);
  if (integer == std::numeric_limits<std::int32_t>::min()) return "(-2147483647 - 1)";
  return integer < 0 ? fmt::format("({})", integer) : fmt::format("{}", integer);
}

// How a tensor of each storage dtype is read (device_math.cuh).
struct TensorAccess {
  const char* pointer;
  const char* loader;
};
TensorAccess tensor_access(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return {"const float*", "load_tensor_f32"};
    case DType::kF64:
      return {"const double*", "load_tensor_f64"};
    case DType::kBF16:
      return {"const unsigned short*", "load_tensor_bf16"};
    case DType::kF16:
      return {"const unsigned short*", "load_tensor_f16"};
    case DType::kI32:
      return {"const int*", "load_tensor_i32"};
    case DType::kI64:
      return {"const long long*", "load_tensor_i64"};
  }
  throw_internal("cuda codegen: unknown tensor dtype");
}

std::size_t slot_of(const std::vector<std::string>& names, const std::string& name) {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return i;
  }
  throw_internal("cuda codegen: '" + name + "' has no kernel-argument slot");
}

// The element offset of a load from its index expressions. Extra tensors are contiguous
// (check_forward_args enforces it), so the strides are constants; offsets are 32-bit when the
// tensor has fewer than 2^31 elements.
std::string linear_offset(const TensorDecl& decl, const std::vector<std::string>& indices) {
  const std::vector<std::int64_t> strides = contiguous_strides(decl.shape);
  std::int64_t elements = 1;
  for (std::int64_t extent : decl.shape) elements *= extent;
  const bool narrow = elements <= std::numeric_limits<std::int32_t>::max();
  std::string offset;
  for (std::size_t k = 0; k < indices.size(); ++k) {
    if (k > 0) offset += " + ";
    const std::int64_t stride = strides[k];
    if (narrow) {
      offset += stride == 1 ? indices[k] : fmt::format("{} * {}", indices[k], stride);
    } else {
      offset += fmt::format("static_cast<long long>({}) * {}LL", indices[k], stride);
    }
  }
  return offset.empty() ? "0" : offset;
}

// The i32 values ir_small_int_to_float (device_math.cuh) converts exactly: [-2^22, 2^22).
constexpr double kSmallIntLimit = 4194304.0;

// A function of the dot product with every tanh in its small form (GraphLowering::emit_from_dot).
struct SmallTanh {
  bool has_tanh = false;   // the function computes a tanh
  bool possible = true;    // every tanh argument has a form whose bound is known
  std::string body;        // with ir_tanh_small when both hold, else the function unchanged
  std::string unchanged;   // the function's body with ir_tanh
  // On `bound`, `inv` and `p`: each tanh argument below kTanhSmallLimit.
  std::vector<std::string> terms;
  std::string condition() const { return fmt::format("{}", fmt::join(terms, " && ")); }
  // Whether this function's terms are among `other`'s.
  bool covered_by(const SmallTanh& other) const {
    return std::all_of(terms.begin(), terms.end(), [&](const std::string& term) {
      return std::find(other.terms.begin(), other.terms.end(), term) != other.terms.end();
    });
  }
};

// Lowers one canonical graph. Nodes that depend only on (b, h, Q_LEN, KV_LEN), params and loads
// at such indices are "invariant": computed once per thread block into Invariants; the rest are
// computed per element.
class GraphLowering {
 public:
  GraphLowering(const Graph& graph, std::string prefix, const Problem& problem,
                const ModifierBindings& bindings)
      : graph_(graph),
        prefix_(std::move(prefix)),
        problem_(problem),
        bindings_(bindings),
        intervals_(node_intervals(graph, problem.leaf_ranges())) {
    const std::size_t count = graph.nodes().size();
    reachable_.assign(count, false);
    varying_.assign(count, false);
    reachable_[static_cast<std::size_t>(graph.root())] = true;
    for (std::size_t i = count; i-- > 0;) {
      if (!reachable_[i]) continue;
      for (std::int32_t arg : graph.nodes()[i].args)
        reachable_[static_cast<std::size_t>(arg)] = true;
    }
    for (std::size_t i = 0; i < count; ++i) {
      const GraphNode& node = graph.nodes()[i];
      bool varying = node.op == Op::kScore || node.op == Op::kQuery || node.op == Op::kKey;
      for (std::int32_t arg : node.args)
        varying = varying || varying_[static_cast<std::size_t>(arg)];
      varying_[i] = varying;
    }
  }

  // Fields of Invariants and their assignments in prepare().
  void emit_invariants(std::string& fields, std::string& assignments) const {
    for (std::size_t i = 0; i < graph_.nodes().size(); ++i) {
      if (!reachable_[i] || varying_[i] || !is_computed(i)) continue;
      const GraphNode& node = graph_.nodes()[i];
      fields += fmt::format("    {} {}{};\n", c_type(node.type), prefix_, i);
      assignments += fmt::format("    inv.{}{} = {};\n", prefix_, i, expression(i));
    }
  }

  // Per-element statements; returns the root's value.
  std::string emit_varying(std::string& statements) const {
    for (std::size_t i = 0; i < graph_.nodes().size(); ++i) {
      if (!reachable_[i] || !varying_[i] || !is_computed(i) || skipped_.count(i) != 0) continue;
      const GraphNode& node = graph_.nodes()[i];
      statements +=
          fmt::format("    const {} {}{} = {};\n", c_type(node.type), prefix_, i, expression(i));
    }
    return reference(static_cast<std::size_t>(graph_.root()));
  }

  // Whether the root (or node `index`) depends on the score, q or kv (else it is a field of
  // Invariants or a leaf).
  bool varies() const { return varies(static_cast<std::size_t>(graph_.root())); }
  bool varies(std::size_t index) const { return varying_[index]; }

  // The staged load (stageable_load): its node reads the StagedElement when the kernel passes one
  // (score_mod_log2 takes `const StagedElement* staged`). Returns the members that go with
  // it: kStagedRowStride and staged_origin (the offset of element [..., 0, 0]).
  std::string stage_load(std::size_t index) {
    const GraphNode& node = graph_.nodes()[index];
    const TensorDecl& decl = problem_.desc().tensors.at(node.name);
    const char* reader = decl.dtype == DType::kBF16 ? "staged_bf16" : "staged_f16";
    staged_ = fmt::format("(staged != nullptr ? {}(*staged) : {})", reader, load(node));
    staged_index_ = index;
    std::vector<std::string> indices;
    for (std::size_t k = 0; k + 2 < node.args.size(); ++k) {
      indices.push_back(operand(node, k, Type::kI32));
    }
    indices.push_back("0");
    indices.push_back("0");
    return fmt::format(
        "  static constexpr int kStagedTensor = {};\n"
        "  static constexpr long long kStagedRowStride = {}LL;\n"
        "  __device__ static __forceinline__ long long staged_origin(const Invariants& inv, "
        "const ForwardParams& p, const Coordinates& at) {{\n    return {};\n  }}\n",
        slot_of(bindings_.tensors, node.name), decl.shape.back(), linear_offset(decl, indices));
  }

  // The body of a function of the raw dot product q . k instead of the score (score_mod_log2 and
  // score_grad_from_dot, which the tensor-core kernels call). Constant multiplications are merged
  // where the graph allows, so softcap's `tanh(score / 30) * 30` costs two instructions less per
  // element: a score used only as `score * c` or `score / c` becomes `dot * (scale * c)` with the
  // product computed once per block (extra Invariants fields; equal products in two functions are
  // one value after inlining, so the forward's tanh and the derivative's stay one computation), and
  // a root `x * c1 * c2` (each step `* c` or `/ c`, inner steps used only there) returns
  // `x * (c1 * c2)`, times log2(e) with `log2_result` (the exp2-domain logit), or `x` when the
  // product is 1 (softcap's derivative). Each merge moves the result by about an ulp of fp32, far
  // inside the 16-bit storage these kernels serve. Returns the statements and the return.
  //
  // With `small`, also the same function with every tanh as ir_tanh_small, and the condition on
  // `bound` (a bound of |dot| over a tile) under which each tanh argument is below
  // kTanhSmallLimit, where ir_tanh returns exactly ir_tanh_small: the kernels then run the cheaper
  // function on the whole tile, with the same values. Offered when every tanh takes the score times
  // or divided by an invariant (softcap's `tanh(score / c)`): such an argument is largest in
  // magnitude at |dot| = bound, because rounding is monotone and symmetric, so the condition
  // evaluates the argument's own operations at the bound.
  std::string emit_from_dot(std::string& fields, std::string& assignments, bool log2_result,
                            SmallTanh* small = nullptr) {
    factor_multiplies_ = 0;
    const auto count = graph_.nodes().size();
    std::int32_t score_node = -1;
    std::vector<int> uses(count, 0);
    for (std::size_t i = 0; i < count; ++i) {
      if (!reachable_[i]) continue;
      if (graph_.nodes()[i].op == Op::kScore) score_node = static_cast<std::int32_t>(i);
      for (std::int32_t arg : graph_.nodes()[i].args) ++uses[static_cast<std::size_t>(arg)];
    }
    const auto root = static_cast<std::size_t>(graph_.root());
    // The root's chain of constant factors, outermost first.
    double factor = log2_result ? 1.4426950408889634 : 1.0;
    std::size_t base = root;
    std::vector<std::size_t> chain;
    for (;;) {
      const GraphNode& node = graph_.nodes()[base];
      if (node.type != Type::kF32 || (base != root && uses[base] != 1)) break;
      if (node.op != Op::kMul && node.op != Op::kDiv) break;
      bool stepped = false;
      for (std::size_t k = node.op == Op::kMul ? 0 : 1; k < 2 && !stepped; ++k) {
        const GraphNode& constant = graph_.node(node.args[k]);
        const std::int32_t other = node.args[1 - k];
        if (constant.op != Op::kLiteral || other == score_node) continue;
        const double c = node.op == Op::kMul ? constant.literal : 1.0 / constant.literal;
        if (!std::isnormal(static_cast<float>(factor * c))) continue;
        factor *= c;
        chain.push_back(base);
        base = static_cast<std::size_t>(other);
        stepped = true;
      }
      if (!stepped) break;
    }
    // A sum at the base takes the factor term by term (distribute_factor); its nodes are skipped,
    // and its uses of the score need no `score`.
    std::string distributed;
    if (static_cast<float>(factor) != 1.0f && (base == root || uses[base] == 1)) {
      distributed = distribute_factor(base, factor, score_node, uses, fields, assignments);
    }
    std::string statements;
    if (score_node >= 0) {
      // The constant factor of each use of the score; all uses must have one to drop `score`.
      std::vector<std::pair<std::size_t, std::string>> folds;
      bool all_folded = score_node != static_cast<std::int32_t>(base);
      for (std::size_t i = 0; i < count; ++i) {
        if (!reachable_[i] || std::find(chain.begin(), chain.end(), i) != chain.end()) continue;
        if (skipped_.count(i) != 0) continue;  // distributed
        const GraphNode& node = graph_.nodes()[i];
        for (std::size_t k = 0; k < node.args.size(); ++k) {
          if (node.args[k] != score_node) continue;
          const std::string score_factor_text = score_factor(node, k);
          if (score_factor_text.empty()) {
            all_folded = false;
          } else {
            folds.emplace_back(i, score_factor_text);
          }
        }
      }
      if (all_folded) {
        for (const auto& [index, text] : folds) {
          const std::string field = dot_field(index, text, fields, assignments);
          overrides_[index] = fmt::format("ir_mul(dot, inv.{})", field);
          override_fields_[index] = field;
        }
      } else {
        statements += "    const float score = dot * p.scale;\n";
      }
    }
    skipped_.insert(chain.begin(), chain.end());
    const auto single = static_cast<float>(factor);
    if (distributed.empty() && single != 1.0f && varying_[base]) ++factor_multiplies_;
    auto body = [&](TanhForm form) {
      tanh_form_ = form;
      std::string text = statements;
      emit_varying(text);
      const std::string value = reference(base);
      const std::string result =
          !distributed.empty() ? distributed
          : single == 1.0f     ? value
                               : fmt::format("ir_mul({}, {})", value, float_literal(factor));
      return text + fmt::format("    return {};\n", result);
    };
    const std::string fast = body(TanhForm::kFast);
    if (small != nullptr) {
      *small = SmallTanh{};
      for (std::size_t i = 0; i < count; ++i) {
        if (!reachable_[i] || skipped_.count(i) != 0 || graph_.nodes()[i].op != Op::kTanh) continue;
        small->has_tanh = true;
        const std::string term = small_tanh_term(static_cast<std::size_t>(graph_.nodes()[i].args[0]),
                                                 score_node);
        if (term.empty()) {
          small->possible = false;
        } else if (std::find(small->terms.begin(), small->terms.end(), term) ==
                   small->terms.end()) {
          small->terms.push_back(term);
        }
      }
      small->unchanged = fast;
      small->body = small->has_tanh && small->possible ? body(TanhForm::kSmall) : fast;
    }
    skipped_.clear();
    overrides_.clear();
    override_fields_.clear();
    tanh_form_ = TanhForm::kLibrary;
    return fast;
  }

  // How many per-element multiplies by the root's constant factor the last emit_from_dot's
  // function has (a varying value times the factor that no product took in: a bias term's
  // `bias * log2 e`, a root `t * log2 e`).
  int factor_multiplies() const { return factor_multiplies_; }

 private:
  // The name of an Invariants field holding `expression` (computed in prepare()), added as
  // `name` unless a field already holds the same expression: the derivative reuses
  // score_mod_log2's products and adds no field.
  static std::string invariant_field(const std::string& name, const std::string& expression,
                                     std::string& fields, std::string& assignments) {
    const std::string value = fmt::format(" = {};\n", expression);
    if (const std::size_t at = assignments.find(value); at != std::string::npos) {
      const std::size_t start = assignments.rfind("inv.", at) + 4;
      return assignments.substr(start, at - start);
    }
    fields += fmt::format("    float {};\n", name);
    assignments += fmt::format("    inv.{}{}", name, value);
    return name;
  }

  // The Invariants field `p.scale * factor` that a score used as `score * factor` by node `index`
  // becomes (`dot * inv.field`), shared with any equal product (invariant_field).
  std::string dot_field(std::size_t index, const std::string& factor, std::string& fields,
                        std::string& assignments) const {
    return invariant_field(fmt::format("{}{}_dot", prefix_, index),
                           fmt::format("p.scale * {}", factor), fields, assignments);
  }

  // The root's constant factor (log2(e) times the root's own constants) taken into each term of
  // a sum at `base`: (score + b) * c becomes dot * (scale * c) + b * c, and ALiBi's
  // (score + float(kv - q) * slope) * c becomes dot * (scale * c) + float(kv - q) * (slope * c)
  // with slope * c computed once per block: a multiply and an FMA per score instead of a
  // multiply, a multiply, an add and the final multiply. Like the other merges, each term moves
  // by about an ulp. Returns the sum's expression, or empty when `base` is not a sum; the sum's
  // nodes that the expression replaces are added to skipped_.
  std::string distribute_factor(std::size_t base, double factor, std::int32_t score_node,
                                const std::vector<int>& uses, std::string& fields,
                                std::string& assignments) {
    const GraphNode& node = graph_.nodes()[base];
    if (node.type != Type::kF32 || (node.op != Op::kAdd && node.op != Op::kSub)) return {};
    if (base == staged_index_) return {};
    return term_times(base, factor, score_node, uses, fields, assignments, true);
  }

  // Node `index` times `factor` (distribute_factor). `whole`: the node is the sum itself, whose
  // only use is the function's result.
  std::string term_times(std::size_t index, double factor, std::int32_t score_node,
                         const std::vector<int>& uses, std::string& fields,
                         std::string& assignments, bool whole = false) {
    const GraphNode& node = graph_.nodes()[index];
    const std::string factor_text = float_literal(factor);
    if (static_cast<std::int32_t>(index) == score_node) {
      return fmt::format("ir_mul(dot, inv.{})",
                         dot_field(index, factor_text, fields, assignments));
    }
    const bool own = (whole || uses[index] == 1) && node.type == Type::kF32 && varying_[index] &&
                     index != staged_index_;
    if (own && (node.op == Op::kAdd || node.op == Op::kSub)) {
      skipped_.insert(index);
      return fmt::format(
          "{}({}, {})", node.op == Op::kAdd ? "ir_add" : "ir_sub",
          term_times(static_cast<std::size_t>(node.args[0]), factor, score_node, uses, fields,
                     assignments),
          term_times(static_cast<std::size_t>(node.args[1]), factor, score_node, uses, fields,
                     assignments));
    }
    if (own && node.op == Op::kNeg) {
      skipped_.insert(index);
      return fmt::format("ir_neg({})", term_times(static_cast<std::size_t>(node.args[0]), factor,
                                                  score_node, uses, fields, assignments));
    }
    if (own && (node.op == Op::kMul || node.op == Op::kDiv)) {
      // x * y or x / y with y invariant: x * (y * factor) or x * (factor / y).
      for (std::size_t k = node.op == Op::kMul ? 0 : 1; k < 2; ++k) {
        const auto y = static_cast<std::size_t>(node.args[k]);
        const auto x = static_cast<std::size_t>(node.args[1 - k]);
        const GraphNode& y_node = graph_.nodes()[y];
        if (varying_[y] || y_node.type != Type::kF32) continue;
        std::string times;  // y * factor (or factor / y) as a literal or an Invariants field
        if (y_node.op == Op::kLiteral) {
          const double c = node.op == Op::kMul ? y_node.literal * factor : factor / y_node.literal;
          if (!std::isnormal(static_cast<float>(c))) continue;
          times = float_literal(c);
        } else {
          times = "inv." + invariant_field(
                               fmt::format("{}{}_times", prefix_, index),
                               node.op == Op::kMul
                                   ? fmt::format("ir_mul({}, {})", reference(y), factor_text)
                                   : fmt::format("ir_div({}, {})", factor_text, reference(y)),
                               fields, assignments);
        }
        skipped_.insert(index);
        if (static_cast<std::int32_t>(x) == score_node) {
          return fmt::format("ir_mul(dot, inv.{})", dot_field(index, times, fields, assignments));
        }
        return fmt::format("ir_mul({}, {})", operand(node, 1 - k, Type::kF32), times);
      }
    }
    if (node.type == Type::kF32 && node.op == Op::kLiteral) {
      return float_literal(node.literal * factor);
    }
    if (varying_[index]) ++factor_multiplies_;
    return fmt::format("ir_mul({}, {})", converted(index, Type::kF32), factor_text);
  }

  // The condition that tanh argument `index` is below kTanhSmallLimit in magnitude for every
  // |dot| <= bound, or empty when its form is not one whose magnitude grows with |dot|: a fold
  // (`dot * inv.field`), or `score * c`, `c * score`, `score / c` with c invariant (the score is
  // `dot * p.scale`).
  std::string small_tanh_term(std::size_t index, std::int32_t score_node) const {
    if (const auto fold = override_fields_.find(index); fold != override_fields_.end()) {
      return fmt::format("fabsf(bound * inv.{}) < kTanhSmallLimit", fold->second);
    }
    const GraphNode& node = graph_.nodes()[index];
    if (score_node < 0 || node.type != Type::kF32 || node.args.size() != 2) return {};
    if (node.op != Op::kMul && node.op != Op::kDiv) return {};
    for (std::size_t k = 0; k < 2; ++k) {
      if (node.args[k] != score_node) continue;
      if (node.op == Op::kDiv && k != 0) continue;
      const std::size_t other = static_cast<std::size_t>(node.args[1 - k]);
      if (varying_[other] || graph_.nodes()[other].type != Type::kF32) continue;
      // The argument's own expression with the score at its largest magnitude.
      const std::string factor = reference(other);
      const std::string at_bound = "(bound * fabsf(p.scale))";
      if (node.op == Op::kDiv) {
        // As expression() lowers it: times the reciprocal of a literal, else a division.
        if (const std::string reciprocal = reciprocal_of_literal(node); !reciprocal.empty()) {
          return fmt::format("fabsf({} * {}) < kTanhSmallLimit", at_bound, reciprocal);
        }
        return fmt::format("fabsf({} / {}) < kTanhSmallLimit", at_bound, factor);
      }
      return fmt::format("fabsf({} * {}) < kTanhSmallLimit", at_bound, factor);
    }
    return {};
  }

  // Nodes that get a named value (everything but leaves, literals and params).
  bool is_computed(std::size_t index) const {
    const Op op = graph_.nodes()[index].op;
    return op == Op::kLoad || is_elementwise(op);
  }

  // How another expression refers to node `index`.
  std::string reference(std::size_t index) const {
    const GraphNode& node = graph_.nodes()[index];
    switch (node.op) {
      case Op::kScore:
        return "score";
      case Op::kBatch:
        return "at.batch";
      case Op::kHead:
        return "at.head";
      case Op::kQuery:
        return "q";
      case Op::kKey:
        return "kv";
      case Op::kQueryLen:
        return "at.q_len";
      case Op::kKeyLen:
        return "at.kv_len";
      case Op::kLiteral:
        if (node.type == Type::kF32) return float_literal(node.literal);
        if (node.type == Type::kI32) return int_literal(node.literal);
        return node.literal != 0.0 ? "true" : "false";
      case Op::kParam:
        return fmt::format("p.params[{}]", slot_of(bindings_.params, node.name));
      default:  // kLoad and the elementwise ops: a named value
        break;
    }
    return varying_[index] ? fmt::format("{}{}", prefix_, index)
                           : fmt::format("inv.{}{}", prefix_, index);
  }

  // Operand `k` of `node`, converted to `type` when its own type differs.
  std::string operand(const GraphNode& node, std::size_t k, Type type) const {
    return converted(static_cast<std::size_t>(node.args[k]), type);
  }

  // Node `index`'s value as `type`.
  std::string converted(std::size_t index, Type type) const {
    const std::string text = reference(index);
    const Type from = graph_.nodes()[index].type;
    if (from == type) return text;
    // An i32 whose range over the problem is small converts without I2F (ir_small_int_to_float).
    if (from == Type::kI32 && type == Type::kF32 &&
        intervals_[index].lo >= -kSmallIntLimit &&
        intervals_[index].hi < kSmallIntLimit) {
      return fmt::format("ir_small_int_to_float({})", text);
    }
    return fmt::format("static_cast<{}>({})", c_type(type), text);
  }

  // The common type of a comparison's operands (i32 with f32 compares as f32).
  Type comparison_type(const GraphNode& node) const {
    const Type a = graph_.node(node.args[0]).type;
    const Type b = graph_.node(node.args[1]).type;
    return a == b ? a : Type::kF32;
  }

  std::string call(const char* function, const GraphNode& node, Type type) const {
    std::string text = fmt::format("{}(", function);
    for (std::size_t k = 0; k < node.args.size(); ++k) {
      if (k > 0) text += ", ";
      text += operand(node, k, type);
    }
    return text + ")";
  }

  std::string compare(const char* symbol, const GraphNode& node) const {
    const Type type = comparison_type(node);
    return fmt::format("({} {} {})", operand(node, 0, type), symbol, operand(node, 1, type));
  }

  // x / c for an f32 literal c: x * (1 / c) when 1 / c is a normal float (within an ulp of the
  // division, and a multiply instead of a division in the per-element code). Empty otherwise.
  std::string reciprocal_of_literal(const GraphNode& node) const {
    const GraphNode& divisor = graph_.node(node.args[1]);
    if (node.type != Type::kF32 || divisor.op != Op::kLiteral) return {};
    const double reciprocal = 1.0 / divisor.literal;
    if (!std::isnormal(static_cast<float>(reciprocal))) return {};
    return float_literal(reciprocal);
  }

  std::string load(const GraphNode& node) const {
    const std::size_t slot = slot_of(bindings_.tensors, node.name);
    const TensorDecl& decl = problem_.desc().tensors.at(node.name);
    const TensorAccess access = tensor_access(decl.dtype);
    std::vector<std::string> indices;
    for (std::size_t k = 0; k < node.args.size(); ++k) {
      indices.push_back(operand(node, k, Type::kI32));
    }
    return fmt::format("{}(static_cast<{}>(p.tensors[{}].data), {})", access.loader, access.pointer,
                       slot, linear_offset(decl, indices));
  }

  // `score * c`, `c * score` or `score / c` (operand `k` is the score) for an f32-typed node:
  // the constant c as a literal, else empty.
  std::string score_factor(const GraphNode& node, std::size_t k) const {
    if (node.type != Type::kF32 || node.args.size() != 2) return {};
    const GraphNode& other = graph_.node(node.args[1 - k]);
    if (other.op != Op::kLiteral) return {};
    if (node.op == Op::kMul) return float_literal(other.literal);
    if (node.op == Op::kDiv && k == 0) return reciprocal_of_literal(node);
    return {};
  }

  std::string expression(std::size_t index) const {
    if (const auto found = overrides_.find(index); found != overrides_.end()) return found->second;
    if (index == staged_index_) return staged_;
    const GraphNode& node = graph_.nodes()[index];
    const Type type = node.type;
    switch (node.op) {
      case Op::kScore:
      case Op::kBatch:
      case Op::kHead:
      case Op::kQuery:
      case Op::kKey:
      case Op::kQueryLen:
      case Op::kKeyLen:
      case Op::kLiteral:
      case Op::kParam:
        return reference(index);
      case Op::kLoad:
        return load(node);
      case Op::kAdd:
        return call("ir_add", node, type);
      case Op::kSub:
        return call("ir_sub", node, type);
      case Op::kMul:
        return call("ir_mul", node, type);
      case Op::kDiv:
        if (const std::string reciprocal = reciprocal_of_literal(node); !reciprocal.empty()) {
          return fmt::format("ir_mul({}, {})", operand(node, 0, type), reciprocal);
        }
        return call("ir_div", node, type);
      case Op::kMod:
        return call("ir_mod", node, type);
      case Op::kNeg:
        return call("ir_neg", node, type);
      case Op::kLess:
        return compare("<", node);
      case Op::kLessEqual:
        return compare("<=", node);
      case Op::kGreater:
        return compare(">", node);
      case Op::kGreaterEqual:
        return compare(">=", node);
      case Op::kEqual:
        return compare("==", node);
      case Op::kNotEqual:
        return compare("!=", node);
      case Op::kAnd:
        return fmt::format("({} && {})", operand(node, 0, Type::kBool),
                           operand(node, 1, Type::kBool));
      case Op::kOr:
        return fmt::format("({} || {})", operand(node, 0, Type::kBool),
                           operand(node, 1, Type::kBool));
      case Op::kNot:
        return fmt::format("(!{})", operand(node, 0, Type::kBool));
      case Op::kWhere:
        return fmt::format("({} ? {} : {})", operand(node, 0, Type::kBool), operand(node, 1, type),
                           operand(node, 2, type));
      case Op::kMin:
        return call("ir_min", node, type);
      case Op::kMax:
        return call("ir_max", node, type);
      case Op::kClamp:
        return call("ir_clamp", node, type);
      case Op::kAbs:
        return call("ir_abs", node, type);
      case Op::kExp:
        return call("expf", node, Type::kF32);
      case Op::kExp2:
        return call("exp2f", node, Type::kF32);
      case Op::kLog:
        return call("logf", node, Type::kF32);
      case Op::kLog2:
        return call("log2f", node, Type::kF32);
      case Op::kSqrt:
        return call("sqrtf", node, Type::kF32);
      case Op::kRsqrt:
        return call("ir_rsqrt", node, Type::kF32);
      case Op::kTanh:
        // The tensor-core kernels' functions (emit_from_dot) use ir_tanh (device_math.cuh):
        // tanhf's accuracy without its clamp, two instructions less per score; the fp32 kernels
        // keep CUDA's tanhf, as verified against the fp32 tolerance. (The exp2/reciprocal form
        // alone, 3e-7 absolute error near 0, was measured at 1.7x the softcap speed on the
        // mma.sync kernel but fails the fp32-level LSE tolerance on short sequences. A per-warp
        // vote that skips the exponential branch when no lane needs it measured a third slower
        // on the wgmma kernel, H200 2026-12-03: the branches serialize the element code.)
        return call(tanh_form_ == TanhForm::kFast    ? "ir_tanh"
                    : tanh_form_ == TanhForm::kSmall ? "ir_tanh_small"
                                                     : "tanhf",
                    node, Type::kF32);
      case Op::kSigmoid:
        return call("ir_sigmoid", node, Type::kF32);
      case Op::kFloor:
        return call("floorf", node, Type::kF32);
      case Op::kToFloat:
        return operand(node, 0, Type::kF32);
      case Op::kToInt:
        if (graph_.node(node.args[0]).type == Type::kI32)
          return reference(static_cast<std::size_t>(node.args[0]));
        return call("ir_to_int", node, Type::kF32);
    }
    throw_internal("cuda codegen: unknown op");
  }

  const Graph& graph_;
  std::string prefix_;
  // Expressions that replace a node's own (emit_log2_from_dot's merged multiplications).
  std::map<std::size_t, std::string> overrides_;
  std::set<std::size_t> skipped_;  // nodes emit_varying leaves out (merged into a factor)
  std::map<std::size_t, std::string> override_fields_;  // the Invariants field of each fold
  // tanh as CUDA's tanhf, as ir_tanh (emit_from_dot) or as ir_tanh_small (its small variant).
  enum class TanhForm { kLibrary, kFast, kSmall };
  TanhForm tanh_form_ = TanhForm::kLibrary;
  int factor_multiplies_ = 0;  // emit_from_dot's (factor_multiplies)
  std::size_t staged_index_ = static_cast<std::size_t>(-1);  // stage_load's node
  std::string staged_;                                       // and its expression
  const Problem& problem_;
  const ModifierBindings& bindings_;
  std::vector<Interval> intervals_;  // each node's range over the problem (interval analysis)
  std::vector<bool> reachable_;
  std::vector<bool> varying_;
};

bool keeps_everything(const Graph& mask) {
  return mask.is_literal() && mask.node(mask.root()).literal != 0.0;
}

bool is_constant(const Graph& graph, double value) {
  return graph.is_literal() && graph.node(graph.root()).literal == value;
}

// Two more spaces before every line (statements moved into a block).
std::string indent(const std::string& lines) {
  std::string text;
  std::size_t start = 0;
  while (start < lines.size()) {
    const std::size_t end = lines.find('\n', start);
    const std::size_t stop = end == std::string::npos ? lines.size() : end + 1;
    text += "  " + lines.substr(start, stop - start);
    start = stop;
  }
  return text;
}

// The Modifier's backward members (kernels/backward_common.cuh). The lowerings of the derivative
// graphs add their invariant nodes to `fields` and `assignments` (Invariants and prepare()),
// under prefixes of their own: d (the score derivative), g<n>i<k>_ (index k of load n), g<n>d_
// (the derivative with respect to load n).
// `small`: score_grad_from_dot with its tanh in the small form (see emit_from_dot).
std::string backward_members(const Problem& problem, const ModifierBindings& bindings,
                             const BackwardCode& backward, std::string& fields,
                             std::string& assignments, SmallTanh& small) {
  const GraphLowering derivative(backward.score_derivative, "d", problem, bindings);
  derivative.emit_invariants(fields, assignments);
  std::string derivative_body;
  const std::string derivative_value = derivative.emit_varying(derivative_body);
  GraphLowering derivative_dot(backward.score_derivative, "d", problem, bindings);
  const std::string derivative_dot_body =
      derivative_dot.emit_from_dot(fields, assignments, false, &small);

  std::string scatter;  // tensor_grads' body
  std::string flush;    // flush_tensor_grads' body
  int local_slots = 0;
  for (std::size_t n = 0; n < backward.load_derivatives.size(); ++n) {
    const LoadDerivative& load = backward.load_derivatives[n];
    // The modifier is piecewise constant in this load (e.g. it only compares it): nothing to add.
    if (is_constant(load.derivative, 0.0)) continue;
    const std::string accumulator =
        fmt::format("bp.grad_fixed[{}]", slot_of(bindings.tensors, load.tensor));
    std::string body;
    std::vector<std::string> indices;
    bool invariant = true;
    for (std::size_t k = 0; k < load.indices.size(); ++k) {
      const GraphLowering index(load.indices[k], fmt::format("g{}i{}_", n, k), problem, bindings);
      index.emit_invariants(fields, assignments);
      indices.push_back(index.emit_varying(body));
      invariant = invariant && !index.varies();
    }
    const GraphLowering value(load.derivative, fmt::format("g{}d_", n), problem, bindings);
    value.emit_invariants(fields, assignments);
    const std::string value_root = value.emit_varying(body);
    const std::string offset = linear_offset(problem.desc().tensors.at(load.tensor), indices);
    const std::string contribution = fmt::format("to_fixed(dlogit * {})", value_root);
    std::vector<std::string> index_text;
    for (const Graph& index : load.indices) index_text.push_back(index.to_string());
    scatter += fmt::format("    // d score_mod / d {}[{}] = {}\n", load.tensor,
                           fmt::join(index_text, ", "), load.derivative.to_string());
    scatter += fmt::format("    if ({} != nullptr) {{\n", accumulator) + indent(body);
    if (invariant) {
      // The same element for the whole (b, h): summed per thread, then per warp, then added.
      scatter += fmt::format("      local[{}] += {};\n", local_slots, contribution);
      flush += fmt::format(
          "    {{\n      const long long sum = warp_sum_fixed(local[{}]);\n"
          "      if ((threadIdx.x % kWarpSize) == 0 && {} != nullptr) add_fixed({} + {}, sum);\n"
          "    }}\n",
          local_slots, accumulator, accumulator, offset);
      ++local_slots;
    } else {
      scatter += fmt::format("      add_fixed({} + {}, {});\n", accumulator, offset, contribution);
    }
    scatter += "    }\n";
  }

  std::string text;
  text += fmt::format("  static constexpr bool kIdentityDerivative = {};\n",
                      is_constant(backward.score_derivative, 1.0));
  // Whether d score_mod / d score is finite at every finite score (its interval over the problem,
  // the score unbounded, has finite ends): then an element whose dlogit is 0 (masked, or P = 0)
  // gets 0 from the product alone, without the kernels' select against 0 * inf.
  const Interval derivative_range = node_intervals(backward.score_derivative, problem.leaf_ranges())
      [static_cast<std::size_t>(backward.score_derivative.root())];
  text += fmt::format("  static constexpr bool kBoundedDerivative = {};\n",
                      std::isfinite(derivative_range.lo) && std::isfinite(derivative_range.hi));
  text += fmt::format("  static constexpr bool kHasTensorGrads = {};\n", !scatter.empty());
  // At least one slot: a C++ array cannot be empty.
  text += fmt::format("  static constexpr int kLocalGradSlots = {};\n", std::max(local_slots, 1));
  text += fmt::format("  // d score_mod / d score: {}\n", backward.score_derivative.to_string());
  text +=
      "  __device__ static __forceinline__ float score_grad(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float score, int q, int kv) {\n" +
      derivative_body + fmt::format("    return {};\n  }}\n", derivative_value);
  text +=
      "  // score_grad(dot * scale), constant multiplications merged\n"
      "  __device__ static __forceinline__ float score_grad_from_dot(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv) {\n" +
      derivative_dot_body + "  }\n";
  text +=
      "  __device__ static __forceinline__ void tensor_grads(const Invariants& inv, "
      "const BackwardParams& bp, const Coordinates& at, float score, int q, int kv, "
      "float dlogit, long long (&local)[kLocalGradSlots]) {\n";
  if (!scatter.empty()) text += "    [[maybe_unused]] const ForwardParams& p = bp.fwd;\n";
  text += scatter + "  }\n";
  text +=
      "  __device__ static __forceinline__ void flush_tensor_grads(const Invariants& inv, "
      "const BackwardParams& bp, const Coordinates& at, "
      "long long (&local)[kLocalGradSlots]) {\n" +
      flush + "  }\n";
  return text;
}

// The four backward entry points (their grids: kernels/params.cuh and the engine's run_backward).
std::string backward_entry_points(const Problem& problem, const BackwardChoice& choice) {
  const std::string launch_bounds = choice.min_blocks > 0
                                        ? fmt::format("{}, {}", choice.threads, choice.min_blocks)
                                        : fmt::format("{}", choice.threads);
  std::string text = fmt::format("using FlexattnBackwardConfig = {};\n", choice.config_type());
  text += fmt::format(
      "extern \"C\" __global__ void __launch_bounds__(flexattn_kernels::kDeltaThreads) {}(\n"
      "    const flexattn_kernels::BackwardParams params) {{\n"
      "  flexattn_kernels::backward_delta<{}, {}>(params);\n}}\n",
      kBackwardDeltaName, element_tag(problem.dtype()), problem.head_dim_v());
  // On wgmma both kernels take the wgmma configuration and its block of threads.
  if (choice.wgmma) {
    text += fmt::format("using FlexattnWgmmaConfig = {};\n", choice.wgmma_config_type());
  }
  const std::string config = choice.wgmma ? "FlexattnWgmmaConfig" : "FlexattnBackwardConfig";
  for (const auto& [name, function, threads] :
       {std::tuple{kBackwardDkdvName, choice.dkdv_template(), choice.dkdv_threads},
        std::tuple{kBackwardDqName, choice.dq_template(), choice.dq_threads}}) {
    const std::string bounds = choice.wgmma ? fmt::format("{}, 1", threads) : launch_bounds;
    text += fmt::format(
        "extern \"C\" __global__ void __launch_bounds__({}) {}(\n"
        "    const flexattn_kernels::BackwardParams params) {{\n"
        "  flexattn_kernels::{}<{}, flexattn_generated::Modifier>(params);\n"
        "}}\n",
        bounds, name, function, config);
  }
  text += fmt::format(
      "extern \"C\" __global__ void __launch_bounds__(flexattn_kernels::kFinalizeThreads) {}(\n"
      "    const flexattn_kernels::FinalizeParams params) {{\n"
      "  flexattn_kernels::backward_finalize(params);\n}}\n",
      kBackwardFinalizeName);
  return text;
}

}  // namespace

BackwardCode backward_code(const Problem& problem, const BackwardChoice& choice) {
  BackwardCode code;
  code.choice = choice;
  code.score_derivative = derivative_wrt_score(problem.score_mod());
  for (LoadDerivative& load : derivatives_wrt_tensors(problem.score_mod())) {
    const auto decl = problem.desc().tensors.find(load.tensor);
    if (decl != problem.desc().tensors.end() && is_floating(decl->second.dtype)) {
      code.load_derivatives.push_back(std::move(load));
    }
  }
  return code;
}

namespace {

// stageable_tensor's load node in score_mod, or -1.
std::int32_t stageable_load(const Problem& problem) {
  if (problem.layout() == Layout::kTHD) return -1;
  const Graph& graph = problem.score_mod();
  const ModifierBindings no_bindings;  // only which nodes vary per element is asked
  const GraphLowering lowering(graph, "s", problem, no_bindings);
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    const GraphNode& node = graph.nodes()[i];
    if (node.op != Op::kLoad) continue;
    const auto decl = problem.desc().tensors.find(node.name);
    if (decl == problem.desc().tensors.end()) continue;
    const std::vector<std::int64_t>& shape = decl->second.shape;
    const std::size_t rank = shape.size();
    if ((decl->second.dtype != DType::kBF16 && decl->second.dtype != DType::kF16) || rank < 2 ||
        node.args.size() != rank || graph.node(node.args[rank - 1]).op != Op::kKey ||
        graph.node(node.args[rank - 2]).op != Op::kQuery ||
        shape[rank - 1] != problem.seq_len_kv() || shape[rank - 2] != problem.seq_len_q() ||
        shape[rank - 1] % 8 != 0) {
      continue;
    }
    bool invariant_rest = true;
    for (std::size_t k = 0; k + 2 < rank; ++k) {
      invariant_rest = invariant_rest && !lowering.varies(static_cast<std::size_t>(node.args[k]));
    }
    if (invariant_rest) return static_cast<std::int32_t>(i);
  }
  return -1;
}

}  // namespace

std::string stageable_tensor(const Problem& problem) {
  const std::int32_t index = stageable_load(problem);
  return index < 0 ? std::string() : problem.score_mod().node(index).name;
}

BindingSelection bind_modifier(const Problem& problem) {
  BindingSelection selection;
  std::set<std::string> tensors;
  std::set<std::string> params;
  for (const Graph* graph : {&problem.score_mod(), &problem.mask_mod()}) {
    for (const std::string& name : graph->tensors()) tensors.insert(name);
    for (const std::string& name : graph->params()) params.insert(name);
  }
  selection.bindings.tensors.assign(tensors.begin(), tensors.end());
  selection.bindings.params.assign(params.begin(), params.end());
  if (tensors.size() > static_cast<std::size_t>(flexattn_kernels::kMaxTensors)) {
    selection.reason = fmt::format("the modifiers read {} tensors; the kernel takes at most {}",
                                   tensors.size(), flexattn_kernels::kMaxTensors);
  } else if (params.size() > static_cast<std::size_t>(flexattn_kernels::kMaxParams)) {
    selection.reason = fmt::format("the modifiers read {} parameters; the kernel takes at most {}",
                                   params.size(), flexattn_kernels::kMaxParams);
  }
  return selection;
}

// The widest logit range (log2 units) for which the forward's softmax fixes its reference after
// a row's first tile: P = exp2(logit - reference) then stays a normal number of fp32's (and
// bf16's) exponent range, far from the 2^-126 where ex2.approx.ftz flushes to 0.
constexpr double kStaticReferenceSpan = 100.0;

// kStaticReference (forward_mma.cuh, bounded_softmax_probabilities): no running row max after a
// row's first tile, when score_mod's interval over the problem (the score unbounded) is finite
// and at most kStaticReferenceSpan wide in log2 units, e.g. a softcap (30 tanh(score / 30) lies
// in [-30, 30]: 86.6 log2 units); kStaticReferenceLog2 is its top. Not for fp16, whose P (stored
// as fp16 for P V) would underflow below 2^-24.
std::string static_reference_members(const Problem& problem) {
  const Graph& graph = problem.score_mod();
  const Interval range =
      node_intervals(graph, problem.leaf_ranges())[static_cast<std::size_t>(graph.root())];
  const double lo = range.lo * std::numbers::log2e;
  const double hi = range.hi * std::numbers::log2e;
  const bool fixed = problem.dtype() != DType::kF16 && std::isfinite(lo) && std::isfinite(hi) &&
                     hi - lo <= kStaticReferenceSpan;
  std::string text = fmt::format("  static constexpr bool kStaticReference = {};\n", fixed);
  text += fmt::format("  static constexpr float kStaticReferenceLog2 = {};{}\n",
                      fixed ? float_literal(hi) : "0.0f",
                      fixed ? fmt::format("  // logits in [{}, {}]", range.lo, range.hi) : "");
  return text;
}

std::string generate_modifier_source(const Problem& problem, const ModifierBindings& bindings,
                                     const KernelChoice& choice, const BackwardCode* backward) {
  if (problem.wants_backward() != (backward != nullptr)) {
    throw_internal("cuda codegen: backward code must be given exactly when gradients are wanted");
  }
  const GraphLowering score(problem.score_mod(), "s", problem, bindings);
  const GraphLowering mask(problem.mask_mod(), "m", problem, bindings);
  std::string fields;
  std::string assignments;
  score.emit_invariants(fields, assignments);
  mask.emit_invariants(fields, assignments);
  std::string score_body;
  const std::string score_value = score.emit_varying(score_body);
  GraphLowering score_log2(problem.score_mod(), "s", problem, bindings);
  std::string staged_members = "  static constexpr int kStagedTensor = -1;\n";
  if (choice.stage_tensor) {
    const std::int32_t staged = stageable_load(problem);
    if (staged < 0) throw_internal("cuda codegen: a staged tensor without a stageable load");
    staged_members = score_log2.stage_load(static_cast<std::size_t>(staged));
  }
  SmallTanh score_small;
  const std::string score_log2_body =
      score_log2.emit_from_dot(fields, assignments, true, &score_small);
  // The forward's logit (score_mod_forward): score_mod_log2, or the natural-units function when
  // log2 e costs it per-element multiplies that the natural one does not have (a bias: `dot *
  // (scale log2 e) + bias * log2 e` against `dot * scale + bias`, one FMA); the softmax then
  // takes log2 e in its exp2 argument, an FMA in place of the subtraction (kForwardToLog2).
  // Not with small-tanh functions (they are of score_mod_log2).
  std::string forward_members =
      "  static constexpr float kForwardToLog2 = 1.0f;\n"
      "  __device__ static __forceinline__ float score_mod_forward(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv, "
      "const StagedElement* staged) {\n"
      "    return score_mod_log2(inv, p, at, dot, q, kv, staged);\n  }\n";
  if (!problem.score_mod().is_identity_score() && score_log2.factor_multiplies() > 0 &&
      !(score_small.has_tanh && score_small.possible)) {
    GraphLowering score_natural(problem.score_mod(), "s", problem, bindings);
    if (choice.stage_tensor) {
      const auto staged = static_cast<std::size_t>(stageable_load(problem));
      static_cast<void>(score_natural.stage_load(staged));
    }
    std::string natural_fields = fields;
    std::string natural_assignments = assignments;
    const std::string natural_body =
        score_natural.emit_from_dot(natural_fields, natural_assignments, false);
    if (score_natural.factor_multiplies() < score_log2.factor_multiplies()) {
      fields = std::move(natural_fields);
      assignments = std::move(natural_assignments);
      forward_members =
          "  static constexpr float kForwardToLog2 = kLog2e;\n"
          "  // score_mod(dot * scale), constant multiplications merged (natural units)\n"
          "  __device__ static __forceinline__ float score_mod_forward(const Invariants& inv, "
          "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv, "
          "[[maybe_unused]] const StagedElement* staged) {\n" +
          natural_body + "  }\n";
    }
  }
  std::string mask_body;
  const std::string mask_value = mask.emit_varying(mask_body);
  SmallTanh derivative_small;
  std::string backward_text =
      backward != nullptr
          ? backward_members(problem, bindings, *backward, fields, assignments, derivative_small)
          : std::string();
  // The small-tanh variants (kSmallTanh), decided by score_mod alone (the forward's source is
  // the same with or without the backward): offered when it computes a tanh and every tanh
  // argument has a known bound. The derivative's variant has its tanh in the small form when its
  // arguments are covered by the same condition (softcap: the same argument), else it is the
  // derivative unchanged, which is exact at any bound.
  const bool small_tanh = score_small.has_tanh && score_small.possible;
  if (small_tanh && backward != nullptr) {
    const bool covered = derivative_small.possible && derivative_small.covered_by(score_small);
    backward_text +=
        "  __device__ static __forceinline__ float score_grad_from_dot_small("
        "const Invariants& inv, const ForwardParams& p, const Coordinates& at, float dot, "
        "int q, int kv) {\n" +
        (covered ? derivative_small.body : derivative_small.unchanged) + "  }\n";
  }

  std::string text = "// ---- generated by flexattn's cuda engine ----\n";
  text += "namespace flexattn_generated {\nusing namespace flexattn_kernels;\n\n";
  text += "struct Modifier {\n";
  text += fmt::format("  static constexpr bool kIdentityScore = {};\n",
                      problem.score_mod().is_identity_score());
  text += fmt::format("  static constexpr bool kHasMask = {};\n",
                      !keeps_everything(problem.mask_mod()));
  text += "  struct Invariants {\n" + fields + "  };\n";
  text +=
      "  __device__ static __forceinline__ Invariants prepare(const ForwardParams& p, "
      "const Coordinates& at) {\n    Invariants inv{};\n" +
      assignments + "    return inv;\n  }\n";
  text += fmt::format("  // score_mod: {}\n", problem.score_mod().to_string());
  text +=
      "  __device__ static __forceinline__ float score_mod(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float score, int q, int kv) {\n" +
      score_body + fmt::format("    return {};\n  }}\n", score_value);
  text +=
      "  // score_mod(dot * scale) * log2(e), constant multiplications merged\n"
      "  __device__ static __forceinline__ float score_mod_log2(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv, "
      "[[maybe_unused]] const StagedElement* staged) {\n" +
      score_log2_body + "  }\n";
  text += forward_members;
  text += static_reference_members(problem);
  text += fmt::format("  static constexpr bool kSmallTanh = {};\n", small_tanh);
  if (small_tanh) {
    text +=
        "  // Whether every tanh argument is below kTanhSmallLimit for |dot| <= bound, where\n"
        "  // ir_tanh_small equals ir_tanh: then the _small functions give the same values.\n"
        "  __device__ static __forceinline__ bool tanh_args_small(const Invariants& inv, "
        "const ForwardParams& p, float bound) {\n" +
        fmt::format("    return {};\n  }}\n", score_small.condition());
    text +=
        "  __device__ static __forceinline__ float score_mod_log2_small(const Invariants& inv, "
        "const ForwardParams& p, const Coordinates& at, float dot, int q, int kv, "
        "[[maybe_unused]] const StagedElement* staged) {\n" +
        score_small.body + "  }\n";
  }
  text += staged_members;
  text += fmt::format("  // mask_mod: {}\n", problem.mask_mod().to_string());
  text +=
      "  __device__ static __forceinline__ bool mask_mod(const Invariants& inv, "
      "const ForwardParams& p, const Coordinates& at, int q, int kv) {\n" +
      mask_body + fmt::format("    return {};\n  }}\n", mask_value);
  text += backward_text;
  text += "};\n\n}  // namespace flexattn_generated\n\n";

  const bool tensor_cores = choice.kind != KernelKind::kSimt;
  text += fmt::format("using FlexattnConfig = {};\n", choice.config_type());
  text += fmt::format(
      "extern \"C\" __global__ void __launch_bounds__(FlexattnConfig::{}{}) {}(\n"
      "    const flexattn_kernels::ForwardParams params) {{\n"
      "  flexattn_kernels::{}<FlexattnConfig, flexattn_generated::Modifier>(params);\n}}\n",
      choice.kind == KernelKind::kWgmma ? "kBlockThreads" : "kThreads",
      tensor_cores ? ", FlexattnConfig::kMinBlocks" : "", kKernelName, choice.kernel_template());
  if (backward != nullptr) text += backward_entry_points(problem, backward->choice);
  return text;
}

std::string generate_translation_unit(const Problem& problem, const ModifierBindings& bindings,
                                      const KernelChoice& choice, const BackwardCode* backward) {
  return std::string(kernel_library_source()) + "\n" +
         generate_modifier_source(problem, bindings, choice, backward);
}

}  // namespace flexattn::cuda
