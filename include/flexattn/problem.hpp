// An attention problem: shapes, layout, strides, dtypes, scale, modifiers, params, extra tensors,
// direction. Validated once, at construction, with clear errors.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "flexattn/analysis.hpp"
#include "flexattn/dtype.hpp"
#include "flexattn/export.hpp"
#include "flexattn/expr.hpp"
#include "flexattn/graph.hpp"
#include "flexattn/tensor.hpp"

namespace flexattn {

// Q, K, V, O (and their gradients) in one of these orders. `thd` packs the sequences of a batch
// one after another: (total_tokens, heads, head_dim), with offsets cu_seqlens (batch + 1 entries).
enum class Layout { kBSHD, kSBHD, kBHSD, kTHD };
FLEXATTN_API std::string_view to_string(Layout layout);   // "bshd", ...
FLEXATTN_API Layout parse_layout(std::string_view text);  // throws kInvalidArgument

enum class Direction { kForward, kForwardBackward };

// A paged KV cache (docs/design.md section 2, "Paged KV cache"). K and V are pools of `pages`
// pages of `page_size` tokens each, shaped (pages, page_size, heads_kv, head_dim) whatever the
// queries' layout; the run's ForwardArgs::page_table (int32, (batch, max_pages)) names the pages
// of each sequence in order and ForwardArgs::cache_lens (int32, (batch,)) how many tokens each
// holds. The cache holds the new queries' own keys: sequence b's queries are its last q_len
// tokens, at positions cache_lens[b] - q_len + i (the modifiers' `q`; `KV_LEN` is
// cache_lens[b]). Forward only.
struct KvCacheDesc {
  std::int64_t pages = 0;      // pages in the K and V pools
  std::int64_t page_size = 0;  // tokens per page
  std::int64_t max_pages = 0;  // page-table entries per sequence; capacity = max_pages x page_size
};

struct TensorDecl {
  DType dtype = DType::kF32;  // fp32/fp64/fp16/bf16 load as f32; int32/int64 load as i32
  std::vector<std::int64_t> shape;
};

struct FLEXATTN_API ProblemDesc {
  std::int64_t batch = 1;
  std::int64_t heads_q = 1;
  std::int64_t heads_kv = 0;    // 0: same as heads_q
  std::int64_t seq_len_q = 1;   // thd: the longest sequence (derived from cu_seqlens if 0)
  std::int64_t seq_len_kv = 0;  // 0: same as seq_len_q
  std::int64_t head_dim_qk = 64;
  std::int64_t head_dim_v = 0;  // 0: same as head_dim_qk
  Layout layout = Layout::kBSHD;
  DType dtype = DType::kF32;          // storage of Q, K, V, O, dO, dQ, dK, dV
  std::optional<double> scale;        // default 1 / sqrt(head_dim_qk)
  std::optional<ir::Expr> score_mod;  // absent: identity
  std::optional<ir::Expr> mask_mod;   // absent: keep everything
  std::map<std::string, double> params;
  std::map<std::string, TensorDecl> tensors;
  std::vector<std::int64_t> cu_seqlens_q,
      cu_seqlens_kv;  // thd only (no cu_seqlens_kv with a cache)
  // A paged KV cache; layouts bshd and thd only; seq_len_kv is then the capacity (0 sets it).
  std::optional<KvCacheDesc> kv_cache;
  // Strides (elements) of the views in layout order (K and V of a cache: in pool order, rank 4);
  // absent: contiguous. Gradients (dQ, dK, dV,
  // dO) use the strides of Q, K, V, O respectively.
  std::optional<std::vector<std::int64_t>> q_strides, k_strides, v_strides, o_strides;
  Direction direction = Direction::kForward;
  bool want_lse = true;
  Device device = Device::kCpu;

  // The names the parser may resolve for this problem (params and tensors declared above).
  ir::Scope scope() const;
};

class FLEXATTN_API Problem {
 public:
  // Validates (heads_q % heads_kv, positive sizes, unit last stride, tensors bound and of the
  // declared rank, every tensor load in bounds or clamped, thd offsets, ...) and canonicalises
  // the modifiers. Throws Error(kInvalidArgument) with a one-line message.
  explicit Problem(ProblemDesc desc);

  const ProblemDesc& desc() const { return desc_; }
  std::int64_t batch() const { return desc_.batch; }
  std::int64_t heads_q() const { return desc_.heads_q; }
  std::int64_t heads_kv() const { return desc_.heads_kv; }
  std::int64_t seq_len_q() const { return desc_.seq_len_q; }
  std::int64_t seq_len_kv() const { return desc_.seq_len_kv; }
  std::int64_t head_dim_qk() const { return desc_.head_dim_qk; }
  std::int64_t head_dim_v() const { return desc_.head_dim_v; }
  Layout layout() const { return desc_.layout; }
  DType dtype() const { return desc_.dtype; }
  double scale() const { return *desc_.scale; }
  Direction direction() const { return desc_.direction; }
  bool wants_backward() const { return desc_.direction == Direction::kForwardBackward; }
  Device device() const { return desc_.device; }

  // Canonical modifiers after load checking (undecidable indices clamped).
  const Graph& score_mod() const { return score_mod_; }
  const Graph& mask_mod() const { return mask_mod_; }
  // The hash a plan must prove it implements: score_mod, mask_mod and the scale.
  std::uint64_t modifier_hash() const { return modifier_hash_; }
  // The hash of the derivatives a plan must prove when the problem wants gradients: backward_hash
  // (below) of derivative_wrt_score and derivatives_wrt_tensors of score_mod. 0 for a forward-only
  // problem.
  std::uint64_t backward_hash() const { return backward_hash_; }

  const std::optional<KvCacheDesc>& kv_cache() const { return desc_.kv_cache; }

  // Per-sequence lengths of batch entry b (thd: from cu_seqlens; otherwise seq_len_q/kv). With a
  // KV cache, seq_len_kv_of is the capacity: the run's cache_lens give the lengths.
  std::int64_t seq_len_q_of(std::int64_t b) const;
  std::int64_t seq_len_kv_of(std::int64_t b) const;
  // Leaf ranges over the whole problem, for the interval analysis.
  LeafRanges leaf_ranges() const;

  // Expected shapes/strides of the views, in layout order.
  // q/dq: bshd (B, Sq, Hq, Dqk), sbhd (Sq, B, Hq, Dqk), bhsd (B, Hq, Sq, Dqk), thd (Tq, Hq, Dqk);
  // k/dk with Hkv, Skv; v/dv with Hkv, Skv, Dv; o/dout with Hq, Sq, Dv.
  // lse: (B, Hq, Sq) or thd (Hq, Tq), contiguous, fp64 for fp64 problems and fp32 otherwise.
  // A KV cache: k and v (pages, page_size, Hkv, D); page_table int32 (B, max_pages) and
  // cache_lens int32 (B), contiguous.
  // "q", "k", "v", "o", "lse", "page_table", "cache_lens" (data null)
  TensorView expected(std::string_view which) const;
  std::int64_t total_tokens_q() const;  // thd: cu_seqlens_q.back(); else batch * seq_len_q
  std::int64_t total_tokens_kv() const;

  // Exact signature: every shape, stride, dtype, layout, device, direction and the thd offsets.
  const std::string& signature() const { return signature_; }

 private:
  ProblemDesc desc_;
  Graph score_mod_;
  Graph mask_mod_;
  std::uint64_t modifier_hash_ = 0;
  std::uint64_t backward_hash_ = 0;
  std::string signature_;
};

// The hash a plan must prove it implements (Problem::modifier_hash and every engine's
// PlanInfo::lowered_hash use this one formula).
FLEXATTN_API std::uint64_t modifier_hash(const Graph& score_mod, const Graph& mask_mod,
                                         double scale);

// The hash of a backward's derivatives a plan must prove (Problem::backward_hash and every
// engine's PlanInfo::lowered_backward_hash use this one formula): d score_mod / d score, then, in
// the order of derivatives_wrt_tensors, each float tensor load's tensor name, index graphs and
// d score_mod / d load.
FLEXATTN_API std::uint64_t backward_hash(const Graph& score_derivative,
                                         const std::vector<LoadDerivative>& load_derivatives);

// FLOPs per docs/design.md section 6 (forward; forward+backward is 3.5x). Counts only kept tiles'
// worth for causal-like masks via `kept_fraction` (1.0 dense, 0.5 causal).
FLEXATTN_API double attention_flops(const Problem& problem, double kept_fraction);

}  // namespace flexattn
