// Reading and writing NumPy .npy files (format versions 1 to 3).
#include "flexattn/npy.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string_view>

#include "core/checked_size.hpp"
#include "flexattn/error.hpp"

namespace flexattn {

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
// Magic, two version bytes, then a 2-byte (version 1) or 4-byte (versions 2, 3) header length.
constexpr std::size_t kVersionBytes = 2;
constexpr std::size_t kShortLengthBytes = 2;
constexpr std::size_t kLongLengthBytes = 4;
// NumPy pads the whole preamble to a multiple of 64 bytes so the data is aligned.
constexpr std::size_t kPreambleAlignment = 64;
// A header past this is not something NumPy writes; refuse it rather than allocate blindly.
constexpr std::size_t kMaxHeaderLength = 1u << 20;
// Streams are read in pieces of this size (a read's count is a std::streamsize).
constexpr std::size_t kReadChunkBytes = std::size_t{1} << 24;

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw_invalid(fmt::format("npy file '{}': {}", path, problem));
}

struct DTypeCode {
  std::string_view descr;
  DType dtype;
};
constexpr DTypeCode kDTypeCodes[] = {
    {"<f8", DType::kF64}, {"<f4", DType::kF32}, {"<f2", DType::kF16},
    {"<i4", DType::kI32}, {"<i8", DType::kI64},
};

// The header is a Python dict literal: {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : text_(text), path_(path) {}

  struct Header {
    std::string descr;
    bool fortran_order = false;
    std::vector<std::int64_t> shape;
  };

  Header parse() {
    Header header;
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    while (true) {
      skip_space();
      if (peek() == '}') {
        ++position_;
        break;
      }
      const std::string key = parse_string();
      expect(':');
      if (key == "descr") {
        header.descr = parse_string();
        have_descr = true;
      } else if (key == "fortran_order") {
        header.fortran_order = parse_bool();
        have_order = true;
      } else if (key == "shape") {
        header.shape = parse_shape();
        have_shape = true;
      } else {
        fail(path_, fmt::format("unexpected key '{}' in header", key));
      }
      skip_space();
      if (peek() == ',') {
        ++position_;
      } else if (peek() != '}') {
        fail(path_, "malformed header dictionary");
      }
    }
    skip_space();
    if (position_ != text_.size()) fail(path_, "trailing characters after header dictionary");
    if (!have_descr || !have_order || !have_shape) {
      fail(path_, "header lacks one of 'descr', 'fortran_order', 'shape'");
    }
    return header;
  }

 private:
  char peek() const { return position_ < text_.size() ? text_[position_] : '\0'; }
  void skip_space() {
    while (position_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[position_]))) {
      ++position_;
    }
  }
  void expect(char c) {
    skip_space();
    if (peek() != c) fail(path_, fmt::format("malformed header: expected '{}'", c));
    ++position_;
  }
  std::string parse_string() {
    skip_space();
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail(path_, "malformed header: expected a string");
    const std::size_t end = text_.find(quote, position_ + 1);
    if (end == std::string_view::npos) fail(path_, "malformed header: unterminated string");
    std::string value(text_.substr(position_ + 1, end - position_ - 1));
    position_ = end + 1;
    return value;
  }
  bool parse_bool() {
    skip_space();
    for (auto [word, value] :
         {std::pair{std::string_view("True"), true}, std::pair{std::string_view("False"), false}}) {
      if (text_.substr(position_, word.size()) == word) {
        position_ += word.size();
        return value;
      }
    }
    fail(path_, "malformed header: fortran_order is not True or False");
  }
  std::vector<std::int64_t> parse_shape() {
    expect('(');
    std::vector<std::int64_t> shape;
    while (true) {
      skip_space();
      if (peek() == ')') {
        ++position_;
        return shape;
      }
      if (!std::isdigit(static_cast<unsigned char>(peek()))) {
        fail(path_, "malformed header: shape entries must be non-negative integers");
      }
      std::int64_t extent = 0;
      while (std::isdigit(static_cast<unsigned char>(peek()))) {
        const int digit = peek() - '0';
        if (extent > (std::numeric_limits<std::int64_t>::max() - digit) / 10) {
          fail(path_, "shape entry too large");
        }
        extent = extent * 10 + digit;
        ++position_;
      }
      shape.push_back(extent);
      skip_space();
      if (peek() == ',') {
        ++position_;
      } else if (peek() != ')') {
        fail(path_, "malformed header: bad shape tuple");
      }
    }
  }

  std::string_view text_;
  const std::string& path_;
  std::size_t position_ = 0;
};

std::uint32_t little_endian(const unsigned char* bytes, std::size_t count) {
  std::uint32_t value = 0;
  for (std::size_t i = count; i-- > 0;) value = (value << 8) | bytes[i];
  return value;
}

std::string_view descr_of(DType dtype, const std::string& path) {
  for (const DTypeCode& code : kDTypeCodes) {
    if (code.dtype == dtype) return code.descr;
  }
  fail(path, fmt::format("{} has no NumPy dtype; convert it (e.g. to fp32) before writing",
                         to_string(dtype)));
}

std::string shape_tuple(const std::vector<std::int64_t>& shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  return fmt::format("({})", fmt::join(shape, ", "));
}

// Reads up to `count` bytes (fewer only at the end of the stream); never seeks, so pipes, FIFOs
// and /dev/stdin read like files.
std::size_t read_up_to(std::istream& stream, char* destination, std::size_t count) {
  std::size_t done = 0;
  while (done < count && stream) {
    const std::size_t chunk = std::min(count - done, kReadChunkBytes);
    stream.read(destination + done, static_cast<std::streamsize>(chunk));
    done += static_cast<std::size_t>(stream.gcount());
  }
  return done;
}

}  // namespace

HostTensor read_npy(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) fail(path, "cannot open for reading");
  // A regular file's size is known before its data is allocated; a stream's is checked as it
  // ends (reading one byte past the data finds trailing bytes).
  std::error_code error;
  std::optional<std::uintmax_t> file_size;
  if (std::filesystem::is_regular_file(path, error)) {
    const std::uintmax_t size = std::filesystem::file_size(path, error);
    if (!error) file_size = size;
  }

  unsigned char preamble[kMagic.size() + kVersionBytes + kLongLengthBytes] = {};
  char* const preamble_bytes = reinterpret_cast<char*>(preamble);
  const std::size_t fixed = kMagic.size() + kVersionBytes;
  const std::size_t got = read_up_to(file, preamble_bytes, fixed + kShortLengthBytes);
  if (got < fixed + kShortLengthBytes) fail(path, "truncated (no complete .npy preamble)");
  if (std::string_view(preamble_bytes, kMagic.size()) != kMagic) {
    fail(path, "not a .npy file (bad magic)");
  }
  const int major = preamble[kMagic.size()];
  std::size_t length_bytes = 0;
  if (major == 1) {
    length_bytes = kShortLengthBytes;
  } else if (major == 2 || major == 3) {
    length_bytes = kLongLengthBytes;
  } else {
    fail(path, fmt::format("unsupported .npy format version {}", major));
  }
  const std::size_t rest = length_bytes - kShortLengthBytes;
  if (read_up_to(file, preamble_bytes + got, rest) != rest) fail(path, "truncated preamble");
  const std::size_t header_length = little_endian(preamble + fixed, length_bytes);
  if (header_length > kMaxHeaderLength) fail(path, "header too long");
  const std::size_t data_offset = fixed + length_bytes + header_length;
  if (file_size && data_offset > *file_size) fail(path, "truncated header");
  std::string header_text(header_length, '\0');
  if (read_up_to(file, header_text.data(), header_length) != header_length) {
    fail(path, "truncated header");
  }

  const HeaderParser::Header header = HeaderParser(header_text, path).parse();
  if (header.fortran_order) {
    fail(path, "Fortran-order arrays are not supported (save with np.ascontiguousarray)");
  }
  std::optional<DType> dtype;
  for (const DTypeCode& code : kDTypeCodes) {
    if (header.descr == code.descr) dtype = code.dtype;
  }
  if (!dtype) {
    fail(path,
         fmt::format("unsupported dtype '{}' (expected <f8, <f4, <f2, <i4 or <i8)", header.descr));
  }
  std::optional<std::int64_t> expected = static_cast<std::int64_t>(size_of(*dtype));
  for (std::int64_t extent : header.shape) {
    if (expected) expected = checked_multiply(*expected, extent);
  }
  if (!expected || *expected > kMaxTensorBytes) {
    fail(path, fmt::format("data size does not match the shape: ({}) of {} holds more than 2^48 "
                           "bytes",
                           fmt::join(header.shape, ", "), header.descr));
  }
  const auto expected_bytes = static_cast<std::size_t>(*expected);
  if (file_size && *file_size - data_offset != expected_bytes) {
    fail(path, fmt::format("data size does not match the shape: {} bytes for {} expected",
                           *file_size - data_offset, expected_bytes));
  }
  // A stream's header is not trusted with an allocation: its data is read as it comes, in pieces,
  // and the tensor is allocated once the data is all there.
  std::string streamed;
  if (!file_size) {
    while (streamed.size() <= expected_bytes && file) {
      const std::size_t begin = streamed.size();
      streamed.resize(begin + std::min(kReadChunkBytes, expected_bytes + 1 - begin));
      streamed.resize(begin + read_up_to(file, streamed.data() + begin, streamed.size() - begin));
    }
    if (streamed.size() != expected_bytes) {
      fail(path, fmt::format("data size does not match the shape: {}{} bytes for {} expected",
                             streamed.size(), streamed.size() > expected_bytes ? " or more" : "",
                             expected_bytes));
    }
  }
  HostTensor tensor(*dtype, header.shape);
  if (!file_size) {
    std::copy(streamed.begin(), streamed.end(), static_cast<char*>(tensor.data()));
    return tensor;
  }
  const std::size_t data_bytes =
      read_up_to(file, static_cast<char*>(tensor.data()), expected_bytes);
  char extra = 0;
  if (data_bytes != expected_bytes || read_up_to(file, &extra, 1) != 0) {
    fail(path,
         fmt::format("data size does not match the shape: {}{} bytes for {} expected", data_bytes,
                     data_bytes == expected_bytes ? " or more" : "", expected_bytes));
  }
  if (file.bad()) fail(path, "cannot read data");
  return tensor;
}

void write_npy(const std::string& path, const HostTensor& tensor) {
  const std::string header_dict =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
                  descr_of(tensor.dtype(), path), shape_tuple(tensor.shape()));
  // Version 1 stores the header length in 2 bytes; longer headers need version 2.
  const bool long_header =
      header_dict.size() + kPreambleAlignment > std::numeric_limits<std::uint16_t>::max();
  const std::size_t length_bytes = long_header ? kLongLengthBytes : kShortLengthBytes;
  const std::size_t unpadded =
      kMagic.size() + kVersionBytes + length_bytes + header_dict.size() + 1;
  const std::size_t padding =
      (kPreambleAlignment - unpadded % kPreambleAlignment) % kPreambleAlignment;
  const std::size_t header_length = header_dict.size() + padding + 1;

  std::string preamble(kMagic);
  preamble.push_back(static_cast<char>(long_header ? 2 : 1));
  preamble.push_back('\0');
  for (std::size_t i = 0; i < length_bytes; ++i) {
    preamble.push_back(static_cast<char>((header_length >> (8 * i)) & 0xffu));
  }
  preamble += header_dict;
  preamble.append(padding, ' ');
  preamble.push_back('\n');

  const std::string temporary = fmt::format("{}.tmp.{}", path, static_cast<long>(::getpid()));
  try {
    {
      std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
      if (!file) fail(path, fmt::format("cannot open '{}' for writing", temporary));
      file.write(preamble.data(), static_cast<std::streamsize>(preamble.size()));
      file.write(static_cast<const char*>(tensor.data()),
                 static_cast<std::streamsize>(tensor.bytes()));
      file.flush();
      if (!file) fail(path, "write failed");
    }
    std::error_code error;
    std::filesystem::rename(temporary, path, error);
    if (error) fail(path, fmt::format("cannot rename the temporary file: {}", error.message()));
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
}

}  // namespace flexattn
