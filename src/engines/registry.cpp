// The one list of built-in engines, in preference order (fastest first).
#include "engines/cpu_ref/cpu_ref.hpp"
#include "flexattn/context.hpp"

namespace flexattn {

std::vector<std::shared_ptr<const Engine>> builtin_engines() {
  std::vector<std::shared_ptr<const Engine>> engines;
  engines.push_back(make_cpu_ref_engine());
  return engines;
}

}  // namespace flexattn
