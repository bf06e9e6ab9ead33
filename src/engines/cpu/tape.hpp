// The modifier, compiled: canonical graphs lowered once per plan into a straight-line tape of
// vector instructions, one per graph node, each evaluated over a whole row of a score tile (one
// key against a row of queries) at a time. f32 values live in float arrays, i32 and bool values
// in int32 arrays (bool as 0 / 1); the leaves `q` and `kv` are an iota and a broadcast, the other
// leaves, literals and parameters are broadcasts; tensor loads gather with the tensor's strides.
// The semantics are those of `evaluate` (analysis.hpp), in float32.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "flexattn/graph.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn::cpu {

// A value's home: a row of one of the two arrays of a TapeRunner.
struct Slot {
  bool is_float = true;  // float array (f32) or int32 array (i32, bool)
  std::int32_t index = -1;
};

struct Instruction {
  Op op = Op::kAdd;
  Type type = Type::kF32;          // of the result
  Type operand_type = Type::kF32;  // of the first operand (comparisons, conversions, min/max)
  Slot result;
  std::array<Slot, 3> args;
  std::int32_t load = -1;  // kLoad: index into Tape::loads()
};

struct TapeLoad {
  std::string tensor;
  std::vector<Slot> indices;  // i32 slots
};

class Tape {
 public:
  Tape() = default;
  // Lowers `graphs` into one tape (common sub-expressions shared); output(i) holds the root of
  // graphs[i]. Every IR op is lowered; there is no op this engine rejects.
  explicit Tape(const std::vector<const Graph*>& graphs);

  const std::vector<Instruction>& instructions() const { return instructions_; }
  const std::vector<TapeLoad>& loads() const { return loads_; }
  Slot output(std::size_t i) const { return outputs_[i]; }
  std::size_t output_count() const { return outputs_.size(); }
  std::int32_t float_slots() const { return float_slots_; }
  std::int32_t int_slots() const { return int_slots_; }
  // Slot of a leaf (kScore, kBatch, kHead, kQuery, kKey, kQueryLen, kKeyLen); index -1 if unused.
  Slot leaf(Op op) const;
  struct Constant {
    Slot slot;
    double value;
  };
  const std::vector<Constant>& constants() const { return constants_; }
  struct Parameter {
    Slot slot;
    std::string name;
  };
  const std::vector<Parameter>& parameters() const { return parameters_; }
  // Instructions are ordered in three groups, each evaluated as rarely as its inputs allow:
  // [0, head_end) read neither the score nor a position (once per (batch, head)),
  // [head_end, query_end) read the query but not the key or the score (once per query range),
  // [query_end, size) the rest (once per key row).
  std::size_t head_end() const { return head_end_; }
  std::size_t query_end() const { return query_end_; }

 private:
  friend class TapeBuilder;
  friend class TapeMutator;  // planted faults (tests/support/cpu_tape_faults.cpp)
  std::vector<Instruction> instructions_;
  std::vector<TapeLoad> loads_;
  std::vector<Slot> outputs_;
  std::map<Op, Slot> leaves_;
  std::vector<Constant> constants_;
  std::vector<Parameter> parameters_;
  std::int32_t float_slots_ = 0, int_slots_ = 0;
  std::size_t head_end_ = 0, query_end_ = 0;
};

// The values a tape reads besides the leaves: parameter values and tensor views (CPU).
struct TapeInputs {
  std::map<std::string, double> params;
  std::map<std::string, TensorView> tensors;
};

// Evaluates a tape over rows of `width` lanes; one per thread (it owns the value arrays).
class TapeRunner {
 public:
  TapeRunner(const Tape& tape, const TapeInputs& inputs, std::int64_t width);
  TapeRunner(TapeRunner&&) = default;

  // The (batch, head) of the following rows and that sequence's lengths; evaluates the first
  // group of instructions.
  void set_head(std::int64_t batch, std::int64_t head, std::int64_t query_length,
                std::int64_t key_length);
  // Lane i is query first + i; lanes at or past the sequence end repeat its last query, so every
  // index a load computes stays inside the ranges the problem's load analysis proved. Evaluates
  // the second group of instructions.
  // `position_offset` is added to every query index (a KV cache's queries sit at its end).
  void set_queries(std::int64_t first, std::int64_t count, std::int64_t position_offset = 0);
  // set_head and set_queries at once for lanes that differ in head: lane i is head heads[i] at
  // query position queries[i] (i < count; lanes past it repeat the last). A decoding step packs
  // the query heads of a GQA group into the lanes, so one K and V tile serves them all.
  void set_lanes(std::int64_t batch, const std::int32_t* heads, const std::int32_t* queries,
                 std::int64_t count, std::int64_t query_length, std::int64_t key_length);
  // Evaluates the tape for one key against the queries. `score` has lanes() values (unused when
  // the tape does not read the score). Float output i is written to destinations[i] (lanes()
  // values) when that pointer is not null; an output the row computes is written there directly.
  void run(std::int64_t key, const float* score, std::span<float* const> destinations = {});
  // run() for several keys at once: lane i takes key first_key + i / key_stride (lanes set up
  // with set_lanes repeating one pattern of key_stride lanes), so a task of few query rows
  // evaluates lanes() / key_stride keys per call. Each lane computes what run() computes for its
  // key.
  void run_keys(std::int64_t first_key, std::int64_t key_stride, const float* score,
                std::span<float* const> destinations = {});

  // The values of `slot` in the last row run() evaluated (an output handed a destination there
  // is read from the destination, not here).
  const float* floats(Slot slot) const { return read_floats_[to_index(slot)]; }
  const std::int32_t* ints(Slot slot) const { return read_ints_[to_index(slot)]; }
  std::int64_t width() const { return width_; }
  // Lanes evaluated: the query count of set_queries rounded up to whole vectors.
  std::int64_t lanes() const { return lanes_; }

 private:
  struct BoundLoad {
    const void* data = nullptr;
    DType dtype = DType::kF32;
    std::vector<std::int64_t> shape, strides;
  };
  static std::size_t to_index(Slot slot) { return static_cast<std::size_t>(slot.index); }
  float* storage_of(Slot slot);  // a float slot's own array
  void point_at_storage();
  void fill_int(Op leaf, std::int64_t value);
  void execute_range(std::size_t begin, std::size_t end);
  void gather(const Instruction& instruction);

  const Tape* tape_;
  std::int64_t width_;
  std::int64_t lanes_;
  std::int64_t query_length_ = 1, key_length_ = 1;
  std::vector<float> float_storage_;       // (float_slots, width)
  std::vector<std::int32_t> int_storage_;  // (int_slots, width)
  std::vector<const float*> read_floats_;  // per slot: where operands are read
  std::vector<float*> write_floats_;       // per slot: where results are written
  std::vector<const std::int32_t*> read_ints_;
  std::vector<std::int32_t*> write_ints_;
  std::vector<bool> computed_per_row_;  // per float slot: written by a row instruction
  Slot score_slot_, key_slot_;          // leaves set per row (index -1 when unused)
  bool score_is_output_ = false;        // an output is the score itself (e.g. d(score * g)/dg)
  std::vector<Slot> redirected_;        // slots run() pointed at caller memory
  std::vector<BoundLoad> bound_;
  std::vector<std::int64_t> offsets_;  // gather scratch (width,)
};

}  // namespace flexattn::cpu
