// cuDNN, opened at run time. libcudnn.so.9 exists only where cuDNN is installed, so the library
// never links it: a build with cuDNN headers still loads on a machine without it, and the engine
// then reports why it is unavailable. Every call is checked; a failure throws Error(kCudnn)
// naming the failing step, the status and cuDNN's own last error message.
#pragma once

#include <cudnn_graph.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "flexattn/engine.hpp"

namespace flexattn::cudnn {

// The entry points the engine uses (resolved with dlsym).
struct Functions {
  decltype(&::cudnnGetVersion) get_version = nullptr;
  decltype(&::cudnnGetErrorString) get_error_string = nullptr;
  decltype(&::cudnnGetLastErrorString) get_last_error_string = nullptr;
  decltype(&::cudnnCreate) create = nullptr;
  decltype(&::cudnnDestroy) destroy = nullptr;
  decltype(&::cudnnSetStream) set_stream = nullptr;
  decltype(&::cudnnBackendCreateDescriptor) create_descriptor = nullptr;
  decltype(&::cudnnBackendDestroyDescriptor) destroy_descriptor = nullptr;
  decltype(&::cudnnBackendSetAttribute) set_attribute = nullptr;
  decltype(&::cudnnBackendGetAttribute) get_attribute = nullptr;
  decltype(&::cudnnBackendFinalize) finalize = nullptr;
  decltype(&::cudnnBackendExecute) execute = nullptr;
};

class Library {
 public:
  // Never throws: when libcudnn.so.9 is missing or lacks an entry point, the returned library is
  // unavailable and `availability()` says why.
  static std::shared_ptr<const Library> open();
  // libcudnn stays loaded: plans and descriptors may outlive any one Library object.
  ~Library() = default;
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;

  const Support& availability() const { return availability_; }
  const Functions& api() const { return functions_; }
  // cudnnGetVersion(): major * 10000 + minor * 100 + patch (9.19.0 is 91900).
  std::size_t version() const { return version_; }
  std::string version_text() const;  // "9.19.0"

  // "CUDNN_STATUS_BAD_PARAM (<cuDNN's last error message>)".
  std::string describe(cudnnStatus_t status) const;
  // Throws Error(kCudnn, "cuDNN <step> failed: <describe(status)>") unless status is SUCCESS.
  void check(cudnnStatus_t status, std::string_view step) const;

 private:
  Library() = default;
  void initialise();

  void* library_ = nullptr;
  Functions functions_;
  Support availability_ = Support::no("not opened");
  std::size_t version_ = 0;
};

// True for the CUDNN_STATUS_NOT_SUPPORTED family (a configuration cuDNN declines, as opposed to a
// malformed request).
bool is_not_supported(cudnnStatus_t status);

}  // namespace flexattn::cudnn
