// Caller-owned device memory (ForwardArgs/BackwardArgs::workspace and ::allocator): the plan
// checks a lent workspace before running and hands both to the engine unchanged; engines that
// need no scratch report 0 and run with or without one.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/engine.hpp"
#include "flexattn/error.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

constexpr std::size_t kForwardBytes = 1000;
constexpr std::size_t kBackwardBytes = 4096;

// cpu_ref's plan that claims scratch and records what each call was lent.
class ScratchPlan final : public Plan {
 public:
  explicit ScratchPlan(std::unique_ptr<Plan> inner)
      : Plan(inner->info()), inner_(std::move(inner)) {}
  const Problem& problem() const override { return inner_->problem(); }
  std::size_t workspace_bytes(Pass pass) const override {
    return pass == Pass::kForward ? kForwardBytes : kBackwardBytes;
  }
  mutable std::vector<Workspace> lent;
  mutable std::vector<DeviceAllocator*> allocators;

 protected:
  void run_forward(const ForwardArgs& args) const override {
    lent.push_back(args.workspace);
    allocators.push_back(args.allocator);
    inner_->forward(ForwardArgs{args.q, args.k, args.v, args.out, args.lse, args.tensors});
  }
  void run_backward(const BackwardArgs& args) const override {
    lent.push_back(args.workspace);
    allocators.push_back(args.allocator);
    BackwardArgs plain = args;
    plain.workspace = {};
    plain.allocator = nullptr;
    inner_->backward(plain);
  }

 private:
  std::unique_ptr<Plan> inner_;
};

class NeverAllocates final : public DeviceAllocator {
 public:
  void* allocate(std::size_t bytes, void* stream) override {
    static_cast<void>(bytes), static_cast<void>(stream);
    ADD_FAILURE() << "a plan on host memory asked the allocator";
    return nullptr;
  }
  void release(void* data, std::size_t bytes, void* stream) noexcept override {
    static_cast<void>(data), static_cast<void>(bytes), static_cast<void>(stream);
  }
};

struct Fixture {
  Problem problem;
  test::Inputs inputs;
  test::Outputs outputs;
  ScratchPlan plan;
};

std::unique_ptr<Fixture> make_fixture() {
  ProblemDesc desc;
  desc.batch = 1, desc.heads_q = 2, desc.heads_kv = 2, desc.seq_len_q = 8, desc.seq_len_kv = 8;
  desc.head_dim_qk = 4, desc.head_dim_v = 4, desc.dtype = DType::kF64;
  desc.direction = Direction::kForwardBackward;
  const Problem problem(desc);
  test::Inputs inputs = test::random_inputs(problem, 7);
  test::Outputs outputs{HostTensor(DType::kF64, problem.expected("o").shape),
                        HostTensor(DType::kF64, problem.expected("lse").shape),
                        HostTensor(DType::kF64, problem.expected("q").shape),
                        HostTensor(DType::kF64, problem.expected("k").shape),
                        HostTensor(DType::kF64, problem.expected("v").shape),
                        {}};
  return std::unique_ptr<Fixture>(new Fixture{problem, std::move(inputs), std::move(outputs),
                                              ScratchPlan(make_cpu_ref_engine()->plan(problem))});
}

// An aligned buffer standing for device memory (the checks never dereference it).
struct Buffer {
  explicit Buffer(std::size_t bytes) : storage(bytes + kWorkspaceAlignment) {}
  std::byte* aligned() {
    const auto address = reinterpret_cast<std::uintptr_t>(storage.data());
    return storage.data() + (kWorkspaceAlignment - address % kWorkspaceAlignment);
  }
  std::vector<std::byte> storage;
};

std::string invalid_message(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.what();
    return error.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

TEST(Workspace, ALentWorkspaceReachesTheEngineUnchanged) {
  const auto f = make_fixture();
  Buffer buffer(kBackwardBytes);
  NeverAllocates allocator;
  ForwardArgs args = test::forward_args(f->inputs, f->outputs);
  args.workspace = {buffer.aligned(), kForwardBytes};
  args.allocator = &allocator;
  f->plan.forward(args);
  BackwardArgs bargs = test::backward_args(f->inputs, f->outputs);
  bargs.workspace = {buffer.aligned(), kBackwardBytes + 1};
  f->plan.backward(bargs);
  ASSERT_EQ(f->plan.lent.size(), 2U);
  EXPECT_EQ(f->plan.lent[0].data, buffer.aligned());
  EXPECT_EQ(f->plan.lent[0].bytes, kForwardBytes);
  EXPECT_EQ(f->plan.allocators[0], &allocator);
  EXPECT_EQ(f->plan.lent[1].bytes, kBackwardBytes + 1);
  EXPECT_EQ(f->plan.allocators[1], nullptr);
}

TEST(Workspace, ATooSmallWorkspaceIsRefusedBeforeRunning) {
  const auto f = make_fixture();
  Buffer buffer(kBackwardBytes);
  ForwardArgs args = test::forward_args(f->inputs, f->outputs);
  args.workspace = {buffer.aligned(), kForwardBytes - 1};
  const std::string forward = invalid_message([&] { f->plan.forward(args); });
  EXPECT_NE(forward.find("999 bytes lent; this plan's forward needs 1000"), std::string::npos)
      << forward;
  BackwardArgs bargs = test::backward_args(f->inputs, f->outputs);
  bargs.workspace = {buffer.aligned(), kForwardBytes};  // enough for the forward only
  const std::string backward = invalid_message([&] { f->plan.backward(bargs); });
  EXPECT_NE(backward.find("1000 bytes lent; this plan's backward needs 4096"), std::string::npos)
      << backward;
  EXPECT_TRUE(f->plan.lent.empty());
}

TEST(Workspace, AMisalignedOrNullWorkspaceIsRefused) {
  const auto f = make_fixture();
  Buffer buffer(kBackwardBytes);
  ForwardArgs args = test::forward_args(f->inputs, f->outputs);
  args.workspace = {buffer.aligned() + 16, kBackwardBytes};
  EXPECT_NE(invalid_message([&] { f->plan.forward(args); }).find("not 256-byte aligned"),
            std::string::npos);
  args.workspace = {nullptr, kBackwardBytes};
  EXPECT_NE(invalid_message([&] { f->plan.forward(args); }).find("at a null pointer"),
            std::string::npos);
  EXPECT_TRUE(f->plan.lent.empty());
}

TEST(Workspace, NoWorkspaceLeavesTheChoiceToTheEngine) {
  const auto f = make_fixture();
  f->plan.forward(test::forward_args(f->inputs, f->outputs));
  ASSERT_EQ(f->plan.lent.size(), 1U);
  EXPECT_EQ(f->plan.lent[0].data, nullptr);
}

// The CPU engines use no device scratch: 0 bytes, and a lent workspace or allocator changes
// nothing (the allocator is never asked).
TEST(Workspace, CpuEnginesNeedNoneAndIgnoreWhatTheyAreLent) {
  for (const std::string name : {"cpu", "cpu_ref"}) {
    SCOPED_TRACE(name);
    const std::shared_ptr<const Engine> engine = test::builtin_engine(name);
    ASSERT_NE(engine, nullptr);
    ProblemDesc desc = test::catalogue_desc({"softcap", "causal"}, ProblemDesc{});
    desc.batch = 1, desc.heads_q = 2, desc.heads_kv = 1, desc.seq_len_q = 33, desc.seq_len_kv = 40;
    desc.head_dim_qk = 16, desc.head_dim_v = 16, desc.dtype = DType::kF32;
    desc.direction = Direction::kForwardBackward;
    const Problem problem(desc);
    const auto plan = engine->plan(problem);
    EXPECT_EQ(plan->workspace_bytes(Pass::kForward), 0U);
    EXPECT_EQ(plan->workspace_bytes(Pass::kBackward), 0U);
    const test::Inputs inputs = test::random_inputs(problem, 3);
    const test::Outputs expected = test::run_engine(*engine, problem, inputs);
    test::Outputs lent = test::run_engine(*engine, problem, inputs);  // shapes; overwritten below
    Buffer buffer(64);
    NeverAllocates allocator;
    ForwardArgs args = test::forward_args(inputs, lent);
    args.workspace = {buffer.aligned(), 64};
    args.allocator = &allocator;
    plan->forward(args);
    BackwardArgs bargs = test::backward_args(inputs, lent);
    bargs.allocator = &allocator;
    plan->backward(bargs);
    EXPECT_EQ(test::max_abs_error(lent.out, expected.out), 0.0);
    EXPECT_EQ(test::max_abs_error(lent.dq, expected.dq), 0.0);
    EXPECT_EQ(test::max_abs_error(lent.dk, expected.dk), 0.0);
    EXPECT_EQ(test::max_abs_error(lent.dv, expected.dv), 0.0);
  }
}

}  // namespace
}  // namespace flexattn
