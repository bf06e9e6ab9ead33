// `flexattn check`: the conformance matrix from the command line.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace flexattn::cli {

struct CheckFlags {
  std::string engines;        // comma-separated name globs ("cpu,cuda*"); empty: all but cpu_ref
  std::string tier = "quick";
  std::string json_file;
  std::string filter;         // only cases whose name contains this text
  bool planted_faults = false;  // hidden: adds the deliberately faulty engines
  bool verbose = false;       // also print passing cases
};

void add_check_command(CLI::App& app, CheckFlags& flags);
// Exit code: 0 when nothing failed, 1 otherwise.
int check_command(const CheckFlags& flags);

}  // namespace flexattn::cli
