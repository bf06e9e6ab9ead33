// The `flexattn` tool against hostile and careless input: sizes whose products overflow or pass
// the machine's memory, integers outside int64, explicit zero sizes and empty texts, non-finite
// parameters, a stdout that cannot be written, and inputs read from pipes. Each is refused with
// one "error:" line and its exit code (2 invalid input, 1 otherwise), or, for pipes, read.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

namespace fs = std::filesystem;

constexpr int kExitInvalidInput = 2;
constexpr int kExitFailure = 1;
// A refusal happens before any allocation or computation: well under this.
constexpr std::chrono::seconds kRefusalTime{5};

struct CliResult {
  int exit_code = -1;
  std::string out, err;
};

std::string quote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

using test::read_text;

class CliInput : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           fmt::format("flexattn_cli_input_{}_{}", info->name(), ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `before` (a shell prefix such as "cat q.npy |"), the tool with `args`, then `stdout_to`
  // (a redirection target; empty: a file read back into the result), in the temporary folder.
  CliResult run(const std::vector<std::string>& args, const std::string& before = "",
                const std::string& stdout_to = "") const {
    std::string command = fmt::format("cd {} && {} env -u FLEXATTN_ENGINES -u FLEXATTN_LOG {}",
                                      quote(dir_.string()), before, quote(FLEXATTN_CLI_PATH));
    for (const std::string& arg : args) command += fmt::format(" {}", quote(arg));
    const fs::path out_file = dir_ / "stdout.txt", err_file = dir_ / "stderr.txt";
    command += fmt::format(" >{} 2>{}", stdout_to.empty() ? quote(out_file.string()) : stdout_to,
                           quote(err_file.string()));
    const int status = std::system(command.c_str());
    CliResult result;
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.out = read_text(out_file);
    result.err = read_text(err_file);
    fs::remove(out_file);
    fs::remove(err_file);
    return result;
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // One "error: " line containing `part`, exit `code`, and no file left in the folder.
  static void expect_refused(const CliResult& result, int code, const std::string& part) {
    EXPECT_EQ(result.exit_code, code) << result.err;
    EXPECT_EQ(result.err.rfind("error: ", 0), 0u) << result.err;
    EXPECT_EQ(result.err.find('\n'), result.err.size() - 1) << "not one line: " << result.err;
    EXPECT_NE(result.err.find(part), std::string::npos) << result.err;
  }

 private:
  fs::path dir_;
};

const std::vector<std::string> kSmallProblem = {
    "--batch", "1", "--heads-q", "2", "--seq-len-q", "9", "--head-dim", "8", "--engine", "cpu"};

std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

TEST_F(CliInput, SizeProductsPastTheLimitAreRefusedNamingTheDimensions) {
  struct Case {
    std::vector<std::string> flags;
    std::string part;
  };
  const std::vector<Case> cases = {
      // 16 x 4 x 2^62 elements wrapped to a 64-byte allocation (SIGSEGV).
      {{"--seq-len-q", "16", "--head-dim", "4611686018427387904"},
       "head_dim_qk 4611686018427387904"},
      {{"--heads-q", "3000000", "--seq-len-q", "3000000", "--head-dim", "3000000"},
       "heads_q 3000000"},
      {{"--seq-len-q", "1000", "--head-dim", "2", "--head-dim-v", "9223372036854775807"},
       "head_dim_v 9223372036854775807"},
      // The modifiers index q and kv as i32.
      {{"--seq-len-q", "3000000000", "--head-dim", "1"}, "seq_len_q (3000000000)"},
      // 4 TB of q: below the 2^48-byte limit, past this machine's memory.
      {{"--seq-len-q", "1000000000", "--head-dim", "1000"}, "host memory"},
      // A catalogue tensor (heads, seq, seq) too large for memory.
      {{"--seq-len-q", "4000000", "--head-dim", "1", "--modifier", "post_scale_bias"},
       "host memory"},
  };
  for (const Case& test_case : cases) {
    SCOPED_TRACE(fmt::format("{}", fmt::join(test_case.flags, " ")));
    const auto start = std::chrono::steady_clock::now();
    const CliResult result = run(with({"run", "--engine", "cpu"}, test_case.flags));
    expect_refused(result, kExitInvalidInput, test_case.part);
    EXPECT_LT(std::chrono::steady_clock::now() - start, kRefusalTime);
  }
}

TEST_F(CliInput, IntegersOutsideTheirRangeAreRefusedNotClamped) {
  struct Case {
    std::vector<std::string> flags;
    std::string part;
  };
  const std::vector<Case> cases = {
      {{"--head-dim", "99999999999999999999"}, "outside the range"},
      {{"--batch", "-9223372036854775809"}, "outside the range"},
      {{"--seed", "18446744073709551616"}, "outside the range"},
      {{"--seed", "-1"}, "not a decimal integer"},
      {{"--seq-len-q", "12abc"}, "not a decimal integer"},
      {{"--layout", "thd", "--cu-seqlens-q", "0,99999999999999999999"}, "outside the range"},
  };
  for (const Case& test_case : cases) {
    SCOPED_TRACE(fmt::format("{}", fmt::join(test_case.flags, " ")));
    expect_refused(run(with({"explain"}, test_case.flags)), kExitInvalidInput, test_case.part);
  }
  // Leading zeros are decimal, not octal: 010 is ten query positions.
  const CliResult decimal = run({"explain", "--seq-len-q", "010", "--json"});
  ASSERT_EQ(decimal.exit_code, 0) << decimal.err;
  EXPECT_NE(decimal.out.find("seq 10/10"), std::string::npos) << decimal.out;
}

TEST_F(CliInput, ExplicitZeroSizesAreRefused) {
  for (const char* flag : {"--batch", "--heads-q", "--heads-kv", "--seq-len-q", "--seq-len-kv",
                           "--head-dim", "--head-dim-v"}) {
    SCOPED_TRACE(flag);
    expect_refused(run({"run", flag, "0"}), kExitInvalidInput, "0 is not a size");
    expect_refused(run({"run", flag, "-4"}), kExitInvalidInput, "-4 is not a size");
  }
}

TEST_F(CliInput, ExplicitEmptyTextsAreRefused) {
  for (const char* flag :
       {"--score-mod", "--mask-mod", "--dtype", "--layout", "--modifier", "--q", "--engine"}) {
    SCOPED_TRACE(flag);
    expect_refused(run({"run", flag, ""}), kExitInvalidInput, "empty value");
    expect_refused(run({"explain", flag, "  "}), kExitInvalidInput, "empty value");
  }
}

TEST_F(CliInput, NonFiniteParametersAreRefused) {
  for (const char* value : {"nan", "inf", "-inf", "1e999"}) {
    SCOPED_TRACE(value);
    const CliResult result = run(with({"run"}, {"--score-mod", "cap * tanh(score / cap)", "--param",
                                                fmt::format("cap={}", value)}));
    expect_refused(result, kExitInvalidInput, "cap");
    EXPECT_TRUE(result.err.find("finite") != std::string::npos ||
                result.err.find("not a number") != std::string::npos)
        << result.err;
  }
}

TEST_F(CliInput, AnUnwritableStdoutExitsOne) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"explain", "--modifier", "softcap"}, with({"run"}, kSmallProblem),
        std::vector<std::string>{"engines", "--json"}}) {
    SCOPED_TRACE(args[0]);
    expect_refused(run(args, "", "/dev/full"), kExitFailure, "cannot write to standard output");
  }
}

TEST_F(CliInput, InputsAreReadFromPipesAndStdin) {
  ProblemDesc desc;
  desc.batch = 1, desc.heads_q = 2, desc.seq_len_q = 9, desc.head_dim_qk = 8;
  const Problem problem(desc);
  const test::Inputs inputs = test::random_inputs(problem, 5);
  write_npy(path("q.npy"), inputs.q);
  write_npy(path("k.npy"), inputs.k);
  write_npy(path("v.npy"), inputs.v);
  const std::vector<std::string> common = {"run",   "--engine", "cpu_ref", "--k",
                                           "k.npy", "--v",      "v.npy"};
  const CliResult from_file = run(with(common, {"--q", "q.npy", "--out", "file.npy"}));
  ASSERT_EQ(from_file.exit_code, 0) << from_file.err;
  const CliResult from_stdin =
      run(with(common, {"--q", "/dev/stdin", "--out", "stdin.npy"}), "cat q.npy |");
  ASSERT_EQ(from_stdin.exit_code, 0) << from_stdin.err;
  ASSERT_EQ(::mkfifo(path("q.fifo").c_str(), 0600), 0);
  const CliResult from_fifo =
      run(with(common, {"--q", "q.fifo", "--out", "fifo.npy"}), "(cat q.npy > q.fifo &) &&");
  ASSERT_EQ(from_fifo.exit_code, 0) << from_fifo.err;
  const HostTensor expected = read_npy(path("file.npy"));
  for (const char* name : {"stdin.npy", "fifo.npy"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(test::max_abs_error(read_npy(path(name)), expected), 0.0);
  }
  // A stream that ends early, or runs on past the data, is refused like a file.
  const std::string bytes = read_text(path("q.npy"));
  std::ofstream(path("short.bin"), std::ios::binary) << bytes.substr(0, bytes.size() - 4);
  std::ofstream(path("long.bin"), std::ios::binary) << bytes << "tail";
  for (const char* name : {"short.bin", "long.bin"}) {
    SCOPED_TRACE(name);
    expect_refused(run(with(common, {"--q", "/dev/stdin"}), fmt::format("cat {} |", name)),
                   kExitInvalidInput, "data size does not match the shape");
  }
}

}  // namespace
}  // namespace flexattn
