// NumPy .npy files: the exchange format of the golden data, the CLI and the benchmarks.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "flexattn/export.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn {

// Reads a C-order, little-endian .npy file (format versions 1, 2 and 3) of dtype <f8, <f4, <f2,
// <i4 or <i8. Any other dtype, Fortran order, or a malformed or truncated file throws
// Error(kInvalidArgument) with a one-line message naming the file.
FLEXATTN_API HostTensor read_npy(const std::string& path);

// Writes `tensor` as a .npy file, atomically (OutputFiles of one file). bf16 has no NumPy dtype:
// convert first.
FLEXATTN_API void write_npy(const std::string& path, const HostTensor& tensor);

// Output files written all or nothing. add_npy() (a tensor as .npy) and add_bytes() write a
// file's contents to a new temporary file in its destination's folder (created exclusively, under
// a random name starting with '.'); commit() renames every temporary into place once all of them
// are complete. Until commit() succeeds no destination changes: a failed add or commit() and a set
// destroyed without commit() remove every temporary, and a rename that fails during commit() puts
// back every file already replaced (from a hard link taken before the first rename; where the file
// system refuses hard links, that file cannot be put back and the error says so). A process killed
// during commit()'s renames can leave some files replaced and temporaries behind. A destination
// that is a symbolic link is written through (its target is replaced); one that exists and is not a
// regular file (a device, a FIFO, a folder) is refused, since it would be replaced rather than
// written. A replaced file keeps its permission bits; a new one gets 0666 less the umask. Errors:
// kInvalidArgument for a destination refused up front, kIo for what the system refuses (a full
// disk, permissions).
class FLEXATTN_API OutputFiles {
 public:
  OutputFiles() = default;
  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;
  ~OutputFiles();

  void add_npy(const std::string& path, const HostTensor& tensor);
  void add_bytes(const std::string& path, std::string_view bytes);
  void commit();

 private:
  void add_parts(const std::string& path, std::initializer_list<std::string_view> parts);

  struct Entry {
    std::string path;         // as given, for messages
    std::string destination;  // symbolic links resolved
    std::string temporary;
    std::string backup;     // a hard link to the replaced file during commit(), or empty
    bool replaces = false;  // the destination existed
  };
  std::vector<Entry> entries_;
  bool committed_ = false;
};

// Throws Error(kInvalidArgument), naming `path`, unless OutputFiles can write it: its folder
// exists, and it does not exist or is a regular file (links resolved).
FLEXATTN_API void check_output_file(const std::string& path);

// The file `path` names once symbolic links are resolved (also when it does not exist yet: its
// folder's resolved path and its name), for comparing outputs with each other and with inputs.
FLEXATTN_API std::string resolved_file(const std::string& path);

}  // namespace flexattn
