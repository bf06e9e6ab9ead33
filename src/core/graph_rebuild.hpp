// Internal: turning canonical Graph nodes back into builder expressions, one node at a time, so
// analyses (differentiation, load clamping) can rebuild a graph with some nodes replaced.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "flexattn/error.hpp"
#include "flexattn/graph.hpp"

namespace flexattn::detail {

// The builder expression of `node` whose operands (indices for a load) are `args`.
inline ir::Expr rebuild_node(const GraphNode& node, std::vector<ir::Expr> args) {
  switch (node.op) {
    case Op::kScore:
      return ir::score();
    case Op::kBatch:
      return ir::batch();
    case Op::kHead:
      return ir::head();
    case Op::kQuery:
      return ir::query();
    case Op::kKey:
      return ir::key();
    case Op::kQueryLen:
      return ir::query_length();
    case Op::kKeyLen:
      return ir::key_length();
    case Op::kLiteral:
      switch (node.type) {
        case Type::kF32:
          return ir::literal_f32(node.literal);
        case Type::kI32:
          return ir::literal_i32(static_cast<std::int64_t>(node.literal));
        case Type::kBool:
          return ir::literal_bool(node.literal != 0.0);
      }
      throw_internal("literal node of an unknown type");
    case Op::kParam:
      return ir::param(node.name);
    case Op::kLoad:
      return ir::load(node.name, node.type, std::move(args));
    default:
      if (is_elementwise(node.op)) return ir::make(node.op, std::move(args));
      break;
  }
  throw_internal("graph node with an unknown op");
}

// The builder expression of every node of `graph`, sharing sub-expressions (index by node).
inline std::vector<ir::Expr> node_expressions(const Graph& graph) {
  std::vector<ir::Expr> expressions;
  expressions.reserve(graph.nodes().size());
  for (const GraphNode& node : graph.nodes()) {
    std::vector<ir::Expr> args;
    args.reserve(node.args.size());
    for (std::int32_t arg : node.args) args.push_back(expressions[static_cast<std::size_t>(arg)]);
    expressions.push_back(rebuild_node(node, std::move(args)));
  }
  return expressions;
}

}  // namespace flexattn::detail
