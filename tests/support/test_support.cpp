#include "support/test_support.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

namespace flexattn::test {

std::vector<std::string> file_names(const std::string& folder) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string read_text(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}


namespace {

namespace fs = std::filesystem;

// Distinct generator streams for the inputs of one seed.
constexpr std::uint64_t kStreamQ = 0x51;
constexpr std::uint64_t kStreamK = 0x4b;
constexpr std::uint64_t kStreamV = 0x56;
constexpr std::uint64_t kStreamDout = 0x44;
constexpr std::uint64_t kStreamTensors = 0x100;
constexpr std::uint64_t kStreamMultiplier = 0x9e3779b97f4a7c15ull;
// Integer extra tensors get this many distinct ids.
constexpr std::int64_t kIntegerIds = 4;

std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t stream) {
  return seed * kStreamMultiplier + stream;
}

std::int64_t json_int(const nlohmann::json& json, const char* key) {
  return json.at(key).get<std::int64_t>();
}

std::string json_text(const nlohmann::json& json, const char* key) {
  const auto found = json.find(key);
  if (found == json.end() || found->is_null()) return {};
  return found->get<std::string>();
}

// A (B, H, S, D) view of `tensor`, which holds the same values in `layout`.
TensorView bhsd_view(const HostTensor& tensor, Layout layout, std::int64_t batch) {
  TensorView view = tensor.view();
  const std::vector<std::int64_t>& shape = tensor.shape();
  const std::vector<std::int64_t> c = contiguous_strides(shape);
  switch (layout) {
    case Layout::kBHSD:
      break;
    case Layout::kBSHD:  // (B, S, H, D)
      view.shape = {shape[0], shape[2], shape[1], shape[3]};
      view.strides = {c[0], c[2], c[1], c[3]};
      break;
    case Layout::kSBHD:  // (S, B, H, D)
      view.shape = {shape[1], shape[2], shape[0], shape[3]};
      view.strides = {c[1], c[2], c[0], c[3]};
      break;
    case Layout::kTHD: {  // (B * S, H, D)
      const std::int64_t length = shape[0] / batch;
      view.shape = {batch, shape[1], length, shape[2]};
      view.strides = {length * c[0], c[1], c[0], c[2]};
      break;
    }
  }
  return view;
}

HostTensor like(const TensorView& expected) { return HostTensor(expected.dtype, expected.shape); }

}  // namespace

// ---- golden cases ---------------------------------------------------------------------------

std::string golden_dir() { return FLEXATTN_GOLDEN_DIR; }

bool golden_available() { return fs::is_regular_file(fs::path(golden_dir()) / "README.md"); }

std::vector<std::string> golden_case_names() {
  std::vector<std::string> names;
  if (!golden_available()) return names;
  for (const fs::directory_entry& entry : fs::directory_iterator(golden_dir())) {
    if (entry.is_directory() && fs::is_regular_file(entry.path() / "case.json")) {
      names.push_back(entry.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

HostTensor GoldenCase::array(const std::string& array) const {
  return read_npy((fs::path(dir) / (array + ".npy")).string());
}

ProblemDesc GoldenCase::desc(Layout layout, DType dtype, Direction direction) const {
  ProblemDesc result;
  result.batch = batch;
  result.heads_q = heads_q;
  result.heads_kv = heads_kv;
  result.seq_len_q = seq_len_q;
  result.seq_len_kv = seq_len_kv;
  result.head_dim_qk = head_dim_qk;
  result.head_dim_v = head_dim_v;
  result.layout = layout;
  result.dtype = dtype;
  result.scale = scale;
  result.direction = direction;
  if (layout == Layout::kTHD) {
    result.cu_seqlens_q = uniform_offsets(batch, seq_len_q);
    result.cu_seqlens_kv = uniform_offsets(batch, seq_len_kv);
  }
  for (const std::string& tensor : tensors) {
    const HostTensor stored = array(tensor);
    result.tensors[tensor] = TensorDecl{stored.dtype(), stored.shape()};
  }
  const ir::Scope scope = result.scope();
  if (!score_mod.empty()) result.score_mod = ir::parse(score_mod, scope);
  if (!mask_mod.empty()) result.mask_mod = ir::parse(mask_mod, scope);
  return result;
}

GoldenCase load_golden_case(const std::string& name) {
  GoldenCase result;
  result.name = name;
  result.dir = (fs::path(golden_dir()) / name).string();
  std::ifstream file(fs::path(result.dir) / "case.json");
  const nlohmann::json json = nlohmann::json::parse(file);
  result.batch = json_int(json, "B");
  result.heads_q = json_int(json, "Hq");
  result.heads_kv = json_int(json, "Hkv");
  result.seq_len_q = json_int(json, "Sq");
  result.seq_len_kv = json_int(json, "Skv");
  result.head_dim_qk = json_int(json, "D");
  result.head_dim_v = json_int(json, "Dv");
  result.scale = json.at("scale").get<double>();
  result.score_mod = json_text(json, "score_mod");
  result.mask_mod = json_text(json, "mask_mod");
  result.tensors = json.at("tensors").get<std::vector<std::string>>();
  result.note = json_text(json, "note");
  return result;
}

// ---- layouts --------------------------------------------------------------------------------

HostTensor from_bhsd(const HostTensor& bhsd, Layout layout) {
  const std::vector<std::int64_t>& s = bhsd.shape();  // (B, H, S, D)
  std::vector<std::int64_t> shape;
  switch (layout) {
    case Layout::kBHSD:
      shape = s;
      break;
    case Layout::kBSHD:
      shape = {s[0], s[2], s[1], s[3]};
      break;
    case Layout::kSBHD:
      shape = {s[2], s[0], s[1], s[3]};
      break;
    case Layout::kTHD:
      shape = {s[0] * s[2], s[1], s[3]};
      break;
  }
  HostTensor result(bhsd.dtype(), shape);
  copy_into(bhsd.view(), bhsd_view(result, layout, s[0]));
  return result;
}

HostTensor lse_as_bhs(const HostTensor& lse, Layout layout, const GoldenCase& golden) {
  if (layout != Layout::kTHD) return lse.to(DType::kF64);
  HostTensor result(DType::kF64, {golden.batch, golden.heads_q, golden.seq_len_q});
  const std::int64_t tokens = golden.batch * golden.seq_len_q;
  for (std::int64_t b = 0; b < golden.batch; ++b) {
    for (std::int64_t h = 0; h < golden.heads_q; ++h) {
      for (std::int64_t q = 0; q < golden.seq_len_q; ++q) {
        result.set((b * golden.heads_q + h) * golden.seq_len_q + q,
                   lse.at(h * tokens + b * golden.seq_len_q + q));
      }
    }
  }
  return result;
}

HostTensor to_bhsd(const HostTensor& tensor, Layout layout, std::int64_t batch) {
  const TensorView source = bhsd_view(tensor, layout, batch);
  HostTensor result(tensor.dtype(), source.shape);
  copy_into(source, result.view());
  return result;
}

std::vector<std::int64_t> uniform_offsets(std::int64_t batch, std::int64_t length) {
  std::vector<std::int64_t> offsets;
  for (std::int64_t b = 0; b <= batch; ++b) offsets.push_back(b * length);
  return offsets;
}

// ---- random problems and inputs ---------------------------------------------------------------

Inputs random_inputs(const Problem& problem, std::uint64_t seed, double v_stddev) {
  Inputs inputs;
  inputs.q = like(problem.expected("q"));
  inputs.k = like(problem.expected("k"));
  inputs.v = like(problem.expected("v"));
  inputs.dout = like(problem.expected("dout"));
  inputs.q.fill_normal(stream_seed(seed, kStreamQ));
  inputs.k.fill_normal(stream_seed(seed, kStreamK));
  inputs.v.fill_normal(stream_seed(seed, kStreamV), v_stddev);
  inputs.dout.fill_normal(stream_seed(seed, kStreamDout));
  std::uint64_t stream = kStreamTensors;
  for (const auto& [name, decl] : problem.desc().tensors) {
    HostTensor tensor(decl.dtype, decl.shape);
    if (is_floating(decl.dtype)) {
      tensor.fill_normal(stream_seed(seed, stream++));
    } else {
      for (std::int64_t i = 0; i < tensor.numel(); ++i) {
        tensor.set(i, static_cast<double>(i * kIntegerIds / tensor.numel()));
      }
    }
    inputs.tensors.emplace(name, std::move(tensor));
  }
  return inputs;
}

ProblemDesc catalogue_desc(const std::vector<std::string>& modifiers, ProblemDesc base) {
  for (const std::string& name : modifiers) {
    if (!name.empty()) apply_modifier(find_modifier(name), base);
  }
  return base;
}

Inputs catalogue_inputs(const Problem& problem, const std::vector<std::string>& modifiers,
                        std::uint64_t seed) {
  Inputs inputs = random_inputs(problem, seed);
  CatalogueDims dims;
  dims.batch = problem.batch();
  dims.heads_q = problem.heads_q();
  dims.seq_len_q = problem.seq_len_q();
  dims.seq_len_kv = problem.seq_len_kv();
  for (const std::string& name : modifiers) {
    if (name.empty()) continue;
    const NamedModifier& modifier = find_modifier(name);
    for (const CatalogueTensor& tensor : modifier.tensors) {
      inputs.tensors[tensor.name] = make_catalogue_tensor(modifier, tensor, dims, seed);
    }
  }
  return inputs;
}

// ---- running an engine ------------------------------------------------------------------------

std::shared_ptr<const Engine> builtin_engine(std::string_view name) {
  for (const std::shared_ptr<const Engine>& engine : builtin_engines()) {
    if (engine->name() == name) return engine;
  }
  ADD_FAILURE() << "no built-in engine named " << name;
  return nullptr;
}

ForwardArgs forward_args(const Inputs& inputs, const Outputs& outputs) {
  ForwardArgs args;
  args.q = inputs.q.view();
  args.k = inputs.k.view();
  args.v = inputs.v.view();
  args.out = outputs.out.view();
  args.lse = outputs.lse.view();
  for (const auto& [name, tensor] : inputs.tensors) args.tensors[name] = tensor.view();
  return args;
}

BackwardArgs backward_args(const Inputs& inputs, const Outputs& outputs) {
  BackwardArgs args;
  args.q = inputs.q.view();
  args.k = inputs.k.view();
  args.v = inputs.v.view();
  args.out = outputs.out.view();
  args.lse = outputs.lse.view();
  args.dout = inputs.dout.view();
  args.dq = outputs.dq.view();
  args.dk = outputs.dk.view();
  args.dv = outputs.dv.view();
  for (const auto& [name, tensor] : inputs.tensors) args.tensors[name] = tensor.view();
  for (const auto& [name, tensor] : outputs.tensor_grads) args.tensor_grads[name] = tensor.view();
  return args;
}

Outputs run_engine(const Engine& engine, const Problem& problem, const Inputs& inputs) {
  const std::unique_ptr<Plan> plan = engine.plan(problem);
  Outputs outputs;
  outputs.out = like(problem.expected("o"));
  outputs.lse = like(problem.expected("lse"));
  plan->forward(forward_args(inputs, outputs));
  if (!problem.wants_backward()) return outputs;
  outputs.dq = like(problem.expected("dq"));
  outputs.dk = like(problem.expected("dk"));
  outputs.dv = like(problem.expected("dv"));
  const DType gradient_dtype = problem.dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
  std::vector<std::string> read = problem.score_mod().tensors();
  for (const std::string& name : problem.mask_mod().tensors()) read.push_back(name);
  for (const std::string& name : read) {
    const TensorDecl& decl = problem.desc().tensors.at(name);
    if (is_floating(decl.dtype)) {
      outputs.tensor_grads.insert_or_assign(name, HostTensor(gradient_dtype, decl.shape));
    }
  }
  plan->backward(backward_args(inputs, outputs));
  return outputs;
}

// ---- tolerances -------------------------------------------------------------------------------

double max_abs_error(const HostTensor& result, const HostTensor& reference) {
  if (result.shape() != reference.shape()) return std::numeric_limits<double>::quiet_NaN();
  const TensorView a = result.view(), b = reference.view();
  double worst = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.load(i), y = b.load(i);
    if (x == y) continue;  // includes equal infinities
    const double error = std::abs(x - y);
    if (std::isnan(error)) return error;
    worst = std::max(worst, error);
  }
  return worst;
}

double max_abs_value(const HostTensor& tensor) {
  const TensorView view = tensor.view();
  double largest = 0.0;
  for (std::int64_t i = 0; i < view.numel(); ++i) {
    const double value = std::abs(view.load(i));
    if (std::isfinite(value)) largest = std::max(largest, value);
  }
  return largest;
}

double allowed_error(double plain_error, double rounding_floor) {
  return 2.0 * plain_error + rounding_floor;
}

::testing::AssertionResult within_tolerance(const HostTensor& result, const HostTensor& reference,
                                            double allowed) {
  if (result.shape() != reference.shape()) {
    return ::testing::AssertionFailure() << "shapes differ: " << result.view().describe() << " vs "
                                         << reference.view().describe();
  }
  const TensorView a = result.view(), b = reference.view();
  std::int64_t worst_index = -1;
  double worst = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.load(i), y = b.load(i);
    if (x == y) continue;
    const double error = std::abs(x - y);
    if (std::isnan(error)) {
      return ::testing::AssertionFailure()
             << "NaN at flat index " << i << " (got " << x << ", expected " << y << ")";
    }
    if (error > worst) worst = error, worst_index = i;
  }
  if (worst <= allowed) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << fmt::format(
             "max abs error {:.3e} at flat index {} (got {}, expected {}) exceeds {:.3e}", worst,
             worst_index, a.load(worst_index), b.load(worst_index), allowed);
}

std::vector<conformance::Case> mixed_tanh_tile_cases(bool backward) {
  std::vector<conformance::Case> result;
  for (std::int64_t head_dim : {64, 128}) {
    conformance::Case c = conformance::custom_case(
        conformance::Shape{1, 4, 2, 1024, 1024, head_dim, head_dim}, Layout::kBHSD, DType::kBF16,
        "6 * tanh(score / 6)", "causal", backward);
    c.name = fmt::format("mixed_tanh_tiles_bf16_bhsd_d{}{}", head_dim, backward ? "_bwd" : "");
    result.push_back(c);
  }
  return result;
}

ScopedEnvironment::ScopedEnvironment(const char* name, const char* value) : name_(name) {
  if (const char* old = std::getenv(name)) previous_ = old;
  if (value == nullptr) {
    unsetenv(name);
  } else {
    setenv(name, value, 1);
  }
}

ScopedEnvironment::~ScopedEnvironment() {
  if (previous_) {
    setenv(name_, previous_->c_str(), 1);
  } else {
    unsetenv(name_);
  }
}

}  // namespace flexattn::test
