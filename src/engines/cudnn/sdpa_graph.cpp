#include "engines/cudnn/sdpa_graph.hpp"

#include <fmt/format.h>

#include <limits>
#include <utility>
#include <vector>

#include "flexattn/analysis.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cudnn {
namespace {

// Scratch tensors start on 256-byte boundaries (cudaMalloc's alignment), so cuDNN may use wide
// loads on them.
constexpr std::size_t kScratchAlignment = 256;
constexpr std::size_t kFloatBytes = sizeof(float);

std::size_t align_up(std::size_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

struct View4 {
  std::vector<std::int64_t> dims, strides;
};

// A Q/K/V/O view as (batch, heads, seq, dim) with the problem's strides: no copy for any layout.
View4 bhsd(const Problem& problem, std::string_view which) {
  const TensorView view = problem.expected(which);
  const std::vector<std::int64_t>& n = view.shape;
  const std::vector<std::int64_t>& s = view.strides;
  switch (problem.layout()) {
    case Layout::kBSHD:
      return {{n[0], n[2], n[1], n[3]}, {s[0], s[2], s[1], s[3]}};
    case Layout::kSBHD:
      return {{n[1], n[2], n[0], n[3]}, {s[1], s[2], s[0], s[3]}};
    case Layout::kBHSD:
      return {n, s};
    case Layout::kTHD:
      break;
  }
  throw_internal("cudnn: thd reached graph construction");
}

View4 transposed(View4 view) {
  std::swap(view.dims[2], view.dims[3]);
  std::swap(view.strides[2], view.strides[3]);
  return view;
}

cudnnDataType_t io_type(const Problem& problem) {
  return problem.dtype() == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

TensorId io_tensor(GraphBuilder& builder, SdpaGraph& graph, const Problem& problem,
                   std::string name, const View4& view, Binding::Kind kind) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.type = io_type(problem);
  spec.dims = view.dims;
  spec.strides = view.strides;
  const TensorId id = builder.tensor(std::move(spec));
  graph.bindings.push_back(Binding{kind, builder.uid(id), {}, nullptr, 0});
  return id;
}

TensorId stats_tensor(GraphBuilder& builder, const Problem& problem, std::string name) {
  const std::vector<std::int64_t> dims = {problem.batch(), problem.heads_q(), problem.seq_len_q(),
                                          1};
  TensorSpec spec;
  spec.name = std::move(name);
  spec.type = CUDNN_DATA_FLOAT;
  spec.strides = packed_strides(dims);
  spec.dims = dims;
  return builder.tensor(std::move(spec));
}

TensorId strided_virtual(GraphBuilder& builder, std::string name, cudnnDataType_t type,
                         std::vector<std::int64_t> dims, std::vector<std::int64_t> strides) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.type = type;
  spec.dims = std::move(dims);
  spec.strides = std::move(strides);
  spec.is_virtual = true;
  return builder.tensor(std::move(spec));
}

// The scaled score after the modifier and the mask, and the mask's keep tensor (-1 when there is
// no mask).
struct ModifiedScore {
  TensorId score = -1;
  TensorId keep = -1;
};

ModifiedScore emit_modifier(const ModifierLowering& lowering, EmitContext& context) {
  GraphBuilder& builder = *context.builder;
  ModifiedScore result;
  result.score = context.score;
  if (lowering.has_score_mod) result.score = emit_lowering(lowering.score, context, "mod");
  if (lowering.has_mask) {
    result.keep = emit_lowering(lowering.mask, context, "mask");
    if (context.fault == CudnnLoweringFault::kDropMaskSelect) {
      context.fault_applied = true;
      return result;
    }
    const TensorId masked_value =
        builder.scalar_f32(-std::numeric_limits<float>::infinity(), "mask.fill");
    // BINARY_SELECT(X, B, T) = T ? X : B: kept scores stay, the rest become -inf.
    result.score = builder.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT,
                                     {result.score, masked_value, result.keep}, CUDNN_DATA_FLOAT,
                                     "mask.select");
  }
  return result;
}

void finish_bindings(SdpaGraph& graph, const EmitContext& context) {
  graph.fault_applied = context.fault_applied;
  for (const auto& [uid, tensor] : context.bindings) {
    graph.bindings.push_back(Binding{Binding::Kind::kTensor, uid, tensor, nullptr, 0});
  }
  for (const auto& [uid, pointer] : graph.builder->by_value_pointers()) {
    graph.bindings.push_back(Binding{Binding::Kind::kHost, uid, {}, pointer, 0});
  }
}

// The index leaf among b and h that `graph` reads, or null.
const char* batch_or_head_leaf(const Graph& graph) {
  for (const GraphNode& node : graph.nodes()) {
    if (node.op == Op::kBatch) return "b";
    if (node.op == Op::kHead) return "h";
  }
  return nullptr;
}

// Whether `graph` compares a value that reads the index q with one that reads kv (a comparison
// node whose operands together read both).
bool compares_query_with_key(const Graph& graph) {
  struct Reads {
    bool query = false;
    bool key = false;
  };
  std::vector<Reads> reads(graph.nodes().size());
  for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
    const GraphNode& node = graph.nodes()[i];
    reads[i].query = node.op == Op::kQuery;
    reads[i].key = node.op == Op::kKey;
    for (const std::int32_t arg : node.args) {
      reads[i].query = reads[i].query || reads[static_cast<std::size_t>(arg)].query;
      reads[i].key = reads[i].key || reads[static_cast<std::size_t>(arg)].key;
    }
    const bool comparison = node.op == Op::kLess || node.op == Op::kLessEqual ||
                            node.op == Op::kGreater || node.op == Op::kGreaterEqual ||
                            node.op == Op::kEqual || node.op == Op::kNotEqual;
    if (comparison && reads[i].query && reads[i].key) return true;
  }
  return false;
}

// Graph classes the backward engines computed wrongly with exit status 0 (cuDNN 9.19, H200,
// flexattn's conformance cases), refused until a qualification run covers them (docs/engines.md,
// section cudnn):
// - a modifier or mask that reads the batch or head index: `score + (kv - q) * exp2(-(h + 1))`
//   gave dQ and dK off by 4e10 while the forward was right (the same modifier with a constant
//   slope is right);
// - a score modifier whose derivative is not the constant 1: `score * score` at seq_len 17 x 33
//   gave NaN dQ, dK and dV (right at 128 x 128).
Support check_backward_class(const Problem& problem, const ModifierLowering& lowering) {
  for (const auto& [what, graph] : {std::pair{"score modifier", &problem.score_mod()},
                                    std::pair{"mask", &problem.mask_mod()}}) {
    if (const char* leaf = batch_or_head_leaf(*graph)) {
      return Support::no(fmt::format(
          "the {} '{}' reads the index {}: cuDNN's backward gave gradients off by 1e10 for such "
          "graphs (ALiBi slopes from the head index), so the cudnn backward refuses them",
          what, graph->to_string(), leaf));
    }
  }
  if (lowering.has_derivative) {
    return Support::no(fmt::format(
        "the score modifier '{}' has a derivative other than 1 ('{}'): cuDNN's backward gave NaN "
        "gradients for such graphs at lengths that are not a multiple of its tile (score * "
        "score at 17 x 33), so the cudnn backward refuses them",
        problem.score_mod().to_string(), lowering.derivative.graph.to_string()));
  }
  return Support::yes();
}

std::string modifier_summary(const ModifierLowering& lowering) {
  return fmt::format("score_mod {} ops, mask {} ops",
                     lowering.has_score_mod ? lowering.score.operations : 0,
                     lowering.has_mask ? lowering.mask.operations + 1 : 0);
}

}  // namespace

Support lower_modifiers(const Problem& problem, ModifierLowering& lowering) {
  const Graph& score = problem.score_mod();
  const Graph& mask = problem.mask_mod();
  lowering.has_score_mod = !score.is_identity_score();
  if (lowering.has_score_mod && !score.uses_score()) {
    return Support::no(
        fmt::format("the score modifier '{}' does not read the score; the fused "
                    "graphs carry the score through the modifier",
                    score.to_string()));
  }
  if (lowering.has_score_mod && compares_query_with_key(score)) {
    // cuDNN 9.19 on sm_90 crashed the process (SIGSEGV inside EngineConfig finalize, under the
    // heuristics query) for every such forward graph tried: where(kv > q, -inf, score),
    // where(q < kv, ...), where(kv > q + 3, ...), with -inf or -1e30, at 100 x 100, 128 x 128 and
    // 47 x 33. A crash cannot be caught, so the class is refused before cuDNN sees it.
    return Support::no(fmt::format(
        "the score modifier '{}' compares q with kv: cuDNN 9.19's heuristics crashed the process "
        "(SIGSEGV) on such graphs, so the cudnn engine refuses them; a condition on q and kv "
        "alone can be the mask instead (e.g. --mask-mod 'q >= kv')",
        score.to_string()));
  }
  if (Support s = plan_lowering(score, problem, lowering.score); !s) return s;
  if (Support s = plan_lowering(mask, problem, lowering.mask); !s) return s;
  lowering.has_mask = true;
  if (lowering.mask.root_is_constant()) {
    const double keep = lowering.mask.nodes[static_cast<std::size_t>(mask.root())].constant;
    if (keep == 0.0) return Support::no("the mask removes every key of every row");
    lowering.has_mask = false;
  }
  if (problem.wants_backward()) {
    const Graph derivative = derivative_wrt_score(score);
    if (Support s = plan_lowering(derivative, problem, lowering.derivative); !s) {
      return Support::no(fmt::format("derivative of the score modifier: {}", s.reason()));
    }
    lowering.has_derivative = true;
    if (lowering.derivative.root_is_constant()) {
      const double slope =
          lowering.derivative.nodes[static_cast<std::size_t>(derivative.root())].constant;
      lowering.has_derivative = slope != 1.0;
    }
    return check_backward_class(problem, lowering);
  }
  return Support::yes();
}

SdpaGraph build_forward_graph(std::shared_ptr<const Library> library, const Problem& problem,
                              const ModifierLowering& lowering, CudnnLoweringFault fault) {
  SdpaGraph graph;
  graph.builder = std::make_unique<GraphBuilder>(std::move(library));
  GraphBuilder& b = *graph.builder;
  const std::int64_t batch = problem.batch(), heads = problem.heads_q();
  const std::int64_t rows = problem.seq_len_q(), columns = problem.seq_len_kv();

  const TensorId q = io_tensor(b, graph, problem, "Q", bhsd(problem, "q"), Binding::Kind::kQ);
  const TensorId kt =
      io_tensor(b, graph, problem, "K^T", transposed(bhsd(problem, "k")), Binding::Kind::kK);
  const TensorId v = io_tensor(b, graph, problem, "V", bhsd(problem, "v"), Binding::Kind::kV);
  const TensorId o = io_tensor(b, graph, problem, "O", bhsd(problem, "o"), Binding::Kind::kO);
  const TensorId stats = stats_tensor(b, problem, "Stats");
  graph.bindings.push_back(Binding{Binding::Kind::kStats, b.uid(stats), {}, nullptr, 0});
  graph.stats_scratch_offset = 0;
  graph.scratch_bytes = align_up(static_cast<std::size_t>(batch * heads * rows) * kFloatBytes);

  const TensorId scale = b.scalar_f32(static_cast<float>(problem.scale()), "attn_scale");
  const TensorId s = b.virtual_tensor("S", CUDNN_DATA_FLOAT, {batch, heads, rows, columns});
  b.matmul(q, kt, s, "bmm1");
  EmitContext context;
  context.builder = &b;
  context.fault = fault;
  context.score = b.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, {s, scale}, CUDNN_DATA_FLOAT,
                              "scaled_score");
  const TensorId modified = emit_modifier(lowering, context).score;

  // Softmax as the frontend decomposes it before cuDNN 9.21, with log-sum-exp stats.
  const TensorId row_max = b.virtual_tensor("max", CUDNN_DATA_FLOAT, {batch, heads, rows, 1});
  b.reduction(CUDNN_REDUCE_TENSOR_MAX, modified, row_max, "max");
  const TensorId shifted = b.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, {modified, row_max},
                                       CUDNN_DATA_FLOAT, "sub_max");
  const TensorId exponent =
      b.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, {shifted}, CUDNN_DATA_FLOAT, "exp");
  const TensorId row_sum = b.virtual_tensor("sum", CUDNN_DATA_FLOAT, {batch, heads, rows, 1});
  b.reduction(CUDNN_REDUCE_TENSOR_ADD, exponent, row_sum, "sum");
  const TensorId log_sum =
      b.pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, {row_sum}, CUDNN_DATA_FLOAT, "log");
  b.pointwise_into(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, {row_max, log_sum}, stats, "stats");
  // bmm2 takes P in the io dtype (a requirement of the fused engines).
  const TensorId p = b.virtual_tensor("P", io_type(problem), {batch, heads, rows, columns});
  b.pointwise_into(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, {exponent, row_sum}, p, "div");
  b.matmul(p, v, o, "bmm2");

  finish_bindings(graph, context);
  graph.summary =
      fmt::format("forward graph of {} ops ({})", b.operation_count(), modifier_summary(lowering));
  return graph;
}

SdpaGraph build_backward_graph(std::shared_ptr<const Library> library, const Problem& problem,
                               const ModifierLowering& lowering, CudnnLoweringFault fault) {
  SdpaGraph graph;
  graph.builder = std::make_unique<GraphBuilder>(std::move(library));
  GraphBuilder& b = *graph.builder;
  const std::int64_t batch = problem.batch(), heads = problem.heads_q();
  const std::int64_t heads_kv = problem.heads_kv();
  const std::int64_t rows = problem.seq_len_q(), columns = problem.seq_len_kv();
  const std::int64_t dim_qk = problem.head_dim_qk(), dim_v = problem.head_dim_v();
  const cudnnDataType_t io = io_type(problem);

  const View4 k_view = bhsd(problem, "k");
  const TensorId q = io_tensor(b, graph, problem, "Q", bhsd(problem, "q"), Binding::Kind::kQ);
  const TensorId kt = io_tensor(b, graph, problem, "K^T", transposed(k_view), Binding::Kind::kK);
  const TensorId vt =
      io_tensor(b, graph, problem, "V^T", transposed(bhsd(problem, "v")), Binding::Kind::kV);
  const TensorId o = io_tensor(b, graph, problem, "O", bhsd(problem, "o"), Binding::Kind::kO);
  const TensorId dout =
      io_tensor(b, graph, problem, "dO", bhsd(problem, "o"), Binding::Kind::kDOut);
  const TensorId stats = stats_tensor(b, problem, "Stats");
  graph.bindings.push_back(Binding{Binding::Kind::kStats, b.uid(stats), {}, nullptr, 0});
  const TensorId dq = io_tensor(b, graph, problem, "dQ", bhsd(problem, "q"), Binding::Kind::kDQ);
  const TensorId dk = io_tensor(b, graph, problem, "dK", k_view, Binding::Kind::kDK);
  const TensorId dv = io_tensor(b, graph, problem, "dV", bhsd(problem, "v"), Binding::Kind::kDV);
  const TensorId scale = b.scalar_f32(static_cast<float>(problem.scale()), "attn_scale");
  const TensorId one = b.scalar_f32(1.0F, "one");

  // softmax_sum = rowsum(dO * O), a dense fp32 scratch tensor.
  const TensorId d_o = strided_virtual(b, "dO*O", CUDNN_DATA_FLOAT, {batch, heads, rows, dim_v},
                                       {heads * rows * dim_v, rows * dim_v, heads * dim_v, 1});
  b.pointwise_into(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, {dout, o}, d_o, "mul_dO_O");
  const TensorId d_o_sum = b.virtual_tensor("sum(dO*O)", CUDNN_DATA_FLOAT, {batch, heads, rows, 1});
  b.reduction(CUDNN_REDUCE_TENSOR_ADD, d_o, d_o_sum, "reduce_dO_O");
  const TensorId softmax_sum = stats_tensor(b, problem, "softmax_sum");
  b.pointwise_into(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, {d_o_sum, one}, softmax_sum,
                   "softmax_sum");
  const std::size_t softmax_sum_bytes =
      align_up(static_cast<std::size_t>(batch * heads * rows) * kFloatBytes);
  graph.bindings.push_back(Binding{Binding::Kind::kScratch, b.uid(softmax_sum), {}, nullptr, 0});

  // P recomputed from the stats, through the same modifier and mask as the forward pass.
  const TensorId s = b.virtual_tensor("S", CUDNN_DATA_FLOAT, {batch, heads, rows, columns});
  b.matmul(q, kt, s, "matmul_Q_KT");
  EmitContext context;
  context.builder = &b;
  context.fault = fault;
  context.score = b.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, {s, scale}, CUDNN_DATA_FLOAT,
                              "scaled_score");
  const ModifiedScore modified = emit_modifier(lowering, context);
  const TensorId shifted = b.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT,
                                       {modified.score, stats}, CUDNN_DATA_FLOAT, "sub_stats");
  const TensorId p =
      b.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, {shifted}, CUDNN_DATA_FLOAT, "exp_s");

  // dV = P^T dO (summed over the query heads of a kv head for GQA).
  const std::vector<std::int64_t> transposed_strides = {heads * rows * columns, rows * columns, 1,
                                                        columns};
  const TensorId pt =
      strided_virtual(b, "P^T", io, {batch, heads, columns, rows}, transposed_strides);
  b.reshape(p, pt, "reshape_p");
  if (heads == heads_kv) {
    b.matmul(pt, dout, dv, "matmul_PT_dO");
  } else {
    const TensorId dv_full = b.virtual_tensor("dV_full", io, {batch, heads, columns, dim_v});
    b.matmul(pt, dout, dv_full, "matmul_PT_dO");
    b.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_full, dv, "reduce_dV");
  }

  // dS = P (dP - softmax_sum), times the modifier's derivative, times the scale.
  const TensorId dp = b.virtual_tensor("dP", CUDNN_DATA_FLOAT, {batch, heads, rows, columns});
  b.matmul(dout, vt, dp, "matmul_dO_VT");
  const TensorId centred = b.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, {dp, softmax_sum},
                                       CUDNN_DATA_FLOAT, "sub_softmax_sum");
  TensorId ds = b.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, {centred, p}, CUDNN_DATA_FLOAT,
                            "mul_dP_P");
  if (lowering.has_derivative) {
    // The bprop of the modifier, from the IR's own derivative (never cuDNN's identity default).
    const TensorId slope = emit_lowering(lowering.derivative, context, "dmod");
    if (fault == CudnnLoweringFault::kDropDerivativeMultiply) {
      context.fault_applied = true;
    } else {
      ds = b.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, {ds, slope}, CUDNN_DATA_FLOAT,
                       "bprop_modifier");
    }
    if (modified.keep >= 0) {
      // Masked elements have P = 0; the select keeps a non-finite derivative there out of dS.
      const TensorId zero = b.scalar_f32(0.0F, "bprop.zero");
      ds = b.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, {ds, zero, modified.keep},
                       CUDNN_DATA_FLOAT, "bprop_mask");
    }
  }
  const TensorId ds_scaled = b.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, {ds, scale},
                                         CUDNN_DATA_FLOAT, "mul_dS_scale");

  // dK = dS^T Q (summed over the query heads of a kv head for GQA).
  const TensorId dst =
      strided_virtual(b, "dS^T", io, {batch, heads, columns, rows}, transposed_strides);
  b.reshape(ds_scaled, dst, "reshape_dS");
  if (heads == heads_kv) {
    b.matmul(dst, q, dk, "matmul_dST_Q");
  } else {
    const TensorId dk_full = b.virtual_tensor("dK_full", io, {batch, heads, columns, dim_qk});
    b.matmul(dst, q, dk_full, "matmul_dST_Q");
    b.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_full, dk, "reduce_dK");
  }

  // dQ = dS K, accumulated in a dense fp32 scratch tensor, then converted.
  const TensorId k = strided_virtual(b, "K", io, k_view.dims, k_view.strides);
  b.reshape(kt, k, "reshape_k");
  const std::vector<std::int64_t> dq_dims = {batch, heads, rows, dim_qk};
  TensorSpec accum;
  accum.name = "dQ_accum";
  accum.type = CUDNN_DATA_FLOAT;
  accum.dims = dq_dims;
  accum.strides = packed_strides(dq_dims);
  const TensorId dq_accum = b.tensor(std::move(accum));
  graph.bindings.push_back(
      Binding{Binding::Kind::kScratch, b.uid(dq_accum), {}, nullptr, softmax_sum_bytes});
  b.matmul(ds_scaled, k, dq_accum, "matmul_dS_K");
  b.pointwise_into(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, {dq_accum}, dq, "identity_dQ");
  graph.scratch_bytes =
      softmax_sum_bytes +
      align_up(static_cast<std::size_t>(batch * heads * rows * dim_qk) * kFloatBytes);

  finish_bindings(graph, context);
  graph.summary = fmt::format("backward graph of {} ops ({}, derivative {} ops)",
                              b.operation_count(), modifier_summary(lowering),
                              lowering.has_derivative ? lowering.derivative.operations : 0);
  return graph;
}

}  // namespace flexattn::cudnn
