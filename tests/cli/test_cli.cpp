// The `flexattn` tool, run as a user would (FLEXATTN_CLI_PATH) in a fresh temporary folder: the
// documented flags work, and every bad input gives exactly one stderr line starting "error:", the
// documented exit code (2 invalid input, 3 nothing can run, 1 otherwise) and no output file.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "flexattn/testing.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

namespace fs = std::filesystem;

constexpr int kExitInvalidInput = 2;
constexpr int kExitUnsupported = 3;
constexpr int kExitFailure = 1;
constexpr int kExitCheckFailed = 4;
// Two float64 computations of the same function that differ only in summation order.
constexpr double kFloat64Tolerance = 1e-12;
// A float32 engine against float64 on these small problems.
constexpr double kFloat32Tolerance = 1e-4;

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

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           fmt::format("flexattn_cli_{}_{}_{}", info->name(), ::getpid(), counter_++);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs the tool in the temporary folder with a clean FLEXATTN_* environment plus `environment`
  // ("NAME=VALUE" entries).
  CliResult run(const std::vector<std::string>& args,
                const std::vector<std::string>& environment = {}) const {
    std::string command =
        fmt::format("cd {} && env -u FLEXATTN_ENGINES -u FLEXATTN_LOG", quote(dir_.string()));
    // fmt rather than `" " + std::string` (GCC 12 -O3 warns falsely on that, -Wrestrict).
    for (const std::string& entry : environment) command += fmt::format(" {}", quote(entry));
    command += fmt::format(" {}", quote(FLEXATTN_CLI_PATH));
    for (const std::string& arg : args) command += fmt::format(" {}", quote(arg));
    command += fmt::format(" >{} 2>{}", quote((dir_ / "stdout.txt").string()),
                           quote((dir_ / "stderr.txt").string()));
    const int status = std::system(command.c_str());
    CliResult result;
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.out = read_text(dir_ / "stdout.txt");
    result.err = read_text(dir_ / "stderr.txt");
    fs::remove(dir_ / "stdout.txt");
    fs::remove(dir_ / "stderr.txt");
    return result;
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  bool exists(const std::string& name) const { return fs::exists(dir_ / name); }

  // The files in the folder (there must be no output and no temporary left after a failure).
  std::vector<std::string> files() const { return test::file_names(dir_); }

  // q, k, v of `problem` written as .npy files (in its layout), plus the inputs themselves.
  test::Inputs write_inputs(const Problem& problem, std::uint64_t seed) const {
    test::Inputs inputs = test::random_inputs(problem, seed);
    write_npy(path("q.npy"), inputs.q);
    write_npy(path("k.npy"), inputs.k);
    write_npy(path("v.npy"), inputs.v);
    return inputs;
  }

  // Fails unless the run failed with `code`, one "error: " line, and left only `inputs` behind.
  void expect_failure(const CliResult& result, int code, const std::string& part,
                      const std::vector<std::string>& inputs = {}) const {
    EXPECT_EQ(result.exit_code, code) << result.err;
    const std::vector<std::string> lines = lines_of(result.err);
    ASSERT_EQ(lines.size(), 1u) << result.err;
    EXPECT_EQ(lines[0].rfind("error: ", 0), 0u) << lines[0];
    EXPECT_NE(lines[0].find(part), std::string::npos) << lines[0];
    std::vector<std::string> expected = inputs;
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(files(), expected) << "an output or temporary file was left behind";
  }

 private:
  fs::path dir_;
  static inline int counter_ = 0;
};

ProblemDesc small_desc(Layout layout, DType dtype) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = 17;
  desc.seq_len_kv = 33;
  desc.head_dim_qk = 16;
  desc.layout = layout;
  desc.dtype = dtype;
  return desc;
}

// ---- documented flags ---------------------------------------------------------------------------

TEST_F(Cli, HelpExitsZero) {
  const CliResult result = run({"--help"});
  EXPECT_EQ(result.exit_code, 0);
  for (const char* command : {"demo", "engines", "explain", "run"}) {
    EXPECT_NE(result.out.find(command), std::string::npos) << command;
  }
}

TEST_F(Cli, EnginesListsEveryEngine) {
  const CliResult result = run({"engines"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("cpu_ref"), std::string::npos) << result.out;
  for (const auto& engine : builtin_engines()) {
    EXPECT_NE(result.out.find(std::string(engine->name())), std::string::npos) << engine->name();
  }
  const CliResult json = run({"engines", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json parsed = nlohmann::json::parse(json.out);
  EXPECT_EQ(parsed.at("engines").size(), builtin_engines().size());
}

TEST_F(Cli, RunWithRandomInputsWritesOutputs) {
  const CliResult result = run({"run",
                                "--batch",
                                "2",
                                "--heads-q",
                                "4",
                                "--heads-kv",
                                "2",
                                "--seq-len-q",
                                "17",
                                "--seq-len-kv",
                                "33",
                                "--head-dim",
                                "16",
                                "--head-dim-v",
                                "8",
                                "--score-mod",
                                "30 * tanh(score / 30)",
                                "--mask-mod",
                                "q >= kv",
                                "--seed",
                                "3",
                                "--out",
                                "out.npy",
                                "--lse",
                                "lse.npy",
                                "--check"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_TRUE(result.err.empty()) << result.err;
  EXPECT_NE(result.out.find("engine"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("max abs error vs cpu_ref"), std::string::npos) << result.out;
  const HostTensor out = read_npy(path("out.npy"));
  EXPECT_EQ(out.dtype(), DType::kF32);
  EXPECT_EQ(out.shape(), (std::vector<std::int64_t>{2, 17, 4, 8}));
  const HostTensor lse = read_npy(path("lse.npy"));
  EXPECT_EQ(lse.shape(), (std::vector<std::int64_t>{2, 4, 17}));
}

TEST_F(Cli, RunWithNpyInputsMatchesTheReference) {
  ProblemDesc desc = small_desc(Layout::kBHSD, DType::kF64);
  desc.score_mod = ir::parse("score + float(q - kv) / 8");
  desc.mask_mod = ir::parse("q + (KV_LEN - Q_LEN) >= kv");
  const Problem problem(desc);
  const test::Inputs inputs = write_inputs(problem, 5);
  const CliResult result =
      run({"run", "--layout", "bhsd", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--score-mod",
           "score + float(q - kv) / 8", "--mask-mod", "q + (KV_LEN - Q_LEN) >= kv", "--engine",
           "cpu_ref", "--out", "out.npy", "--lse", "lse.npy"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const test::Outputs expected =
      test::run_engine(*test::builtin_engine("cpu_ref"), problem, inputs);
  const HostTensor out = read_npy(path("out.npy"));
  EXPECT_EQ(out.dtype(), DType::kF64);  // the dtype comes from the files
  EXPECT_TRUE(test::within_tolerance(out, expected.out, kFloat64Tolerance));
  EXPECT_TRUE(test::within_tolerance(read_npy(path("lse.npy")), expected.lse, kFloat64Tolerance));
}

TEST_F(Cli, RunJsonParsesAndReportsTheCheck) {
  const CliResult result = run({"run", "--modifier", "softcap", "--modifier", "causal",
                                "--seq-len-q", "40", "--check", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const nlohmann::json summary = nlohmann::json::parse(result.out);
  EXPECT_FALSE(summary.at("engine").get<std::string>().empty());
  EXPECT_FALSE(summary.at("plan").get<std::string>().empty());
  EXPECT_GT(summary.at("forward_ms").get<double>(), 0.0);
  EXPECT_LE(summary.at("check").at("max_error").get<double>(), kFloat32Tolerance);
  EXPECT_TRUE(summary.at("check").at("max_abs_error").contains("out"));
}

TEST_F(Cli, BenchReportsTimesRatesAndTheSgemmYardstick) {
  const CliResult result = run({"bench", "--engine", "cpu", "--modifier", "softcap", "--seq-len-q",
                                "64", "--backward", "--iters", "2", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const nlohmann::json summary = nlohmann::json::parse(result.out);
  EXPECT_EQ(summary.at("engine").get<std::string>(), "cpu");
  EXPECT_GT(summary.at("forward_gflops").get<double>(), 0.0);
  EXPECT_GT(summary.at("forward_backward_ms").get<double>(),
            summary.at("forward_ms").get<double>());
  EXPECT_GE(summary.at("sgemm_gflops").get<double>(), 0.0);
  expect_failure(run({"bench", "--iters", "0"}), 2, "--iters");
}

TEST_F(Cli, RunBackwardWritesGradientsOfInputsAndTensors) {
  const CliResult result =
      run({"run", "--modifier", "post_scale_bias", "--seq-len-q", "24", "--heads-q", "2",
           "--backward", "--check", "--json", "--dq", "dq.npy", "--dk", "dk.npy", "--dv", "dv.npy",
           "--dtensor", "bias=dbias.npy"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const nlohmann::json summary = nlohmann::json::parse(result.out);
  EXPECT_LE(summary.at("check").at("max_error").get<double>(), kFloat32Tolerance);
  EXPECT_TRUE(summary.at("check").at("max_abs_error").contains("dbias"));
  EXPECT_EQ(read_npy(path("dbias.npy")).shape(), (std::vector<std::int64_t>{2, 24, 24}));
  for (const char* name : {"dq.npy", "dk.npy", "dv.npy"}) EXPECT_TRUE(exists(name)) << name;
}

TEST_F(Cli, RunThdWithOffsets) {
  const CliResult result = run({"run", "--layout", "thd", "--cu-seqlens-q", "0,5,17,20",
                                "--mask-mod", "q >= kv", "--out", "out.npy", "--check", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(read_npy(path("out.npy")).shape(), (std::vector<std::int64_t>{20, 4, 64}));
  const nlohmann::json summary = nlohmann::json::parse(result.out);
  EXPECT_LE(summary.at("check").at("max_error").get<double>(), kFloat32Tolerance);
}

TEST_F(Cli, RunPagedKvCacheDecodeAndChunkedPrefill) {
  // Decode: one new token per sequence; lengths 1, 57 and the whole capacity.
  CliResult result = run({"run",
                          "--seq-len-q",
                          "1",
                          "--seq-len-kv",
                          "100",
                          "--page-size",
                          "16",
                          "--batch",
                          "3",
                          "--heads-q",
                          "4",
                          "--heads-kv",
                          "2",
                          "--cache-lens",
                          "1,57,100",
                          "--modifier",
                          "softcap_causal",
                          "--check",
                          "--json",
                          "--out",
                          "out.npy"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  nlohmann::json summary = nlohmann::json::parse(result.out);
  EXPECT_EQ(summary.at("engine").get<std::string>(), "cpu");
  EXPECT_TRUE(summary.at("check").at("passed").get<bool>());
  EXPECT_GT(summary.at("kv_cache_gb_per_s").get<double>(), 0.0);
  EXPECT_NE(summary.at("problem").get<std::string>().find("paged KV cache of 21 pages of 16"),
            std::string::npos);
  EXPECT_EQ(read_npy(path("out.npy")).shape(), (std::vector<std::int64_t>{3, 1, 4, 64}));
  // Chunked prefill: 5 new tokens against 40 cached, and an empty slot.
  result = run({"run", "--layout", "thd", "--cu-seqlens-q", "0,5,6", "--seq-len-kv", "64",
                "--page-size", "8", "--cache-lens", "40,0", "--mask-mod", "q >= kv", "--check",
                "--json", "--lse", "lse.npy"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  summary = nlohmann::json::parse(result.out);
  EXPECT_TRUE(summary.at("check").at("passed").get<bool>());
  const HostTensor lse = read_npy(path("lse.npy"));
  EXPECT_TRUE(std::isfinite(lse.at(0)));
  EXPECT_EQ(lse.at(5), -std::numeric_limits<double>::infinity());  // head 0, the empty slot
  // bench reports the bytes of cached K and V read per second.
  result = run({"bench", "--seq-len-q", "1", "--seq-len-kv", "64", "--page-size", "16",
                "--cache-lens", "40", "--iters", "1", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_GT(nlohmann::json::parse(result.out).at("kv_cache_gb_per_s").get<double>(), 0.0);
}

TEST_F(Cli, RunPagedKvCacheFromFiles) {
  // Two sequences in pages of 4: sequence 0 in pool pages 2, 0; sequence 1 in page 1.
  HostTensor q(DType::kF32, {2, 2, 2, 8}), k(DType::kF32, {3, 4, 1, 8}),
      v(DType::kF32, {3, 4, 1, 8});
  q.fill_normal(1);
  k.fill_normal(2);
  v.fill_normal(3);
  HostTensor table(DType::kI32, {2, 2});
  table.set(0, 2), table.set(1, 0), table.set(2, 1), table.set(3, 1);
  write_npy(path("q.npy"), q);
  write_npy(path("k.npy"), k);
  write_npy(path("v.npy"), v);
  write_npy(path("table.npy"), table);
  const std::vector<std::string> common = {
      "run",       "--q",          "q.npy", "--k",          "k.npy",  "--v",
      "v.npy",     "--page-size",  "4",     "--seq-len-kv", "8",      "--page-table",
      "table.npy", "--cache-lens", "7,3",   "--mask-mod",   "q >= kv"};
  std::vector<std::string> args = common;
  args.insert(args.end(), {"--engine", "cpu_ref", "--out", "ref.npy"});
  CliResult result = run(args);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  args = common;
  args.insert(args.end(), {"--engine", "cpu", "--out", "out.npy", "--check"});
  result = run(args);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  // Row 1 of sequence 1 (position 2 of 3 cached tokens) attends to page 1's slots 0..2 only;
  // by hand, in float64.
  const HostTensor ref = read_npy(path("ref.npy"));
  for (std::int64_t h = 0; h < 2; ++h) {
    std::vector<double> scores;
    double largest = -1e300;
    for (std::int64_t kv = 0; kv < 3; ++kv) {
      double dot = 0;
      for (std::int64_t d = 0; d < 8; ++d) {
        dot += q.at(((1 * 2 + 1) * 2 + h) * 8 + d) * k.at((1 * 4 + kv) * 8 + d);
      }
      scores.push_back(dot / std::sqrt(8.0));
      largest = std::max(largest, scores.back());
    }
    double sum = 0;
    for (double& score : scores) sum += (score = std::exp(score - largest));
    for (std::int64_t d = 0; d < 8; ++d) {
      double expected = 0;
      for (std::int64_t kv = 0; kv < 3; ++kv) expected += scores[kv] / sum * v.at((4 + kv) * 8 + d);
      EXPECT_NEAR(ref.at(((1 * 2 + 1) * 2 + h) * 8 + d), expected, 1e-6);
    }
  }
  EXPECT_TRUE(test::within_tolerance(read_npy(path("out.npy")), ref, kFloat32Tolerance));
}

TEST_F(Cli, RunPagedKvCacheRefusesBadCaches) {
  expect_failure(run({"run", "--pages", "4"}), 2, "--pages needs --page-size");
  expect_failure(run({"run", "--cache-lens", "4"}), 2, "--cache-lens needs --page-size");
  expect_failure(run({"run", "--page-size", "0"}), 2, "--page-size");
  expect_failure(run({"run", "--page-size", "16", "--batch", "3", "--cache-lens", "1,2"}), 2,
                 "--cache-lens has 2 values; the batch has 3 sequences");
  expect_failure(run({"run", "--page-size", "16", "--seq-len-q", "2", "--seq-len-kv", "100",
                      "--cache-lens", "200"}),
                 2, "cache_lens[0] (200) must be 0 or in [2, 112]");
  expect_failure(run({"run", "--page-size", "16", "--layout", "sbhd"}), 2,
                 "a KV cache takes queries in layout bshd or thd, not sbhd");
  expect_failure(run({"run", "--page-size", "16", "--backward"}), 2, "forward only");
  expect_failure(run({"run", "--page-size", "16", "--seq-len-kv", "9223372036854775807"}), 2,
                 "capacity max_pages x page_size (576460752303423488 x 16) is past the "
                 "modifiers' i32 indices");
  HostTensor table(DType::kI64, {1, 8});
  write_npy(path("table.npy"), table);
  expect_failure(run({"run", "--page-size", "16", "--page-table", "table.npy"}), 2,
                 "--page-table 'table.npy': expected int32 (batch, max_pages) = [1, 8]",
                 {"table.npy"});
  HostTensor outside(DType::kI32, {1, 8});
  outside.set(3, 8);  // the pool has 8 pages
  write_npy(path("outside.npy"), outside);
  expect_failure(run({"run", "--page-size", "16", "--page-table", "outside.npy", "--out", "o.npy"}),
                 2, "page_table[0, 3] (8) is outside the pool's pages [0, 8)",
                 {"outside.npy", "table.npy"});
}

TEST_F(Cli, LogInfoNamesTheSelection) {
  const CliResult result = run({"run", "--seq-len-q", "8"}, {"FLEXATTN_LOG=info"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.err.find("flexattn: selected"), std::string::npos) << result.err;
}

// `explain --source` prints the code the cuda engine would compile (no GPU needed), including
// the derivative of the modifier when the problem wants gradients.
TEST_F(Cli, ExplainSourcePrintsTheGeneratedModifier) {
  const CliResult result =
      run({"explain", "--modifier", "softcap", "--dtype", "bf16", "--backward", "--source"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  bool cuda_built = false;
  for (const auto& engine : builtin_engines()) cuda_built = cuda_built || engine->name() == "cuda";
  if (!cuda_built) {
    GTEST_SKIP() << "built without the cuda engine: no engine generates code";
  }
  EXPECT_NE(result.out.find("code generated by cuda:"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("ir_tanh("), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("score_grad("), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("flexattn_backward_dq"), std::string::npos) << result.out;
}

TEST_F(Cli, ExplainShowsModifierHashDerivativesAndEveryEngine) {
  const CliResult result =
      run({"explain", "--with-planted-faults", "--heads-q", "8", "--score-mod",
           "score + bias[h, q, kv] * 2", "--tensor", "bias=bias.npy", "--seq-len-q", "16"});
  // bias.npy does not exist yet: an input error.
  expect_failure(result, kExitInvalidInput, "bias.npy");
  HostTensor bias(DType::kF32, {8, 16, 16});
  bias.fill_normal(1);
  write_npy(path("bias.npy"), bias);
  const CliResult explained =
      run({"explain", "--with-planted-faults", "--heads-q", "8", "--score-mod",
           "score + bias[h, q, kv] * 2", "--tensor", "bias=bias.npy", "--seq-len-q", "16"});
  ASSERT_EQ(explained.exit_code, 0) << explained.err;
  ProblemDesc desc;
  desc.heads_q = 8;
  desc.seq_len_q = 16;
  desc.tensors["bias"] = TensorDecl{DType::kF32, {8, 16, 16}};
  desc.score_mod = ir::parse("score + bias[h, q, kv] * 2", desc.scope());
  const Problem problem(desc);
  const std::string& text = explained.out;
  EXPECT_NE(text.find(hash_to_hex(problem.modifier_hash())), std::string::npos) << text;
  EXPECT_NE(text.find(problem.score_mod().to_string()), std::string::npos) << text;
  EXPECT_NE(text.find("d score_mod / d score"), std::string::npos) << text;
  EXPECT_NE(text.find("d score_mod / d bias[h, q, kv]"), std::string::npos) << text;
  std::vector<std::shared_ptr<const Engine>> engines = builtin_engines();
  for (const auto& engine : testing::planted_faulty_engines()) engines.push_back(engine);
  for (const auto& engine : engines) {
    EXPECT_NE(text.find(std::string(engine->name())), std::string::npos) << engine->name();
  }
  const CliResult json = run({"explain", "--json", "--score-mod", "30 * tanh(score / 30)"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json parsed = nlohmann::json::parse(json.out);
  EXPECT_EQ(parsed.at("engines").size(), builtin_engines().size());
  EXPECT_FALSE(parsed.at("derivative_wrt_score").get<std::string>().empty());
}

TEST_F(Cli, DemoRunsAndPassesItsCheck) {
  const CliResult result = run({"demo", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const nlohmann::json summary = nlohmann::json::parse(result.out);
  EXPECT_TRUE(summary.at("check").at("passed").get<bool>());
  EXPECT_GT(summary.at("gflops").get<double>(), 0.0);
}

// ---- bad inputs ---------------------------------------------------------------------------------

TEST_F(Cli, MalformedExpression) {
  expect_failure(run({"run", "--score-mod", "30 * tanh(score / ", "--out", "out.npy"}),
                 kExitInvalidInput, "--score-mod");
}

TEST_F(Cli, UnknownTensorName) {
  expect_failure(run({"run", "--score-mod", "score + nope[h]", "--out", "out.npy"}),
                 kExitInvalidInput, "nope");
}

TEST_F(Cli, UnknownFlag) {
  expect_failure(run({"run", "--bogus", "1", "--out", "out.npy"}), kExitInvalidInput, "--bogus");
}

TEST_F(Cli, ShapeMismatchBetweenInputs) {
  const Problem problem(small_desc(Layout::kBSHD, DType::kF32));
  write_inputs(problem, 1);
  HostTensor narrow_k(DType::kF32, {2, 33, 2, 8});
  write_npy(path("k.npy"), narrow_k);
  expect_failure(run({"run", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "out.npy"}),
                 kExitInvalidInput, "shape mismatch", {"q.npy", "k.npy", "v.npy"});
}

TEST_F(Cli, FlagDisagreesWithInputFile) {
  const Problem problem(small_desc(Layout::kBSHD, DType::kF32));
  write_inputs(problem, 1);
  expect_failure(run({"run", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--seq-len-q", "16",
                      "--out", "out.npy"}),
                 kExitInvalidInput, "--seq-len-q", {"q.npy", "k.npy", "v.npy"});
}

TEST_F(Cli, HeadsNotAMultiple) {
  expect_failure(run({"run", "--heads-q", "6", "--heads-kv", "4", "--out", "out.npy"}),
                 kExitInvalidInput, "multiple");
}

TEST_F(Cli, CorruptNpy) {
  const Problem problem(small_desc(Layout::kBSHD, DType::kF32));
  write_inputs(problem, 1);
  std::ofstream(path("q.npy"), std::ios::binary | std::ios::trunc) << "\x93NUMPY garbage";
  expect_failure(run({"run", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "out.npy"}),
                 kExitInvalidInput, "q.npy", {"q.npy", "k.npy", "v.npy"});
}

// --tensor NAME=FILE.npy:bf16 stores a float tensor as bf16: the run equals one whose file holds
// the bf16-rounded values, and differs from the unrounded file's.
TEST_F(Cli, TensorStorageSuffixConvertsTheTensor) {
  constexpr std::int64_t kHeads = 4, kSeqLen = 16;
  HostTensor bias(DType::kF32, {kHeads, kSeqLen, kSeqLen});
  bias.fill_normal(3, 4.0);
  write_npy(path("bias.npy"), bias);
  write_npy(path("rounded.npy"), bias.to(DType::kBF16).to(DType::kF32));
  const auto output = [&](const std::string& tensor, const std::string& out) {
    const CliResult result =
        run({"run", "--engine", "cpu_ref", "--heads-q", "4", "--seq-len-q", "16", "--tensor",
             tensor, "--score-mod", "score + bias[h, q, kv]", "--out", out});
    EXPECT_EQ(result.exit_code, 0) << result.err;
    return read_npy(path(out));
  };
  const HostTensor converted = output("bias=bias.npy:bf16", "converted.npy");
  const HostTensor rounded = output("bias=rounded.npy", "rounded_out.npy");
  const HostTensor exact = output("bias=bias.npy:fp32", "exact.npy");
  bool differs = false;
  for (std::int64_t i = 0; i < converted.numel(); ++i) {
    ASSERT_EQ(converted.at(i), rounded.at(i)) << i;
    differs = differs || converted.at(i) != exact.at(i);
  }
  EXPECT_TRUE(differs);
  // Only float tensors take a storage; an unknown suffix is part of the file name.
  HostTensor ids(DType::kI32, {kSeqLen});
  write_npy(path("ids.npy"), ids);
  expect_failure(
      run({"run", "--seq-len-q", "16", "--tensor", "ids=ids.npy:bf16", "--mask-mod",
           "ids[q] == ids[kv]", "--out", "out.npy"}),
      kExitInvalidInput, "applies to float tensors",
      {"bias.npy", "converted.npy", "exact.npy", "ids.npy", "rounded.npy", "rounded_out.npy"});
  expect_failure(
      run({"run", "--heads-q", "4", "--seq-len-q", "16", "--tensor", "bias=bias.npy:bf17",
           "--score-mod", "score + bias[h, q, kv]", "--out", "out.npy"}),
      kExitInvalidInput, "bias.npy:bf17",
      {"bias.npy", "converted.npy", "exact.npy", "ids.npy", "rounded.npy", "rounded_out.npy"});
}

TEST_F(Cli, OutOfRangeTensorIndex) {
  constexpr std::int64_t kHeads = 4, kSeqLen = 16;
  HostTensor bias(DType::kF32, {kHeads, kSeqLen, kSeqLen});
  write_npy(path("bias.npy"), bias);
  expect_failure(run({"run", "--heads-q", "4", "--seq-len-q", "16", "--tensor", "bias=bias.npy",
                      "--score-mod", "score + bias[h, q, kv + 1]", "--out", "out.npy"}),
                 kExitInvalidInput, "bias", {"bias.npy"});
}

TEST_F(Cli, UnknownEngineForced) {
  expect_failure(run({"run", "--engine", "warp_drive", "--out", "out.npy"}), kExitInvalidInput,
                 "unknown engine 'warp_drive'");
}

TEST_F(Cli, NoEngineCanRun) {
  const CliResult result = run({"run", "--out", "out.npy"}, {"FLEXATTN_ENGINES=-cpu*"});
  expect_failure(result, kExitUnsupported, "no engine can run this problem");
  EXPECT_NE(result.err.find("cpu_ref: denied by policy FLEXATTN_ENGINES=-cpu*"), std::string::npos)
      << result.err;
}

TEST_F(Cli, PlantedFaultIsRefusedByThePlanProof) {
  const CliResult result = run({"run", "--with-planted-faults", "--engine", "faulty_drop_mod",
                                "--score-mod", "30*tanh(score/30)", "--out", "out.npy"});
  expect_failure(result, kExitFailure,
                 "refusing to run a plan that does not implement the requested modifier");
  EXPECT_NE(result.err.find("faulty_drop_mod"), std::string::npos) << result.err;
}

// The lying engine passes the plan proof; the plan canary refuses it (exit 3, one line).
TEST_F(Cli, LyingEngineIsRefusedByTheCanary) {
  const CliResult run_result =
      run({"run", "--with-planted-faults", "--engine", "faulty_lying_hash", "--score-mod",
           "30*tanh(score/30)", "--mask-mod", "q >= kv", "--out", "out.npy"});
  expect_failure(run_result, kExitUnsupported, "canary: engine faulty_lying_hash computed");
  const CliResult demo = run({"demo", "--with-planted-faults", "--engine", "faulty_lying_hash"});
  expect_failure(demo, kExitUnsupported, "canary: engine faulty_lying_hash computed");
  EXPECT_NE(demo.err.find("is allowed"), std::string::npos) << demo.err;
}

// With the canary off, the demo's own per-element check catches the engine that drops the cap:
// exit 4, one error line, and no "ok" anywhere.
TEST_F(Cli, DemoCheckFailsTheLyingEngineWithoutTheCanary) {
  const CliResult demo = run({"demo", "--with-planted-faults", "--engine", "faulty_lying_hash"},
                             {"FLEXATTN_CANARY=0"});
  expect_failure(demo, kExitCheckFailed, "faulty_lying_hash disagrees with cpu_ref");
  EXPECT_EQ(demo.out.find(": ok"), std::string::npos) << demo.out;
  EXPECT_NE(demo.out.find("FAILED"), std::string::npos) << demo.out;
}

TEST_F(Cli, GradientOutputWithoutBackward) {
  expect_failure(run({"run", "--dq", "dq.npy"}), kExitInvalidInput, "--backward");
}

TEST_F(Cli, MissingInputFile) {
  expect_failure(run({"run", "--q", "no.npy", "--k", "no.npy", "--v", "no.npy", "--out", "o.npy"}),
                 kExitInvalidInput, "no.npy");
}

TEST_F(Cli, OutputFolderMissing) {
  expect_failure(run({"run", "--out", "missing/out.npy"}), kExitInvalidInput, "missing");
}

// A modifier past float32's range (`score + 1e39` is `score + inf`: NaN rows) computes the same
// on the cpu engine as on cpu_ref, so the canary (NaN agrees with NaN) and the check pass.
TEST_F(Cli, OverflowingModifierMatchesTheReferenceThroughCanaryAndCheck) {
  for (const char* modifier : {"score + 1e39", "where(kv == 3, score * 1e39, score)"}) {
    const CliResult result = run({"run", "--engine", "cpu", "--seq-len-q", "64", "--score-mod",
                                  modifier, "--backward", "--check"});
    EXPECT_EQ(result.exit_code, 0) << modifier << ": " << result.err;
    EXPECT_NE(result.out.find(": ok"), std::string::npos) << result.out;
  }
}

// ---- the output transaction
// ----------------------------------------------------------------------

// Two flags naming one file (after normalisation and links), or an output naming an input, are
// refused before anything runs; nothing is written and the input is unchanged.
TEST_F(Cli, OutputsNamingOneFileOrAnInputAreRefused) {
  fs::create_directories(path("sub"));
  fs::create_symlink("o.npy", path("link.npy"));
  for (const auto& [out, lse] :
       std::vector<std::pair<std::string, std::string>>{{"o.npy", "o.npy"},
                                                        {"o.npy", "./o.npy"},
                                                        {"o.npy", "sub/../o.npy"},
                                                        {"o.npy", "link.npy"},
                                                        {"o.npy", path("o.npy")}}) {
    expect_failure(run({"run", "--seq-len-q", "16", "--out", out, "--lse", lse}), kExitInvalidInput,
                   "name the same file", {"link.npy", "sub"});
  }
  const Problem problem(small_desc(Layout::kBSHD, DType::kF32));
  write_inputs(problem, 1);
  const std::string before = read_text(path("q.npy"));
  expect_failure(run({"run", "--layout", "bshd", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy",
                      "--out", "./q.npy"}),
                 kExitInvalidInput, "is the input of --q",
                 {"k.npy", "link.npy", "q.npy", "sub", "v.npy"});
  EXPECT_EQ(read_text(path("q.npy")), before);
}

// A destination that exists and is not a regular file is refused up front (it would be replaced
// by the rename, not written). A FIFO stands for device nodes too: a test that tried /dev/null
// would, against a build with the defect, replace the machine's /dev/null.
TEST_F(Cli, DeviceAndFifoOutputsAreRefused) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  expect_failure(run({"run", "--seq-len-q", "16", "--out", "fifo"}), kExitInvalidInput,
                 "not a regular file", {"fifo"});
  EXPECT_TRUE(fs::is_fifo(path("fifo")));
}

// A second output that cannot be written (no file can be created in /proc) leaves the first
// output's existing file as it was and no temporary behind: the outputs are one transaction.
TEST_F(Cli, AFailedOutputLeavesEveryOtherOutputUnchanged) {
  { std::ofstream(path("o.npy")) << "the previous contents"; }
  const CliResult result =
      run({"run", "--seq-len-q", "16", "--out", "o.npy", "--lse", "/proc/flexattn-lse.npy"});
  expect_failure(result, kExitFailure, "cannot write '/proc/flexattn-lse.npy'", {"o.npy"});
  EXPECT_EQ(read_text(path("o.npy")), "the previous contents");
}

// A successful run replaces an existing output through a symbolic link (the link stays), keeps
// the replaced file's permissions, and leaves no temporary; a file planted at a temporary name
// of the old scheme (OUTPUT.tmp.PID, predictable) is never touched.
TEST_F(Cli, OutputsReplaceFilesThroughLinksAndKeepTheirPermissions) {
  { std::ofstream(path("target.npy")) << "old"; }
  fs::permissions(path("target.npy"), fs::perms::owner_read | fs::perms::owner_write);
  fs::create_symlink("target.npy", path("link.npy"));
  { std::ofstream(path("victim")) << "victim"; }
  const CliResult result = run({"run", "--seq-len-q", "16", "--out", "link.npy"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_TRUE(fs::is_symlink(path("link.npy")));
  EXPECT_EQ(read_npy(path("link.npy")).numel(), 1 * 16 * 4 * 64);
  EXPECT_EQ(fs::status(path("target.npy")).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(files(), (std::vector<std::string>{"link.npy", "target.npy", "victim"}));
  EXPECT_EQ(read_text(path("victim")), "victim");
}

// `run --check` with an engine that drops the modifier (the canary switched off so the planted
// engine is selected): exit 4, the reason on stderr, "passed": false, and no output file.
TEST_F(Cli, RunCheckFailureExitsFourAndWritesNothing) {
  const CliResult result =
      run({"run", "--with-planted-faults", "--engine", "faulty_lying_hash", "--heads-q", "2",
           "--seq-len-q", "64", "--dtype", "bf16", "--score-mod", "3 * tanh(score / 3)",
           "--backward", "--check", "--json", "--out", "out.npy", "--dq", "dq.npy"},
          {"FLEXATTN_CANARY=0"});
  EXPECT_EQ(result.exit_code, 4) << result.err;
  EXPECT_NE(result.err.find("error: check against cpu_ref failed"), std::string::npos)
      << result.err;
  EXPECT_NE(result.err.find("dq: error"), std::string::npos) << result.err;
  EXPECT_FALSE(exists("out.npy"));
  EXPECT_FALSE(exists("dq.npy"));
  const nlohmann::json summary = nlohmann::json::parse(result.out);
  EXPECT_FALSE(summary.at("check").at("passed").get<bool>());
  EXPECT_TRUE(summary.at("outputs").empty());
}

// NaN on both sides (log of negative scores, through the reference itself) agrees: error 0, not
// nan, and the check passes.
TEST_F(Cli, RunCheckCountsAgreeingNanAsZero) {
  const CliResult result = run({"run", "--engine", "cpu_ref", "--seq-len-q", "4", "--score-mod",
                                "log(score)", "--check", "--json", "--out", "out.npy"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const nlohmann::json summary = nlohmann::json::parse(result.out);
  EXPECT_EQ(summary.at("check").at("max_abs_error").at("out").get<double>(), 0.0);
  EXPECT_EQ(summary.at("check").at("max_abs_error").at("lse").get<double>(), 0.0);
  EXPECT_TRUE(summary.at("check").at("passed").get<bool>());
  EXPECT_TRUE(exists("out.npy"));
}

}  // namespace
}  // namespace flexattn
