// Shared pieces of the backward passes (backward.cpp, query_pass.cpp): the per-thread tile
// buffers and the recomputation of P and dS for one (key tile x query tile) pair.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "engines/cpu/kernels.hpp"
#include "engines/cpu/plan.hpp"
#include "engines/cpu/skipping_product.hpp"
#include "engines/cpu/tile_io.hpp"

namespace flexattn::cpu {

// One thread's buffers. Tiles are (block_k keys, block_q queries), row-major with leading
// dimension ld (block_q padded, see TileSizes).
struct BackwardState {
  std::optional<TapeRunner> runner;                // backward tape: score_mod and its derivative
  std::optional<TapeRunner> mask_runner;           // mask tape
  std::optional<TapeRunner> gradient_runner;       // tensor-gradient tape (query pass only)
  std::vector<float> queries;                      // (block_q, queries_ld): Q rows, zero padded
  std::vector<float> queries_t;                    // (dim_qk, ld): scale * Q^T
  std::vector<float> douts;                        // (block_q, douts_ld): dO rows, zero padded
  std::vector<float> douts_t;                      // (dim_v, ld): dO^T
  std::vector<float> keys, values;                 // K / V tiles packed to fp32 (see float_rows)
  std::vector<float> raw;                          // S^T before the modifier
  std::vector<float> probs;                        // P^T
  std::vector<float> dmod;                         // d score_mod / d score
  std::vector<float> ds;                           // dS^T w.r.t. the modified score
  std::vector<float> ds_raw;                       // dS^T w.r.t. the raw score
  std::vector<float> lse_shift, row_scale, delta;  // (block_q,): P = exp(S' - shift) * scale
  bool nan_rows = false;  // some row's shift or scale is NaN (recompute keeps its removed P at 0)
  std::vector<float> cleaned;  // gemm_skipping_zeros's copy of a tile with non-finite values
};

// The key pass's per-thread state: tile buffers and the dK / dV accumulators of one key tile,
// plus the dQ^T accumulators of a whole (batch, kv head) group in the fused pass.
struct KeyTileState {
  BackwardState tiles;
  std::vector<float> dk, dv;  // (block_k, dim_qk_padded), (block_k, dim_v_padded)
  std::vector<float> dq;      // (group, query_tiles, dim_qk, ld), fused pass only
};

// What both passes read: the problem, the lowering, the arguments and the tile geometry.
struct BackwardContext {
  BackwardContext(const Problem& problem, const Lowering& lowering, const TileSizes& tiles,
                  const BackwardArgs& arguments);

  BackwardState make_state(bool with_gradients) const;
  // The tapes' (batch, head); then a query tile's Q, dO, LSE and D into the state.
  void set_head(std::int64_t b, std::int64_t h, BackwardState& s) const;
  void load_query_tile(std::int64_t b, std::int64_t h, std::int64_t q0, std::int64_t nq,
                       const std::vector<float>& delta, BackwardState& s) const;
  // S^T, the modifier and its derivative, the mask, P^T, dP^T, dS^T for keys [k0, k0 + nk)
  // against the loaded query tile of nq queries. Lanes past nq (padding to whole vectors) are
  // masked: P = 0 and dS = 0 there, whatever the modifier gives at their dummy score.
  void recompute(TileClass tile_class, std::int64_t k0, std::int64_t nk, std::int64_t nq,
                 const RowsView& keys, const RowsView& values, BackwardState& s) const;
  // D = rowsum(dO * O) for every (batch, head, query), indexed like the LSE.
  std::vector<float> row_deltas(const TensorView& out) const;

  const Problem& p;
  const Lowering& low;
  std::int64_t block_q, block_k, ld, dim_qk, dim_v, dim_qk_padded, dim_v_padded;
  std::int64_t queries_ld, douts_ld;  // padded like ld (see kLanePadding)
  std::int64_t group;
  float scale;
  const Kernels& kernel;
  const BackwardArgs& args;
  TapeInputs inputs;
  const RowStatistics* statistics = nullptr;  // from a statistics pass; null: use the LSE
  // Which tiles of Q, K and dO (the data of the products that skip zero weights) are finite.
  FiniteTiles finite_q, finite_k, finite_dout;
};

}  // namespace flexattn::cpu
