// Engine selection: the ordered list of engines, the policy that filters it, the plan proof, and
// the plan cache. Caches live here, not in globals.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "flexattn/engine.hpp"
#include "flexattn/export.hpp"

namespace flexattn {

// Which engines may be chosen. `force` picks one engine and never falls back. `patterns` is a
// list of name globs applied in order: "cuda" or "+cuda" allows, "-cudnn*" denies; when any
// allow pattern is present only allowed engines are considered. FLEXATTN_ENGINES uses the same
// syntax, comma-separated ("cuda,-cudnn*"); a single name without '*' or '-' given there is a
// list of one allow pattern, not a force.
//
// The rules in full:
// - Globs match the whole engine name; `*` matches any run of characters (also none), `?` one.
//   Pattern names use letters, digits and `_` besides the glob characters; spaces around an entry
//   are ignored, empty entries are skipped, anything else is Error(kInvalidArgument).
// - Deny wins: an engine matched by any deny pattern is never chosen, whatever the order of the
//   patterns and even when it is the forced engine (the error then says it was denied). A forced
//   engine need not match the allow patterns: forcing is the more explicit request.
// - A pattern that matches no engine of this build is not an error (FLEXATTN_ENGINES=cuda on a
//   CPU-only build simply leaves nothing allowed, and the selection error says so), but `force`
//   must name an engine of the context: Context's constructor throws Error(kInvalidArgument)
//   listing the engines otherwise.
struct FLEXATTN_API Policy {
  std::string force;
  std::vector<std::string> patterns;
  // Where the patterns came from, named in "denied by policy ..." reasons: "FLEXATTN_ENGINES"
  // when read from the environment, empty when set through the API.
  std::string source;

  static Policy parse(std::string_view text);  // "a,-b*,+c"
  static Policy from_environment();            // FLEXATTN_ENGINES, empty policy if unset
  bool allows(std::string_view engine_name) const;
  // Why `allows` says no ("denied by policy FLEXATTN_ENGINES=-cpu_ref* (pattern -cpu_ref*)");
  // empty when it says yes.
  std::string refusal(std::string_view engine_name) const;
  // The patterns as text, comma-separated (what `parse` reads back).
  std::string to_string() const;
};

// Whether `name` matches the glob `pattern` (`*`, `?`), over the whole name.
FLEXATTN_API bool glob_match(std::string_view pattern, std::string_view name);

enum class LogLevel { kOff, kInfo, kDebug };
// FLEXATTN_LOG=off|info|debug (unset or empty: off). info logs one line per selection (the chosen
// engine and its plan); debug adds every engine's verdict. Another value is
// Error(kInvalidArgument).
FLEXATTN_API LogLevel log_level_from_environment();

// FLEXATTN_CANARY=0 switches the plan canary off (unset, empty or 1: on); another value is
// Error(kInvalidArgument). See ContextOptions::canary for what it guards and the risk of turning
// it off.
FLEXATTN_API bool canary_from_environment();

struct ContextOptions {
  Policy policy = Policy::from_environment();
  LogLevel log_level = log_level_from_environment();
  std::ostream* log_stream = nullptr;  // default std::cerr
  // Extra engines appended after the built-in list (tests, the planted faulty engines).
  std::vector<std::shared_ptr<const Engine>> extra_engines;
  // The plan canary (docs/engines.md, "Plan canary"): before a new plan of any engine other than
  // cpu_ref is cached, select() runs it once on synthetic, discriminating inputs and compares
  // sampled rows with cpu_ref; a plan that computes something else (e.g. holds the right
  // modifier and ignores it, which the plan proof cannot see) is refused. Off, such a plan is
  // used unchecked.
  bool canary = canary_from_environment();
};

struct Verdict {
  std::string engine;
  bool allowed = true;  // by the policy
  Support support = Support::no("not asked");
};

class FLEXATTN_API Context {
 public:
  explicit Context(ContextOptions options = {});

  // Built-in engines in preference order (fastest first), then the extra ones.
  const std::vector<std::shared_ptr<const Engine>>& engines() const { return engines_; }
  const std::shared_ptr<const Engine>* find_engine(std::string_view name) const;

  // Every engine's verdict for the problem, in preference order. `support` is asked of every
  // engine, also of those the policy refuses, so explain shows what each one could do.
  std::vector<Verdict> explain(const Problem& problem) const;

  // The plan of the first allowed engine that supports the problem (or the forced one), from the
  // cache when present. Verifies the plan's lowered hash and signature equal the problem's and
  // throws Error(kInternal) otherwise; such a plan is never cached, and selection does not fall
  // through to the next engine (an engine that claims support and builds something else is a
  // bug to surface, not to route around). Then, with ContextOptions::canary, a new plan of an
  // engine other than cpu_ref runs the canary once before it is cached; a plan it refuses makes a
  // forced engine throw Error(kUnsupported) with the canary's one-line reason, and auto selection
  // move on to the next engine. When nothing can run, throws Error(kUnsupported):
  // "no engine can run this problem (<summary>)", then one line per engine "  <name>: <reason>".
  // Thread-safe.
  std::shared_ptr<const Plan> select(const Problem& problem);

  void forward(const Problem& problem, const ForwardArgs& args);
  void backward(const Problem& problem, const BackwardArgs& args);

  const ContextOptions& options() const { return options_; }
  std::size_t cached_plans() const;
  // How many times select() ran the plan canary (once per new plan of a checked engine).
  std::size_t canary_runs() const;

 private:
  ContextOptions options_;
  std::vector<std::shared_ptr<const Engine>> engines_;
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<const Plan>> plan_cache_;
  std::size_t canary_runs_ = 0;
};

// A one-line summary of a problem for messages and logs: direction, layout, dtype, device, sizes
// and the canonical modifiers ("fwd bshd fp32 cpu, batch 2, heads 8/8, seq 1024/1024, head_dim
// 128/128, score_mod 30 * tanh(score / 30), mask_mod q >= kv").
FLEXATTN_API std::string problem_summary(const Problem& problem);

// The built-in engines of this build, in preference order (src/engines/registry.cpp).
FLEXATTN_API std::vector<std::shared_ptr<const Engine>> builtin_engines();

}  // namespace flexattn
