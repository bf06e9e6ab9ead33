#include "engines/cudnn/proof.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <numbers>

#include "core/graph_rebuild.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cudnn {
namespace {

using Kind = OperationRecord::Kind;

[[noreturn]] void unrecognised(const std::string& what) {
  throw_internal(fmt::format("cudnn plan proof: {}", what));
}

ir::Expr axis_leaf(std::int64_t axis) {
  switch (axis) {
    case 0:
      return ir::batch();
    case 1:
      return ir::head();
    case 2:
      return ir::query();
    case 3:
      return ir::key();
    default:
      unrecognised(fmt::format("GEN_INDEX along axis {}", axis));
  }
}

// The IR type a cuDNN tensor holds; HALF and BFLOAT16 are no modifier value's type.
std::optional<Type> ir_type(cudnnDataType_t type) {
  if (type == CUDNN_DATA_FLOAT) return Type::kF32;
  if (type == CUDNN_DATA_INT32) return Type::kI32;
  if (type == CUDNN_DATA_BOOLEAN) return Type::kBool;
  return std::nullopt;
}

// The inverse of lowering.cpp's table: each operation of the graph as the IR op it computes.
class Rebuilder {
 public:
  Rebuilder(const GraphRecord& record, const BoundValues& bound) : record_(record), bound_(bound) {
    for (std::size_t i = 0; i < record.operations.size(); ++i) {
      const OperationRecord& operation = record.operations[i];
      producers_[operation.output] = i;
      for (std::int64_t input : operation.inputs) consumers_[input].push_back(i);
    }
  }

  const OperationRecord* producer(std::int64_t uid) const {
    const auto found = producers_.find(uid);
    return found == producers_.end() ? nullptr : &record_.operations[found->second];
  }
  std::vector<const OperationRecord*> consumers(std::int64_t uid) const {
    std::vector<const OperationRecord*> result;
    if (const auto found = consumers_.find(uid); found != consumers_.end()) {
      for (std::size_t i : found->second) result.push_back(&record_.operations[i]);
    }
    return result;
  }
  const TensorRecord& tensor(std::int64_t uid) const {
    const auto found = record_.tensors.find(uid);
    if (found == record_.tensors.end()) unrecognised(fmt::format("tensor uid {} unread", uid));
    return found->second;
  }
  bool is_matmul_output(std::int64_t uid) const {
    const OperationRecord* op = producer(uid);
    return op != nullptr && op->kind == Kind::kMatmul;
  }
  bool is_scalar(std::int64_t uid) const {
    return producer(uid) == nullptr && tensor(uid).by_value && bound_.host.contains(uid);
  }
  double scalar_value(std::int64_t uid) const {
    const void* pointer = bound_.host.at(uid);
    switch (tensor(uid).type) {
      case CUDNN_DATA_FLOAT: {
        float value = 0.0F;
        std::memcpy(&value, pointer, sizeof(value));
        return value;
      }
      case CUDNN_DATA_INT32: {
        std::int32_t value = 0;
        std::memcpy(&value, pointer, sizeof(value));
        return value;
      }
      case CUDNN_DATA_BOOLEAN: {
        bool value = false;
        std::memcpy(&value, pointer, sizeof(value));
        return value ? 1.0 : 0.0;
      }
      default:
        unrecognised(fmt::format("by-value tensor uid {} of cuDNN data type {}", uid,
                                 static_cast<int>(tensor(uid).type)));
    }
  }

  void set_score(std::int64_t uid) { score_ = uid; }

  ir::Expr expression(std::int64_t uid) {
    if (uid == score_) return ir::score();
    if (const auto found = memo_.find(uid); found != memo_.end()) return found->second;
    ir::Expr result = compute(uid);
    memo_.emplace(uid, result);
    return result;
  }

 private:
  ir::Expr leaf(std::int64_t uid) const {
    const TensorRecord& t = tensor(uid);
    if (t.by_value) {
      if (!bound_.host.contains(uid)) unrecognised(fmt::format("by-value uid {} unbound", uid));
      const double value = scalar_value(uid);
      if (t.type == CUDNN_DATA_INT32) return ir::literal_i32(static_cast<std::int64_t>(value));
      if (t.type == CUDNN_DATA_BOOLEAN) return ir::literal_bool(value != 0.0);
      return ir::literal_f32(value);
    }
    const auto name = bound_.tensors.find(uid);
    if (t.is_virtual || name == bound_.tensors.end()) {
      unrecognised(
          fmt::format("the modifier reads tensor uid {}, which no operation computes "
                      "and no modifier tensor binds",
                      uid));
    }
    // A load broadcast over the axes it does not vary along; its indices are the axes it does,
    // outermost (largest stride) first.
    std::vector<std::size_t> axes;
    for (std::size_t a = 0; a < t.dims.size(); ++a) {
      if (t.dims[a] > 1) axes.push_back(a);
    }
    std::stable_sort(axes.begin(), axes.end(),
                     [&](std::size_t x, std::size_t y) { return t.strides[x] > t.strides[y]; });
    std::vector<ir::Expr> indices;
    for (std::size_t a : axes) indices.push_back(axis_leaf(static_cast<std::int64_t>(a)));
    // A load that varies along no axis reads one element (cudnn_normal_form writes it alike).
    if (indices.empty()) indices.push_back(ir::literal_i32(0));
    const Type type = t.type == CUDNN_DATA_INT32 ? Type::kI32 : Type::kF32;
    return ir::load(name->second, type, std::move(indices));
  }

  ir::Expr compute(std::int64_t uid) {
    const OperationRecord* op = producer(uid);
    if (op == nullptr) return leaf(uid);
    if (op->kind != Kind::kPointwise) {
      unrecognised(
          fmt::format("the modifier reads uid {}, the output of a matmul, reduction or "
                      "reshape",
                      uid));
    }
    std::vector<ir::Expr> in;
    for (std::int64_t input : op->inputs) in.push_back(expression(input));
    const auto need = [&](std::size_t count) {
      if (in.size() != count) {
        unrecognised(fmt::format("pointwise {} (mode {}) with {} inputs", to_string(op->mode),
                                 static_cast<int>(op->mode), in.size()));
      }
    };
    const auto binary = [&](Op ir_op) {
      need(2);
      return ir::make(ir_op, {in[0], in[1]});
    };
    const auto unary = [&](Op ir_op) {
      need(1);
      return ir::make(ir_op, {in[0]});
    };
    const std::optional<Type> output = ir_type(tensor(op->output).type);
    if (!output) unrecognised(fmt::format("a modifier value of uid {} in an io type", uid));
    ir::Expr result = ir::score();
    switch (op->mode) {
      case CUDNN_POINTWISE_ADD:
        result = binary(Op::kAdd);
        break;
      case CUDNN_POINTWISE_SUB:
        result = binary(Op::kSub);
        break;
      case CUDNN_POINTWISE_MUL:
        result = binary(Op::kMul);
        break;
      case CUDNN_POINTWISE_DIV:
        result = binary(Op::kDiv);
        break;
      case CUDNN_POINTWISE_MOD:
        result = binary(Op::kMod);
        break;
      case CUDNN_POINTWISE_MIN:
        result = binary(Op::kMin);
        break;
      case CUDNN_POINTWISE_MAX:
        result = binary(Op::kMax);
        break;
      case CUDNN_POINTWISE_CMP_LT:
        result = binary(Op::kLess);
        break;
      case CUDNN_POINTWISE_CMP_LE:
        result = binary(Op::kLessEqual);
        break;
      case CUDNN_POINTWISE_CMP_GT:
        result = binary(Op::kGreater);
        break;
      case CUDNN_POINTWISE_CMP_GE:
        result = binary(Op::kGreaterEqual);
        break;
      case CUDNN_POINTWISE_CMP_EQ:
        result = binary(Op::kEqual);
        break;
      case CUDNN_POINTWISE_CMP_NEQ:
        result = binary(Op::kNotEqual);
        break;
      case CUDNN_POINTWISE_LOGICAL_AND:
        result = binary(Op::kAnd);
        break;
      case CUDNN_POINTWISE_LOGICAL_OR:
        result = binary(Op::kOr);
        break;
      case CUDNN_POINTWISE_LOGICAL_NOT:
        result = unary(Op::kNot);
        break;
      case CUDNN_POINTWISE_NEG:
        result = unary(Op::kNeg);
        break;
      case CUDNN_POINTWISE_ABS:
        result = unary(Op::kAbs);
        break;
      case CUDNN_POINTWISE_EXP:
        result = unary(Op::kExp);
        break;
      case CUDNN_POINTWISE_LOG:
        result = unary(Op::kLog);
        break;
      case CUDNN_POINTWISE_SQRT:
        result = unary(Op::kSqrt);
        break;
      case CUDNN_POINTWISE_RSQRT:
        result = unary(Op::kRsqrt);
        break;
      case CUDNN_POINTWISE_TANH_FWD:
        result = unary(Op::kTanh);
        break;
      case CUDNN_POINTWISE_SIGMOID_FWD:
        result = unary(Op::kSigmoid);
        break;
      case CUDNN_POINTWISE_FLOOR:
        result = unary(Op::kFloor);
        break;
      case CUDNN_POINTWISE_BINARY_SELECT:
        // BINARY_SELECT(X, B, T) is T ? X : B.
        need(3);
        result = ir::where(in[2], in[0], in[1]);
        break;
      case CUDNN_POINTWISE_IDENTITY:
        need(1);
        result = in[0].type() == Type::kI32 && *output == Type::kF32 ? ir::make(Op::kToFloat, in)
                                                                     : in[0];
        break;
      case CUDNN_POINTWISE_GEN_INDEX:
        if (!op->axis) unrecognised("GEN_INDEX without an axis");
        result = axis_leaf(*op->axis);
        break;
      default:
        unrecognised(fmt::format("pointwise mode {} has no IR form", static_cast<int>(op->mode)));
    }
    if (result.type() != *output) {
      unrecognised(fmt::format("uid {} holds {} but its operation computes {}", uid,
                               flexattn::to_string(*output), flexattn::to_string(result.type())));
    }
    return result;
  }

  const GraphRecord& record_;
  const BoundValues& bound_;
  std::map<std::int64_t, std::size_t> producers_;
  std::map<std::int64_t, std::vector<std::size_t>> consumers_;
  std::map<std::int64_t, ir::Expr> memo_;
  std::int64_t score_ = -1;
};

// The one operation that `matches`; names `what` when there is none or more than one.
template <class Matches>
const OperationRecord& unique(const GraphRecord& record, Matches matches, std::string_view what) {
  const OperationRecord* found = nullptr;
  for (const OperationRecord& op : record.operations) {
    if (!matches(op)) continue;
    if (found != nullptr) unrecognised(fmt::format("more than one {}", what));
    found = &op;
  }
  if (found == nullptr) unrecognised(fmt::format("no {}", what));
  return *found;
}

bool is_exp_input(const Rebuilder& rebuilder, std::int64_t uid) {
  for (const OperationRecord* consumer : rebuilder.consumers(uid)) {
    if (consumer->kind == Kind::kPointwise && consumer->mode == CUDNN_POINTWISE_EXP) return true;
  }
  return false;
}

// Follows dS (P times the centred dP) to the multiply by the scale: what multiplies it on the way
// is the modifier's derivative, and a select against zero keeps masked elements out.
void rebuild_derivative(Rebuilder& rebuilder, const GraphRecord& record, std::int64_t probability,
                        std::int64_t scale, ReadBackModifiers& result) {
  const OperationRecord& product = unique(
      record,
      [&](const OperationRecord& op) {
        if (op.kind != Kind::kPointwise || op.mode != CUDNN_POINTWISE_MUL) return false;
        if (op.inputs.size() != 2 || op.inputs[1] != probability) return false;
        const OperationRecord* centred = rebuilder.producer(op.inputs[0]);
        return centred != nullptr && centred->kind == Kind::kPointwise &&
               centred->mode == CUDNN_POINTWISE_SUB &&
               rebuilder.is_matmul_output(centred->inputs[0]);
      },
      "dS = P (dP - softmax_sum)");
  Graph derivative(ir::literal_f32(1.0));
  std::int64_t current = product.output;
  for (std::size_t step = 0; step <= record.operations.size(); ++step) {
    const OperationRecord* next = nullptr;
    for (const OperationRecord* consumer : rebuilder.consumers(current)) {
      if (consumer->kind == Kind::kPointwise) next = consumer;
    }
    if (next == nullptr) unrecognised("dS reaches no multiply by the scale");
    const bool binary_multiply = next->mode == CUDNN_POINTWISE_MUL && next->inputs.size() == 2;
    if (binary_multiply && next->inputs[0] == current && next->inputs[1] == scale) {
      result.derivative = derivative;
      return;
    }
    if (binary_multiply && next->inputs[0] == current) {
      derivative = Graph(rebuilder.expression(next->inputs[1]));
    } else if (next->mode == CUDNN_POINTWISE_BINARY_SELECT && next->inputs.size() == 3 &&
               next->inputs[0] == current && rebuilder.is_scalar(next->inputs[1]) &&
               rebuilder.scalar_value(next->inputs[1]) == 0.0) {
      result.derivative_keep = Graph(rebuilder.expression(next->inputs[2]));
    } else {
      unrecognised(
          fmt::format("dS passes through pointwise mode {}", static_cast<int>(next->mode)));
    }
    current = next->output;
  }
  unrecognised("dS passes through a cycle");
}

ir::Expr masked(const Graph& score_mod, const Graph& mask) {
  return ir::where(mask.to_expr(), score_mod.to_expr(),
                   ir::literal_f32(-std::numeric_limits<double>::infinity()));
}

double round_to_float(double value) { return static_cast<double>(static_cast<float>(value)); }

}  // namespace

std::string ReadBackModifiers::to_string() const {
  std::string text = fmt::format("score_mod '{}', mask '{}', scale {}", score_mod.to_string(),
                                 mask.to_string(), scale);
  if (derivative) {
    text += fmt::format(", d score_mod / d score '{}' (kept where '{}')", derivative->to_string(),
                        derivative_keep.to_string());
  }
  return text;
}

ReadBackModifiers rebuild_modifiers(const GraphRecord& record, const BoundValues& bound,
                                    GraphKind kind) {
  Rebuilder rebuilder(record, bound);
  ReadBackModifiers result;
  // The scaled score: the first matmul's output times a by-value scalar.
  const OperationRecord& scaling = unique(
      record,
      [&](const OperationRecord& op) {
        return op.kind == Kind::kPointwise && op.mode == CUDNN_POINTWISE_MUL &&
               op.inputs.size() == 2 && rebuilder.is_matmul_output(op.inputs[0]) &&
               rebuilder.is_scalar(op.inputs[1]) &&
               rebuilder.tensor(op.inputs[1]).type == CUDNN_DATA_FLOAT;
      },
      "scaled score (a matmul's output times a by-value scalar)");
  rebuilder.set_score(scaling.output);
  result.scale = rebuilder.scalar_value(scaling.inputs[1]);
  // What the softmax reads: X of the SUB of a row statistic (the row max, or the stats) that EXP
  // exponentiates.
  const OperationRecord& centring = unique(
      record,
      [&](const OperationRecord& op) {
        if (op.kind != Kind::kPointwise || op.mode != CUDNN_POINTWISE_SUB) return false;
        if (op.inputs.size() != 2 || !is_exp_input(rebuilder, op.output)) return false;
        const std::vector<std::int64_t>& dims = rebuilder.tensor(op.inputs[1]).dims;
        return !dims.empty() && dims.back() == 1;
      },
      "softmax input (a row statistic subtracted before EXP)");
  const std::int64_t softmax_input = centring.inputs[0];
  const OperationRecord* select = rebuilder.producer(softmax_input);
  bool split = false;
  if (select != nullptr && select->kind == Kind::kPointwise &&
      select->mode == CUDNN_POINTWISE_BINARY_SELECT && select->inputs.size() == 3 &&
      rebuilder.is_scalar(select->inputs[1]) &&
      rebuilder.scalar_value(select->inputs[1]) == -std::numeric_limits<double>::infinity()) {
    Graph keep(rebuilder.expression(select->inputs[2]));
    if (!keep.uses_score()) {
      result.mask = std::move(keep);
      result.score_mod = Graph(rebuilder.expression(select->inputs[0]));
      split = true;
    }
  }
  if (!split) result.score_mod = Graph(rebuilder.expression(softmax_input));
  if (kind == GraphKind::kBackward) {
    const OperationRecord& exponent = unique(
        record,
        [&](const OperationRecord& op) {
          return op.kind == Kind::kPointwise && op.mode == CUDNN_POINTWISE_EXP &&
                 op.inputs.size() == 1 && op.inputs[0] == centring.output;
        },
        "P = EXP(score - stats)");
    rebuild_derivative(rebuilder, record, exponent.output, scaling.inputs[1], result);
  }
  return result;
}

Graph cudnn_normal_form(const Graph& graph, const Problem& problem) {
  // Parameters and sequence lengths become the constants they are for this problem, folded.
  std::vector<ir::Expr> substituted;
  for (const GraphNode& node : graph.nodes()) {
    std::vector<ir::Expr> args;
    for (std::int32_t arg : node.args) args.push_back(substituted[static_cast<std::size_t>(arg)]);
    if (node.op == Op::kParam) {
      substituted.push_back(ir::literal_f32(problem.desc().params.at(node.name)));
    } else if (node.op == Op::kQueryLen) {
      substituted.push_back(ir::literal_i32(problem.seq_len_q()));
    } else if (node.op == Op::kKeyLen) {
      substituted.push_back(ir::literal_i32(problem.seq_len_kv()));
    } else {
      substituted.push_back(detail::rebuild_node(node, std::move(args)));
    }
  }
  const Graph folded(substituted[static_cast<std::size_t>(graph.root())]);
  // Then fp32 constants, the recipes of ops cuDNN has no mode for, and broadcast loads.
  const std::int64_t extents[] = {problem.batch(), problem.heads_q(), problem.seq_len_q(),
                                  problem.seq_len_kv()};
  std::vector<ir::Expr> held;
  for (const GraphNode& node : folded.nodes()) {
    std::vector<ir::Expr> args;
    for (std::int32_t arg : node.args) args.push_back(held[static_cast<std::size_t>(arg)]);
    if (node.op == Op::kLiteral && node.type == Type::kF32) {
      held.push_back(ir::literal_f32(round_to_float(node.literal)));
    } else if (node.op == Op::kClamp) {
      held.push_back(ir::make(Op::kMin, {ir::make(Op::kMax, {args[0], args[1]}), args[2]}));
    } else if (node.op == Op::kExp2) {
      held.push_back(ir::make(
          Op::kExp,
          {ir::make(Op::kMul, {args[0], ir::literal_f32(round_to_float(std::numbers::ln2))})}));
    } else if (node.op == Op::kLog2) {
      held.push_back(ir::make(Op::kMul, {ir::make(Op::kLog, {args[0]}),
                                         ir::literal_f32(round_to_float(std::numbers::log2e))}));
    } else if (node.op == Op::kLoad) {
      std::vector<ir::Expr> varying;
      for (std::size_t i = 0; i < node.args.size(); ++i) {
        const Op index = folded.node(node.args[i]).op;
        const int axis = index == Op::kBatch   ? 0
                         : index == Op::kHead  ? 1
                         : index == Op::kQuery ? 2
                         : index == Op::kKey   ? 3
                                               : -1;
        if (axis < 0 || extents[axis] > 1) varying.push_back(args[i]);
      }
      // Every index is an axis of extent 1: the load reads element 0 (as the read-back has it).
      if (varying.empty()) varying.push_back(ir::literal_i32(0));
      held.push_back(ir::load(node.name, node.type, std::move(varying)));
    } else {
      held.push_back(detail::rebuild_node(node, std::move(args)));
    }
  }
  return Graph(held[static_cast<std::size_t>(folded.root())]);
}

Proof prove(const ReadBackModifiers& forward, const std::optional<ReadBackModifiers>& backward,
            const Problem& problem) {
  Proof proof;
  proof.read_back_hash = modifier_hash(forward.score_mod, forward.mask, forward.scale);
  const Graph requested_mask = cudnn_normal_form(problem.mask_mod(), problem);
  const Graph requested_score = cudnn_normal_form(problem.score_mod(), problem);
  const Graph requested(masked(requested_score, requested_mask));
  const float requested_scale = static_cast<float>(problem.scale());
  const auto check = [&](const ReadBackModifiers& read, std::string_view pass) -> bool {
    if (static_cast<float>(read.scale) != requested_scale) {
      proof.mismatch = fmt::format("the {} graph scales the score by {} where {} was requested",
                                   pass, read.scale, requested_scale);
      return false;
    }
    const Graph computed(
        masked(cudnn_normal_form(read.score_mod, problem), cudnn_normal_form(read.mask, problem)));
    if (computed.hash() != requested.hash()) {
      proof.mismatch = fmt::format(
          "the {} graph computes '{}' before the softmax where the request, as cuDNN holds it, "
          "is '{}'",
          pass, computed.to_string(), requested.to_string());
      return false;
    }
    return true;
  };
  if (!check(forward, "forward")) return proof;
  if (problem.wants_backward()) {
    if (!backward || !backward->derivative) {
      proof.mismatch = "the backward graph was not read back";
      return proof;
    }
    if (!check(*backward, "backward")) return proof;
    const Graph requested_derivative =
        cudnn_normal_form(derivative_wrt_score(problem.score_mod()), problem);
    const Graph derivative = cudnn_normal_form(*backward->derivative, problem);
    if (derivative.hash() != requested_derivative.hash()) {
      proof.mismatch = fmt::format(
          "the backward graph multiplies dS by '{}' where d score_mod / d score is '{}'",
          derivative.to_string(), requested_derivative.to_string());
      return proof;
    }
    const bool needs_keep = !requested_mask.is_literal() && !requested_derivative.is_literal();
    const Graph expected_keep = needs_keep ? requested_mask : Graph::always_true();
    if (cudnn_normal_form(backward->derivative_keep, problem).hash() != expected_keep.hash()) {
      proof.mismatch =
          fmt::format("the backward graph keeps the derivative where '{}' where '{}' was expected",
                      backward->derivative_keep.to_string(), expected_keep.to_string());
      return proof;
    }
  }
  proof.holds = true;
  proof.lowered_hash = problem.modifier_hash();
  // The backward reads no float tensor's gradient (guards.cpp refuses those), so what it proves
  // is d score_mod / d score alone.
  if (problem.wants_backward()) proof.lowered_backward_hash = problem.backward_hash();
  return proof;
}

}  // namespace flexattn::cudnn
