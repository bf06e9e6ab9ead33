// Helpers shared by the cuda engine's device tests (test_cuda_forward.cpp,
// test_cuda_backward.cpp): the engine when a device is usable, host tensors copied to the device
// (outputs poisoned with NaN so an element never written fails), and the golden data's
// conventions (LSE regrouping, rounding floors).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

namespace flexattn::test {

// The cuda engine when this machine can run it, else null.
inline std::shared_ptr<const Engine> device_engine() {
  const std::shared_ptr<const Engine> engine = builtin_engine("cuda");
  if (engine == nullptr || !engine->available()) return nullptr;
  return engine;
}

#define SKIP_WITHOUT_DEVICE()                           \
  do {                                                  \
    if (::flexattn::test::device_engine() == nullptr) { \
      GTEST_SKIP() << "no usable CUDA device";          \
    }                                                   \
  } while (false)

// A device copy of a host tensor (or an output filled with NaN bytes, so unwritten elements fail).
class DeviceTensor {
 public:
  DeviceTensor(const DeviceMemory& memory, const HostTensor& host, bool poison = false)
      : memory_(memory), host_(host.to(host.dtype())) {
    pointer_ = memory_.allocate(host_.bytes());
    if (poison) {
      std::vector<unsigned char> nan_bytes(host_.bytes(), 0xff);  // NaN in every float dtype
      memory_.copy_to_device(pointer_, nan_bytes.data(), nan_bytes.size());
    } else {
      memory_.copy_to_device(pointer_, host_.data(), host_.bytes());
    }
  }
  ~DeviceTensor() { memory_.release(pointer_); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  TensorView view() const {
    TensorView view = host_.view();
    view.data = pointer_;
    view.device = Device::kCuda;
    return view;
  }
  HostTensor download() {
    memory_.synchronize();
    memory_.copy_to_host(host_.data(), pointer_, host_.bytes());
    return host_.to(host_.dtype());
  }

 private:
  const DeviceMemory& memory_;
  HostTensor host_;
  void* pointer_ = nullptr;
};

// One rounding in `dtype`, relative: the tolerance floor of an output stored in it.
inline double epsilon(DType dtype) {
  if (dtype == DType::kBF16) return 0x1p-7;
  if (dtype == DType::kF16) return 0x1p-10;
  return std::numeric_limits<float>::epsilon();
}

// The golden cases, each in every layout and storage dtype the engine serves.
using GoldenParam = std::tuple<std::string, Layout, DType>;
inline std::vector<GoldenParam> golden_params() {
  std::vector<std::string> names = golden_case_names();
  if (names.empty()) names.push_back("missing");  // one test that reports the missing data
  std::vector<GoldenParam> params;
  for (const std::string& name : names) {
    for (Layout layout : {Layout::kBSHD, Layout::kSBHD, Layout::kBHSD, Layout::kTHD}) {
      for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
        params.emplace_back(name, layout, dtype);
      }
    }
  }
  return params;
}
inline std::string golden_name(const ::testing::TestParamInfo<GoldenParam>& info) {
  return std::get<0>(info.param) + "_" + std::string(to_string(std::get<1>(info.param))) + "_" +
         std::string(to_string(std::get<2>(info.param)));
}

}  // namespace flexattn::test
