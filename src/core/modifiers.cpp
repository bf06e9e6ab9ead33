// The catalogue of named modifiers and the deterministic contents of their tensors.
#include "flexattn/modifiers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "flexattn/error.hpp"

namespace flexattn {

namespace {

using Contents = CatalogueTensor::Contents;

// T5-style relative bias: offsets kv - q are clamped to [-64, 64], i.e. 129 buckets.
constexpr std::int64_t kRelativeBuckets = 129;
// ALiBi slope base: 2^(-8 (h + 1) / heads), as in Press et al.
constexpr double kAlibiExponent = 8.0;
// Document masks: documents are on average a quarter of the sequence ("a few documents").
constexpr std::int64_t kDocumentsPerSequence = 4;

std::vector<NamedModifier> build_catalogue() {
  const CatalogueTensor slopes{"slopes", DType::kF32, Contents::kAlibiSlopes};
  const CatalogueTensor rel{"rel", DType::kF32, Contents::kNormal};
  const CatalogueTensor bias{"bias", DType::kF32, Contents::kNormal};
  const CatalogueTensor gate{"gate", DType::kF32, Contents::kNormal};
  const CatalogueTensor doc{"doc", DType::kI32, Contents::kDocumentIds};
  const std::string softcap = "30 * tanh(score / 30)";
  const std::string causal = "q >= kv";
  return {
      {"softcap", "Gemma-2 logit softcapping at 30", softcap, "", {}},
      {"alibi",
       "ALiBi linear position bias, per-head slopes",
       "score + slopes[h] * (kv - q)",
       "",
       {slopes}},
      {"relative_bias",
       "T5-style bucketed relative position bias (129 buckets)",
       "score + rel[h, clamp(kv - q + 64, 0, 128)]",
       "",
       {rel}},
      {"post_scale_bias",
       "learned additive bias after scaling",
       "score + bias[h, q, kv]",
       "",
       {bias}},
      {"head_gate", "learned per-head gate on the scores", "score * sigmoid(gate[h])", "", {gate}},
      {"causal", "causal mask aligned to the top left", "", causal, {}},
      {"causal_bottom_right",
       "causal mask aligned to the bottom right",
       "",
       "q + (KV_LEN - Q_LEN) >= kv",
       {}},
      {"sliding_window", "causal sliding window of 256 keys", "", "q >= kv && q - kv < 256", {}},
      {"document_mask",
       "causal attention inside each packed document",
       "",
       "doc[q] == doc[kv] && q >= kv",
       {doc}},
      {"prefix_lm",
       "bidirectional prefix of 128 keys, causal after it",
       "",
       "kv < 128 || q >= kv",
       {}},
      {"softcap_causal", "softcap 30 with a causal mask (the demo default)", softcap, causal, {}},
      {"alibi_causal",
       "ALiBi with a causal mask",
       "score + slopes[h] * (kv - q)",
       causal,
       {slopes}},
  };
}

// FNV-1a, so each tensor of a modifier gets its own stream from one seed.
std::uint64_t name_hash(std::string_view name) {
  constexpr std::uint64_t kOffsetBasis = 0xcbf29ce484222325ull;
  constexpr std::uint64_t kPrime = 0x100000001b3ull;
  std::uint64_t hash = kOffsetBasis;
  for (char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * kPrime;
  return hash;
}

std::uint64_t splitmix64(std::uint64_t& state) {
  state += 0x9e3779b97f4a7c15ull;
  std::uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The longest thd sequence, or the padded length.
std::int64_t resolved_length(std::int64_t length, const std::vector<std::int64_t>& offsets) {
  if (length != 0 || offsets.size() < 2) return length;
  std::int64_t longest = 0;
  for (std::size_t i = 1; i < offsets.size(); ++i) {
    longest = std::max(longest, offsets[i] - offsets[i - 1]);
  }
  return longest;
}

}  // namespace

std::vector<std::int64_t> NamedModifier::tensor_shape(const CatalogueTensor& tensor,
                                                      const CatalogueDims& dims) const {
  if (tensor.name == "slopes" || tensor.name == "gate") return {dims.heads_q};
  if (tensor.name == "rel") return {dims.heads_q, kRelativeBuckets};
  if (tensor.name == "bias") return {dims.heads_q, dims.seq_len_q, dims.seq_len_kv};
  if (tensor.name == "doc") return {dims.seq_len_q};
  throw_internal(fmt::format("modifier '{}': no shape rule for tensor '{}'", name, tensor.name));
}

const std::vector<NamedModifier>& modifier_catalogue() {
  static const std::vector<NamedModifier> catalogue = build_catalogue();
  return catalogue;
}

const NamedModifier& find_modifier(std::string_view name) {
  std::string known;
  for (const NamedModifier& modifier : modifier_catalogue()) {
    if (modifier.name == name) return modifier;
    known += (known.empty() ? "" : ", ") + modifier.name;
  }
  throw_invalid(fmt::format("unknown modifier '{}' (known: {})", name, known));
}

HostTensor make_catalogue_tensor(const NamedModifier& modifier, const CatalogueTensor& tensor,
                                 const CatalogueDims& dims, std::uint64_t seed) {
  HostTensor result(tensor.dtype, modifier.tensor_shape(tensor, dims));
  std::uint64_t state = seed ^ name_hash(tensor.name);
  switch (tensor.contents) {
    case Contents::kNormal:
      result.fill_normal(splitmix64(state));
      break;
    case Contents::kAlibiSlopes:
      for (std::int64_t h = 0; h < result.numel(); ++h) {
        result.set(h, std::exp2(-kAlibiExponent * static_cast<double>(h + 1) /
                                static_cast<double>(result.numel())));
      }
      break;
    case Contents::kDocumentIds: {
      // Consecutive documents of random length in [1, 2 * length / kDocumentsPerSequence].
      const std::int64_t length = result.numel();
      const auto longest =
          static_cast<std::uint64_t>(std::max<std::int64_t>(1, 2 * length / kDocumentsPerSequence));
      std::int64_t position = 0;
      for (std::int64_t document = 0; position < length; ++document) {
        const auto size = static_cast<std::int64_t>(1 + splitmix64(state) % longest);
        for (std::int64_t i = 0; i < size && position < length; ++i, ++position) {
          result.set(position, static_cast<double>(document));
        }
      }
      break;
    }
  }
  return result;
}

void apply_modifier(const NamedModifier& modifier, ProblemDesc& desc) {
  CatalogueDims dims;
  dims.batch = desc.batch;
  dims.heads_q = desc.heads_q;
  dims.seq_len_q = resolved_length(desc.seq_len_q, desc.cu_seqlens_q);
  dims.seq_len_kv = resolved_length(
      desc.seq_len_kv, desc.cu_seqlens_kv.empty() ? desc.cu_seqlens_q : desc.cu_seqlens_kv);
  if (dims.seq_len_kv == 0) dims.seq_len_kv = dims.seq_len_q;
  for (const CatalogueTensor& tensor : modifier.tensors) {
    if (tensor.contents == Contents::kDocumentIds && dims.seq_len_q != dims.seq_len_kv) {
      throw_invalid(fmt::format("modifier '{}' needs seq_len_q == seq_len_kv (got {} and {})",
                                modifier.name, dims.seq_len_q, dims.seq_len_kv));
    }
    desc.tensors[tensor.name] = TensorDecl{tensor.dtype, modifier.tensor_shape(tensor, dims)};
  }
  const ir::Scope scope = desc.scope();
  if (!modifier.score_mod.empty()) desc.score_mod = ir::parse(modifier.score_mod, scope);
  if (!modifier.mask_mod.empty()) desc.mask_mod = ir::parse(modifier.mask_mod, scope);
}

}  // namespace flexattn
