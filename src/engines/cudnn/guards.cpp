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

// Engines a device run of the conformance matrix verified (docs/engines.md, section cudnn): a
// global index names a different kernel in another release, its knobs a different variant of it,
// and a kernel may behave differently on another architecture, so an entry holds for exactly one
// engine tag, cuDNN release (patch level included) and compute capability.
struct VerifiedEngine {
  GraphKind kind;
  const char* tag;      // EngineChoice::tag(): global index and knobs
  std::size_t release;  // cudnnGetVersion()
  int compute_capability;
};
constexpr VerifiedEngine kVerifiedEngines[] = {
#include "engines/cudnn/verified_engines.inc"
};

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

bool is_verified(GraphKind kind, const EngineChoice& choice, std::size_t release,
                 int compute_capability) {
  for (const VerifiedEngine& engine : kVerifiedEngines) {
    if (engine.kind == kind && choice.tag() == engine.tag && engine.release == release &&
        engine.compute_capability == compute_capability) {
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
    list +=
        fmt::format("{} on cuDNN {}.{}.{} sm_{}", engine.tag, engine.release / kVersionMajorUnit,
                    (engine.release % kVersionMajorUnit) / kVersionMinorUnit,
                    engine.release % kVersionMinorUnit, engine.compute_capability);
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
