// Canonicalisation of the modifier IR: hash-consing, explicit promotions, constant folding, exact
// algebraic identities and ordered commutative operands.
#include "flexattn/graph.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <set>
#include <unordered_map>
#include <utility>

#include "core/printer.hpp"
#include "core/semantics.hpp"
#include "flexattn/error.hpp"

namespace flexattn {

namespace {

// splitmix64's finaliser (Steele, Lea, Flood): a fixed bijective 64-bit mix.
std::uint64_t mix64(std::uint64_t value) {
  value ^= value >> 30;
  value *= 0xbf58476d1ce4e5b9ULL;
  value ^= value >> 27;
  value *= 0x94d049bb133111ebULL;
  value ^= value >> 31;
  return value;
}

// The golden-ratio increment of splitmix64; separates successive combine steps.
constexpr std::uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ULL;
// Starting value of every node hash (the ASCII bytes of "flexattn").
constexpr std::uint64_t kHashSeed = 0x666c65786174746eULL;
// Bytes of a name folded into the hash per combine step.
constexpr std::size_t kNameChunk = 8;

std::uint64_t node_hash(const GraphNode& node, const std::vector<GraphNode>& nodes) {
  std::uint64_t hash = kHashSeed;
  hash = hash_combine(hash, static_cast<std::uint64_t>(node.op));
  hash = hash_combine(hash, static_cast<std::uint64_t>(node.type));
  if (node.op == Op::kLiteral)
    hash = hash_combine(hash, std::bit_cast<std::uint64_t>(node.literal));
  if (node.op == Op::kParam || node.op == Op::kLoad) {
    hash = hash_combine(hash, node.name.size());
    for (std::size_t begin = 0; begin < node.name.size(); begin += kNameChunk) {
      std::uint64_t chunk = 0;
      for (std::size_t i = begin; i < std::min(begin + kNameChunk, node.name.size()); ++i) {
        chunk |= static_cast<std::uint64_t>(static_cast<unsigned char>(node.name[i]))
                 << (8 * (i - begin));
      }
      hash = hash_combine(hash, chunk);
    }
  }
  hash = hash_combine(hash, node.args.size());
  for (std::int32_t arg : node.args) {
    hash = hash_combine(hash, nodes[static_cast<std::size_t>(arg)].hash);
  }
  return hash;
}

bool same_node(const GraphNode& a, const GraphNode& b) {
  return a.op == b.op && a.type == b.type &&
         std::bit_cast<std::uint64_t>(a.literal) == std::bit_cast<std::uint64_t>(b.literal) &&
         a.name == b.name && a.args == b.args;
}

// Builds the canonical node list (possibly with unreachable nodes; see compact()).
class Canonicaliser {
 public:
  std::vector<GraphNode> nodes;

  std::int32_t visit(const ir::Expr& expr) {
    const ir::ExprNode* key = &expr.node();
    if (auto found = memo_.find(key); found != memo_.end()) return found->second;
    const ir::ExprNode& node = expr.node();
    std::vector<std::int32_t> args;
    args.reserve(node.args.size());
    for (const ir::Expr& arg : node.args) args.push_back(visit(arg));
    std::int32_t result = 0;
    if (node.op == Op::kLiteral || node.op == Op::kParam || arity(node.op) == 0) {
      result = add(node.op, node.type, node.literal, node.name, {});
    } else if (node.op == Op::kLoad) {
      result = add(node.op, node.type, 0.0, node.name, std::move(args));
    } else {
      promote_operands(node.op, node.type, args);
      result = add(node.op, node.type, 0.0, {}, std::move(args));
    }
    memo_.emplace(key, result);
    return result;
  }

 private:
  const GraphNode& at(std::int32_t index) const { return nodes[static_cast<std::size_t>(index)]; }

  bool is_literal(std::int32_t index, double value) const {
    const GraphNode& node = at(index);
    return node.op == Op::kLiteral && node.literal == value;
  }

  // Order of commutative operands: constants last (`score + 6`, as people write it), otherwise
  // by structural hash.
  bool comes_before(std::int32_t a, std::int32_t b) const {
    const bool a_literal = at(a).op == Op::kLiteral;
    const bool b_literal = at(b).op == Op::kLiteral;
    if (a_literal != b_literal) return b_literal;
    return at(a).hash < at(b).hash;
  }

  std::int32_t literal(Type type, double value) { return add(Op::kLiteral, type, value, {}, {}); }

  std::int32_t promote(std::int32_t index) {
    if (at(index).type != Type::kI32) return index;
    return add(Op::kToFloat, Type::kF32, 0.0, {}, {index});
  }

  // Makes the implicit i32 -> f32 promotions of a (type-checked) op explicit.
  void promote_operands(Op op, Type result_type, std::vector<std::int32_t>& args) {
    bool any_f32 = false;
    for (std::int32_t arg : args) any_f32 = any_f32 || at(arg).type == Type::kF32;
    switch (op) {
      case Op::kAdd:
      case Op::kSub:
      case Op::kMul:
      case Op::kDiv:
      case Op::kMod:
      case Op::kMin:
      case Op::kMax:
      case Op::kClamp:
        if (result_type == Type::kF32) {
          for (std::int32_t& arg : args) arg = promote(arg);
        }
        return;
      case Op::kLess:
      case Op::kLessEqual:
      case Op::kGreater:
      case Op::kGreaterEqual:
      case Op::kEqual:
      case Op::kNotEqual:
        if (any_f32) {
          for (std::int32_t& arg : args) arg = promote(arg);
        }
        return;
      case Op::kWhere:
        if (result_type == Type::kF32) {
          args[1] = promote(args[1]);
          args[2] = promote(args[2]);
        }
        return;
      case Op::kExp:
      case Op::kExp2:
      case Op::kLog:
      case Op::kLog2:
      case Op::kSqrt:
      case Op::kRsqrt:
      case Op::kTanh:
      case Op::kSigmoid:
      case Op::kFloor:
        args[0] = promote(args[0]);
        return;
      case Op::kScore:
      case Op::kBatch:
      case Op::kHead:
      case Op::kQuery:
      case Op::kKey:
      case Op::kQueryLen:
      case Op::kKeyLen:
      case Op::kLiteral:
      case Op::kParam:
      case Op::kLoad:
      case Op::kNeg:
      case Op::kAnd:
      case Op::kOr:
      case Op::kNot:
      case Op::kAbs:
      case Op::kToFloat:
      case Op::kToInt:
        return;
    }
  }

  // Exact rewrites; returns the replacement node or -1.
  std::int32_t simplify(Op op, Type type, const std::vector<std::int32_t>& args) {
    const auto literal_value = [&](std::size_t i, double* value) {
      const GraphNode& node = at(args[i]);
      if (node.op != Op::kLiteral) return false;
      *value = node.literal;
      return true;
    };
    double value = 0.0;
    switch (op) {
      case Op::kAdd:
        if (is_literal(args[1], 0.0)) return args[0];
        if (is_literal(args[0], 0.0)) return args[1];
        return -1;
      case Op::kSub:
        return is_literal(args[1], 0.0) ? args[0] : -1;
      case Op::kMul:
        if (is_literal(args[1], 1.0)) return args[0];
        if (is_literal(args[0], 1.0)) return args[1];
        if (type == Type::kI32 && (is_literal(args[0], 0.0) || is_literal(args[1], 0.0))) {
          return literal(Type::kI32, 0.0);
        }
        return -1;
      case Op::kDiv:
        return is_literal(args[1], 1.0) ? args[0] : -1;
      case Op::kNeg:
      case Op::kNot:
        return at(args[0]).op == op ? at(args[0]).args[0] : -1;
      case Op::kAnd:
        for (std::size_t i = 0; i < 2; ++i) {
          if (literal_value(i, &value)) return value != 0.0 ? args[1 - i] : args[i];
        }
        return args[0] == args[1] ? args[0] : -1;
      case Op::kOr:
        for (std::size_t i = 0; i < 2; ++i) {
          if (literal_value(i, &value)) return value != 0.0 ? args[i] : args[1 - i];
        }
        return args[0] == args[1] ? args[0] : -1;
      case Op::kWhere:
        if (literal_value(0, &value)) return value != 0.0 ? args[1] : args[2];
        if (args[1] == args[2]) return args[1];
        if (at(args[0]).op == Op::kNot) {
          return add(Op::kWhere, type, 0.0, {}, {at(args[0]).args[0], args[2], args[1]});
        }
        return -1;
      case Op::kMin:
      case Op::kMax:
        return args[0] == args[1] ? args[0] : -1;
      case Op::kToFloat:
        return at(args[0]).type == Type::kF32 ? args[0] : -1;
      case Op::kToInt:
        return at(args[0]).type == Type::kI32 ? args[0] : -1;
      case Op::kScore:
      case Op::kBatch:
      case Op::kHead:
      case Op::kQuery:
      case Op::kKey:
      case Op::kQueryLen:
      case Op::kKeyLen:
      case Op::kLiteral:
      case Op::kParam:
      case Op::kLoad:
      case Op::kMod:
      case Op::kLess:
      case Op::kLessEqual:
      case Op::kGreater:
      case Op::kGreaterEqual:
      case Op::kEqual:
      case Op::kNotEqual:
      case Op::kClamp:
      case Op::kAbs:
      case Op::kExp:
      case Op::kExp2:
      case Op::kLog:
      case Op::kLog2:
      case Op::kSqrt:
      case Op::kRsqrt:
      case Op::kTanh:
      case Op::kSigmoid:
      case Op::kFloor:
        return -1;
    }
    return -1;
  }

  // The comparison that holds for swapped operands; other ops are their own mirror.
  static Op mirror(Op op) {
    if (op == Op::kLess) return Op::kGreater;
    if (op == Op::kLessEqual) return Op::kGreaterEqual;
    if (op == Op::kGreater) return Op::kLess;
    if (op == Op::kGreaterEqual) return Op::kLessEqual;
    return op;
  }

  std::int32_t add(Op op, Type type, double literal_value, std::string name,
                   std::vector<std::int32_t> args) {
    const bool foldable = op != Op::kLoad && !args.empty() &&
                          std::all_of(args.begin(), args.end(),
                                      [&](std::int32_t arg) { return at(arg).op == Op::kLiteral; });
    if (foldable) {
      std::vector<double> values;
      for (std::int32_t arg : args) values.push_back(at(arg).literal);
      const double folded = apply_op(op, type, values);
      // NaN has no literal syntax; such an expression stays as written.
      if (!std::isnan(folded)) return add(Op::kLiteral, type, folded, {}, {});
    }
    if (op != Op::kLiteral && op != Op::kLoad) {
      if (std::int32_t simpler = simplify(op, type, args); simpler >= 0) return simpler;
    }
    if (is_commutative(op) && comes_before(args[1], args[0])) std::swap(args[0], args[1]);
    // Mirrored comparisons are one comparison: `a >= b` and `b <= a` get the same operand order.
    if (const Op mirrored = mirror(op); mirrored != op && comes_before(args[1], args[0])) {
      std::swap(args[0], args[1]);
      op = mirrored;
    }
    GraphNode node;
    node.op = op;
    node.type = type;
    node.literal = op == Op::kLiteral ? literal_value : 0.0;
    node.name = std::move(name);
    node.args = std::move(args);
    node.hash = node_hash(node, nodes);
    std::vector<std::int32_t>& bucket = by_hash_[node.hash];
    for (std::int32_t candidate : bucket) {
      if (same_node(at(candidate), node)) return candidate;
    }
    const auto index = static_cast<std::int32_t>(nodes.size());
    nodes.push_back(std::move(node));
    bucket.push_back(index);
    return index;
  }

  std::unordered_map<const ir::ExprNode*, std::int32_t> memo_;
  std::unordered_map<std::uint64_t, std::vector<std::int32_t>> by_hash_;
};

// Keeps the nodes reachable from `root`, in the post-order of a depth-first walk that visits
// operands in their (canonical) order, so equal graphs have identical node lists.
std::vector<GraphNode> compact(const std::vector<GraphNode>& nodes, std::int32_t root,
                               std::int32_t* new_root) {
  std::vector<std::int32_t> renumbered(nodes.size(), -1);
  std::vector<GraphNode> kept;
  // Explicit stack of (node, next operand to visit) so deep expressions cannot overflow.
  std::vector<std::pair<std::int32_t, std::size_t>> stack{{root, 0}};
  while (!stack.empty()) {
    auto& [index, next] = stack.back();
    const GraphNode& node = nodes[static_cast<std::size_t>(index)];
    if (next < node.args.size()) {
      const std::int32_t arg = node.args[next++];
      if (renumbered[static_cast<std::size_t>(arg)] < 0) stack.emplace_back(arg, 0);
      continue;
    }
    if (renumbered[static_cast<std::size_t>(index)] < 0) {
      GraphNode copy = node;
      for (std::int32_t& arg : copy.args) arg = renumbered[static_cast<std::size_t>(arg)];
      renumbered[static_cast<std::size_t>(index)] = static_cast<std::int32_t>(kept.size());
      kept.push_back(std::move(copy));
    }
    stack.pop_back();
  }
  *new_root = renumbered[static_cast<std::size_t>(root)];
  return kept;
}

ir::Expr literal_expr(const GraphNode& node) {
  switch (node.type) {
    case Type::kF32:
      return ir::literal_f32(node.literal);
    case Type::kI32:
      return ir::literal_i32(static_cast<std::int64_t>(node.literal));
    case Type::kBool:
      return ir::literal_bool(node.literal != 0.0);
  }
  throw_internal("literal of unknown type");
}

}  // namespace

std::uint64_t hash_combine(std::uint64_t seed, std::uint64_t value) {
  return mix64(seed + kGoldenGamma + mix64(value) + (seed << 6) + (seed >> 2));
}

std::string hash_to_hex(std::uint64_t hash) { return fmt::format("{:016x}", hash); }

Graph::Graph() : Graph(ir::score()) {}

Graph::Graph(const ir::Expr& expr) {
  Canonicaliser canonicaliser;
  const std::int32_t root = canonicaliser.visit(expr);
  nodes_ = compact(canonicaliser.nodes, root, &root_);
}

bool Graph::is_identity_score() const {
  return nodes_[static_cast<std::size_t>(root_)].op == Op::kScore;
}

bool Graph::is_literal() const {
  return nodes_[static_cast<std::size_t>(root_)].op == Op::kLiteral;
}

bool Graph::uses_score() const {
  return std::any_of(nodes_.begin(), nodes_.end(),
                     [](const GraphNode& node) { return node.op == Op::kScore; });
}

std::vector<std::string> Graph::tensors() const {
  std::set<std::string> names;
  for (const GraphNode& node : nodes_) {
    if (node.op == Op::kLoad) names.insert(node.name);
  }
  return {names.begin(), names.end()};
}

std::vector<std::string> Graph::params() const {
  std::set<std::string> names;
  for (const GraphNode& node : nodes_) {
    if (node.op == Op::kParam) names.insert(node.name);
  }
  return {names.begin(), names.end()};
}

ir::Expr Graph::to_expr() const {
  std::vector<ir::Expr> exprs;
  exprs.reserve(nodes_.size());
  for (const GraphNode& node : nodes_) {
    std::vector<ir::Expr> args;
    for (std::int32_t arg : node.args) args.push_back(exprs[static_cast<std::size_t>(arg)]);
    if (node.op == Op::kLiteral) {
      exprs.push_back(literal_expr(node));
    } else if (node.op == Op::kParam) {
      exprs.push_back(ir::param(node.name));
    } else if (node.op == Op::kLoad) {
      exprs.push_back(ir::load(node.name, node.type, std::move(args)));
    } else {
      exprs.push_back(ir::make(node.op, std::move(args)));
    }
  }
  return exprs[static_cast<std::size_t>(root_)];
}

std::string Graph::to_string() const { return ir::print(to_expr().node()); }

}  // namespace flexattn
