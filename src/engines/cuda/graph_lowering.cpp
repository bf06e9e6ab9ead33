#include "engines/cuda/graph_lowering.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

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

// The i32 values ir_small_int_to_float (device_math.cuh) converts exactly: [-2^22, 2^22).
constexpr double kSmallIntLimit = 4194304.0;

}  // namespace

std::string float_literal(double value) {
  const auto single = static_cast<float>(value);
  if (std::isnan(single)) return "__int_as_float(0x7fc00000)";
  if (std::isinf(single)) return single > 0 ? "positive_infinity()" : "negative_infinity()";
  // Hexadecimal: exact, so the kernel sees the f32 value the IR's literal rounds to.
  return fmt::format("({:a}f)", single);
}

std::size_t slot_of(const std::vector<std::string>& names, const std::string& name) {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return i;
  }
  throw_internal("cuda codegen: '" + name + "' has no kernel-argument slot");
}

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

std::string SmallTanh::condition() const { return fmt::format("{}", fmt::join(terms, " && ")); }

bool SmallTanh::covered_by(const SmallTanh& other) const {
  return std::all_of(terms.begin(), terms.end(), [&](const std::string& term) {
    return std::find(other.terms.begin(), other.terms.end(), term) != other.terms.end();
  });
}

GraphLowering::GraphLowering(const Graph& graph, std::string prefix, const Problem& problem,
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
    for (std::int32_t arg : graph.nodes()[i].args) reachable_[static_cast<std::size_t>(arg)] = true;
  }
  for (std::size_t i = 0; i < count; ++i) {
    const GraphNode& node = graph.nodes()[i];
    bool varying = node.op == Op::kScore || node.op == Op::kQuery || node.op == Op::kKey;
    for (std::int32_t arg : node.args) varying = varying || varying_[static_cast<std::size_t>(arg)];
    varying_[i] = varying;
  }
}

void GraphLowering::emit_invariants(std::string& fields, std::string& assignments) const {
  for (std::size_t i = 0; i < graph_.nodes().size(); ++i) {
    if (!reachable_[i] || varying_[i] || !is_computed(i)) continue;
    const GraphNode& node = graph_.nodes()[i];
    fields += fmt::format("    {} {}{};\n", c_type(node.type), prefix_, i);
    assignments += fmt::format("    inv.{}{} = {};\n", prefix_, i, expression(i));
  }
}

std::string GraphLowering::emit_varying(std::string& statements) const {
  for (std::size_t i = 0; i < graph_.nodes().size(); ++i) {
    if (!reachable_[i] || !varying_[i] || !is_computed(i) || skipped_.count(i) != 0) continue;
    const GraphNode& node = graph_.nodes()[i];
    statements +=
        fmt::format("    const {} {}{} = {};\n", c_type(node.type), prefix_, i, expression(i));
  }
  return reference(static_cast<std::size_t>(graph_.root()));
}

std::string GraphLowering::stage_load(std::size_t index) {
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

std::string GraphLowering::emit_from_dot(std::string& fields, std::string& assignments,
                                         bool log2_result, SmallTanh* small) {
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
    const std::string result = !distributed.empty() ? distributed
                               : single == 1.0f
                                   ? value
                                   : fmt::format("ir_mul({}, {})", value, float_literal(factor));
    return text + fmt::format("    return {};\n", result);
  };
  const std::string fast = body(TanhForm::kFast);
  if (small != nullptr) {
    *small = SmallTanh{};
    for (std::size_t i = 0; i < count; ++i) {
      if (!reachable_[i] || skipped_.count(i) != 0 || graph_.nodes()[i].op != Op::kTanh) continue;
      small->has_tanh = true;
      const std::string term =
          small_tanh_term(static_cast<std::size_t>(graph_.nodes()[i].args[0]), score_node);
      if (term.empty()) {
        small->possible = false;
      } else if (std::find(small->terms.begin(), small->terms.end(), term) == small->terms.end()) {
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

std::string GraphLowering::invariant_field(const std::string& name, const std::string& expression,
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

std::string GraphLowering::dot_field(std::size_t index, const std::string& factor,
                                     std::string& fields, std::string& assignments) const {
  return invariant_field(fmt::format("{}{}_dot", prefix_, index),
                         fmt::format("p.scale * {}", factor), fields, assignments);
}

std::string GraphLowering::distribute_factor(std::size_t base, double factor,
                                             std::int32_t score_node, const std::vector<int>& uses,
                                             std::string& fields, std::string& assignments) {
  const GraphNode& node = graph_.nodes()[base];
  if (node.type != Type::kF32 || (node.op != Op::kAdd && node.op != Op::kSub)) return {};
  if (base == staged_index_) return {};
  return term_times(base, factor, score_node, uses, fields, assignments, true);
}

std::string GraphLowering::term_times(std::size_t index, double factor, std::int32_t score_node,
                                      const std::vector<int>& uses, std::string& fields,
                                      std::string& assignments, bool whole) {
  const GraphNode& node = graph_.nodes()[index];
  const std::string factor_text = float_literal(factor);
  if (static_cast<std::int32_t>(index) == score_node) {
    return fmt::format("ir_mul(dot, inv.{})", dot_field(index, factor_text, fields, assignments));
  }
  const bool own = (whole || uses[index] == 1) && node.type == Type::kF32 && varying_[index] &&
                   index != staged_index_;
  if (own && (node.op == Op::kAdd || node.op == Op::kSub)) {
    skipped_.insert(index);
    return fmt::format("{}({}, {})", node.op == Op::kAdd ? "ir_add" : "ir_sub",
                       term_times(static_cast<std::size_t>(node.args[0]), factor, score_node, uses,
                                  fields, assignments),
                       term_times(static_cast<std::size_t>(node.args[1]), factor, score_node, uses,
                                  fields, assignments));
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
        times =
            "inv." + invariant_field(fmt::format("{}{}_times", prefix_, index),
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

std::string GraphLowering::small_tanh_term(std::size_t index, std::int32_t score_node) const {
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

bool GraphLowering::is_computed(std::size_t index) const {
  const Op op = graph_.nodes()[index].op;
  return op == Op::kLoad || is_elementwise(op);
}

std::string GraphLowering::reference(std::size_t index) const {
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

std::string GraphLowering::operand(const GraphNode& node, std::size_t k, Type type) const {
  return converted(static_cast<std::size_t>(node.args[k]), type);
}

std::string GraphLowering::converted(std::size_t index, Type type) const {
  const std::string text = reference(index);
  const Type from = graph_.nodes()[index].type;
  if (from == type) return text;
  // An i32 whose range over the problem is small converts without I2F (ir_small_int_to_float).
  if (from == Type::kI32 && type == Type::kF32 && intervals_[index].lo >= -kSmallIntLimit &&
      intervals_[index].hi < kSmallIntLimit) {
    return fmt::format("ir_small_int_to_float({})", text);
  }
  return fmt::format("static_cast<{}>({})", c_type(type), text);
}

Type GraphLowering::comparison_type(const GraphNode& node) const {
  const Type a = graph_.node(node.args[0]).type;
  const Type b = graph_.node(node.args[1]).type;
  return a == b ? a : Type::kF32;
}

std::string GraphLowering::call(const char* function, const GraphNode& node, Type type) const {
  std::string text = fmt::format("{}(", function);
  for (std::size_t k = 0; k < node.args.size(); ++k) {
    if (k > 0) text += ", ";
    text += operand(node, k, type);
  }
  return text + ")";
}

std::string GraphLowering::compare(const char* symbol, const GraphNode& node) const {
  const Type type = comparison_type(node);
  return fmt::format("({} {} {})", operand(node, 0, type), symbol, operand(node, 1, type));
}

std::string GraphLowering::reciprocal_of_literal(const GraphNode& node) const {
  const GraphNode& divisor = graph_.node(node.args[1]);
  if (node.type != Type::kF32 || divisor.op != Op::kLiteral) return {};
  const double reciprocal = 1.0 / divisor.literal;
  if (!std::isnormal(static_cast<float>(reciprocal))) return {};
  return float_literal(reciprocal);
}

std::string GraphLowering::load(const GraphNode& node) const {
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

std::string GraphLowering::score_factor(const GraphNode& node, std::size_t k) const {
  if (node.type != Type::kF32 || node.args.size() != 2) return {};
  const GraphNode& other = graph_.node(node.args[1 - k]);
  if (other.op != Op::kLiteral) return {};
  if (node.op == Op::kMul) return float_literal(other.literal);
  if (node.op == Op::kDiv && k == 0) return reciprocal_of_literal(node);
  return {};
}

std::string GraphLowering::expression(std::size_t index) const {
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

bool keeps_everything(const Graph& mask) {
  return mask.is_literal() && mask.node(mask.root()).literal != 0.0;
}

bool is_constant(const Graph& graph, double value) {
  return graph.is_literal() && graph.node(graph.root()).literal == value;
}

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

}  // namespace flexattn::cuda
