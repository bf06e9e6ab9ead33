// Names of the error codes (used in CLI output and log lines).
#include "flexattn/error.hpp"

namespace flexattn {

std::string_view to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kCuda:
      return "CUDA error";
    case ErrorCode::kCudnn:
      return "cuDNN error";
    case ErrorCode::kCompile:
      return "compile error";
    case ErrorCode::kIo:
      return "I/O error";
    case ErrorCode::kInternal:
      return "internal error";
  }
  return "unknown error";
}

}  // namespace flexattn
