#include "support/cpu_tape_faults.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "engines/cpu/tape.hpp"

namespace flexattn::cpu {
namespace {

// A slot as one number: float slots non-negative, bool slots negative.
std::int64_t encode(Slot slot) { return slot.is_float ? slot.index : -1 - slot.index; }

}  // namespace

class TapeMutator {
 public:
  // The tapes a plan of `lowering` executes, in site order.
  static std::vector<Tape*> executed(Lowering& lowering) {
    std::vector<Tape*> tapes;
    if (!lowering.identity_score) tapes.push_back(&lowering.score_tape);
    if (!lowering.keep_all) tapes.push_back(&lowering.mask_tape);
    if (!lowering.identity_score) tapes.push_back(&lowering.backward_tape);
    tapes.push_back(&lowering.gradient_tape);
    return tapes;
  }

  // Calls `mutate(tape, index)` for site `site` among the entries `sites(tape)` lists.
  template <typename Sites, typename Mutate>
  static bool at_site(Lowering& lowering, std::size_t site, const Sites& sites,
                      const Mutate& mutate) {
    for (Tape* tape : executed(lowering)) {
      const std::vector<std::size_t> found = sites(*tape);
      if (site < found.size()) {
        mutate(*tape, found[site]);
        return true;
      }
      site -= found.size();
    }
    return false;
  }

  // Slots an output depends on (a graph's dead nodes are lowered too; changing one changes
  // nothing that runs, so it is no fault).
  static std::set<std::int64_t> live_slots(const Tape& tape) {
    std::set<std::int64_t> live;
    for (const Slot& output : tape.outputs_) live.insert(encode(output));
    for (std::size_t i = tape.instructions_.size(); i-- > 0;) {
      const Instruction& instruction = tape.instructions_[i];
      if (live.count(encode(instruction.result)) == 0) continue;
      if (instruction.op == Op::kLoad) {
        for (Slot index : tape.loads_[static_cast<std::size_t>(instruction.load)].indices) {
          live.insert(encode(index));
        }
      } else {
        for (int a = 0; a < arity(instruction.op); ++a) {
          live.insert(encode(instruction.args[static_cast<std::size_t>(a)]));
        }
      }
    }
    return live;
  }

  static std::vector<std::size_t> live_instructions(const Tape& tape) {
    const std::set<std::int64_t> live = live_slots(tape);
    std::vector<std::size_t> found;
    for (std::size_t i = 0; i < tape.instructions_.size(); ++i) {
      if (live.count(encode(tape.instructions_[i].result)) != 0) found.push_back(i);
    }
    return found;
  }

  static std::vector<std::size_t> live_constants(const Tape& tape) {
    const std::set<std::int64_t> live = live_slots(tape);
    std::vector<std::size_t> found;
    for (std::size_t i = 0; i < tape.constants_.size(); ++i) {
      if (live.count(encode(tape.constants_[i].slot)) != 0) found.push_back(i);
    }
    return found;
  }

  static std::vector<std::size_t> swappable(const Tape& tape) {
    std::vector<std::size_t> found;
    for (std::size_t i : live_instructions(tape)) {
      const Instruction& instruction = tape.instructions_[i];
      if (is_elementwise(instruction.op) && arity(instruction.op) >= 2 &&
          !is_commutative(instruction.op)) {
        found.push_back(i);
      }
    }
    return found;
  }

  static void drop_operation(Tape& tape, std::size_t index) {
    const Instruction dropped = tape.instructions_[index];
    const Slot replacement = dropped.op == Op::kLoad
                                 ? tape.loads_[static_cast<std::size_t>(dropped.load)].indices[0]
                                 : dropped.args[0];
    tape.instructions_.erase(tape.instructions_.begin() + static_cast<std::ptrdiff_t>(index));
    const auto redirect = [&](Slot& slot) {
      if (slot.is_float == dropped.result.is_float && slot.index == dropped.result.index) {
        slot = replacement;
      }
    };
    for (Instruction& instruction : tape.instructions_) {
      for (Slot& arg : instruction.args) redirect(arg);
    }
    for (TapeLoad& load : tape.loads_) {
      for (Slot& index_slot : load.indices) redirect(index_slot);
    }
    for (Slot& output : tape.outputs_) redirect(output);
  }

  static void change_constant(Tape& tape, std::size_t index) {
    double& value = tape.constants_[index].value;
    if (!tape.constants_[index].slot.is_float) {
      value = value == 0.0 ? 1.0 : 0.0;  // i32 and bool alike
    } else {
      value = !std::isfinite(value) ? -value : value == 0.0 ? 1.0 : value * 3.0;
    }
  }

  static void swap_operands(Tape& tape, std::size_t index) {
    Instruction& instruction = tape.instructions_[index];
    if (instruction.op == Op::kWhere) {
      std::swap(instruction.args[1], instruction.args[2]);
    } else {
      std::swap(instruction.args[0], instruction.args[1]);
    }
  }

  // Output `output` of `tape` replaced by a new constant 1.
  static void output_to_one(Tape& tape, std::size_t output) {
    const Slot one{true, tape.float_slots_++};
    tape.constants_.push_back({one, 1.0});
    tape.outputs_[output] = one;
  }
};

bool apply_fault(Lowering& lowering, TapeFault fault, std::size_t site) {
  switch (fault) {
    case TapeFault::kDropOperation:
      return TapeMutator::at_site(lowering, site, TapeMutator::live_instructions,
                                  TapeMutator::drop_operation);
    case TapeFault::kChangeConstant:
      return TapeMutator::at_site(lowering, site, TapeMutator::live_constants,
                                  TapeMutator::change_constant);
    case TapeFault::kSwapOperands:
      return TapeMutator::at_site(lowering, site, TapeMutator::swappable,
                                  TapeMutator::swap_operands);
    case TapeFault::kDropMask: {
      if (site != 0 || lowering.keep_all) return false;
      const Graph keep = Graph::always_true();
      lowering.mask_tape = Tape({&keep});
      return true;
    }
    case TapeFault::kDropDerivative: {
      // d score_mod / d score, then each load's derivative, where it is not 1 already.
      std::vector<std::pair<Tape*, std::size_t>> sites;
      if (!lowering.identity_score && lowering.backward_tape.output_count() > 1) {
        sites.emplace_back(&lowering.backward_tape, 1);
      }
      std::size_t indices = 0;
      for (const LoadDerivative& load : lowering.load_derivatives) indices += load.indices.size();
      for (std::size_t n = 0; n < lowering.load_derivatives.size(); ++n) {
        sites.emplace_back(&lowering.gradient_tape, indices + n);
      }
      std::erase_if(sites, [](const std::pair<Tape*, std::size_t>& at) {
        const Graph derivative = lift_output(*at.first, at.second);
        return derivative.is_literal() && derivative.node(derivative.root()).literal == 1.0;
      });
      if (site >= sites.size()) return false;
      TapeMutator::output_to_one(*sites[site].first, sites[site].second);
      return true;
    }
  }
  return false;
}

std::shared_ptr<const Engine> make_faulty_cpu_engine(TapeFault fault, std::size_t site) {
  return make_cpu_engine(
      [fault, site](Lowering& lowering) { return apply_fault(lowering, fault, site); });
}

}  // namespace flexattn::cpu
