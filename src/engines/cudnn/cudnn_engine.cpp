#include "engines/cudnn/cudnn_engine.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>

#include "engines/cuda/driver.hpp"
#include "engines/cuda/repair.hpp"
#include "engines/cudnn/backend.hpp"
#include "engines/cudnn/guards.hpp"
#include "engines/cudnn/library.hpp"
#include "engines/cudnn/planner.hpp"
#include "engines/cudnn/proof.hpp"
#include "engines/cudnn/readback.hpp"
#include "engines/cudnn/sdpa_graph.hpp"
#include "flexattn/error.hpp"

namespace flexattn {
namespace cudnn {
namespace {

constexpr std::string_view kEngineName = "cudnn";
// cuDNN was told every tensor is 16-byte aligned (backend.cpp); run() holds callers to it.
constexpr std::uintptr_t kPointerAlignment = 16;
// The engine's scratch tensors follow cuDNN's workspace at this alignment.
constexpr std::size_t kScratchAlignment = 256;

std::size_t align_up(std::size_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

// The cuDNN library, the CUDA device and the one cuDNN handle the engine's plans share.
class Runtime {
 public:
  Runtime() : library_(Library::open()), driver_(cuda::Driver::open()), memory_(driver_) {}
  ~Runtime() {
    if (handle_ == nullptr) return;
    // cudnnDestroy needs the context the handle was created in; a destructor cannot throw, so
    // the driver calls are made directly.
    CUcontext popped = nullptr;
    if (driver_->api().context_push(driver_->context()) == CUDA_SUCCESS) {
      library_->api().destroy(handle_);
      driver_->api().context_pop(&popped);
    }
  }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Support availability() const {
    if (!library_->availability()) return library_->availability();
    if (!driver_->availability()) return driver_->availability();
    return Support::yes();
  }
  const std::shared_ptr<const Library>& library() const { return library_; }
  const std::shared_ptr<const cuda::Driver>& driver() const { return driver_; }
  const DeviceMemory* memory() const { return &memory_; }

  // Created on first use, in the device's primary context.
  cudnnHandle_t handle() const {
    std::lock_guard lock(mutex_);
    if (handle_ == nullptr) {
      cuda::ContextScope scope(*driver_);
      library_->check(library_->api().create(&handle_), "cudnnCreate");
    }
    return handle_;
  }

  // One cuDNN handle serves every plan: executions are serialized on the host.
  std::mutex& execution_mutex() const { return execution_mutex_; }

 private:
  std::shared_ptr<const Library> library_;
  std::shared_ptr<const cuda::Driver> driver_;
  cuda::DriverMemory memory_;
  mutable std::mutex mutex_;
  mutable std::mutex execution_mutex_;
  mutable cudnnHandle_t handle_ = nullptr;
};

// What the variant pack binds to the uids no operation computes.
BoundValues bound_values(const SdpaGraph& graph) {
  BoundValues bound;
  for (const Binding& binding : graph.bindings) {
    if (binding.kind == Binding::Kind::kHost) bound.host.emplace(binding.uid, binding.host);
    if (binding.kind == Binding::Kind::kTensor) bound.tensors.emplace(binding.uid, binding.tensor);
  }
  return bound;
}

// The modifiers `graph` computes, read back from its descriptors; `counts` says where the values
// came from.
ReadBackModifiers read_back(const SdpaGraph& graph, GraphKind kind, std::string& counts) {
  const GraphRecord record = read_graph(*graph.builder);
  counts = fmt::format("{} values answered by cuDNN, {} taken as cuDNN accepted them",
                       record.answered, record.as_accepted);
  return rebuild_modifiers(record, bound_values(graph), kind);
}

// An operation graph with the plan chosen for it.
struct CompiledGraph {
  SdpaGraph graph;
  Descriptor operation_graph;
  FinalizedPlan plan;
};

std::string describe(const CompiledGraph& compiled, std::size_t candidates) {
  return fmt::format("{}; cuDNN engine {} ({}; candidate {} of {}), workspace {} B",
                     compiled.graph.summary, compiled.plan.choice.tag(), compiled.plan.readback,
                     compiled.plan.rank + 1, candidates, compiled.plan.workspace_bytes);
}

class CudnnPlan final : public Plan {
 public:
  CudnnPlan(PlanInfo info, const Problem& problem, std::shared_ptr<const Runtime> runtime,
            CompiledGraph forward, std::optional<CompiledGraph> backward,
            std::unique_ptr<const cuda::NonFiniteRepair> repair)
      : Plan(std::move(info)),
        problem_(problem),
        runtime_(std::move(runtime)),
        forward_(std::move(forward)),
        backward_(std::move(backward)),
        repair_(std::move(repair)) {}

  const Problem& problem() const override { return problem_; }

  // cuDNN's workspace for the engine config, then the graph's own scratch tensors.
  // The backward's ends with the non-finite repair's scratch.
  std::size_t workspace_bytes(Pass pass) const override {
    if (pass == Pass::kForward) return footprint(forward_);
    return backward_ ? backward_footprint() : 0;
  }

 protected:
  // After cuDNN's graph, the rows it left NaN or inf are computed again (repair.hpp): a removed
  // position's weight 0 times a NaN or inf operand makes them NaN where the reference is finite.
  void run_forward(const ForwardArgs& args) const override {
    // The LSE (cuDNN's Stats): the caller's, else the graph's scratch copy.
    const auto stats = [&](std::byte* scratch) -> void* {
      return args.lse.empty() ? scratch + forward_.graph.stats_scratch_offset : args.lse.data;
    };
    const auto repair = [&](std::byte* /*base*/, std::byte* scratch) {
      repair_->forward(args, stats(scratch));
    };
    execute(forward_, footprint(forward_), args, repair,
            [&](const Binding& binding, std::byte* scratch) -> void* {
              switch (binding.kind) {
                case Binding::Kind::kQ:
                  return args.q.data;
                case Binding::Kind::kK:
                  return args.k.data;
                case Binding::Kind::kV:
                  return args.v.data;
                case Binding::Kind::kO:
                  return args.out.data;
                case Binding::Kind::kStats:
                  return stats(scratch);
                case Binding::Kind::kTensor:
                  return args.tensors.at(binding.tensor).data;
                case Binding::Kind::kHost:
                  return binding.host;
                case Binding::Kind::kScratch:
                  return scratch + binding.offset;
                case Binding::Kind::kDOut:
                case Binding::Kind::kDQ:
                case Binding::Kind::kDK:
                case Binding::Kind::kDV:
                  break;
              }
              throw_internal("cudnn: a backward tensor in the forward graph");
            });
  }

  void run_backward(const BackwardArgs& args) const override {
    if (!backward_) {
      throw_invalid("cudnn: this plan was built for the forward pass only");
    }
    const auto repair = [&](std::byte* base, std::byte* /*scratch*/) {
      repair_->backward(args, base + align_up(footprint(*backward_)));
    };
    execute(*backward_, backward_footprint(), args, repair,
            [&](const Binding& binding, std::byte* scratch) -> void* {
              switch (binding.kind) {
                case Binding::Kind::kQ:
                  return args.q.data;
                case Binding::Kind::kK:
                  return args.k.data;
                case Binding::Kind::kV:
                  return args.v.data;
                case Binding::Kind::kO:
                  return args.out.data;
                case Binding::Kind::kStats:
                  return args.lse.data;
                case Binding::Kind::kDOut:
                  return args.dout.data;
                case Binding::Kind::kDQ:
                  return args.dq.data;
                case Binding::Kind::kDK:
                  return args.dk.data;
                case Binding::Kind::kDV:
                  return args.dv.data;
                case Binding::Kind::kTensor:
                  return args.tensors.at(binding.tensor).data;
                case Binding::Kind::kHost:
                  return binding.host;
                case Binding::Kind::kScratch:
                  return scratch + binding.offset;
              }
              throw_internal("cudnn: unknown binding");
            });
  }

 private:
  static std::size_t footprint(const CompiledGraph& compiled) {
    return align_up(static_cast<std::size_t>(compiled.plan.workspace_bytes)) +
           compiled.graph.scratch_bytes;
  }
  std::size_t backward_footprint() const {
    return align_up(footprint(*backward_)) + repair_->backward_scratch_bytes();
  }

  // The memory the plan keeps for calls that bring none (made on the first such call).
  CUdeviceptr own_workspace() const {
    const std::lock_guard lock(workspace_mutex_);
    if (workspace_.address() == 0) {
      std::size_t bytes = footprint(forward_);
      if (backward_) bytes = std::max(bytes, backward_footprint());
      workspace_ = cuda::DeviceBuffer(runtime_->driver(), bytes);
    }
    return workspace_.address();
  }

  // `args`: ForwardArgs or BackwardArgs (their stream, workspace and allocator); `bytes`: the
  // pass's workspace; `after(base, scratch)` runs once the graph is enqueued (the repair), with
  // the workspace at `base` and the graph's scratch tensors at `scratch`.
  template <class Args, class After, class PointerOf>
  void execute(const CompiledGraph& compiled, std::size_t bytes, const Args& args, After after,
               PointerOf pointer_of) const {
    const Library& library = *runtime_->library();
    void* const stream = args.stream;
    const bool own = bytes > 0 && args.workspace.data == nullptr && args.allocator == nullptr;
    const CUdeviceptr fallback = own ? own_workspace() : 0;
    cuda::ContextScope memory_scope(*runtime_->driver());
    cuda::CallScratch memory(*runtime_->driver(), args.workspace, args.allocator, bytes,
                             static_cast<CUstream>(stream), fallback);
    auto* base = reinterpret_cast<std::byte*>(memory.address());
    std::byte* scratch = base + align_up(static_cast<std::size_t>(compiled.plan.workspace_bytes));
    std::vector<std::int64_t> uids;
    std::vector<void*> pointers;
    for (const Binding& binding : compiled.graph.bindings) {
      void* pointer = pointer_of(binding, scratch);
      if (binding.kind != Binding::Kind::kHost &&
          reinterpret_cast<std::uintptr_t>(pointer) % kPointerAlignment != 0) {
        throw_invalid(fmt::format("cudnn: tensor uid {} ({}) at {} is not 16-byte aligned",
                                  binding.uid, binding.tensor.empty() ? "argument" : binding.tensor,
                                  pointer));
      }
      uids.push_back(binding.uid);
      pointers.push_back(pointer);
    }
    void* workspace = compiled.plan.workspace_bytes > 0 ? base : nullptr;
    Descriptor pack(runtime_->library(), CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
             static_cast<std::int64_t>(uids.size()), uids.data(), "VARIANT_PACK_UNIQUE_IDS");
    pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
             static_cast<std::int64_t>(pointers.size()), pointers.data(),
             "VARIANT_PACK_DATA_POINTERS");
    pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace,
             "VARIANT_PACK_WORKSPACE");
    pack.finalize();
    const cudnnHandle_t handle = runtime_->handle();
    std::lock_guard lock(runtime_->execution_mutex());
    cuda::ContextScope scope(*runtime_->driver());
    library.check(library.api().set_stream(handle, static_cast<cudaStream_t>(stream)),
                  "cudnnSetStream");
    library.check(library.api().execute(handle, compiled.plan.plan.get(), pack.get()),
                  "cudnnBackendExecute");
    after(base, scratch);
    memory.release();
  }

  Problem problem_;
  std::shared_ptr<const Runtime> runtime_;
  CompiledGraph forward_;
  std::optional<CompiledGraph> backward_;
  std::unique_ptr<const cuda::NonFiniteRepair> repair_;
  mutable std::mutex workspace_mutex_;
  mutable cuda::DeviceBuffer workspace_;
};

// The graphs of a problem up to the screened engine candidates: what supports() builds.
struct Prepared {
  SdpaGraph graph;
  std::optional<ReadBackModifiers> modifiers;  // read back from the graph's descriptors
  std::string readback_counts;
  std::optional<Descriptor> operation_graph;
  std::vector<Candidate> candidates;
  std::size_t offered = 0;
};

class CudnnEngine final : public Engine {
 public:
  explicit CudnnEngine(CudnnOptions options) : runtime_(std::make_shared<Runtime>()) {
    policy_.exclusions.patterns = std::move(options.exclude);
    for (std::string& pattern : ExclusionList::from_environment()) {
      policy_.exclusions.patterns.push_back(std::move(pattern));
    }
    policy_.allow_unverified = options.allow_unverified_engines;
    policy_.release = runtime_->library()->version();
    policy_.release_text = runtime_->library()->version_text();
    if (runtime_->availability()) {
      policy_.compute_capability = runtime_->driver()->compute_capability();
    }
  }

  std::string_view name() const override { return kEngineName; }
  Device device() const override { return Device::kCuda; }
  const DeviceMemory* memory() const override {
    return runtime_->availability() ? runtime_->memory() : nullptr;
  }
  Support available() const override { return runtime_->availability(); }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered lowered;
    const cuda::Driver& driver = *runtime_->driver();
    if (Support s = check_constraints(problem, driver.compute_capability()); !s) {
      lowered.support = s;
      return lowered;
    }
    ModifierLowering modifiers;
    if (Support s = lower_modifiers(problem, modifiers); !s) {
      lowered.support = s;
      return lowered;
    }
    const Library& library = *runtime_->library();
    if (Support s = check_release(library.version(), library.version_text(), problem,
                                  modifiers.has_score_mod || modifiers.has_mask);
        !s) {
      lowered.support = s;
      return lowered;
    }
    Prepared forward, backward;
    if (Support s = prepare(problem, modifiers, GraphKind::kForward, forward); !s) {
      lowered.support = s;
      return lowered;
    }
    if (problem.wants_backward()) {
      if (Support s = prepare(problem, modifiers, GraphKind::kBackward, backward); !s) {
        lowered.support = s;
        return lowered;
      }
    }
    Proof proof;
    try {
      proof = prove(*forward.modifiers, backward.modifiers, problem);
    } catch (const std::exception& error) {
      proof.holds = false;
      proof.mismatch = error.what();
    }
    if (!proof.holds) {
      lowered.support =
          Support::no(fmt::format("cudnn: the plan proof failed: {}", proof.mismatch));
      return lowered;
    }
    // cuDNN's products, like the tensor-core kernels', multiply a removed position's weight 0 by
    // its operand; the cuda engine's row kernels recompute the rows that makes NaN (repair.hpp).
    // Without them the plan would not compute the reference's non-finite semantics.
    cuda::RepairLowering repair =
        cuda::make_non_finite_repair(problem, runtime_->driver(), stage != Stage::kCheck);
    if (!repair.support) {
      lowered.support = Support::no(fmt::format("cudnn: {}", repair.support.reason()));
      return lowered;
    }
    if (stage == Stage::kCheck) {
      lowered.support = Support::yes();
      return lowered;
    }

    std::optional<CompiledGraph> compiled_forward, compiled_backward;
    if (Support s = compile(forward, GraphKind::kForward, compiled_forward); !s) {
      lowered.support = s;
      return lowered;
    }
    std::string description =
        fmt::format("cuDNN {} on {} (sm_{}): {}", library.version_text(), driver.device_name(),
                    driver.compute_capability(), describe(*compiled_forward, forward.offered));
    if (problem.wants_backward()) {
      if (Support s = compile(backward, GraphKind::kBackward, compiled_backward); !s) {
        lowered.support = s;
        return lowered;
      }
      description += fmt::format("; {}", describe(*compiled_backward, backward.offered));
    }
    PlanInfo info;
    info.engine = std::string(kEngineName);
    info.description = std::move(description);
    // The proof: the modifiers read back from the operation graphs this plan runs equal the
    // request as cuDNN can hold it (proof.hpp).
    info.lowered_hash = proof.lowered_hash;
    info.lowered_backward_hash = proof.lowered_backward_hash;
    info.description += fmt::format("; plan proof: {} (forward: {})",
                                    forward.modifiers->to_string(), forward.readback_counts);
    info.description += "; " + repair.repair->describe();
    info.signature = problem.signature();
    lowered.plan = std::make_unique<CudnnPlan>(
        std::move(info), problem, runtime_, std::move(*compiled_forward),
        std::move(compiled_backward), std::move(repair.repair));
    lowered.support = Support::yes();
    return lowered;
  }

 private:
  // Builds the operation graph and screens the heuristics' engines. A graph cuDNN rejects, or
  // one no allowed engine takes, makes the answer "no" with cuDNN's reason.
  Support prepare(const Problem& problem, const ModifierLowering& modifiers, GraphKind kind,
                  Prepared& prepared) const {
    const std::shared_ptr<const Library>& library = runtime_->library();
    std::vector<Candidate> candidates;
    try {
      prepared.graph = kind == GraphKind::kForward
                           ? build_forward_graph(library, problem, modifiers)
                           : build_backward_graph(library, problem, modifiers);
      // A read-back that cannot finish proves nothing: the plan is refused, never thrown out of.
      try {
        prepared.modifiers = read_back(prepared.graph, kind, prepared.readback_counts);
      } catch (const std::exception& error) {
        return Support::no(
            fmt::format("cudnn: the plan proof failed: the lowered {} graph could "
                        "not be read back: {}",
                        to_string(kind), error.what()));
      }
      cuda::ContextScope scope(*runtime_->driver());
      prepared.operation_graph = prepared.graph.builder->build(runtime_->handle());
      candidates = engine_candidates(library, *prepared.operation_graph);
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kCudnn) throw;
      return Support::no(
          fmt::format("cuDNN rejected the lowered {} graph: {}", to_string(kind), error.what()));
    }
    prepared.offered = candidates.size();
    if (candidates.empty()) {
      return Support::no(fmt::format("cuDNN {} has no engine for the lowered {} graph ({})",
                                     library->version_text(), to_string(kind),
                                     prepared.graph.summary));
    }
    std::vector<std::string> rejected;
    prepared.candidates = screen(std::move(candidates), kind, policy_, rejected);
    if (prepared.candidates.empty()) {
      return Support::no(fmt::format("no allowed cuDNN engine for the {} graph: {}",
                                     to_string(kind), fmt::join(rejected, "; ")));
    }
    return Support::yes();
  }

  Support compile(Prepared& prepared, GraphKind kind,
                  std::optional<CompiledGraph>& compiled) const {
    std::vector<std::string> declined;
    std::optional<FinalizedPlan> plan;
    {
      cuda::ContextScope scope(*runtime_->driver());
      plan = finalize_plan(runtime_->library(), runtime_->handle(), prepared.candidates, kind,
                           policy_, declined);
    }
    if (!plan) {
      return Support::no(fmt::format("every cuDNN engine declined the {} graph: {}",
                                     to_string(kind), fmt::join(declined, "; ")));
    }
    compiled.emplace(CompiledGraph{std::move(prepared.graph), std::move(*prepared.operation_graph),
                                   std::move(*plan)});
    return Support::yes();
  }

  std::shared_ptr<const Runtime> runtime_;
  ScreeningPolicy policy_;
};

}  // namespace
}  // namespace cudnn

std::shared_ptr<const Engine> make_cudnn_engine(CudnnOptions options) {
  return std::make_shared<cudnn::CudnnEngine>(std::move(options));
}

namespace {

// The H200 of the benchmarks; the constraints depend on the architecture.
constexpr int kAssumedCapability = 90;

Support check_lowering(const Problem& problem, cudnn::ModifierLowering& modifiers) {
  if (Support s = cudnn::check_constraints(problem, kAssumedCapability); !s) return s;
  return cudnn::lower_modifiers(problem, modifiers);
}

}  // namespace

Support check_cudnn_lowering(const Problem& problem) {
  cudnn::ModifierLowering modifiers;
  return check_lowering(problem, modifiers);
}

Support check_cudnn_graphs_without_device(const Problem& problem, std::string& summary) {
  using namespace cudnn;
  const std::shared_ptr<const Library> library = Library::open();
  if (!library->availability()) return library->availability();
  ModifierLowering modifiers;
  if (Support s = check_lowering(problem, modifiers); !s) return s;
  try {
    summary = build_forward_graph(library, problem, modifiers).summary;
    if (problem.wants_backward()) {
      summary += "; " + build_backward_graph(library, problem, modifiers).summary;
    }
  } catch (const Error& error) {
    if (error.code() != ErrorCode::kCudnn) throw;
    return Support::no(fmt::format("cuDNN rejected a descriptor: {}", error.what()));
  }
  return Support::yes();
}

CudnnGraphProof prove_cudnn_graphs_without_device(const Problem& problem,
                                                  CudnnLoweringFault fault) {
  using namespace cudnn;
  CudnnGraphProof result;
  const std::shared_ptr<const Library> library = Library::open();
  if (!library->availability()) {
    result.proof = library->availability();
    return result;
  }
  // The forward part of the lowering, then the derivative as lower_modifiers plans it, also for
  // the backward classes the engine refuses (their graphs are still proven).
  ProblemDesc forward_desc = problem.desc();
  forward_desc.direction = Direction::kForward;
  ModifierLowering modifiers;
  if (Support s = check_lowering(Problem(forward_desc), modifiers); !s) {
    result.proof = s;
    return result;
  }
  if (problem.wants_backward()) {
    const Graph derivative = derivative_wrt_score(problem.score_mod());
    if (Support s = plan_lowering(derivative, problem, modifiers.derivative); !s) {
      result.proof = s;
      return result;
    }
    modifiers.has_derivative =
        !modifiers.derivative.root_is_constant() ||
        modifiers.derivative.nodes[static_cast<std::size_t>(derivative.root())].constant != 1.0;
  }
  std::string counts;
  const SdpaGraph forward = build_forward_graph(library, problem, modifiers, fault);
  const ReadBackModifiers forward_read = read_back(forward, GraphKind::kForward, counts);
  result.fault_applied = forward.fault_applied;
  result.read_back = forward_read.to_string();
  std::optional<ReadBackModifiers> backward_read;
  if (problem.wants_backward()) {
    const SdpaGraph backward = build_backward_graph(library, problem, modifiers, fault);
    backward_read = read_back(backward, GraphKind::kBackward, counts);
    result.fault_applied = result.fault_applied || backward.fault_applied;
    result.read_back += "; backward: " + backward_read->to_string();
  }
  result.read_back += "; " + counts;
  const Proof proof = prove(forward_read, backward_read, problem);
  result.proof = proof.holds ? Support::yes() : Support::no(proof.mismatch);
  return result;
}

}  // namespace flexattn
