#include "engines/cudnn/library.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <array>

#include "flexattn/error.hpp"

namespace flexattn::cudnn {
namespace {

constexpr const char* kLibraryName = "libcudnn.so.9";
// cuDNN's last-error messages are short; longer ones are cut.
constexpr std::size_t kErrorMessageCapacity = 1024;
// Status codes come in families of a thousand (3000-3999: not supported).
constexpr int kNotSupportedFirst = 3000;
constexpr int kNotSupportedLast = 3999;
constexpr std::size_t kVersionMajorUnit = 10000;
constexpr std::size_t kVersionMinorUnit = 100;

template <class Function>
bool resolve(void* library, const char* symbol, Function& function) {
  function = reinterpret_cast<Function>(dlsym(library, symbol));
  return function != nullptr;
}

}  // namespace

std::shared_ptr<const Library> Library::open() {
  std::shared_ptr<Library> library(new Library());
  library->initialise();
  return library;
}

void Library::initialise() {
  library_ = dlopen(kLibraryName, RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) {
    availability_ = Support::no(fmt::format("{} not found", kLibraryName));
    return;
  }
  Functions& f = functions_;
  const bool resolved = resolve(library_, "cudnnGetVersion", f.get_version) &&
                        resolve(library_, "cudnnGetErrorString", f.get_error_string) &&
                        resolve(library_, "cudnnGetLastErrorString", f.get_last_error_string) &&
                        resolve(library_, "cudnnCreate", f.create) &&
                        resolve(library_, "cudnnDestroy", f.destroy) &&
                        resolve(library_, "cudnnSetStream", f.set_stream) &&
                        resolve(library_, "cudnnBackendCreateDescriptor", f.create_descriptor) &&
                        resolve(library_, "cudnnBackendDestroyDescriptor", f.destroy_descriptor) &&
                        resolve(library_, "cudnnBackendSetAttribute", f.set_attribute) &&
                        resolve(library_, "cudnnBackendGetAttribute", f.get_attribute) &&
                        resolve(library_, "cudnnBackendFinalize", f.finalize) &&
                        resolve(library_, "cudnnBackendExecute", f.execute);
  if (!resolved) {
    availability_ =
        Support::no(fmt::format("{} lacks a backend entry point: {}", kLibraryName, dlerror()));
    return;
  }
  version_ = f.get_version();
  availability_ = Support::yes();
}

std::string Library::version_text() const {
  return fmt::format("{}.{}.{}", version_ / kVersionMajorUnit,
                     (version_ % kVersionMajorUnit) / kVersionMinorUnit,
                     version_ % kVersionMinorUnit);
}

std::string Library::describe(cudnnStatus_t status) const {
  const char* name = functions_.get_error_string != nullptr ? functions_.get_error_string(status)
                                                            : "unknown status";
  std::array<char, kErrorMessageCapacity> message{};
  if (functions_.get_last_error_string != nullptr) {
    functions_.get_last_error_string(message.data(), message.size());
  }
  if (message[0] == '\0') return fmt::format("{} ({})", name, static_cast<int>(status));
  return fmt::format("{} ({}): {}", name, static_cast<int>(status), message.data());
}

void Library::check(cudnnStatus_t status, std::string_view step) const {
  if (status == CUDNN_STATUS_SUCCESS) return;
  throw Error(ErrorCode::kCudnn, fmt::format("cuDNN {} failed: {}", step, describe(status)));
}

bool is_not_supported(cudnnStatus_t status) {
  const int code = static_cast<int>(status);
  return code >= kNotSupportedFirst && code <= kNotSupportedLast;
}

}  // namespace flexattn::cudnn
