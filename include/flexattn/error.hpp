// Errors: one exception type with a code. Library code never exits, aborts or prints-and-continues.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "flexattn/export.hpp"

namespace flexattn {

enum class ErrorCode {
  kInvalidArgument,  // bad shapes, names, expressions, files: the caller's input is wrong
  kUnsupported,      // valid request, but no (or not the forced) engine can compute it
  kCuda,             // a CUDA runtime/driver call failed
  kCudnn,            // a cuDNN call failed
  kCompile,          // run-time compilation (NVRTC) failed
  kIo,               // the system refused a file operation (disk full, permissions)
  kInternal,         // a broken invariant inside flexattn: a bug
};

FLEXATTN_API std::string_view to_string(ErrorCode code);

class FLEXATTN_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

[[noreturn]] inline void throw_invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}
[[noreturn]] inline void throw_unsupported(const std::string& message) {
  throw Error(ErrorCode::kUnsupported, message);
}
[[noreturn]] inline void throw_internal(const std::string& message) {
  throw Error(ErrorCode::kInternal, message);
}

}  // namespace flexattn
