// Umbrella header: the whole public API.
#pragma once

#include "flexattn/analysis.hpp"
#include "flexattn/context.hpp"
#include "flexattn/dtype.hpp"
#include "flexattn/engine.hpp"
#include "flexattn/error.hpp"
#include "flexattn/expr.hpp"
#include "flexattn/graph.hpp"
#include "flexattn/modifiers.hpp"
#include "flexattn/npy.hpp"
#include "flexattn/problem.hpp"
#include "flexattn/tensor.hpp"
#include "flexattn/version.hpp"
