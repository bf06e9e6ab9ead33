#include "engines/cuda/cuda_engine.hpp"

#include <fmt/format.h>

#include <bit>
#include <chrono>
#include <cstdlib>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "engines/cuda/codegen.hpp"
#include "engines/cuda/driver.hpp"
#include "engines/cuda/graph_lowering.hpp"
#include "engines/cuda/kernel_cache.hpp"
#include "engines/cuda/kernels/params.cuh"
#include "engines/cuda/launch_support.hpp"
#include "engines/cuda/repair.hpp"
#include "engines/cuda/source_proof.hpp"
#include "engines/cuda/tile_plan.hpp"
#include "flexattn/error.hpp"

namespace flexattn {
namespace cuda {
namespace {

using flexattn_kernels::BackwardParams;
using flexattn_kernels::DecodeParams;
using flexattn_kernels::FinalizeParams;
using flexattn_kernels::ForwardParams;
using flexattn_kernels::SequenceView;

constexpr std::string_view kEngineName = "cuda";
// Grid limit of x (query blocks); y and z: kMaxGridYZ (launch_support.hpp).
constexpr std::int64_t kMaxGridX = std::numeric_limits<int>::max();
// cp.async reads 16-byte chunks of the tensor-core kernels' rows.
constexpr std::uintptr_t kChunkAlignment = 16;

// What lowering a problem produces: supports() stops after it, plan() builds on it.
struct Lowering {
  KernelChoice choice;
  ModifierBindings bindings;
  std::optional<BackwardCode> backward;  // when the problem wants gradients
  std::string source;                    // the translation unit NVRTC compiles
  // With a staged tensor (KernelChoice::stage_tensor): the same kernels without staging, which
  // the plan compiles and runs the first time that tensor is not 16-byte aligned.
  std::optional<KernelChoice> unstaged_choice;
  std::string unstaged_source;
};

// Whether the wgmma kernels (forward and backward) may be chosen on sm_90: FLEXATTN_CUDA_WGMMA=0
// keeps the mma.sync kernels (comparisons, and a way around a wgmma problem without a rebuild).
// A plan setting (CudaEngine::plan_settings).
bool wgmma_allowed() {
  const char* value = std::getenv("FLEXATTN_CUDA_WGMMA");
  return value == nullptr || std::string_view(value) != "0";
}

// The grid's y (heads) and z (batch) limits, and token indices within int.
Support lower_backward(const Problem& problem, Lowering& lowering, int capability) {
  const BackwardSelection selection = choose_backward_kernel(problem, capability, wgmma_allowed());
  if (!selection.reason.empty()) return Support::no(selection.reason);
  try {
    lowering.backward = backward_code(problem, selection.choice);
  } catch (const Error& error) {
    return Support::no(fmt::format("cannot differentiate the score modifier: {}", error.what()));
  }
  // The finalize kernel converts one tensor gradient per launch, in a one-dimensional grid.
  for (const std::string& name : lowering.bindings.tensors) {
    std::int64_t elements = 1;
    for (std::int64_t extent : problem.desc().tensors.at(name).shape) elements *= extent;
    if (ceil_div(elements, flexattn_kernels::kFinalizeThreads) > kMaxGridX) {
      return Support::no(fmt::format("tensor {} has too many elements for a gradient", name));
    }
  }
  return Support::yes();
}

// `capability`: the device's compute capability, 0 without a device (the portable kernels).
Support lower_problem(const Problem& problem, Lowering& lowering, int capability) {
  KernelSelection selection = choose_kernel(problem, capability, wgmma_allowed());
  if (!selection.reason.empty()) return Support::no(selection.reason);
  // A dense bias-like tensor travels through shared memory (stage_wgmma_tensor) where it can: a
  // [.., q, kv] bf16 bias at head dim 128 measured 215 -> 360 TFLOP/s (H200). Where the stages do
  // not fit, the kernel reads the tensor from global memory.
  std::optional<KernelChoice> unstaged;
  if (selection.choice.kind != KernelKind::kDecode && !stageable_tensor(problem).empty()) {
    KernelChoice staged = selection.choice;
    if (stage_wgmma_tensor(staged).empty() && staged.stage_tensor) {
      // The unstaged fallback walks the same tile list: the default shape where the tiles agree
      // (head dim 128), else the staged shape without its tile (head dim 64's 64-key tiles).
      unstaged = selection.choice.block_n == staged.block_n ? selection.choice
                                                            : without_staged_tensor(staged);
      selection.choice = staged;
    }
  }
  // The pipelined wgmma forward's warpgroups take turns issuing their products
  // (WgmmaConfig::kTakeTurns): measured faster on every head-dim-128 row (no modifier +8%, softcap
  // +4%; docs/measurements/2026-12-02-wgmma-backward.md). Turns need the pipelined loop and two
  // warpgroups.
  selection.choice.take_turns = selection.choice.turns_possible();
  if (unstaged) {
    unstaged->take_turns = unstaged->turns_possible();
    // Both run on the same tile list and grid.
    if (unstaged->block_m != selection.choice.block_m ||
        unstaged->block_n != selection.choice.block_n ||
        unstaged->class_block_q != selection.choice.class_block_q) {
      throw_internal("cuda: the staged and unstaged forward kernels tile differently");
    }
  }
  const BindingSelection binding = bind_modifier(problem);
  if (!binding.reason.empty()) return Support::no(binding.reason);
  if (Support limits = launch_limits(problem); !limits) return limits;
  lowering.choice = selection.choice;
  lowering.bindings = binding.bindings;
  if (problem.wants_backward()) {
    const Support backward = lower_backward(problem, lowering, capability);
    if (!backward) return backward;
  }
  // Every IR op has a lowering (codegen.cpp switches over Op without a default), so generating
  // the code is the last step of deciding support.
  lowering.source = generate_translation_unit(problem, lowering.bindings, lowering.choice,
                                              lowering.backward ? &*lowering.backward : nullptr);
  if (unstaged) {
    lowering.unstaged_source = generate_translation_unit(
        problem, lowering.bindings, *unstaged, lowering.backward ? &*lowering.backward : nullptr);
    lowering.unstaged_choice = unstaged;
  }
  return Support::yes();
}

// The plan proof of every source the plan can compile: the forward with its staged tensor and,
// where there is one, its unstaged fallback.
SourceProof prove_lowering(const Problem& problem, const Lowering& lowering) {
  SourceProof proof = prove_modifier_source(problem, lowering.bindings, lowering.source);
  if (proof.proven && lowering.unstaged_choice) {
    proof = prove_modifier_source(problem, lowering.bindings, lowering.unstaged_source);
    if (!proof.proven) proof.failure = "the unstaged forward: " + proof.failure;
  }
  return proof;
}

// The architecture suffix the module needs ("a": sm_90a) when any of its kernels uses wgmma.
std::string architecture_suffix(const Lowering& lowering) {
  if (!lowering.choice.architecture_suffix().empty()) return lowering.choice.architecture_suffix();
  return lowering.backward ? lowering.backward->choice.architecture_suffix() : std::string();
}

// The forward's module: its kernel (with a decode, the split combination too), with the dynamic
// shared memory it is launched with. `forward`: lowering.choice, or its unstaged_choice.
std::vector<KernelFunction> forward_functions(const KernelChoice& forward) {
  if (forward.kind == KernelKind::kDecode) {
    return {{std::string(kKernelName), forward.shared_bytes, true},
            {std::string(kDecodeCombineName), 0}};
  }
  return {{std::string(kKernelName), forward.shared_bytes,
           forward.kind == KernelKind::kWgmma && forward.min_blocks > 1}};
}

// The backward's module (when gradients are wanted): its four kernels.
std::vector<KernelFunction> backward_functions(const BackwardChoice& backward) {
  return {{std::string(kBackwardDeltaName), 0},
          {std::string(kBackwardDkdvName), backward.dkdv_shared_bytes()},
          {std::string(kBackwardDqName), backward.dq_shared_bytes()},
          {std::string(kBackwardFinalizeName), 0}};
}

// A plan's compiled modules: the forward's, and the backward's when gradients are wanted
// (compiled at the same time, each from the one source with its module's define).
struct PlanKernels {
  KernelLookup forward;
  std::optional<KernelLookup> backward;
  std::string origin;    // both modules' origins, once when they agree
  double seconds = 0.0;  // to obtain both
  std::string keys() const {
    return backward ? fmt::format("{} + {}", forward.key.substr(0, 16), backward->key.substr(0, 16))
                    : forward.key.substr(0, 16);
  }
};

// The tensor-core kernels copy 16-byte chunks: each argument must start on one.
void check_chunk_aligned(std::string_view name, const void* data) {
  if (reinterpret_cast<std::uintptr_t>(data) % kChunkAlignment != 0) {
    throw_invalid(fmt::format(
        "cuda: argument {} ({}) is not 16-byte aligned; the tensor-core kernels copy 16-byte "
        "chunks",
        name, data));
  }
}

// A stream a plan owns (the backward's second stream), created on its first use and destroyed
// with the plan (work still queued on it completes first; cuStreamDestroy does not wait).
class PlanStream {
 public:
  explicit PlanStream(std::shared_ptr<const Driver> driver) : driver_(std::move(driver)) {}
  ~PlanStream() {
    if (stream_ == nullptr) return;
    CUcontext popped = nullptr;
    if (driver_->api().context_push(driver_->context()) == CUDA_SUCCESS) {
      driver_->api().stream_destroy(stream_);
      driver_->api().context_pop(&popped);
    }
  }
  PlanStream(const PlanStream&) = delete;
  PlanStream& operator=(const PlanStream&) = delete;

  // With the plan's context current.
  CUstream get() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (stream_ == nullptr) {
      driver_->check(driver_->api().stream_create(&stream_, CU_STREAM_NON_BLOCKING),
                     "cuStreamCreate");
    }
    return stream_;
  }

 private:
  std::shared_ptr<const Driver> driver_;
  mutable std::mutex mutex_;
  mutable CUstream stream_ = nullptr;
};

// Work forked from `main` onto `side` for one scope: `side` starts after the work `main` holds
// when the fork is made, and `main` waits for `side` when it ends, so whatever `main` does
// afterwards (the finalize kernels, freeing the stream-ordered scratch) follows the side work.
// Both waits are stream-ordered (events), so the host does not block; by CUDA's rules a
// captured `main` (CUDA graphs) takes `side` into its capture and back (not tested here). Calls
// from several host threads may share `side`: each waits for its own event.
class StreamFork {
 public:
  StreamFork(const Driver& driver, CUstream main, CUstream side)
      : driver_(driver), main_(main), side_(side) {
    driver_.check(order(main_, side_), "cuEventRecord / cuStreamWaitEvent");
  }
  ~StreamFork() {
    if (order(side_, main_) != CUDA_SUCCESS) driver_.api().context_synchronize();  // the slow way
  }
  StreamFork(const StreamFork&) = delete;
  StreamFork& operator=(const StreamFork&) = delete;

 private:
  // `later` waits for the work `earlier` holds now.
  CUresult order(CUstream earlier, CUstream later) const {
    const DriverFunctions& f = driver_.api();
    CUevent event = nullptr;
    CUresult result = f.event_create(&event, CU_EVENT_DISABLE_TIMING);
    if (result == CUDA_SUCCESS) result = f.event_record(event, earlier);
    if (result == CUDA_SUCCESS) result = f.stream_wait_event(later, event, 0);
    if (event != nullptr) f.event_destroy(event);  // released once it has completed
    return result;
  }

  const Driver& driver_;
  CUstream main_;
  CUstream side_;
};

// How a paged-cache plan splits each sequence's keys (DecodeParams::splits): enough blocks for
// kDecodeWaves blocks per multiprocessor where batch x kv heads x row blocks gives fewer, each
// split at least kDecodeMinSplitKeys keys (two 32-key chunks for each of the block's 4 warps) and
// a whole number of chunks.
constexpr std::int64_t kDecodeWaves = 4;
constexpr std::int64_t kDecodeMinSplitKeys = 256;
struct DecodeSplits {
  int splits = 1;
  int keys_per_split = 0;
  unsigned row_blocks = 1;
};
DecodeSplits decode_splits(const Problem& problem, const KernelChoice& choice,
                           int multiprocessors) {
  DecodeSplits result;
  if (choice.paged_wgmma) {
    // The wgmma forward: one split, blocks of block_m queries of one query head.
    result.keys_per_split = static_cast<int>(problem.seq_len_kv());
    result.row_blocks = static_cast<unsigned>(ceil_div(problem.seq_len_q(), choice.block_m));
    return result;
  }
  const std::int64_t group = problem.heads_q() / problem.heads_kv();
  result.row_blocks = static_cast<unsigned>(ceil_div(group * problem.seq_len_q(), choice.block_m));
  const std::int64_t blocks = problem.batch() * problem.heads_kv() * result.row_blocks;
  const std::int64_t capacity = problem.seq_len_kv();
  const std::int64_t wanted = ceil_div(kDecodeWaves * std::max(multiprocessors, 1), blocks);
  const std::int64_t most = std::max<std::int64_t>(1, capacity / kDecodeMinSplitKeys);
  const std::int64_t splits = std::clamp<std::int64_t>(wanted, 1, most);
  const std::int64_t keys = ceil_div(ceil_div(capacity, splits), choice.block_n) * choice.block_n;
  result.keys_per_split = static_cast<int>(keys);
  result.splits = static_cast<int>(ceil_div(capacity, keys));
  return result;
}

// What the forward pass of every plan needs, and its grid.
struct ForwardState {
  CUfunction function = nullptr;
  DeviceBuffer tile_offsets;
  DeviceBuffer tile_entries;
  ForwardParams params{};
  unsigned grid_x = 0;
};

// The forward without its staged tensor, for a call whose staged tensor is not 16-byte aligned
// (the staging copies 16-byte chunks): compiled the first time one comes (the kernel cache's
// mutex orders concurrent first calls; both get the same module).
struct UnstagedForward {
  KernelChoice choice;
  std::string source;
  std::vector<KernelFunction> functions;
  std::string suffix;
  std::string_view define;  // kForwardModuleDefine when the source holds a backward
  std::shared_ptr<KernelCache> cache;
  mutable std::mutex mutex;
  mutable std::shared_ptr<const CompiledKernel> kernel;
  mutable CUfunction function = nullptr;

  CUfunction get() const {
    const std::lock_guard<std::mutex> lock(mutex);
    if (function == nullptr) {
      KernelLookup lookup = cache->get(source, functions, suffix, define);
      function = lookup.kernel->function(kKernelName);
      kernel = std::move(lookup.kernel);
    }
    return function;
  }
};

// A paged-cache plan's kernels and launch: the decode kernel over (splits x row blocks, kv heads,
// batch), then, with several splits, the combine kernel; its partial results take the forward's
// workspace.
struct DecodeState {
  CUfunction combine = nullptr;
  DecodeParams params{};
  DecodeSplits splits;
  std::size_t partial_o_bytes = 0;
  std::size_t partial_lse_bytes = 0;
  std::size_t workspace_bytes() const {
    return splits.splits > 1 ? align_scratch(partial_o_bytes) + align_scratch(partial_lse_bytes)
                             : 0;
  }
};

// What the backward pass needs: its own tile lists (query-major for the dQ kernel, kv-major for
// the dK/dV kernel, for its block sizes) and the four kernels.
struct BackwardState {
  BackwardChoice choice;
  CUfunction delta = nullptr;
  CUfunction dkdv = nullptr;
  CUfunction dq = nullptr;
  CUfunction finalize = nullptr;
  DeviceBuffer tile_offsets;
  DeviceBuffer tile_entries;
  DeviceBuffer kv_tile_offsets;
  DeviceBuffer kv_tile_entries;
  BackwardParams params{};
  std::size_t delta_floats = 0;  // one per (b, h, query), like the LSE
  // The dQ kernel's stream: a second stream beside the dK/dV kernel's, so the dQ blocks fill the
  // multiprocessors the dK/dV kernel's last partial wave leaves idle. Forward and backward, bf16,
  // head dim 128 (H200, docs/measurements/2026-12-03-second-stream-fixed-reference.md): softcap
  // 313.0 -> 316.5 TFLOP/s, no modifier 383.1 -> 392.1, causal softcap 276.4 -> 284.1, causal
  // 356.7 -> 368.6.
  std::unique_ptr<PlanStream> side_stream;
};

class CudaPlan final : public Plan {
 public:
  CudaPlan(PlanInfo info, const Problem& problem, std::shared_ptr<const Driver> driver,
           const Lowering& lowering, PlanKernels kernels, const TileList& tiles,
           const TileList* backward_tiles, const TileList* dkdv_tiles,
           const std::shared_ptr<KernelCache>& cache)
      : Plan(std::move(info)),
        problem_(problem),
        driver_(std::move(driver)),
        choice_(lowering.choice),
        staged_tensor_(lowering.choice.stage_tensor ? stageable_tensor(problem) : std::string()),
        bindings_(lowering.bindings),
        kernel_(std::move(kernels.forward.kernel)),
        backward_kernel_(kernels.backward ? std::move(kernels.backward->kernel) : nullptr) {
    const ForwardParams base =
        base_forward_params(problem, bindings_, driver_, cu_seqlens_q_, cu_seqlens_kv_);
    const TensorView lse = problem.expected("lse");

    forward_.function = kernel_->function(kKernelName);
    forward_.tile_offsets = upload_ints(driver_, tiles.offsets);
    forward_.tile_entries = upload_ints(driver_, tiles.entries);
    forward_.params = base;
    forward_.params.tile_offsets = device_ints(forward_.tile_offsets);
    forward_.params.tile_entries = device_ints(forward_.tile_entries);
    forward_.params.class_block_q = tiles.class_block_q;
    // A staged tensor's kernel numbers its blocks batch-fastest (params.cuh), so a bias without
    // a batch index is read from memory once per head: bias at head dim 64 277.5 -> 280.7 TFLOP/s,
    // causal 236.4 -> 245.1; head dim 128 373.0 -> 374.0 (H200,
    // docs/measurements/2026-12-03-head-dim-64-tiles.md).
    forward_.params.batch_fastest = lowering.choice.stage_tensor ? 1 : 0;
    forward_.grid_x = static_cast<unsigned>(ceil_div(problem.seq_len_q(), lowering.choice.block_m));
    if (lowering.choice.kind == KernelKind::kDecode) {
      DecodeState& d = decode_.emplace();
      d.combine = kernel_->function(kDecodeCombineName);
      d.splits = decode_splits(problem, lowering.choice, driver_->multiprocessors());
      DecodeParams& p = d.params;
      p.fwd = forward_.params;
      p.fwd.cu_seqlens_kv = nullptr;
      // The pools (pages, page_size, heads_kv, dim), whatever the queries' layout.
      for (const auto& [which, view] : {std::pair{"k", &p.fwd.k}, std::pair{"v", &p.fwd.v}}) {
        const std::vector<std::int64_t> strides = problem.expected(which).strides;
        *view = SequenceView{nullptr, strides[0], strides[1], strides[2]};
      }
      const KvCacheDesc& pools = *problem.kv_cache();
      p.max_pages = static_cast<int>(pools.max_pages);
      p.page_size = static_cast<int>(pools.page_size);
      const auto page_size = static_cast<std::uint64_t>(pools.page_size);
      p.page_shift = std::has_single_bit(page_size) ? std::countr_zero(page_size) : -1;
      p.pages = static_cast<int>(pools.pages);
      p.splits = d.splits.splits;
      p.keys_per_split = d.splits.keys_per_split;
      p.heads_q = static_cast<int>(problem.heads_q());
      p.tokens_q = static_cast<int>(problem.total_tokens_q());
      const auto rows = static_cast<std::size_t>(d.splits.splits) *
                        static_cast<std::size_t>(problem.heads_q()) *
                        static_cast<std::size_t>(p.tokens_q);
      d.partial_lse_bytes = rows * sizeof(float);
      d.partial_o_bytes = d.partial_lse_bytes * static_cast<std::size_t>(problem.head_dim_v());
    }
    if (lowering.unstaged_choice) {
      unstaged_ = std::make_unique<UnstagedForward>();
      unstaged_->choice = *lowering.unstaged_choice;
      unstaged_->source = lowering.unstaged_source;
      unstaged_->functions = forward_functions(*lowering.unstaged_choice);
      unstaged_->define = lowering.backward ? kForwardModuleDefine : std::string_view();
      unstaged_->suffix = architecture_suffix(lowering);
      unstaged_->cache = cache;
    }

    if (lowering.backward) {
      if (backward_tiles == nullptr) throw_internal("cuda: a backward plan without its tiles");
      BackwardState& b = backward_.emplace();
      b.choice = lowering.backward->choice;
      if (backward_kernel_ == nullptr) throw_internal("cuda: a backward plan without its module");
      b.delta = backward_kernel_->function(kBackwardDeltaName);
      b.dkdv = backward_kernel_->function(kBackwardDkdvName);
      b.dq = backward_kernel_->function(kBackwardDqName);
      b.finalize = backward_kernel_->function(kBackwardFinalizeName);
      // The dK/dV kernel walks the kv-major order of its own tiles (wgmma: 128 keys).
      const KvTileList transposed =
          transpose_tiles(dkdv_tiles != nullptr ? *dkdv_tiles : *backward_tiles);
      b.tile_offsets = upload_ints(driver_, backward_tiles->offsets);
      b.tile_entries = upload_ints(driver_, backward_tiles->entries);
      b.kv_tile_offsets = upload_ints(driver_, transposed.offsets);
      b.kv_tile_entries = upload_ints(driver_, transposed.entries);
      BackwardParams& p = b.params;
      p.fwd = base;
      p.fwd.tile_offsets = device_ints(b.tile_offsets);
      p.fwd.tile_entries = device_ints(b.tile_entries);
      p.fwd.class_block_q = backward_tiles->class_block_q;
      p.dout = sequence_view(problem, "dout");
      p.dq = sequence_view(problem, "dq");
      p.dk = sequence_view(problem, "dk");
      p.dv = sequence_view(problem, "dv");
      p.kv_tile_offsets = device_ints(b.kv_tile_offsets);
      p.kv_tile_entries = device_ints(b.kv_tile_entries);
      b.delta_floats = static_cast<std::size_t>(lse.numel());
      b.side_stream = std::make_unique<PlanStream>(driver_);
    }
  }

  const Problem& problem() const override { return problem_; }

  // The backward's scratch at most: delta and the second LSE, then a fixed-point accumulator for
  // every float tensor the modifier reads (run_backward takes those whose gradient is wanted).
  std::size_t workspace_bytes(Pass pass) const override {
    if (pass == Pass::kForward) return decode_ ? decode_->workspace_bytes() : 0;
    if (!backward_) return 0;
    std::size_t bytes = 2 * align_scratch(backward_->delta_floats * sizeof(float));
    for (const std::string& name : bindings_.tensors) {
      const TensorDecl& decl = problem_.desc().tensors.at(name);
      if (!is_floating(decl.dtype)) continue;
      std::size_t elements = 1;
      for (std::int64_t extent : decl.shape) elements *= static_cast<std::size_t>(extent);
      bytes += align_scratch(elements * sizeof(flexattn_kernels::GradAccumulator));
    }
    return bytes;
  }

 protected:
  void run_forward(const ForwardArgs& args) const override {
    if (decode_) {
      run_decode(args);
      return;
    }
    ForwardParams p = forward_.params;
    bind_views(args, static_cast<float*>(args.lse.data), p);
    if (choice_.kind != KernelKind::kSimt) {
      for (const auto& [name, view] : {std::pair{"q", &args.q}, std::pair{"k", &args.k},
                                       std::pair{"v", &args.v}, std::pair{"out", &args.out}}) {
        check_chunk_aligned(name, view->data);
      }
    }
    bind_tensors(bindings_, args.tensors, p);
    CUfunction function = forward_.function;
    const KernelChoice* choice = &choice_;
    if (unstaged_ &&
        reinterpret_cast<std::uintptr_t>(args.tensors.at(staged_tensor_).data) % kChunkAlignment !=
            0) {
      function = unstaged_->get();
      choice = &unstaged_->choice;
    }
    ContextScope scope(*driver_);
    launch(function, {forward_.grid_x, heads_q(), batch()}, choice->threads(), choice->shared_bytes,
           static_cast<CUstream>(args.stream), &p, "forward");
  }

  void run_backward(const BackwardArgs& args) const override {
    if (!backward_) throw_internal("cuda: backward on a plan built for the forward only");
    const BackwardState& b = *backward_;
    BackwardParams p = b.params;
    bind_views(args, p);
    if (b.choice.kind == KernelKind::kMma) {
      for (const auto& [name, view] :
           {std::pair{"q", &args.q}, std::pair{"k", &args.k}, std::pair{"v", &args.v},
            std::pair{"out", &args.out}, std::pair{"dout", &args.dout}, std::pair{"dq", &args.dq},
            std::pair{"dk", &args.dk}, std::pair{"dv", &args.dv}}) {
        check_chunk_aligned(name, view->data);
      }
    }
    bind_tensors(bindings_, args.tensors, p.fwd);

    // Scratch (from args.workspace, args.allocator or cuMemAllocAsync): delta, lse2, then one
    // fixed-point accumulator per wanted tensor gradient.
    struct Gradient {
      std::size_t slot;
      const TensorView* view;
      std::size_t offset;  // bytes into the scratch
    };
    std::vector<Gradient> gradients;
    std::size_t bytes = align_scratch(b.delta_floats * sizeof(float));
    const std::size_t lse2_offset = bytes;
    bytes += align_scratch(b.delta_floats * sizeof(float));
    const std::size_t accumulators_begin = bytes;
    for (std::size_t slot = 0; slot < bindings_.tensors.size(); ++slot) {
      const auto found = args.tensor_grads.find(bindings_.tensors[slot]);
      if (found == args.tensor_grads.end()) continue;
      gradients.push_back({slot, &found->second, bytes});
      bytes += align_scratch(static_cast<std::size_t>(found->second.numel()) *
                             sizeof(flexattn_kernels::GradAccumulator));
    }

    ContextScope scope(*driver_);
    const auto stream = static_cast<CUstream>(args.stream);
    if (bytes > workspace_bytes(Pass::kBackward)) {
      throw_internal(
          fmt::format("cuda: the backward's scratch ({} bytes) exceeds the {} bytes "
                      "workspace_bytes() reports",
                      bytes, workspace_bytes(Pass::kBackward)));
    }
    CallScratch scratch(*driver_, args.workspace, args.allocator, bytes, stream);
    p.delta = reinterpret_cast<float*>(scratch.address());
    p.lse2 = reinterpret_cast<float*>(scratch.address() + lse2_offset);
    if (bytes > accumulators_begin) {
      driver_->check(driver_->api().memset_d8_async(scratch.address() + accumulators_begin, 0,
                                                    bytes - accumulators_begin, stream),
                     "cuMemsetD8Async");
    }
    for (const Gradient& gradient : gradients) {
      p.grad_fixed[gradient.slot] =
          reinterpret_cast<flexattn_kernels::GradAccumulator*>(scratch.address() + gradient.offset);
    }
    p.tensor_grads_wanted = gradients.empty() ? 0 : 1;

    const auto heads_kv = static_cast<unsigned>(problem_.heads_kv());
    const auto grid_q = [&](int rows) {
      return static_cast<unsigned>(ceil_div(problem_.seq_len_q(), rows));
    };
    launch(b.delta, {grid_q(flexattn_kernels::kDeltaRows), heads_q(), batch()},
           flexattn_kernels::kDeltaThreads, 0, stream, &p, "backward delta");
    {
      // The dQ kernel on the second stream (side_stream); `stream` waits for it at the end
      // of this block, before the finalize kernels read its tensor gradients.
      const CUstream side = b.side_stream->get();
      const StreamFork fork(*driver_, stream, side);
      launch(b.dkdv,
             {static_cast<unsigned>(ceil_div(problem_.seq_len_kv(), b.choice.dkdv_block_kv) *
                                    b.choice.dkdv_parts),
              heads_kv, batch()},
             b.choice.dkdv_threads, b.choice.dkdv_shared_bytes(), stream, &p, "backward dK/dV");
      launch(b.dq, {grid_q(b.choice.dq_block_q), heads_q(), batch()}, b.choice.dq_threads,
             b.choice.dq_shared_bytes(), side, &p, "backward dQ");
    }
    for (const Gradient& gradient : gradients) {
      FinalizeParams f{};
      f.fixed = reinterpret_cast<const flexattn_kernels::GradAccumulator*>(scratch.address() +
                                                                           gradient.offset);
      f.out = gradient.view->data;
      f.count = gradient.view->numel();
      f.out_is_f64 = gradient.view->dtype == DType::kF64 ? 1 : 0;
      launch(b.finalize,
             {static_cast<unsigned>(ceil_div(f.count, flexattn_kernels::kFinalizeThreads)), 1, 1},
             flexattn_kernels::kFinalizeThreads, 0, stream, &f, "backward finalize");
    }
    scratch.release();
  }

 private:
  // A paged-cache forward (DecodeState). The page table and the lengths stay on the device: a
  // length or a used page id out of range makes that sequence's rows NaN (kernels/decode.cuh).
  void run_decode(const ForwardArgs& args) const {
    const DecodeState& d = *decode_;
    DecodeParams p = d.params;
    bind_views(args, static_cast<float*>(args.lse.data), p.fwd);
    p.page_table = static_cast<const int*>(args.page_table.data);
    p.cache_lens = static_cast<const int*>(args.cache_lens.data);
    if (choice_.paged_wgmma) {
      // The wgmma forward also copies Q and stores O 16 bytes at a time.
      check_chunk_aligned("q", args.q.data);
      check_chunk_aligned("out", args.out.data);
    }
    if (choice_.vector_loads) {
      for (const auto& [name, view] : {std::pair{"k", &args.k}, std::pair{"v", &args.v}}) {
        if (reinterpret_cast<std::uintptr_t>(view->data) % kChunkAlignment != 0) {
          throw_invalid(fmt::format(
              "cuda: argument {} ({}) is not 16-byte aligned; the paged-cache kernel reads the "
              "pools 16 bytes at a time",
              name, view->data));
        }
      }
    }
    bind_tensors(bindings_, args.tensors, p.fwd);
    ContextScope scope(*driver_);
    const auto stream = static_cast<CUstream>(args.stream);
    const std::size_t bytes = d.workspace_bytes();
    CallScratch scratch(*driver_, args.workspace, args.allocator, bytes, stream);
    if (d.splits.splits > 1) {
      p.partial_o = reinterpret_cast<float*>(scratch.address());
      p.partial_lse = reinterpret_cast<float*>(scratch.address() + align_scratch(d.partial_o_bytes));
    }
    // The wgmma forward: (query blocks, query heads, batch); else (splits x row blocks, kv heads,
    // batch).
    const Grid grid = choice_.paged_wgmma
                          ? Grid{d.splits.row_blocks, heads_q(), batch()}
                          : Grid{d.splits.row_blocks * static_cast<unsigned>(d.splits.splits),
                                 static_cast<unsigned>(problem_.heads_kv()), batch()};
    launch(forward_.function, grid, choice_.threads(), choice_.shared_bytes, stream, &p,
           "paged-cache forward");
    if (d.splits.splits > 1) {
      const std::int64_t rows = problem_.heads_q() * static_cast<std::int64_t>(p.tokens_q);
      launch(d.combine,
             {static_cast<unsigned>(rows), 1, 1},
             flexattn_kernels::kDecodeCombineThreads, 0, stream, &p, "paged-cache combine");
    }
    scratch.release();
  }

  unsigned heads_q() const { return static_cast<unsigned>(problem_.heads_q()); }
  unsigned batch() const { return static_cast<unsigned>(problem_.batch()); }

  template <class Params>
  void launch(CUfunction function, Grid grid, int threads, int shared_bytes, CUstream stream,
              Params* params, std::string_view what) const {
    cuda::launch(*driver_, function, grid, threads, shared_bytes, stream, params, what);
  }

  Problem problem_;
  std::shared_ptr<const Driver> driver_;
  KernelChoice choice_;
  std::string staged_tensor_;  // the tensor the forward stages in shared memory, if any
  ModifierBindings bindings_;
  std::shared_ptr<const CompiledKernel> kernel_;           // the forward's module
  std::shared_ptr<const CompiledKernel> backward_kernel_;  // the backward's, when wanted
  DeviceBuffer cu_seqlens_q_;
  DeviceBuffer cu_seqlens_kv_;
  ForwardState forward_;
  std::optional<BackwardState> backward_;
  std::optional<DecodeState> decode_;          // a paged-cache problem
  std::unique_ptr<UnstagedForward> unstaged_;  // with a staged tensor
};

class CudaEngine final : public Engine {
 public:
  CudaEngine()
      : driver_(Driver::open()),
        memory_(driver_),
        kernels_(std::make_shared<KernelCache>(driver_)) {}

  std::string_view name() const override { return kEngineName; }
  Device device() const override { return Device::kCuda; }
  // Paged caches: the decode kernel (kernels/decode.cuh).
  bool reads_kv_cache() const override { return true; }
  const DeviceMemory* memory() const override {
    return driver_->availability() ? &memory_ : nullptr;
  }
  Support available() const override {
    if (!driver_->availability()) return driver_->availability();
    return nvrtc_availability();
  }

  // FLEXATTN_CUDA_WGMMA=0 changes the kernels of sm_90 plans.
  std::string plan_settings() const override { return wgmma_allowed() ? "" : "wgmma=0"; }

  std::string generated_source(const Problem& problem) const override {
    Lowering lowering;
    const Support support = lower_problem(problem, lowering, capability());
    if (!support) return fmt::format("// cuda: not supported: {}\n", support.reason());
    return lowering.source;
  }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    Lowering lowering;
    result.support = lower_problem(problem, lowering, capability());
    if (!result.support || stage == Stage::kCheck) return result;

    std::vector<KernelFunction> functions = forward_functions(lowering.choice);
    if (lowering.backward) {
      for (KernelFunction& function : backward_functions(lowering.backward->choice)) {
        functions.push_back(std::move(function));
      }
    }
    const int shared_limit = driver_->max_shared_memory_per_block();
    for (const KernelFunction& function : functions) {
      if (function.shared_bytes > shared_limit) {
        result.support = Support::no(
            fmt::format("kernel {} needs {} bytes of shared memory; {} allows {}", function.name,
                        function.shared_bytes, driver_->device_name(), shared_limit));
        return result;
      }
    }
    // The paged-cache kernel walks its keys without a tile list (the mask per element).
    const bool decode = lowering.choice.kind == KernelKind::kDecode;
    const TileList tiles = decode ? TileList{} : classify_tiles(problem, lowering.choice.class_block_q,
                                                                lowering.choice.block_n);
    std::optional<TileList> backward_tiles;
    std::string backward_text;
    std::optional<TileList> dkdv_tiles;  // when the dK/dV kernel has its own blocks
    if (lowering.backward) {
      const BackwardChoice& backward = lowering.backward->choice;
      // The dQ kernel's q-major list, and the dK/dV kernel's when its blocks differ (wgmma).
      backward_tiles = classify_tiles(problem, backward.dq_block_q, backward.block_kv);
      if (backward.dkdv_block_kv != backward.block_kv || backward.dq_block_q != backward.block_q) {
        dkdv_tiles = classify_tiles(problem, backward.block_q, backward.dkdv_block_kv);
      }
      backward_text =
          fmt::format("; backward {}, {} of {} tiles visited ({} with the mask evaluated)",
                      backward.describe(), backward_tiles->tiles - backward_tiles->skipped,
                      backward_tiles->tiles, backward_tiles->mixed);
    }
    // The plan proof: the generated source it compiles, lifted and proven equal to the request
    // by evaluation (source_proof.hpp). A source it cannot prove is refused before it is compiled
    // (selection then moves to the next engine, naming the reason).
    const SourceProof proof = prove_lowering(problem, lowering);
    if (!proof.proven) {
      result.support = Support::no(
          fmt::format("the plan proof could not show the generated kernel source equal to the "
                      "request ({}), so the plan is refused",
                      proof.failure));
      return result;
    }
    PlanKernels kernels = compile_modules(lowering);

    std::string tile_text = fmt::format("{} of {} kv tiles visited ({} with the mask evaluated)",
                                        tiles.tiles - tiles.skipped, tiles.tiles, tiles.mixed);
    if (decode) {
      const DecodeSplits splits =
          decode_splits(problem, lowering.choice, driver_->multiprocessors());
      tile_text =
          lowering.choice.paged_wgmma
              ? fmt::format(
                    "{} query block(s) per query head, each over the cache's tiles ({})",
                    splits.row_blocks,
                    keeps_everything(problem.mask_mod())
                        ? "all of them"
                        : "those the mask keeps, listed per block and evaluated per element")
              : fmt::format("keys in {} split(s) of {}, {} row block(s) per kv head", splits.splits,
                            splits.keys_per_split, splits.row_blocks);
    }
    PlanInfo info;
    info.engine = std::string(kEngineName);
    info.description =
        fmt::format("{}; {}{}; kernel {} on {} (sm_{}{}), {} in {:.3f} s",
                    lowering.choice.describe(), tile_text, backward_text, kernels.keys(),
                    driver_->device_name(), driver_->compute_capability(),
                    architecture_suffix(lowering), kernels.origin, kernels.seconds);
    const ProofHashes hashes = proof_hashes(problem, proof);
    info.lowered_hash = hashes.lowered_hash;
    info.lowered_backward_hash = hashes.lowered_backward_hash;
    info.signature = problem.signature();
    result.plan = std::make_unique<CudaPlan>(
        std::move(info), problem, driver_, lowering, std::move(kernels), tiles,
        backward_tiles ? &*backward_tiles : nullptr, dkdv_tiles ? &*dkdv_tiles : nullptr, kernels_);
    return result;
  }

 private:
  int capability() const { return driver_->availability() ? driver_->compute_capability() : 0; }

  // The plan's modules. With a backward, its module compiles on a second thread while this one
  // compiles the forward's: within one program NVRTC assembles the kernels on every core
  // (--split-compile=0), but its front end and optimizer took a forward+backward unit's kernels
  // one after another (docs/measurements/2026-12-07-cpu-jit-two-modules.txt).
  PlanKernels compile_modules(const Lowering& lowering) const {
    const auto start = std::chrono::steady_clock::now();
    const std::string suffix = architecture_suffix(lowering);
    PlanKernels kernels;
    if (!lowering.backward) {
      kernels.forward = kernels_->get(lowering.source, forward_functions(lowering.choice), suffix);
      kernels.origin = kernels.forward.origin;
      kernels.seconds = kernels.forward.seconds;
      return kernels;
    }
    const auto backward_module = [this, &lowering, &suffix] {
      return kernels_->get(lowering.source, backward_functions(lowering.backward->choice), suffix,
                           kBackwardModuleDefine);
    };
    // (The future's destructor waits for the backward's thread, also when the forward throws.
    // Where no thread can be started, the two compile one after the other.)
    std::future<KernelLookup> backward;
    try {
      backward = std::async(std::launch::async, backward_module);
    } catch (const std::system_error&) {
    }
    kernels.forward = kernels_->get(lowering.source, forward_functions(lowering.choice), suffix,
                                    kForwardModuleDefine);
    kernels.backward = backward.valid() ? backward.get() : backward_module();
    kernels.origin = kernels.forward.origin == kernels.backward->origin
                         ? kernels.forward.origin
                         : kernels.forward.origin + " and " + kernels.backward->origin;
    kernels.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return kernels;
  }

  std::shared_ptr<const Driver> driver_;
  DriverMemory memory_;
  std::shared_ptr<KernelCache> kernels_;  // shared with the plans (their unstaged forwards)
};

}  // namespace

PlanSource plan_source(const Problem& problem, int capability) {
  Lowering lowering;
  PlanSource result;
  if (const Support support = lower_problem(problem, lowering, capability); !support) {
    result.reason = support.reason();
    return result;
  }
  result.source = lowering.source;
  result.suffix = architecture_suffix(lowering);
  return result;
}

ProofHashes plan_proof_hashes(const Problem& problem, int capability) {
  Lowering lowering;
  if (!lower_problem(problem, lowering, capability)) return {};
  return proof_hashes(problem, prove_lowering(problem, lowering));
}

}  // namespace cuda

std::shared_ptr<const Engine> make_cuda_engine() { return std::make_shared<cuda::CudaEngine>(); }

}  // namespace flexattn
