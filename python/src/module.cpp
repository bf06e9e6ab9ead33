// flexattn._flexattn: the nanobind extension under the Python package. It exposes the modifier
// builder (ir::Expr), problems and plans, engine selection (one Context per engine request) and
// explain/engines. All semantics stay in the C++ library; tensors arrive as (data pointer,
// dtype, shape, strides) and are wrapped in TensorViews without copies.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "flexattn/flexattn.hpp"

namespace nb = nanobind;

namespace flexattn::python {

namespace {

// ---- errors --------------------------------------------------------------------------------

// flexattn.Error (RuntimeError) and flexattn.NoEngineError (Error); invalid input is ValueError.
PyObject* error_type = nullptr;
PyObject* no_engine_error_type = nullptr;

void translate_error(const std::exception_ptr& pointer, void*) {
  try {
    std::rethrow_exception(pointer);
  } catch (const Error& error) {
    switch (error.code()) {
      case ErrorCode::kInvalidArgument:
        PyErr_SetString(PyExc_ValueError, error.what());
        return;
      case ErrorCode::kUnsupported:
        PyErr_SetString(no_engine_error_type, error.what());
        return;
      case ErrorCode::kCuda:
      case ErrorCode::kCudnn:
      case ErrorCode::kCompile:
      case ErrorCode::kIo:
      case ErrorCode::kInternal:
        PyErr_SetString(error_type, error.what());
        return;
    }
    PyErr_SetString(error_type, error.what());
  }
}

// ---- the modifier builder --------------------------------------------------------------------

// The operations a traced Python function may produce, by the names the Python tracer uses.
const std::map<std::string, Op, std::less<>>& operations() {
  // clang-format off
  static const std::map<std::string, Op, std::less<>> kOperations = {
      {"add", Op::kAdd},         {"sub", Op::kSub},         {"mul", Op::kMul},
      {"div", Op::kDiv},         {"mod", Op::kMod},         {"neg", Op::kNeg},
      {"lt", Op::kLess},         {"le", Op::kLessEqual},    {"gt", Op::kGreater},
      {"ge", Op::kGreaterEqual}, {"eq", Op::kEqual},        {"ne", Op::kNotEqual},
      {"and", Op::kAnd},         {"or", Op::kOr},           {"not", Op::kNot},
      {"where", Op::kWhere},     {"min", Op::kMin},         {"max", Op::kMax},
      {"clamp", Op::kClamp},     {"abs", Op::kAbs},         {"exp", Op::kExp},
      {"exp2", Op::kExp2},       {"log", Op::kLog},         {"log2", Op::kLog2},
      {"sqrt", Op::kSqrt},       {"rsqrt", Op::kRsqrt},     {"tanh", Op::kTanh},
      {"sigmoid", Op::kSigmoid}, {"floor", Op::kFloor},     {"float", Op::kToFloat},
      {"int", Op::kToInt},
  };
  // clang-format on
  return kOperations;
}

ir::Expr make_operation(const std::string& name, const std::vector<ir::Expr>& args) {
  const auto found = operations().find(name);
  if (found == operations().end()) throw_invalid("unknown IR operation '" + name + "'");
  if (static_cast<int>(args.size()) != arity(found->second)) {
    throw_invalid("IR operation '" + name + "' takes " + std::to_string(arity(found->second)) +
                  " arguments, got " + std::to_string(args.size()));
  }
  return ir::make(found->second, args);
}

ir::Expr make_leaf(const std::string& name) {
  if (name == "score") return ir::score();
  if (name == "b") return ir::batch();
  if (name == "h") return ir::head();
  if (name == "q") return ir::query();
  if (name == "kv") return ir::key();
  if (name == "Q_LEN") return ir::query_length();
  if (name == "KV_LEN") return ir::key_length();
  throw_invalid("unknown IR leaf '" + name + "'");
}

// ---- problems ------------------------------------------------------------------------------

// A view as the Python layer passes it: (data pointer, dtype name, shape, strides).
using ViewTuple =
    std::tuple<std::uintptr_t, std::string, std::vector<std::int64_t>, std::vector<std::int64_t>>;

TensorView to_view(const ViewTuple& tuple, Device device) {
  TensorView view;
  view.data = reinterpret_cast<void*>(std::get<0>(tuple));
  view.dtype = parse_dtype(std::get<1>(tuple));
  view.shape = std::get<2>(tuple);
  view.strides = std::get<3>(tuple);
  view.device = device;
  return view;
}

std::optional<TensorView> optional_view(const std::optional<ViewTuple>& tuple, Device device) {
  if (!tuple) return std::nullopt;
  return to_view(*tuple, device);
}

template <typename T>
T get(const nb::dict& dict, const char* key, T fallback) {
  if (!dict.contains(key)) return fallback;
  nb::handle value = dict[key];
  if (value.is_none()) return fallback;
  return nb::cast<T>(value);
}

// Builds the problem a Python call describes. The dict's keys mirror ProblemDesc; the modifiers
// are IR text (what the tracer printed, or what the user wrote) parsed in the problem's scope.
ProblemDesc problem_desc(const nb::dict& dict) {
  ProblemDesc desc;
  desc.batch = get<std::int64_t>(dict, "batch", 1);
  desc.heads_q = get<std::int64_t>(dict, "heads_q", 1);
  desc.heads_kv = get<std::int64_t>(dict, "heads_kv", 0);
  desc.seq_len_q = get<std::int64_t>(dict, "seq_len_q", 1);
  desc.seq_len_kv = get<std::int64_t>(dict, "seq_len_kv", 0);
  desc.head_dim_qk = get<std::int64_t>(dict, "head_dim_qk", 64);
  desc.head_dim_v = get<std::int64_t>(dict, "head_dim_v", 0);
  desc.layout = parse_layout(get<std::string>(dict, "layout", "bhsd"));
  desc.dtype = parse_dtype(get<std::string>(dict, "dtype", "fp32"));
  desc.scale = get<std::optional<double>>(dict, "scale", std::nullopt);
  const std::string device = get<std::string>(dict, "device", "cpu");
  if (device == "cpu") {
    desc.device = Device::kCpu;
  } else if (device == "cuda") {
    desc.device = Device::kCuda;
  } else {
    throw_invalid("unknown device '" + device + "' (cpu or cuda)");
  }
  desc.direction =
      get<bool>(dict, "backward", false) ? Direction::kForwardBackward : Direction::kForward;
  using Strides = std::optional<std::vector<std::int64_t>>;
  desc.q_strides = get<Strides>(dict, "q_strides", std::nullopt);
  desc.k_strides = get<Strides>(dict, "k_strides", std::nullopt);
  desc.v_strides = get<Strides>(dict, "v_strides", std::nullopt);
  desc.o_strides = get<Strides>(dict, "o_strides", std::nullopt);
  using Offsets = std::vector<std::int64_t>;
  desc.cu_seqlens_q = get<Offsets>(dict, "cu_seqlens_q", {});
  desc.cu_seqlens_kv = get<Offsets>(dict, "cu_seqlens_kv", {});
  using Cache = std::optional<std::tuple<std::int64_t, std::int64_t, std::int64_t>>;
  if (const Cache cache = get<Cache>(dict, "kv_cache", std::nullopt)) {
    desc.kv_cache = KvCacheDesc{std::get<0>(*cache), std::get<1>(*cache), std::get<2>(*cache)};
  }
  using Decls = std::map<std::string, std::pair<std::string, std::vector<std::int64_t>>>;
  for (const auto& [name, decl] : get<Decls>(dict, "tensors", {})) {
    desc.tensors[name] = TensorDecl{parse_dtype(decl.first), decl.second};
  }
  const ir::Scope scope = desc.scope();
  const std::string score_mod = get<std::string>(dict, "score_mod", "");
  const std::string mask_mod = get<std::string>(dict, "mask_mod", "");
  if (!score_mod.empty()) desc.score_mod = ir::parse(score_mod, scope);
  if (!mask_mod.empty()) desc.mask_mod = ir::parse(mask_mod, scope);
  return desc;
}

// One Context per engine request ("auto" or an engine name), created on first use and kept for
// the life of the process: it owns the plan cache and the compiled kernels.
Context& context_for(const std::string& engine) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<Context>> contexts;
  const std::lock_guard lock(mutex);
  auto found = contexts.find(engine);
  if (found != contexts.end()) return *found->second;
  ContextOptions options;
  if (engine != "auto") options.policy.force = engine;
  auto context = std::make_unique<Context>(std::move(options));
  return *contexts.emplace(engine, std::move(context)).first->second;
}

// A selected plan; forward/backward take the views and run with the GIL released.
class PyPlan {
 public:
  explicit PyPlan(std::shared_ptr<const Plan> plan) : plan_(std::move(plan)) {}

  std::string engine() const { return plan_->info().engine; }
  std::string description() const { return plan_->info().description; }
  std::string summary() const { return problem_summary(plan_->problem()); }
  std::string score_mod() const { return plan_->problem().score_mod().to_string(); }
  std::string mask_mod() const { return plan_->problem().mask_mod().to_string(); }

  void forward(const ViewTuple& q, const ViewTuple& k, const ViewTuple& v, const ViewTuple& out,
               const std::optional<ViewTuple>& lse, const std::map<std::string, ViewTuple>& tensors,
               std::uintptr_t stream) const {
    const Device device = plan_->problem().device();
    ForwardArgs args;
    args.q = to_view(q, device);
    args.k = to_view(k, device);
    args.v = to_view(v, device);
    args.out = to_view(out, device);
    if (auto view = optional_view(lse, device)) args.lse = *view;
    for (const auto& [name, tuple] : tensors) args.tensors[name] = to_view(tuple, device);
    args.stream = reinterpret_cast<void*>(stream);
    const nb::gil_scoped_release release;
    plan_->forward(args);
  }

  void backward(const ViewTuple& q, const ViewTuple& k, const ViewTuple& v, const ViewTuple& out,
                const ViewTuple& lse, const ViewTuple& dout, const ViewTuple& dq,
                const ViewTuple& dk, const ViewTuple& dv,
                const std::map<std::string, ViewTuple>& tensors,
                const std::map<std::string, ViewTuple>& tensor_grads, std::uintptr_t stream,
                std::uintptr_t workspace, std::size_t workspace_bytes) const {
    const Device device = plan_->problem().device();
    BackwardArgs args;
    args.workspace = {reinterpret_cast<void*>(workspace), workspace_bytes};
    args.q = to_view(q, device);
    args.k = to_view(k, device);
    args.v = to_view(v, device);
    args.out = to_view(out, device);
    args.lse = to_view(lse, device);
    args.dout = to_view(dout, device);
    args.dq = to_view(dq, device);
    args.dk = to_view(dk, device);
    args.dv = to_view(dv, device);
    for (const auto& [name, tuple] : tensors) args.tensors[name] = to_view(tuple, device);
    for (const auto& [name, tuple] : tensor_grads) {
      args.tensor_grads[name] = to_view(tuple, device);
    }
    args.stream = reinterpret_cast<void*>(stream);
    const nb::gil_scoped_release release;
    plan_->backward(args);
  }

  std::size_t workspace_bytes(Pass pass) const { return plan_->workspace_bytes(pass); }

  // Checks the views of a forward call against the plan's problem (what forward runs first),
  // without running: the Python layer checks a new plan's views once before it calls
  // forward_pointers with the same layout.
  void check_forward(const ViewTuple& q, const ViewTuple& k, const ViewTuple& v,
                     const ViewTuple& out, const ViewTuple& lse,
                     const std::map<std::string, ViewTuple>& tensors) const {
    const Device device = plan_->problem().device();
    ForwardArgs args;
    args.q = to_view(q, device);
    args.k = to_view(k, device);
    args.v = to_view(v, device);
    args.out = to_view(out, device);
    args.lse = to_view(lse, device);
    for (const auto& [name, tuple] : tensors) args.tensors[name] = to_view(tuple, device);
    check_forward_args(plan_->problem(), args);
  }

  // The same calls with data pointers alone: the views take the shapes, strides and dtypes of
  // the problem the plan was built for. The Python layer calls these only with tensors whose
  // layout is the plan's (its plan cache is keyed by every shape, stride and dtype); the plan
  // still checks every view before running.
  // A KV cache problem's page table and lengths come as pointers too (int32, contiguous);
  // Plan::forward checks the lengths and the pages they use before running.
  void forward_pointers(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t out,
                        std::uintptr_t lse, const std::map<std::string, std::uintptr_t>& tensors,
                        std::uintptr_t stream, std::uintptr_t workspace,
                        std::size_t workspace_bytes, std::uintptr_t page_table,
                        std::uintptr_t cache_lens) const {
    const Problem& problem = plan_->problem();
    ForwardArgs args;
    args.workspace = {reinterpret_cast<void*>(workspace), workspace_bytes};
    args.q = expected(problem, "q", q);
    args.k = expected(problem, "k", k);
    args.v = expected(problem, "v", v);
    args.out = expected(problem, "o", out);
    args.lse = expected(problem, "lse", lse);
    args.tensors = tensor_views(problem, tensors);
    if (problem.kv_cache()) {
      args.page_table = expected(problem, "page_table", page_table);
      args.cache_lens = expected(problem, "cache_lens", cache_lens);
    }
    args.stream = reinterpret_cast<void*>(stream);
    const nb::gil_scoped_release release;
    plan_->forward(args);
  }

 private:
  static TensorView expected(const Problem& problem, std::string_view which, std::uintptr_t data) {
    TensorView view = problem.expected(which);
    view.data = reinterpret_cast<void*>(data);
    return view;
  }

  static std::map<std::string, TensorView> tensor_views(
      const Problem& problem, const std::map<std::string, std::uintptr_t>& pointers) {
    std::map<std::string, TensorView> views;
    for (const auto& [name, data] : pointers) {
      const auto decl = problem.desc().tensors.find(name);
      if (decl == problem.desc().tensors.end()) {
        throw_invalid("tensor '" + name + "' is not declared by the problem");
      }
      TensorView view;
      view.data = reinterpret_cast<void*>(data);
      view.dtype = decl->second.dtype;
      view.shape = decl->second.shape;
      view.strides = contiguous_strides(view.shape);
      view.device = problem.device();
      views[name] = view;
    }
    return views;
  }

  std::shared_ptr<const Plan> plan_;
};

PyPlan select_plan(const nb::dict& dict, const std::string& engine) {
  const Problem problem(problem_desc(dict));
  Context& context = context_for(engine);
  const nb::gil_scoped_release release;
  return PyPlan(context.select(problem));
}

// What `flexattn explain` prints, as a dict.
nb::dict explain(const nb::dict& dict, const std::string& engine) {
  const Problem problem(problem_desc(dict));
  const Context& context = context_for(engine);
  const std::vector<Verdict> verdicts = context.explain(problem);
  const Policy& policy = context.options().policy;
  nb::dict result;
  result["problem"] = problem_summary(problem);
  result["signature"] = problem.signature();
  result["score_mod"] = problem.score_mod().to_string();
  result["mask_mod"] = problem.mask_mod().to_string();
  result["scale"] = problem.scale();
  result["modifier_hash"] = hash_to_hex(problem.modifier_hash());
  nb::list tensor_derivatives;
  try {
    result["derivative_wrt_score"] = derivative_wrt_score(problem.score_mod()).to_string();
    for (const LoadDerivative& load : derivatives_wrt_tensors(problem.score_mod())) {
      std::string text = load.tensor + "[";
      for (std::size_t i = 0; i < load.indices.size(); ++i) {
        text += (i == 0 ? "" : ", ") + load.indices[i].to_string();
      }
      tensor_derivatives.append(nb::make_tuple(text + "]", load.derivative.to_string()));
    }
  } catch (const Error& error) {
    result["derivative_wrt_score"] = std::string("(not differentiable: ") + error.what() + ")";
  }
  result["derivatives_wrt_tensors"] = tensor_derivatives;
  nb::list engines;
  nb::object selected = nb::none();
  for (const Verdict& verdict : verdicts) {
    nb::dict entry;
    entry["name"] = verdict.engine;
    entry["allowed"] = verdict.allowed;
    entry["policy"] = policy.refusal(verdict.engine);
    entry["supported"] = verdict.support.ok();
    entry["reason"] = verdict.support.reason();
    if (selected.is_none() && verdict.allowed && verdict.support.ok()) {
      selected = nb::str(verdict.engine.c_str());
    }
    engines.append(entry);
  }
  result["engines"] = engines;
  result["selected"] = selected;
  return result;
}

nb::list engines() {
  const Context& context = context_for("auto");
  const Policy& policy = context.options().policy;
  nb::list list;
  for (const auto& engine : context.engines()) {
    const Support available = engine->available();
    nb::dict entry;
    entry["name"] = std::string(engine->name());
    entry["device"] = std::string(to_string(engine->device()));
    entry["available"] = available.ok();
    entry["reason"] = available.reason();
    entry["allowed"] = policy.allows(engine->name());
    entry["policy"] = policy.refusal(engine->name());
    list.append(entry);
  }
  return list;
}

}  // namespace

NB_MODULE(_flexattn, m) {
  m.doc() = "flexattn's C++ core (the Python package 'flexattn' is the interface)";
  m.attr("__version__") = version();
  // Plans cached by the Python layer live until interpreter exit, past nanobind's leak check.
  nb::set_leak_warnings(false);

  // The exception types live as long as the process (module state is never torn down).
  error_type =
      PyErr_NewExceptionWithDoc("flexattn.Error", "An error flexattn reports (the C++ message).",
                                PyExc_RuntimeError, nullptr);
  no_engine_error_type = PyErr_NewExceptionWithDoc(
      "flexattn.NoEngineError", "No engine (or not the requested one) can run the problem.",
      error_type, nullptr);
  if (error_type == nullptr || no_engine_error_type == nullptr) throw nb::python_error();
  m.attr("Error") = nb::borrow(error_type);
  m.attr("NoEngineError") = nb::borrow(no_engine_error_type);
  nb::register_exception_translator(translate_error);

  nb::class_<ir::Expr>(m, "Expr")
      .def_prop_ro("type", [](const ir::Expr& e) { return std::string(to_string(e.type())); })
      .def("__str__", &ir::Expr::to_string)
      .def("__repr__", [](const ir::Expr& e) { return "Expr(" + e.to_string() + ")"; });
  m.def("leaf", &make_leaf, nb::arg("name"));
  m.def("literal_f32", &ir::literal_f32, nb::arg("value"));
  m.def("literal_i32", &ir::literal_i32, nb::arg("value"));
  m.def("literal_bool", &ir::literal_bool, nb::arg("value"));
  m.def("operation", &make_operation, nb::arg("name"), nb::arg("args"));
  m.def(
      "load",
      [](const std::string& tensor, bool is_float, const std::vector<ir::Expr>& indices) {
        return ir::load(tensor, is_float ? Type::kF32 : Type::kI32, indices);
      },
      nb::arg("tensor"), nb::arg("is_float"), nb::arg("indices"));
  m.def(
      "canonical",
      [](const std::string& text, const nb::dict& tensors) {
        nb::dict desc;
        desc["tensors"] = tensors;
        return ir::parse(text, problem_desc(desc).scope()).to_string();
      },
      nb::arg("text"), nb::arg("tensors"));

  nb::class_<PyPlan>(m, "Plan")
      .def_prop_ro("engine", &PyPlan::engine)
      .def_prop_ro("description", &PyPlan::description)
      .def_prop_ro("summary", &PyPlan::summary)
      .def_prop_ro("score_mod", &PyPlan::score_mod)
      .def_prop_ro("mask_mod", &PyPlan::mask_mod)
      .def("forward", &PyPlan::forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
           nb::arg("lse").none(), nb::arg("tensors"), nb::arg("stream"))
      .def("check_forward", &PyPlan::check_forward, nb::arg("q"), nb::arg("k"), nb::arg("v"),
           nb::arg("out"), nb::arg("lse"), nb::arg("tensors"))
      .def_prop_ro("forward_workspace_bytes",
                   [](const PyPlan& plan) { return plan.workspace_bytes(Pass::kForward); })
      .def_prop_ro("backward_workspace_bytes",
                   [](const PyPlan& plan) { return plan.workspace_bytes(Pass::kBackward); })
      .def("forward_pointers", &PyPlan::forward_pointers, nb::arg("q"), nb::arg("k"), nb::arg("v"),
           nb::arg("out"), nb::arg("lse"), nb::arg("tensors"), nb::arg("stream"),
           nb::arg("workspace") = 0, nb::arg("workspace_bytes") = 0, nb::arg("page_table") = 0,
           nb::arg("cache_lens") = 0)
      .def("backward", &PyPlan::backward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
           nb::arg("lse"), nb::arg("dout"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
           nb::arg("tensors"), nb::arg("tensor_grads"), nb::arg("stream"), nb::arg("workspace") = 0,
           nb::arg("workspace_bytes") = 0);
  m.def("select", &select_plan, nb::arg("problem"), nb::arg("engine"));
  m.def("explain", &explain, nb::arg("problem"), nb::arg("engine"));
  m.def("engines", &engines);
}

}  // namespace flexattn::python
