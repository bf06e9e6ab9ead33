// `flexattn engines`: every engine of this build, in preference order, whether it can run on this
// machine and why not, and whether the policy (FLEXATTN_ENGINES) allows it.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli.hpp"

namespace flexattn::cli {

void add_engines_command(CLI::App& app, bool& json, bool& planted_faults) {
  CLI::App* engines = app.add_subcommand(
      "engines", "list every engine, in preference order, and whether it is available here");
  engines->add_flag("--json", json, "print a machine-readable list");
  engines
      ->add_flag("--with-planted-faults", planted_faults,
                 "add the deliberately faulty test engines")
      ->group("");
}

int engines_command(bool json, bool planted_faults) {
  const Context context(context_options("auto", planted_faults));
  const Policy& policy = context.options().policy;
  if (json) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& engine : context.engines()) {
      const Support available = engine->available();
      list.push_back({{"name", std::string(engine->name())},
                      {"device", std::string(to_string(engine->device()))},
                      {"available", available.ok()},
                      {"reason", available.reason()},
                      {"allowed", policy.allows(engine->name())},
                      {"policy", policy.refusal(engine->name())}});
    }
    fmt::print("{}\n", nlohmann::ordered_json{{"engines", list}}.dump(2));
    return 0;
  }
  std::size_t width = 0;
  for (const auto& engine : context.engines()) width = std::max(width, engine->name().size());
  fmt::print("engines, in preference order:\n");
  for (const auto& engine : context.engines()) {
    const Support available = engine->available();
    std::string text = available ? "available" : "not available: " + available.reason();
    if (!policy.allows(engine->name())) text += "; " + policy.refusal(engine->name());
    fmt::print("  {:<{}}  {:<4}  {}\n", engine->name(), width, to_string(engine->device()), text);
  }
  return 0;
}

}  // namespace flexattn::cli
