// The cpu engine's plan proof: tapes lifted back into the IR (see tape_proof.hpp).
#include "engines/cpu/tape_proof.hpp"

#include <fmt/format.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "flexattn/error.hpp"

namespace flexattn::cpu {

namespace {

constexpr Op kLeaves[] = {Op::kScore, Op::kBatch,    Op::kHead,  Op::kQuery,
                          Op::kKey,   Op::kQueryLen, Op::kKeyLen};

std::int64_t encode(Slot slot) { return slot.is_float ? slot.index : -1 - slot.index; }

ir::Expr leaf_expression(Op op) {
  switch (op) {
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
    case Op::kParam:
    case Op::kLoad:
    case Op::kAdd:
    case Op::kSub:
    case Op::kMul:
    case Op::kDiv:
    case Op::kMod:
    case Op::kNeg:
    case Op::kLess:
    case Op::kLessEqual:
    case Op::kGreater:
    case Op::kGreaterEqual:
    case Op::kEqual:
    case Op::kNotEqual:
    case Op::kAnd:
    case Op::kOr:
    case Op::kNot:
    case Op::kWhere:
    case Op::kMin:
    case Op::kMax:
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
    case Op::kToFloat:
    case Op::kToInt:
      break;
  }
  throw_internal(fmt::format("cpu proof: {} is not a leaf", to_string(op)));
}

// Int-array slots read as bool: operands of && || !, conditions of where, and a tape output the
// caller reads as a mask. Everything else in the int array is i32.
std::map<std::int64_t, bool> bool_slots(const Tape& tape, bool output_is_bool, std::size_t output) {
  std::map<std::int64_t, bool> reads_bool;
  for (const Instruction& instruction : tape.instructions()) {
    const Op op = instruction.op;
    if (op == Op::kAnd || op == Op::kOr) {
      reads_bool[encode(instruction.args[0])] = true;
      reads_bool[encode(instruction.args[1])] = true;
    } else if (op == Op::kNot || op == Op::kWhere) {
      reads_bool[encode(instruction.args[0])] = true;
    }
  }
  if (output_is_bool) reads_bool[encode(tape.output(output))] = true;
  return reads_bool;
}

// The type operand `a` of `instruction` has in the canonical form.
Type operand_type(const Instruction& instruction, std::size_t a) {
  switch (instruction.op) {
    case Op::kLoad:
      return Type::kI32;
    case Op::kWhere:
      return a == 0 ? Type::kBool : instruction.type;
    case Op::kAnd:
    case Op::kOr:
    case Op::kNot:
      return Type::kBool;
    case Op::kScore:
    case Op::kBatch:
    case Op::kHead:
    case Op::kQuery:
    case Op::kKey:
    case Op::kQueryLen:
    case Op::kKeyLen:
    case Op::kLiteral:
    case Op::kParam:
    case Op::kAdd:
    case Op::kSub:
    case Op::kMul:
    case Op::kDiv:
    case Op::kMod:
    case Op::kNeg:
    case Op::kLess:
    case Op::kLessEqual:
    case Op::kGreater:
    case Op::kGreaterEqual:
    case Op::kEqual:
    case Op::kNotEqual:
    case Op::kMin:
    case Op::kMax:
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
    case Op::kToFloat:
    case Op::kToInt:
      break;
  }
  return instruction.operand_type;  // every operand alike: the first operand's type
}

Graph lift(const Tape& tape, std::size_t output, bool output_is_bool) {
  const std::map<std::int64_t, bool> reads_bool = bool_slots(tape, output_is_bool, output);
  std::map<std::int64_t, ir::Expr> values;
  for (Op op : kLeaves) {
    const Slot slot = tape.leaf(op);
    if (slot.index >= 0) values.insert_or_assign(encode(slot), leaf_expression(op));
  }
  for (const Tape::Constant& constant : tape.constants()) {
    const std::int64_t at = encode(constant.slot);
    if (constant.slot.is_float) {
      values.insert_or_assign(at, ir::literal_f32(constant.value));
    } else if (reads_bool.count(at) != 0) {
      values.insert_or_assign(at, ir::literal_bool(constant.value != 0.0));
    } else {
      values.insert_or_assign(at, ir::literal_i32(static_cast<std::int64_t>(constant.value)));
    }
  }
  for (const Tape::Parameter& parameter : tape.parameters()) {
    values.insert_or_assign(encode(parameter.slot), ir::param(parameter.name));
  }
  const auto value_of = [&](Slot slot) -> const ir::Expr& {
    const auto found = values.find(encode(slot));
    if (found == values.end()) {
      throw_internal(fmt::format("cpu proof: slot {} is read before it is written", encode(slot)));
    }
    return found->second;
  };
  for (const Instruction& instruction : tape.instructions()) {
    std::vector<ir::Expr> args;
    std::string name;
    if (instruction.op == Op::kLoad) {
      const TapeLoad& load = tape.loads().at(static_cast<std::size_t>(instruction.load));
      name = load.tensor;
      for (Slot index : load.indices) args.push_back(value_of(index));
    } else if (is_elementwise(instruction.op)) {
      for (int a = 0; a < arity(instruction.op); ++a) {
        args.push_back(value_of(instruction.args[static_cast<std::size_t>(a)]));
      }
    } else {
      throw_internal(fmt::format("cpu proof: instruction {}", to_string(instruction.op)));
    }
    const ir::Expr result = instruction.op == Op::kLoad ? ir::load(name, instruction.type, args)
                                                        : ir::make(instruction.op, args);
    // The tape converts nothing implicitly (the canonical form spells every promotion as float()):
    // an operand of another type than the instruction reads, or a result of another type than its
    // slot holds, is not the IR the runner executes.
    bool converted = result.type() != instruction.type ||
                     instruction.result.is_float != (instruction.type == Type::kF32);
    for (std::size_t a = 0; !converted && a < args.size(); ++a) {
      converted = args[a].type() != operand_type(instruction, a);
    }
    if (converted) {
      throw_internal(fmt::format("cpu proof: instruction {} does not type as the IR",
                                 to_string(instruction.op)));
    }
    values.insert_or_assign(encode(instruction.result), result);
  }
  return Graph(value_of(tape.output(output)));
}

Graph literal_one() { return Graph(ir::literal_f32(1.0)); }

}  // namespace

Graph lift_output(const Tape& tape, std::size_t output) { return lift(tape, output, false); }

LoweringProof prove_lowering(const Lowering& lowering, const Problem& problem) {
  LoweringProof proof;
  try {
    const Graph score =
        lowering.identity_score ? Graph::identity_score() : lift(lowering.score_tape, 0, false);
    const Graph mask = lowering.keep_all ? Graph::always_true() : lift(lowering.mask_tape, 0, true);
    proof.forward = modifier_hash(score, mask, problem.scale());
    if (lowering.backward_tape.output_count() == 0) return proof;
    // The backward recomputes the modified score from its own tape: it must be the forward's.
    const Graph recomputed =
        lowering.identity_score ? Graph::identity_score() : lift(lowering.backward_tape, 0, false);
    if (recomputed.hash() != score.hash()) {
      proof.forward = hash_combine(proof.forward, recomputed.hash());
    }
    const Graph derivative =
        lowering.identity_score ? literal_one() : lift(lowering.backward_tape, 1, false);
    // gradient_tape's outputs: every load's indices, then every load's derivative (engine.cpp).
    std::vector<LoadDerivative> loads;
    std::size_t next = 0;
    for (const LoadDerivative& load : lowering.load_derivatives) {
      LoadDerivative lifted;
      lifted.tensor = load.tensor;
      for (std::size_t k = 0; k < load.indices.size(); ++k) {
        lifted.indices.push_back(lift(lowering.gradient_tape, next++, false));
      }
      loads.push_back(std::move(lifted));
    }
    for (LoadDerivative& load : loads) {
      load.derivative = lift(lowering.gradient_tape, next++, false);
    }
    proof.backward = backward_hash(derivative, loads);
  } catch (const Error&) {
    return LoweringProof{};
  }
  return proof;
}

}  // namespace flexattn::cpu
