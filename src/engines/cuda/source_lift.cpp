#include "engines/cuda/source_lift.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <set>
#include <utility>

#include "engines/cuda/lift_expression.hpp"

namespace flexattn::cuda {
namespace {

using lift::ExpressionParser;
using lift::fail;
using lift::LiftError;
using lift::Scope;
using lift::tokenize;
using lift::type_name;

// ---- lines -----------------------------------------------------------------------------------

std::string_view trim(std::string_view line) {
  while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
  while (!line.empty() && line.back() == ' ') line.remove_suffix(1);
  return line;
}

bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

LiftedType declared_type(std::string_view name) {
  if (name == "float") return LiftedType::kFloat;
  if (name == "int") return LiftedType::kInt;
  if (name == "bool") return LiftedType::kBool;
  if (name == "long long") return LiftedType::kLong;
  fail(fmt::format("the type '{}'", name));
}

// The functions the kernels call, with their result types.
const std::map<std::string, std::string>& known_functions() {
  static const std::map<std::string, std::string> functions = {
      {"prepare", "Invariants"},
      {"score_mod", "float"},
      {"score_mod_log2", "float"},
      {"score_mod_forward", "float"},
      {"score_mod_log2_small", "float"},
      {"tanh_args_small", "bool"},
      {"staged_origin", "long long"},
      {"mask_mod", "bool"},
      {"score_grad", "float"},
      {"score_grad_from_dot", "float"},
      {"score_grad_from_dot_small", "float"},
      {"tensor_grads", "void"},
      {"flush_tensor_grads", "void"}};
  return functions;
}

class SourceParser {
 public:
  explicit SourceParser(std::string_view source) {
    std::size_t start = 0;
    while (start <= source.size()) {
      const std::size_t end = source.find('\n', start);
      const std::size_t stop = end == std::string_view::npos ? source.size() : end;
      lines_.push_back(source.substr(start, stop - start));
      if (end == std::string_view::npos) break;
      start = end + 1;
    }
  }

  LiftedModifier parse() {
    expect_line("namespace flexattn_generated {");
    expect_line("using namespace flexattn_kernels;");
    expect_line("");
    expect_line("struct Modifier {");
    for (;;) {
      const std::string_view line = next_line();
      if (line == "};") break;
      if (starts_with(line, "//")) continue;
      if (starts_with(line, "static constexpr ")) {
        constant(line.substr(17));
      } else if (line == "struct Invariants {") {
        invariants();
      } else if (starts_with(line, "__device__ static __forceinline__ ")) {
        function(line.substr(34));
      } else {
        fail("a line the code generator does not emit");
      }
    }
    return std::move(modifier_);
  }

  std::size_t line_number() const { return line_; }

 private:
  std::string_view next_line() {
    if (line_ >= lines_.size()) fail("the source ends inside the Modifier struct");
    return trim(lines_[line_++]);
  }
  void expect_line(std::string_view text) {
    if (next_line() != text) fail(fmt::format("expected '{}'", text));
  }

  void constant(std::string_view line) {
    // `float NAME = EXPR;  // comment`, `bool NAME = true;`, `int NAME = N;`, `long long NAME =
    // NLL;`
    if (const std::size_t comment = line.find("  //"); comment != std::string_view::npos) {
      line = line.substr(0, comment);
    }
    const std::size_t equals = line.find(" = ");
    if (equals == std::string_view::npos || line.back() != ';') fail("a malformed constant");
    const std::string_view declaration = line.substr(0, equals);
    const std::size_t space = declaration.rfind(' ');
    const LiftedType type = declared_type(declaration.substr(0, space));
    const std::string name(declaration.substr(space + 1));
    const Scope scope;
    ExpressionParser parser(modifier_, scope,
                            tokenize(line.substr(equals + 3, line.size() - equals - 4)));
    const int value = parser.expression();
    parser.expect_end();
    const LiftedNode& node = modifier_.nodes[static_cast<std::size_t>(value)];
    if (node.kind != LiftedKind::kLiteral || node.type != type) {
      fail(fmt::format("constant {} is not a {} literal", name, type_name(type)));
    }
    if (type == LiftedType::kBool) {
      modifier_.flags[name] = node.number != 0.0;
    } else if (type == LiftedType::kFloat) {
      modifier_.constants[name] = value;
    } else {
      modifier_.integers[name] = node.number;
    }
  }

  void invariants() {
    for (;;) {
      const std::string_view line = next_line();
      if (line == "};") return;
      const std::size_t space = line.rfind(' ');
      if (space == std::string_view::npos || line.back() != ';') fail("a malformed field");
      const std::string name(line.substr(space + 1, line.size() - space - 2));
      if (!modifier_.invariant_fields.emplace(name, declared_type(line.substr(0, space))).second) {
        fail(fmt::format("field {} declared twice", name));
      }
    }
  }

  // `RESULT NAME(PARAMETERS) {`
  void function(std::string_view header) {
    const std::size_t open = header.find('(');
    if (open == std::string_view::npos || !starts_with(header.substr(header.size() - 3), ") {")) {
      fail("a malformed function header");
    }
    const std::string_view signature = header.substr(0, open);
    const std::size_t space = signature.rfind(' ');
    LiftedFunction lifted;
    lifted.name = std::string(signature.substr(space + 1));
    const auto known = known_functions().find(lifted.name);
    if (known == known_functions().end())
      fail(fmt::format("an unknown function '{}'", lifted.name));
    if (signature.substr(0, space) != known->second) fail("a function of the wrong result type");
    if (modifier_.functions.count(lifted.name) != 0) fail("a function defined twice");
    Scope scope;
    std::string_view parameters = header.substr(open + 1, header.size() - open - 4);
    while (!parameters.empty()) {
      const std::size_t comma = parameters.find(", ");
      std::string_view parameter = parameters.substr(0, comma);
      parameters = comma == std::string_view::npos ? "" : parameters.substr(comma + 2);
      if (starts_with(parameter, "[[maybe_unused]] ")) parameter.remove_prefix(17);
      if (parameter == "const Invariants& inv") {
        scope.has_inv = true;
      } else if (parameter == "const ForwardParams& p") {
        scope.has_p = true;
      } else if (parameter == "const Coordinates& at") {
        scope.has_at = true;
      } else if (parameter == "const StagedElement* staged") {
        scope.has_staged = true;
      } else if (parameter == "const BackwardParams& bp" ||
                 parameter == "GradSum (&local)[kLocalGradSlots]") {
      } else if (parameter == "float score" || parameter == "float dot" ||
                 parameter == "float bound" || parameter == "float dlogit" ||
                 parameter == "int q" || parameter == "int kv") {
        const std::string name(parameter.substr(parameter.find(' ') + 1));
        scope.leaves.insert(name);
        lifted.parameters.push_back(name);
      } else {
        fail(fmt::format("a parameter '{}'", parameter));
      }
    }
    lifted.result = known->second == "bool"        ? LiftedType::kBool
                    : known->second == "long long" ? LiftedType::kLong
                                                   : LiftedType::kFloat;
    if (lifted.name == "prepare") {
      prepare(scope);
      return;
    }
    if (lifted.name == "tensor_grads") {
      tensor_grads(scope, lifted);
    } else if (lifted.name == "flush_tensor_grads") {
      flush_tensor_grads(scope);
    } else {
      lifted.value = body(scope, lifted.result);
    }
    modifier_.functions.emplace(lifted.name, std::move(lifted));
  }

  int parse_expression(const Scope& scope, std::string_view text) {
    ExpressionParser parser(modifier_, scope, tokenize(text));
    const int value = parser.expression();
    parser.expect_end();
    return value;
  }

  // `const T NAME = EXPR;`: adds NAME to the scope. False when the line is no such statement.
  bool local_value(Scope& scope, std::string_view line) {
    if (!starts_with(line, "const ") || line.back() != ';') return false;
    const std::size_t equals = line.find(" = ");
    if (equals == std::string_view::npos) return false;
    const std::string_view declaration = line.substr(6, equals - 6);
    const std::size_t space = declaration.rfind(' ');
    if (space == std::string_view::npos) return false;
    const LiftedType type = declared_type(declaration.substr(0, space));
    const std::string name(declaration.substr(space + 1));
    const int value = parse_expression(scope, line.substr(equals + 3, line.size() - equals - 4));
    if (modifier_.nodes[static_cast<std::size_t>(value)].type != type) {
      fail(fmt::format("{} declared {} holds another type", name, type_name(type)));
    }
    if (scope.leaves.count(name) != 0 || !scope.values.emplace(name, value).second) {
      fail(fmt::format("{} defined twice", name));
    }
    return true;
  }

  int body(Scope& scope, LiftedType result) {
    for (;;) {
      const std::string_view line = next_line();
      if (starts_with(line, "//") || local_value(scope, line)) continue;
      if (!starts_with(line, "return ") || line.back() != ';')
        fail("a statement the code generator does not emit");
      const int value = parse_expression(scope, line.substr(7, line.size() - 8));
      // staged_origin's `long long` takes a narrow offset's int as C++ converts it.
      const LiftedType returned = modifier_.nodes[static_cast<std::size_t>(value)].type;
      if (returned != result && !(result == LiftedType::kLong && returned == LiftedType::kInt)) {
        fail("a return of another type");
      }
      expect_line("}");
      return value;
    }
  }

  void prepare(const Scope& function_scope) {
    expect_line("Invariants inv{};");
    Scope scope = function_scope;
    scope.has_inv = true;
    std::set<std::string> assigned;
    for (;;) {
      const std::string_view line = next_line();
      if (line == "return inv;") break;
      const std::size_t equals = line.find(" = ");
      if (!starts_with(line, "inv.") || equals == std::string_view::npos || line.back() != ';') {
        fail("a statement of prepare() the code generator does not emit");
      }
      const std::string field(line.substr(4, equals - 4));
      const auto declared = modifier_.invariant_fields.find(field);
      if (declared == modifier_.invariant_fields.end() || !assigned.insert(field).second) {
        fail(fmt::format("inv.{} is not a field assigned once", field));
      }
      // A field read before its assignment would read the zero of Invariants inv{}.
      std::map<std::string, LiftedType> visible;
      for (const std::string& name : assigned) {
        if (name != field) visible.emplace(name, modifier_.invariant_fields.at(name));
      }
      std::swap(visible, modifier_.invariant_fields);
      const int value = parse_expression(scope, line.substr(equals + 3, line.size() - equals - 4));
      std::swap(visible, modifier_.invariant_fields);
      if (modifier_.nodes[static_cast<std::size_t>(value)].type != declared->second) {
        fail(fmt::format("inv.{} assigned another type", field));
      }
      modifier_.prepare.emplace_back(field, value);
    }
    expect_line("}");
    if (assigned.size() != modifier_.invariant_fields.size()) fail("a field prepare() leaves at 0");
  }

  // `bp.grad_fixed[N]`: N.
  static int accumulator(ExpressionParser& parser) {
    parser.expect("bp");
    parser.expect(".");
    parser.expect("grad_fixed");
    parser.expect("[");
    const auto slot = static_cast<int>(parser.integer());
    parser.expect("]");
    return slot;
  }

  void tensor_grads(Scope& scope, LiftedFunction& lifted) {
    bool in_block = false;
    LiftedGradient gradient;
    for (;;) {
      const std::string_view line = next_line();
      if (starts_with(line, "//")) continue;
      if (line == "}") {
        if (!in_block) return;
        if (gradient.value < 0) fail("a tensor_grads block without its contribution");
        lifted.gradients.push_back(gradient);
        in_block = false;
        continue;
      }
      if (!in_block && line == "[[maybe_unused]] const ForwardParams& p = bp.fwd;") {
        scope.has_p = true;
        continue;
      }
      if (!in_block && starts_with(line, "if (")) {
        ExpressionParser parser(modifier_, scope, tokenize(line));
        parser.expect("if");
        parser.expect("(");
        gradient = LiftedGradient{};
        gradient.slot = accumulator(parser);
        parser.expect("!=");
        parser.expect("nullptr");
        parser.expect(")");
        parser.expect("{");
        parser.expect_end();
        in_block = true;
        continue;
      }
      if (!in_block || gradient.value >= 0)
        fail("a statement of tensor_grads the code generator does not emit");
      if (local_value(scope, line)) continue;
      ExpressionParser parser(modifier_, scope, tokenize(line));
      if (starts_with(line, "add_fixed(")) {
        parser.expect("add_fixed");
        parser.expect("(");
        if (accumulator(parser) != gradient.slot)
          fail("a contribution to another tensor's gradient");
        parser.expect("+");
        gradient.offset = parser.expression();
        parser.expect(",");
      } else {
        parser.expect("local");
        parser.expect("[");
        gradient.local_slot = static_cast<int>(parser.integer());
        parser.expect("]");
        parser.expect("+=");
      }
      parser.expect("to_fixed");
      parser.expect("(");
      parser.expect("dlogit");
      parser.expect("*");
      gradient.value = parser.expression();
      parser.expect(")");
      if (gradient.offset >= 0) parser.expect(")");
      parser.expect(";");
      parser.expect_end();
      if (parser.type(gradient.value) != LiftedType::kFloat) fail("a gradient that is not a float");
    }
  }

  // Each local slot's element: fills the offset of the tensor_grads block with that slot.
  void flush_tensor_grads(const Scope& scope) {
    const auto tensor_grads = modifier_.functions.find("tensor_grads");
    if (tensor_grads == modifier_.functions.end()) fail("flush_tensor_grads before tensor_grads");
    auto& gradients = tensor_grads->second.gradients;
    for (;;) {
      const std::string_view line = next_line();
      if (line == "}") break;
      if (line != "{") fail("a statement of flush_tensor_grads the code generator does not emit");
      ExpressionParser sum(modifier_, scope, tokenize(next_line()));
      for (const char* text :
           {"const", "GradSum", "sum", "=", "warp_sum_fixed", "(", "local", "["}) {
        sum.expect(text);
      }
      const auto local_slot = static_cast<int>(sum.integer());
      for (const char* text : {"]", ")", ";"}) sum.expect(text);
      sum.expect_end();
      ExpressionParser add(modifier_, scope, tokenize(next_line()));
      for (const char* text :
           {"if", "(", "(", "threadIdx", ".", "x", "%", "kWarpSize", ")", "==", "0", "&&"}) {
        add.expect(text);
      }
      const int slot = accumulator(add);
      for (const char* text : {"!=", "nullptr", ")", "add_fixed", "("}) add.expect(text);
      if (accumulator(add) != slot) fail("a flush into another tensor's gradient");
      add.expect("+");
      const int offset = add.expression();
      for (const char* text : {",", "sum", ")", ";"}) add.expect(text);
      add.expect_end();
      expect_line("}");
      bool matched = false;
      for (LiftedGradient& gradient : gradients) {
        if (gradient.local_slot != local_slot) continue;
        if (gradient.slot != slot || gradient.offset >= 0) fail("a flush of another slot's sum");
        gradient.offset = offset;
        matched = true;
      }
      if (!matched) fail("a flush of a local slot nothing adds to");
    }
    for (const LiftedGradient& gradient : gradients) {
      if (gradient.offset < 0) fail("a local gradient slot that is never flushed");
    }
  }

  std::vector<std::string_view> lines_;
  std::size_t line_ = 0;
  LiftedModifier modifier_;
};

}  // namespace

LiftResult lift_modifier_source(std::string_view source) {
  LiftResult result;
  const std::size_t marker = source.find(kGeneratedMarker);
  if (marker == std::string_view::npos) {
    result.failure = "the source has no generated Modifier";
    return result;
  }
  const std::size_t start = source.find('\n', marker);
  if (start == std::string_view::npos) {
    result.failure = "the source ends at its marker";
    return result;
  }
  SourceParser parser(source.substr(start + 1));
  try {
    result.modifier = parser.parse();
  } catch (const LiftError& error) {
    result.failure = fmt::format("generated line {}: {}", parser.line_number(), error.what);
  }
  return result;
}

}  // namespace flexattn::cuda
