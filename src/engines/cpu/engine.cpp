// `cpu`: the engine object, its lowering (which decides support and builds the plan in one
// function), the tile sizes and the mask tile classification.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <optional>

#include "engines/cpu/cpu.hpp"
#include "engines/cpu/kernels.hpp"
#include "engines/cpu/plan.hpp"
#include "engines/cpu/tape_proof.hpp"
#include "flexattn/error.hpp"

namespace flexattn::cpu {

namespace {

constexpr std::string_view kEngineName = "cpu";

// 128 queries x 64 keys, measured on the bench problem (docs/performance.md) against 32/64/192/
// 256 x 32/64/128. Wider query tiles amortise packing the K and V tile (once per step) and the
// per-row cost of the modifier tape over more lanes; 128 keys per step double the partially
// masked diagonal of a causal mask (causal forward -20%), 32 halve the products' k depth. The
// step's working set (score and probability tiles of 32 KiB, Q^T and O^T of 32 KiB at head dim
// 64, K and V of 16 KiB) stays in a core's L2, each product's B panel in L1.
constexpr std::int64_t kBlockQ = 128;
constexpr std::int64_t kBlockK = 64;

bool uses_leaf(const Graph& graph, Op leaf) {
  return std::any_of(graph.nodes().begin(), graph.nodes().end(),
                     [&](const GraphNode& node) { return node.op == leaf; });
}

std::int64_t count_tiles(const std::vector<TileGrid>& grids, TileClass which) {
  std::int64_t count = 0;
  for (const TileGrid& grid : grids) {
    count += std::count(grid.classes.begin(), grid.classes.end(), which);
  }
  return count;
}

}  // namespace

TileSizes choose_tile_sizes(const Problem& /*problem*/) {
  return {kBlockQ, kBlockK, kBlockQ + kLanePadding};
}

std::vector<TileGrid> classify_tiles(const Problem& problem, const Graph& mask, bool keep_all,
                                     const TileSizes& tiles) {
  // A grid per batch entry when entries differ: thd sequences have their own lengths, and a
  // mask may read `b`. Otherwise one grid, classified over the whole batch range, serves all.
  const bool per_batch = problem.layout() == Layout::kTHD || uses_leaf(mask, Op::kBatch);
  const std::int64_t grid_count = per_batch ? problem.batch() : 1;
  std::vector<TileGrid> grids(to_size(grid_count));
  for (std::int64_t b = 0; b < grid_count; ++b) {
    TileGrid& grid = grids[to_size(b)];
    const std::int64_t q_len = problem.seq_len_q_of(b), kv_len = problem.seq_len_kv_of(b);
    grid.query_tiles = ceil_div(q_len, tiles.block_q);
    grid.key_tiles = ceil_div(kv_len, tiles.block_k);
    grid.classes.assign(to_size(grid.query_tiles * grid.key_tiles), TileClass::kAllTrue);
    if (keep_all || grid.classes.empty()) continue;
    LeafRanges ranges = problem.leaf_ranges();
    if (per_batch) {
      const auto at = [](std::int64_t value) { return static_cast<double>(value); };
      ranges.batch = {at(b), at(b)};
      ranges.query_length = {at(q_len), at(q_len)};
      ranges.key_length = {at(kv_len), at(kv_len)};
    }
    for (std::int64_t qt = 0; qt < grid.query_tiles; ++qt) {
      for (std::int64_t kt = 0; kt < grid.key_tiles; ++kt) {
        const TileRect rect{qt * tiles.block_q, std::min(q_len, (qt + 1) * tiles.block_q),
                            kt * tiles.block_k, std::min(kv_len, (kt + 1) * tiles.block_k)};
        grid.classes[to_size(qt * grid.key_tiles + kt)] = classify_tile(mask, ranges, rect);
      }
    }
  }
  return grids;
}

TileGrid classify_cache_tiles(const Problem& problem, const Graph& mask, bool keep_all,
                              const TileSizes& tiles, std::int64_t b, std::int64_t q_len,
                              std::int64_t kv_len, std::int64_t q_offset) {
  TileGrid grid;
  grid.query_tiles = ceil_div(q_len, tiles.block_q);
  grid.key_tiles = ceil_div(kv_len, tiles.block_k);
  grid.classes.assign(to_size(grid.query_tiles * grid.key_tiles), TileClass::kAllTrue);
  if (keep_all || grid.classes.empty()) return grid;
  const auto at = [](std::int64_t value) { return static_cast<double>(value); };
  LeafRanges ranges = problem.leaf_ranges();
  ranges.batch = {at(b), at(b)};
  ranges.query_length = {at(q_len), at(q_len)};
  ranges.key_length = {at(kv_len), at(kv_len)};
  for (std::int64_t qt = 0; qt < grid.query_tiles; ++qt) {
    for (std::int64_t kt = 0; kt < grid.key_tiles; ++kt) {
      const TileRect rect{q_offset + qt * tiles.block_q,
                          q_offset + std::min(q_len, (qt + 1) * tiles.block_q), kt * tiles.block_k,
                          std::min(kv_len, (kt + 1) * tiles.block_k)};
      grid.classes[to_size(qt * grid.key_tiles + kt)] = classify_tile(mask, ranges, rect);
    }
  }
  return grid;
}

CpuPlan::CpuPlan(PlanInfo info, Problem problem, Lowering lowering, TileSizes tiles,
                 std::vector<TileGrid> grids)
    : Plan(std::move(info)),
      problem_(std::move(problem)),
      lowering_(std::move(lowering)),
      tiles_(tiles),
      grids_(std::move(grids)) {}

namespace {

class CpuEngine final : public Engine {
 public:
  CpuEngine() = default;
  explicit CpuEngine(LoweringHook hook) : hook_(std::move(hook)) {}
  std::string_view name() const override { return kEngineName; }
  Support available() const override { return Support::yes(); }
  bool reads_kv_cache() const override { return true; }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered result;
    if (problem.device() != Device::kCpu) {
      result.support = Support::no("cpu computes on the CPU only");
      return result;
    }
    if (problem.dtype() == DType::kF64) {
      result.support =
          Support::no("cpu computes in float32 for fp32, fp16 and bf16 storage; fp64 is cpu_ref's");
      return result;
    }
    Lowering lowering;
    lowering.score_mod = problem.score_mod();
    lowering.mask_mod = problem.mask_mod();
    lowering.identity_score = lowering.score_mod.is_identity_score();
    const GraphNode& mask_root = lowering.mask_mod.node(lowering.mask_mod.root());
    lowering.keep_all = lowering.mask_mod.is_literal() && mask_root.literal != 0.0;
    try {
      lowering.score_tape = Tape({&lowering.score_mod});
      lowering.mask_tape = Tape({&lowering.mask_mod});
      if (problem.wants_backward()) {
        const Graph score_derivative = derivative_wrt_score(lowering.score_mod);
        lowering.backward_tape = Tape({&lowering.score_mod, &score_derivative});
        lowering.load_derivatives = derivatives_wrt_tensors(lowering.score_mod);
        std::vector<const Graph*> gradient_graphs;
        for (const LoadDerivative& load : lowering.load_derivatives) {
          for (const Graph& index : load.indices) gradient_graphs.push_back(&index);
        }
        for (const LoadDerivative& load : lowering.load_derivatives) {
          gradient_graphs.push_back(&load.derivative);
        }
        lowering.gradient_tape = Tape(gradient_graphs);
      }
    } catch (const Error& error) {
      result.support = Support::no(fmt::format("cannot lower the modifier: {}", error.what()));
      return result;
    }
    if (hook_ && !hook_(lowering)) {
      result.support = Support::no("refused by the lowering hook");
      return result;
    }
    result.support = Support::yes();
    if (stage == Stage::kCheck) return result;

    const TileSizes tiles = choose_tile_sizes(problem);
    // A KV cache's lengths come with each run: its tiles are classified then.
    std::vector<TileGrid> grids =
        problem.kv_cache() ? std::vector<TileGrid>{}
                           : classify_tiles(problem, lowering.mask_mod, lowering.keep_all, tiles);
    PlanInfo info;
    info.engine = std::string(kEngineName);
    info.description = fmt::format(
        "flash attention, {} queries x {} keys per tile, {} kernels, {} threads, score tape of "
        "{} instructions, mask tape of {}, {}",
        tiles.block_q, tiles.block_k, kernels().isa, omp_get_max_threads(),
        lowering.score_tape.instructions().size(), lowering.mask_tape.instructions().size(),
        problem.kv_cache()
            ? std::string("paged KV cache read page by page, tiles classified per run")
            : fmt::format("tiles skipped {} / unmasked {} / mixed {}",
                          count_tiles(grids, TileClass::kAllFalse),
                          count_tiles(grids, TileClass::kAllTrue),
                          count_tiles(grids, TileClass::kMixed)));
    const LoweringProof proof = prove_lowering(lowering, problem);
    info.lowered_hash = proof.forward;
    info.lowered_backward_hash = proof.backward;
    info.signature = problem.signature();
    result.plan = std::make_unique<CpuPlan>(std::move(info), problem, std::move(lowering), tiles,
                                            std::move(grids));
    return result;
  }

 private:
  LoweringHook hook_;
};

}  // namespace

std::shared_ptr<const Engine> make_cpu_engine(LoweringHook hook) {
  return std::make_shared<CpuEngine>(std::move(hook));
}

}  // namespace flexattn::cpu

namespace flexattn {

std::shared_ptr<const Engine> make_cpu_engine() { return std::make_shared<cpu::CpuEngine>(); }

}  // namespace flexattn
