// The text-syntax printer shared by Expr::to_string, Graph::to_string and the type-error
// messages. Parentheses are minimal under C-like precedence; the output re-parses to an equal
// canonical graph, up to 64 KiB of text (longer texts, as a graph's shared nodes repeated in a
// derivative can give, are cut there and say so).
#pragma once

#include <string>

#include "flexattn/expr.hpp"

namespace flexattn::ir {

std::string print(const ExprNode& node);

}  // namespace flexattn::ir
