#include "engines/cudnn/guards.hpp"

#include <fmt/format.h>

#include <array>
#include <cstdlib>

#include "flexattn/context.hpp"

namespace flexattn::cudnn {
namespace {

// Versions are cudnnGetVersion() values: major * 10000 + minor * 100 + patch.
constexpr std::size_t kVersionMajorUnit = 10000;
constexpr std::size_t kVersionMinorUnit = 100;

struct KnownBadRelease {
  std::size_t first;
  std::size_t last;
  const char* reason;
};

// The oldest release whose fused-attention graphs the cuDNN frontend's own flexible-graph tests
// cover; nothing older is tried.
constexpr std::size_t kOldestRelease = 90600;
// Score-modifier and mask graphs produced NaN before 9.13 (JAX re-enabled cuDNN flex attention
// from 9.13 "to avoid NaNs").
constexpr std::size_t kOldestModifierRelease = 91300;
// Up to 9.15 the backward engines need a padding mask when seq_len_kv is not a multiple of 128
// (the frontend adds one); flexattn does not add it.
constexpr std::size_t kLastBackwardPaddingRelease = 91500;
constexpr std::int64_t kBackwardKeyMultiple = 128;

constexpr KnownBadRelease kKnownBadReleases[] = {
    {91000, 91001,
     "fp16/bf16 fused attention has known bugs in cuDNN 9.10.0 and 9.10.1 (the cuDNN frontend "
     "refuses these releases)"},
};

// Engines a device run of test_cudnn verified (docs/engines.md, section cudnn), by global index
// and cuDNN minor release: an engine is added once the conformance matrix passed on it. A global
// index names a different kernel in another release, so each release is qualified by its own run;
// until then its engines are refused ("not verified").
struct VerifiedEngine {
  GraphKind kind;
  std::int64_t global_index;
  std::size_t major;  // cuDNN release major.minor, any patch level
  std::size_t minor;
};
// The first device run, 2026-12-02 (cuDNN 9.19.0, NVIDIA H200, driver 580; the log is
// docs/gpu-runs/2026-12-02-cudnn-first-run.txt): every plan cuDNN finalized ran eng2 (eng2_k24=7)
// forward and eng6 (eng6_k24=26) backward. On them every conformance case passed against cpu_ref
// (forward: none, causal, bottom-right causal with empty rows, bias, ALiBi, piecewise; backward:
// none, causal, bottom-right causal; fp16 and bf16, GQA and MQA, head dims 64 to 256, seq_len up
// to 640), and the golden cases it ran matched FlexAttention in bhsd. Only the softcap cases
// failed, by their LSE, and the error was cuDNN's tanh (lowering.cpp now refuses tanh).
constexpr std::array<VerifiedEngine, 2> kVerifiedEngines{{
    {GraphKind::kForward, 2, 9, 19},
    {GraphKind::kBackward, 6, 9, 19},
}};

constexpr int kMinimumCapability = 80;
constexpr int kHopperCapability = 90;
constexpr int kHopperNext = 100;
// Head dims: multiples of 8 (16-byte rows of fp16/bf16); at most 256 on Hopper, 128 elsewhere.
constexpr std::int64_t kHeadDimMultiple = 8;
constexpr std::int64_t kHopperMaxHeadDim = 256;
constexpr std::int64_t kOtherMaxHeadDim = 128;

}  // namespace

std::string EngineChoice::name() const { return fmt::format("eng{}", global_index); }

std::string EngineChoice::tag() const {
  std::string text = name();
  for (const auto& [type, value] : knobs) text += fmt::format("_k{}={}", type, value);
  return text;
}

std::string_view to_string(GraphKind kind) {
  return kind == GraphKind::kForward ? "forward" : "backward";
}

std::vector<std::string> ExclusionList::from_environment() {
  std::vector<std::string> patterns;
  const char* text = std::getenv("FLEXATTN_CUDNN_EXCLUDE");
  if (text == nullptr) return patterns;
  std::string entry;
  for (const char* c = text;; ++c) {
    if (*c == ',' || *c == '\0') {
      const auto begin = entry.find_first_not_of(' ');
      const auto end = entry.find_last_not_of(' ');
      if (begin != std::string::npos) patterns.push_back(entry.substr(begin, end - begin + 1));
      entry.clear();
      if (*c == '\0') break;
    } else {
      entry += *c;
    }
  }
  return patterns;
}

std::string ExclusionList::match(const EngineChoice& choice) const {
  for (const std::string& pattern : patterns) {
    if (glob_match(pattern, choice.name()) || glob_match(pattern, choice.tag())) return pattern;
  }
  return {};
}

bool is_verified(GraphKind kind, const EngineChoice& choice, std::size_t release) {
  const std::size_t major = release / kVersionMajorUnit;
  const std::size_t minor = (release % kVersionMajorUnit) / kVersionMinorUnit;
  for (const VerifiedEngine& engine : kVerifiedEngines) {
    if (engine.kind == kind && engine.global_index == choice.global_index &&
        engine.major == major && engine.minor == minor) {
      return true;
    }
  }
  return false;
}

std::string verified_engines(GraphKind kind) {
  std::string list;
  for (const VerifiedEngine& engine : kVerifiedEngines) {
    if (engine.kind != kind) continue;
    if (!list.empty()) list += ", ";
    list += fmt::format("eng{} on cuDNN {}.{}", engine.global_index, engine.major, engine.minor);
  }
  return list.empty() ? std::string("none yet") : list;
}

Support check_release(std::size_t version, const std::string& version_text, const Problem& problem,
                      bool modifier_graph) {
  if (version < kOldestRelease) {
    return Support::no(
        fmt::format("cuDNN {} is older than 9.6.0, the oldest release flexattn "
                    "builds fused attention graphs for",
                    version_text));
  }
  for (const KnownBadRelease& bad : kKnownBadReleases) {
    if (version >= bad.first && version <= bad.last) {
      return Support::no(fmt::format("cuDNN {}: {}", version_text, bad.reason));
    }
  }
  if (modifier_graph && version < kOldestModifierRelease) {
    return Support::no(
        fmt::format("cuDNN {}: score-modifier and mask graphs produced NaN before "
                    "cuDNN 9.13",
                    version_text));
  }
  if (problem.wants_backward() && version <= kLastBackwardPaddingRelease &&
      problem.seq_len_kv() % kBackwardKeyMultiple != 0) {
    return Support::no(fmt::format(
        "cuDNN {}: up to 9.15 the backward engines need a padding mask when seq_len_kv ({}) is "
        "not a multiple of 128",
        version_text, problem.seq_len_kv()));
  }
  return Support::yes();
}

Support check_constraints(const Problem& problem, int compute_capability) {
  if (compute_capability < kMinimumCapability) {
    return Support::no(
        fmt::format("cuDNN fused attention needs sm_80 or newer (the device is "
                    "sm_{})",
                    compute_capability));
  }
  if (problem.dtype() != DType::kF16 && problem.dtype() != DType::kBF16) {
    return Support::no(fmt::format("cuDNN fused attention takes fp16 or bf16, not {}",
                                   to_string(problem.dtype())));
  }
  if (problem.layout() == Layout::kTHD) {
    return Support::no(
        "thd (packed ragged sequences) needs cuDNN ragged offsets, which the cudnn "
        "engine does not implement");
  }
  const bool hopper = compute_capability >= kHopperCapability && compute_capability < kHopperNext;
  const std::int64_t max_head_dim = hopper ? kHopperMaxHeadDim : kOtherMaxHeadDim;
  for (const auto& [name, dim] : {std::pair{"head_dim_qk", problem.head_dim_qk()},
                                  std::pair{"head_dim_v", problem.head_dim_v()}}) {
    if (dim % kHeadDimMultiple != 0) {
      return Support::no(fmt::format("{} {} is not a multiple of 8", name, dim));
    }
    if (dim > max_head_dim) {
      return Support::no(
          fmt::format("{} {} exceeds {} on sm_{}", name, dim, max_head_dim, compute_capability));
    }
  }
  for (const char* which : {"q", "k", "v", "o"}) {
    if (problem.expected(which).strides.back() != 1) {
      return Support::no(fmt::format("{} has a non-unit last stride", which));
    }
  }
  if (problem.wants_backward()) {
    if (problem.seq_len_q() == 1 && problem.seq_len_kv() == 1) {
      return Support::no("cuDNN's attention backward does not take seq_len_q = seq_len_kv = 1");
    }
    for (const std::string& tensor : problem.score_mod().tensors()) {
      if (is_floating(problem.desc().tensors.at(tensor).dtype)) {
        return Support::no(fmt::format(
            "the gradient of tensor '{}' read by the score modifier is not implemented by the "
            "cudnn engine (cuDNN's fused backward has no reduction into arbitrary tensors)",
            tensor));
      }
    }
  }
  return Support::yes();
}

}  // namespace flexattn::cudnn
