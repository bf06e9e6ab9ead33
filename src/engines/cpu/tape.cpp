// Lowering of canonical graphs to a vector tape, and its evaluation (see tape.hpp).
#include "engines/cpu/tape.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <tuple>

#include "engines/cpu/kernels.hpp"
#include "flexattn/dtype.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cpu {

namespace {

// How often a node's value changes (see Tape::head_end): the groups of the instruction order.
enum class Variation : std::uint8_t { kPerHead, kPerQuery, kPerRow };

Variation leaf_variation(Op op) {
  if (op == Op::kQuery) return Variation::kPerQuery;
  if (op == Op::kKey || op == Op::kScore) return Variation::kPerRow;
  return Variation::kPerHead;
}

std::int64_t encode(Slot slot) { return slot.is_float ? slot.index : -1 - slot.index; }

}  // namespace

// Adds graphs to a tape, sharing nodes that are structurally equal across graphs.
class TapeBuilder {
 public:
  explicit TapeBuilder(Tape& tape) : tape_(tape) {}

  Slot add(const Graph& graph) {
    std::vector<Slot> slots(graph.nodes().size());
    for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
      const GraphNode& node = graph.nodes()[i];
      std::vector<Slot> args;
      std::vector<std::int64_t> encoded;
      for (std::int32_t arg : node.args) {
        args.push_back(slots[static_cast<std::size_t>(arg)]);
        encoded.push_back(encode(args.back()));
      }
      const Key key{node.op, node.type, std::bit_cast<std::uint64_t>(node.literal), node.name,
                    encoded};
      if (const auto found = known_.find(key); found != known_.end()) {
        slots[i] = found->second;
        continue;
      }
      const Type operand_type = node.args.empty() ? node.type : graph.node(node.args.front()).type;
      slots[i] = lower(node, operand_type, args);
      known_.emplace(key, slots[i]);
    }
    return slots[static_cast<std::size_t>(graph.root())];
  }

  // Orders the instructions by Variation (stable, so operands still come first).
  void finish() {
    std::vector<Instruction> ordered;
    for (Variation group : {Variation::kPerHead, Variation::kPerQuery, Variation::kPerRow}) {
      for (std::size_t i = 0; i < tape_.instructions_.size(); ++i) {
        if (variations_[i] == group) ordered.push_back(tape_.instructions_[i]);
      }
      if (group == Variation::kPerHead) tape_.head_end_ = ordered.size();
      if (group == Variation::kPerQuery) tape_.query_end_ = ordered.size();
    }
    tape_.instructions_ = std::move(ordered);
  }

 private:
  using Key = std::tuple<Op, Type, std::uint64_t, std::string, std::vector<std::int64_t>>;

  Slot new_slot(Type type) {
    Slot slot;
    slot.is_float = type == Type::kF32;
    slot.index = slot.is_float ? tape_.float_slots_++ : tape_.int_slots_++;
    return slot;
  }

  Variation variation_of(Slot slot) const {
    const auto found = slot_variation_.find(encode(slot));
    return found == slot_variation_.end() ? Variation::kPerHead : found->second;
  }

  Slot lower(const GraphNode& node, Type operand_type, const std::vector<Slot>& args) {
    const Slot result = new_slot(node.type);
    Variation variation = Variation::kPerHead;
    for (Slot arg : args) variation = std::max(variation, variation_of(arg));
    Instruction instruction;
    instruction.op = node.op;
    instruction.type = node.type;
    instruction.operand_type = operand_type;
    instruction.result = result;
    for (std::size_t a = 0; a < args.size() && a < instruction.args.size(); ++a) {
      instruction.args[a] = args[a];
    }
    switch (node.op) {
      case Op::kScore:
      case Op::kBatch:
      case Op::kHead:
      case Op::kQuery:
      case Op::kKey:
      case Op::kQueryLen:
      case Op::kKeyLen:
        tape_.leaves_[node.op] = result;
        slot_variation_[encode(result)] = leaf_variation(node.op);
        return result;
      case Op::kLiteral:
        tape_.constants_.push_back({result, node.literal});
        return result;
      case Op::kParam:
        tape_.parameters_.push_back({result, node.name});
        return result;
      case Op::kLoad:
        instruction.load = static_cast<std::int32_t>(tape_.loads_.size());
        tape_.loads_.push_back({node.name, args});
        break;
      default:
        if (!is_elementwise(node.op)) throw_internal("cpu tape: unknown op");
        break;
    }
    tape_.instructions_.push_back(instruction);
    variations_.push_back(variation);
    slot_variation_[encode(result)] = variation;
    return result;
  }

  Tape& tape_;
  std::map<Key, Slot> known_;
  std::map<std::int64_t, Variation> slot_variation_;
  std::vector<Variation> variations_;  // per instruction, before finish()
};

Tape::Tape(const std::vector<const Graph*>& graphs) {
  TapeBuilder builder(*this);
  for (const Graph* graph : graphs) outputs_.push_back(builder.add(*graph));
  builder.finish();
}

Slot Tape::leaf(Op op) const {
  const auto found = leaves_.find(op);
  return found == leaves_.end() ? Slot{} : found->second;
}

}  // namespace flexattn::cpu
