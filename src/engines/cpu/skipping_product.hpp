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
#pragma once

#include <vector>

#include "engines/cpu/kernels.hpp"

namespace flexattn::cpu {

// Which operand of GemmOperands holds the data; the other holds the coefficients.
enum class DataOperand { kA, kB };

// C = A B (or C += A B) like kernel.gemm, except that a coefficient of exactly 0 never multiplies
// a data value: the term is skipped. `scratch` holds the cleaned data tile when the data has
// non-finite entries (resized then; untouched otherwise).
void gemm_skipping_zeros(const Kernels& kernel, const GemmOperands& operands, DataOperand data,
                         std::vector<float>& scratch);

}  // namespace flexattn::cpu
