// The backward pass (flash-attention-2 style): scores are recomputed tile by tile from Q, K and
// the forward's row statistics, never stored whole. Every output element is summed in a fixed
// order by one work item, so the result is bit-identical for any number of threads:
// - fused (5 products): parallel over (batch, kv head); for each key tile, dK and dV over every
//   query head of the group and every query tile, and dQ of those tiles added up in place;
// - or, when there are too few (batch, kv head) items for the threads or tensor gradients are
//   wanted, a key pass parallel over (batch, kv head, key tile) for dK and dV, then a query pass
//   (query_pass.cpp) parallel over (batch, query tile, head) for dQ and the tensor gradients
//   (7 products: S and dP are computed twice). The two sum dQ identically.
// - A statistics pass first, when P and D must be consistent to a few ulp (see run_backward).
// Like the forward pass, tiles are transposed (keys x queries) so per-query statistics are vectors.
#include "engines/cpu/backward.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engines/cpu/kernels.hpp"
#include "engines/cpu/skipping_product.hpp"
#include "engines/cpu/tile_io.hpp"

namespace flexattn::cpu {

namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
constexpr float kInfinity = std::numeric_limits<float>::infinity();

// out[c * ld_out + r] = scale * in[r * ld_in + c] for r < rows, c < columns.
void transpose(const float* in, std::int64_t ld_in, std::int64_t rows, std::int64_t columns,
               float scale, float* out, std::int64_t ld_out) {
  for (std::int64_t c = 0; c < columns; ++c) {
    for (std::int64_t r = 0; r < rows; ++r) out[c * ld_out + r] = scale * in[r * ld_in + c];
  }
}

}  // namespace

BackwardContext::BackwardContext(const Problem& problem, const Lowering& lowering,
                                 const TileSizes& tiles, const BackwardArgs& arguments)
    : p(problem),
      low(lowering),
      block_q(tiles.block_q),
      block_k(tiles.block_k),
      ld(tiles.ld),
      dim_qk(problem.head_dim_qk()),
      dim_v(problem.head_dim_v()),
      dim_qk_padded(round_up(problem.head_dim_qk(), kVectorWidth)),
      dim_v_padded(round_up(problem.head_dim_v(), kVectorWidth)),
      queries_ld(dim_qk_padded + kLanePadding),
      douts_ld(dim_v_padded + kLanePadding),
      group(problem.heads_q() / problem.heads_kv()),
      scale(static_cast<float>(problem.scale())),
      kernel(kernels()),
      args(arguments),
      inputs{problem.desc().params, arguments.tensors},
      finite_q(problem, true, tiles.block_q),
      finite_k(problem, false, tiles.block_k),
      finite_dout(problem, true, tiles.block_q) {}

BackwardState BackwardContext::make_state(bool with_gradients) const {
  BackwardState s;
  if (!low.identity_score) s.runner.emplace(low.backward_tape, inputs, block_q);
  if (!low.keep_all) s.mask_runner.emplace(low.mask_tape, inputs, block_q);
  if (with_gradients) s.gradient_runner.emplace(low.gradient_tape, inputs, block_q);
  s.queries.resize(to_size(block_q * queries_ld));
  s.queries_t.resize(to_size(dim_qk * ld));
  s.douts.resize(to_size(block_q * douts_ld));
  s.douts_t.resize(to_size(dim_v * ld));
  s.keys.resize(to_size(block_k * dim_qk));
  s.values.resize(to_size(block_k * dim_v));
  for (auto* tile : {&s.raw, &s.probs, &s.dmod, &s.ds, &s.ds_raw}) {
    tile->resize(to_size(block_k * ld));
  }
  for (auto* vector : {&s.lse_shift, &s.row_scale, &s.delta}) vector->resize(to_size(block_q));
  return s;
}

void BackwardContext::load_query_tile(std::int64_t b, std::int64_t h, std::int64_t q0,
                                      std::int64_t nq, const std::vector<float>& delta,
                                      BackwardState& s) const {
  const std::int64_t lanes = round_up(nq, kVectorWidth);
  const RowBlock q_block{sequence_rows(p, args.q, true, b, h), q0, nq, dim_qk};
  read_rows(args.q, q_block, s.queries.data(), queries_ld, lanes, dim_qk_padded);
  transpose(s.queries.data(), queries_ld, lanes, dim_qk, scale, s.queries_t.data(), ld);
  const RowBlock dout_block{sequence_rows(p, args.dout, true, b, h), q0, nq, dim_v};
  read_rows(args.dout, dout_block, s.douts.data(), douts_ld, lanes, dim_v_padded);
  transpose(s.douts.data(), douts_ld, lanes, dim_v, 1.0f, s.douts_t.data(), ld);
  const auto* lse = static_cast<const float*>(args.lse.data);
  for (std::int64_t r = 0; r < lanes; ++r) {
    if (r >= nq) {  // padding lanes: P = exp(s - inf) = 0, so they contribute nothing
      s.lse_shift[r] = kInfinity;
      s.row_scale[r] = 0.0f;
      s.delta[r] = 0.0f;
      continue;
    }
    const std::int64_t at = statistic_offset(p, b, h, q0 + r);
    // A row with no kept key has P = 0: shifting by +inf gives exactly that.
    const float shift = statistics != nullptr ? statistics->max[to_size(at)] : lse[at];
    s.lse_shift[r] = shift == kNegativeInfinity ? kInfinity : shift;
    s.row_scale[r] = statistics != nullptr ? statistics->inverse_sum[to_size(at)] : 1.0f;
    s.delta[r] = delta[to_size(at)];
  }
  s.nan_rows = false;
  for (std::int64_t r = 0; r < nq; ++r) {
    s.nan_rows =
        s.nan_rows || std::isnan(s.lse_shift[to_size(r)]) || std::isnan(s.row_scale[to_size(r)]);
  }
  if (s.runner) s.runner->set_queries(q0, nq);
  if (s.mask_runner) s.mask_runner->set_queries(q0, nq);
  if (s.gradient_runner) s.gradient_runner->set_queries(q0, nq);
}

void BackwardContext::set_head(std::int64_t b, std::int64_t h, BackwardState& s) const {
  const std::int64_t q_len = p.seq_len_q_of(b), kv_len = p.seq_len_kv_of(b);
  if (s.runner) s.runner->set_head(b, h, q_len, kv_len);
  if (s.mask_runner) s.mask_runner->set_head(b, h, q_len, kv_len);
  if (s.gradient_runner) s.gradient_runner->set_head(b, h, q_len, kv_len);
}

void BackwardContext::recompute(TileClass tile_class, std::int64_t k0, std::int64_t nk,
                                std::int64_t nq, const RowsView& keys, const RowsView& values,
                                BackwardState& s) const {
  const std::int64_t lanes = round_up(nq, kVectorWidth);
  float* raw = s.raw.data();      // (nk, lanes) of (block_k, ld): scale * K Q^T
  float* probs = s.probs.data();  // modified scores, then P^T
  float* dmod = s.dmod.data();    // d score_mod / d score
  // S^T = K (scale Q)^T
  kernel.gemm({nk, lanes, dim_qk, keys.rows, keys.ld, 1, s.queries_t.data(), ld, raw, ld, false});
  for (std::int64_t c = 0; c < nk; ++c) {
    float* raw_row = raw + c * ld;
    float* prob_row = probs + c * ld;
    if (s.runner) {
      float* const destinations[] = {prob_row, dmod + c * ld};
      s.runner->run(k0 + c, raw_row, destinations);
    } else {
      std::copy_n(raw_row, lanes, prob_row);
    }
    if (tile_class == TileClass::kMixed) {  // kAllTrue tiles skip the mask
      s.mask_runner->run(k0 + c, nullptr);
      const std::int32_t* keep = s.mask_runner->ints(low.mask_tape.output(0));
      for (std::int64_t r = 0; r < lanes; ++r) {
        prob_row[r] = keep[r] != 0 ? prob_row[r] : kNegativeInfinity;
      }
    }
    // Padding lanes hold score_mod at a dummy score (1 / score is inf there), and their shift is
    // +inf: exp(inf - inf) would be NaN and reach dK and dV through the products.
    std::fill(prob_row + nq, prob_row + lanes, kNegativeInfinity);
  }
  // A row whose LSE (or max or reciprocal sum) is NaN (a NaN among its kept scores) gets P = NaN
  // everywhere, where its removed positions (S' = -inf) must stay 0: their S' wait in ds_raw
  // (written only by softmax_gradient below) and are put back as 0 after the exponential.
  const bool nan_rows = s.nan_rows;
  if (nan_rows) std::copy_n(probs, nk * ld, s.ds_raw.data());
  // P^T = exp(S'^T - LSE), or exp(S'^T - max) / sum from the statistics pass
  kernel.exp_shifted(probs, nk, lanes, ld, s.lse_shift.data(),
                     statistics != nullptr ? s.row_scale.data() : nullptr);
  for (std::int64_t at = 0; nan_rows && at < nk * ld; ++at) {
    if (s.ds_raw[to_size(at)] == kNegativeInfinity) probs[at] = 0.0f;
  }
  // dP^T = V dO^T, then dS = P (dP - D) (d loss / d modified score) and dS * d score_mod / d
  // score (d loss / d raw score).
  kernel.gemm(
      {nk, lanes, dim_v, values.rows, values.ld, 1, s.douts_t.data(), ld, s.ds.data(), ld, false});
  kernel.softmax_gradient(probs, s.runner ? dmod : nullptr, s.ds.data(), s.ds_raw.data(), nk, lanes,
                          ld, s.delta.data());
}

std::vector<float> BackwardContext::row_deltas(const TensorView& out) const {
  // D = rowsum(dO * O), per (batch, head, query), indexed like the LSE.
  std::vector<float> delta(to_size(p.heads_q() * p.total_tokens_q()), 0.0f);
  const std::int64_t heads = p.heads_q();
  const auto make_state = [&] { return std::vector<float>(to_size(2 * block_q * dim_v)); };
  parallel_for(p.batch() * heads, make_state, [&](std::int64_t task, std::vector<float>& rows) {
    const std::int64_t b = task / heads, h = task % heads, q_len = p.seq_len_q_of(b);
    float* outs = rows.data();                     // (block_q, dim_v)
    float* douts = rows.data() + block_q * dim_v;  // (block_q, dim_v)
    const SequenceRows out_rows = sequence_rows(p, out, true, b, h);
    const SequenceRows dout_rows = sequence_rows(p, args.dout, true, b, h);
    for (std::int64_t q0 = 0; q0 < q_len; q0 += block_q) {
      const std::int64_t nq = std::min(block_q, q_len - q0);
      read_rows(out, {out_rows, q0, nq, dim_v}, outs, dim_v, nq, dim_v);
      read_rows(args.dout, {dout_rows, q0, nq, dim_v}, douts, dim_v, nq, dim_v);
      for (std::int64_t r = 0; r < nq; ++r) {
        float sum = 0.0f;
        for (std::int64_t j = 0; j < dim_v; ++j) sum += outs[r * dim_v + j] * douts[r * dim_v + j];
        delta[to_size(statistic_offset(p, b, h, q0 + r))] = sum;
      }
    }
  });
  return delta;
}

void CpuPlan::run_backward(const BackwardArgs& args) const {
  bool tensor_gradients = false;
  for (const auto& [name, view] : args.tensor_grads) {
    for (const LoadDerivative& load : lowering_.load_derivatives) {
      tensor_gradients = tensor_gradients || load.tensor == name;
    }
  }
  // P = exp(S' - LSE) carries the rounding of the fp32 LSE (|LSE| * 2^-24 relative), and
  // D = rowsum(dO * O) the rounding of the stored O (2^-11 relative for fp16, 2^-8 for bf16) and
  // of a different summation than the backward's own P and dP. dS inherits both, and the
  // gradient of a per-head tensor (a learned ALiBi slope collects dS * (kv - q) over every pair)
  // sums them up. So when such a gradient is wanted, or O is stored in 16 bits, a statistics
  // pass (a forward with dP = dO V^T in place of P V) first computes the running max, the
  // reciprocal sum and D = sum P dP, consistent with the P of the backward to a few ulp.
  RowStatistics statistics;
  std::vector<float> delta;
  BackwardContext context(problem_, lowering_, tiles_, args);
  if (problem_.dtype() != DType::kF32 || tensor_gradients) {
    const auto rows = to_size(problem_.heads_q() * problem_.total_tokens_q());
    statistics.max.resize(rows);
    statistics.inverse_sum.resize(rows);
    statistics.delta.resize(rows);
    forward_pass({args.q, args.k, args.v, {}, {}, args.tensors, args.stream}, &args.dout,
                 &statistics);
    context.statistics = &statistics;
    delta = std::move(statistics.delta);
  } else {
    delta = context.row_deltas(args.out);
  }
  // Fused (5 products) when there are enough (batch, kv head) items to keep every thread busy
  // and no tensor gradient is wanted; else the key pass and the query pass (7 products, every
  // key tile its own item). Both sum every output in the same order with the same kernels, so
  // they give bit-identical results and the choice may depend on the thread count.
  const std::int64_t items = problem_.batch() * problem_.heads_kv();
  if (!tensor_gradients && items >= kFusedItemsPerThread * omp_get_max_threads()) {
    fused_pass(context, delta);
    for (const auto& [name, view] : args.tensor_grads) {  // read only by the mask: zero
      for (std::int64_t e = 0; e < view.numel(); ++e) view.store(e, 0.0);
    }
    return;
  }
  key_pass(context, delta);
  query_pass(context, delta);
}

KeyTileState CpuPlan::make_key_tile_state(const BackwardContext& x) const {
  KeyTileState s{x.make_state(false), {}, {}, {}};
  s.dk.resize(to_size(x.block_k * x.dim_qk_padded));
  s.dv.resize(to_size(x.block_k * x.dim_v_padded));
  return s;
}

void CpuPlan::key_tile(const BackwardContext& x, const std::vector<float>& delta, std::int64_t b,
                       std::int64_t h_kv, std::int64_t kt, KeyTileState& state,
                       float* dq_blocks) const {
  const Problem& p = problem_;
  BackwardState& s = state.tiles;
  const std::int64_t q_len = p.seq_len_q_of(b), kv_len = p.seq_len_kv_of(b);
  const std::int64_t k0 = kt * x.block_k, nk = std::min(x.block_k, kv_len - k0);
  const TileGrid& tile_grid = grid(b);
  const RowBlock k_block{sequence_rows(p, x.args.k, false, b, h_kv), k0, nk, x.dim_qk};
  const RowBlock v_block{sequence_rows(p, x.args.v, false, b, h_kv), k0, nk, x.dim_v};
  const RowsView keys = float_rows(x.args.k, k_block, s.keys.data());
  const RowsView values = float_rows(x.args.v, v_block, s.values.data());
  std::fill(state.dk.begin(), state.dk.end(), 0.0f);
  std::fill(state.dv.begin(), state.dv.end(), 0.0f);
  const std::int64_t dq_block = x.dim_qk * x.ld;
  for (std::int64_t g = 0; g < x.group; ++g) {
    const std::int64_t h = h_kv * x.group + g;
    x.set_head(b, h, s);
    for (std::int64_t qt = 0; qt < tile_grid.query_tiles; ++qt) {
      const TileClass tile_class = tile_grid.at(qt, kt);
      if (tile_class == TileClass::kAllFalse) continue;  // proven fully masked: skipped
      const std::int64_t q0 = qt * x.block_q, nq = std::min(x.block_q, q_len - q0);
      const std::int64_t lanes = round_up(nq, kVectorWidth);
      x.load_query_tile(b, h, q0, nq, delta, s);
      x.recompute(tile_class, k0, nk, nq, keys, values, s);
      const bool q_finite = x.finite_q.at(b, h, qt, s.queries.data(), x.queries_ld, nq, x.dim_qk);
      const bool dout_finite = x.finite_dout.at(b, h, qt, s.douts.data(), x.douts_ld, nq, x.dim_v);
      // dV += P^T dO;  dK += dS^T Q (the scale is applied once, at the end)
      // (P and dS are 0 where nothing may contribute: see skipping_product.hpp)
      gemm_skipping_zeros(x.kernel,
                          {nk, x.dim_v_padded, lanes, s.probs.data(), x.ld, 1, s.douts.data(),
                           x.douts_ld, state.dv.data(), x.dim_v_padded, true},
                          DataOperand::kB, dout_finite, s.cleaned);
      gemm_skipping_zeros(x.kernel,
                          {nk, x.dim_qk_padded, lanes, s.ds_raw.data(), x.ld, 1, s.queries.data(),
                           x.queries_ld, state.dk.data(), x.dim_qk_padded, true},
                          DataOperand::kB, q_finite, s.cleaned);
      if (dq_blocks != nullptr) {  // dQ^T += K^T dS^T, exactly as the query pass adds it
        float* dq_t = dq_blocks + (g * tile_grid.query_tiles + qt) * dq_block;
        gemm_skipping_zeros(
            x.kernel,
            {x.dim_qk, lanes, nk, keys.rows, 1, keys.ld, s.ds_raw.data(), x.ld, dq_t, x.ld, true},
            DataOperand::kA, x.finite_k.at(b, h_kv, kt, keys.rows, keys.ld, nk, x.dim_qk),
            s.cleaned);
      }
    }
  }
  for (float& value : state.dk) value *= x.scale;
  write_rows(x.args.dk, {sequence_rows(p, x.args.dk, false, b, h_kv), k0, nk, x.dim_qk},
             state.dk.data(), x.dim_qk_padded);
  write_rows(x.args.dv, {sequence_rows(p, x.args.dv, false, b, h_kv), k0, nk, x.dim_v},
             state.dv.data(), x.dim_v_padded);
}

void CpuPlan::key_pass(const BackwardContext& x, const std::vector<float>& delta) const {
  const std::int64_t heads_kv = problem_.heads_kv();
  std::vector<std::pair<std::int64_t, std::int64_t>> key_tiles;  // (batch, key tile)
  for (std::int64_t b = 0; b < problem_.batch(); ++b) {
    for (std::int64_t kt = 0; kt < grid(b).key_tiles; ++kt) key_tiles.emplace_back(b, kt);
  }
  parallel_for(
      static_cast<std::int64_t>(key_tiles.size()) * heads_kv,
      [&] { return make_key_tile_state(x); },
      [&](std::int64_t index, KeyTileState& state) {
        const auto [b, kt] = key_tiles[to_size(index / heads_kv)];
        key_tile(x, delta, b, index % heads_kv, kt, state, nullptr);
      });
}

void CpuPlan::fused_pass(const BackwardContext& x, const std::vector<float>& delta) const {
  const Problem& p = problem_;
  const std::int64_t heads_kv = p.heads_kv();
  parallel_for(
      p.batch() * heads_kv, [&] { return make_key_tile_state(x); },
      [&](std::int64_t index, KeyTileState& state) {
        const std::int64_t b = index / heads_kv, h_kv = index % heads_kv;
        const TileGrid& tile_grid = grid(b);
        const std::int64_t dq_block = x.dim_qk * x.ld;
        // dQ^T of every query tile of the group's heads: (group, query_tiles, dim_qk, ld)
        state.dq.assign(to_size(x.group * tile_grid.query_tiles * dq_block), 0.0f);
        for (std::int64_t kt = 0; kt < tile_grid.key_tiles; ++kt) {
          key_tile(x, delta, b, h_kv, kt, state, state.dq.data());
        }
        const std::int64_t q_len = p.seq_len_q_of(b);
        for (std::int64_t g = 0; g < x.group; ++g) {
          const std::int64_t h = h_kv * x.group + g;
          for (std::int64_t qt = 0; qt < tile_grid.query_tiles; ++qt) {
            const std::int64_t q0 = qt * x.block_q, nq = std::min(x.block_q, q_len - q0);
            const RowBlock dq_rows{sequence_rows(p, x.args.dq, true, b, h), q0, nq, x.dim_qk};
            write_rows_transposed(x.args.dq, dq_rows,
                                  &state.dq[to_size((g * tile_grid.query_tiles + qt) * dq_block)],
                                  x.ld, x.scale, state.tiles.queries.data());
          }
        }
      });
}

}  // namespace flexattn::cpu
