#include "engines/cuda/kernel_cache.hpp"

#include <cuda.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nvrtc.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <iterator>
#include <random>
#include <system_error>

#include "flexattn/error.hpp"

namespace flexattn::cuda {
namespace {

// NVRTC, opened at run time like the driver (driver.cpp): a program linked against flexattn starts
// where the CUDA toolkit is not installed, and the cuda engine then says why it is unavailable.
// The library of the toolkit the engine was built with (its major version).
struct Nvrtc {
  Support availability = Support::no("not opened");
  decltype(&nvrtcVersion) version = nullptr;
  decltype(&nvrtcGetErrorString) error_string = nullptr;
  decltype(&nvrtcCreateProgram) create_program = nullptr;
  decltype(&nvrtcCompileProgram) compile_program = nullptr;
  decltype(&nvrtcGetProgramLogSize) program_log_size = nullptr;
  decltype(&nvrtcGetProgramLog) program_log = nullptr;
  decltype(&nvrtcGetCUBINSize) cubin_size = nullptr;
  decltype(&nvrtcGetCUBIN) cubin = nullptr;
  decltype(&nvrtcDestroyProgram) destroy_program = nullptr;
};

const Nvrtc& nvrtc() {
  static const Nvrtc api = [] {
    Nvrtc loaded;
    const std::string library = fmt::format("libnvrtc.so.{}", CUDA_VERSION / 1000);
    void* handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      loaded.availability = Support::no(
          fmt::format("{} not found (the cuda engine compiles its kernels with NVRTC when it "
                      "plans; install the CUDA toolkit's NVRTC or put it on LD_LIBRARY_PATH)",
                      library));
      return loaded;
    }
    std::string missing;
    const auto bind = [&](auto& function, const char* name) {
      function =
          reinterpret_cast<std::remove_reference_t<decltype(function)>>(::dlsym(handle, name));
      if (function == nullptr && missing.empty()) missing = name;
    };
    bind(loaded.version, "nvrtcVersion");
    bind(loaded.error_string, "nvrtcGetErrorString");
    bind(loaded.create_program, "nvrtcCreateProgram");
    bind(loaded.compile_program, "nvrtcCompileProgram");
    bind(loaded.program_log_size, "nvrtcGetProgramLogSize");
    bind(loaded.program_log, "nvrtcGetProgramLog");
    bind(loaded.cubin_size, "nvrtcGetCUBINSize");
    bind(loaded.cubin, "nvrtcGetCUBIN");
    bind(loaded.destroy_program, "nvrtcDestroyProgram");
    loaded.availability = missing.empty()
                              ? Support::yes()
                              : Support::no(fmt::format("{} has no {}", library, missing));
    return loaded;
  }();
  return api;
}

// NVRTC's functions, or kUnsupported with the reason it cannot be opened.
const Nvrtc& loaded_nvrtc() {
  const Nvrtc& api = nvrtc();
  if (!api.availability) throw_unsupported(fmt::format("cuda: {}", api.availability.reason()));
  return api;
}

// FNV-1a (64-bit) constants: offset basis and prime.
constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
constexpr std::uint64_t kFnvPrime = 0x100000001b3ULL;
// A second, independent offset basis for the upper half of the 128-bit key.
constexpr std::uint64_t kSecondOffset = 0x6c62272e07bb0142ULL;

std::uint64_t fnv1a(std::string_view bytes, std::uint64_t hash) {
  for (const char byte : bytes) {
    hash ^= static_cast<unsigned char>(byte);
    hash *= kFnvPrime;
  }
  return hash;
}

// The disk entry: a fixed header, then the cubin.
constexpr std::array<char, 8> kMagic = {'F', 'L', 'X', 'C', 'U', 'B', 'I', 'N'};
constexpr std::uint32_t kFormatVersion = 1;
constexpr std::size_t kKeyDigits = 32;
struct EntryHeader {
  std::array<char, 8> magic;
  std::uint32_t version;
  std::array<char, kKeyDigits> key;
  std::uint64_t payload_bytes;
  std::uint64_t payload_checksum;
};

std::uint64_t checksum(const std::vector<char>& payload) {
  return fnv1a(std::string_view(payload.data(), payload.size()), kFnvOffset);
}

void check_nvrtc(nvrtcResult result, const char* call) {
  if (result != NVRTC_SUCCESS) {
    throw Error(ErrorCode::kCompile,
                fmt::format("{} failed: {}", call, nvrtc().error_string(result)));
  }
}

// Reads a disk entry; empty when absent, truncated, corrupt or for another key.
std::vector<char> read_entry(const std::filesystem::path& path, const std::string& key) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return {};
  EntryHeader header{};
  file.read(reinterpret_cast<char*>(&header), sizeof(header));
  if (!file || header.magic != kMagic || header.version != kFormatVersion ||
      std::string_view(header.key.data(), header.key.size()) != key) {
    return {};
  }
  // A cubin of more than 256 MiB is no kernel of ours: treat the header as corrupt.
  constexpr std::uint64_t kMaxPayload = std::uint64_t{1} << 28;
  if (header.payload_bytes == 0 || header.payload_bytes > kMaxPayload) return {};
  std::vector<char> payload(header.payload_bytes);
  file.read(payload.data(), static_cast<std::streamsize>(payload.size()));
  if (!file || file.peek() != std::char_traits<char>::eof()) return {};
  if (checksum(payload) != header.payload_checksum) return {};
  return payload;
}

// Writes atomically: a uniquely named temporary file in the same folder, renamed over the entry.
// The cache is an optimisation, so failures leave no file and are not errors.
void write_entry(const std::filesystem::path& path, const std::string& key,
                 const std::vector<char>& payload) {
  EntryHeader header{};
  header.magic = kMagic;
  header.version = kFormatVersion;
  std::memcpy(header.key.data(), key.data(), kKeyDigits);
  header.payload_bytes = payload.size();
  header.payload_checksum = checksum(payload);
  std::random_device random;
  const std::filesystem::path temporary =
      path.string() + fmt::format(".tmp.{}.{:x}", static_cast<long>(getpid()), random());
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    file.write(reinterpret_cast<const char*>(&header), sizeof(header));
    file.write(payload.data(), static_cast<std::streamsize>(payload.size()));
    file.flush();
    if (!file) {
      std::error_code ignored;
      std::filesystem::remove(temporary, ignored);
      return;
    }
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) std::filesystem::remove(temporary, error);
}

// Keeps a failed translation unit next to the cache so the NVRTC log's line numbers can be read.
std::string keep_failed_source(const std::string& source, const std::string& name) {
  const std::filesystem::path directory = cache_directory();
  if (directory.empty()) return "";
  const std::filesystem::path path = directory / name;
  std::ofstream file(path, std::ios::trunc);
  file << source;
  return file ? path.string() : "";
}

}  // namespace

Support nvrtc_availability() { return nvrtc().availability; }

std::string nvrtc_version() {
  int major = 0;
  int minor = 0;
  check_nvrtc(loaded_nvrtc().version(&major, &minor), "nvrtcVersion");
  return fmt::format("{}.{}", major, minor);
}

std::filesystem::path cache_directory() {
  std::filesystem::path directory;
  if (const char* explicit_dir = std::getenv("FLEXATTN_CACHE_DIR");
      explicit_dir != nullptr && *explicit_dir != '\0') {
    directory = explicit_dir;
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    directory = std::filesystem::path(xdg) / "flexattn";
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    directory = std::filesystem::path(home) / ".cache" / "flexattn";
  } else {
    return {};
  }
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  return error ? std::filesystem::path() : directory;
}

std::vector<char> compile_to_cubin(const std::string& source, const std::string& source_name,
                                   int capability, std::string_view suffix,
                                   std::string_view define) {
  const Nvrtc& api = loaded_nvrtc();
  nvrtcProgram program = nullptr;
  check_nvrtc(
      api.create_program(&program, source.c_str(), source_name.c_str(), 0, nullptr, nullptr),
      "nvrtcCreateProgram");
  const std::string architecture = fmt::format("--gpu-architecture=sm_{}{}", capability, suffix);
  // --split-compile=0: NVRTC optimises and assembles the module's kernels on every core. The
  // SASS is the same instruction for instruction; a forward+backward module (five kernels:
  // head dim 128, softcap, sm_90a) compiled in 3.0 - 3.6 s with one thread and 1.9 - 2.3 s with
  // two (the 2-core development machine, 2026-12-03); a forward-only module (one kernel)
  // gains nothing.
  std::vector<const char*> options = {architecture.c_str(), "-std=c++17", "--split-compile=0"};
  const std::string macro = fmt::format("-D{}", define);
  if (!define.empty()) options.push_back(macro.c_str());
  const nvrtcResult compiled =
      api.compile_program(program, static_cast<int>(options.size()), options.data());
  if (compiled != NVRTC_SUCCESS) {
    std::size_t log_size = 0;
    std::string log;
    if (api.program_log_size(program, &log_size) == NVRTC_SUCCESS && log_size > 1) {
      log.resize(log_size);
      api.program_log(program, log.data());
      log.resize(log_size - 1);
    }
    api.destroy_program(&program);
    const std::string kept = keep_failed_source(source, source_name);
    throw Error(ErrorCode::kCompile,
                fmt::format("NVRTC could not compile {}{}: {}\n{}", source_name,
                            kept.empty() ? "" : " (kept at " + kept + ")",
                            api.error_string(compiled), log));
  }
  std::size_t size = 0;
  std::vector<char> cubin;
  try {
    check_nvrtc(api.cubin_size(program, &size), "nvrtcGetCUBINSize");
    cubin.resize(size);
    check_nvrtc(api.cubin(program, cubin.data()), "nvrtcGetCUBIN");
  } catch (...) {
    api.destroy_program(&program);
    throw;
  }
  api.destroy_program(&program);
  return cubin;
}

CompiledKernel::CompiledKernel(std::shared_ptr<const Driver> driver, const std::vector<char>& cubin,
                               const std::vector<KernelFunction>& functions)
    : driver_(std::move(driver)) {
  ContextScope scope(*driver_);
  driver_->check(driver_->api().module_load_data(&module_, cubin.data()), "cuModuleLoadData");
  try {
    for (const KernelFunction& kernel : functions) {
      CUfunction function = nullptr;
      driver_->check(driver_->api().module_get_function(&function, module_, kernel.name.c_str()),
                     fmt::format("cuModuleGetFunction({})", kernel.name));
      driver_->check(
          driver_->api().function_set_attribute(
              function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kernel.shared_bytes),
          fmt::format("cuFuncSetAttribute({}, MAX_DYNAMIC_SHARED_SIZE_BYTES)", kernel.name));
      if (kernel.max_shared_carveout) {
        driver_->check(
            driver_->api().function_set_attribute(
                function, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                CU_SHAREDMEM_CARVEOUT_MAX_SHARED),
            fmt::format("cuFuncSetAttribute({}, PREFERRED_SHARED_MEMORY_CARVEOUT)", kernel.name));
      }
      functions_.emplace(kernel.name, function);
    }
  } catch (...) {
    driver_->api().module_unload(module_);
    throw;
  }
}

CUfunction CompiledKernel::function(std::string_view name) const {
  const auto found = functions_.find(name);
  if (found == functions_.end()) {
    throw_internal(fmt::format("cuda: the compiled module has no kernel {}", name));
  }
  return found->second;
}

CompiledKernel::~CompiledKernel() {
  CUcontext popped = nullptr;
  if (driver_->api().context_push(driver_->context()) == CUDA_SUCCESS) {
    driver_->api().module_unload(module_);
    driver_->api().context_pop(&popped);
  }
}

KernelLookup KernelCache::get(const std::string& source,
                              const std::vector<KernelFunction>& functions, std::string_view suffix,
                              std::string_view define) {
  const auto start = std::chrono::steady_clock::now();
  // The names are in the source; the shared bytes are set when loading, so they are part of the
  // in-memory entry ("|shared 98304" for a forward-only module, as before the backward existed).
  std::vector<int> shared;
  for (const KernelFunction& kernel : functions) shared.push_back(kernel.shared_bytes);
  std::string versions =
      fmt::format("|sm_{}{}|nvrtc {}|driver {}|shared {}", driver_->compute_capability(), suffix,
                  nvrtc_version(), driver_->driver_version(), fmt::join(shared, ","));
  if (!define.empty()) versions += fmt::format("|define {}", define);
  KernelLookup lookup;
  lookup.key = fmt::format("{:016x}{:016x}", fnv1a(versions, fnv1a(source, kFnvOffset)),
                           fnv1a(versions, fnv1a(source, kSecondOffset)));
  const auto elapsed = [&start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // In memory, or being obtained by another thread (then its result, or its error); else this
  // thread obtains it, outside the lock, so different modules compile at once.
  std::promise<Module> promise;
  {
    std::unique_lock lock(mutex_);
    if (const auto found = kernels_.find(lookup.key); found != kernels_.end()) {
      lookup.kernel = found->second;
      lookup.origin = "memory cache";
      lookup.seconds = elapsed();
      return lookup;
    }
    if (const auto found = pending_.find(lookup.key); found != pending_.end()) {
      const std::shared_future<Module> obtained = found->second;
      lock.unlock();
      lookup.kernel = obtained.get();
      lookup.origin = "memory cache";
      lookup.seconds = elapsed();
      return lookup;
    }
    pending_.emplace(lookup.key, promise.get_future().share());
  }
  try {
    const std::filesystem::path directory = cache_directory();
    const std::filesystem::path entry =
        directory.empty() ? std::filesystem::path() : directory / (lookup.key + ".cubin");
    std::vector<char> cubin = entry.empty() ? std::vector<char>() : read_entry(entry, lookup.key);
    if (!cubin.empty()) {
      lookup.origin = "disk cache";
    } else {
      cubin = compile_to_cubin(source, "flexattn_" + lookup.key + ".cu",
                               driver_->compute_capability(), suffix, define);
      if (!entry.empty()) write_entry(entry, lookup.key, cubin);
      lookup.origin = "compiled (NVRTC)";
    }
    lookup.kernel = std::make_shared<CompiledKernel>(driver_, cubin, functions);
  } catch (...) {
    // Nothing is kept: the waiting threads get the error, a later call tries again.
    {
      const std::lock_guard lock(mutex_);
      pending_.erase(lookup.key);
    }
    promise.set_exception(std::current_exception());
    throw;
  }
  {
    const std::lock_guard lock(mutex_);
    kernels_.emplace(lookup.key, lookup.kernel);
    pending_.erase(lookup.key);
  }
  promise.set_value(lookup.kernel);
  lookup.seconds = elapsed();
  return lookup;
}

}  // namespace flexattn::cuda
