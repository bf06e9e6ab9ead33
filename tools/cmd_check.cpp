// `flexattn check [--engines LIST] [--tier quick|full|non-finite] [--json FILE]`: every engine on
// every case of the conformance matrix against cpu_ref, as a table a person reads at a glance, then
// a summary per engine. What a user runs after installing on a new machine or a new cuDNN.
#include "cmd_check.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "flexattn/conformance.hpp"
#include "flexattn/context.hpp"
#include "flexattn/error.hpp"
#include "flexattn/npy.hpp"
#include "flexattn/testing.hpp"

namespace flexattn::cli {
namespace {

using conformance::Case;
using conformance::Outcome;
using conformance::Status;

struct Tally {
  int passed = 0, failed = 0, skipped = 0;
  double worst_ratio = 0.0;  // max error / allowed over passing and failing cases
  std::map<std::string, int> skip_reasons;
};

// Column widths of the table (the longest case names of the catalogue fit).
constexpr int kEngineWidth = 18;
constexpr int kCaseWidth = 72;

void write_text_atomically(const std::string& path, const std::string& text) {
  OutputFiles file;
  file.add_bytes(path, text);
  file.commit();
}

std::vector<std::shared_ptr<const Engine>> engines_to_check(const CheckFlags& flags) {
  std::vector<std::shared_ptr<const Engine>> engines = builtin_engines();
  if (flags.planted_faults) {
    for (auto& engine : testing::planted_faulty_engines()) engines.push_back(engine);
  }
  std::vector<std::shared_ptr<const Engine>> chosen;
  if (flags.engines.empty()) {
    for (auto& engine : engines) {
      if (engine->name() != "cpu_ref") chosen.push_back(engine);  // the oracle itself
    }
    return chosen;
  }
  const Policy policy = Policy::parse(flags.engines);
  for (auto& engine : engines) {
    if (policy.allows(engine->name())) chosen.push_back(engine);
  }
  if (chosen.empty()) {
    std::string names;
    for (auto& engine : engines)
      names += fmt::format("{}{}", names.empty() ? "" : ", ", engine->name());
    throw_invalid(
        fmt::format("--engines '{}' matches no engine (engines: {})", flags.engines, names));
  }
  return chosen;
}

}  // namespace

void add_check_command(CLI::App& app, CheckFlags& flags) {
  CLI::App* check = app.add_subcommand(
      "check", "Run the conformance matrix: every engine against cpu_ref on every case");
  check->add_option("--engines", flags.engines,
                    "Comma-separated engine name globs (default: every engine but cpu_ref)");
  check->add_option("--tier", flags.tier,
                    "quick (CI), full, or non-finite (NaN and inf planted in the inputs)")
      ->check(CLI::IsMember({"quick", "full", "non-finite"}));
  check->add_option("--json", flags.json_file, "Write every result to this JSON file");
  check->add_option("--filter", flags.filter, "Only cases whose name contains this text");
  check->add_flag("--verbose", flags.verbose, "Print passing cases too");
  check->add_flag("--planted-faults", flags.planted_faults)->group("");  // test-only, hidden
}

int check_command(const CheckFlags& flags) {
  const std::vector<std::shared_ptr<const Engine>> engines = engines_to_check(flags);
  std::vector<Case> cases = conformance::cases(conformance::parse_tier(flags.tier));
  if (!flags.filter.empty()) {
    std::erase_if(cases,
                  [&](const Case& c) { return c.name.find(flags.filter) == std::string::npos; });
  }
  if (!flags.json_file.empty()) {
    // Fail on an unwritable path now, not after the whole matrix ran.
    const std::filesystem::path parent = std::filesystem::path(flags.json_file).parent_path();
    if (!parent.empty() && !std::filesystem::is_directory(parent)) {
      throw_invalid(
          fmt::format("cannot write '{}': no folder '{}'", flags.json_file, parent.string()));
    }
  }

  fmt::print("{:<{}} {:<{}} {:>10} {:>10} {:>8}  {}\n", "engine", kEngineWidth, "case", kCaseWidth,
             "max err", "allowed", "outside", "verdict");
  nlohmann::json results = nlohmann::json::array();
  std::map<std::string, Tally> tallies;
  const auto start = std::chrono::steady_clock::now();
  for (const auto& engine : engines) {
    Tally& tally = tallies[std::string(engine->name())];
    for (const Case& test_case : cases) {
      const Outcome outcome = conformance::run_case(*engine, test_case);
      const double ratio = outcome.allowed() > 0.0 ? outcome.max_error() / outcome.allowed() : 0.0;
      switch (outcome.status) {
        case Status::kPass:
          ++tally.passed;
          break;
        case Status::kFail:
          ++tally.failed;
          break;
        case Status::kSkipped:
          ++tally.skipped;
          ++tally.skip_reasons[outcome.reason];
          break;
      }
      if (outcome.status != Status::kSkipped)
        tally.worst_ratio = std::max(tally.worst_ratio, ratio);
      const bool show =
          flags.verbose || outcome.status == Status::kFail ||
          (outcome.status == Status::kSkipped && tally.skip_reasons[outcome.reason] == 1);
      if (show) {
        const std::string verdict =
            outcome.status == Status::kPass
                ? "pass"
                : fmt::format("{}: {}", conformance::to_string(outcome.status), outcome.reason);
        if (outcome.status == Status::kSkipped) {
          fmt::print("{:<{}} {:<{}} {:>10} {:>10} {:>8}  {}{}\n", engine->name(), kEngineWidth,
                     test_case.name, kCaseWidth, "-", "-", "-", verdict,
                     flags.verbose ? "" : " (first of its kind)");
        } else {
          fmt::print("{:<{}} {:<{}} {:>10.3g} {:>10.3g} {:>7.2f}%  {}\n", engine->name(),
                     kEngineWidth, test_case.name, kCaseWidth, outcome.max_error(),
                     outcome.allowed(), 100.0 * outcome.fraction_outside(), verdict);
        }
        std::fflush(stdout);
      }
      nlohmann::json row = {{"engine", engine->name()},
                            {"case", test_case.name},
                            {"status", conformance::to_string(outcome.status)},
                            {"reason", outcome.reason}};
      for (const auto& check : outcome.checks) {
        row["outputs"].push_back({{"output", check.output},
                                  {"max_error", check.max_error},
                                  {"allowed", check.allowed},
                                  {"fraction_outside", check.fraction_outside},
                                  {"guard_intact", check.guard_intact}});
      }
      results.push_back(row);
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  fmt::print("\nsummary ({} cases, tier {}, {:.1f} s)\n", cases.size(), flags.tier, seconds);
  bool any_failed = false;
  for (const auto& engine : engines) {
    const Tally& tally = tallies[std::string(engine->name())];
    any_failed |= tally.failed > 0;
    fmt::print("  {:<{}} {:>5} pass {:>5} FAIL {:>5} skipped   worst error/allowed {:.2f}\n",
               engine->name(), kEngineWidth, tally.passed, tally.failed, tally.skipped,
               tally.worst_ratio);
    for (const auto& [reason, count] : tally.skip_reasons) {
      fmt::print("  {:<{}}   skipped {} x: {}\n", "", kEngineWidth, count, reason);
    }
  }
  if (!flags.json_file.empty()) {
    nlohmann::json document = {{"tier", flags.tier}, {"seconds", seconds}, {"results", results}};
    write_text_atomically(flags.json_file, document.dump(1) + "\n");
  }
  return any_failed ? 1 : 0;
}

}  // namespace flexattn::cli
