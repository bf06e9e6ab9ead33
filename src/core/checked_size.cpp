// Checked size arithmetic and the host memory bound.
#include "core/checked_size.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include "flexattn/error.hpp"

namespace flexattn {

namespace {

constexpr int kMaxTensorBytesLog2 = 48;
static_assert(kMaxTensorBytes == std::int64_t{1} << kMaxTensorBytesLog2);

std::string describe(const std::vector<NamedExtent>& extents) {
  std::string text;
  for (const NamedExtent& extent : extents) {
    if (!text.empty()) text += " x ";
    text += fmt::format("{} {}", extent.name, extent.value);
  }
  return text.empty() ? "no" : text;
}

}  // namespace

std::optional<std::int64_t> checked_multiply(std::int64_t a, std::int64_t b) {
  std::int64_t product = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

std::optional<std::int64_t> checked_add(std::int64_t a, std::int64_t b) {
  std::int64_t sum = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

std::int64_t checked_tensor_bytes(std::string_view what, const std::vector<NamedExtent>& extents,
                                  std::size_t element_bytes) {
  for (const NamedExtent& extent : extents) {
    if (extent.value < 0) {
      throw_invalid(
          fmt::format("{}: {} ({}) must not be negative", what, extent.name, extent.value));
    }
  }
  std::optional<std::int64_t> bytes = static_cast<std::int64_t>(element_bytes);
  for (const NamedExtent& extent : extents) {
    if (bytes) bytes = checked_multiply(*bytes, extent.value);
  }
  if (!bytes || *bytes > kMaxTensorBytes) {
    throw_invalid(fmt::format("{} would hold {} elements of {} bytes: more than 2^{} bytes", what,
                              describe(extents), element_bytes, kMaxTensorBytesLog2));
  }
  return *bytes;
}

std::int64_t checked_tensor_bytes(std::string_view what, const std::vector<std::int64_t>& shape,
                                  std::size_t element_bytes) {
  std::vector<std::string> names;
  names.reserve(shape.size());
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    names.push_back(fmt::format("axis {}", axis));
  }
  std::vector<NamedExtent> extents;
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    extents.push_back({names[axis], shape[axis]});
  }
  return checked_tensor_bytes(what, extents, element_bytes);
}

std::uint64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_bytes = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return 0;
  const std::optional<std::int64_t> bytes = checked_multiply(pages, page_bytes);
  return bytes ? static_cast<std::uint64_t>(*bytes) : 0;
}

void require_host_memory(std::string_view what, std::int64_t bytes) {
  const std::uint64_t available = host_memory_bytes();
  if (available != 0 && bytes > 0 && static_cast<std::uint64_t>(bytes) > available) {
    throw_invalid(fmt::format("{} needs {} bytes of host memory; this machine has {}", what, bytes,
                              available));
  }
}

}  // namespace flexattn
