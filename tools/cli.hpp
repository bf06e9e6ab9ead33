// The `flexattn` command-line tool: shared pieces of its subcommands. The tool is a thin client of
// the public API; everything here is argument handling, data movement and printing.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flexattn/flexattn.hpp"

namespace flexattn::cli {

// The exit status of `run --check` and `demo` when a result disagrees with cpu_ref (beyond
// tolerance, or NaN where the reference is finite); distinct from 1 (failure), 2 (invalid input)
// and 3 (unsupported).
inline constexpr int kExitCheckFailed = 4;

// ---- problem flags (problem_flags.cpp) ----------------------------------------------------------

// The flags every problem-taking subcommand (explain, run) shares. Sizes are 0 when not given:
// they then come from the --q/--k/--v files, or from the defaults below.
struct ProblemFlags {
  std::int64_t batch = 0, heads_q = 0, heads_kv = 0, seq_len_q = 0, seq_len_kv = 0;
  std::int64_t head_dim = 0, head_dim_v = 0;
  std::string layout = "bshd";
  std::string dtype;  // empty: the --q file's dtype, else fp32
  std::optional<double> scale;
  std::string score_mod, mask_mod;
  std::vector<std::string> modifiers;  // catalogue names
  std::vector<std::string> params;     // NAME=VALUE
  std::vector<std::string> tensors;    // NAME=FILE.npy
  std::vector<std::int64_t> cu_seqlens_q, cu_seqlens_kv;
  // A paged KV cache (--page-size): its capacity is --seq-len-kv rounded up to whole pages.
  std::int64_t page_size = 0, pages = 0;
  std::vector<std::int64_t> cache_lens;  // default: --seq-len-kv tokens in every sequence
  std::string page_table_file;           // default: each sequence its own pages, shuffled
  std::string q_file, k_file, v_file;
  std::string engine = "auto";
  bool backward = false;
  std::uint64_t seed = 0;
  bool planted_faults = false;  // hidden: adds the deliberately faulty test engines
};

// Defaults for sizes given neither by a flag nor by a file.
constexpr std::int64_t kDefaultBatch = 1;
constexpr std::int64_t kDefaultHeads = 4;
constexpr std::int64_t kDefaultSeqLen = 128;
constexpr std::int64_t kDefaultHeadDim = 64;

void add_problem_flags(CLI::App& app, ProblemFlags& flags);

// A problem description plus the data bound to it by the flags. The description is on the CPU;
// problem_on() moves it to an engine's device.
struct Setup {
  ProblemDesc desc;
  std::optional<HostTensor> q, k, v;          // from files, in the problem's dtype
  std::map<std::string, HostTensor> tensors;  // every declared tensor, from a file or catalogue
  std::optional<HostTensor> page_table;       // a KV cache's, from --page-table
  std::vector<std::int64_t> cache_lens;       // a KV cache's, one per sequence
  std::int64_t pool_pages = 0;                // a KV cache's pages in the --k/--v files
};

Problem problem_on(const ProblemDesc& desc, Device device);

// Reads files, checks the flags against each other and validates the problem (Error on failure).
Setup build_setup(const ProblemFlags& flags);

// ---- selection across devices (engine_run.cpp) --------------------------------------------------

// The plan of the first engine that can run the problem on its device, as Context::select would
// choose it if the problem were on that device. When no engine can run it on any device, the
// Error(kUnsupported) lists every engine with its reason for the problem on its own device.
struct Selection {
  Problem problem;
  std::shared_ptr<const Plan> plan;
  std::shared_ptr<const Engine> engine;
};
Selection select_plan(Context& context, const ProblemDesc& desc);

// Every engine's verdict, each for the problem on the engine's own device.
std::vector<Verdict> explain_all(const Context& context, const ProblemDesc& desc);

// The outputs of one run, on the host, in the problem's dtype (lse and tensor gradients: fp64
// for fp64 problems, fp32 otherwise).
struct Outputs {
  HostTensor out, lse, dq, dk, dv;
  std::map<std::string, HostTensor> tensor_grads;
  double forward_seconds = 0.0;
  double backward_seconds = 0.0;
};

struct Inputs {
  HostTensor q, k, v, dout;
  std::map<std::string, HostTensor> tensors;
  HostTensor page_table, cache_lens;  // a KV cache problem's (int32)
};

// The setup's data (moved out of it) plus seeded N(0, 1) values for whatever the files did not
// give; dout from `dout_file` when not empty.
Inputs make_inputs(const Problem& problem, Setup& setup, std::uint64_t seed,
                   const std::string& dout_file);

// Runs the plan's forward (and backward when the problem wants it) `repeat` times, moving data to
// and from the engine's device, a workspace lent to each call; the times are per call: the median
// on the CPU, the mean of calls enqueued back to back on a GPU (the device's time, as CUDA events
// around back-to-back calls count it).
Outputs run_plan(const Selection& selection, const Inputs& inputs, int repeat);

// The float64 reference of the same problem on the CPU (cpu_ref on fp64 copies of the inputs).
Outputs run_reference(const Problem& problem, const Inputs& inputs);

// max |a - b| over all elements (equal infinities, and NaN against NaN, agree: 0; a NaN on one
// side only gives NaN).
double max_abs_error(const HostTensor& a, const HostTensor& b);
double max_abs_value(const HostTensor& tensor);

// A KV cache run's work (paged is false for other problems): the K and V bytes its sequences hold
// (what a decoding step must read) and the FLOPs of every cached (query, key) pair (the mask is
// not estimated).
struct CacheWork {
  bool paged = false;
  double kv_bytes = 0, flops = 0;
};
CacheWork cache_work(const Problem& problem, const Inputs& inputs);

// The fraction of (q, kv) pairs the mask keeps, estimated from the interval analysis over tiles
// (proven all-true tiles count fully, all-false ones not at all, mixed ones half).
double kept_fraction(const Problem& problem);

// ---- output -------------------------------------------------------------------------------------

// Checks the output files before anything is computed ((flag, path) pairs; empty paths are
// unused flags): each folder exists; an existing output is a regular file (or a link to one);
// no two outputs, and no output and input, are the same file once links are resolved.
void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs,
                        const std::vector<std::pair<std::string, std::string>>& inputs);
// A --tensor value's file and the storage it asks for: FILE.npy, or FILE.npy:DTYPE (fp32, fp16 or
// bf16: a float tensor converted to that storage, e.g. a bf16 bias, which .npy cannot hold).
struct TensorFile {
  std::string path;
  std::optional<DType> storage;
};
TensorFile parse_tensor_file(const std::string& text);

// `NAME=VALUE` split at the first '='; Error(kInvalidArgument) naming the flag otherwise.
std::pair<std::string, std::string> split_assignment(const std::string& text,
                                                     const std::string& flag);

// ---- subcommands
// ----------------------------------------------------------------------------------

struct RunFlags {
  std::string out_file, lse_file, dout_file, dq_file, dk_file, dv_file;
  std::vector<std::string> dtensor_files;  // NAME=FILE.npy
  bool check = false;
  bool json = false;
  int repeat = 1;
};

void add_run_command(CLI::App& app, ProblemFlags& problem, RunFlags& flags);
int run_command(const ProblemFlags& problem, const RunFlags& flags);

struct ExplainFlags {
  bool json = false;
  bool source = false;  // also print the code each engine generates for the problem
};
void add_explain_command(CLI::App& app, ProblemFlags& problem, ExplainFlags& flags);
int explain_command(const ProblemFlags& problem, const ExplainFlags& flags);

struct DemoFlags {
  bool json = false;
  bool planted_faults = false;
  std::string engine = "auto";
};
void add_demo_command(CLI::App& app, DemoFlags& flags);
int demo_command(const DemoFlags& flags);

void add_engines_command(CLI::App& app, bool& json, bool& planted_faults);
int engines_command(bool json, bool planted_faults);

// The context options of the tool: the environment's policy and log level, `engine` ("auto" or a
// name to force), and the planted faulty engines when asked for.
ContextOptions context_options(const std::string& engine, bool planted_faults);

}  // namespace flexattn::cli
