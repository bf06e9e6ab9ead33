// Caller-owned device memory on the GPU engines (ctest label `gpu`; skipped without a device):
// a lent workspace of exactly Plan::workspace_bytes() and a caller's allocator give the same
// bits as the engine's own memory, the engine writes nothing past the workspace it reports, the
// allocator is asked for no more than that and gets everything back, and a workspace one byte too
// small is refused.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda_device.hpp"
#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

namespace flexattn::test {
namespace {

constexpr std::size_t kGuardBytes = 4096;
constexpr unsigned char kGuard = 0xab;

// Synchronous device memory; releases wait for the device, so stream order is kept trivially.
class CountingAllocator final : public DeviceAllocator {
 public:
  explicit CountingAllocator(const DeviceMemory& memory) : memory_(memory) {}
  void* allocate(std::size_t bytes, void* stream) override {
    static_cast<void>(stream);
    requested.push_back(bytes);
    return memory_.allocate(bytes);
  }
  void release(void* data, std::size_t bytes, void* stream) noexcept override {
    static_cast<void>(bytes), static_cast<void>(stream);
    memory_.synchronize();
    memory_.release(data);
    ++released;
  }
  std::vector<std::size_t> requested;
  int released = 0;

 private:
  const DeviceMemory& memory_;
};

// Device memory of `bytes` followed by guard bytes, lent as a workspace of `bytes`.
class GuardedWorkspace {
 public:
  GuardedWorkspace(const DeviceMemory& memory, std::size_t bytes)
      : memory_(memory), bytes_(bytes), pointer_(memory.allocate(bytes + kGuardBytes)) {
    const std::vector<unsigned char> fill(bytes + kGuardBytes, kGuard);
    memory_.copy_to_device(pointer_, fill.data(), fill.size());
  }
  ~GuardedWorkspace() { memory_.release(pointer_); }
  GuardedWorkspace(const GuardedWorkspace&) = delete;
  GuardedWorkspace& operator=(const GuardedWorkspace&) = delete;

  Workspace lent(std::size_t less = 0) const { return {pointer_, bytes_ - less}; }
  bool guard_intact() const {
    std::vector<unsigned char> all(bytes_ + kGuardBytes);
    memory_.synchronize();
    memory_.copy_to_host(all.data(), pointer_, all.size());
    for (std::size_t i = bytes_; i < all.size(); ++i) {
      if (all[i] != kGuard) return false;
    }
    return true;
  }

 private:
  const DeviceMemory& memory_;
  std::size_t bytes_;
  void* pointer_;
};

enum class Memory { kEngine, kLent, kAllocator };

struct RunResult {
  Outputs outputs;
  bool guard_intact = true;
  std::vector<std::size_t> requested;
  int released = 0;
};

RunResult run(const Engine& engine, const Plan& plan, const Problem& problem, const Inputs& inputs,
              const std::vector<std::string>& learned, Memory memory) {
  const DeviceMemory& device = *engine.memory();
  DeviceTensor q(device, inputs.q), k(device, inputs.k), v(device, inputs.v),
      dout(device, inputs.dout);
  DeviceTensor out(device, HostTensor(problem.dtype(), problem.expected("o").shape), true);
  DeviceTensor lse(device, HostTensor(DType::kF32, problem.expected("lse").shape), true);
  DeviceTensor dq(device, HostTensor(problem.dtype(), problem.expected("q").shape), true);
  DeviceTensor dk(device, HostTensor(problem.dtype(), problem.expected("k").shape), true);
  DeviceTensor dv(device, HostTensor(problem.dtype(), problem.expected("v").shape), true);
  std::map<std::string, std::unique_ptr<DeviceTensor>> tensors, gradients;
  for (const auto& [name, tensor] : inputs.tensors) {
    tensors.emplace(name, std::make_unique<DeviceTensor>(device, tensor));
  }
  for (const std::string& name : learned) {
    gradients.emplace(name,
                      std::make_unique<DeviceTensor>(
                          device, HostTensor(DType::kF32, inputs.tensors.at(name).shape()), true));
  }
  GuardedWorkspace forward_workspace(device, plan.workspace_bytes(Pass::kForward));
  GuardedWorkspace backward_workspace(device, plan.workspace_bytes(Pass::kBackward));
  CountingAllocator allocator(device);

  ForwardArgs args;
  args.q = q.view(), args.k = k.view(), args.v = v.view(), args.out = out.view();
  args.lse = lse.view();
  for (const auto& [name, tensor] : tensors) args.tensors[name] = tensor->view();
  BackwardArgs bargs;
  bargs.q = q.view(), bargs.k = k.view(), bargs.v = v.view(), bargs.out = out.view();
  bargs.lse = lse.view(), bargs.dout = dout.view();
  bargs.dq = dq.view(), bargs.dk = dk.view(), bargs.dv = dv.view();
  bargs.tensors = args.tensors;
  for (const auto& [name, gradient] : gradients) bargs.tensor_grads[name] = gradient->view();
  if (memory == Memory::kLent) {
    args.workspace = forward_workspace.lent();
    bargs.workspace = backward_workspace.lent();
  } else if (memory == Memory::kAllocator) {
    args.allocator = &allocator;
    bargs.allocator = &allocator;
  }
  plan.forward(args);
  plan.backward(bargs);

  RunResult result;
  result.outputs.out = out.download();
  result.outputs.lse = lse.download();
  result.outputs.dq = dq.download();
  result.outputs.dk = dk.download();
  result.outputs.dv = dv.download();
  for (auto& [name, gradient] : gradients) result.outputs.tensor_grads[name] = gradient->download();
  result.guard_intact = forward_workspace.guard_intact() && backward_workspace.guard_intact();
  result.requested = allocator.requested;
  result.released = allocator.released;
  return result;
}

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

void expect_same(const Outputs& got, const Outputs& want) {
  EXPECT_TRUE(same_bits(got.out, want.out));
  EXPECT_TRUE(same_bits(got.lse, want.lse));
  EXPECT_TRUE(same_bits(got.dq, want.dq));
  EXPECT_TRUE(same_bits(got.dk, want.dk));
  EXPECT_TRUE(same_bits(got.dv, want.dv));
  for (const auto& [name, gradient] : want.tensor_grads) {
    EXPECT_TRUE(same_bits(got.tensor_grads.at(name), gradient)) << name;
  }
}

class DeviceWorkspace : public ::testing::TestWithParam<std::string> {};

TEST_P(DeviceWorkspace, LentAndAllocatedMemoryGiveTheEnginesOwnResults) {
  const std::shared_ptr<const Engine> engine = builtin_engine(GetParam());
  if (engine == nullptr || !engine->available()) GTEST_SKIP() << GetParam() << " unavailable";
  int ran = 0;
  // A learned ALiBi slope (its gradient needs the cuda engine's accumulators), then plain causal.
  for (const std::vector<std::string>& modifiers : std::vector<std::vector<std::string>>{
           {"alibi", "causal"}, {"softcap", "causal"}, {"causal"}}) {
    ProblemDesc base;
    base.layout = Layout::kBSHD, base.dtype = DType::kBF16;
    base.batch = 2, base.heads_q = 4, base.heads_kv = 2, base.seq_len_q = 300;
    base.seq_len_kv = 300, base.head_dim_qk = 64, base.head_dim_v = 64;
    base.direction = Direction::kForwardBackward, base.device = Device::kCuda;
    const Problem problem(catalogue_desc(modifiers, base));
    if (!engine->supports(problem)) continue;
    SCOPED_TRACE(problem.score_mod().to_string() + " / " + problem.mask_mod().to_string());
    ++ran;
    const Inputs inputs = catalogue_inputs(problem, modifiers, 11);
    std::vector<std::string> learned;
    for (const std::string& name : problem.score_mod().tensors()) {
      if (is_floating(problem.desc().tensors.at(name).dtype)) learned.push_back(name);
    }
    const auto plan = engine->plan(problem);
    const RunResult own = run(*engine, *plan, problem, inputs, learned, Memory::kEngine);
    const RunResult lent = run(*engine, *plan, problem, inputs, learned, Memory::kLent);
    expect_same(lent.outputs, own.outputs);
    EXPECT_TRUE(lent.guard_intact) << "wrote past the workspace_bytes it reports";
    EXPECT_TRUE(lent.requested.empty()) << "asked the allocator although lent a workspace";
    const RunResult allocated = run(*engine, *plan, problem, inputs, learned, Memory::kAllocator);
    expect_same(allocated.outputs, own.outputs);
    EXPECT_EQ(allocated.released, static_cast<int>(allocated.requested.size()));
    for (std::size_t bytes : allocated.requested) {
      EXPECT_LE(bytes, std::max(plan->workspace_bytes(Pass::kForward),
                                plan->workspace_bytes(Pass::kBackward)));
    }
    if (GetParam() == "cuda") {
      EXPECT_GT(plan->workspace_bytes(Pass::kBackward), 0U);  // row statistics at least
      EXPECT_FALSE(allocated.requested.empty());
    }
  }
  EXPECT_GT(ran, 0) << GetParam() << " supports none of the problems";
}

TEST_P(DeviceWorkspace, AWorkspaceOneByteTooSmallIsRefused) {
  const std::shared_ptr<const Engine> engine = builtin_engine(GetParam());
  if (engine == nullptr || !engine->available()) GTEST_SKIP() << GetParam() << " unavailable";
  ProblemDesc desc;
  desc.layout = Layout::kBSHD, desc.dtype = DType::kBF16, desc.batch = 1, desc.heads_q = 2;
  desc.seq_len_q = 128, desc.head_dim_qk = 64, desc.direction = Direction::kForwardBackward;
  desc.device = Device::kCuda;
  desc.mask_mod = ir::query() >= ir::key();
  const Problem problem(desc);
  const Support support = engine->supports(problem);
  ASSERT_TRUE(support) << support.reason();
  const auto plan = engine->plan(problem);
  const std::size_t bytes = plan->workspace_bytes(Pass::kBackward);
  if (bytes == 0) GTEST_SKIP() << "this plan's backward needs no scratch";
  const DeviceMemory& device = *engine->memory();
  const Inputs inputs = random_inputs(problem, 5);
  GuardedWorkspace workspace(device, bytes);
  DeviceTensor q(device, inputs.q), k(device, inputs.k), v(device, inputs.v),
      dout(device, inputs.dout), out(device, inputs.q, true), dq(device, inputs.q, true),
      dk(device, inputs.k, true), dv(device, inputs.v, true);
  DeviceTensor lse(device, HostTensor(DType::kF32, problem.expected("lse").shape), true);
  BackwardArgs args;
  args.q = q.view(), args.k = k.view(), args.v = v.view(), args.out = out.view();
  args.lse = lse.view(), args.dout = dout.view();
  args.dq = dq.view(), args.dk = dk.view(), args.dv = dv.view();
  args.workspace = workspace.lent(1);
  try {
    plan->backward(args);
    ADD_FAILURE() << "a workspace of " << bytes - 1 << " bytes was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find(std::to_string(bytes)), std::string::npos)
        << error.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, DeviceWorkspace, ::testing::Values("cuda", "cudnn"));

}  // namespace
}  // namespace flexattn::test
