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
// tile once per key tile), so a call scans each input once per (batch, head) (FiniteHeads):
// the products of a head without NaN or inf (the common case) skip the tile scan, and only those
// of a head that has one scan their tiles.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "engines/cpu/kernels.hpp"
#include "flexattn/problem.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn::cpu {

// Which operand of GemmOperands holds the data; the other holds the coefficients.
enum class DataOperand { kA, kB };

// C = A B (or C += A B) like kernel.gemm, except that a coefficient of exactly 0 never multiplies
// a data value: the term is skipped. `data_finite`: the caller knows the data tile holds no NaN
// or inf (its head has none), so it is one plain product, without the scan. `scratch` holds the
// cleaned data tile when the data has non-finite entries (resized then; untouched otherwise).
void gemm_skipping_zeros(const Kernels& kernel, const GemmOperands& operands, DataOperand data,
                         bool data_finite, std::vector<float>& scratch);

// Whether each (batch, head) sequence of a Q, K, V or dO view is free of NaN and infinities. A
// sequence is scanned when a task of the pass first asks about it, and the answer is kept for the
// rest of the call; tasks that ask at once may both scan, and find the same answer. (A parallel
// scan of its own before the pass measured slower than the tile scans it replaces, on a loaded
// machine: docs/measurements/2026-12-05-cpu-non-finite-flags.txt.) fp16 and bf16 are scanned in
// their storage: their conversion to float32 is exact, inf and NaN included.
class FiniteHeads {
 public:
  // query_side: the view is indexed by query positions, with heads_q heads; else by key
  // positions, with heads_kv. `columns`: the head dimension of the view.
  FiniteHeads(const Problem& problem, const TensorView& view, bool query_side,
              std::int64_t columns);
  // Whether the (batch, head) sequence holds no NaN and no infinity. Safe from any thread.
  bool at(std::int64_t batch, std::int64_t head) const;

 private:
  enum State : std::uint8_t { kUnknown, kFinite, kNonFinite };
  const Problem& problem_;
  const TensorView& view_;
  bool query_side_;
  std::int64_t columns_, heads_;
  mutable std::vector<std::atomic<std::uint8_t>> states_;  // per (batch, head)
};

}  // namespace flexattn::cpu
