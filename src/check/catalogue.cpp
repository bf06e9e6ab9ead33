// The catalogue of conformance cases: which modifiers, masks, layouts, dtypes and shapes each
// tier covers, and how a case becomes a concrete problem with deterministic tensor contents.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flexattn/conformance.hpp"
#include "flexattn/error.hpp"
#include "flexattn/expr.hpp"

namespace flexattn::conformance {
namespace {

struct ModifierSpec {
  const char* name;
  const char* text;  // IR text; empty for the identity
};

struct TensorSpec {
  const char* name;
  enum class Contents { kNormal, kSlopes, kDocumentsOfQuery, kDocumentsOfKey } contents;
};

// Score modifiers: every kind of IR feature a user writes (transcendental, tensor loads of several
// ranks, index arithmetic, piecewise definitions, -inf results).
constexpr ModifierSpec kScoreMods[] = {
    {"none", ""},
    {"softcap30", "30 * tanh(score / 30)"},
    {"softcap5", "5 * tanh(score / 5)"},
    {"softcap08", "0.8 * tanh(score / 0.8)"},
    {"bias", "score + bias[h, q, kv]"},
    {"alibi", "score + slopes[h] * (kv - q)"},
    {"relbias", "score + rel[h, clamp(kv - q + 64, 0, 128)]"},
    {"gate", "score * sigmoid(gate[h])"},
    {"piecewise", "where(score > 0, score * 0.5, score * 2 + 0.25 * float(kv % 3))"},
    {"neginf", "where(kv % 5 == 3, -inf, score)"},
    // Parameters computed from indices, non-linear score terms, tensor gradients whose derivative
    // is a leaf (the score itself, the literal 1) and products of two loads.
    {"alibihead", "score + float(kv - q) * exp2(-float(h + 1))"},
    {"logindex", "score + log(float(kv + 1)) * sqrt(float(h + 1)) * 0.5"},
    {"square", "score * score * 0.25"},
    {"swish", "score * sigmoid(score)"},
    {"reciprocal", "1 / score"},  // q and k shifted so every score is about 8 (query_key_mean)
    {"gain", "score * g[h]"},
    {"keybias", "score + gk[h, kv]"},
    {"keyonly", "gk[h, kv]"},
    {"twoloads", "score + bias[h, q, kv] * gk[h, kv]"},
};

// Masks: none, the common structured ones, one from integer tensors, and one that empties rows.
constexpr ModifierSpec kMasks[] = {
    {"none", ""},
    {"causal", "q >= kv"},
    {"causalbr", "q + (KV_LEN - Q_LEN) >= kv"},
    {"window", "q >= kv && q - kv < 24"},
    {"document", "docq[q] == dockv[kv]"},
    {"prefix", "kv < 8 || q >= kv"},
    {"emptyrows", "q % 4 != 1 && kv <= q + 3"},
};

const ModifierSpec& find_spec(std::string_view name, const auto& table) {
  for (const ModifierSpec& spec : table) {
    if (name == spec.name) return spec;
  }
  throw_invalid(fmt::format("unknown conformance modifier or mask '{}'", name));
}

// Documents of a few, uneven lengths laid over [0, length): position -> document id.
constexpr std::int64_t kDocuments = 3;
std::int64_t document_of(std::int64_t position, std::int64_t length) {
  // Boundaries at 1/5 and 3/5 of the sequence, so the documents differ in length.
  const std::int64_t first_end = length / 5;
  const std::int64_t second_end = (3 * length) / 5;
  if (position < first_end) return 0;
  if (position < second_end) return 1;
  return kDocuments - 1;
}

std::string shape_name(const Case& c) {
  return fmt::format("{}_{}_b{}_hq{}_hkv{}_sq{}_skv{}_d{}{}{}", to_string(c.dtype),
                     to_string(c.layout), c.shape.batch, c.shape.heads_q, c.shape.heads_kv,
                     c.shape.seq_len_q, c.shape.seq_len_kv, c.shape.head_dim_qk,
                     c.shape.head_dim_v == c.shape.head_dim_qk
                         ? std::string()
                         : fmt::format("_dv{}", c.shape.head_dim_v),
                     c.page_size > 0 ? fmt::format("_paged{}", c.page_size) : std::string());
}

Case make_case(const Shape& shape, Layout layout, DType dtype, std::string modifier,
               std::string mask, bool backward) {
  Case c;
  c.shape = shape;
  c.layout = layout;
  c.dtype = dtype;
  c.modifier = std::move(modifier);
  c.mask = std::move(mask);
  c.backward = backward;
  c.name = fmt::format("{}/{}_{}{}", shape_name(c), c.modifier, c.mask, backward ? "_bwd" : "");
  return c;
}

constexpr Layout kLayouts[] = {Layout::kBSHD, Layout::kSBHD, Layout::kBHSD, Layout::kTHD};
constexpr DType kDtypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// Shapes: odd lengths (1, 17, 100, 577), seq_len_q != seq_len_kv, head dims 64/80/96/128/256
// and 192 with a 128-wide V (DeepSeek's MLA), head_dim_v != head_dim_qk, GQA ratios 1 and 4, and
// MQA.
std::vector<Shape> shape_sweep(Tier tier) {
  std::vector<Shape> shapes = {
      {1, 2, 2, 1, 1, 64, 64},       {2, 4, 4, 17, 17, 64, 64},     {1, 4, 1, 17, 100, 64, 64},
      {1, 4, 4, 100, 17, 80, 80},    {1, 8, 2, 100, 100, 128, 128}, {1, 2, 2, 64, 64, 256, 256},
      {1, 4, 2, 33, 47, 64, 80},     {1, 1, 1, 577, 577, 64, 64},   {1, 4, 1, 1, 577, 128, 128},
      {1, 4, 2, 100, 100, 192, 128},
  };
  if (tier == Tier::kFull) {
    const std::vector<Shape> more = {
        {2, 8, 2, 577, 577, 80, 80},  {2, 4, 4, 100, 577, 256, 256}, {1, 16, 4, 577, 100, 64, 64},
        {3, 6, 3, 17, 17, 128, 64},   {2, 8, 1, 100, 100, 256, 128}, {1, 4, 4, 77, 77, 96, 96},
        {2, 4, 2, 129, 65, 192, 128},
    };
    shapes.insert(shapes.end(), more.begin(), more.end());
  }
  return shapes;
}

}  // namespace

// A forward case against a paged KV cache (Case::page_size).
Case paged_case(const Shape& shape, Layout layout, DType dtype, std::string modifier,
                std::string mask, std::int64_t page_size) {
  Case c = make_case(shape, layout, dtype, std::move(modifier), std::move(mask), false);
  c.page_size = page_size;
  c.name = fmt::format("{}/{}_{}", shape_name(c), c.modifier, c.mask);
  return c;
}

Case custom_case(const Shape& shape, Layout layout, DType dtype, std::string score_mod,
                 std::string mask, bool backward) {
  Case c = make_case(shape, layout, dtype, "custom", std::move(mask), backward);
  c.custom_score_mod = std::move(score_mod);
  c.prove_discriminating = false;
  return c;
}

Tier parse_tier(std::string_view text) {
  if (text == "quick") return Tier::kQuick;
  if (text == "full") return Tier::kFull;
  if (text == "non-finite") return Tier::kNonFinite;
  throw_invalid(fmt::format("unknown tier '{}' (expected quick, full or non-finite)", text));
}

std::string_view to_string(Planted planted) {
  switch (planted) {
    case Planted::kNone:
      return "none";
    case Planted::kNanValue:
      return "nanv";
    case Planted::kInfKey:
      return "infk";
    case Planted::kNanQuery:
      return "nanq";
    case Planted::kNanOutputGradient:
      return "nando";
  }
  return "?";
}

std::string_view to_string(Status status) {
  switch (status) {
    case Status::kPass:
      return "pass";
    case Status::kFail:
      return "FAIL";
    case Status::kSkipped:
      return "skipped";
  }
  return "?";
}

namespace {

// The non-finite tier: each planted value under masks that remove the planted key for some
// queries (causal, sliding window, documents) and under a modifier that gives -inf instead of a
// mask, in every storage dtype, forward and backward (dO only backward); the backward at head
// dims 256 and 192/128 (softcap, causal: the GPU's kernels for the widest heads); and decoding
// and chunked prefill against a paged cache, with the planted key hidden from the new tokens by
// a sliding window or kept by ALiBi alone.
std::vector<Case> non_finite_cases() {
  const Shape shape{1, 4, 2, 100, 100, 64, 64};
  std::vector<Case> result;
  for (DType dtype : kDtypes) {
    std::vector<Case> bases;
    for (const auto& [modifier, mask] :
         std::vector<std::pair<const char*, const char*>>{{"none", "causal"},
                                                          {"softcap30", "causal"},
                                                          {"alibi", "window"},
                                                          {"bias", "document"}}) {
      bases.push_back(make_case(shape, Layout::kBSHD, dtype, modifier, mask, false));
    }
    Case minus_infinity =
        custom_case(shape, Layout::kBSHD, dtype, "where(kv > q, -inf, score)", "none", false);
    bases.push_back(minus_infinity);
    for (const Case& base : bases) {
      for (bool backward : {false, true}) {
        for (Planted planted : {Planted::kNanValue, Planted::kInfKey, Planted::kNanQuery,
                                Planted::kNanOutputGradient}) {
          if (planted == Planted::kNanOutputGradient && !backward) continue;
          Case c = base;
          c.backward = backward;
          c.planted = planted;
          c.name = fmt::format("{}/{}_{}_{}{}", shape_name(c),
                               c.modifier == "custom" ? "neginfcausal" : c.modifier, c.mask,
                               to_string(planted), backward ? "_bwd" : "");
          result.push_back(std::move(c));
        }
      }
    }
    for (const Shape& wide :
         {Shape{1, 4, 2, 100, 100, 256, 256}, Shape{1, 4, 2, 100, 100, 192, 128}}) {
      for (Planted planted : {Planted::kNanValue, Planted::kInfKey, Planted::kNanQuery,
                              Planted::kNanOutputGradient}) {
        Case c = make_case(wide, Layout::kBSHD, dtype, "softcap30", "causal", false);
        c.backward = true;
        c.planted = planted;
        c.name =
            fmt::format("{}/{}_{}_{}_bwd", shape_name(c), c.modifier, c.mask, to_string(planted));
        result.push_back(std::move(c));
      }
    }
    // Decoding, and chunked prefill of 130 new tokens at head dim 128 (on sm_90 the wgmma
    // forward over the cache). The window hides the planted key (2 kv / 5) from the new tokens;
    // in the prefill it still lies in a tile the first query block visits (key 160, queries from
    // 270), so the tensor-core product takes 0 times the NaN and the block's rows are recomputed
    // through the page table.
    const Shape decode{4, 8, 2, 1, 300, 64, 64};
    const Shape prefill{2, 4, 2, 130, 400, 128, 128};
    for (const Shape& paged : {decode, prefill}) {
      for (const auto& [modifier, mask] : std::vector<std::pair<const char*, const char*>>{
               {"softcap30", "window"}, {"alibi", "none"}}) {
        for (Planted planted : {Planted::kNanValue, Planted::kInfKey, Planted::kNanQuery}) {
          Case c = paged_case(paged, Layout::kBSHD, dtype, modifier, mask, 16);
          c.planted = planted;
          c.name =
              fmt::format("{}/{}_{}_{}", shape_name(c), c.modifier, c.mask, to_string(planted));
          result.push_back(std::move(c));
        }
      }
    }
  }
  return result;
}

}  // namespace

std::vector<Case> cases(Tier tier) {
  if (tier == Tier::kNonFinite) return non_finite_cases();
  std::vector<Case> result;
  const Shape base{2, 4, 2, 100, 100, 64, 64};  // GQA 2:1, a length no tile size divides

  // 1. Every modifier with every mask: forward; backward for each modifier with two masks
  //    (all of them in the full tier).
  for (const ModifierSpec& modifier : kScoreMods) {
    for (const ModifierSpec& mask : kMasks) {
      result.push_back(
          make_case(base, Layout::kBSHD, DType::kF32, modifier.name, mask.name, false));
      const bool quick_backward = std::string_view(mask.name) == "none" ||
                                  std::string_view(mask.name) == "causal" ||
                                  std::string_view(mask.name) == "emptyrows";
      if (tier == Tier::kFull || quick_backward) {
        result.push_back(
            make_case(base, Layout::kBSHD, DType::kF32, modifier.name, mask.name, true));
      }
    }
  }

  // 2. Every layout with every storage dtype, forward and backward.
  const Shape layout_shape{2, 4, 1, 33, 47, 64, 64};
  const std::vector<std::pair<std::string, std::string>> layout_mods =
      tier == Tier::kQuick
          ? std::vector<std::pair<std::string, std::string>>{{"softcap30", "causal"},
                                                             {"bias", "document"}}
          : std::vector<std::pair<std::string, std::string>>{
                {"softcap30", "causal"}, {"bias", "document"},  {"alibi", "window"},
                {"relbias", "prefix"},   {"gate", "emptyrows"}, {"neginf", "causalbr"}};
  for (Layout layout : kLayouts) {
    for (DType dtype : kDtypes) {
      for (const auto& [modifier, mask] : layout_mods) {
        result.push_back(make_case(layout_shape, layout, dtype, modifier, mask, false));
        result.push_back(make_case(layout_shape, layout, dtype, modifier, mask, true));
      }
    }
  }

  // 3. Every shape feature, in the low-precision dtypes GPU engines run.
  const std::vector<std::pair<std::string, std::string>> shape_mods =
      tier == Tier::kQuick
          ? std::vector<std::pair<std::string, std::string>>{{"alibi", "causalbr"}}
          : std::vector<std::pair<std::string, std::string>>{{"alibi", "causalbr"},
                                                             {"softcap30", "none"},
                                                             {"none", "causal"},
                                                             {"relbias", "window"}};
  for (const Shape& shape : shape_sweep(tier)) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      if (tier == Tier::kQuick && dtype == DType::kF16) continue;
      for (const auto& [modifier, mask] : shape_mods) {
        result.push_back(make_case(shape, Layout::kBSHD, dtype, modifier, mask, false));
        result.push_back(make_case(shape, Layout::kBSHD, dtype, modifier, mask, true));
      }
    }
  }
  // 4. The gradient catalogue: every score modifier above whose derivative or loads are
  //    non-trivial, forward and backward, at odd lengths (1, 17, 33, 129: padding rows and
  //    columns in every tile size) and at a tile multiple (128).
  const std::vector<std::pair<Shape, DType>> gradient_shapes = {
      {{1, 4, 2, 17, 33, 64, 64}, DType::kBF16},   {{1, 4, 2, 17, 33, 64, 64}, DType::kF32},
      {{1, 2, 2, 129, 129, 64, 64}, DType::kBF16}, {{1, 2, 1, 1, 33, 64, 64}, DType::kBF16},
      {{1, 2, 2, 128, 128, 64, 64}, DType::kF16},
  };
  for (const char* modifier : {"alibihead", "logindex", "square", "swish", "reciprocal", "gain",
                               "keybias", "keyonly", "twoloads"}) {
    for (const auto& [shape, dtype] : gradient_shapes) {
      if (tier == Tier::kQuick && dtype == DType::kF16 && std::string_view(modifier) != "square") {
        continue;
      }
      for (bool backward : {false, true}) {
        result.push_back(make_case(shape, Layout::kBSHD, dtype, modifier, "none", backward));
      }
    }
  }
  // 5. A paged KV cache: decoding (one or two new tokens per sequence, GQA up to 8:1) and chunked
  //    prefill (ragged thd chunks; 40-token chunks at GQA 4:1, 160 packed rows per kv head, which
  //    the cuda engine takes 64 at a time; chunks of 130 and 200 tokens, which it takes 128 at a
  //    time on sm_90's wgmma forward), page sizes 1, 16 and 64, lengths from the query count to the
  //    capacity and an empty slot, in every storage dtype; long caches whose keys are split.
  const Shape decode{4, 8, 1, 1, 300, 64, 64}, decode2{4, 4, 2, 2, 129, 128, 128};
  const Shape prefill{3, 4, 4, 37, 200, 64, 64}, prefill_gqa{2, 8, 2, 40, 700, 128, 128};
  const Shape prefill_long{4, 4, 2, 130, 400, 128, 128}, prefill_long64{2, 2, 1, 200, 500, 64, 64};
  const std::vector<std::pair<std::string, std::string>> paged_mods =
      tier == Tier::kQuick
          ? std::vector<std::pair<std::string, std::string>>{{"softcap30", "causal"},
                                                             {"alibi", "window"},
                                                             {"bias", "document"}}
          : std::vector<std::pair<std::string, std::string>>{
                {"softcap30", "causal"}, {"alibi", "window"},   {"bias", "document"},
                {"alibihead", "none"},   {"relbias", "prefix"}, {"neginf", "emptyrows"}};
  for (const auto& [modifier, mask] : paged_mods) {
    for (DType dtype : kDtypes) {
      if (tier == Tier::kQuick && dtype == DType::kF16) continue;
      // One new token sits after every key: a causal mask keeps them all (nothing to check).
      result.push_back(paged_case(decode, Layout::kBSHD, dtype, modifier,
                                  mask == "causal" ? "window" : mask, 16));
      result.push_back(paged_case(prefill, Layout::kTHD, dtype, modifier, mask, 64));
    }
    result.push_back(paged_case(decode2, Layout::kBSHD, DType::kBF16, modifier, mask, 1));
    result.push_back(paged_case(prefill_gqa, Layout::kBSHD, DType::kBF16, modifier, mask, 16));
    result.push_back(paged_case(prefill_long, Layout::kBSHD, DType::kBF16, modifier, mask, 16));
    result.push_back(paged_case(prefill_long64, Layout::kBSHD, DType::kF16, modifier, mask, 64));
  }
  // Caches long enough that the cpu engine splits their keys (2048 per split): a full one, a
  // half-full one, a one-token one and an empty slot; a window leaves the first splits empty.
  const Shape long_decode{4, 8, 2, 1, 4500, 64, 64};
  for (const auto& [modifier, mask] : std::vector<std::pair<std::string, std::string>>{
           {"softcap30", "window"}, {"alibi", "none"}}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      result.push_back(paged_case(long_decode, Layout::kBSHD, dtype, modifier, mask, 16));
    }
  }
  return result;
}

namespace {

std::vector<TensorSpec> tensors_of(std::string_view modifier, std::string_view mask) {
  std::vector<TensorSpec> tensors;
  if (modifier == "bias" || modifier == "custom" || modifier == "twoloads") {
    tensors.push_back({"bias", TensorSpec::Contents::kNormal});
  }
  if (modifier == "alibi" || modifier == "custom") {
    tensors.push_back({"slopes", TensorSpec::Contents::kSlopes});
  }
  if (modifier == "relbias") tensors.push_back({"rel", TensorSpec::Contents::kNormal});
  if (modifier == "gate") tensors.push_back({"gate", TensorSpec::Contents::kNormal});
  if (modifier == "gain") tensors.push_back({"g", TensorSpec::Contents::kNormal});
  if (modifier == "keybias" || modifier == "keyonly" || modifier == "twoloads") {
    tensors.push_back({"gk", TensorSpec::Contents::kNormal});
  }
  if (mask == "document") {
    tensors.push_back({"docq", TensorSpec::Contents::kDocumentsOfQuery});
    tensors.push_back({"dockv", TensorSpec::Contents::kDocumentsOfKey});
  }
  return tensors;
}

std::vector<std::int64_t> tensor_shape(std::string_view name, const Shape& s) {
  if (name == "bias") return {s.heads_q, s.seq_len_q, s.seq_len_kv};
  if (name == "slopes" || name == "gate" || name == "g") return {s.heads_q};
  if (name == "gk") return {s.heads_q, s.seq_len_kv};
  if (name == "rel") return {s.heads_q, 129};  // 129 buckets: clamp(kv - q + 64, 0, 128)
  if (name == "docq") return {s.seq_len_q};
  if (name == "dockv") return {s.seq_len_kv};
  throw_internal(fmt::format("no shape rule for conformance tensor '{}'", name));
}

// thd packs sequences of different lengths: entry b has length max(1, len - 3 b), so the batch
// is ragged and the longest sequence is the nominal length.
std::vector<std::int64_t> ragged_offsets(std::int64_t batch, std::int64_t length) {
  constexpr std::int64_t kShrinkPerEntry = 3;
  std::vector<std::int64_t> offsets{0};
  for (std::int64_t b = 0; b < batch; ++b) {
    offsets.push_back(offsets.back() + std::max<std::int64_t>(1, length - kShrinkPerEntry * b));
  }
  return offsets;
}

}  // namespace

namespace {

// Makes instance.desc a paged KV cache problem (Case::page_size) and fills its page table and
// lengths; `tensor_dims` gets the capacity as both lengths.
void paged_cache(const Case& c, std::uint64_t seed, Instance& instance, Shape& tensor_dims) {
  ProblemDesc& desc = instance.desc;
  const std::int64_t page_size = c.page_size;
  const std::int64_t max_pages = (c.shape.seq_len_kv + page_size - 1) / page_size;
  const std::int64_t capacity = max_pages * page_size;
  constexpr std::int64_t kSparePages = 3;
  const std::int64_t pages = c.shape.batch * max_pages + kSparePages;
  desc.kv_cache = KvCacheDesc{pages, page_size, max_pages};
  desc.seq_len_kv = 0;
  tensor_dims.seq_len_q = tensor_dims.seq_len_kv = capacity;

  std::vector<std::int32_t> order(static_cast<std::size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed * 7919u + 5u));
  instance.page_table = HostTensor(DType::kI32, {c.shape.batch, max_pages});
  instance.cache_lens = HostTensor(DType::kI32, {c.shape.batch});
  std::size_t next = 0;
  for (std::int64_t b = 0; b < c.shape.batch; ++b) {
    const std::int64_t q_len = c.layout == Layout::kTHD
                                   ? desc.cu_seqlens_q[static_cast<std::size_t>(b + 1)] -
                                         desc.cu_seqlens_q[static_cast<std::size_t>(b)]
                                   : c.shape.seq_len_q;
    constexpr std::int64_t kPatterns = 4;
    std::int64_t length = 0;
    switch (b % kPatterns) {
      case 0:
        length = capacity;
        break;
      case 1:
        length = q_len;
        break;
      case 2:
        length = (q_len + capacity) / 2;
        break;
      default:
        length = 0;  // an empty slot
        break;
    }
    instance.cache_lens.set(b, static_cast<double>(length));
    const std::int64_t used = (length + page_size - 1) / page_size;
    for (std::int64_t j = 0; j < max_pages; ++j) {
      instance.page_table.set(b * max_pages + j, j < used ? order[next++] : -1);
    }
  }
}

}  // namespace

Instance instantiate(const Case& c, Device device, std::uint64_t seed) {
  Instance instance;
  ProblemDesc& desc = instance.desc;
  desc.batch = c.shape.batch;
  desc.heads_q = c.shape.heads_q;
  desc.heads_kv = c.shape.heads_kv;
  desc.seq_len_q = c.shape.seq_len_q;
  desc.seq_len_kv = c.shape.seq_len_kv;
  desc.head_dim_qk = c.shape.head_dim_qk;
  desc.head_dim_v = c.shape.head_dim_v;
  desc.layout = c.layout;
  desc.dtype = c.dtype;
  desc.direction = c.backward ? Direction::kForwardBackward : Direction::kForward;
  desc.device = device;
  if (c.layout == Layout::kTHD) {
    desc.cu_seqlens_q = ragged_offsets(c.shape.batch, c.shape.seq_len_q);
    if (c.page_size == 0) desc.cu_seqlens_kv = ragged_offsets(c.shape.batch, c.shape.seq_len_kv);
  }
  // A paged case's tensors are indexed by positions: the queries' too reach the capacity.
  Shape tensor_dims = c.shape;
  if (c.page_size > 0) paged_cache(c, seed, instance, tensor_dims);

  std::uint64_t tensor_seed = seed * 1000003u + 17u;
  for (const TensorSpec& spec : tensors_of(c.modifier, c.mask)) {
    const std::vector<std::int64_t> shape = tensor_shape(spec.name, tensor_dims);
    const bool is_index = spec.contents == TensorSpec::Contents::kDocumentsOfQuery ||
                          spec.contents == TensorSpec::Contents::kDocumentsOfKey;
    HostTensor tensor(is_index ? DType::kI32 : DType::kF32, shape);
    switch (spec.contents) {
      case TensorSpec::Contents::kNormal:
        tensor.fill_normal(tensor_seed++);
        break;
      case TensorSpec::Contents::kSlopes:
        for (std::int64_t h = 0; h < shape[0]; ++h) {
          tensor.set(h,
                     std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(shape[0])));
        }
        break;
      case TensorSpec::Contents::kDocumentsOfQuery:
      case TensorSpec::Contents::kDocumentsOfKey:
        for (std::int64_t i = 0; i < shape[0]; ++i) {
          tensor.set(i, static_cast<double>(document_of(i, shape[0])));
        }
        break;
    }
    desc.tensors[spec.name] = TensorDecl{tensor.dtype(), shape};
    instance.tensors.emplace(spec.name, std::move(tensor));
  }

  const ir::Scope scope = desc.scope();
  const ModifierSpec& mask = find_spec(c.mask, kMasks);
  if (c.modifier == "custom") {
    desc.score_mod = ir::parse(c.custom_score_mod, scope);
  } else if (const ModifierSpec& modifier = find_spec(c.modifier, kScoreMods);
             *modifier.text != '\0') {
    desc.score_mod = ir::parse(modifier.text, scope);
  }
  if (*mask.text != '\0') desc.mask_mod = ir::parse(mask.text, scope);
  // 1 / score on scores bounded away from 0: q and k entries about 1, so a score at head dim 64
  // is about 8 (the padding rows' dummy score 0 is where the modifier is infinite).
  if (c.modifier == "reciprocal") {
    instance.query_key_mean = 1.0;
    instance.query_key_stddev = 0.5;
  }
  // Softcap 30 on scores of about 1 moves them by ~1e-4, invisible in bf16 (the case would not
  // discriminate): q and k entries of standard deviation 4 give scores of about 16, where
  // 30 * tanh(score / 30) is far from the identity and its derivative far from 1.
  if (c.modifier == "softcap30") instance.query_key_stddev = 4.0;
  return instance;
}

}  // namespace flexattn::conformance
