// Internals of the conformance runner shared by its files.
#pragma once

#include <cstdint>

#include "flexattn/engine.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::conformance::detail {

// Element offsets of the sequence tensors of a problem in its layout.
class LayoutIndex {
 public:
  explicit LayoutIndex(const Problem& problem) : problem_(problem) {}
  // Q/K/V/O-like views: element (b, head, position in the sequence, d).
  std::int64_t offset(const TensorView& view, bool query_side, std::int64_t b, std::int64_t head,
                      std::int64_t position, std::int64_t d) const;
  // LSE: (B, Hq, Sq) or thd (Hq, Tq), contiguous.
  std::int64_t lse_offset(std::int64_t b, std::int64_t head, std::int64_t position) const;

 private:
  const Problem& problem_;
};

// The plain same-precision implementation that sets the tolerance (DESIGN.md section 5): what a
// straightforward framework implementation does in the storage precision: fp32 products of
// storage-precision inputs, fp32 softmax, P rounded to the storage dtype before P @ V, outputs
// rounded to the storage dtype; backward likewise (dS rounded before its two products). It reads
// and writes host views of any dtype; LSE and tensor gradients are fp32.
void plain_forward(const Problem& problem, const ForwardArgs& args);
void plain_backward(const Problem& problem, const BackwardArgs& args);

}  // namespace flexattn::conformance::detail
