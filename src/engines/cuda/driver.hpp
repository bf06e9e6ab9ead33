// The CUDA driver API, opened at run time. libcuda.so.1 exists only where an NVIDIA driver is
// installed, so the library never links it: a build with CUDA still loads on a machine without a
// GPU, and the engine then reports why it is unavailable. Every call is checked; a failure
// throws Error(kCuda) naming the call and the driver's error.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "flexattn/engine.hpp"

namespace flexattn::cuda {

// The driver entry points flexattn uses (resolved with dlsym; names are the ABI's, e.g. _v2).
struct DriverFunctions {
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDriverGetVersion) driver_get_version = nullptr;
  decltype(&::cuDeviceGetCount) device_get_count = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&::cuDeviceGetName) device_get_name = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) primary_context_retain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) primary_context_release = nullptr;
  decltype(&::cuCtxPushCurrent) context_push = nullptr;
  decltype(&::cuCtxPopCurrent) context_pop = nullptr;
  decltype(&::cuCtxSynchronize) context_synchronize = nullptr;
  decltype(&::cuModuleLoadData) module_load_data = nullptr;
  decltype(&::cuModuleUnload) module_unload = nullptr;
  decltype(&::cuModuleGetFunction) module_get_function = nullptr;
  decltype(&::cuFuncSetAttribute) function_set_attribute = nullptr;
  decltype(&::cuLaunchKernel) launch_kernel = nullptr;
  decltype(&::cuMemAlloc) memory_allocate = nullptr;
  decltype(&::cuMemFree) memory_free = nullptr;
  // Stream-ordered scratch of the backward pass (the stream's memory pool; CUDA 11.2 drivers on).
  decltype(&::cuMemAllocAsync) memory_allocate_async = nullptr;
  decltype(&::cuMemFreeAsync) memory_free_async = nullptr;
  decltype(&::cuMemsetD8Async) memset_d8_async = nullptr;
  // A second stream for the backward's dQ kernel.
  decltype(&::cuStreamCreate) stream_create = nullptr;
  decltype(&::cuStreamDestroy) stream_destroy = nullptr;
  decltype(&::cuEventCreate) event_create = nullptr;
  decltype(&::cuEventDestroy) event_destroy = nullptr;
  decltype(&::cuEventRecord) event_record = nullptr;
  decltype(&::cuStreamWaitEvent) stream_wait_event = nullptr;
  decltype(&::cuMemcpyHtoD) copy_host_to_device = nullptr;
  decltype(&::cuMemcpyDtoH) copy_device_to_host = nullptr;
  decltype(&::cuGetErrorName) get_error_name = nullptr;
  decltype(&::cuGetErrorString) get_error_string = nullptr;
};

// One device (ordinal 0) and its primary context, shared with the CUDA runtime, so streams and
// pointers from cudaMalloc / PyTorch are valid here.
class Driver {
 public:
  // Never throws: when libcuda is missing, cuInit fails or there is no device, the returned
  // driver is unavailable and `availability()` says why.
  static std::shared_ptr<const Driver> open();
  ~Driver();
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  const Support& availability() const { return availability_; }
  const DriverFunctions& api() const { return functions_; }
  CUcontext context() const { return context_; }
  // "sm_90"; compute capability 9.0 is 90.
  int compute_capability() const { return compute_capability_; }
  int driver_version() const { return driver_version_; }  // e.g. 13000
  const std::string& device_name() const { return device_name_; }
  int max_shared_memory_per_block() const { return max_shared_per_block_; }
  int multiprocessors() const { return multiprocessors_; }

  // Throws Error(kCuda, "<call> failed: <NAME>: <description>") unless result is CUDA_SUCCESS.
  void check(CUresult result, std::string_view call) const;

 private:
  Driver() = default;
  void initialise();

  void* library_ = nullptr;
  DriverFunctions functions_;
  Support availability_ = Support::no("not opened");
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  int compute_capability_ = 0;
  int driver_version_ = 0;
  int max_shared_per_block_ = 0;
  int multiprocessors_ = 0;
  std::string device_name_;
};

// Makes the driver's context current on this thread for the scope.
class ContextScope {
 public:
  explicit ContextScope(const Driver& driver);
  ~ContextScope();
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  const Driver& driver_;
};

// An owned device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::shared_ptr<const Driver> driver, std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  CUdeviceptr address() const { return address_; }
  void upload(const void* source, std::size_t bytes) const;

 private:
  void release() noexcept;
  std::shared_ptr<const Driver> driver_;
  CUdeviceptr address_ = 0;
};

// The device scratch of one call, from where its arguments say (ForwardArgs::workspace, then
// ::allocator), else from `fallback` when non-zero (memory the plan keeps), else from
// cuMemAllocAsync on the stream. Memory from the allocator or cuMemAllocAsync goes back
// stream-ordered: at release(), or in the destructor when the call ends early (an exception).
// Expects the driver's context current; `bytes` may be 0 (no memory, address 0).
class CallScratch {
 public:
  CallScratch(const Driver& driver, const Workspace& workspace, DeviceAllocator* allocator,
              std::size_t bytes, CUstream stream, CUdeviceptr fallback = 0);
  ~CallScratch();
  CallScratch(const CallScratch&) = delete;
  CallScratch& operator=(const CallScratch&) = delete;

  CUdeviceptr address() const { return address_; }
  // Gives back memory this call took (after the work enqueued on the stream so far).
  void release();

 private:
  enum class Source { kNone, kLent, kAllocator, kStreamOrdered };
  CUresult give_back() noexcept;

  const Driver& driver_;
  DeviceAllocator* allocator_;
  CUstream stream_;
  std::size_t bytes_;
  Source source_ = Source::kNone;
  CUdeviceptr address_ = 0;
};

// DeviceMemory for clients of the engine (tests, the CLI, the conformance runner).
class DriverMemory final : public DeviceMemory {
 public:
  explicit DriverMemory(std::shared_ptr<const Driver> driver) : driver_(std::move(driver)) {}
  void* allocate(std::size_t bytes) const override;
  void release(void* pointer) const noexcept override;
  void copy_to_device(void* destination, const void* source, std::size_t bytes) const override;
  void copy_to_host(void* destination, const void* source, std::size_t bytes) const override;
  void synchronize() const override;

 private:
  std::shared_ptr<const Driver> driver_;
};

}  // namespace flexattn::cuda
