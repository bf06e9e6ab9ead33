// Engine selection: the policy, the ordered engine list, the plan proof and the plan cache.
#include "flexattn/context.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <set>

#include "core/canary.hpp"
#include "flexattn/error.hpp"

namespace flexattn {

namespace {

constexpr std::string_view kEnvironmentPolicy = "FLEXATTN_ENGINES";
constexpr std::string_view kEnvironmentLog = "FLEXATTN_LOG";
constexpr std::string_view kEnvironmentCanary = "FLEXATTN_CANARY";
constexpr std::string_view kLogPrefix = "flexattn: ";
// The oracle the canary compares with; its own plans need no canary.
constexpr std::string_view kReferenceEngine = "cpu_ref";

std::string_view trim(std::string_view text) {
  const auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

bool is_pattern_character(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '*' || c == '?';
}

bool is_deny(std::string_view pattern) { return !pattern.empty() && pattern.front() == '-'; }

// The glob of a pattern, without its '+' or '-'.
std::string_view glob_of(std::string_view pattern) {
  if (!pattern.empty() && (pattern.front() == '-' || pattern.front() == '+')) {
    pattern.remove_prefix(1);
  }
  return pattern;
}

std::string engine_names(const std::vector<std::shared_ptr<const Engine>>& engines) {
  std::vector<std::string_view> names;
  for (const auto& engine : engines) names.push_back(engine->name());
  return fmt::format("{}", fmt::join(names, ", "));
}

// Plan-cache key: engine and its plan settings, exact signature, modifier hash, and the canonical
// text too, so that a hash collision could never alias two different modifiers.
std::string cache_key(const Engine& engine, const Problem& problem) {
  return fmt::format("{}\n{}\n{}\n{}\n{}\n{}", engine.name(), engine.plan_settings(),
                     problem.signature(), hash_to_hex(problem.modifier_hash()),
                     problem.score_mod().to_string(), problem.mask_mod().to_string());
}

// The plan proof (docs/design.md section 4): the plan implements exactly the requested modifier
// (and, for a backward, its derivatives) and was built for exactly this problem.
void verify_plan(const Plan& plan, const Problem& problem) {
  const PlanInfo& info = plan.info();
  if (const std::string failure = plan_proof_failure(info, problem); !failure.empty()) {
    throw_internal(fmt::format(
        "{}; refusing to run a plan that does not implement the requested modifier", failure));
  }
  if (info.signature != problem.signature()) {
    throw_internal(fmt::format(
        "engine {}: its plan was built for problem '{}' but '{}' was requested; refusing to run a "
        "plan built for another problem",
        info.engine, info.signature, problem.signature()));
  }
}

}  // namespace

// ---- policy -------------------------------------------------------------------------------------

bool glob_match(std::string_view pattern, std::string_view name) {
  // Greedy matching with backtracking to the last '*': linear in practice for engine names.
  std::size_t p = 0, n = 0;
  std::size_t star = std::string_view::npos, star_name = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_name = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++star_name;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

Policy Policy::parse(std::string_view text) {
  Policy policy;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    std::size_t end = text.find(',', begin);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view entry = trim(text.substr(begin, end - begin));
    begin = end + 1;
    if (entry.empty()) continue;
    const std::string_view glob = glob_of(entry);
    if (glob.empty()) {
      throw_invalid(fmt::format("engine policy '{}': '{}' names no engine", text, entry));
    }
    for (char c : glob) {
      if (!is_pattern_character(c)) {
        throw_invalid(fmt::format(
            "engine policy '{}': '{}' contains '{}'; names use letters, digits, '_', and the "
            "globs '*' and '?'",
            text, entry, c));
      }
    }
    policy.patterns.emplace_back(entry);
  }
  return policy;
}

Policy Policy::from_environment() {
  const char* text = std::getenv(std::string(kEnvironmentPolicy).c_str());
  if (text == nullptr) return {};
  Policy policy = parse(text);
  policy.source = std::string(kEnvironmentPolicy);
  return policy;
}

std::string Policy::to_string() const { return fmt::format("{}", fmt::join(patterns, ",")); }

std::string Policy::refusal(std::string_view engine_name) const {
  const std::string where =
      source.empty() ? to_string() : fmt::format("{}={}", source, to_string());
  bool has_allow = false;
  bool allowed = false;
  for (const std::string& pattern : patterns) {
    const bool matches = glob_match(glob_of(pattern), engine_name);
    if (is_deny(pattern)) {
      if (matches) return fmt::format("denied by policy {} (pattern {})", where, pattern);
    } else {
      has_allow = true;
      allowed = allowed || matches;
    }
  }
  if (!force.empty() && engine_name != force) {
    return fmt::format("not the forced engine ({})", force);
  }
  if (force.empty() && has_allow && !allowed) {
    return fmt::format("not allowed by policy {} (matches no allow pattern)", where);
  }
  return {};
}

bool Policy::allows(std::string_view engine_name) const { return refusal(engine_name).empty(); }

LogLevel log_level_from_environment() {
  const char* text = std::getenv(std::string(kEnvironmentLog).c_str());
  if (text == nullptr) return LogLevel::kOff;
  const std::string_view value = trim(text);
  if (value.empty() || value == "off") return LogLevel::kOff;
  if (value == "info") return LogLevel::kInfo;
  if (value == "debug") return LogLevel::kDebug;
  throw_invalid(fmt::format("{}='{}': expected off, info or debug", kEnvironmentLog, value));
}

bool canary_from_environment() {
  const char* text = std::getenv(std::string(kEnvironmentCanary).c_str());
  if (text == nullptr) return true;
  const std::string_view value = trim(text);
  if (value.empty() || value == "1") return true;
  if (value == "0") return false;
  throw_invalid(fmt::format("{}='{}': expected 1 (on) or 0 (off)", kEnvironmentCanary, value));
}

std::string problem_summary(const Problem& problem) {
  std::string summary =
      fmt::format("{} {} {} {}, batch {}, heads {}/{}, seq {}/{}, head_dim {}/{}",
                  problem.wants_backward() ? "fwd+bwd" : "fwd", to_string(problem.layout()),
                  to_string(problem.dtype()), to_string(problem.device()), problem.batch(),
                  problem.heads_q(), problem.heads_kv(), problem.seq_len_q(), problem.seq_len_kv(),
                  problem.head_dim_qk(), problem.head_dim_v());
  if (const auto& cache = problem.kv_cache()) {
    summary += fmt::format(", paged KV cache of {} pages of {} tokens, {} per sequence",
                           cache->pages, cache->page_size, cache->max_pages);
  }
  if (!problem.score_mod().is_identity_score()) {
    summary += fmt::format(", score_mod {}", problem.score_mod().to_string());
  }
  if (!problem.mask_mod().is_literal() ||
      problem.mask_mod().node(problem.mask_mod().root()).literal == 0.0) {
    summary += fmt::format(", mask_mod {}", problem.mask_mod().to_string());
  }
  return summary;
}

// ---- context ------------------------------------------------------------------------------------

Context::Context(ContextOptions options) : options_(std::move(options)) {
  engines_ = builtin_engines();
  for (std::shared_ptr<const Engine>& engine : options_.extra_engines) {
    if (!engine) throw_invalid("ContextOptions::extra_engines holds a null engine");
    engines_.push_back(engine);
  }
  std::set<std::string_view> names;
  for (const auto& engine : engines_) {
    if (!names.insert(engine->name()).second) {
      throw_invalid(fmt::format("two engines are named '{}' (engines: {})", engine->name(),
                                engine_names(engines_)));
    }
  }
  if (!options_.policy.force.empty() && find_engine(options_.policy.force) == nullptr) {
    throw_invalid(fmt::format("unknown engine '{}' (engines: {})", options_.policy.force,
                              engine_names(engines_)));
  }
}

const std::shared_ptr<const Engine>* Context::find_engine(std::string_view name) const {
  for (const auto& engine : engines_) {
    if (engine->name() == name) return &engine;
  }
  return nullptr;
}

std::vector<Verdict> Context::explain(const Problem& problem) const {
  std::vector<Verdict> verdicts;
  for (const auto& engine : engines_) {
    Verdict verdict;
    verdict.engine = std::string(engine->name());
    verdict.allowed = options_.policy.allows(engine->name());
    verdict.support = engine->supports(problem);
    verdicts.push_back(std::move(verdict));
  }
  return verdicts;
}

std::size_t Context::cached_plans() const {
  const std::lock_guard lock(mutex_);
  return plan_cache_.size();
}

std::size_t Context::canary_runs() const {
  const std::lock_guard lock(mutex_);
  return canary_runs_;
}

std::shared_ptr<const Plan> Context::select(const Problem& problem) {
  const Policy& policy = options_.policy;
  std::ostream& log = options_.log_stream != nullptr ? *options_.log_stream : std::cerr;
  const bool log_info = options_.log_level != LogLevel::kOff;
  const bool log_debug = options_.log_level == LogLevel::kDebug;

  if (log_debug) {
    log << kLogPrefix << "verdicts for " << problem_summary(problem) << '\n';
    for (const Verdict& verdict : explain(problem)) {
      const std::string refusal = policy.refusal(verdict.engine);
      log << kLogPrefix << "  " << verdict.engine << ": "
          << (verdict.support ? std::string("supported") : verdict.support.reason())
          << (refusal.empty() ? "" : "; " + refusal) << '\n';
    }
  }

  // A plan in the cache is the one an earlier call selected: the policy is fixed for the context
  // and support is a function of the problem, so the first allowed engine with a cached plan is
  // the engine this call would select. It is proven again before it is returned.
  {
    const std::lock_guard lock(mutex_);
    for (const auto& engine : engines_) {
      if (!policy.allows(engine->name())) continue;
      const auto found = plan_cache_.find(cache_key(*engine, problem));
      if (found == plan_cache_.end()) continue;
      verify_plan(*found->second, problem);
      if (log_info) {
        log << kLogPrefix << "selected " << engine->name()
            << " (cached plan: " << found->second->info().description << ") for "
            << problem_summary(problem) << '\n';
      }
      return found->second;
    }
  }

  // Engines that said yes to supports() but declined while planning (e.g. cuDNN's heuristics
  // offering no engine for the graph): their reasons, for the final error.
  std::map<std::string, std::string, std::less<>> declined;
  // Engines whose plan the canary refused: the canary's one-line reasons.
  std::map<std::string, std::string, std::less<>> refused;
  for (const auto& engine : engines_) {
    if (!policy.allows(engine->name())) continue;
    const Support support = engine->supports(problem);
    if (!support) {
      if (!policy.force.empty()) {
        throw_unsupported(fmt::format("forced engine {} cannot run this problem ({}): {}",
                                      engine->name(), problem_summary(problem), support.reason()));
      }
      continue;
    }
    // The key of the settings the plan is built under (read before planning).
    const std::string key = cache_key(*engine, problem);
    std::shared_ptr<const Plan> plan;
    try {
      plan = engine->plan(problem);
    } catch (const Error& error) {
      // Only "cannot compute this" falls through to the next engine; a forced engine never
      // falls back, and every other error (a bad plan, a driver failure) propagates.
      if (error.code() != ErrorCode::kUnsupported || !policy.force.empty()) throw;
      declined.emplace(engine->name(), error.what());
      if (log_info) {
        log << kLogPrefix << engine->name() << " declined while planning: " << error.what() << '\n';
      }
      continue;
    }
    verify_plan(*plan, problem);
    if (options_.canary && engine->name() != kReferenceEngine) {
      const detail::CanaryResult canary = detail::run_canary(*engine, *plan);
      {
        const std::lock_guard lock(mutex_);
        ++canary_runs_;
      }
      if (log_info) {
        log << kLogPrefix << "canary for " << engine->name() << ": "
            << (canary.passed
                    ? fmt::format("passed ({:.3g} of the tolerance", canary.largest_error_ratio)
                    : canary.reason)
            << (canary.passed ? fmt::format("; q scaled by {}, {:.3g} s, {} bytes of arguments)",
                                            canary.input_scale, canary.seconds, canary.bytes)
                              : "")
            << '\n';
        if (!canary.note.empty()) {
          log << kLogPrefix << "canary for " << engine->name() << ": " << canary.note << '\n';
        }
      }
      if (!canary.passed) {
        if (!policy.force.empty()) {
          throw_unsupported(fmt::format("forced engine {} refused ({}): {}", engine->name(),
                                        problem_summary(problem), canary.reason));
        }
        refused.emplace(engine->name(), canary.reason);
        continue;
      }
    }
    {
      const std::lock_guard lock(mutex_);
      // Another thread may have planned the same problem meanwhile; keep the first plan.
      plan = plan_cache_.emplace(key, plan).first->second;
    }
    if (log_info) {
      log << kLogPrefix << "selected " << engine->name() << " (plan: " << plan->info().description
          << ") for " << problem_summary(problem) << '\n';
    }
    return plan;
  }

  std::string message =
      fmt::format("no engine can run this problem ({})", problem_summary(problem));
  for (const auto& engine : engines_) {
    std::string reason = policy.refusal(engine->name());
    if (const auto found = declined.find(engine->name());
        reason.empty() && found != declined.end()) {
      reason = "declined while planning: " + found->second;
    }
    if (const auto found = refused.find(engine->name()); reason.empty() && found != refused.end()) {
      reason = "refused by the canary: " + found->second;
    }
    if (reason.empty()) reason = engine->supports(problem).reason();
    message += fmt::format("\n  {}: {}", engine->name(), reason);
  }
  throw_unsupported(message);
}

void Context::forward(const Problem& problem, const ForwardArgs& args) {
  select(problem)->forward(args);
}

void Context::backward(const Problem& problem, const BackwardArgs& args) {
  select(problem)->backward(args);
}

}  // namespace flexattn
