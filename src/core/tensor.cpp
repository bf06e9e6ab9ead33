// Strided tensor views, the owning host tensor, and strided copies with dtype conversion.
#include "flexattn/tensor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numbers>

#include "core/checked_size.hpp"
#include "flexattn/error.hpp"

namespace flexattn {

namespace {

// Cache-line (and AVX-512 vector) alignment of host storage.
constexpr std::size_t kHostAlignment = 64;

// The element count; Error(kInvalidArgument) for a negative extent or a count past int64.
std::int64_t product(const std::vector<std::int64_t>& shape) {
  std::optional<std::int64_t> count = 1;
  for (std::int64_t extent : shape) {
    if (count) count = checked_multiply(*count, extent);
  }
  if (!count) {
    throw_invalid(
        fmt::format("shape [{}]: negative, or more than 2^63 elements", fmt::join(shape, ", ")));
  }
  return *count;
}

void require_cpu(const TensorView& view, const char* what) {
  if (view.device != Device::kCpu) {
    throw_invalid(fmt::format("{}: tensor {} is not on the CPU", what, view.describe()));
  }
  if (view.data == nullptr) throw_invalid(fmt::format("{}: tensor has no data", what));
}

template <typename T>
T* element(void* data, std::int64_t offset) {
  return static_cast<T*>(data) + offset;
}

// Rounds to the nearest integer and saturates to T's range (NaN -> 0), for integer stores.
template <typename T>
T to_integer(double value) {
  if (std::isnan(value)) return 0;
  const double rounded = std::nearbyint(value);
  constexpr auto kLowest = static_cast<double>(std::numeric_limits<T>::lowest());
  constexpr auto kHighest = static_cast<double>(std::numeric_limits<T>::max());
  if (rounded <= kLowest) return std::numeric_limits<T>::lowest();
  if (rounded >= kHighest) return std::numeric_limits<T>::max();
  return static_cast<T>(rounded);
}

// splitmix64 (Steele, Lea, Flood 2014): a tiny generator with identical output everywhere.
class SplitMix64 {
 public:
  static constexpr std::uint64_t kIncrement = 0x9e3779b97f4a7c15ull;
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  // The generator `seed` after `steps` calls of next(): its state is a counter.
  static SplitMix64 after(std::uint64_t seed, std::uint64_t steps) {
    return SplitMix64(seed + steps * kIncrement);  // modulo 2^64, as next() adds
  }
  std::uint64_t next() {
    state_ += kIncrement;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1]: the top 53 bits, shifted away from 0 so log() is finite.
  double uniform_open_zero() {
    constexpr int kMantissaBits = 53;
    constexpr double kUnit = 1.0 / static_cast<double>(1ull << kMantissaBits);
    return (static_cast<double>(next() >> (64 - kMantissaBits)) + 1.0) * kUnit;
  }

 private:
  std::uint64_t state_;
};

double load_element(void* data, DType dtype, std::int64_t offset) {
  switch (dtype) {
    case DType::kF64:
      return *element<const double>(data, offset);
    case DType::kF32:
      return *element<const float>(data, offset);
    case DType::kF16:
      return to_float(*element<const Half>(data, offset));
    case DType::kBF16:
      return to_float(*element<const BFloat16>(data, offset));
    case DType::kI32:
      return *element<const std::int32_t>(data, offset);
    case DType::kI64:
      return static_cast<double>(*element<const std::int64_t>(data, offset));
  }
  throw_internal("load: unknown dtype");
}

void store_element(void* data, DType dtype, std::int64_t offset, double value) {
  switch (dtype) {
    case DType::kF64:
      *element<double>(data, offset) = value;
      return;
    case DType::kF32:
      *element<float>(data, offset) = static_cast<float>(value);
      return;
    case DType::kF16:
      *element<Half>(data, offset) = to_half(static_cast<float>(value));
      return;
    case DType::kBF16:
      *element<BFloat16>(data, offset) = to_bfloat16(static_cast<float>(value));
      return;
    case DType::kI32:
      *element<std::int32_t>(data, offset) = to_integer<std::int32_t>(value);
      return;
    case DType::kI64:
      *element<std::int64_t>(data, offset) = to_integer<std::int64_t>(value);
      return;
  }
  throw_internal("store: unknown dtype");
}

}  // namespace

std::string_view to_string(Device device) {
  switch (device) {
    case Device::kCpu:
      return "cpu";
    case Device::kCuda:
      return "cuda";
  }
  return "?";
}

std::int64_t TensorView::numel() const { return product(shape); }

std::string TensorView::describe() const {
  std::string text = fmt::format("{}[{}] strides [{}]", to_string(dtype), fmt::join(shape, ", "),
                                 fmt::join(strides, ", "));
  if (device != Device::kCpu) text += fmt::format(" on {}", to_string(device));
  return text;
}

double TensorView::load(std::int64_t offset) const { return load_element(data, dtype, offset); }

void TensorView::store(std::int64_t offset, double value) const {
  store_element(data, dtype, offset, value);
}

std::int64_t TensorView::load_index(std::int64_t offset) const {
  switch (dtype) {
    case DType::kI32:
      return *element<const std::int32_t>(data, offset);
    case DType::kI64:
      return *element<const std::int64_t>(data, offset);
    case DType::kF64:
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      break;
  }
  throw_invalid(fmt::format("load_index: {} is not an integer tensor", describe()));
}

std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> strides(shape.size(), 1);
  for (std::size_t i = shape.size(); i > 1; --i) strides[i - 2] = strides[i - 1] * shape[i - 1];
  return strides;
}

void HostTensor::FreeDeleter::operator()(std::byte* pointer) const { std::free(pointer); }

HostTensor::HostTensor(DType dtype, std::vector<std::int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  for (std::int64_t extent : shape_) {
    if (extent < 0)
      throw_invalid(fmt::format("HostTensor: negative extent in [{}]", fmt::join(shape_, ", ")));
  }
  const std::string what =
      fmt::format("HostTensor {}[{}]", to_string(dtype_), fmt::join(shape_, ", "));
  const std::int64_t checked_bytes = checked_tensor_bytes(what, shape_, size_of(dtype_));
  require_host_memory(what, checked_bytes);
  numel_ = product(shape_);
  // aligned_alloc needs a size that is a multiple of the alignment (and never 0 here); below
  // kMaxTensorBytes the rounding cannot overflow.
  const std::size_t size =
      std::max(kHostAlignment, (static_cast<std::size_t>(checked_bytes) + kHostAlignment - 1) /
                                   kHostAlignment * kHostAlignment);
  auto* memory = static_cast<std::byte*>(std::aligned_alloc(kHostAlignment, size));
  if (memory == nullptr) {
    throw_invalid(fmt::format("HostTensor: cannot allocate {} bytes", size));
  }
  std::memset(memory, 0, size);
  storage_.reset(memory);
}

TensorView HostTensor::view() const {
  TensorView result;
  result.data = const_cast<std::byte*>(storage_.get());
  result.dtype = dtype_;
  result.shape = shape_;
  result.strides = contiguous_strides(shape_);
  result.device = Device::kCpu;
  return result;
}

void HostTensor::fill_normal(std::uint64_t seed, double stddev) {
  // Box-Muller: two uniforms give two independent N(0, 1) values. Pair p takes the generator's
  // outputs 2p and 2p + 1, so chunks of pairs start their generator where the sequence is and
  // are filled in parallel with the values one generator would give (a cache of 10^8 elements
  // took seconds on one core).
  constexpr std::int64_t kPairsPerChunk = std::int64_t{1} << 15;
  const TensorView destination = view();
  const std::int64_t count = numel();
  const std::int64_t pairs = (count + 1) / 2;
  const std::int64_t chunks = (pairs + kPairsPerChunk - 1) / kPairsPerChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    const std::int64_t first = chunk * kPairsPerChunk;
    const std::int64_t last = std::min(pairs, first + kPairsPerChunk);
    SplitMix64 generator = SplitMix64::after(seed, 2 * static_cast<std::uint64_t>(first));
    for (std::int64_t pair = first; pair < last; ++pair) {
      const double radius = std::sqrt(-2.0 * std::log(generator.uniform_open_zero()));
      const double angle = 2.0 * std::numbers::pi * generator.uniform_open_zero();
      const std::int64_t i = 2 * pair;
      destination.store(i, stddev * radius * std::cos(angle));
      if (i + 1 < count) destination.store(i + 1, stddev * radius * std::sin(angle));
    }
  }
}

HostTensor HostTensor::to(DType dtype) const {
  HostTensor result(dtype, shape_);
  copy_into(view(), result.view());
  return result;
}

double HostTensor::at(std::int64_t flat_index) const {
  if (flat_index < 0 || flat_index >= numel()) {
    throw_invalid(fmt::format("HostTensor::at: index {} outside {} elements", flat_index, numel()));
  }
  return load_element(storage_.get(), dtype_, flat_index);
}

void HostTensor::set(std::int64_t flat_index, double value) {
  if (flat_index < 0 || flat_index >= numel()) {
    throw_invalid(
        fmt::format("HostTensor::set: index {} outside {} elements", flat_index, numel()));
  }
  store_element(storage_.get(), dtype_, flat_index, value);
}

void copy_into(const TensorView& source, const TensorView& destination) {
  if (source.shape != destination.shape) {
    throw_invalid(fmt::format("copy_into: shapes differ: {} vs {}", source.describe(),
                              destination.describe()));
  }
  if (source.strides.size() != source.shape.size() ||
      destination.strides.size() != destination.shape.size()) {
    throw_invalid("copy_into: strides and shape of different rank");
  }
  const std::int64_t count = source.numel();
  if (count == 0) return;
  require_cpu(source, "copy_into source");
  require_cpu(destination, "copy_into destination");

  const bool same_dtype = source.dtype == destination.dtype;
  const std::size_t element_bytes = size_of(source.dtype);
  const auto contiguous = contiguous_strides(source.shape);
  if (same_dtype && source.strides == contiguous && destination.strides == contiguous) {
    std::memmove(destination.data, source.data, static_cast<std::size_t>(count) * element_bytes);
    return;
  }
  // Odometer over the multi-index, tracking both element offsets.
  const std::size_t rank = source.shape.size();
  std::vector<std::int64_t> index(rank, 0);
  std::int64_t source_offset = 0;
  std::int64_t destination_offset = 0;
  for (std::int64_t n = 0; n < count; ++n) {
    if (same_dtype) {  // bit-exact (int64 beyond 2^53, NaN payloads)
      std::memcpy(static_cast<std::byte*>(destination.data) +
                      destination_offset * static_cast<std::int64_t>(element_bytes),
                  static_cast<const std::byte*>(source.data) +
                      source_offset * static_cast<std::int64_t>(element_bytes),
                  element_bytes);
    } else {
      destination.store(destination_offset, source.load(source_offset));
    }
    for (std::size_t axis = rank; axis-- > 0;) {
      ++index[axis];
      source_offset += source.strides[axis];
      destination_offset += destination.strides[axis];
      if (index[axis] < source.shape[axis]) break;
      source_offset -= source.strides[axis] * source.shape[axis];
      destination_offset -= destination.strides[axis] * destination.shape[axis];
      index[axis] = 0;
    }
  }
}

}  // namespace flexattn
