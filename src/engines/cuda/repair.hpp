// The non-finite repair another GPU engine runs after its own kernels (the cudnn engine): the rows
// of O (and the LSE), dQ, dK and dV that hold NaN or inf are computed again exactly by the cuda
// engine's row kernels (kernels/repair.cuh; docs/engines.md, "Non-finite inputs"). An engine
// whose products multiply a removed position's weight 0 by its NaN or inf operand, and which is
// otherwise right, then gives the reference's non-finite semantics (docs/design.md).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "engines/cuda/driver.hpp"
#include "flexattn/engine.hpp"
#include "flexattn/problem.hpp"

namespace flexattn::cuda {

class NonFiniteRepair {
 public:
  virtual ~NonFiniteRepair() = default;
  // After the engine stored args.out and the LSE at `lse` (args.lse's data, or the engine's own
  // copy when the caller asked for none): recomputes every row of O whose stored values are not
  // all finite, and its LSE. Stream-ordered on args.stream.
  virtual void forward(const ForwardArgs& args, void* lse) const = 0;
  // After the engine stored dQ, dK and dV: recomputes every row of them that is not all finite.
  // `scratch`: backward_scratch_bytes() of device memory, stream-ordered on args.stream, that
  // the call may overwrite (the rows' delta).
  virtual void backward(const BackwardArgs& args, void* scratch) const = 0;
  virtual std::size_t backward_scratch_bytes() const = 0;
  // The compiled module, for a plan's description.
  virtual std::string describe() const = 0;
};

struct RepairLowering {
  Support support = Support::no(
      "not lowered");  // no, with the reason, where the cuda engine cannot build the repair
  std::unique_ptr<const NonFiniteRepair> repair;  // set when `compile` was asked and it holds
};

// The repair of `problem` (a cuda-device problem the caller's engine serves): lowered, its
// generated source proven equal to the request (source_proof.hpp) like the cuda engine's own
// plans, and, with `compile`, compiled for `driver`'s device.
RepairLowering make_non_finite_repair(const Problem& problem,
                                      const std::shared_ptr<const Driver>& driver, bool compile);

}  // namespace flexattn::cuda
