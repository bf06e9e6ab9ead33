// Products in which a position that must not contribute (a masked key, a modified score of -inf)
// contributes nothing, whatever the data there holds.
//
// The engine's products multiply a coefficient tile (P or dS, exactly 0 at such positions) by a
// data tile (Q, K, V or dO rows). 0 * NaN and 0 * inf are NaN, so a plain product would let a
// NaN in a masked value row poison every query of its tile. `gemm_skipping_zeros` computes the
// product as if each zero coefficient skipped its term: with finite data (the common case) it is
// one plain product after a scan of the data tile; otherwise the product runs on the data with
// its non-finite entries set to 0, and each non-finite entry then adds its terms for the nonzero
// coefficients only (docs/design.md, "Non-finite values").
//
// A data tile is read many times (a K or V tile once per query tile that meets it, a Q or dO
// tile once per key tile), so a call scans each tile once (FiniteTiles): the products of a tile
// without NaN or inf (the common case) are plain products, and only a tile that has one takes
// the skipping path.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "engines/cpu/kernels.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cpu {

// Which operand of GemmOperands holds the data; the other holds the coefficients.
enum class DataOperand { kA, kB };

// C = A B (or C += A B) like kernel.gemm, except that a coefficient of exactly 0 never multiplies
// a data value: the term is skipped. `data_finite`: the caller knows the data tile holds no NaN
// or inf (FiniteTiles), so it is one plain product, without the scan. `scratch` holds the
// cleaned data tile when the data has non-finite entries (resized then; untouched otherwise).
void gemm_skipping_zeros(const Kernels& kernel, const GemmOperands& operands, DataOperand data,
                         bool data_finite, std::vector<float>& scratch);

// Whether each tile of a Q, K, V or dO view (`block` rows of one (batch, head) sequence) is free
// of NaN and infinities. A tile is scanned in its float32 copy, exactly the data the products
// read, the first time a task of the pass has converted it, and the answer is kept for the rest
// of the call; tasks that ask at once may both scan, and find the same answer. (Scanning each
// input's (batch, head) sequences in the tensor instead recovered only half the cost in the
// backward, and a parallel pass of its own before the loop lost: see
// docs/measurements/2026-12-05-cpu-non-finite-flags.txt.)
class FiniteTiles {
 public:
  // query_side: tiles of query positions, with heads_q heads; else of key positions, with
  // heads_kv.
  FiniteTiles(const Problem& problem, bool query_side, std::int64_t block);
  // Key-side tiles of sequences of these lengths (a KV cache's run), with `heads` heads.
  FiniteTiles(const std::vector<std::int64_t>& lengths, std::int64_t heads, std::int64_t block);
  // Whether tile `tile` (rows [tile * block, ...)) of the (batch, head) sequence holds no NaN and
  // no infinity. `rows` is its float32 copy, `count` rows of `columns` floats `ld` apart, scanned
  // only if no task has asked before. Safe from any thread.
  bool at(std::int64_t batch, std::int64_t head, std::int64_t tile, const float* rows,
          std::int64_t ld, std::int64_t count, std::int64_t columns) const;

 private:
  enum State : std::uint8_t { kUnknown, kFinite, kNonFinite };
  std::int64_t heads_;
  std::vector<std::int64_t> tiles_, first_;  // per batch: tiles per head, index of its first
  mutable std::vector<std::atomic<std::uint8_t>> states_;  // per (batch, head, tile)
};

}  // namespace flexattn::cpu
