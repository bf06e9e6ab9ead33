// `flexattn bench`: times one engine on one problem (a benchmark, not a test).
#pragma once

#include <CLI/CLI.hpp>

#include "cli.hpp"

namespace flexattn::cli {

struct BenchFlags {
  int iters = 10;
  int warmup = 2;
  bool json = false;
};

void add_bench_command(CLI::App& app, ProblemFlags& problem, BenchFlags& flags);
int bench_command(const ProblemFlags& problem, const BenchFlags& flags);

}  // namespace flexattn::cli
