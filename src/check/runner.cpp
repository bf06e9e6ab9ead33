// Runs one conformance case on an engine: same inputs through the engine, through cpu_ref in
// float64 and through the plain same-precision implementation; the case first proven
// discriminating, then every output checked against the float64 result per element with the
// tolerance rule (tolerance.cpp), and every output buffer fenced by sentinel regions.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "check/check_internal.hpp"
#include "flexattn/conformance.hpp"
#include "flexattn/error.hpp"

namespace flexattn::conformance {
namespace {

// Sentinel elements on each side of every output buffer, and the byte they hold. Interior
// elements start as NaN (all bits set) so an element the engine never writes fails the check.
constexpr std::int64_t kGuardElements = 64;
constexpr unsigned char kGuardByte = 0xA7;
constexpr unsigned char kPoisonByte = 0xFF;

// An output buffer with guard regions, on the host or on the engine's device.
class GuardedBuffer {
 public:
  GuardedBuffer(const TensorView& expected, const DeviceMemory* memory)
      : memory_(memory), dtype_(expected.dtype), shape_(expected.shape) {
    const std::size_t element = size_of(dtype_);
    const auto count = static_cast<std::size_t>(expected.numel());
    total_bytes_ = (count + 2 * kGuardElements) * element;
    interior_offset_ = kGuardElements * element;
    interior_bytes_ = count * element;
    host_.assign(total_bytes_, std::byte{kGuardByte});
    std::memset(host_.data() + interior_offset_, kPoisonByte, interior_bytes_);
    if (memory_ != nullptr) {
      device_ = memory_->allocate(total_bytes_);
      memory_->copy_to_device(device_, host_.data(), total_bytes_);
    }
  }
  ~GuardedBuffer() {
    if (memory_ != nullptr && device_ != nullptr) memory_->release(device_);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  // The view handed to the engine.
  TensorView engine_view() const {
    TensorView view;
    std::byte* base = memory_ != nullptr ? static_cast<std::byte*>(device_)
                                         : const_cast<std::byte*>(host_.data());
    view.data = base + interior_offset_;
    view.dtype = dtype_;
    view.shape = shape_;
    view.strides = contiguous_strides(shape_);
    view.device = memory_ != nullptr ? Device::kCuda : Device::kCpu;
    return view;
  }
  // Brings the buffer back to the host (after the engine ran); returns whether guards held.
  bool fetch() {
    if (memory_ != nullptr) {
      memory_->synchronize();
      memory_->copy_to_host(host_.data(), device_, total_bytes_);
    }
    for (std::size_t i = 0; i < total_bytes_; ++i) {
      const bool in_guard = i < interior_offset_ || i >= interior_offset_ + interior_bytes_;
      if (in_guard && host_[i] != std::byte{kGuardByte}) return false;
    }
    return true;
  }
  TensorView host_view() const {
    TensorView view = engine_view();
    view.data = const_cast<std::byte*>(host_.data()) + interior_offset_;
    view.device = Device::kCpu;
    return view;
  }

 private:
  const DeviceMemory* memory_;
  DType dtype_;
  std::vector<std::int64_t> shape_;
  std::vector<std::byte> host_;
  std::size_t total_bytes_ = 0, interior_offset_ = 0, interior_bytes_ = 0;
  void* device_ = nullptr;
};

// An input on the engine's device (a plain host view for CPU engines).
class DeviceInput {
 public:
  DeviceInput(const HostTensor& tensor, const DeviceMemory* memory) : memory_(memory) {
    view_ = tensor.view();
    if (memory_ != nullptr) {
      device_ = memory_->allocate(tensor.bytes());
      memory_->copy_to_device(device_, tensor.data(), tensor.bytes());
      view_.data = device_;
      view_.device = Device::kCuda;
    }
  }
  ~DeviceInput() {
    if (memory_ != nullptr && device_ != nullptr) memory_->release(device_);
  }
  DeviceInput(const DeviceInput&) = delete;
  DeviceInput& operator=(const DeviceInput&) = delete;
  const TensorView& view() const { return view_; }

 private:
  const DeviceMemory* memory_;
  TensorView view_;
  void* device_ = nullptr;
};

// N(mean, stddev^2) entries, rounded to `dtype`.
HostTensor random_input(const TensorView& expected, DType dtype, std::uint64_t seed,
                        double mean = 0.0, double stddev = 1.0) {
  HostTensor tensor(dtype, expected.shape);
  tensor.fill_normal(seed);
  if (mean != 0.0 || stddev != 1.0) {
    const TensorView view = tensor.view();
    for (std::int64_t e = 0; e < view.numel(); ++e) view.store(e, mean + stddev * view.load(e));
  }
  return tensor;
}

// Case::planted: the value in every 7th element of one row (entry `batch`, token, head) of a
// bshd tensor (a K/V pool: batch is the page, token the slot).
void plant(HostTensor& tensor, std::int64_t batch, std::int64_t token, std::int64_t head,
           double value) {
  constexpr std::int64_t kEvery = 7;
  const TensorView view = tensor.view();  // (batch, seq, heads, dim)
  for (std::int64_t d = 0; d < view.shape[3]; d += kEvery) {
    view.store(batch * view.strides[0] + token * view.strides[1] + head * view.strides[2] +
                   d * view.strides[3],
               value);
  }
}

// Plants Case::planted in sequence 0: a query row, or key `2 kv / 5` (of a paged cache: through
// the page table, in the full first sequence, where a sliding window hides it from the new
// tokens).
void plant_case(const Case& c, const Instance& instance, HostTensor& q, HostTensor& k,
                HostTensor& v, HostTensor& dout) {
  if (c.planted == Planted::kNone) return;
  if (c.layout != Layout::kBSHD) {
    throw_internal(fmt::format("conformance case {}: values are planted in bshd only", c.name));
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::int64_t key = 2 * c.shape.seq_len_kv / 5, query = c.shape.seq_len_q / 10;
  const std::int64_t head_kv = c.shape.heads_kv - 1, head = c.shape.heads_q - 1;
  std::int64_t key_entry = 0, key_token = key;
  if (c.page_size > 0) {
    key_entry = static_cast<std::int64_t>(instance.page_table.at(key / c.page_size));
    key_token = key % c.page_size;
  }
  switch (c.planted) {
    case Planted::kNone:
      break;
    case Planted::kNanValue:
      plant(v, key_entry, key_token, head_kv, nan);
      break;
    case Planted::kInfKey:
      plant(k, key_entry, key_token, head_kv, std::numeric_limits<double>::infinity());
      break;
    case Planted::kNanQuery:
      plant(q, 0, query, head, nan);
      break;
    case Planted::kNanOutputGradient:
      plant(dout, 0, query, head, nan);
      break;
  }
}

HostTensor host_output(const TensorView& expected, DType dtype) {
  return HostTensor(dtype, expected.shape);
}

}  // namespace

const OutputCheck* Outcome::worst() const {
  const OutputCheck* worst_check = nullptr;
  double worst_ratio = -1.0;
  for (const OutputCheck& check : checks) {
    const double ratio = check.allowed > 0.0     ? check.max_error / check.allowed
                         : check.max_error > 0.0 ? std::numeric_limits<double>::infinity()
                                                 : 0.0;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst_check = &check;
    }
  }
  return worst_check;
}

double Outcome::max_error() const {
  const OutputCheck* check = worst();
  return check == nullptr ? 0.0 : check->max_error;
}

double Outcome::allowed() const {
  const OutputCheck* check = worst();
  return check == nullptr ? 0.0 : check->allowed;
}

double Outcome::fraction_outside() const {
  double worst = 0.0;
  for (const OutputCheck& check : checks) worst = std::max(worst, check.fraction_outside);
  return worst;
}

Outcome run_case(const Engine& engine, const Case& test_case, std::uint64_t seed) {
  Outcome outcome;
  if (Support available = engine.available(); !available) {
    outcome.reason = available.reason();
    return outcome;
  }
  Instance instance = instantiate(test_case, engine.device(), seed);
  const Problem problem(instance.desc);
  if (Support support = engine.supports(problem); !support) {
    outcome.reason = support.reason();
    return outcome;
  }
  const DeviceMemory* memory = engine.memory();
  const DType dtype = problem.dtype();
  const DType stats_dtype = DType::kF32;

  // The same inputs for all three, in the storage dtype; float64 copies for the reference.
  HostTensor q = random_input(problem.expected("q"), dtype, seed * 4 + 0, instance.query_key_mean,
                              instance.query_key_stddev);
  HostTensor k = random_input(problem.expected("k"), dtype, seed * 4 + 1, instance.query_key_mean,
                              instance.query_key_stddev);
  HostTensor v = random_input(problem.expected("v"), dtype, seed * 4 + 2);
  HostTensor dout = random_input(problem.expected("o"), dtype, seed * 4 + 3);
  plant_case(test_case, instance, q, k, v, dout);

  ProblemDesc reference_desc = instance.desc;
  reference_desc.dtype = DType::kF64;
  reference_desc.device = Device::kCpu;
  detail::ReferenceInputs reference_inputs{
      q.to(DType::kF64), k.to(DType::kF64), v.to(DType::kF64), dout.to(DType::kF64), {}};
  if (problem.kv_cache()) {
    reference_inputs.page_table = instance.page_table.to(DType::kI32);
    reference_inputs.cache_lens = instance.cache_lens.to(DType::kI32);
  }
  for (auto& [name, tensor] : instance.tensors) {
    const bool is_float = is_floating(tensor.dtype());
    reference_inputs.tensors.emplace(name,
                                     is_float ? tensor.to(DType::kF64) : tensor.to(tensor.dtype()));
    if (is_float) reference_desc.tensors[name].dtype = DType::kF64;
  }
  const std::vector<std::string> float_tensors = [&] {
    std::vector<std::string> names;
    for (const std::string& name : problem.score_mod().tensors()) {
      if (is_floating(instance.tensors.at(name).dtype())) names.push_back(name);
    }
    return names;
  }();

  // Float64 reference.
  const detail::ReferenceOutputs reference = detail::run_reference(
      reference_desc, reference_inputs, float_tensors, detail::ReferenceVariant::kExact);

  // Plain same-precision implementation (the tolerance).
  HostTensor plain_out = host_output(problem.expected("o"), dtype);
  HostTensor plain_lse = host_output(problem.expected("lse"), stats_dtype);
  HostTensor plain_dq, plain_dk, plain_dv;
  std::map<std::string, HostTensor> plain_dtensor;
  // The size of the terms each gradient element through dS cancels (its rounding floor).
  HostTensor magnitude_dq, magnitude_dk, magnitude_dv;
  // The spread of dq and dk that the storage roundings of O, P and dS allow (their second floor).
  HostTensor sigma_dq, sigma_dk;
  std::map<std::string, HostTensor> magnitude_dtensor;
  {
    ForwardArgs args{q.view(), k.view(), v.view(), plain_out.view(), plain_lse.view(), {}, nullptr};
    for (auto& [name, tensor] : instance.tensors) args.tensors[name] = tensor.view();
    if (problem.kv_cache()) {
      args.page_table = instance.page_table.view();
      args.cache_lens = instance.cache_lens.view();
    }
    detail::plain_forward(problem, args);
    if (test_case.backward) {
      plain_dq = HostTensor(dtype, q.shape());
      plain_dk = HostTensor(dtype, k.shape());
      plain_dv = HostTensor(dtype, v.shape());
      BackwardArgs bargs;
      bargs.q = q.view(), bargs.k = k.view(), bargs.v = v.view();
      bargs.out = plain_out.view(), bargs.lse = plain_lse.view(), bargs.dout = dout.view();
      bargs.dq = plain_dq.view(), bargs.dk = plain_dk.view(), bargs.dv = plain_dv.view();
      bargs.tensors = args.tensors;
      for (const std::string& name : float_tensors) {
        plain_dtensor.emplace(name, HostTensor(stats_dtype, instance.tensors.at(name).shape()));
        bargs.tensor_grads[name] = plain_dtensor.at(name).view();
      }
      detail::plain_backward(problem, bargs);

      magnitude_dq = HostTensor(DType::kF64, q.shape());
      magnitude_dk = HostTensor(DType::kF64, k.shape());
      magnitude_dv = HostTensor(DType::kF64, v.shape());
      bargs.dq = magnitude_dq.view(), bargs.dk = magnitude_dk.view();
      bargs.dv = magnitude_dv.view();
      for (const std::string& name : float_tensors) {
        magnitude_dtensor.emplace(name, HostTensor(DType::kF64, instance.tensors.at(name).shape()));
        bargs.tensor_grads[name] = magnitude_dtensor.at(name).view();
      }
      detail::plain_backward_magnitudes(problem, bargs);

      sigma_dq = HostTensor(DType::kF64, q.shape());
      sigma_dk = HostTensor(DType::kF64, k.shape());
      bargs.dq = sigma_dq.view(), bargs.dk = sigma_dk.view();
      detail::plain_backward_rounding_sigma(problem, bargs);
    }
  }

  // Every output with its float64 reference and its tolerance, in the order they are reported.
  std::vector<detail::ToleratedOutput> outputs;
  const auto add_output = [&](std::string name, const HostTensor& plain,
                              const HostTensor& reference_output, DType rounding_dtype,
                              const HostTensor* magnitudes = nullptr,
                              const HostTensor* sigma = nullptr) {
    detail::Tolerance tolerance =
        detail::derive_tolerance(plain.view(), reference_output.view(), rounding_dtype);
    if (sigma != nullptr) {
      tolerance.floor = detail::gradient_floor(magnitudes->view(), sigma->view());
    } else if (magnitudes != nullptr) {
      tolerance.floor = detail::cancellation_floor(magnitudes->view());
    }
    outputs.push_back({std::move(name), &reference_output, std::move(tolerance)});
  };
  add_output("out", plain_out, reference.out, dtype);
  add_output("lse", plain_lse, reference.lse, stats_dtype);
  if (test_case.backward) {
    add_output("dq", plain_dq, reference.dq, dtype, &magnitude_dq, &sigma_dq);
    add_output("dk", plain_dk, reference.dk, dtype, &magnitude_dk, &sigma_dk);
    add_output("dv", plain_dv, reference.dv, dtype);
    for (const std::string& name : float_tensors) {
      add_output("d" + name, plain_dtensor.at(name), reference.tensor_grads.at(name), stats_dtype,
                 &magnitude_dtensor.at(name));
    }
  }
  const auto output_named = [&](const std::string& name) -> const detail::ToleratedOutput& {
    for (const detail::ToleratedOutput& output : outputs) {
      if (output.name == name) return output;
    }
    throw_internal(fmt::format("conformance: no output '{}'", name));
  };
  const auto reference_of = [&](const std::string& name) {
    return output_named(name).reference->view();
  };
  const auto tolerance_of = [&](const std::string& name) { return output_named(name).tolerance; };

  // The case must tell the request from the wrong functions an engine might compute.
  if (test_case.prove_discriminating) {
    const std::string failure =
        detail::discrimination_failure(reference_desc, reference_inputs, float_tensors, outputs);
    if (!failure.empty()) {
      outcome.status = Status::kFail;
      outcome.reason = "catalogue: the case does not discriminate: " + failure;
      return outcome;
    }
  }

  // The engine, with every input on its device and every output fenced.
  try {
    const std::unique_ptr<Plan> plan = engine.plan(problem);
    // The plan proof, exactly as selection applies it.
    if (const std::string failure = plan_proof_failure(plan->info(), problem); !failure.empty()) {
      outcome.status = Status::kFail;
      outcome.reason = "plan proof failed: " + failure;
      return outcome;
    }
    const DeviceInput q_in(q, memory), k_in(k, memory), v_in(v, memory), dout_in(dout, memory);
    std::map<std::string, std::unique_ptr<DeviceInput>> tensor_inputs;
    for (auto& [name, tensor] : instance.tensors) {
      tensor_inputs.emplace(name, std::make_unique<DeviceInput>(tensor, memory));
    }
    GuardedBuffer out(problem.expected("o"), memory);
    GuardedBuffer lse(problem.expected("lse"), memory);
    ForwardArgs args{q_in.view(),       k_in.view(), v_in.view(), out.engine_view(),
                     lse.engine_view(), {},          nullptr};
    for (auto& [name, input] : tensor_inputs) args.tensors[name] = input->view();
    std::optional<DeviceInput> page_table_in, cache_lens_in;
    if (problem.kv_cache()) {
      args.page_table = page_table_in.emplace(instance.page_table, memory).view();
      args.cache_lens = cache_lens_in.emplace(instance.cache_lens, memory).view();
    }
    plan->forward(args);
    const bool out_guard = out.fetch();
    const bool lse_guard = lse.fetch();
    outcome.checks.push_back(detail::compare("out", out.host_view(), reference_of("out"),
                                             tolerance_of("out"), out_guard));
    outcome.checks.push_back(detail::compare("lse", lse.host_view(), reference_of("lse"),
                                             tolerance_of("lse"), lse_guard));
    if (test_case.backward) {
      GuardedBuffer dq(problem.expected("q"), memory), dk(problem.expected("k"), memory),
          dv(problem.expected("v"), memory);
      std::map<std::string, std::unique_ptr<GuardedBuffer>> dtensors;
      BackwardArgs bargs;
      bargs.q = args.q, bargs.k = args.k, bargs.v = args.v;
      bargs.out = out.engine_view(), bargs.lse = lse.engine_view(), bargs.dout = dout_in.view();
      bargs.dq = dq.engine_view(), bargs.dk = dk.engine_view(), bargs.dv = dv.engine_view();
      bargs.tensors = args.tensors;
      for (const std::string& name : float_tensors) {
        TensorView expected;
        expected.dtype = stats_dtype;
        expected.shape = instance.tensors.at(name).shape();
        dtensors.emplace(name, std::make_unique<GuardedBuffer>(expected, memory));
        bargs.tensor_grads[name] = dtensors.at(name)->engine_view();
      }
      plan->backward(bargs);
      const bool dq_guard = dq.fetch(), dk_guard = dk.fetch(), dv_guard = dv.fetch();
      outcome.checks.push_back(
          detail::compare("dq", dq.host_view(), reference_of("dq"), tolerance_of("dq"), dq_guard));
      outcome.checks.push_back(
          detail::compare("dk", dk.host_view(), reference_of("dk"), tolerance_of("dk"), dk_guard));
      outcome.checks.push_back(
          detail::compare("dv", dv.host_view(), reference_of("dv"), tolerance_of("dv"), dv_guard));
      for (const std::string& name : float_tensors) {
        const bool guard = dtensors.at(name)->fetch();
        outcome.checks.push_back(detail::compare("d" + name, dtensors.at(name)->host_view(),
                                                 reference_of("d" + name), tolerance_of("d" + name),
                                                 guard));
      }
    }
  } catch (const Error& error) {
    outcome.status = Status::kFail;
    outcome.reason = fmt::format("{} error: {}", to_string(error.code()), error.what());
    return outcome;
  }

  outcome.status = Status::kPass;
  for (const OutputCheck& check : outcome.checks) {
    if (check.passed()) continue;
    outcome.status = Status::kFail;
    if (!outcome.reason.empty()) outcome.reason += "; ";
    outcome.reason +=
        !check.guard_intact
            ? fmt::format("{}: write outside the buffer (sentinel overwritten)", check.output)
            : fmt::format(
                  "{}: error {:.3g} > allowed {:.3g} at element {} (got {:.6g}, expected {:.6g}; "
                  "{:.1f}% outside)",
                  check.output, check.max_error, check.allowed, check.worst_index,
                  check.worst_value, check.worst_reference, 100.0 * check.fraction_outside);
  }
  return outcome;
}

}  // namespace flexattn::conformance
