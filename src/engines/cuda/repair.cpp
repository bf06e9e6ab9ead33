// The non-finite repair of another GPU engine (repair.hpp): the cuda engine's row kernels
// (kernels/repair.cuh), lowered, proven and compiled for the caller's problem.
#include "engines/cuda/repair.hpp"

#include <fmt/format.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engines/cuda/codegen.hpp"
#include "engines/cuda/kernel_cache.hpp"
#include "engines/cuda/launch_support.hpp"
#include "engines/cuda/source_proof.hpp"
#include "engines/cuda/tile_plan.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cuda {
namespace {

using flexattn_kernels::BackwardParams;
using flexattn_kernels::ForwardParams;

// The non-finite repair module of a problem: its kernels and their parameters.
class RepairKernels final : public NonFiniteRepair {
 public:
  RepairKernels(const Problem& problem, std::shared_ptr<const Driver> driver,
                ModifierBindings bindings, KernelLookup kernel)
      : problem_(problem),
        driver_(std::move(driver)),
        bindings_(std::move(bindings)),
        kernel_(std::move(kernel.kernel)),
        key_(kernel.key),
        origin_(kernel.origin) {
    forward_ = base_forward_params(problem, bindings_, driver_, cu_seqlens_q_, cu_seqlens_kv_);
    forward_function_ = kernel_->function(kRepairForwardName);
    if (problem.wants_backward()) {
      backward_.fwd = forward_;
      backward_.dout = sequence_view(problem, "dout");
      backward_.dq = sequence_view(problem, "dq");
      backward_.dk = sequence_view(problem, "dk");
      backward_.dv = sequence_view(problem, "dv");
      delta_function_ = kernel_->function(kBackwardDeltaName);
      dq_function_ = kernel_->function(kRepairDqName);
      dkdv_function_ = kernel_->function(kRepairDkdvName);
      delta_bytes_ =
          align_scratch(static_cast<std::size_t>(problem.expected("lse").numel()) * sizeof(float));
    }
  }

  void forward(const ForwardArgs& args, void* lse) const override {
    ForwardParams p = forward_;
    bind_views(args, static_cast<float*>(lse), p);
    bind_tensors(bindings_, args.tensors, p);
    const ContextScope scope(*driver_);
    launch(forward_function_, rows(problem_.seq_len_q()), heads(problem_.heads_q()),
           flexattn_kernels::kRepairThreads, static_cast<CUstream>(args.stream), &p,
           "non-finite repair of O");
  }

  void backward(const BackwardArgs& args, void* scratch) const override {
    if (delta_function_ == nullptr) throw_internal("cuda: a backward repair of a forward problem");
    if (args.lse.data == nullptr) throw_internal("cuda: a backward repair without the LSE");
    BackwardParams p = backward_;
    bind_views(args, p);
    bind_tensors(bindings_, args.tensors, p.fwd);
    p.delta = static_cast<float*>(scratch);
    p.lse2 = reinterpret_cast<float*>(static_cast<std::byte*>(scratch) + delta_bytes_);
    const ContextScope scope(*driver_);
    const auto stream = static_cast<CUstream>(args.stream);
    launch(delta_function_,
           static_cast<unsigned>(ceil_div(problem_.seq_len_q(), flexattn_kernels::kDeltaRows)),
           heads(problem_.heads_q()), flexattn_kernels::kDeltaThreads, stream, &p,
           "non-finite repair: delta");
    launch(dq_function_, rows(problem_.seq_len_q()), heads(problem_.heads_q()),
           flexattn_kernels::kRepairThreads, stream, &p, "non-finite repair of dQ");
    launch(dkdv_function_, rows(problem_.seq_len_kv()), heads(problem_.heads_kv()),
           flexattn_kernels::kRepairThreads, stream, &p, "non-finite repair of dK and dV");
  }

  std::size_t backward_scratch_bytes() const override { return 2 * delta_bytes_; }

  std::string describe() const override {
    return fmt::format("non-finite rows recomputed by cuda kernel {} ({})", key_.substr(0, 16),
                       origin_);
  }

 private:
  static unsigned rows(std::int64_t count) {
    return static_cast<unsigned>(ceil_div(count, flexattn_kernels::kRepairRows));
  }
  static unsigned heads(std::int64_t count) { return static_cast<unsigned>(count); }

  // Grid (rows, heads, batch) of kRepairThreads threads, no dynamic shared memory.
  template <class Params>
  void launch(CUfunction function, unsigned grid_x, unsigned heads, int threads, CUstream stream,
              Params* params, std::string_view what) const {
    cuda::launch(*driver_, function, {grid_x, heads, static_cast<unsigned>(problem_.batch())},
                 threads, 0, stream, params, what);
  }

  Problem problem_;
  std::shared_ptr<const Driver> driver_;
  ModifierBindings bindings_;
  std::shared_ptr<const CompiledKernel> kernel_;
  std::string key_;
  std::string origin_;
  DeviceBuffer cu_seqlens_q_;
  DeviceBuffer cu_seqlens_kv_;
  ForwardParams forward_{};
  BackwardParams backward_{};
  CUfunction forward_function_ = nullptr;
  CUfunction delta_function_ = nullptr;
  CUfunction dq_function_ = nullptr;
  CUfunction dkdv_function_ = nullptr;
  std::size_t delta_bytes_ = 0;
};

}  // namespace

RepairLowering make_non_finite_repair(const Problem& problem,
                                      const std::shared_ptr<const Driver>& driver, bool compile) {
  RepairLowering result;
  const auto refuse = [&](std::string reason) {
    result.support = Support::no("no non-finite repair: " + reason);
    return std::move(result);
  };
  if (problem.device() != Device::kCuda) return refuse("the problem is not on the cuda device");
  if (problem.kv_cache()) return refuse("a paged KV cache");
  const BindingSelection binding = bind_modifier(problem);
  if (!binding.reason.empty()) return refuse(binding.reason);
  if (Support limits = launch_limits(problem); !limits) return refuse(limits.reason());
  std::optional<BackwardCode> backward;
  if (problem.wants_backward()) {
    try {
      backward = backward_code(problem, BackwardChoice{});
    } catch (const Error& error) {
      return refuse(fmt::format("cannot differentiate the score modifier: {}", error.what()));
    }
  }
  const std::string source =
      generate_repair_translation_unit(problem, binding.bindings, backward ? &*backward : nullptr);
  // The same proof as the cuda engine's plans: the Modifier struct the kernels call, lifted
  // from this source, equals the request.
  const SourceProof proof = prove_modifier_source(problem, binding.bindings, source);
  if (!proof.proven) {
    return refuse(
        fmt::format("the plan proof could not show the generated source equal to the "
                    "request ({})",
                    proof.failure));
  }
  result.support = Support::yes();
  if (!compile) return result;
  if (!driver->availability()) return refuse(driver->availability().reason());
  if (Support nvrtc = nvrtc_availability(); !nvrtc) return refuse(nvrtc.reason());
  std::vector<KernelFunction> functions = {{std::string(kRepairForwardName), 0}};
  if (backward) {
    functions.push_back({std::string(kBackwardDeltaName), 0});
    functions.push_back({std::string(kRepairDqName), 0});
    functions.push_back({std::string(kRepairDkdvName), 0});
  }
  KernelCache cache(driver);
  result.repair = std::make_unique<RepairKernels>(problem, driver, binding.bindings,
                                                  cache.get(source, functions));
  return result;
}

}  // namespace flexattn::cuda
