// Checked size arithmetic: every place where a shape becomes an element count or a byte size
// multiplies through checked_multiply, so a hostile shape is refused with a message naming its
// dimensions instead of wrapping around to a small allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flexattn/dtype.hpp"

namespace flexattn {

// The largest tensor flexattn accepts, in bytes (256 TiB): past the memory of any machine, and
// small enough that every size an engine derives from an accepted tensor (tiles padded to a
// multiple of 128, fp32 accumulators of fp16 data, byte offsets) stays far below 2^63.
inline constexpr std::int64_t kMaxTensorBytes = std::int64_t{1} << 48;

// a * b for non-negative a and b; nullopt when the product does not fit in int64.
std::optional<std::int64_t> checked_multiply(std::int64_t a, std::int64_t b);
// a + b for non-negative a and b; nullopt when the sum does not fit in int64.
std::optional<std::int64_t> checked_add(std::int64_t a, std::int64_t b);

// One dimension of a shape, with the name the error message gives it ("seq_len_q", "axis 2").
struct NamedExtent {
  std::string_view name;
  std::int64_t value = 0;
};

// The byte size of a tensor of `extents` elements of `element_bytes` each. Error(kInvalidArgument)
// "<what> would hold batch 1 x seq_len_q 16 x ... elements of 4 bytes: more than 2^48 bytes" when
// it passes kMaxTensorBytes (or int64). Negative extents are refused too.
std::int64_t checked_tensor_bytes(std::string_view what, const std::vector<NamedExtent>& extents,
                                  std::size_t element_bytes);
// The same for a plain shape, its axes named "axis 0", "axis 1", ...
std::int64_t checked_tensor_bytes(std::string_view what, const std::vector<std::int64_t>& shape,
                                  std::size_t element_bytes);

// This machine's physical memory in bytes (0 where it cannot be read), the bound of what one
// process can allocate on the host without the kernel's out-of-memory killer.
std::uint64_t host_memory_bytes();

// Error(kInvalidArgument) "<what> needs N bytes of host memory; this machine has M" when `bytes`
// exceeds host_memory_bytes().
void require_host_memory(std::string_view what, std::int64_t bytes);

}  // namespace flexattn
