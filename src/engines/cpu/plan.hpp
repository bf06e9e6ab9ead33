// The `cpu` engine's plan: the modifiers lowered to tapes, the tile sizes, the per-tile mask
// classes from the interval analysis, and the forward and backward passes (forward.cpp,
// backward.cpp, query_pass.cpp).
#pragma once

#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engines/cpu/tape.hpp"
#include "flexattn/analysis.hpp"
#include "flexattn/engine.hpp"

namespace flexattn::cpu {

// Tile sizes. Scores are held transposed, as (block_k keys x block_q queries) tiles, so every
// softmax statistic is a vector across queries; block_q is therefore a multiple of the vector
// width.
struct TileSizes {
  std::int64_t block_q = 0;
  std::int64_t block_k = 0;
  std::int64_t ld = 0;  // leading dimension of (x, block_q) tile buffers: block_q padded
};
TileSizes choose_tile_sizes(const Problem& problem);

// Rows of tile buffers are padded by one cache line (16 floats): with a power-of-two row stride,
// a product's B panel (64 bytes of each of k rows) falls on 1/8 of the L1 sets and evicts
// itself; one extra line per row spreads it over all of them (measured: about 15% on the
// forward, docs/performance.md).
inline constexpr std::int64_t kLanePadding = 16;

// What lowering the problem produced; built once per plan.
struct Lowering {
  // The graphs the tapes were built from (tile classification and the tensor gradients' windows
  // read them; the proof lifts the tapes themselves, tape_proof.hpp).
  Graph score_mod, mask_mod;
  bool identity_score = false;
  bool keep_all = false;  // the mask is the literal `true`
  Tape score_tape;        // outputs: score_mod
  Tape mask_tape;         // outputs: mask_mod
  Tape backward_tape;     // outputs: score_mod, d score_mod / d score
  // The gradients of the float tensors the score modifier reads, and one tape whose outputs are
  // every load's indices, then every load's derivative.
  std::vector<LoadDerivative> load_derivatives;
  Tape gradient_tape;
};

struct BackwardContext;
struct KeyTileState;

// The fused backward runs one work item per (batch, kv head); it is chosen when there are at
// least this many items per thread, so that dynamic scheduling can still even out items of
// unequal work (ragged thd sequences, masks) instead of leaving a thread idle at the end.
inline constexpr std::int64_t kFusedItemsPerThread = 2;

// Mask classes of the tiles of one batch entry's (query tile, key tile) grid.
struct TileGrid {
  std::int64_t query_tiles = 0, key_tiles = 0;
  std::vector<TileClass> classes;  // (query_tiles, key_tiles), row-major
  TileClass at(std::int64_t query_tile, std::int64_t key_tile) const {
    return classes[static_cast<std::size_t>(query_tile * key_tiles + key_tile)];
  }
};

// Per-row statistics of a forward for the backward, indexed like the LSE: the final running max,
// the reciprocal of the final sum (0 for a row with no kept key), and D = sum over kv of P dP.
struct RowStatistics {
  std::vector<float> max, inverse_sum, delta;
};

class CpuPlan final : public Plan {
 public:
  CpuPlan(PlanInfo info, Problem problem, Lowering lowering, TileSizes tiles,
          std::vector<TileGrid> grids);

  const Problem& problem() const override { return problem_; }

 protected:
  void run_forward(const ForwardArgs& args) const override;
  void run_backward(const BackwardArgs& args) const override;

 private:
  const TileGrid& grid(std::int64_t batch) const {
    return grids_.size() == 1 ? grids_.front() : grids_[static_cast<std::size_t>(batch)];
  }
  // The forward (forward.cpp). With `dout`, it also accumulates D = sum P dP into statistics;
  // an empty args.out skips the output.
  void forward_pass(const ForwardArgs& args, const TensorView* dout,
                    RowStatistics* statistics) const;
  // Backward passes (backward.cpp, query_pass.cpp). A key tile's dK and dV over every query
  // head of its group and every query tile, adding dQ^T into dq_blocks when not null.
  KeyTileState make_key_tile_state(const BackwardContext& context) const;
  void key_tile(const BackwardContext& context, const std::vector<float>& delta, std::int64_t b,
                std::int64_t h_kv, std::int64_t kt, KeyTileState& state, float* dq_blocks) const;
  void key_pass(const BackwardContext& context, const std::vector<float>& delta) const;
  void query_pass(const BackwardContext& context, const std::vector<float>& delta) const;
  void fused_pass(const BackwardContext& context, const std::vector<float>& delta) const;

  Problem problem_;
  Lowering lowering_;
  TileSizes tiles_;
  std::vector<TileGrid> grids_;  // one per batch entry, or one shared by all
};

// Classifies every tile of every batch entry (one grid when they all agree by construction).
std::vector<TileGrid> classify_tiles(const Problem& problem, const Graph& mask, bool keep_all,
                                     const TileSizes& tiles);
// The grid of one KV cache sequence of a run: q_len queries at positions [q_offset, q_offset +
// q_len) against kv_len cached keys.
TileGrid classify_cache_tiles(const Problem& problem, const Graph& mask, bool keep_all,
                              const TileSizes& tiles, std::int64_t b, std::int64_t q_len,
                              std::int64_t kv_len, std::int64_t q_offset);

// Runs body(i, state) for i in [0, count) on OpenMP threads with one `State` per thread (from
// make_state()). Iterations must write disjoint memory. An exception never leaves the parallel
// region: the first one is rethrown afterwards.
template <typename MakeState, typename Body>
void parallel_for(std::int64_t count, const MakeState& make_state, const Body& body) {
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const auto record = [&] {
    const std::lock_guard lock(failure_mutex);
    if (!failure) failure = std::current_exception();
  };
#pragma omp parallel
  {
    std::optional<decltype(make_state())> state;
    try {
      state.emplace(make_state());
    } catch (...) {
      record();
    }
#pragma omp for schedule(dynamic)
    for (std::int64_t i = 0; i < count; ++i) {
      if (!state) continue;
      try {
        body(i, *state);
      } catch (...) {
        record();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

inline std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}
inline std::int64_t ceil_div(std::int64_t value, std::int64_t divisor) {
  return (value + divisor - 1) / divisor;
}
inline std::size_t to_size(std::int64_t value) { return static_cast<std::size_t>(value); }

}  // namespace flexattn::cpu
