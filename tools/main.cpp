// `flexattn`: the command-line tool. Subcommands: demo, engines, explain, run, check, bench (see --help).
// Errors: one line on stderr starting with "error: "; exit code 2 for invalid input (including
// bad flags), 3 when no engine can run the problem, 1 for anything else.
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <sstream>

#include "cli.hpp"
#include "cmd_bench.hpp"
#include "cmd_check.hpp"

namespace {

constexpr int kExitInvalidInput = 2;
constexpr int kExitUnsupported = 3;
constexpr int kExitFailure = 1;

// Multi-line library messages ("no engine can run ...", then one line per engine) on one line:
// "first line: second; third".
std::string one_line(const std::string& message) {
  std::istringstream stream(message);
  std::string first, line, rest;
  std::getline(stream, first);
  while (std::getline(stream, line)) {
    const std::size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos) continue;
    rest += (rest.empty() ? "" : "; ") + line.substr(start);
  }
  return rest.empty() ? first : first + ": " + rest;
}

int fail(int code, const std::string& message) {
  std::fflush(stdout);
  fmt::print(stderr, "error: {}\n", one_line(message));
  return code;
}

// A subcommand's result stands only if its output reached stdout: a full disk or a closed pipe
// turns exit 0 into exit 1, with the reason on stderr.
int flushed(int code) {
  if (std::fflush(stdout) == 0 && std::ferror(stdout) == 0) return code;
  const int error = errno;
  std::clearerr(stdout);
  fmt::print(stderr, "error: cannot write to standard output: {}\n", std::strerror(error));
  return code == 0 ? kExitFailure : code;
}

int exit_code(flexattn::ErrorCode code) {
  switch (code) {
    case flexattn::ErrorCode::kInvalidArgument:
      return kExitInvalidInput;
    case flexattn::ErrorCode::kUnsupported:
      return kExitUnsupported;
    case flexattn::ErrorCode::kCuda:
    case flexattn::ErrorCode::kCudnn:
    case flexattn::ErrorCode::kCompile:
    case flexattn::ErrorCode::kIo:
    case flexattn::ErrorCode::kInternal:
      break;
  }
  return kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flexattn::cli;
  CLI::App app(
      "flexattn: scaled-dot-product attention with user-defined score modifiers and "
      "masks, served by several engines behind one guarded selection.\n"
      "Environment: FLEXATTN_ENGINES=cuda,-cudnn* (allow/deny engines by glob), "
      "FLEXATTN_LOG=info|debug (log each selection).",
      "flexattn");
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("flexattn ") + flexattn::version());

  DemoFlags demo;
  bool engines_json = false, engines_planted = false;
  ProblemFlags explain_problem;
  ExplainFlags explain;
  ProblemFlags run_problem;
  RunFlags run;
  CheckFlags check;
  ProblemFlags bench_problem;
  BenchFlags bench;
  add_demo_command(app, demo);
  add_engines_command(app, engines_json, engines_planted);
  add_explain_command(app, explain_problem, explain);
  add_run_command(app, run_problem, run);
  add_check_command(app, check);
  add_bench_command(app, bench_problem, bench);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForAllHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForVersion& version) {
    return app.exit(version);
  } catch (const CLI::ParseError& error) {
    return fail(kExitInvalidInput, fmt::format("{} (see flexattn --help)", error.what()));
  }

  try {
    if (app.got_subcommand("demo")) return flushed(demo_command(demo));
    if (app.got_subcommand("engines")) {
      return flushed(engines_command(engines_json, engines_planted));
    }
    if (app.got_subcommand("explain")) return flushed(explain_command(explain_problem, explain));
    if (app.got_subcommand("run")) return flushed(run_command(run_problem, run));
    if (app.got_subcommand("check")) return flushed(check_command(check));
    if (app.got_subcommand("bench")) return flushed(bench_command(bench_problem, bench));
    return fail(kExitInvalidInput, "no subcommand (see flexattn --help)");
  } catch (const flexattn::Error& error) {
    return fail(exit_code(error.code()), error.what());
  } catch (const std::bad_alloc&) {
    return fail(kExitFailure, "out of memory");
  } catch (const std::exception& error) {
    return fail(kExitFailure, error.what());
  }
}
