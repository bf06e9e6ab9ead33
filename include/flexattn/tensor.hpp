// Non-owning strided tensor views (what engines read and write) and a small owning host tensor
// (what the CLI, tests and benchmarks allocate).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flexattn/dtype.hpp"
#include "flexattn/export.hpp"

namespace flexattn {

enum class Device { kCpu, kCuda };

FLEXATTN_API std::string_view to_string(Device device);

// Strides are in elements, not bytes. Shapes and strides have the same rank.
struct FLEXATTN_API TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  Device device = Device::kCpu;

  bool empty() const { return data == nullptr; }
  std::int64_t numel() const;
  int rank() const { return static_cast<int>(shape.size()); }
  // "fp32[2, 128, 8, 64] strides [65536, 512, 64, 1]"
  std::string describe() const;

  // Reads/writes one element (CPU only) at an element offset, converting from/to double.
  double load(std::int64_t offset) const;
  void store(std::int64_t offset, double value) const;
  std::int64_t load_index(std::int64_t offset) const;  // integer tensors
};

FLEXATTN_API std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& shape);

// An owning, contiguous (C order), 64-byte aligned host tensor.
class FLEXATTN_API HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape);  // zero-filled

  const std::vector<std::int64_t>& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  std::int64_t numel() const { return numel_; }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * size_of(dtype_); }
  void* data() { return storage_.get(); }
  const void* data() const { return storage_.get(); }
  TensorView view() const;  // contiguous view (data pointer is mutable through the view)

  // Fills with N(0, stddev^2) values from a fixed generator (same seed, same values on every
  // machine), rounded to the storage dtype.
  void fill_normal(std::uint64_t seed, double stddev = 1.0);
  // Converted copy (element-wise through double).
  HostTensor to(DType dtype) const;
  double at(std::int64_t flat_index) const;
  void set(std::int64_t flat_index, double value);

 private:
  struct FreeDeleter {
    void operator()(std::byte* pointer) const;
  };
  DType dtype_ = DType::kF32;
  std::vector<std::int64_t> shape_;
  std::int64_t numel_ = 1;  // the product of shape_ (fixed at construction): at/set check it
  std::unique_ptr<std::byte[], FreeDeleter> storage_;
};

// Copies `source` into the strided `destination` (same shape), converting dtypes (CPU only).
FLEXATTN_API void copy_into(const TensorView& source, const TensorView& destination);

}  // namespace flexattn
