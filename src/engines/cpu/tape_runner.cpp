// Evaluation of a tape (see tape.hpp): the value arrays, the leaves, tensor gathers, and the
// three instruction groups run at their own rates.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "engines/cpu/kernels.hpp"
#include "engines/cpu/tape.hpp"
#include "engines/cpu/tape_ops.hpp"
#include "flexattn/dtype.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cpu {

namespace {

// i32 values wrap to 32 bits (two's complement), like `evaluate`.
std::int32_t wrap(std::int64_t value) {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(static_cast<std::uint64_t>(value)));
}

}  // namespace

TapeRunner::TapeRunner(const Tape& tape, const TapeInputs& inputs, std::int64_t width)
    : tape_(&tape), width_(width), lanes_(width) {
  const auto floats = static_cast<std::size_t>(tape.float_slots());
  const auto ints = static_cast<std::size_t>(tape.int_slots());
  float_storage_.assign(floats * static_cast<std::size_t>(width), 0.0f);
  int_storage_.assign(ints * static_cast<std::size_t>(width), 0);
  read_floats_.resize(floats);
  write_floats_.resize(floats);
  read_ints_.resize(ints);
  write_ints_.resize(ints);
  point_at_storage();
  score_slot_ = tape.leaf(Op::kScore);
  key_slot_ = tape.leaf(Op::kKey);
  for (std::size_t i = 0; i < tape.output_count(); ++i) {
    const Slot output = tape.output(i);
    score_is_output_ = score_is_output_ || (score_slot_.index >= 0 && output.is_float &&
                                            output.index == score_slot_.index);
  }
  offsets_.assign(static_cast<std::size_t>(width), 0);
  computed_per_row_.assign(floats, false);
  for (std::size_t i = tape.query_end(); i < tape.instructions().size(); ++i) {
    const Slot result = tape.instructions()[i].result;
    if (result.is_float) computed_per_row_[to_index(result)] = true;
  }
  for (const Tape::Constant& constant : tape.constants()) {
    if (constant.slot.is_float) {
      std::fill_n(write_floats_[to_index(constant.slot)], width,
                  static_cast<float>(constant.value));
    } else {
      std::fill_n(write_ints_[to_index(constant.slot)], width,
                  static_cast<std::int32_t>(constant.value));
    }
  }
  for (const Tape::Parameter& parameter : tape.parameters()) {
    const auto found = inputs.params.find(parameter.name);
    if (found == inputs.params.end()) {
      throw_invalid(fmt::format("cpu: parameter '{}' has no value", parameter.name));
    }
    std::fill_n(write_floats_[to_index(parameter.slot)], width, static_cast<float>(found->second));
  }
  for (const TapeLoad& load : tape.loads()) {
    const auto found = inputs.tensors.find(load.tensor);
    if (found == inputs.tensors.end() || found->second.empty()) {
      throw_invalid(fmt::format("cpu: tensor '{}' is not bound", load.tensor));
    }
    const TensorView& view = found->second;
    if (view.rank() != static_cast<int>(load.indices.size())) {
      throw_invalid(fmt::format("cpu: tensor '{}' has rank {} but is loaded with {} indices",
                                load.tensor, view.rank(), load.indices.size()));
    }
    bound_.push_back({view.data, view.dtype, view.shape, view.strides});
  }
}

float* TapeRunner::storage_of(Slot slot) {
  return float_storage_.data() + to_index(slot) * static_cast<std::size_t>(width_);
}

void TapeRunner::point_at_storage() {
  for (std::size_t slot = 0; slot < read_floats_.size(); ++slot) {
    write_floats_[slot] = storage_of({true, static_cast<std::int32_t>(slot)});
    read_floats_[slot] = write_floats_[slot];
  }
  for (std::size_t slot = 0; slot < read_ints_.size(); ++slot) {
    write_ints_[slot] = int_storage_.data() + slot * static_cast<std::size_t>(width_);
    read_ints_[slot] = write_ints_[slot];
  }
}

void TapeRunner::fill_int(Op leaf, std::int64_t value) {
  const Slot slot = tape_->leaf(leaf);
  if (slot.index >= 0)
    std::fill_n(write_ints_[to_index(slot)], width_, static_cast<std::int32_t>(value));
}

void TapeRunner::execute_range(std::size_t begin, std::size_t end) {
  const LaneArrays arrays{read_floats_.data(), read_ints_.data(), write_floats_.data(),
                          write_ints_.data(), lanes_};
  for (std::size_t i = begin; i < end; ++i) {
    const Instruction& instruction = tape_->instructions()[i];
    if (instruction.op == Op::kLoad) {
      gather(instruction);
    } else {
      execute_instruction(instruction, arrays);
    }
  }
}

void TapeRunner::set_head(std::int64_t batch, std::int64_t head, std::int64_t query_length,
                          std::int64_t key_length) {
  query_length_ = query_length;
  key_length_ = key_length;
  fill_int(Op::kBatch, batch);
  fill_int(Op::kHead, head);
  fill_int(Op::kQueryLen, query_length);
  fill_int(Op::kKeyLen, key_length);
  lanes_ = width_;  // every lane, whatever set_queries selects later
  execute_range(0, tape_->head_end());
}

void TapeRunner::set_queries(std::int64_t first, std::int64_t count, std::int64_t position_offset) {
  lanes_ = std::min(width_, (count + kVectorWidth - 1) / kVectorWidth * kVectorWidth);
  const Slot slot = tape_->leaf(Op::kQuery);
  if (slot.index >= 0) {
    std::int32_t* lanes = write_ints_[to_index(slot)];  // (width,)
    const std::int64_t last = std::min(first + count, query_length_) - 1;
    for (std::int64_t i = 0; i < width_; ++i) {
      lanes[i] = static_cast<std::int32_t>(position_offset + std::min(first + i, last));
    }
  }
  execute_range(tape_->head_end(), tape_->query_end());
}

void TapeRunner::set_lanes(std::int64_t batch, const std::int32_t* heads,
                           const std::int32_t* queries, std::int64_t count,
                           std::int64_t query_length, std::int64_t key_length) {
  query_length_ = query_length;
  key_length_ = key_length;
  fill_int(Op::kBatch, batch);
  fill_int(Op::kQueryLen, query_length);
  fill_int(Op::kKeyLen, key_length);
  for (const auto& [leaf, values] : {std::pair{Op::kHead, heads}, std::pair{Op::kQuery, queries}}) {
    const Slot slot = tape_->leaf(leaf);
    if (slot.index < 0) continue;
    std::int32_t* lanes = write_ints_[to_index(slot)];  // (width,)
    for (std::int64_t i = 0; i < width_; ++i) lanes[i] = values[std::min(i, count - 1)];
  }
  lanes_ = std::min(width_, (count + kVectorWidth - 1) / kVectorWidth * kVectorWidth);
  execute_range(0, tape_->query_end());
}

void TapeRunner::run(std::int64_t key, const float* score, std::span<float* const> destinations) {
  run_keys(key, lanes_, score, destinations);
}

void TapeRunner::run_keys(std::int64_t first_key, std::int64_t key_stride, const float* score,
                          std::span<float* const> destinations) {
  if (key_slot_.index >= 0) {
    std::int32_t* keys = write_ints_[to_index(key_slot_)];
    for (std::int64_t i = 0; i < lanes_; i += key_stride) {
      std::fill_n(keys + i, std::min(key_stride, lanes_ - i),
                  static_cast<std::int32_t>(std::min(first_key + i / key_stride, key_length_ - 1)));
    }
  }
  if (score_slot_.index >= 0) read_floats_[to_index(score_slot_)] = score;
  // Outputs computed by this row's instructions are written straight to their destination
  // (the first destination of a slot; any other one gets a copy below).
  redirected_.clear();
  for (std::size_t i = 0; i < destinations.size(); ++i) {
    const Slot slot = tape_->output(i);
    if (destinations[i] == nullptr || !slot.is_float || !computed_per_row_[to_index(slot)])
      continue;
    if (write_floats_[to_index(slot)] != storage_of(slot)) continue;  // already redirected
    write_floats_[to_index(slot)] = destinations[i];
    read_floats_[to_index(slot)] = destinations[i];
    redirected_.push_back(slot);
  }
  execute_range(tape_->query_end(), tape_->instructions().size());
  for (std::size_t i = 0; i < destinations.size(); ++i) {
    if (destinations[i] == nullptr) continue;
    const float* values = read_floats_[to_index(tape_->output(i))];
    if (values != destinations[i]) {
      std::memcpy(destinations[i], values, static_cast<std::size_t>(lanes_) * sizeof(float));
    }
  }
  for (Slot slot : redirected_) {
    write_floats_[to_index(slot)] = storage_of(slot);
    read_floats_[to_index(slot)] = storage_of(slot);
  }
  if (score_slot_.index >= 0) {
    read_floats_[to_index(score_slot_)] = storage_of(score_slot_);
    // floats() of an output reads its slot after the row: an output that is the score leaf
    // itself (d(score * g[h]) / d g = score) must hold this row's score there, not stale values.
    if (score_is_output_) {
      std::memcpy(storage_of(score_slot_), score, static_cast<std::size_t>(lanes_) * sizeof(float));
    }
  }
}

void TapeRunner::gather(const Instruction& instruction) {
  const BoundLoad& tensor = bound_[static_cast<std::size_t>(instruction.load)];
  const TapeLoad& load = tape_->loads()[static_cast<std::size_t>(instruction.load)];
  const std::int64_t n = lanes_;
  std::int64_t* offsets = offsets_.data();
  std::fill_n(offsets, n, 0);
  for (std::size_t axis = 0; axis < load.indices.size(); ++axis) {
    // The problem's load analysis proved every index in bounds or clamped it; this clamp only
    // guarantees memory safety and changes nothing for valid input.
    const std::int32_t* index = ints(load.indices[axis]);
    const std::int64_t last = tensor.shape[axis] - 1;
    const std::int64_t stride = tensor.strides[axis];
    for (std::int64_t i = 0; i < n; ++i) {
      offsets[i] += std::clamp<std::int64_t>(index[i], 0, last) * stride;
    }
  }
  const auto store = [&](auto read) {
    if (instruction.result.is_float) {
      float* out = write_floats_[to_index(instruction.result)];
      for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(read(offsets[i]));
    } else {
      std::int32_t* out = write_ints_[to_index(instruction.result)];
      for (std::int64_t i = 0; i < n; ++i)
        out[i] = wrap(static_cast<std::int64_t>(read(offsets[i])));
    }
  };
  switch (tensor.dtype) {
    case DType::kF32:
      store([data = static_cast<const float*>(tensor.data)](std::int64_t at) { return data[at]; });
      return;
    case DType::kF64:
      store([data = static_cast<const double*>(tensor.data)](std::int64_t at) { return data[at]; });
      return;
    case DType::kF16:
      store([data = static_cast<const Half*>(tensor.data)](std::int64_t at) {
        return to_float(data[at]);
      });
      return;
    case DType::kBF16:
      store([data = static_cast<const BFloat16*>(tensor.data)](std::int64_t at) {
        return to_float(data[at]);
      });
      return;
    case DType::kI32:
      store([data = static_cast<const std::int32_t*>(tensor.data)](std::int64_t at) {
        return data[at];
      });
      return;
    case DType::kI64:
      store([data = static_cast<const std::int64_t*>(tensor.data)](std::int64_t at) {
        return data[at];
      });
      return;
  }
}

}  // namespace flexattn::cpu
