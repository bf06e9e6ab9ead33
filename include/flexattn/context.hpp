// Engine selection: the ordered list of engines, the policy that filters it, the plan proof, and
// the plan cache. Caches live here, not in globals.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "flexattn/engine.hpp"

namespace flexattn {

// Which engines may be chosen. `force` picks one engine and never falls back. `patterns` is a
// list of name globs applied in order: "cuda" or "+cuda" allows, "-cudnn*" denies; when any
// allow pattern is present only allowed engines are considered. FLEXATTN_ENGINES uses the same
// syntax, comma-separated ("cuda,-cudnn*"); a single name without '*' or '-' given there is a
// list of one allow pattern, not a force.
struct Policy {
  std::string force;
  std::vector<std::string> patterns;

  static Policy parse(std::string_view text);  // "a,-b*,+c"
  static Policy from_environment();             // FLEXATTN_ENGINES, empty policy if unset
  bool allows(std::string_view engine_name) const;
};

enum class LogLevel { kOff, kInfo, kDebug };
LogLevel log_level_from_environment();  // FLEXATTN_LOG=info|debug

struct ContextOptions {
  Policy policy = Policy::from_environment();
  LogLevel log_level = log_level_from_environment();
  std::ostream* log_stream = nullptr;  // default std::cerr
  // Extra engines appended after the built-in list (tests, the planted faulty engines).
  std::vector<std::shared_ptr<const Engine>> extra_engines;
};

struct Verdict {
  std::string engine;
  bool allowed = true;  // by the policy
  Support support = Support::no("not asked");
};

class Context {
 public:
  explicit Context(ContextOptions options = {});

  // Built-in engines in preference order (fastest first), then the extra ones.
  const std::vector<std::shared_ptr<const Engine>>& engines() const { return engines_; }
  const std::shared_ptr<const Engine>* find_engine(std::string_view name) const;

  // Every engine's verdict for the problem, in preference order.
  std::vector<Verdict> explain(const Problem& problem) const;

  // The plan of the first allowed engine that supports the problem (or the forced one), from the
  // cache when present. Verifies the plan's lowered hash and signature equal the problem's and
  // throws Error(kInternal) otherwise. When nothing can run, throws Error(kUnsupported) listing
  // every engine and its reason.
  std::shared_ptr<const Plan> select(const Problem& problem);

  void forward(const Problem& problem, const ForwardArgs& args);
  void backward(const Problem& problem, const BackwardArgs& args);

  const ContextOptions& options() const { return options_; }
  std::size_t cached_plans() const;

 private:
  ContextOptions options_;
  std::vector<std::shared_ptr<const Engine>> engines_;
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<const Plan>> plan_cache_;
};

// The built-in engines of this build, in preference order (src/engines/registry.cpp).
std::vector<std::shared_ptr<const Engine>> builtin_engines();

}  // namespace flexattn
