// Reading and writing NumPy .npy files (format versions 1 to 3).
#include "flexattn/npy.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
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

namespace {

// The .npy preamble (magic, version, header length, header dict, padding) of `tensor`.
std::string npy_preamble(const std::string& path, const HostTensor& tensor) {
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

  return preamble;
}

[[noreturn]] void fail_io(const std::string& path, const std::string& what, int error) {
  throw Error(ErrorCode::kIo,
              fmt::format("cannot write '{}': {}: {}", path, what, std::strerror(error)));
}

// A name in `folder` that starts with '.', ends with `suffix` and carries 64 random bits.
std::string random_name(const std::filesystem::path& folder, const std::string& stem,
                        const char* suffix) {
  static thread_local std::mt19937_64 generator{std::random_device{}()};
  return (folder / fmt::format(".{}.{:016x}.{}", stem, generator(), suffix)).string();
}

void write_all(int fd, const char* data, std::size_t bytes, const std::string& path) {
  while (bytes > 0) {
    const ssize_t written = ::write(fd, data, bytes);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail_io(path, "write failed", errno);
    }
    data += written;
    bytes -= static_cast<std::size_t>(written);
  }
}

}  // namespace

std::string resolved_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::path file = fs::absolute(path).lexically_normal();
  // A link is followed even when its target does not exist yet (weakly_canonical would stop at
  // it); the limit is the kernel's for nested links.
  constexpr int kMaxLinks = 40;
  for (int links = 0; links < kMaxLinks && fs::is_symlink(file, error); ++links) {
    const fs::path target = fs::read_symlink(file, error);
    if (error) break;
    file = (target.is_absolute() ? target : file.parent_path() / target).lexically_normal();
  }
  const fs::path resolved = fs::weakly_canonical(file, error);
  return (error ? file : resolved.lexically_normal()).string();
}

void check_output_file(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path destination(resolved_file(path));
  std::error_code error;
  if (!fs::is_directory(destination.parent_path(), error)) {
    fs::path folder = fs::path(path).parent_path();
    throw_invalid(fmt::format("cannot write '{}': folder '{}' does not exist", path,
                              folder.empty() ? "." : folder.string()));
  }
  const fs::file_status status = fs::status(destination, error);
  if (fs::is_directory(status))
    throw_invalid(fmt::format("cannot write '{}': it is a folder", path));
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    throw_invalid(fmt::format(
        "cannot write '{}': it exists and is not a regular file (outputs replace a file as a "
        "whole, so devices and FIFOs are not written)",
        path));
  }
}

OutputFiles::~OutputFiles() {
  if (committed_) return;
  for (const Entry& entry : entries_) {
    if (!entry.temporary.empty()) ::unlink(entry.temporary.c_str());
    if (!entry.backup.empty()) ::unlink(entry.backup.c_str());
  }
}

void OutputFiles::add_npy(const std::string& path, const HostTensor& tensor) {
  const std::string preamble = npy_preamble(path, tensor);
  add_parts(path, {std::string_view(preamble),
                   std::string_view(static_cast<const char*>(tensor.data()), tensor.bytes())});
}

void OutputFiles::add_bytes(const std::string& path, std::string_view bytes) {
  add_parts(path, {bytes});
}

void OutputFiles::add_parts(const std::string& path,
                            std::initializer_list<std::string_view> parts) {
  if (committed_) throw_internal("OutputFiles: a file added after commit()");
  Entry entry;
  entry.path = path;
  entry.destination = resolved_file(path);
  check_output_file(path);
  struct stat existing {};
  if (::stat(entry.destination.c_str(), &existing) == 0) {
    entry.replaces = true;
  } else if (errno != ENOENT) {
    fail_io(path, "cannot inspect it", errno);
  }
  const std::filesystem::path destination(entry.destination);
  const std::string stem = destination.filename().string();
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    entry.temporary = random_name(destination.parent_path(), stem, "tmp");
    fd =
        ::open(entry.temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd < 0 && (errno != EEXIST || attempt == 8)) {
      const int error = errno;
      entry.temporary.clear();
      fail_io(path, "cannot create a temporary file beside it", error);
    }
  }
  entries_.push_back(entry);  // from here the destructor removes the temporary
  try {
    if (entry.replaces) (void)::fchmod(fd, existing.st_mode & 07777);
    for (std::string_view part : parts) write_all(fd, part.data(), part.size(), path);
    if (::fsync(fd) != 0) fail_io(path, "cannot flush it", errno);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) fail_io(path, "cannot close it", errno);
}

void OutputFiles::commit() {
  if (committed_) throw_internal("OutputFiles::commit twice");
  // Hard links to the files about to be replaced, so a failed rename can put them back.
  for (Entry& entry : entries_) {
    if (!entry.replaces) continue;
    const std::string stem = std::filesystem::path(entry.destination).filename().string();
    const std::filesystem::path folder = std::filesystem::path(entry.destination).parent_path();
    for (int attempt = 0; attempt < 8; ++attempt) {
      const std::string backup = random_name(folder, stem, "old");
      if (::link(entry.destination.c_str(), backup.c_str()) == 0) {
        entry.backup = backup;
        break;
      }
      if (errno != EEXIST) break;  // no hard links here: this file cannot be put back
    }
  }
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    Entry& entry = entries_[i];
    if (::rename(entry.temporary.c_str(), entry.destination.c_str()) == 0) continue;
    const int error = errno;
    std::string lost;
    for (std::size_t j = 0; j < entries_.size(); ++j) {
      Entry& other = entries_[j];
      if (j >= i) {  // not renamed: its destination is as it was
        ::unlink(other.temporary.c_str());
        if (!other.backup.empty()) ::unlink(other.backup.c_str());
      } else if (!other.replaces) {  // renamed onto nothing: remove it
        ::unlink(other.destination.c_str());
      } else if (!other.backup.empty() &&
                 ::rename(other.backup.c_str(), other.destination.c_str()) == 0) {
        // put back
      } else {  // the new file stays; the old one is kept where it is, if it could be linked
        lost += fmt::format(
            "{}'{}' (its previous contents {})", lost.empty() ? "" : ", ", other.path,
            other.backup.empty() ? "are lost" : fmt::format("are in '{}'", other.backup));
      }
      other.temporary.clear();
      other.backup.clear();
    }
    fail_io(entry.path,
            lost.empty() ? "cannot rename the temporary file into place (no output changed)"
                         : fmt::format("cannot rename the temporary file into place, and could not "
                                       "restore {}",
                                       lost),
            error);
  }
  committed_ = true;
  for (const Entry& entry : entries_) {
    if (!entry.backup.empty()) ::unlink(entry.backup.c_str());
  }
}

void write_npy(const std::string& path, const HostTensor& tensor) {
  OutputFiles file;
  file.add_npy(path, tensor);
  file.commit();
}

}  // namespace flexattn
