// The forward pass: flash attention over (query tile x key tile) steps with an online softmax in
// float32, parallel over (batch, query tile, head).
//
// Everything is held transposed, with queries along the vector lanes: the score tile is
// S^T = K Q^T (keys x queries), the output accumulator is O^T (head_dim_v x queries), and the
// running max and sum are vectors over queries, so the softmax never reduces across lanes.
// Both products use the same kernel: S^T = K (Q^T) reads the packed K rows, and O^T += V^T P^T
// reads the packed V rows transposed through the kernel's strides; no tile is transposed.
// With `dout`, the same loop is the backward's statistics pass: dP^T = V dO^T replaces the
// output product and D = sum P dP is accumulated, rescaled like the sum.
// A forward alone whose sequences' queries fit one tile (decoding, short chunks) splits each long
// sequence's keys into runs of kSplitKeyTiles tiles, so a batch of a few sequences still fills
// every thread: each split keeps its own max, sum and unnormalised output, combined by their
// log-sum-exp afterwards. The split depends only on the problem and the sequence lengths (not on
// the thread count or the page size), so a run's bits do not depend on the machine.
#include <algorithm>
#include <cmath>
#include <limits>

#include "engines/cpu/kernels.hpp"
#include "engines/cpu/plan.hpp"
#include "engines/cpu/skipping_product.hpp"
#include "engines/cpu/tile_io.hpp"

namespace flexattn::cpu {

namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
// Key tiles per split of a forward whose queries fit one tile (64 x 32 = 2048 keys).
constexpr std::int64_t kSplitKeyTiles = 32;

// One thread's buffers, sized for a tile.
struct ForwardState {
  std::optional<TapeRunner> score_runner, mask_runner;
  std::vector<float> queries_t;  // (head_dim_qk, ld): scale * Q^T (ld: padded block_q)
  std::vector<float> keys;       // (block_k, head_dim_qk): the K tile packed to fp32
  std::vector<float> values;     // (block_k, head_dim_v): the V tile packed to fp32
  std::vector<float> scores;     // (block_k, ld): S^T
  std::vector<float> probs;      // (block_k, ld): S'^T, then P^T
  std::vector<float> out_t;      // (head_dim_v, ld): unnormalised O^T (or dO^T)
  std::vector<float> row_max, row_sum, alpha;  // (block_q,) each
  std::vector<float> row_delta;                // (block_q,): statistics pass, unnormalised D
  std::vector<float> scratch;                  // (block_q, max(head_dim_qk, head_dim_v))
  std::vector<float> cleaned;                  // gemm_skipping_zeros's copy of a non-finite tile
  std::vector<std::int32_t> lane_heads, lane_queries;  // a packed task's (block_q,) each
};

// A KV cache problem's run: each sequence's length and query offset (its queries are the last
// q_len positions of the cache) and its tile grid, classified for those.
struct CacheRun {
  std::vector<std::int64_t> lengths, offsets;
  std::vector<TileGrid> grids;
};

// Rows [k0, k0 + nk) (columns [0, dim)) of sequence b's cache in head h_kv, page by page
// through the page table: visit(block, at) for each page's run of them, `at` its first row's
// index from k0.
template <class Visit>
void for_each_page_run(const TensorView& pool, const TensorView& page_table,
                       const KvCacheDesc& cache, std::int64_t b, std::int64_t h_kv, std::int64_t k0,
                       std::int64_t nk, std::int64_t dim, Visit visit) {
  const auto* pages = static_cast<const std::int32_t*>(page_table.data) + b * cache.max_pages;
  for (std::int64_t s = k0; s < k0 + nk;) {
    const std::int64_t page = pages[s / cache.page_size], slot = s % cache.page_size;
    const std::int64_t count = std::min(cache.page_size - slot, k0 + nk - s);
    const SequenceRows rows{page * pool.strides[0] + h_kv * pool.strides[2], pool.strides[1]};
    visit(RowBlock{rows, slot, count, dim}, s - k0);
    s += count;
  }
}

// Those rows as float32 rows of `dim` in `buffer`.
RowsView cache_rows(const TensorView& pool, const TensorView& page_table, const KvCacheDesc& cache,
                    std::int64_t b, std::int64_t h_kv, std::int64_t k0, std::int64_t nk,
                    std::int64_t dim, float* buffer) {
  for_each_page_run(pool, page_table, cache, b, h_kv, k0, nk, dim,
                    [&](const RowBlock& block, std::int64_t at) {
                      read_rows(pool, block, buffer + at * dim, dim, block.count, dim);
                    });
  return {buffer, dim};
}

// Prefetches what cache_rows would read.
void prefetch_cache_rows(const TensorView& pool, const TensorView& page_table,
                         const KvCacheDesc& cache, std::int64_t b, std::int64_t h_kv,
                         std::int64_t k0, std::int64_t nk, std::int64_t dim) {
  for_each_page_run(pool, page_table, cache, b, h_kv, k0, nk, dim,
                    [&](const RowBlock& block, std::int64_t) { prefetch_rows(pool, block); });
}

}  // namespace

void CpuPlan::run_forward(const ForwardArgs& args) const { forward_pass(args, nullptr, nullptr); }

void CpuPlan::forward_pass(const ForwardArgs& args, const TensorView* dout,
                           RowStatistics* statistics) const {
  const Problem& p = problem_;
  const Lowering& low = lowering_;
  const std::int64_t block_q = tiles_.block_q, block_k = tiles_.block_k, ld = tiles_.ld;
  const std::int64_t dim_qk = p.head_dim_qk(), dim_v = p.head_dim_v();
  const std::int64_t heads = p.heads_q(), group = p.heads_q() / p.heads_kv();
  const auto scale = static_cast<float>(p.scale());
  const Kernels& kernel = kernels();
  const TapeInputs inputs{p.desc().params, args.tensors};

  const std::optional<KvCacheDesc>& cache = p.kv_cache();
  CacheRun cache_run;
  for (std::int64_t b = 0; cache && b < p.batch(); ++b) {
    const std::int64_t length = static_cast<const std::int32_t*>(args.cache_lens.data)[b];
    const std::int64_t offset = length == 0 ? 0 : length - p.seq_len_q_of(b);
    cache_run.lengths.push_back(length);
    cache_run.offsets.push_back(offset);
    cache_run.grids.push_back(classify_cache_tiles(p, low.mask_mod, low.keep_all, tiles_, b,
                                                   p.seq_len_q_of(b), length, offset));
  }
  const auto grid_of = [&](std::int64_t b) -> const TileGrid& {
    return cache ? cache_run.grids[to_size(b)] : grid(b);
  };

  // A decoding step (the forward alone, every sequence's queries of a GQA group within one tile)
  // packs the group's query heads into the lanes: lane g * nq + r is head h_kv * group + g at
  // row r, so a K and V tile is read, converted and multiplied once for the group instead of
  // once per head. Each lane computes exactly what it computes unpacked.
  const bool forward_alone = dout == nullptr && statistics == nullptr;
  const bool packed = forward_alone && group > 1 && p.seq_len_q() * group <= block_q;
  const std::int64_t heads_per_task = packed ? group : 1;
  const std::int64_t tasks_per_tile = heads / heads_per_task;

  // Work items: (batch, query tile, key split), each times heads (or GQA groups when packed),
  // heads innermost so neighbouring tasks of a GQA group read the same K and V. A split's task
  // leaves its part (max, sum and unnormalised O^T of its `used` lanes) in `partials`.
  struct Item {
    std::int64_t b, qt, first_tile, end_tile;
    std::int64_t partial;  // offset of the part of its first task; -1: not split
  };
  std::vector<Item> items;
  std::vector<std::pair<std::int64_t, std::int64_t>> split_tiles;  // (first item, splits)
  std::int64_t partial_floats = 0;
  for (std::int64_t b = 0; b < p.batch(); ++b) {
    const TileGrid& tile_grid = grid_of(b);
    const std::int64_t splits = forward_alone && tile_grid.query_tiles == 1
                                    ? (tile_grid.key_tiles + kSplitKeyTiles - 1) / kSplitKeyTiles
                                    : 1;
    for (std::int64_t qt = 0; qt < tile_grid.query_tiles; ++qt) {
      if (splits <= 1) {
        items.push_back({b, qt, 0, tile_grid.key_tiles, -1});
        continue;
      }
      split_tiles.emplace_back(static_cast<std::int64_t>(items.size()), splits);
      const std::int64_t used = heads_per_task * std::min(block_q, p.seq_len_q_of(b));
      for (std::int64_t split = 0; split < splits; ++split) {
        items.push_back({b, qt, split * kSplitKeyTiles,
                         std::min(tile_grid.key_tiles, (split + 1) * kSplitKeyTiles),
                         partial_floats});
        partial_floats += tasks_per_tile * used * (2 + dim_v);
      }
    }
  }
  std::vector<float> partials(to_size(partial_floats));
  float* lse = static_cast<float*>(args.lse.data);
  const bool with_output = !args.out.empty();
  // V is the data of the only product that skips zero weights (O^T += V^T P^T).
  const FiniteTiles finite_v = cache ? FiniteTiles(cache_run.lengths, p.heads_kv(), block_k)
                                     : FiniteTiles(p, false, block_k);

  const auto make_state = [&] {
    ForwardState s;
    if (!low.identity_score) s.score_runner.emplace(low.score_tape, inputs, block_q);
    if (!low.keep_all) s.mask_runner.emplace(low.mask_tape, inputs, block_q);
    s.queries_t.resize(to_size(dim_qk * ld));
    s.keys.resize(to_size(block_k * dim_qk));
    s.values.resize(to_size(block_k * dim_v));
    s.scores.resize(to_size(block_k * ld));
    s.probs.resize(to_size(block_k * ld));
    s.out_t.resize(to_size(dim_v * ld));
    for (auto* vector : {&s.row_max, &s.row_sum, &s.alpha, &s.row_delta}) {
      vector->resize(to_size(block_q));
    }
    s.scratch.resize(to_size(block_q * std::max(dim_qk, dim_v)));
    s.lane_heads.resize(to_size(block_q));
    s.lane_queries.resize(to_size(block_q));
    return s;
  };

  // Normalises the rows of heads h .. of query tile qt from the state's max, sum and O^T, and
  // writes O, the LSE and the statistics; a row with no kept key has O = 0 and LSE = -inf.
  const auto finish = [&](ForwardState& s, std::int64_t b, std::int64_t qt, std::int64_t h) {
    const std::int64_t q0 = qt * block_q, nq = std::min(block_q, p.seq_len_q_of(b) - q0);
    const std::int64_t used = heads_per_task * nq;
    for (std::int64_t r = 0; r < used; ++r) {
      const bool empty = s.row_sum[r] == 0.0f;
      s.alpha[r] = empty ? 0.0f : 1.0f / s.row_sum[r];
      const std::int64_t at = statistic_offset(p, b, h + r / nq, q0 + r % nq);
      if (lse != nullptr) {
        lse[at] = empty ? kNegativeInfinity : s.row_max[r] + std::log(s.row_sum[r]);
      }
      if (statistics != nullptr) {
        statistics->max[to_size(at)] = s.row_max[r];
        statistics->inverse_sum[to_size(at)] = s.alpha[r];
        statistics->delta[to_size(at)] = s.row_delta[r] * s.alpha[r];
      }
    }
    if (!with_output) return;
    for (std::int64_t j = 0; j < dim_v; ++j) {
      float* out_row = &s.out_t[to_size(j * ld)];
      for (std::int64_t r = 0; r < used; ++r) out_row[r] *= s.alpha[r];
    }
    for (std::int64_t g = 0; g < heads_per_task; ++g) {
      const RowBlock o_block{sequence_rows(p, args.out, true, b, h + g), q0, nq, dim_v};
      write_rows_transposed(args.out, o_block, s.out_t.data() + g * nq, ld, 1.0f, s.scratch.data());
    }
  };

  const auto task = [&](std::int64_t index, ForwardState& s) {
    const Item& item = items[to_size(index / tasks_per_tile)];
    const std::int64_t b = item.b, qt = item.qt;
    // Heads h .. h + heads_per_task - 1, all of kv head h_kv.
    const std::int64_t h = index % tasks_per_tile * heads_per_task, h_kv = h / group;
    const std::int64_t q_len = p.seq_len_q_of(b);
    const std::int64_t kv_len = cache ? cache_run.lengths[to_size(b)] : p.seq_len_kv_of(b);
    const std::int64_t q_offset = cache ? cache_run.offsets[to_size(b)] : 0;
    const std::int64_t q0 = qt * block_q, nq = std::min(block_q, q_len - q0);
    const std::int64_t used = heads_per_task * nq;  // lanes holding a query row
    const std::int64_t lanes = round_up(used, kVectorWidth);
    const TileGrid& tile_grid = grid_of(b);

    for (std::int64_t g = 0; g < heads_per_task; ++g) {  // the last head also zeroes the padding
      const RowBlock q_block{sequence_rows(p, args.q, true, b, h + g), q0, nq, dim_qk};
      read_rows_transposed(args.q, q_block, scale, s.queries_t.data() + g * nq, ld,
                           g + 1 < heads_per_task ? nq : lanes - g * nq, s.scratch.data());
    }
    // A forward alone with at most one vector of query rows per head (a decoding step) adds
    // P V through narrow_accumulate, eight lanes at a time, so padding lanes cost nothing. Its
    // S^T and P^T tiles are compact (a key row every `lanes` floats), so the modifier's tapes
    // take block_q / lanes keys per call, their lanes the task's pattern repeated (run_keys).
    // A lane's result depends on no other lane, so a packed GQA group still equals its heads
    // run one by one, bit for bit.
    const bool narrow = forward_alone && nq <= kVectorWidth;
    const std::int64_t tile_ld = narrow ? lanes : ld;  // of scores and probs
    const std::int64_t keys_per_call = narrow ? block_q / lanes : 1;
    const SequenceRows k_rows = cache ? SequenceRows{} : sequence_rows(p, args.k, false, b, h_kv);
    const SequenceRows v_rows = cache ? SequenceRows{} : sequence_rows(p, args.v, false, b, h_kv);
    std::fill_n(s.row_max.begin(), lanes, kNegativeInfinity);
    std::fill_n(s.row_sum.begin(), lanes, 0.0f);
    std::fill_n(s.row_delta.begin(), lanes, 0.0f);
    if (dout != nullptr) {  // dO^T, in the output accumulator's place
      const RowBlock dout_block{sequence_rows(p, *dout, true, b, h), q0, nq, dim_v};
      read_rows_transposed(*dout, dout_block, 1.0f, s.out_t.data(), ld, lanes, s.scratch.data());
    }
    for (std::int64_t j = 0; with_output && j < dim_v; ++j) {
      std::fill_n(&s.out_t[to_size(j * ld)], lanes, 0.0f);
    }
    // Lane i: lane i % lanes of the task (heads h .. when packed), whose padding lanes repeat
    // its last row.
    const std::int64_t pattern_lanes = narrow ? keys_per_call * lanes : used;
    for (std::int64_t i = 0; (packed || narrow) && i < pattern_lanes; ++i) {
      const std::int64_t lane = std::min(i % lanes, used - 1);
      s.lane_heads[to_size(i)] = static_cast<std::int32_t>(packed ? h + lane / nq : h);
      s.lane_queries[to_size(i)] = static_cast<std::int32_t>(q_offset + q0 + lane % nq);
    }
    for (auto* runner : {&s.score_runner, &s.mask_runner}) {
      if (!*runner) continue;
      if (packed || narrow) {
        (*runner)->set_lanes(b, s.lane_heads.data(), s.lane_queries.data(), pattern_lanes, q_len,
                             kv_len);
      } else {
        (*runner)->set_head(b, h, q_len, kv_len);
        (*runner)->set_queries(q0, nq, q_offset);
      }
    }

    for (std::int64_t kt = item.first_tile; kt < item.end_tile; ++kt) {
      const TileClass tile_class = tile_grid.at(qt, kt);
      if (tile_class == TileClass::kAllFalse) continue;  // proven fully masked: skipped
      const std::int64_t k0 = kt * block_k, nk = std::min(block_k, kv_len - k0);
      // The next tile's K and V rows start loading while this one is read and multiplied: a
      // head's rows lie heads_kv * head_dim apart (4 KiB at 8 heads of 128 fp32), one per page
      // of memory, where the hardware prefetchers stop.
      if (kt + 1 < item.end_tile) {
        const std::int64_t next = k0 + block_k, count = std::min(block_k, kv_len - next);
        if (cache) {
          prefetch_cache_rows(args.k, args.page_table, *cache, b, h_kv, next, count, dim_qk);
          prefetch_cache_rows(args.v, args.page_table, *cache, b, h_kv, next, count, dim_v);
        } else {
          prefetch_rows(args.k, {k_rows, next, count, dim_qk});
          prefetch_rows(args.v, {v_rows, next, count, dim_v});
        }
      }
      const RowsView keys = cache ? cache_rows(args.k, args.page_table, *cache, b, h_kv, k0, nk,
                                               dim_qk, s.keys.data())
                                  : float_rows(args.k, {k_rows, k0, nk, dim_qk}, s.keys.data());
      const RowsView values = cache ? cache_rows(args.v, args.page_table, *cache, b, h_kv, k0, nk,
                                                 dim_v, s.values.data())
                                    : float_rows(args.v, {v_rows, k0, nk, dim_v}, s.values.data());
      float* scores = s.scores.data();  // (nk, lanes) of (block_k, tile_ld): S^T
      float* probs = s.probs.data();    // S'^T, then P^T

      // S^T = K (scale Q)^T, then S' = score_mod(S), keys_per_call rows at a time (their values
      // past row nk land in the buffer's spare rows), written straight into probs.
      kernel.gemm({nk, lanes, dim_qk, keys.rows, keys.ld, 1, s.queries_t.data(), ld,
                   s.score_runner ? scores : probs, tile_ld, false});
      for (std::int64_t c = 0; s.score_runner && c < nk; c += keys_per_call) {
        float* destination = probs + c * tile_ld;
        s.score_runner->run_keys(k0 + c, lanes, scores + c * tile_ld, {&destination, 1});
      }
      if (tile_class == TileClass::kMixed) {  // kAllTrue tiles skip the mask
        const std::int32_t* keep = s.mask_runner->ints(low.mask_tape.output(0));
        for (std::int64_t c = 0; c < nk; c += keys_per_call) {
          s.mask_runner->run_keys(k0 + c, lanes, nullptr);
          float* row = probs + c * tile_ld;
          const std::int64_t count = std::min(keys_per_call, nk - c) * lanes;
          for (std::int64_t r = 0; r < count; ++r) {
            row[r] = keep[r] != 0 ? row[r] : kNegativeInfinity;
          }
        }
      }
      // Padding lanes (past used) hold score_mod at a dummy score: masked, so nothing of them
      // is kept (the statistics pass's D and max are per lane, but nothing may depend on them).
      for (std::int64_t c = 0; used < lanes && c < nk; ++c) {
        std::fill(probs + c * tile_ld + used, probs + c * tile_ld + lanes, kNegativeInfinity);
      }

      // Online softmax: P^T in place, the running max and sum, and O^T rescaled when the max
      // moved; then O^T += V^T P^T.
      const bool rescale = kernel.softmax_step(probs, nk, lanes, tile_ld, s.row_max.data(),
                                               s.row_sum.data(), s.alpha.data());
      if (with_output) {
        if (rescale) kernel.scale_columns(s.out_t.data(), dim_v, lanes, ld, s.alpha.data());
        const bool finite = finite_v.at(b, h_kv, kt, values.rows, values.ld, nk, dim_v);
        if (narrow && finite) {
          for (std::int64_t j = 0; j < used; j += kVectorWidth) {
            kernel.narrow_accumulate({dim_v, std::min(kVectorWidth, used - j), nk, values.rows,
                                      values.ld, probs + j, tile_ld, s.out_t.data() + j, ld});
          }
        } else {
          gemm_skipping_zeros(kernel,
                              {dim_v, lanes, nk, values.rows, 1, values.ld, probs, tile_ld,
                               s.out_t.data(), ld, true},
                              DataOperand::kA, finite, s.cleaned);
        }
      }
      if (dout != nullptr) {  // D += P . dP, rescaled like the sum: dP^T = V dO^T in `scores`
        // (column_dot skips P = 0, where dP may be NaN from a masked non-finite V row)
        if (rescale) kernel.scale_columns(s.row_delta.data(), 1, lanes, ld, s.alpha.data());
        kernel.gemm({nk, lanes, dim_v, values.rows, values.ld, 1, s.out_t.data(), ld, scores,
                     tile_ld, false});
        kernel.column_dot(probs, scores, nk, lanes, tile_ld, s.row_delta.data());
      }
    }

    if (item.partial < 0) return finish(s, b, qt, h);
    float* part = partials.data() + item.partial + index % tasks_per_tile * used * (2 + dim_v);
    std::copy_n(s.row_max.begin(), used, part);
    std::copy_n(s.row_sum.begin(), used, part + used);
    for (std::int64_t j = 0; with_output && j < dim_v; ++j) {
      std::copy_n(&s.out_t[to_size(j * ld)], used, part + (2 + j) * used);
    }
  };
  parallel_for(static_cast<std::int64_t>(items.size()) * tasks_per_tile, make_state, task);
  if (split_tiles.empty()) return;

  // A split tile's rows: the parts scaled to their common max and summed in split order. A part
  // that kept no key (sum 0, O^T 0) is left out; a NaN sum makes the row NaN, as unsplit.
  const auto combine = [&](std::int64_t index, ForwardState& s) {
    const std::int64_t first = split_tiles[to_size(index / tasks_per_tile)].first;
    const std::int64_t splits = split_tiles[to_size(index / tasks_per_tile)].second;
    const std::int64_t b = items[to_size(first)].b, qt = items[to_size(first)].qt;
    const std::int64_t task_in_tile = index % tasks_per_tile, h = task_in_tile * heads_per_task;
    const std::int64_t used = heads_per_task * std::min(block_q, p.seq_len_q_of(b));
    const auto part_of = [&](std::int64_t split) -> const float* {
      return partials.data() + items[to_size(first + split)].partial +
             task_in_tile * used * (2 + dim_v);
    };
    for (std::int64_t r = 0; r < used; ++r) {
      float row_max = kNegativeInfinity;
      for (std::int64_t split = 0; split < splits; ++split) {
        const float* part = part_of(split);
        if (part[used + r] != 0.0f) row_max = std::max(row_max, part[r]);
      }
      s.row_max[to_size(r)] = row_max;
      s.row_sum[to_size(r)] = 0.0f;
      for (std::int64_t j = 0; with_output && j < dim_v; ++j) s.out_t[to_size(j * ld + r)] = 0.0f;
    }
    for (std::int64_t split = 0; split < splits; ++split) {
      const float* part = part_of(split);
      for (std::int64_t r = 0; r < used; ++r) {
        if (part[used + r] == 0.0f) continue;
        const float weight = std::exp(part[r] - s.row_max[to_size(r)]);
        s.row_sum[to_size(r)] += part[used + r] * weight;
        for (std::int64_t j = 0; with_output && j < dim_v; ++j) {
          s.out_t[to_size(j * ld + r)] += part[(2 + j) * used + r] * weight;
        }
      }
    }
    finish(s, b, qt, h);
  };
  parallel_for(static_cast<std::int64_t>(split_tiles.size()) * tasks_per_tile, make_state, combine);
}

}  // namespace flexattn::cpu
