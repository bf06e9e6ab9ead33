#include "engines/cuda/cuda_engine.hpp"

#include <fmt/format.h>

#include <array>
#include <limits>
#include <numbers>
#include <utility>

#include "engines/cuda/codegen.hpp"
#include "engines/cuda/driver.hpp"
#include "engines/cuda/kernel_cache.hpp"
#include "engines/cuda/kernels/params.cuh"
#include "engines/cuda/tile_plan.hpp"
#include "flexattn/error.hpp"

namespace flexattn {
namespace cuda {
namespace {

using flexattn_kernels::ForwardParams;
using flexattn_kernels::SequenceView;

constexpr std::string_view kEngineName = "cuda";
// Grid limits of y (heads) and z (batch); x (query blocks) allows 2^31 - 1.
constexpr std::int64_t kMaxGridYZ = 65535;
// cp.async reads 16-byte chunks of the tensor-core kernel's rows.
constexpr std::uintptr_t kChunkAlignment = 16;

// What lowering a problem produces: supports() stops after it, plan() builds on it.
struct Lowering {
  KernelChoice choice;
  ModifierBindings bindings;
  std::string source;  // the translation unit NVRTC compiles
};

Support lower_problem(const Problem& problem, Lowering& lowering) {
  if (problem.wants_backward()) {
    return Support::no("the cuda engine computes the forward pass only (no backward yet)");
  }
  const KernelSelection selection = choose_kernel(problem);
  if (!selection.reason.empty()) return Support::no(selection.reason);
  const BindingSelection binding = bind_modifier(problem);
  if (!binding.reason.empty()) return Support::no(binding.reason);
  if (problem.heads_q() > kMaxGridYZ || problem.batch() > kMaxGridYZ) {
    return Support::no(fmt::format("batch {} x heads {} exceeds the launch grid ({} each)",
                                   problem.batch(), problem.heads_q(), kMaxGridYZ));
  }
  constexpr auto kMaxInt = static_cast<std::int64_t>(std::numeric_limits<int>::max());
  if (problem.total_tokens_q() > kMaxInt || problem.total_tokens_kv() > kMaxInt) {
    return Support::no("more than 2^31 - 1 tokens in one launch");
  }
  lowering.choice = selection.choice;
  lowering.bindings = binding.bindings;
  // Every IR op has a lowering (codegen.cpp switches over Op without a default), so generating
  // the code is the last step of deciding support.
  lowering.source = generate_translation_unit(problem, lowering.bindings, lowering.choice);
  return Support::yes();
}

// (batch, token, head) strides of a Q/K/V/O view in the problem's layout.
SequenceView sequence_view(const Problem& problem, std::string_view which) {
  const TensorView view = problem.expected(which);
  const std::vector<std::int64_t>& s = view.strides;
  switch (problem.layout()) {
    case Layout::kBSHD:
      return SequenceView{nullptr, s[0], s[1], s[2]};
    case Layout::kSBHD:
      return SequenceView{nullptr, s[1], s[0], s[2]};
    case Layout::kBHSD:
      return SequenceView{nullptr, s[0], s[2], s[1]};
    case Layout::kTHD:
      return SequenceView{nullptr, 0, s[0], s[1]};
  }
  throw_internal("cuda: unknown layout");
}

DeviceBuffer upload_ints(const std::shared_ptr<const Driver>& driver,
                         const std::vector<int>& values) {
  DeviceBuffer buffer(driver, values.size() * sizeof(int));
  buffer.upload(values.data(), values.size() * sizeof(int));
  return buffer;
}

std::vector<int> to_ints(const std::vector<std::int64_t>& values) {
  return std::vector<int>(values.begin(), values.end());  // < 2^31: checked by lower_problem
}

class CudaForwardPlan final : public Plan {
 public:
  CudaForwardPlan(PlanInfo info, const Problem& problem, std::shared_ptr<const Driver> driver,
                  const Lowering& lowering, KernelLookup kernel, const TileList& tiles)
      : Plan(std::move(info)),
        problem_(problem),
        driver_(std::move(driver)),
        choice_(lowering.choice),
        bindings_(lowering.bindings),
        kernel_(std::move(kernel.kernel)) {
    tile_offsets_ = upload_ints(driver_, tiles.offsets);
    tile_entries_ = upload_ints(driver_, tiles.entries.empty() ? std::vector<int>{0}
                                                                : tiles.entries);
    ForwardParams& p = params_;
    p = ForwardParams{};
    p.q = sequence_view(problem, "q");
    p.k = sequence_view(problem, "k");
    p.v = sequence_view(problem, "v");
    p.o = sequence_view(problem, "o");
    const TensorView lse = problem.expected("lse");
    if (problem.layout() == Layout::kTHD) {
      p.lse_batch_stride = 0;
      p.lse_head_stride = lse.strides[0];
      cu_seqlens_q_ = upload_ints(driver_, to_ints(problem.desc().cu_seqlens_q));
      cu_seqlens_kv_ = upload_ints(driver_, to_ints(problem.desc().cu_seqlens_kv));
      p.cu_seqlens_q = reinterpret_cast<const int*>(cu_seqlens_q_.address());
      p.cu_seqlens_kv = reinterpret_cast<const int*>(cu_seqlens_kv_.address());
    } else {
      p.lse_batch_stride = lse.strides[0];
      p.lse_head_stride = lse.strides[1];
    }
    p.seq_len_q = static_cast<int>(problem.seq_len_q());
    p.seq_len_kv = static_cast<int>(problem.seq_len_kv());
    p.heads_per_kv = static_cast<int>(problem.heads_q() / problem.heads_kv());
    p.scale = static_cast<float>(problem.scale());
    p.scale_log2 = static_cast<float>(problem.scale() * std::numbers::log2e);
    p.tile_offsets = reinterpret_cast<const int*>(tile_offsets_.address());
    p.tile_entries = reinterpret_cast<const int*>(tile_entries_.address());
    p.class_block_q = tiles.class_block_q;
    for (std::size_t i = 0; i < bindings_.params.size(); ++i) {
      p.params[i] = static_cast<float>(problem.desc().params.at(bindings_.params[i]));
    }
    grid_x_ = static_cast<unsigned>((problem.seq_len_q() + choice_.block_m - 1) / choice_.block_m);
  }

  const Problem& problem() const override { return problem_; }

 protected:
  void run_forward(const ForwardArgs& args) const override {
    ForwardParams p = params_;
    p.q.data = args.q.data;
    p.k.data = args.k.data;
    p.v.data = args.v.data;
    p.o.data = args.out.data;
    p.lse = static_cast<float*>(args.lse.data);
    if (choice_.kind == KernelKind::kMma) {
      for (const auto& [name, view] : {std::pair{"q", &args.q}, std::pair{"k", &args.k},
                                       std::pair{"v", &args.v}, std::pair{"out", &args.out}}) {
        if (reinterpret_cast<std::uintptr_t>(view->data) % kChunkAlignment != 0) {
          throw_invalid(fmt::format(
              "cuda: argument {} ({}) is not 16-byte aligned; the tensor-core kernel copies "
              "16-byte chunks",
              name, view->data));
        }
      }
    }
    for (std::size_t i = 0; i < bindings_.tensors.size(); ++i) {
      p.tensors[i].data = args.tensors.at(bindings_.tensors[i]).data;
    }
    std::array<void*, 1> kernel_args = {&p};
    ContextScope scope(*driver_);
    driver_->check(driver_->api().launch_kernel(
                       kernel_->function(), grid_x_, static_cast<unsigned>(problem_.heads_q()),
                       static_cast<unsigned>(problem_.batch()),
                       static_cast<unsigned>(choice_.threads()), 1, 1,
                       static_cast<unsigned>(choice_.shared_bytes),
                       static_cast<CUstream>(args.stream), kernel_args.data(), nullptr),
                   "cuLaunchKernel");
  }

  void run_backward(const BackwardArgs&) const override {
    throw_unsupported("cuda: the backward pass is not implemented");
  }

 private:
  Problem problem_;
  std::shared_ptr<const Driver> driver_;
  KernelChoice choice_;
  ModifierBindings bindings_;
  std::shared_ptr<const CompiledKernel> kernel_;
  DeviceBuffer tile_offsets_;
  DeviceBuffer tile_entries_;
  DeviceBuffer cu_seqlens_q_;
  DeviceBuffer cu_seqlens_kv_;
  ForwardParams params_{};
  unsigned grid_x_ = 0;
};

class CudaEngine final : public Engine {
 public:
  CudaEngine() : driver_(Driver::open()), memory_(driver_), kernels_(driver_) {}

  std::string_view name() const override { return kEngineName; }
  Device device() const override { return Device::kCuda; }
  const DeviceMemory* memory() const override {
    return driver_->availability() ? &memory_ : nullptr;
  }
  Support available() const override { return driver_->availability(); }

  std::string generated_source(const Problem& problem) const override {
    Lowering lowering;
    const Support support = lower_problem(problem, lowering);
    if (!support) return fmt::format("// cuda: not supported: {}\n", support.reason());
    return lowering.source;
  }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    Lowering lowering;
    result.support = lower_problem(problem, lowering);
    if (!result.support || stage == Stage::kCheck) return result;

    const int shared_limit = driver_->max_shared_memory_per_block();
    if (lowering.choice.shared_bytes > shared_limit) {
      result.support = Support::no(fmt::format(
          "the kernel needs {} bytes of shared memory; {} allows {}",
          lowering.choice.shared_bytes, driver_->device_name(), shared_limit));
      return result;
    }
    const TileList tiles =
        classify_tiles(problem, lowering.choice.class_block_q, lowering.choice.block_n);
    KernelLookup kernel = kernels_.get(lowering.source, lowering.choice.shared_bytes);

    PlanInfo info;
    info.engine = std::string(kEngineName);
    info.description = fmt::format(
        "{}; {} of {} kv tiles visited ({} with the mask evaluated); kernel {} on {} (sm_{}), "
        "{} in {:.3f} s",
        lowering.choice.describe(), tiles.tiles - tiles.skipped, tiles.tiles, tiles.mixed,
        kernel.key.substr(0, 16), driver_->device_name(), driver_->compute_capability(),
        kernel.origin, kernel.seconds);
    info.lowered_hash = modifier_hash(problem.score_mod(), problem.mask_mod(), problem.scale());
    info.signature = problem.signature();
    result.plan = std::make_unique<CudaForwardPlan>(std::move(info), problem, driver_, lowering,
                                                    std::move(kernel), tiles);
    return result;
  }

 private:
  std::shared_ptr<const Driver> driver_;
  DriverMemory memory_;
  mutable KernelCache kernels_;
};

}  // namespace
}  // namespace cuda

std::shared_ptr<const Engine> make_cuda_engine() {
  return std::make_shared<cuda::CudaEngine>();
}

}  // namespace flexattn
