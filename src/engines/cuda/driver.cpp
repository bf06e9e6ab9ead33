#include "engines/cuda/driver.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <array>

#include "flexattn/error.hpp"

namespace flexattn::cuda {
namespace {

constexpr const char* kDriverLibrary = "libcuda.so.1";
constexpr int kDeviceOrdinal = 0;
constexpr std::size_t kDeviceNameCapacity = 256;

template <class Function>
bool resolve(void* library, const char* symbol, Function& function) {
  function = reinterpret_cast<Function>(dlsym(library, symbol));
  return function != nullptr;
}

}  // namespace

std::shared_ptr<const Driver> Driver::open() {
  std::shared_ptr<Driver> driver(new Driver());
  driver->initialise();
  return driver;
}

void Driver::initialise() {
  library_ = dlopen(kDriverLibrary, RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) {
    availability_ = Support::no(fmt::format("no CUDA device ({} not found)", kDriverLibrary));
    return;
  }
  DriverFunctions& f = functions_;
  const bool resolved =
      resolve(library_, "cuInit", f.init) &&
      resolve(library_, "cuDriverGetVersion", f.driver_get_version) &&
      resolve(library_, "cuDeviceGetCount", f.device_get_count) &&
      resolve(library_, "cuDeviceGet", f.device_get) &&
      resolve(library_, "cuDeviceGetAttribute", f.device_get_attribute) &&
      resolve(library_, "cuDeviceGetName", f.device_get_name) &&
      resolve(library_, "cuDevicePrimaryCtxRetain", f.primary_context_retain) &&
      resolve(library_, "cuDevicePrimaryCtxRelease_v2", f.primary_context_release) &&
      resolve(library_, "cuCtxPushCurrent_v2", f.context_push) &&
      resolve(library_, "cuCtxPopCurrent_v2", f.context_pop) &&
      resolve(library_, "cuCtxSynchronize", f.context_synchronize) &&
      resolve(library_, "cuModuleLoadData", f.module_load_data) &&
      resolve(library_, "cuModuleUnload", f.module_unload) &&
      resolve(library_, "cuModuleGetFunction", f.module_get_function) &&
      resolve(library_, "cuFuncSetAttribute", f.function_set_attribute) &&
      resolve(library_, "cuLaunchKernel", f.launch_kernel) &&
      resolve(library_, "cuMemAlloc_v2", f.memory_allocate) &&
      resolve(library_, "cuMemFree_v2", f.memory_free) &&
      resolve(library_, "cuMemAllocAsync", f.memory_allocate_async) &&
      resolve(library_, "cuMemFreeAsync", f.memory_free_async) &&
      resolve(library_, "cuMemsetD8Async", f.memset_d8_async) &&
      resolve(library_, "cuStreamCreate", f.stream_create) &&
      resolve(library_, "cuStreamDestroy_v2", f.stream_destroy) &&
      resolve(library_, "cuEventCreate", f.event_create) &&
      resolve(library_, "cuEventDestroy_v2", f.event_destroy) &&
      resolve(library_, "cuEventRecord", f.event_record) &&
      resolve(library_, "cuStreamWaitEvent", f.stream_wait_event) &&
      resolve(library_, "cuMemcpyHtoD_v2", f.copy_host_to_device) &&
      resolve(library_, "cuMemcpyDtoH_v2", f.copy_device_to_host) &&
      resolve(library_, "cuGetErrorName", f.get_error_name) &&
      resolve(library_, "cuGetErrorString", f.get_error_string);
  if (!resolved) {
    availability_ = Support::no(fmt::format("no CUDA device ({} lacks a driver entry point: {})",
                                            kDriverLibrary, dlerror()));
    return;
  }
  const CUresult init = f.init(0);
  if (init != CUDA_SUCCESS) {
    const char* name = nullptr;
    f.get_error_name(init, &name);
    availability_ = Support::no(
        fmt::format("no CUDA device (cuInit: {})", name != nullptr ? name : "unknown error"));
    return;
  }
  int count = 0;
  if (f.device_get_count(&count) != CUDA_SUCCESS || count == 0) {
    availability_ = Support::no("no CUDA device (the driver lists none)");
    return;
  }
  try {
    check(f.device_get(&device_, kDeviceOrdinal), "cuDeviceGet");
    int major = 0;
    int minor = 0;
    check(f.device_get_attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_),
          "cuDeviceGetAttribute");
    check(f.device_get_attribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_),
          "cuDeviceGetAttribute");
    compute_capability_ = major * 10 + minor;
    check(f.device_get_attribute(&max_shared_per_block_,
                                 CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device_),
          "cuDeviceGetAttribute");
    check(f.device_get_attribute(&multiprocessors_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                 device_),
          "cuDeviceGetAttribute");
    check(f.driver_get_version(&driver_version_), "cuDriverGetVersion");
    std::array<char, kDeviceNameCapacity> name{};
    check(f.device_get_name(name.data(), static_cast<int>(name.size()), device_),
          "cuDeviceGetName");
    device_name_ = name.data();
    check(f.primary_context_retain(&context_, device_), "cuDevicePrimaryCtxRetain");
  } catch (const Error& error) {
    availability_ = Support::no(fmt::format("CUDA device unusable: {}", error.what()));
    return;
  }
  // mma.sync bf16, ldmatrix and cp.async need compute capability 8.0.
  constexpr int kMinimumCapability = 80;
  if (compute_capability_ < kMinimumCapability) {
    availability_ = Support::no(fmt::format("{} is sm_{}; the cuda engine needs sm_80 or newer",
                                            device_name_, compute_capability_));
    return;
  }
  availability_ = Support::yes();
}

Driver::~Driver() {
  if (context_ != nullptr) functions_.primary_context_release(device_);
  // libcuda stays loaded: unloading a driver library while modules may live is never safe.
}

void Driver::check(CUresult result, std::string_view call) const {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* description = nullptr;
  if (functions_.get_error_name != nullptr) functions_.get_error_name(result, &name);
  if (functions_.get_error_string != nullptr) functions_.get_error_string(result, &description);
  throw Error(ErrorCode::kCuda,
              fmt::format("{} failed: {} ({})", call, name != nullptr ? name : "unknown error",
                          description != nullptr ? description : "no description"));
}

ContextScope::ContextScope(const Driver& driver) : driver_(driver) {
  driver_.check(driver_.api().context_push(driver_.context()), "cuCtxPushCurrent");
}

ContextScope::~ContextScope() {
  CUcontext popped = nullptr;
  driver_.api().context_pop(&popped);
}

DeviceBuffer::DeviceBuffer(std::shared_ptr<const Driver> driver, std::size_t bytes)
    : driver_(std::move(driver)) {
  if (bytes == 0) return;
  ContextScope scope(*driver_);
  driver_->check(driver_->api().memory_allocate(&address_, bytes), "cuMemAlloc");
}

DeviceBuffer::~DeviceBuffer() { release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : driver_(std::move(other.driver_)), address_(other.address_) {
  other.address_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release();
    driver_ = std::move(other.driver_);
    address_ = other.address_;
    other.address_ = 0;
  }
  return *this;
}

void DeviceBuffer::release() noexcept {
  if (address_ == 0 || driver_ == nullptr) return;
  CUcontext popped = nullptr;
  if (driver_->api().context_push(driver_->context()) == CUDA_SUCCESS) {
    driver_->api().memory_free(address_);
    driver_->api().context_pop(&popped);
  }
  address_ = 0;
}

void DeviceBuffer::upload(const void* source, std::size_t bytes) const {
  if (bytes == 0) return;
  ContextScope scope(*driver_);
  driver_->check(driver_->api().copy_host_to_device(address_, source, bytes), "cuMemcpyHtoD");
}

CallScratch::CallScratch(const Driver& driver, const Workspace& workspace,
                         DeviceAllocator* allocator, std::size_t bytes, CUstream stream,
                         CUdeviceptr fallback)
    : driver_(driver), allocator_(allocator), stream_(stream), bytes_(bytes) {
  if (bytes == 0) return;
  if (workspace.data != nullptr) {  // Plan::forward/backward checked its size and alignment
    source_ = Source::kLent;
    address_ = reinterpret_cast<CUdeviceptr>(workspace.data);
  } else if (allocator != nullptr) {
    void* data = allocator->allocate(bytes, stream);
    if (data == nullptr) {
      throw_invalid(
          fmt::format("workspace: the caller's allocator returned null for {} bytes", bytes));
    }
    source_ = Source::kAllocator;
    address_ = reinterpret_cast<CUdeviceptr>(data);
    if (address_ % kWorkspaceAlignment != 0) {
      give_back();
      throw_invalid(
          fmt::format("workspace: the caller's allocator returned {}, not {}-byte "
                      "aligned",
                      data, kWorkspaceAlignment));
    }
  } else if (fallback != 0) {
    source_ = Source::kLent;
    address_ = fallback;
  } else {
    driver_.check(driver_.api().memory_allocate_async(&address_, bytes, stream_),
                  "cuMemAllocAsync");
    source_ = Source::kStreamOrdered;
  }
}

CallScratch::~CallScratch() { give_back(); }

void CallScratch::release() { driver_.check(give_back(), "cuMemFreeAsync"); }

CUresult CallScratch::give_back() noexcept {
  const Source source = source_;
  const CUdeviceptr address = address_;
  source_ = Source::kNone;
  address_ = 0;
  switch (source) {
    case Source::kAllocator:
      allocator_->release(reinterpret_cast<void*>(address), bytes_, stream_);
      return CUDA_SUCCESS;
    case Source::kStreamOrdered:
      return driver_.api().memory_free_async(address, stream_);
    case Source::kNone:
    case Source::kLent:
      break;
  }
  return CUDA_SUCCESS;
}

void* DriverMemory::allocate(std::size_t bytes) const {
  ContextScope scope(*driver_);
  CUdeviceptr address = 0;
  driver_->check(driver_->api().memory_allocate(&address, bytes == 0 ? 1 : bytes), "cuMemAlloc");
  return reinterpret_cast<void*>(address);
}

void DriverMemory::release(void* pointer) const noexcept {
  if (pointer == nullptr) return;
  CUcontext popped = nullptr;
  if (driver_->api().context_push(driver_->context()) == CUDA_SUCCESS) {
    driver_->api().memory_free(reinterpret_cast<CUdeviceptr>(pointer));
    driver_->api().context_pop(&popped);
  }
}

void DriverMemory::copy_to_device(void* destination, const void* source, std::size_t bytes) const {
  ContextScope scope(*driver_);
  driver_->check(
      driver_->api().copy_host_to_device(reinterpret_cast<CUdeviceptr>(destination), source, bytes),
      "cuMemcpyHtoD");
}

void DriverMemory::copy_to_host(void* destination, const void* source, std::size_t bytes) const {
  ContextScope scope(*driver_);
  driver_->check(
      driver_->api().copy_device_to_host(destination, reinterpret_cast<CUdeviceptr>(source), bytes),
      "cuMemcpyDtoH");
}

void DriverMemory::synchronize() const {
  ContextScope scope(*driver_);
  driver_->check(driver_->api().context_synchronize(), "cuCtxSynchronize");
}

}  // namespace flexattn::cuda
