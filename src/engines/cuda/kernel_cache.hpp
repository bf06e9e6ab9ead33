// Run-time compilation of the generated kernels (NVRTC) and their two caches: in memory (per
// engine instance) and on disk ($FLEXATTN_CACHE_DIR, else $XDG_CACHE_HOME/flexattn, else
// ~/.cache/flexattn), keyed by the generated source, the architecture and the NVRTC and driver
// versions. Disk entries are written to a temporary file and renamed into place (safe against
// concurrent processes); an entry whose header or checksum does not match is recompiled.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "engines/cuda/driver.hpp"

namespace flexattn::cuda {

// Compiles `source` to a cubin for compute capability `capability` (e.g. 90; `suffix` "a" for
// the architecture-specific target sm_90a that wgmma needs), with the macro `define` defined when
// it is not empty. Needs no GPU. Safe to call from several threads at once (NVRTC compiles
// separate programs concurrently).
// Throws Error(kCompile) with NVRTC's log and the source name on failure.
std::vector<char> compile_to_cubin(const std::string& source, const std::string& source_name,
                                   int capability, std::string_view suffix = "",
                                   std::string_view define = "");
// "13.0"
std::string nvrtc_version();
// Whether NVRTC (opened at run time, like the driver) can be used, and why not.
Support nvrtc_availability();
// Where compiled kernels are kept; empty when no directory can be determined.
std::filesystem::path cache_directory();

// A kernel of the module and the dynamic shared memory it is launched with.
struct KernelFunction {
  std::string name;
  int shared_bytes = 0;
  // Ask for the largest shared-memory carveout (several blocks of a large dynamic shared memory
  // per multiprocessor); otherwise the driver's default.
  bool max_shared_carveout = false;
};

// A loaded module holding the generated kernels.
class CompiledKernel {
 public:
  CompiledKernel(std::shared_ptr<const Driver> driver, const std::vector<char>& cubin,
                 const std::vector<KernelFunction>& functions);
  ~CompiledKernel();
  CompiledKernel(const CompiledKernel&) = delete;
  CompiledKernel& operator=(const CompiledKernel&) = delete;
  // The kernel `name` (one of those it was loaded with); throws Error(kInternal) otherwise.
  CUfunction function(std::string_view name) const;

 private:
  std::shared_ptr<const Driver> driver_;
  CUmodule module_ = nullptr;
  std::map<std::string, CUfunction, std::less<>> functions_;
};

struct KernelLookup {
  std::shared_ptr<const CompiledKernel> kernel;
  std::string key;     // 32 hex digits
  std::string origin;  // "memory cache", "disk cache", "compiled (NVRTC)"
  double seconds = 0.0;  // time to obtain it (compile + load, or read + load)
};

class KernelCache {
 public:
  explicit KernelCache(std::shared_ptr<const Driver> driver) : driver_(std::move(driver)) {}
  // The module of `source` (with the macro `define` defined, when not empty) compiled for the
  // device's architecture plus `suffix` ("a": sm_90a), with each of `functions` set up for its
  // dynamic shared memory. Threads asking for different modules compile them at once; a thread
  // asking for a module another is compiling waits for it and shares it.
  KernelLookup get(const std::string& source, const std::vector<KernelFunction>& functions,
                   std::string_view suffix = "", std::string_view define = "");

 private:
  using Module = std::shared_ptr<const CompiledKernel>;
  std::shared_ptr<const Driver> driver_;
  std::mutex mutex_;
  std::map<std::string, Module> kernels_;
  // Modules being compiled or read, by key: the first asker's result, shared with later ones.
  std::map<std::string, std::shared_future<Module>> pending_;
};

}  // namespace flexattn::cuda
