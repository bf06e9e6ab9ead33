// The engine contract (docs/design.md section 4). An engine answers "can I compute exactly this?"
// by running the same lowering that builds its plan; a plan proves which modifier it lowered and
// refuses arguments other than those of the problem it was built for.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "flexattn/export.hpp"
#include "flexattn/problem.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn {

// A verdict with its reason (empty when supported).
class Support {
 public:
  static Support yes() { return Support(true, {}); }
  static Support no(std::string reason) { return Support(false, std::move(reason)); }
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const std::string& reason() const { return reason_; }

 private:
  Support(bool ok, std::string reason) : ok_(ok), reason_(std::move(reason)) {}
  bool ok_;
  std::string reason_;
};

// Device memory the caller lends a call for its scratch (GPU engines): at least
// Plan::workspace_bytes() of the pass, starting on a kWorkspaceAlignment boundary, on the
// engine's device, and not used by anything else until the work the call enqueues on its stream
// has completed (stream order: the next call on the same stream may reuse it at once).
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};
inline constexpr std::size_t kWorkspaceAlignment = 256;

// Stream-ordered device memory from the caller (a framework's caching allocator, an arena),
// asked for when a call needs scratch and no Workspace is given.
class FLEXATTN_API DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // `bytes` (> 0) of device memory, kWorkspaceAlignment-aligned, usable by the work enqueued on
  // `stream` (a cudaStream_t) from now on; throws (any exception) when it cannot.
  virtual void* allocate(std::size_t bytes, void* stream) = 0;
  // Takes the memory back once the work enqueued on `stream` so far has completed.
  virtual void release(void* data, std::size_t bytes, void* stream) noexcept = 0;
};

struct ForwardArgs {
  TensorView q, k, v;
  TensorView out;
  TensorView lse;  // optional (empty): not written
  std::map<std::string, TensorView> tensors;
  void* stream = nullptr;  // cudaStream_t for GPU engines
  // Where the call's device scratch comes from: `workspace` when set, else `allocator` when set,
  // else the engine's own (cuMemAllocAsync on the stream, or memory the plan keeps).
  Workspace workspace{};
  DeviceAllocator* allocator = nullptr;
  // A KV cache problem's (Problem::kv_cache): the pages of each sequence, int32 (batch,
  // max_pages), and its length in tokens, int32 (batch,), each 0 or in [its query count,
  // capacity]. Entries of page_table past a sequence's length are not read. Empty otherwise.
  TensorView page_table{};
  TensorView cache_lens{};
};

struct BackwardArgs {
  TensorView q, k, v, out, lse, dout;
  TensorView dq, dk, dv;
  std::map<std::string, TensorView> tensors;
  // Gradients of float tensors read by the score modifier (same shape as the tensor, fp32 or
  // fp64). Missing entries are not computed; entries are overwritten, not accumulated into.
  std::map<std::string, TensorView> tensor_grads;
  void* stream = nullptr;
  Workspace workspace{};  // as in ForwardArgs
  DeviceAllocator* allocator = nullptr;
};

enum class Pass { kForward, kBackward };

struct PlanInfo {
  std::string engine;
  std::string description;  // human-readable: tiles, threads, kernels, cuDNN engine...
  // The plan proof (docs/design.md section 4), computed from what the plan executes (lifted back
  // into the IR from its tape, instruction list or operation graph), never from the request:
  // modifier_hash of the score modifier, mask and scale it really implements, and, for a problem
  // that wants gradients, backward_hash of the derivatives it really executes (0 otherwise).
  std::uint64_t lowered_hash = 0;
  std::uint64_t lowered_backward_hash = 0;
  std::string signature;  // Problem::signature() it was built for
};

// Checks a plan's proof against the problem: empty when the plan implements the requested
// modifier (Problem::modifier_hash) and, for a problem that wants gradients, the requested
// derivatives (Problem::backward_hash); otherwise a one-line reason naming the engine and the
// part that differs. Selection and the conformance runner both apply it.
FLEXATTN_API std::string plan_proof_failure(const PlanInfo& info, const Problem& problem);

class FLEXATTN_API Plan {
 public:
  explicit Plan(PlanInfo info) : info_(std::move(info)) {}
  virtual ~Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  const PlanInfo& info() const { return info_; }
  virtual const Problem& problem() const = 0;

  // The device scratch one call of `pass` uses at most (0: none, as on the CPU engines): the
  // size of a Workspace to lend it, or what it asks of a DeviceAllocator.
  virtual std::size_t workspace_bytes(Pass pass) const {
    static_cast<void>(pass);
    return 0;
  }

  // Checks the arguments against the signature (shapes, strides, dtypes, devices, required
  // tensors, a lent workspace's size and alignment), throwing Error(kInvalidArgument) naming the
  // first mismatch, then runs.
  void forward(const ForwardArgs& args) const;
  void backward(const BackwardArgs& args) const;

 protected:
  virtual void run_forward(const ForwardArgs& args) const = 0;
  virtual void run_backward(const BackwardArgs& args) const = 0;

 private:
  PlanInfo info_;
};

// Validates arguments against a problem (what Plan::forward/backward call first).
FLEXATTN_API void check_forward_args(const Problem& problem, const ForwardArgs& args);
FLEXATTN_API void check_backward_args(const Problem& problem, const BackwardArgs& args);

// How a client (the CLI, the conformance runner) moves data to and from an engine's device.
// CPU engines have none: their views point at host memory.
class FLEXATTN_API DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual void* allocate(std::size_t bytes) const = 0;
  virtual void release(void* pointer) const noexcept = 0;
  virtual void copy_to_device(void* destination, const void* source, std::size_t bytes) const = 0;
  virtual void copy_to_host(void* destination, const void* source, std::size_t bytes) const = 0;
  virtual void synchronize() const = 0;
};

class FLEXATTN_API Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string_view name() const = 0;
  // Where the engine's plans expect their data (Problem::device() must match).
  virtual Device device() const { return Device::kCpu; }
  // Non-null for engines whose device is not the CPU; owned by the engine, so valid while the
  // engine lives (keep the shared_ptr that builtin_engine(s) returned, not only this pointer).
  virtual const DeviceMemory* memory() const { return nullptr; }
  // Whether the engine can run on this machine at all ("no CUDA device", "libcudnn.so.9 not
  // found"). Checked before lower().
  virtual Support available() const = 0;

  // supports() is the first half of plan(): both run lower(); supports() stops before building.
  Support supports(const Problem& problem) const;
  // Throws Error(kUnsupported) with the reason when not supported.
  std::unique_ptr<Plan> plan(const Problem& problem) const;
  // The code the engine generates for `problem` (`flexattn explain --source`): for the cuda
  // engine, the CUDA translation unit NVRTC compiles. Empty for engines that generate none.
  // Needs no device.
  virtual std::string generated_source(const Problem& problem) const {
    static_cast<void>(problem);
    return {};
  }
  // The settings in effect now that change the plans the engine builds (the cuda engine's
  // FLEXATTN_CUDA_WGMMA=0: "wgmma=0"); empty when none do (the default). A Context keys its plan
  // cache by them, so a plan built under one setting is never served under another.
  virtual std::string plan_settings() const;
  // Whether the engine's plans read a paged KV cache (Problem::kv_cache): K and V as page pools
  // through the run's page table. supports() and plan() refuse a cache problem for an engine
  // that says no before lower() sees it, so an engine that knows nothing of caches can never
  // read a pool as dense K and V.
  virtual bool reads_kv_cache() const { return false; }

 protected:
  enum class Stage { kCheck, kBuild };
  struct Lowered {
    Support support = Support::no("not lowered");
    std::unique_ptr<Plan> plan;  // set only for Stage::kBuild and a supported problem
  };
  // One function decides support and builds the plan, so the two cannot drift apart.
  virtual Lowered lower(const Problem& problem, Stage stage) const = 0;
};

}  // namespace flexattn
