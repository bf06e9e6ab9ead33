// The engine contract: support is the first half of planning, and plans check their arguments
// against the problem they were built for before running.
#include "flexattn/engine.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <set>

#include "flexattn/error.hpp"

namespace flexattn {

namespace {

bool same_layout(const TensorView& actual, const TensorView& expected) {
  return actual.dtype == expected.dtype && actual.shape == expected.shape &&
         actual.strides == expected.strides && actual.device == expected.device;
}

void check_view(std::string_view name, const TensorView& actual, const TensorView& expected) {
  if (actual.empty()) {
    throw_invalid(fmt::format("argument {}: missing (expected {})", name, expected.describe()));
  }
  if (!same_layout(actual, expected)) {
    throw_invalid(fmt::format("argument {}: expected {}, got {}", name, expected.describe(),
                              actual.describe()));
  }
}

TensorView declared_view(const TensorDecl& decl, Device device) {
  TensorView view;
  view.dtype = decl.dtype;
  view.shape = decl.shape;
  view.strides = contiguous_strides(decl.shape);
  view.device = device;
  return view;
}

std::set<std::string> tensors_read(const Problem& problem) {
  std::set<std::string> names;
  for (const std::string& name : problem.score_mod().tensors()) names.insert(name);
  for (const std::string& name : problem.mask_mod().tensors()) names.insert(name);
  return names;
}

// Every tensor a modifier reads must be passed, contiguous, with its declared shape and dtype.
void check_tensors(const Problem& problem, const std::map<std::string, TensorView>& tensors) {
  for (const std::string& name : tensors_read(problem)) {
    const TensorView expected = declared_view(problem.desc().tensors.at(name), problem.device());
    const auto found = tensors.find(name);
    check_view("tensor '" + name + "'", found == tensors.end() ? TensorView{} : found->second,
               expected);
  }
}

// A KV cache problem's page table and lengths: their views always; on the host, their contents
// too (every length 0 or in [the sequence's query count, capacity], every page a sequence uses
// inside the pool), so no engine reads outside the pools.
void check_kv_cache_args(const Problem& problem, const ForwardArgs& args) {
  if (!problem.kv_cache()) {
    if (!args.page_table.empty() || !args.cache_lens.empty()) {
      throw_invalid("argument page_table/cache_lens: the problem has no KV cache");
    }
    return;
  }
  check_view("page_table", args.page_table, problem.expected("page_table"));
  check_view("cache_lens", args.cache_lens, problem.expected("cache_lens"));
  if (problem.device() != Device::kCpu) return;
  const KvCacheDesc& cache = *problem.kv_cache();
  const auto* lengths = static_cast<const std::int32_t*>(args.cache_lens.data);
  const auto* pages = static_cast<const std::int32_t*>(args.page_table.data);
  const std::int64_t capacity = problem.seq_len_kv();
  for (std::int64_t b = 0; b < problem.batch(); ++b) {
    const std::int64_t length = lengths[b], q_len = problem.seq_len_q_of(b);
    if (length != 0 && (length < q_len || length > capacity)) {
      throw_invalid(fmt::format(
          "argument cache_lens[{}] ({}) must be 0 or in [{}, {}]: at least the sequence's query "
          "tokens (the cache holds their keys), at most the capacity max_pages x page_size",
          b, length, q_len, capacity));
    }
    const std::int64_t used = (length + cache.page_size - 1) / cache.page_size;
    for (std::int64_t j = 0; j < used; ++j) {
      const std::int64_t page = pages[b * cache.max_pages + j];
      if (page < 0 || page >= cache.pages) {
        throw_invalid(fmt::format(
            "argument page_table[{}, {}] ({}) is outside the pool's pages [0, {}) (sequence {} "
            "holds {} tokens in {} pages)",
            b, j, page, cache.pages, b, length, used));
      }
    }
  }
}

constexpr std::string_view kNoKvCache =
    "reads no paged KV cache (K and V as page pools through a page table)";

}  // namespace

std::string plan_proof_failure(const PlanInfo& info, const Problem& problem) {
  if (info.lowered_hash != problem.modifier_hash()) {
    return fmt::format(
        "engine {}: the forward modifier differs: its plan lowered score_mod, mask_mod and scale "
        "of hash {} but {} was requested",
        info.engine, hash_to_hex(info.lowered_hash), hash_to_hex(problem.modifier_hash()));
  }
  if (problem.wants_backward() && info.lowered_backward_hash != problem.backward_hash()) {
    return fmt::format(
        "engine {}: the derivative differs: its plan lowered derivatives of hash {} but {} "
        "(d score_mod / d score and d score_mod / d loaded tensors) was requested",
        info.engine, hash_to_hex(info.lowered_backward_hash), hash_to_hex(problem.backward_hash()));
  }
  return {};
}

std::string Engine::plan_settings() const { return {}; }

Support Engine::supports(const Problem& problem) const {
  Support available_here = available();
  if (!available_here) return available_here;
  if (problem.device() != device()) {
    return Support::no(fmt::format("runs on {}, the problem is on {}", to_string(device()),
                                   to_string(problem.device())));
  }
  if (problem.kv_cache() && !reads_kv_cache()) return Support::no(std::string(kNoKvCache));
  return lower(problem, Stage::kCheck).support;
}

std::unique_ptr<Plan> Engine::plan(const Problem& problem) const {
  const Support available_here = available();
  if (!available_here) throw_unsupported(fmt::format("{}: {}", name(), available_here.reason()));
  if (problem.device() != device()) {
    throw_unsupported(fmt::format("{}: runs on {}, the problem is on {}", name(),
                                  to_string(device()), to_string(problem.device())));
  }
  if (problem.kv_cache() && !reads_kv_cache()) {
    throw_unsupported(fmt::format("{}: {}", name(), kNoKvCache));
  }
  Lowered lowered = lower(problem, Stage::kBuild);
  if (!lowered.support) throw_unsupported(fmt::format("{}: {}", name(), lowered.support.reason()));
  if (!lowered.plan) throw_internal(fmt::format("{}: lowering succeeded without a plan", name()));
  return std::move(lowered.plan);
}

namespace {

// A lent workspace must hold what the pass uses and start on the alignment the engines assume.
void check_workspace(const Workspace& workspace, std::size_t needed, std::string_view pass) {
  if (workspace.data == nullptr) {
    if (workspace.bytes != 0) {
      throw_invalid(fmt::format("workspace: {} bytes at a null pointer", workspace.bytes));
    }
    return;
  }
  if (workspace.bytes < needed) {
    throw_invalid(fmt::format("workspace: {} bytes lent; this plan's {} needs {}", workspace.bytes,
                              pass, needed));
  }
  if (reinterpret_cast<std::uintptr_t>(workspace.data) % kWorkspaceAlignment != 0) {
    throw_invalid(
        fmt::format("workspace: {} is not {}-byte aligned", workspace.data, kWorkspaceAlignment));
  }
}

}  // namespace

void Plan::forward(const ForwardArgs& args) const {
  check_forward_args(problem(), args);
  check_workspace(args.workspace, workspace_bytes(Pass::kForward), "forward");
  run_forward(args);
}

void Plan::backward(const BackwardArgs& args) const {
  check_backward_args(problem(), args);
  check_workspace(args.workspace, workspace_bytes(Pass::kBackward), "backward");
  run_backward(args);
}

void check_forward_args(const Problem& problem, const ForwardArgs& args) {
  check_view("q", args.q, problem.expected("q"));
  check_view("k", args.k, problem.expected("k"));
  check_view("v", args.v, problem.expected("v"));
  check_view("out", args.out, problem.expected("o"));
  if (!args.lse.empty()) check_view("lse", args.lse, problem.expected("lse"));
  check_tensors(problem, args.tensors);
  check_kv_cache_args(problem, args);
}

void check_backward_args(const Problem& problem, const BackwardArgs& args) {
  if (!problem.wants_backward()) {
    throw_invalid("backward: the problem was built for the forward direction only");
  }
  check_view("q", args.q, problem.expected("q"));
  check_view("k", args.k, problem.expected("k"));
  check_view("v", args.v, problem.expected("v"));
  check_view("out", args.out, problem.expected("o"));
  check_view("lse", args.lse, problem.expected("lse"));
  check_view("dout", args.dout, problem.expected("dout"));
  check_view("dq", args.dq, problem.expected("dq"));
  check_view("dk", args.dk, problem.expected("dk"));
  check_view("dv", args.dv, problem.expected("dv"));
  check_tensors(problem, args.tensors);
  const std::set<std::string> read = tensors_read(problem);
  for (const auto& [name, gradient] : args.tensor_grads) {
    const auto decl = problem.desc().tensors.find(name);
    if (!read.contains(name) || decl == problem.desc().tensors.end() ||
        !is_floating(decl->second.dtype)) {
      throw_invalid(fmt::format(
          "argument tensor_grads '{}': the modifiers read no floating-point tensor '{}'", name,
          name));
    }
    TensorView expected = declared_view(decl->second, problem.device());
    expected.dtype = gradient.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    check_view("tensor_grads '" + name + "' (fp32 or fp64)", gradient, expected);
  }
}

}  // namespace flexattn
