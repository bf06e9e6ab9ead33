// The canonical form of a modifier: a hash-consed DAG in topological order. Constants are folded,
// implicit i32 -> f32 promotions are explicit `float(...)` nodes, and operands of commutative ops
// are ordered, so structurally equal modifiers have equal nodes and an equal hash. Engines lower
// this, never the builder tree.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexattn/export.hpp"
#include "flexattn/expr.hpp"

namespace flexattn {

struct GraphNode {
  Op op;
  Type type;
  double literal = 0.0;               // kLiteral
  std::string name;                   // kParam, kLoad
  std::vector<std::int32_t> args;     // indices of earlier nodes
  std::uint64_t hash = 0;             // structural hash of the sub-expression rooted here
};

class FLEXATTN_API Graph {
 public:
  // The identity score modifier (`score`).
  Graph();
  // Canonicalises `expr`. Throws Error(kInvalidArgument) on a type error.
  explicit Graph(const ir::Expr& expr);

  static Graph identity_score() { return Graph(ir::score()); }
  static Graph always_true() { return Graph(ir::literal_bool(true)); }

  const std::vector<GraphNode>& nodes() const { return nodes_; }
  const GraphNode& node(std::int32_t index) const { return nodes_[static_cast<std::size_t>(index)]; }
  std::int32_t root() const { return root_; }
  Type type() const { return nodes_[static_cast<std::size_t>(root_)].type; }
  // Stable across runs and machines (part of disk-cache keys and plan proofs).
  std::uint64_t hash() const { return nodes_[static_cast<std::size_t>(root_)].hash; }

  bool is_identity_score() const;  // the whole graph is `score`
  bool is_literal() const;         // the root is a constant
  bool uses_score() const;
  // Names of tensors/params read, sorted, without duplicates.
  std::vector<std::string> tensors() const;
  std::vector<std::string> params() const;

  std::string to_string() const;  // text syntax; parse(to_string()) gives an equal graph
  ir::Expr to_expr() const;       // back to a builder tree (for differentiation, rewriting)

  friend bool operator==(const Graph& a, const Graph& b) { return a.hash() == b.hash(); }

 private:
  std::vector<GraphNode> nodes_;
  std::int32_t root_ = 0;
};

// Combines hashes in a fixed, platform-independent way.
FLEXATTN_API std::uint64_t hash_combine(std::uint64_t seed, std::uint64_t value);
FLEXATTN_API std::string hash_to_hex(std::uint64_t hash);  // 16 lower-case hex digits

}  // namespace flexattn
