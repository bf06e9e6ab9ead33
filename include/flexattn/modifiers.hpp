// The catalogue of named modifiers shared by tests, benchmarks and the CLI. Each entry is text in
// the IR syntax plus the extra tensors it reads, so every client builds exactly the same problem.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "flexattn/export.hpp"
#include "flexattn/problem.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn {

// The problem sizes a catalogue tensor's shape and contents may depend on.
struct CatalogueDims {
  std::int64_t batch = 1, heads_q = 1, seq_len_q = 1, seq_len_kv = 1;
};

struct CatalogueTensor {
  std::string name;
  DType dtype = DType::kF32;
  enum class Contents {
    kNormal,         // N(0, 1) values (learned biases, gates, relative-bias tables)
    kAlibiSlopes,    // (heads_q,) 2^(-8 (h + 1) / heads_q)
    kDocumentIds,    // (seq_len,) non-decreasing document ids, a few documents of varied length
  } contents = Contents::kNormal;
};

struct FLEXATTN_API NamedModifier {
  std::string name;         // "softcap", "alibi", "causal", ...
  std::string description;  // one line
  std::string score_mod;    // IR text; empty for none
  std::string mask_mod;     // IR text; empty for none
  std::vector<CatalogueTensor> tensors;

  // Shapes of the tensors for these dims, in the order of `tensors`.
  std::vector<std::int64_t> tensor_shape(const CatalogueTensor& tensor,
                                         const CatalogueDims& dims) const;
};

// softcap (30), alibi, relative_bias (T5 buckets), post_scale_bias, causal (top-left),
// causal_bottom_right, sliding_window (window 256), document_mask, prefix_lm (prefix 128), and
// the combinations used by the demo and benchmarks (e.g. softcap_causal).
FLEXATTN_API const std::vector<NamedModifier>& modifier_catalogue();
// Throws Error(kInvalidArgument) listing the known names.
FLEXATTN_API const NamedModifier& find_modifier(std::string_view name);

// Fills `tensor` (allocated with the shape above) for `dims`, deterministically from `seed`.
FLEXATTN_API HostTensor make_catalogue_tensor(const NamedModifier& modifier,
                                              const CatalogueTensor& tensor,
                                              const CatalogueDims& dims, std::uint64_t seed);

// Adds the modifier's expressions and tensor declarations to `desc` (parsing with desc.scope()).
FLEXATTN_API void apply_modifier(const NamedModifier& modifier, ProblemDesc& desc);

}  // namespace flexattn
