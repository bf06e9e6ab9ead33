// `cpu_ref`: the float64 reference engine, the oracle every other engine is compared with.
#pragma once

#include <memory>

#include "flexattn/engine.hpp"

namespace flexattn {

std::shared_ptr<const Engine> make_cpu_ref_engine();

}  // namespace flexattn
