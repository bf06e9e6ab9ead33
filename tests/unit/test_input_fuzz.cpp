// Deterministic random-mutation fuzzing of the two readers of untrusted text: the .npy reader and
// the modifier parser. Every mutated input either reads or throws flexattn::Error: no crash, no
// other exception type, no hang (each input is timed). Fixed seeds and case counts keep the run
// to a few seconds and make every failure reproducible from the printed case number.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <typeinfo>
#include <vector>

#include "flexattn/flexattn.hpp"

namespace flexattn {
namespace {

namespace fs = std::filesystem;

constexpr int kNpyCases = 3000;
constexpr int kParserCases = 20000;
// No single input may take longer than this (the readers are linear in their input).
constexpr std::chrono::milliseconds kMaxCaseTime{500};

// Uniform in [0, bound): the raw generator modulo `bound` (the same on every standard library).
std::size_t below(std::mt19937_64& random, std::size_t bound) {
  return bound == 0 ? 0 : static_cast<std::size_t>(random() % bound);
}

// Bytes that steer the .npy header parser and the parser into their corners.
const std::vector<std::string> kNpySplices = {"(",
                                              ")",
                                              ",",
                                              ", ",
                                              "'",
                                              "{",
                                              "}",
                                              ":",
                                              "0",
                                              "1",
                                              "9",
                                              "99999999999",
                                              "9223372036854775807",
                                              "18446744073709551616",
                                              "-1",
                                              "True",
                                              "False",
                                              "'<f8'",
                                              "'<i8'",
                                              "'>f4'",
                                              "'shape'",
                                              "\n",
                                              std::string(1, '\0'),
                                              "\xff",
                                              "\x93NUMPY"};

const std::vector<std::string> kExpressionSplices = {"(",           ")",
                                                     "[",           "]",
                                                     ",",           "-",
                                                     "!",           "+",
                                                     "*",           "/",
                                                     "%",           "&&",
                                                     "||",          "==",
                                                     "<=",          "score",
                                                     "q",           "kv",
                                                     "h",           "b",
                                                     "Q_LEN",       "KV_LEN",
                                                     "inf",         "true",
                                                     "abs(",        "tanh(",
                                                     "exp(",        "where(",
                                                     "clamp(",      "min(",
                                                     "int(",        "float(",
                                                     "bias[",       "doc[",
                                                     "alpha",       "1",
                                                     "0",           "2147483648",
                                                     "1e999",       "1e-999",
                                                     "0.5",         " ",
                                                     "\t",          "#",
                                                     "\xc3\xa9",    std::string(1, '\0'),
                                                     "-2147483648", "kv - q",
                                                     "q >= kv"};

// One mutation of `text`: flip a bit, overwrite, insert or delete bytes, splice a token, duplicate
// a piece (which nests brackets), or truncate.
void mutate(std::string& text, std::mt19937_64& random, const std::vector<std::string>& splices) {
  const std::size_t at = below(random, text.size() + 1);
  switch (below(random, 7)) {
    case 0:
      if (!text.empty()) text[at % text.size()] ^= static_cast<char>(1u << below(random, 8));
      break;
    case 1:
      if (!text.empty()) text[at % text.size()] = static_cast<char>(below(random, 256));
      break;
    case 2:
      text.insert(at, 1, static_cast<char>(below(random, 256)));
      break;
    case 3:
      text.erase(at, below(random, 8));
      break;
    case 4:
      text.insert(at, splices[below(random, splices.size())]);
      break;
    case 5: {
      const std::size_t length = below(random, text.size() - at + 1);
      const std::string piece = text.substr(at, length);
      for (std::size_t copies = below(random, 4) + 1; copies > 0; --copies) text.insert(at, piece);
      break;
    }
    case 6:
      text.resize(at);
      break;
  }
}

std::string npy_file(const std::string& dict, std::size_t data_bytes, int version) {
  std::string header = dict;
  const std::size_t length_bytes = version == 1 ? 2 : 4;
  while ((6 + 2 + length_bytes + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string bytes = "\x93NUMPY";
  bytes += static_cast<char>(version);
  bytes += '\0';
  for (std::size_t i = 0; i < length_bytes; ++i) {
    bytes += static_cast<char>((header.size() >> (8 * i)) & 0xffu);
  }
  bytes += header;
  for (std::size_t i = 0; i < data_bytes; ++i) bytes += static_cast<char>(i * 37 + 11);
  return bytes;
}

// Runs `body`; fails the test on anything but success or flexattn::Error, and on a slow case.
template <typename Body>
void expect_read_or_error(const Body& body, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  try {
    body();
  } catch (const Error&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << what << ": " << typeid(error).name() << ": " << error.what();
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_LT(elapsed, kMaxCaseTime) << what;
}

TEST(InputFuzz, NpyReaderReadsOrRefusesEveryMutation) {
  const fs::path folder =
      fs::temp_directory_path() / ("flexattn_npy_fuzz_" + std::to_string(::getpid()));
  fs::create_directories(folder);
  const std::string path = (folder / "case.npy").string();
  const std::vector<std::string> seeds = {
      npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 24, 1),
      npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", 24, 2),
      npy_file("{'descr': '<i8', 'fortran_order': False, 'shape': (), }", 8, 3),
      npy_file("{'descr': '<f2', 'fortran_order': False, 'shape': (1, 0, 4), }", 0, 1),
      npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2, 2), }", 32, 1),
  };
  std::mt19937_64 random(20240523);
  int read = 0;
  for (int number = 0; number < kNpyCases; ++number) {
    std::string bytes = seeds[below(random, seeds.size())];
    for (std::size_t count = below(random, 4) + 1; count > 0; --count) {
      mutate(bytes, random, kNpySplices);
    }
    {
      std::ofstream file(path, std::ios::binary | std::ios::trunc);
      file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    expect_read_or_error(
        [&] {
          const HostTensor tensor = read_npy(path);
          // What was read is exactly the data the header describes.
          ASSERT_LE(tensor.bytes(), bytes.size());
          EXPECT_EQ(std::memcmp(tensor.data(), bytes.data() + bytes.size() - tensor.bytes(),
                                tensor.bytes()),
                    0);
          ++read;
        },
        "npy case " + std::to_string(number));
    if (HasFailure()) break;
  }
  fs::remove_all(folder);
  // The mutations keep some files valid, so the reading path is exercised too.
  EXPECT_GT(read, kNpyCases / 100);
}

TEST(InputFuzz, ParserParsesOrRefusesEveryMutation) {
  ir::Scope scope;
  scope.params = {"alpha"};
  scope.tensors["bias"] = {Type::kF32, 3};
  scope.tensors["doc"] = {Type::kI32, 1};
  std::vector<std::string> seeds = {
      "30 * tanh(score / 30)",
      "score + bias[b, h, q] * (kv - q)",
      "where(doc[q] == doc[kv], score, -inf)",
      "q >= kv && (q - kv < 64 || kv < 4)",
      "clamp(score, -alpha, alpha) + min(q, kv) % 7",
      "-(-abs(score)) / float(KV_LEN - q + 1)",
      "!(q < kv) || int(score * 2.5e3) != -2147483648",
  };
  for (const NamedModifier& modifier : modifier_catalogue()) {
    if (!modifier.score_mod.empty()) seeds.push_back(modifier.score_mod);
    if (!modifier.mask_mod.empty()) seeds.push_back(modifier.mask_mod);
  }
  std::mt19937_64 random(7);
  int parsed = 0;
  for (int number = 0; number < kParserCases; ++number) {
    std::string text = seeds[below(random, seeds.size())];
    for (std::size_t count = below(random, 6) + 1; count > 0; --count) {
      mutate(text, random, kExpressionSplices);
    }
    expect_read_or_error(
        [&] {
          const ir::Expr expr = ir::parse(text, scope);
          const Graph graph(expr);
          EXPECT_FALSE(graph.to_string().empty());
          if (expr.type() == Type::kF32) {
            EXPECT_GT(derivative_wrt_score(graph).nodes().size(), 0u);
          }
          ++parsed;
        },
        "parser case " + std::to_string(number) + ": " + text);
    if (HasFailure()) break;
  }
  EXPECT_GT(parsed, kParserCases / 50);
}

}  // namespace
}  // namespace flexattn
