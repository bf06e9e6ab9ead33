// NumPy .npy files: the exchange format of the golden data, the CLI and the benchmarks.
#pragma once

#include <string>

#include "flexattn/tensor.hpp"

namespace flexattn {

// Reads a C-order, little-endian .npy file (format versions 1, 2 and 3) of dtype <f8, <f4, <f2,
// <i4 or <i8. Any other dtype, Fortran order, or a malformed or truncated file throws
// Error(kInvalidArgument) with a one-line message naming the file.
HostTensor read_npy(const std::string& path);

// Writes `tensor` as a .npy file, atomically: the data goes to a temporary file next to `path`
// that is renamed over it, and removed on any error. bf16 has no NumPy dtype: convert first.
void write_npy(const std::string& path, const HostTensor& tensor);

}  // namespace flexattn
