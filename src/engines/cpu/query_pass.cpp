// The query pass of the backward: dQ, and the gradients of the float tensors the score modifier
// reads (e.g. a learned bias), parallel over (batch, query tile, head) work items.
//
// A tensor gradient is a scatter-add of dS * d score_mod / d load at the evaluated indices, and
// different items may add to the same element. To stay bit-identical for any thread count, each
// item accumulates its own contributions in float64 into a private window of the tensor (the
// flat range its indices can reach, from the interval analysis: one row of a bias, one entry of
// a per-head slope), and the windows are added to the totals in item order. Items run in waves of
// one per thread, so memory stays at one window per thread.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "engines/cpu/backward.hpp"
#include "engines/cpu/skipping_product.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cpu {

namespace {

// A requested tensor gradient: the tensor's shape and the loads of it that the score modifier
// differentiates.
struct GradientTarget {
  std::vector<std::int64_t> shape, strides;  // contiguous strides
  std::int64_t numel = 1;
  std::vector<std::size_t> loads;  // indices into Lowering::load_derivatives
};

// One item's contributions to one tensor: elements [first, first + values.size()).
struct GradientWindow {
  std::int64_t first = 0;
  std::vector<double> values;
};

// Where gradient_tape keeps each load's indices and derivative (see engine.cpp).
struct GradientOutputs {
  std::vector<std::size_t> first_index;  // per load: output of its index 0
  std::vector<std::size_t> derivative;   // per load
};

GradientOutputs gradient_outputs(const std::vector<LoadDerivative>& loads) {
  GradientOutputs outputs;
  std::size_t next = 0;
  for (const LoadDerivative& load : loads) {
    outputs.first_index.push_back(next);
    next += load.indices.size();
  }
  for (std::size_t n = 0; n < loads.size(); ++n) outputs.derivative.push_back(next + n);
  return outputs;
}

}  // namespace

void CpuPlan::query_pass(const BackwardContext& x, const std::vector<float>& delta) const {
  const Problem& p = problem_;
  const Lowering& low = lowering_;
  const std::int64_t heads = p.heads_q();
  std::vector<std::pair<std::int64_t, std::int64_t>> query_tiles;  // (batch, query tile)
  for (std::int64_t b = 0; b < p.batch(); ++b) {
    for (std::int64_t qt = 0; qt < grid(b).query_tiles; ++qt) query_tiles.emplace_back(b, qt);
  }
  const auto items = static_cast<std::int64_t>(query_tiles.size()) * heads;

  std::vector<GradientTarget> targets;
  bool any_load = false;
  for (const auto& [name, view] : x.args.tensor_grads) {
    GradientTarget target;
    target.shape = p.desc().tensors.at(name).shape;
    target.strides = contiguous_strides(target.shape);
    for (std::int64_t extent : target.shape) target.numel *= extent;
    for (std::size_t n = 0; n < low.load_derivatives.size(); ++n) {
      if (low.load_derivatives[n].tensor == name) target.loads.push_back(n);
    }
    any_load = any_load || !target.loads.empty();
    targets.push_back(std::move(target));
  }
  const GradientOutputs outputs = gradient_outputs(low.load_derivatives);

  struct State {
    BackwardState tiles;
    std::vector<float> dq_t;  // (dim_qk, ld)
  };
  const auto make_state = [&] {
    State s{x.make_state(any_load), {}};
    s.dq_t.resize(to_size(x.dim_qk * x.ld));
    return s;
  };

  // The flat window of each target that item (b, h, q0, nq) can reach.
  const auto size_windows = [&](std::int64_t b, std::int64_t h, std::int64_t q0, std::int64_t nq,
                                std::vector<GradientWindow>& windows) {
    const auto at = [](std::int64_t value) { return static_cast<double>(value); };
    LeafRanges ranges = p.leaf_ranges();
    const std::int64_t q_len = p.seq_len_q_of(b), kv_len = p.seq_len_kv_of(b);
    ranges.batch = {at(b), at(b)};
    ranges.head = {at(h), at(h)};
    ranges.query = {at(q0), at(q0 + nq - 1)};
    ranges.key = {0.0, at(kv_len - 1)};
    ranges.query_length = {at(q_len), at(q_len)};
    ranges.key_length = {at(kv_len), at(kv_len)};
    windows.resize(targets.size());
    for (std::size_t t = 0; t < targets.size(); ++t) {
      const GradientTarget& target = targets[t];
      std::int64_t lo = target.numel, hi = -1;
      for (std::size_t n : target.loads) {
        const LoadDerivative& load = low.load_derivatives[n];
        std::int64_t flat_lo = 0, flat_hi = 0;
        for (std::size_t axis = 0; axis < load.indices.size(); ++axis) {
          const Graph& index = load.indices[axis];
          const Interval range = node_intervals(index, ranges)[to_size(index.root())];
          const std::int64_t last = target.shape[axis] - 1;
          const bool known =
              std::isfinite(range.lo) && std::isfinite(range.hi) && range.lo <= range.hi;
          const std::int64_t axis_lo =
              known ? std::clamp(static_cast<std::int64_t>(std::floor(range.lo)), std::int64_t{0},
                                 last)
                    : 0;
          const std::int64_t axis_hi =
              known ? std::clamp(static_cast<std::int64_t>(std::ceil(range.hi)), std::int64_t{0},
                                 last)
                    : last;
          flat_lo += axis_lo * target.strides[axis];
          flat_hi += axis_hi * target.strides[axis];
        }
        lo = std::min(lo, flat_lo);
        hi = std::max(hi, flat_hi);
      }
      GradientWindow& window = windows[t];
      window.first = hi < lo ? 0 : lo;
      window.values.assign(to_size(hi < lo ? 0 : hi - lo + 1), 0.0);
    }
  };

  // Adds this key tile's contributions (dS w.r.t. the modified score times the load derivative).
  const auto scatter = [&](BackwardState& s, std::int64_t k0, std::int64_t nk, std::int64_t nq,
                           std::vector<GradientWindow>& windows) {
    TapeRunner& runner = *s.gradient_runner;
    for (std::int64_t c = 0; c < nk; ++c) {
      const float* ds_row = &s.ds[to_size(c * x.ld)];
      if (std::none_of(ds_row, ds_row + nq, [](float ds) { return ds != 0.0f; })) continue;
      runner.run(k0 + c, &s.raw[to_size(c * x.ld)]);
      for (std::size_t t = 0; t < targets.size(); ++t) {
        const GradientTarget& target = targets[t];
        GradientWindow& window = windows[t];
        for (std::size_t n : target.loads) {
          const float* derivative = runner.floats(low.gradient_tape.output(outputs.derivative[n]));
          const std::size_t rank = target.shape.size();
          for (std::int64_t r = 0; r < nq; ++r) {
            if (ds_row[r] == 0.0f) continue;
            std::int64_t flat = 0;
            for (std::size_t axis = 0; axis < rank; ++axis) {
              const std::int32_t* index =
                  runner.ints(low.gradient_tape.output(outputs.first_index[n] + axis));
              flat += std::clamp<std::int64_t>(index[r], 0, target.shape[axis] - 1) *
                      target.strides[axis];
            }
            const std::int64_t offset = flat - window.first;
            if (offset < 0 || offset >= static_cast<std::int64_t>(window.values.size())) {
              throw_internal(fmt::format(
                  "cpu: gradient of '{}' reaches element {} outside its proven range [{}, {})",
                  low.load_derivatives[n].tensor, flat, window.first,
                  window.first + static_cast<std::int64_t>(window.values.size())));
            }
            window.values[to_size(offset)] +=
                static_cast<double>(ds_row[r]) * static_cast<double>(derivative[r]);
          }
        }
      }
    }
  };

  const auto item = [&](std::int64_t index, State& state, std::vector<GradientWindow>* windows) {
    BackwardState& s = state.tiles;
    const auto [b, qt] = query_tiles[to_size(index / heads)];
    const std::int64_t h = index % heads, h_kv = h / x.group;
    const std::int64_t q_len = p.seq_len_q_of(b), kv_len = p.seq_len_kv_of(b);
    const std::int64_t q0 = qt * x.block_q, nq = std::min(x.block_q, q_len - q0);
    const std::int64_t lanes = round_up(nq, kVectorWidth);
    const TileGrid& tile_grid = grid(b);
    if (windows != nullptr) size_windows(b, h, q0, nq, *windows);
    x.set_head(b, h, s);
    x.load_query_tile(b, h, q0, nq, delta, s);
    for (std::int64_t j = 0; j < x.dim_qk; ++j) {
      std::fill_n(&state.dq_t[to_size(j * x.ld)], lanes, 0.0f);
    }
    const SequenceRows k_rows = sequence_rows(p, x.args.k, false, b, h_kv);
    const SequenceRows v_rows = sequence_rows(p, x.args.v, false, b, h_kv);
    for (std::int64_t kt = 0; kt < tile_grid.key_tiles; ++kt) {
      const TileClass tile_class = tile_grid.at(qt, kt);
      if (tile_class == TileClass::kAllFalse) continue;  // proven fully masked: skipped
      const std::int64_t k0 = kt * x.block_k, nk = std::min(x.block_k, kv_len - k0);
      const RowsView keys = float_rows(x.args.k, {k_rows, k0, nk, x.dim_qk}, s.keys.data());
      const RowsView values = float_rows(x.args.v, {v_rows, k0, nk, x.dim_v}, s.values.data());
      x.recompute(tile_class, k0, nk, nq, keys, values, s);
      // dQ^T += K^T dS^T
      gemm_skipping_zeros(x.kernel,
                          {x.dim_qk, lanes, nk, keys.rows, 1, keys.ld, s.ds_raw.data(), x.ld,
                           state.dq_t.data(), x.ld, true},
                          DataOperand::kA,
                          x.finite_k.at(b, h_kv, kt, keys.rows, keys.ld, nk, x.dim_qk), s.cleaned);
      if (windows != nullptr) scatter(s, k0, nk, nq, *windows);
    }
    const RowBlock dq_block{sequence_rows(p, x.args.dq, true, b, h), q0, nq, x.dim_qk};
    write_rows_transposed(x.args.dq, dq_block, state.dq_t.data(), x.ld, x.scale, s.queries.data());
  };

  std::vector<std::vector<double>> totals;
  for (const GradientTarget& target : targets) totals.emplace_back(to_size(target.numel), 0.0);
  if (!any_load) {
    parallel_for(items, make_state,
                 [&](std::int64_t index, State& state) { item(index, state, nullptr); });
  } else {
    const std::int64_t wave = std::max(1, omp_get_max_threads());
    std::vector<std::vector<GradientWindow>> windows(to_size(wave));
    for (std::int64_t first = 0; first < items; first += wave) {
      const std::int64_t size = std::min(wave, items - first);
      parallel_for(size, make_state, [&](std::int64_t i, State& state) {
        item(first + i, state, &windows[to_size(i)]);
      });
      for (std::int64_t i = 0; i < size; ++i) {  // item order: independent of the thread count
        for (std::size_t t = 0; t < targets.size(); ++t) {
          const GradientWindow& window = windows[to_size(i)][t];
          double* total = totals[t].data() + window.first;
          for (std::size_t e = 0; e < window.values.size(); ++e) total[e] += window.values[e];
        }
      }
    }
  }
  std::size_t t = 0;
  for (const auto& [name, view] : x.args.tensor_grads) {
    const std::vector<double>& total = totals[t++];
    for (std::size_t e = 0; e < total.size(); ++e)
      view.store(static_cast<std::int64_t>(e), total[e]);
  }
}

}  // namespace flexattn::cpu
