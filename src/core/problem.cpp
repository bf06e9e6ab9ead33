// Problem validation, canonicalisation of the modifiers, expected views and the signature.
#include "flexattn/problem.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>

#include "core/checked_size.hpp"
#include "flexattn/error.hpp"

namespace flexattn {

namespace {

constexpr std::array kAllLayouts = {Layout::kBSHD, Layout::kSBHD, Layout::kBHSD, Layout::kTHD};

int view_rank(Layout layout) { return layout == Layout::kTHD ? 3 : 4; }

void require_positive(std::int64_t value, const char* name) {
  if (value <= 0) throw_invalid(fmt::format("{} ({}) must be positive", name, value));
}

// Checks thd offsets and returns the longest sequence.
std::int64_t check_offsets(const std::vector<std::int64_t>& offsets, std::int64_t batch,
                           const char* name) {
  if (static_cast<std::int64_t>(offsets.size()) != batch + 1) {
    throw_invalid(fmt::format("{} has {} entries; thd needs batch + 1 = {}", name, offsets.size(),
                              batch + 1));
  }
  if (offsets.front() != 0) {
    throw_invalid(fmt::format("{} must start at 0, not {}", name, offsets.front()));
  }
  std::int64_t longest = 0;
  for (std::size_t i = 1; i < offsets.size(); ++i) {
    if (offsets[i] < offsets[i - 1]) {
      throw_invalid(fmt::format("{} must be non-decreasing: entry {} ({}) < entry {} ({})", name, i,
                                offsets[i], i - 1, offsets[i - 1]));
    }
    longest = std::max(longest, offsets[i] - offsets[i - 1]);
  }
  return longest;
}

std::int64_t shortest_sequence(const std::vector<std::int64_t>& offsets) {
  std::int64_t shortest = offsets[1] - offsets[0];
  for (std::size_t i = 1; i < offsets.size(); ++i) {
    shortest = std::min(shortest, offsets[i] - offsets[i - 1]);
  }
  return shortest;
}

// `pool`: K or V of a KV cache, (pages, page_size, heads_kv, head_dim) in any layout.
void check_strides(const std::optional<std::vector<std::int64_t>>& strides, Layout layout,
                   const char* name, bool pool = false) {
  if (!strides) return;
  const int rank = pool ? 4 : view_rank(layout);
  if (static_cast<int>(strides->size()) != rank) {
    throw_invalid(fmt::format(
        "{} has {} entries; {} needs {}", name, strides->size(),
        pool ? std::string("a KV cache pool") : fmt::format("layout {}", to_string(layout)), rank));
  }
  if (strides->back() != 1) {
    throw_invalid(
        fmt::format("{} [{}]: the last stride must be 1", name, fmt::join(*strides, ", ")));
  }
  for (std::int64_t stride : *strides) {
    if (stride < 0) {
      throw_invalid(
          fmt::format("{} [{}]: strides must not be negative", name, fmt::join(*strides, ", ")));
    }
  }
}

Type element_type_of(DType dtype) { return is_floating(dtype) ? Type::kF32 : Type::kI32; }

// Every tensor load and parameter of `graph` must be declared, with matching rank and kind.
void check_names(const Graph& graph, const ProblemDesc& desc, const char* which) {
  for (const GraphNode& node : graph.nodes()) {
    if (node.op == Op::kParam && !desc.params.contains(node.name)) {
      throw_invalid(fmt::format("{} uses parameter '{}' but no value is given", which, node.name));
    }
    if (node.op != Op::kLoad) continue;
    const auto found = desc.tensors.find(node.name);
    if (found == desc.tensors.end()) {
      throw_invalid(fmt::format("{} loads tensor '{}' which is not declared", which, node.name));
    }
    const TensorDecl& decl = found->second;
    if (decl.shape.size() != node.args.size()) {
      throw_invalid(fmt::format("{} loads '{}' with {} indices but it is declared with rank {}",
                                which, node.name, node.args.size(), decl.shape.size()));
    }
    if (element_type_of(decl.dtype) != node.type) {
      throw_invalid(fmt::format("{} loads '{}' as {} but it is declared {}", which, node.name,
                                to_string(node.type), to_string(decl.dtype)));
    }
  }
}

// The IR reads b, h, q, kv, Q_LEN and KV_LEN as i32, so the dimensions they index fit in it.
void require_index_range(std::int64_t value, const char* name) {
  constexpr std::int64_t kMaxIndexExtent = std::numeric_limits<std::int32_t>::max();
  if (value > kMaxIndexExtent) {
    throw_invalid(fmt::format("{} ({}) is past the modifiers' i32 indices (at most {})", name,
                              value, kMaxIndexExtent));
  }
}

// The bytes one of q, k, v, o holds, or its strided span where strides are given; Error naming
// the dimensions when past kMaxTensorBytes. `tokens` is thd's total token count.
std::int64_t sequence_tensor_bytes(const ProblemDesc& d, const char* which, const char* heads_name,
                                   std::int64_t heads, const char* seq_name, std::int64_t seq_len,
                                   std::int64_t tokens, const char* dim_name, std::int64_t head_dim,
                                   const std::optional<std::vector<std::int64_t>>& strides) {
  const std::size_t element_bytes = size_of(d.dtype);
  const bool pool =
      d.kv_cache && (std::string_view(which) == "k" || std::string_view(which) == "v");
  const std::vector<NamedExtent> extents =
      pool ? std::vector<NamedExtent>{{"pages", d.kv_cache->pages},
                                      {"page_size", d.kv_cache->page_size},
                                      {heads_name, heads},
                                      {dim_name, head_dim}}
      : d.layout == Layout::kTHD
          ? std::vector<NamedExtent>{{"tokens", tokens}, {heads_name, heads}, {dim_name, head_dim}}
          : std::vector<NamedExtent>{
                {"batch", d.batch}, {seq_name, seq_len}, {heads_name, heads}, {dim_name, head_dim}};
  const std::int64_t bytes = checked_tensor_bytes(which, extents, element_bytes);
  if (!strides) return bytes;
  // The span of a strided view: 1 + sum over axes of (extent - 1) * stride elements. Extents
  // are in the layout's order; the stride of each axis pairs with it (check_strides: same rank).
  std::vector<std::int64_t> shape;
  if (pool) {
    shape = {d.kv_cache->pages, d.kv_cache->page_size, heads, head_dim};
  } else {
    switch (d.layout) {
      case Layout::kBSHD:
        shape = {d.batch, seq_len, heads, head_dim};
        break;
      case Layout::kSBHD:
        shape = {seq_len, d.batch, heads, head_dim};
        break;
      case Layout::kBHSD:
        shape = {d.batch, heads, seq_len, head_dim};
        break;
      case Layout::kTHD:
        shape = {tokens, heads, head_dim};
        break;
    }
  }
  std::optional<std::int64_t> span = 1;
  for (std::size_t axis = 0; axis < shape.size() && span; ++axis) {
    const std::optional<std::int64_t> reach = checked_multiply(shape[axis] - 1, (*strides)[axis]);
    span = reach ? checked_add(*span, *reach) : std::nullopt;
  }
  if (span) span = checked_multiply(*span, static_cast<std::int64_t>(element_bytes));
  if (!span || *span > kMaxTensorBytes) {
    throw_invalid(
        fmt::format("{} strides [{}] span more than 2^48 bytes", which, fmt::join(*strides, ", ")));
  }
  return std::max(bytes, *span);
}

// Every tensor of the problem stays under kMaxTensorBytes; on the CPU, all of them together fit
// the host's memory. Runs before anything multiplies the sizes unchecked.
void check_sizes(const ProblemDesc& d) {
  for (const auto& [value, name] :
       {std::pair{d.batch, "batch"}, std::pair{d.heads_q, "heads_q"},
        std::pair{d.seq_len_q, "seq_len_q"}, std::pair{d.seq_len_kv, "seq_len_kv"}}) {
    require_index_range(value, name);
  }
  const bool thd = d.layout == Layout::kTHD;
  const std::int64_t tokens_q = thd ? d.cu_seqlens_q.back() : 0;
  const std::int64_t tokens_kv = thd && !d.kv_cache ? d.cu_seqlens_kv.back() : 0;
  const std::int64_t q =
      sequence_tensor_bytes(d, "q", "heads_q", d.heads_q, "seq_len_q", d.seq_len_q, tokens_q,
                            "head_dim_qk", d.head_dim_qk, d.q_strides);
  const std::int64_t k =
      sequence_tensor_bytes(d, "k", "heads_kv", d.heads_kv, "seq_len_kv", d.seq_len_kv, tokens_kv,
                            "head_dim_qk", d.head_dim_qk, d.k_strides);
  const std::int64_t v =
      sequence_tensor_bytes(d, "v", "heads_kv", d.heads_kv, "seq_len_kv", d.seq_len_kv, tokens_kv,
                            "head_dim_v", d.head_dim_v, d.v_strides);
  const std::int64_t o =
      sequence_tensor_bytes(d, "o", "heads_q", d.heads_q, "seq_len_q", d.seq_len_q, tokens_q,
                            "head_dim_v", d.head_dim_v, d.o_strides);
  const std::size_t lse_element_bytes = d.dtype == DType::kF64 ? sizeof(double) : sizeof(float);
  if (d.kv_cache) {  // the page table and the lengths
    checked_tensor_bytes("page_table", {{"batch", d.batch}, {"max_pages", d.kv_cache->max_pages}},
                         sizeof(std::int32_t));
  }
  const std::int64_t lse =
      thd ? checked_tensor_bytes("lse", {{"heads_q", d.heads_q}, {"tokens", tokens_q}},
                                 lse_element_bytes)
          : checked_tensor_bytes(
                "lse", {{"batch", d.batch}, {"heads_q", d.heads_q}, {"seq_len_q", d.seq_len_q}},
                lse_element_bytes);
  // Forward: q, k, v, o, lse. Backward adds dout, dq, dk, dv and a gradient per tensor.
  const int passes = d.direction == Direction::kForward ? 1 : 2;
  std::optional<std::int64_t> total = passes * (q + k + v + o) + lse;  // each below 2^48
  for (const auto& [name, decl] : d.tensors) {
    const std::int64_t bytes =
        checked_tensor_bytes(fmt::format("tensor '{}'", name), decl.shape, size_of(decl.dtype));
    if (total) total = checked_add(*total, passes * bytes);
  }
  if (d.device == Device::kCpu) {
    require_host_memory("the problem's tensors",
                        total.value_or(std::numeric_limits<std::int64_t>::max()));
  }
}

// A KV cache's geometry, before anything derives sizes from it: positive extents, a capacity the
// modifiers' i32 positions can index, forward only, bshd or thd queries that fit the capacity.
// Sets seq_len_kv to the capacity.
void check_kv_cache(ProblemDesc& d) {
  const KvCacheDesc& cache = *d.kv_cache;
  require_positive(cache.pages, "kv_cache.pages");
  require_positive(cache.page_size, "kv_cache.page_size");
  require_positive(cache.max_pages, "kv_cache.max_pages");
  if (d.layout != Layout::kBSHD && d.layout != Layout::kTHD) {
    throw_invalid(
        fmt::format("a KV cache takes queries in layout bshd or thd, not {}", to_string(d.layout)));
  }
  if (d.direction != Direction::kForward) {
    throw_invalid("a KV cache problem is forward only (no gradients through a cache)");
  }
  if (!d.cu_seqlens_kv.empty()) {
    throw_invalid(
        "a KV cache problem takes no cu_seqlens_kv: the run's cache_lens give the lengths");
  }
  const std::optional<std::int64_t> capacity = checked_multiply(cache.max_pages, cache.page_size);
  constexpr std::int64_t kMaxIndexExtent = std::numeric_limits<std::int32_t>::max();
  if (!capacity || *capacity > kMaxIndexExtent) {
    throw_invalid(fmt::format(
        "kv_cache capacity max_pages x page_size ({} x {}) is past the modifiers' i32 indices (at "
        "most {})",
        cache.max_pages, cache.page_size, kMaxIndexExtent));
  }
  if (d.seq_len_kv != 0 && d.seq_len_kv != *capacity) {
    throw_invalid(fmt::format(
        "seq_len_kv ({}) must be 0 or the KV cache's capacity max_pages x page_size ({})",
        d.seq_len_kv, *capacity));
  }
  d.seq_len_kv = *capacity;
  const std::int64_t longest_q =
      d.layout == Layout::kTHD && d.cu_seqlens_q.size() == static_cast<std::size_t>(d.batch + 1)
          ? check_offsets(d.cu_seqlens_q, d.batch, "cu_seqlens_q")
          : d.seq_len_q;
  if (longest_q > *capacity) {
    throw_invalid(fmt::format(
        "a sequence of {} query tokens does not fit the KV cache's capacity max_pages x page_size "
        "({}): the cache holds the new tokens' keys too",
        longest_q, *capacity));
  }
}

std::string describe_shape(const std::vector<std::int64_t>& values) {
  return fmt::format("[{}]", fmt::join(values, ","));
}

}  // namespace

std::string_view to_string(Layout layout) {
  switch (layout) {
    case Layout::kBSHD:
      return "bshd";
    case Layout::kSBHD:
      return "sbhd";
    case Layout::kBHSD:
      return "bhsd";
    case Layout::kTHD:
      return "thd";
  }
  return "?";
}

Layout parse_layout(std::string_view text) {
  for (Layout layout : kAllLayouts) {
    if (text == to_string(layout)) return layout;
  }
  throw_invalid(fmt::format("unknown layout '{}' (expected bshd, sbhd, bhsd or thd)", text));
}

ir::Scope ProblemDesc::scope() const {
  ir::Scope result;
  for (const auto& [name, value] : params) result.params.push_back(name);
  for (const auto& [name, decl] : tensors) {
    result.tensors[name] =
        ir::Scope::TensorDecl{element_type_of(decl.dtype), static_cast<int>(decl.shape.size())};
  }
  return result;
}

std::uint64_t modifier_hash(const Graph& score_mod, const Graph& mask_mod, double scale) {
  return hash_combine(hash_combine(score_mod.hash(), mask_mod.hash()),
                      std::bit_cast<std::uint64_t>(scale));
}

std::uint64_t backward_hash(const Graph& score_derivative,
                            const std::vector<LoadDerivative>& load_derivatives) {
  std::uint64_t hash = hash_combine(score_derivative.hash(), load_derivatives.size());
  for (const LoadDerivative& load : load_derivatives) {
    hash = hash_combine(hash, load.tensor.size());
    for (const char c : load.tensor) {
      hash = hash_combine(hash, static_cast<std::uint64_t>(static_cast<unsigned char>(c)));
    }
    hash = hash_combine(hash, load.indices.size());
    for (const Graph& index : load.indices) hash = hash_combine(hash, index.hash());
    hash = hash_combine(hash, load.derivative.hash());
  }
  return hash;
}

Problem::Problem(ProblemDesc desc) : desc_(std::move(desc)) {
  ProblemDesc& d = desc_;
  require_positive(d.batch, "batch");
  require_positive(d.heads_q, "heads_q");
  if (d.heads_kv == 0) d.heads_kv = d.heads_q;
  require_positive(d.heads_kv, "heads_kv");
  if (d.heads_q % d.heads_kv != 0) {
    throw_invalid(
        fmt::format("heads_q ({}) must be a multiple of heads_kv ({})", d.heads_q, d.heads_kv));
  }
  require_positive(d.head_dim_qk, "head_dim_qk");
  if (d.head_dim_v == 0) d.head_dim_v = d.head_dim_qk;
  require_positive(d.head_dim_v, "head_dim_v");

  if (d.kv_cache) check_kv_cache(d);
  if (d.layout == Layout::kTHD && d.kv_cache) {
    if (d.cu_seqlens_q.empty()) throw_invalid("layout thd needs cu_seqlens_q (batch + 1 offsets)");
    const std::int64_t longest_q = check_offsets(d.cu_seqlens_q, d.batch, "cu_seqlens_q");
    if (longest_q == 0) throw_invalid("cu_seqlens_q describes no query tokens");
    if (d.seq_len_q == 0) d.seq_len_q = longest_q;
    if (d.seq_len_q != longest_q) {
      throw_invalid(fmt::format("thd: seq_len_q ({}) must be 0 or the longest sequence ({})",
                                d.seq_len_q, longest_q));
    }
  } else if (d.layout == Layout::kTHD) {
    if (d.cu_seqlens_q.empty()) throw_invalid("layout thd needs cu_seqlens_q (batch + 1 offsets)");
    if (d.cu_seqlens_kv.empty()) d.cu_seqlens_kv = d.cu_seqlens_q;
    const std::int64_t longest_q = check_offsets(d.cu_seqlens_q, d.batch, "cu_seqlens_q");
    const std::int64_t longest_kv = check_offsets(d.cu_seqlens_kv, d.batch, "cu_seqlens_kv");
    if (longest_q == 0) throw_invalid("cu_seqlens_q describes no query tokens");
    if (longest_kv == 0) throw_invalid("cu_seqlens_kv describes no key tokens");
    if (d.seq_len_q == 0) d.seq_len_q = longest_q;
    if (d.seq_len_kv == 0) d.seq_len_kv = longest_kv;
    if (d.seq_len_q != longest_q || d.seq_len_kv != longest_kv) {
      throw_invalid(fmt::format(
          "thd: seq_len_q/seq_len_kv ({}, {}) must be 0 or the longest sequence ({}, {})",
          d.seq_len_q, d.seq_len_kv, longest_q, longest_kv));
    }
  } else {
    if (!d.cu_seqlens_q.empty() || !d.cu_seqlens_kv.empty()) {
      throw_invalid(fmt::format("cu_seqlens are only for layout thd, not {}", to_string(d.layout)));
    }
    require_positive(d.seq_len_q, "seq_len_q");
    if (d.seq_len_kv == 0) d.seq_len_kv = d.seq_len_q;
    require_positive(d.seq_len_kv, "seq_len_kv");
  }

  if (!is_floating(d.dtype)) {
    throw_invalid(fmt::format("dtype {} is not a floating-point storage type", to_string(d.dtype)));
  }
  check_strides(d.q_strides, d.layout, "q_strides");
  check_strides(d.k_strides, d.layout, "k_strides", d.kv_cache.has_value());
  check_strides(d.v_strides, d.layout, "v_strides", d.kv_cache.has_value());
  check_strides(d.o_strides, d.layout, "o_strides");

  if (!d.scale) d.scale = 1.0 / std::sqrt(static_cast<double>(d.head_dim_qk));
  if (!std::isfinite(*d.scale)) throw_invalid(fmt::format("scale ({}) must be finite", *d.scale));
  for (const auto& [name, value] : d.params) {
    if (!std::isfinite(value)) {
      throw_invalid(fmt::format("parameter '{}' ({}) must be finite", name, value));
    }
  }

  for (const auto& [name, decl] : d.tensors) {
    for (std::int64_t extent : decl.shape) {
      if (extent <= 0) {
        throw_invalid(fmt::format("tensor '{}' has a non-positive extent in [{}]", name,
                                  fmt::join(decl.shape, ", ")));
      }
    }
  }
  check_sizes(d);

  Graph score_graph;
  if (d.score_mod) {
    const Type type = d.score_mod->type();
    if (type == Type::kBool) {
      throw_invalid(
          fmt::format("score_mod must be f32 or i32, got bool: {}", d.score_mod->to_string()));
    }
    score_graph = Graph(type == Type::kI32 ? ir::to_float(*d.score_mod) : *d.score_mod);
  }
  Graph mask_graph = Graph::always_true();
  if (d.mask_mod) {
    if (d.mask_mod->type() != Type::kBool) {
      throw_invalid(fmt::format("mask_mod must be bool, got {}: {}", to_string(d.mask_mod->type()),
                                d.mask_mod->to_string()));
    }
    mask_graph = Graph(*d.mask_mod);
    if (mask_graph.uses_score()) {
      throw_invalid(fmt::format("mask_mod must not use `score`: {}", d.mask_mod->to_string()));
    }
  }
  check_names(score_graph, d, "score_mod");
  check_names(mask_graph, d, "mask_mod");

  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, decl] : d.tensors) shapes[name] = decl.shape;
  const LeafRanges ranges = leaf_ranges();
  score_mod_ = check_and_clamp_loads(score_graph, ranges, shapes);
  mask_mod_ = check_and_clamp_loads(mask_graph, ranges, shapes);
  modifier_hash_ = flexattn::modifier_hash(score_mod_, mask_mod_, *d.scale);
  if (wants_backward()) {
    backward_hash_ = flexattn::backward_hash(derivative_wrt_score(score_mod_),
                                             derivatives_wrt_tensors(score_mod_));
  }

  std::string& s = signature_;
  s = fmt::format("{}|{}|{}|{}|lse={}", d.direction == Direction::kForward ? "fwd" : "fwd+bwd",
                  to_string(d.layout), to_string(d.dtype), to_string(d.device), d.want_lse ? 1 : 0);
  for (const char* which : {"q", "k", "v", "o"}) {
    const TensorView view = expected(which);
    s += fmt::format("|{}={}:{}", which, describe_shape(view.shape), describe_shape(view.strides));
  }
  if (d.layout == Layout::kTHD) {
    s += fmt::format("|cu_q={}|cu_kv={}", describe_shape(d.cu_seqlens_q),
                     describe_shape(d.cu_seqlens_kv));
  }
  if (d.kv_cache) {
    s += fmt::format("|cache={}x{}/{}", d.kv_cache->pages, d.kv_cache->page_size,
                     d.kv_cache->max_pages);
  }
  for (const auto& [name, decl] : d.tensors) {
    s += fmt::format("|t:{}={}{}", name, to_string(decl.dtype), describe_shape(decl.shape));
  }
  for (const auto& [name, value] : d.params) s += fmt::format("|p:{}={}", name, value);
}

std::int64_t Problem::seq_len_q_of(std::int64_t b) const {
  if (b < 0 || b >= desc_.batch) {
    throw_invalid(fmt::format("batch index {} outside [0, {})", b, desc_.batch));
  }
  if (desc_.layout != Layout::kTHD) return desc_.seq_len_q;
  const auto i = static_cast<std::size_t>(b);
  return desc_.cu_seqlens_q[i + 1] - desc_.cu_seqlens_q[i];
}

std::int64_t Problem::seq_len_kv_of(std::int64_t b) const {
  if (b < 0 || b >= desc_.batch) {
    throw_invalid(fmt::format("batch index {} outside [0, {})", b, desc_.batch));
  }
  if (desc_.layout != Layout::kTHD || desc_.kv_cache) return desc_.seq_len_kv;
  const auto i = static_cast<std::size_t>(b);
  return desc_.cu_seqlens_kv[i + 1] - desc_.cu_seqlens_kv[i];
}

LeafRanges Problem::leaf_ranges() const {
  const auto last = [](std::int64_t extent) { return static_cast<double>(extent - 1); };
  LeafRanges ranges;
  ranges.batch = {0.0, last(desc_.batch)};
  ranges.head = {0.0, last(desc_.heads_q)};
  ranges.query = {0.0, last(desc_.seq_len_q)};
  ranges.key = {0.0, last(desc_.seq_len_kv)};
  if (desc_.kv_cache) {
    // Queries sit at the end of the cache: positions up to the capacity; a cache length is 0
    // (no key is ever visited) or at least the sequence's query count.
    const std::int64_t shortest_q =
        desc_.layout == Layout::kTHD ? shortest_sequence(desc_.cu_seqlens_q) : desc_.seq_len_q;
    ranges.query = {0.0, last(desc_.seq_len_kv)};
    ranges.query_length = {static_cast<double>(shortest_q), static_cast<double>(desc_.seq_len_q)};
    ranges.key_length = {static_cast<double>(std::max<std::int64_t>(1, shortest_q)),
                         static_cast<double>(desc_.seq_len_kv)};
  } else if (desc_.layout == Layout::kTHD) {
    ranges.query_length = {static_cast<double>(shortest_sequence(desc_.cu_seqlens_q)),
                           static_cast<double>(desc_.seq_len_q)};
    ranges.key_length = {static_cast<double>(shortest_sequence(desc_.cu_seqlens_kv)),
                         static_cast<double>(desc_.seq_len_kv)};
  } else {
    ranges.query_length = {static_cast<double>(desc_.seq_len_q),
                           static_cast<double>(desc_.seq_len_q)};
    ranges.key_length = {static_cast<double>(desc_.seq_len_kv),
                         static_cast<double>(desc_.seq_len_kv)};
  }
  return ranges;
}

std::int64_t Problem::total_tokens_q() const {
  return desc_.layout == Layout::kTHD ? desc_.cu_seqlens_q.back() : desc_.batch * desc_.seq_len_q;
}

std::int64_t Problem::total_tokens_kv() const {
  if (desc_.kv_cache) return desc_.kv_cache->pages * desc_.kv_cache->page_size;  // the pool's
  return desc_.layout == Layout::kTHD ? desc_.cu_seqlens_kv.back() : desc_.batch * desc_.seq_len_kv;
}

TensorView Problem::expected(std::string_view which) const {
  const ProblemDesc& d = desc_;
  TensorView view;
  view.device = d.device;
  if (which == "lse") {
    view.dtype = d.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    view.shape = d.layout == Layout::kTHD
                     ? std::vector<std::int64_t>{d.heads_q, total_tokens_q()}
                     : std::vector<std::int64_t>{d.batch, d.heads_q, d.seq_len_q};
    view.strides = contiguous_strides(view.shape);
    return view;
  }
  if (which == "page_table" || which == "cache_lens") {
    if (!d.kv_cache) {
      throw_invalid(fmt::format("Problem::expected: '{}' of a problem without a KV cache", which));
    }
    view.dtype = DType::kI32;
    view.shape = which == "page_table" ? std::vector<std::int64_t>{d.batch, d.kv_cache->max_pages}
                                       : std::vector<std::int64_t>{d.batch};
    view.strides = contiguous_strides(view.shape);
    return view;
  }
  std::int64_t heads = 0, seq_len = 0, tokens = 0, head_dim = 0;
  const std::optional<std::vector<std::int64_t>>* strides = nullptr;
  if (which == "q" || which == "dq") {
    heads = d.heads_q, seq_len = d.seq_len_q, tokens = total_tokens_q(), head_dim = d.head_dim_qk;
    strides = &d.q_strides;
  } else if (which == "k" || which == "dk") {
    heads = d.heads_kv, seq_len = d.seq_len_kv, tokens = total_tokens_kv();
    head_dim = d.head_dim_qk;
    strides = &d.k_strides;
  } else if (which == "v" || which == "dv") {
    heads = d.heads_kv, seq_len = d.seq_len_kv, tokens = total_tokens_kv();
    head_dim = d.head_dim_v;
    strides = &d.v_strides;
  } else if (which == "o" || which == "out" || which == "dout") {
    heads = d.heads_q, seq_len = d.seq_len_q, tokens = total_tokens_q(), head_dim = d.head_dim_v;
    strides = &d.o_strides;
  } else {
    throw_invalid(fmt::format(
        "Problem::expected: unknown view '{}' (expected q, k, v, o, lse, dq, dk, dv, dout, "
        "page_table or cache_lens)",
        which));
  }
  view.dtype = d.dtype;
  const bool pool = d.kv_cache && (which == "k" || which == "v");
  switch (pool ? Layout::kBSHD : d.layout) {
    case Layout::kBSHD:
      view.shape = pool ? std::vector<std::int64_t>{d.kv_cache->pages, d.kv_cache->page_size, heads,
                                                    head_dim}
                        : std::vector<std::int64_t>{d.batch, seq_len, heads, head_dim};
      break;
    case Layout::kSBHD:
      view.shape = {seq_len, d.batch, heads, head_dim};
      break;
    case Layout::kBHSD:
      view.shape = {d.batch, heads, seq_len, head_dim};
      break;
    case Layout::kTHD:
      view.shape = {tokens, heads, head_dim};
      break;
  }
  view.strides = *strides ? **strides : contiguous_strides(view.shape);
  return view;
}

double attention_flops(const Problem& problem, double kept_fraction) {
  // Two matrix products per kept (query, key) pair: Q K^T (2 * head_dim_qk) and P V
  // (2 * head_dim_v); equal to 4 * head_dim when the head dims agree.
  double pairs = 0.0;
  for (std::int64_t b = 0; b < problem.batch(); ++b) {
    pairs += static_cast<double>(problem.seq_len_q_of(b)) *
             static_cast<double>(problem.seq_len_kv_of(b));
  }
  const double per_pair = 2.0 * static_cast<double>(problem.head_dim_qk() + problem.head_dim_v());
  const double forward = pairs * static_cast<double>(problem.heads_q()) * per_pair * kept_fraction;
  // Backward recomputes the scores and does five products where forward does two: 2.5x forward.
  constexpr double kForwardBackwardFactor = 3.5;
  return problem.wants_backward() ? kForwardBackwardFactor * forward : forward;
}

}  // namespace flexattn
