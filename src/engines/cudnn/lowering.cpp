#include "engines/cudnn/lowering.hpp"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <numbers>
#include <optional>

#include "core/semantics.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cudnn {
namespace {

// Integers below 2^24 are exact in fp32, so fp32 fmod of such values is the exact integer
// remainder.
constexpr double kExactFloatIntegers = 16777216.0;

enum Axis : std::int64_t { kBatchAxis = 0, kHeadAxis = 1, kQueryAxis = 2, kKeyAxis = 3 };

Operand argument(std::size_t index) { return Operand{Operand::Kind::kArgument, index, 0.0}; }
Operand step_output(std::size_t index) { return Operand{Operand::Kind::kStep, index, 0.0}; }
Operand constant(double value) { return Operand{Operand::Kind::kConstant, 0, value}; }

cudnnDataType_t arithmetic_compute(Type type) {
  return type == Type::kI32 ? CUDNN_DATA_INT32 : CUDNN_DATA_FLOAT;
}

// One step computing the whole node from its arguments in order.
NodePlan single(cudnnPointwiseMode_t mode, cudnnDataType_t compute, const GraphNode& node) {
  NodePlan plan;
  plan.kind = NodePlan::Kind::kSteps;
  plan.type = node.type;
  Step step{mode, compute, {}, node.type};
  for (std::size_t i = 0; i < node.args.size(); ++i) step.operands.push_back(argument(i));
  plan.steps.push_back(std::move(step));
  return plan;
}

NodePlan steps(Type type, std::vector<Step> list) {
  NodePlan plan;
  plan.kind = NodePlan::Kind::kSteps;
  plan.type = type;
  plan.steps = std::move(list);
  return plan;
}

// Comparisons of integers follow the frontend's own masks (BOOLEAN compute); any fp32 operand
// compares in FLOAT.
cudnnDataType_t comparison_compute(const Graph& graph, const GraphNode& node) {
  for (std::int32_t arg : node.args) {
    if (graph.node(arg).type == Type::kF32) return CUDNN_DATA_FLOAT;
  }
  return CUDNN_DATA_BOOLEAN;
}

cudnnDataType_t storage_type(DType dtype, bool& supported) {
  supported = true;
  switch (dtype) {
    case DType::kF32:
      return CUDNN_DATA_FLOAT;
    case DType::kF16:
      return CUDNN_DATA_HALF;
    case DType::kBF16:
      return CUDNN_DATA_BFLOAT16;
    case DType::kI32:
      return CUDNN_DATA_INT32;
    case DType::kF64:
    case DType::kI64:
      break;
  }
  supported = false;
  return CUDNN_DATA_FLOAT;
}

// A load whose indices are distinct leaves b, h, q, kv reads a broadcast 4-D tensor; any other
// index would need a gather, which cuDNN's pointwise graphs do not have.
Support plan_load(const Graph& graph, const GraphNode& node, const Problem& problem,
                  LoadBinding& binding) {
  const auto decl = problem.desc().tensors.find(node.name);
  if (decl == problem.desc().tensors.end()) {
    return Support::no(fmt::format("tensor '{}' is not declared", node.name));
  }
  bool supported = false;
  binding.tensor = node.name;
  binding.type = storage_type(decl->second.dtype, supported);
  if (!supported) {
    return Support::no(
        fmt::format("tensor '{}' is {}; cuDNN pointwise graphs read fp32, fp16, "
                    "bf16 or int32 tensors",
                    node.name, to_string(decl->second.dtype)));
  }
  const std::vector<std::int64_t>& shape = decl->second.shape;
  const std::vector<std::int64_t> tensor_strides = contiguous_strides(shape);
  const std::array<std::int64_t, 4> extents = {problem.batch(), problem.heads_q(),
                                               problem.seq_len_q(), problem.seq_len_kv()};
  binding.dims = {1, 1, 1, 1};
  std::array<bool, 4> used{};
  std::array<std::int64_t, 4> strides{};
  for (std::size_t j = 0; j < node.args.size(); ++j) {
    const Op index_op = graph.node(node.args[j]).op;
    std::int64_t axis = -1;
    if (index_op == Op::kBatch) axis = kBatchAxis;
    if (index_op == Op::kHead) axis = kHeadAxis;
    if (index_op == Op::kQuery) axis = kQueryAxis;
    if (index_op == Op::kKey) axis = kKeyAxis;
    if (axis < 0) {
      return Support::no(fmt::format(
          "tensor load '{}' has an index other than b, h, q or kv ({}): cuDNN pointwise graphs "
          "read tensors by broadcasting, they have no gather",
          node.name, to_string(index_op)));
    }
    const auto a = static_cast<std::size_t>(axis);
    if (used[a]) {
      return Support::no(
          fmt::format("tensor load '{}' uses the index {} twice", node.name, to_string(index_op)));
    }
    used[a] = true;
    binding.dims[a] = extents[a];
    strides[a] = tensor_strides[j];
  }
  binding.strides = packed_strides(binding.dims);
  for (std::size_t a = 0; a < used.size(); ++a) {
    if (used[a]) binding.strides[a] = strides[a];
  }
  return Support::yes();
}

// The value of a node that depends only on literals, params and the sequence lengths.
double fold(const GraphNode& node, const std::vector<NodePlan>& planned, const Problem& problem) {
  if (node.op == Op::kLiteral) return node.literal;
  if (node.op == Op::kParam) return problem.desc().params.at(node.name);
  if (node.op == Op::kQueryLen) return static_cast<double>(problem.seq_len_q());
  if (node.op == Op::kKeyLen) return static_cast<double>(problem.seq_len_kv());
  std::vector<double> values;
  for (std::int32_t arg : node.args) {
    values.push_back(planned[static_cast<std::size_t>(arg)].constant);
  }
  return apply_op(node.op, node.type, values);
}

bool folds(const GraphNode& node, const std::vector<NodePlan>& planned) {
  if (node.op == Op::kScore || node.op == Op::kBatch || node.op == Op::kHead ||
      node.op == Op::kQuery || node.op == Op::kKey || node.op == Op::kLoad) {
    return false;
  }
  for (std::int32_t arg : node.args) {
    if (planned[static_cast<std::size_t>(arg)].kind != NodePlan::Kind::kConstant) return false;
  }
  return true;
}

// The table: every op, its cuDNN recipe or the reason it has none. No default, so a new IR op
// does not compile until it is handled here.
Support plan_node(const Graph& graph, std::int32_t index, const Problem& problem,
                  const std::vector<Interval>& intervals, GraphLowering& lowering, NodePlan& plan) {
  const GraphNode& node = graph.node(index);
  const auto arg_interval = [&](std::size_t i) {
    return intervals[static_cast<std::size_t>(node.args[i])];
  };
  const auto arg_plan = [&](std::size_t i) -> const NodePlan& {
    return lowering.nodes[static_cast<std::size_t>(node.args[i])];
  };
  const auto refuse = [&](std::string_view why) {
    return Support::no(fmt::format("cudnn cannot lower '{}' ({}): {}", to_string(node.op),
                                   to_string(node.type), why));
  };
  switch (node.op) {
    case Op::kScore:
      plan.kind = NodePlan::Kind::kScore;
      plan.type = Type::kF32;
      return Support::yes();
    case Op::kBatch:
    case Op::kHead:
    case Op::kQuery:
    case Op::kKey:
      plan.kind = NodePlan::Kind::kIndex;
      plan.type = Type::kI32;
      plan.axis = node.op == Op::kBatch   ? kBatchAxis
                  : node.op == Op::kHead  ? kHeadAxis
                  : node.op == Op::kQuery ? kQueryAxis
                                          : kKeyAxis;
      return Support::yes();
    case Op::kQueryLen:
    case Op::kKeyLen:
    case Op::kLiteral:
    case Op::kParam:
      plan.kind = NodePlan::Kind::kConstant;
      plan.type = node.type;
      plan.constant = fold(node, lowering.nodes, problem);
      return Support::yes();
    case Op::kLoad: {
      LoadBinding binding;
      if (Support load = plan_load(graph, node, problem, binding); !load) return load;
      plan.kind = NodePlan::Kind::kLoad;
      plan.type = node.type;
      lowering.loads.emplace(index, std::move(binding));
      return Support::yes();
    }
    case Op::kAdd:
      plan = single(CUDNN_POINTWISE_ADD, arithmetic_compute(node.type), node);
      return Support::yes();
    case Op::kSub:
      plan = single(CUDNN_POINTWISE_SUB, arithmetic_compute(node.type), node);
      return Support::yes();
    case Op::kMul:
      plan = single(CUDNN_POINTWISE_MUL, arithmetic_compute(node.type), node);
      return Support::yes();
    case Op::kDiv:
      if (node.type == Type::kI32) {
        return refuse("integer floor division has no cuDNN pointwise mode");
      }
      plan = single(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    case Op::kMod: {
      // cuDNN's MOD is fmod (the dividend's sign); it equals the IR's floor modulo only for a
      // non-negative dividend and a positive constant divisor, which the intervals must prove.
      const Interval dividend = arg_interval(0);
      const bool divisor_constant = arg_plan(1).kind == NodePlan::Kind::kConstant;
      if (!divisor_constant || !(arg_plan(1).constant > 0.0)) {
        return refuse("the divisor must be a positive constant (cuDNN MOD is fmod)");
      }
      if (!(dividend.lo >= 0.0) || !(dividend.hi < kExactFloatIntegers)) {
        return refuse(fmt::format(
            "the dividend ranges over [{}, {}]; fmod equals floor modulo only for [0, 2^24)",
            dividend.lo, dividend.hi));
      }
      plan = single(CUDNN_POINTWISE_MOD, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    }
    case Op::kNeg:
      plan = single(CUDNN_POINTWISE_NEG, arithmetic_compute(node.type), node);
      return Support::yes();
    case Op::kLess:
      plan = single(CUDNN_POINTWISE_CMP_LT, comparison_compute(graph, node), node);
      return Support::yes();
    case Op::kLessEqual:
      plan = single(CUDNN_POINTWISE_CMP_LE, comparison_compute(graph, node), node);
      return Support::yes();
    case Op::kGreater:
      plan = single(CUDNN_POINTWISE_CMP_GT, comparison_compute(graph, node), node);
      return Support::yes();
    case Op::kGreaterEqual:
      plan = single(CUDNN_POINTWISE_CMP_GE, comparison_compute(graph, node), node);
      return Support::yes();
    case Op::kEqual:
      plan = single(CUDNN_POINTWISE_CMP_EQ, comparison_compute(graph, node), node);
      return Support::yes();
    case Op::kNotEqual:
      plan = single(CUDNN_POINTWISE_CMP_NEQ, comparison_compute(graph, node), node);
      return Support::yes();
    case Op::kAnd:
      plan = single(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, node);
      return Support::yes();
    case Op::kOr:
      plan = single(CUDNN_POINTWISE_LOGICAL_OR, CUDNN_DATA_BOOLEAN, node);
      return Support::yes();
    case Op::kNot:
      plan = single(CUDNN_POINTWISE_LOGICAL_NOT, CUDNN_DATA_BOOLEAN, node);
      return Support::yes();
    case Op::kWhere:
      // BINARY_SELECT(X, B, T) is T ? X : B.
      plan = steps(node.type, {Step{CUDNN_POINTWISE_BINARY_SELECT,
                                    arithmetic_compute(node.type),
                                    {argument(1), argument(2), argument(0)},
                                    node.type}});
      return Support::yes();
    case Op::kMin:
      plan = single(CUDNN_POINTWISE_MIN, arithmetic_compute(node.type), node);
      return Support::yes();
    case Op::kMax:
      plan = single(CUDNN_POINTWISE_MAX, arithmetic_compute(node.type), node);
      return Support::yes();
    case Op::kClamp: {
      const cudnnDataType_t compute = arithmetic_compute(node.type);
      plan = steps(node.type,
                   {Step{CUDNN_POINTWISE_MAX, compute, {argument(0), argument(1)}, node.type},
                    Step{CUDNN_POINTWISE_MIN, compute, {step_output(0), argument(2)}, node.type}});
      return Support::yes();
    }
    case Op::kAbs:
      plan = single(CUDNN_POINTWISE_ABS, arithmetic_compute(node.type), node);
      return Support::yes();
    case Op::kExp:
      plan = single(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    case Op::kExp2:
      // exp2(x) = exp(x ln 2): cuDNN has no EXP2 mode.
      plan = steps(Type::kF32,
                   {Step{CUDNN_POINTWISE_MUL,
                         CUDNN_DATA_FLOAT,
                         {argument(0), constant(std::numbers::ln2)},
                         Type::kF32},
                    Step{CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, {step_output(0)}, Type::kF32}});
      return Support::yes();
    case Op::kLog:
      plan = single(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    case Op::kLog2:
      // log2(x) = log(x) log2(e): cuDNN has no LOG2 mode.
      plan =
          steps(Type::kF32, {Step{CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, {argument(0)}, Type::kF32},
                             Step{CUDNN_POINTWISE_MUL,
                                  CUDNN_DATA_FLOAT,
                                  {step_output(0), constant(std::numbers::log2e)},
                                  Type::kF32}});
      return Support::yes();
    case Op::kSqrt:
      plan = single(CUDNN_POINTWISE_SQRT, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    case Op::kRsqrt:
      plan = single(CUDNN_POINTWISE_RSQRT, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    case Op::kTanh:
      // Measured, not assumed: the first device run (2026-12-02, cuDNN 9.19.0, H200) computed
      // softcap with TANH_FWD, and the LSE missed the tolerance of docs/design.md section 5 in 12
      // of the 16 softcap forward cases while O passed (docs/engines.md, section cudnn).
      return refuse(
          "cuDNN's TANH_FWD is not accurate enough: on cuDNN 9.19 / H200 it gave LSE errors up to "
          "1.5e-5 against float64, beyond flexattn's tolerance (about 2e-6 there); the cuda "
          "engine computes tanh within a few ulp (ir_tanh)");
    case Op::kSigmoid:
      plan = single(CUDNN_POINTWISE_SIGMOID_FWD, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    case Op::kFloor:
      plan = single(CUDNN_POINTWISE_FLOOR, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    case Op::kToFloat:
      plan = single(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, node);
      return Support::yes();
    case Op::kToInt:
      return refuse(
          "cuDNN does not document how a float converts to int32 (the IR truncates toward zero, "
          "maps NaN to 0 and saturates)");
  }
  return refuse("unknown op");
}

}  // namespace

cudnnDataType_t cudnn_type(Type type) {
  switch (type) {
    case Type::kF32:
      return CUDNN_DATA_FLOAT;
    case Type::kI32:
      return CUDNN_DATA_INT32;
    case Type::kBool:
      return CUDNN_DATA_BOOLEAN;
  }
  return CUDNN_DATA_FLOAT;
}

Support plan_lowering(const Graph& graph, const Problem& problem, GraphLowering& lowering) {
  lowering.graph = graph;
  lowering.nodes.assign(graph.nodes().size(), NodePlan{});
  lowering.loads.clear();
  lowering.operations = 0;
  const std::vector<Interval> intervals = node_intervals(graph, problem.leaf_ranges());
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    const auto index = static_cast<std::int32_t>(i);
    const GraphNode& node = graph.node(index);
    NodePlan& plan = lowering.nodes[i];
    if (folds(node, lowering.nodes)) {
      plan.kind = NodePlan::Kind::kConstant;
      plan.type = node.type;
      plan.constant = fold(node, lowering.nodes, problem);
      continue;
    }
    NodePlan planned;
    if (Support support = plan_node(graph, index, problem, intervals, lowering, planned);
        !support) {
      return support;
    }
    lowering.operations += planned.steps.size() + (planned.kind == NodePlan::Kind::kIndex ? 1 : 0);
    plan = std::move(planned);
  }
  return Support::yes();
}

namespace {

TensorId constant_tensor(GraphBuilder& builder, Type type, double value, const std::string& name) {
  switch (type) {
    case Type::kF32:
      return builder.scalar_f32(static_cast<float>(value), name);
    case Type::kI32:
      return builder.scalar_i32(static_cast<std::int32_t>(value), name);
    case Type::kBool:
      return builder.scalar_bool(value != 0.0, name);
  }
  return builder.scalar_f32(static_cast<float>(value), name);
}

// The fault hook of the plan proof's tests: the first finite constant moves (a bool flips).
double faulty_constant(EmitContext& context, double value) {
  if (context.fault != CudnnLoweringFault::kChangeConstant || context.fault_applied ||
      !std::isfinite(value)) {
    return value;
  }
  context.fault_applied = true;
  return value == 0.0 || value == 1.0 ? 1.0 - value : value * 2.0 + 1.0;
}

bool is_commutative_mode(cudnnPointwiseMode_t mode) {
  return mode == CUDNN_POINTWISE_ADD || mode == CUDNN_POINTWISE_MUL ||
         mode == CUDNN_POINTWISE_MIN || mode == CUDNN_POINTWISE_MAX ||
         mode == CUDNN_POINTWISE_CMP_EQ || mode == CUDNN_POINTWISE_CMP_NEQ ||
         mode == CUDNN_POINTWISE_LOGICAL_AND || mode == CUDNN_POINTWISE_LOGICAL_OR;
}

std::string binding_key(const LoadBinding& binding) {
  return fmt::format("{}:{}:{}", binding.tensor, fmt::join(binding.dims, ","),
                     fmt::join(binding.strides, ","));
}

}  // namespace

TensorId emit_lowering(const GraphLowering& lowering, EmitContext& context,
                       const std::string& prefix) {
  GraphBuilder& builder = *context.builder;
  const Graph& graph = lowering.graph;
  std::vector<std::optional<TensorId>> values(graph.nodes().size());
  // Constants become by-value scalars only where an operation reads them.
  const auto value_of = [&](std::int32_t index) -> TensorId {
    std::optional<TensorId>& value = values[static_cast<std::size_t>(index)];
    if (!value) {
      const NodePlan& plan = lowering.nodes[static_cast<std::size_t>(index)];
      if (plan.kind != NodePlan::Kind::kConstant) {
        throw_internal("cudnn: a modifier node is used before it is computed");
      }
      value = constant_tensor(builder, plan.type, faulty_constant(context, plan.constant),
                              fmt::format("{}.c{}", prefix, index));
    }
    return *value;
  };
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    const auto index = static_cast<std::int32_t>(i);
    const NodePlan& plan = lowering.nodes[i];
    const GraphNode& node = graph.node(index);
    switch (plan.kind) {
      case NodePlan::Kind::kConstant:
        break;
      case NodePlan::Kind::kScore:
        values[i] = context.score;
        break;
      case NodePlan::Kind::kIndex: {
        auto found = context.indices.find(plan.axis);
        if (found == context.indices.end()) {
          const TensorId generated =
              builder.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, {context.score},
                                CUDNN_DATA_INT32, fmt::format("index{}", plan.axis), plan.axis);
          found = context.indices.emplace(plan.axis, generated).first;
        }
        values[i] = found->second;
        break;
      }
      case NodePlan::Kind::kLoad: {
        const LoadBinding& binding = lowering.loads.at(index);
        const std::string key = binding_key(binding);
        auto found = context.inputs.find(key);
        if (found == context.inputs.end()) {
          TensorSpec spec;
          spec.name = fmt::format("tensor {}", binding.tensor);
          spec.type = binding.type;
          spec.dims = binding.dims;
          spec.strides = binding.strides;
          const TensorId id = builder.tensor(std::move(spec));
          context.bindings.emplace_back(builder.uid(id), binding.tensor);
          found = context.inputs.emplace(key, id).first;
        }
        values[i] = found->second;
        break;
      }
      case NodePlan::Kind::kSteps: {
        std::vector<TensorId> outputs;
        for (std::size_t s = 0; s < plan.steps.size(); ++s) {
          const Step& step = plan.steps[s];
          std::vector<TensorId> inputs;
          for (const Operand& operand : step.operands) {
            switch (operand.kind) {
              case Operand::Kind::kArgument:
                inputs.push_back(value_of(node.args[operand.index]));
                break;
              case Operand::Kind::kStep:
                inputs.push_back(outputs[operand.index]);
                break;
              case Operand::Kind::kConstant:
                inputs.push_back(
                    builder.scalar_f32(static_cast<float>(faulty_constant(context, operand.value)),
                                       fmt::format("{}.n{}k{}", prefix, i, s)));
                break;
            }
          }
          if (context.fault == CudnnLoweringFault::kDropOperation && !context.fault_applied &&
              builder.spec(inputs.front()).type == cudnn_type(step.result)) {
            context.fault_applied = true;
            outputs.push_back(inputs.front());
            continue;
          }
          if (context.fault == CudnnLoweringFault::kSwapOperands && !context.fault_applied &&
              inputs.size() >= 2 && inputs[0] != inputs[1] && !is_commutative_mode(step.mode)) {
            context.fault_applied = true;
            std::swap(inputs[0], inputs[1]);
          }
          outputs.push_back(builder.pointwise(step.mode, step.compute, inputs,
                                              cudnn_type(step.result),
                                              fmt::format("{}.n{}s{}", prefix, i, s)));
        }
        values[i] = outputs.back();
        break;
      }
    }
  }
  return value_of(graph.root());
}

}  // namespace flexattn::cudnn
