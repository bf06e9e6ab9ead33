// Device helpers for test_cudnn.cpp: host tensors copied to an engine's device, and the timing of
// the benchmark shape with CUDA events (the driver API, opened at run time like the engines do).
#pragma once

#include <cuda.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

namespace flexattn::test {

// A host tensor copied to the engine's device.
class DeviceCopy {
 public:
  DeviceCopy(const DeviceMemory& memory, const HostTensor& host)
      : memory_(memory), host_(host.to(host.dtype())) {
    data_ = memory_.allocate(host_.bytes());
    memory_.copy_to_device(data_, host_.data(), host_.bytes());
  }
  ~DeviceCopy() { memory_.release(data_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;

  TensorView view() const {
    TensorView view = host_.view();
    view.data = data_;
    view.device = Device::kCuda;
    return view;
  }
  HostTensor fetch() {
    memory_.synchronize();
    memory_.copy_to_host(host_.data(), data_, host_.bytes());
    return host_.to(host_.dtype());
  }

 private:
  const DeviceMemory& memory_;
  HostTensor host_;
  void* data_ = nullptr;
};

// CUDA events on the legacy default stream, where the plans run when no stream is given.
class EventTimer {
 public:
  EventTimer() {
    library_ = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library_ == nullptr) return;
    const auto resolve = [&](const char* symbol, auto& function) {
      function =
          reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(library_, symbol));
      return function != nullptr;
    };
    ok_ = resolve("cuDevicePrimaryCtxRetain", retain_) && resolve("cuDeviceGet", device_get_) &&
          resolve("cuCtxPushCurrent_v2", push_) && resolve("cuCtxPopCurrent_v2", pop_) &&
          resolve("cuEventCreate", create_) && resolve("cuEventRecord", record_) &&
          resolve("cuEventSynchronize", synchronize_) && resolve("cuEventDestroy_v2", destroy_) &&
          (resolve("cuEventElapsedTime_v2", elapsed_) || resolve("cuEventElapsedTime", elapsed_));
    CUdevice device = 0;
    ok_ = ok_ && device_get_(&device, 0) == CUDA_SUCCESS &&
          retain_(&context_, device) == CUDA_SUCCESS && push_(context_) == CUDA_SUCCESS &&
          create_(&start_, CU_EVENT_DEFAULT) == CUDA_SUCCESS &&
          create_(&stop_, CU_EVENT_DEFAULT) == CUDA_SUCCESS;
  }
  ~EventTimer() {
    if (start_ != nullptr) destroy_(start_);
    if (stop_ != nullptr) destroy_(stop_);
    CUcontext popped = nullptr;
    if (context_ != nullptr) pop_(&popped);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  bool ok() const { return ok_; }
  // Median milliseconds of `repeats` timed calls after `warmups` untimed ones.
  template <class Work>
  double median_ms(Work work, int warmups, int repeats) {
    for (int i = 0; i < warmups; ++i) work();
    std::vector<double> times;
    for (int i = 0; i < repeats; ++i) {
      record_(start_, nullptr);
      work();
      record_(stop_, nullptr);
      synchronize_(stop_);
      float ms = 0.0F;
      elapsed_(&ms, start_, stop_);
      times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

 private:
  void* library_ = nullptr;
  bool ok_ = false;
  CUcontext context_ = nullptr;
  CUevent start_ = nullptr, stop_ = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) retain_ = nullptr;
  decltype(&::cuDeviceGet) device_get_ = nullptr;
  decltype(&::cuCtxPushCurrent) push_ = nullptr;
  decltype(&::cuCtxPopCurrent) pop_ = nullptr;
  decltype(&::cuEventCreate) create_ = nullptr;
  decltype(&::cuEventRecord) record_ = nullptr;
  decltype(&::cuEventSynchronize) synchronize_ = nullptr;
  decltype(&::cuEventDestroy) destroy_ = nullptr;
  decltype(&::cuEventElapsedTime) elapsed_ = nullptr;
};

// bf16, batch 4, heads 16, seq 4096, head dim 128, bshd: the shape of the peers table in
// ../shared/peers/README.md. Prints TFLOP/s (median of CUDA-event timings) per variant.
inline void time_benchmark_shape(const Engine& engine) {
  constexpr std::int64_t kBatch = 4, kHeads = 16, kSeq = 4096, kHeadDim = 128;
  constexpr int kWarmups = 3, kRepeats = 20;
  constexpr double kMillisecondsPerSecond = 1e3, kTera = 1e12;
  EventTimer timer;
  ASSERT_TRUE(timer.ok()) << "CUDA events unavailable";
  const DeviceMemory& memory = *engine.memory();
  struct Variant {
    std::string label;
    std::vector<std::string> modifiers;
    double kept;
  };
  const std::vector<Variant> variants = {{"none", {}, 1.0},
                                         {"softcap30", {"softcap"}, 1.0},
                                         {"alibi", {"alibi"}, 1.0},
                                         {"causal", {"causal"}, 0.5}};
  ProblemDesc base;
  base.batch = kBatch;
  base.heads_q = kHeads;
  base.seq_len_q = kSeq;
  base.head_dim_qk = kHeadDim;
  base.dtype = DType::kBF16;
  base.device = Device::kCuda;
  // One set of random inputs for every variant (filling them on the host is the slow part).
  const Inputs inputs = random_inputs(Problem(base), 1);
  DeviceCopy q(memory, inputs.q), k(memory, inputs.k), v(memory, inputs.v);
  DeviceCopy dout(memory, inputs.dout);
  DeviceCopy out(memory, HostTensor(DType::kBF16, inputs.dout.shape()));
  CatalogueDims dims;
  dims.batch = kBatch;
  dims.heads_q = kHeads;
  dims.seq_len_q = dims.seq_len_kv = kSeq;
  for (Direction direction : {Direction::kForward, Direction::kForwardBackward}) {
    for (const Variant& variant : variants) {
      base.direction = direction;
      const Problem problem(catalogue_desc(variant.modifiers, base));
      const std::string pass = direction == Direction::kForward ? "fwd" : "fwd+bwd";
      if (Support support = engine.supports(problem); !support) {
        std::printf("[cudnn timing] %s %s: refused: %s\n", variant.label.c_str(), pass.c_str(),
                    support.reason().c_str());
        continue;
      }
      const std::unique_ptr<Plan> plan = engine.plan(problem);
      DeviceCopy lse(memory, HostTensor(DType::kF32, problem.expected("lse").shape));
      std::map<std::string, std::unique_ptr<DeviceCopy>> tensors;
      ForwardArgs args{q.view(), k.view(), v.view(), out.view(), lse.view(), {}, nullptr};
      for (const std::string& name : variant.modifiers) {
        const NamedModifier& modifier = find_modifier(name);
        for (const CatalogueTensor& tensor : modifier.tensors) {
          tensors.emplace(tensor.name,
                          std::make_unique<DeviceCopy>(
                              memory, make_catalogue_tensor(modifier, tensor, dims, 1)));
          args.tensors[tensor.name] = tensors.at(tensor.name)->view();
        }
      }
      const double forward_ms = timer.median_ms([&] { plan->forward(args); }, kWarmups, kRepeats);
      double total_ms = forward_ms;
      std::string backward_text;
      if (problem.wants_backward()) {
        DeviceCopy dq(memory, HostTensor(DType::kBF16, problem.expected("q").shape));
        DeviceCopy dk(memory, HostTensor(DType::kBF16, problem.expected("k").shape));
        DeviceCopy dv(memory, HostTensor(DType::kBF16, problem.expected("v").shape));
        BackwardArgs bargs;
        bargs.q = q.view(), bargs.k = k.view(), bargs.v = v.view();
        bargs.out = out.view(), bargs.lse = lse.view(), bargs.dout = dout.view();
        bargs.dq = dq.view(), bargs.dk = dk.view(), bargs.dv = dv.view();
        bargs.tensors = args.tensors;
        const double backward_ms =
            timer.median_ms([&] { plan->backward(bargs); }, kWarmups, kRepeats);
        total_ms += backward_ms;
        backward_text = fmt::format(", backward {:.3f} ms", backward_ms);
      }
      const double tflops =
          attention_flops(problem, variant.kept) / (total_ms / kMillisecondsPerSecond) / kTera;
      std::printf("[cudnn timing] %-10s %-7s %7.1f TFLOP/s (forward %.3f ms%s) engine: %s\n",
                  variant.label.c_str(), pass.c_str(), tflops, forward_ms, backward_text.c_str(),
                  plan->info().description.c_str());
      EXPECT_GT(tflops, 0.0);
    }
  }
}

}  // namespace flexattn::test
