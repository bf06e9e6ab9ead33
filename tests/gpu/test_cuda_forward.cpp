// The cuda engine on a GPU (ctest label `gpu`; skipped where no device is available):
// - the conformance matrix's forward cases (full tier) and the benchmark shapes against cpu_ref
//   under docs/design.md's tolerance rule;
// - every golden case in every layout and dtype against PyTorch FlexAttention's float64 output,
//   with the tolerance set by a plain same-precision implementation;
// - the plan proof, the kernel caches (memory, disk, corrupt entries) and argument checks.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_device.hpp"
#include "flexattn/conformance.hpp"
#include "support/test_support.hpp"

namespace flexattn::test {
namespace {

namespace fs = std::filesystem;

// ---- forward on the device ----------------------------------------------------------------------

struct DeviceOutputs {
  HostTensor out, lse;
};

DeviceOutputs run_on_device(const Engine& engine, const Problem& problem, const HostTensor& q,
                            const HostTensor& k, const HostTensor& v,
                            const std::map<std::string, HostTensor>& tensors) {
  const DeviceMemory& memory = *engine.memory();
  const TensorView expected_out = problem.expected("o");
  const TensorView expected_lse = problem.expected("lse");
  DeviceTensor dq(memory, q), dk(memory, k), dv(memory, v);
  DeviceTensor out(memory, HostTensor(expected_out.dtype, expected_out.shape), true);
  DeviceTensor lse(memory, HostTensor(expected_lse.dtype, expected_lse.shape), true);
  std::vector<std::unique_ptr<DeviceTensor>> extra;
  ForwardArgs args;
  args.q = dq.view();
  args.k = dk.view();
  args.v = dv.view();
  args.out = out.view();
  args.lse = lse.view();
  for (const auto& [name, tensor] : tensors) {
    extra.push_back(std::make_unique<DeviceTensor>(memory, tensor));
    args.tensors[name] = extra.back()->view();
  }
  const std::unique_ptr<Plan> plan = engine.plan(problem);
  plan->forward(args);
  return DeviceOutputs{out.download(), lse.download()};
}

// ---- conformance matrix -------------------------------------------------------------------------

std::vector<conformance::Case> forward_cases() {
  std::vector<conformance::Case> result;
  for (const conformance::Case& c : conformance::cases(conformance::Tier::kFull)) {
    if (!c.backward) result.push_back(c);
  }
  // The benchmark's shapes and modifiers at a length the reference computes quickly.
  for (const auto& [modifier, mask] :
       std::vector<std::pair<std::string, std::string>>{{"none", "none"},
                                                        {"none", "causal"},
                                                        {"softcap30", "none"},
                                                        {"softcap30", "causal"},
                                                        {"alibi", "none"},
                                                        {"bias", "causal"}}) {
    for (std::int64_t head_dim : {64, 128, 256}) {
      conformance::Case c;
      c.modifier = modifier;
      c.mask = mask;
      c.shape = conformance::Shape{1, 4, 4, 1024, 1024, head_dim, head_dim};
      c.layout = Layout::kBHSD;
      c.dtype = DType::kBF16;
      c.name = fmt::format("bench_bf16_bhsd_d{}/{}_{}", head_dim, modifier, mask);
      result.push_back(c);
    }
  }
  // Both tanh forms in one launch, and the switch between them (test_support.hpp).
  for (const conformance::Case& c : mixed_tanh_tile_cases(false)) result.push_back(c);
  // The lazy row max (kMaxSlack): logits that drift across the kv tiles, upward by a lot per
  // tile (the reference moves on every tile), upward by a little (it lags by up to 8 in log2
  // units: probabilities up to 2^8), and downward (it stays at the first tile's). The custom
  // bias sums take the natural-units logit (score_mod_forward) as well.
  const std::vector<std::pair<std::string, std::string>> drifts = {
      {"steep", "score + float(kv) * 0.5"},
      {"gentle", "score + float(kv) * 0.02 + bias[h, q, kv]"},
      {"falling", "score - float(kv) * 0.02"}};
  for (const auto& [name, score_mod] : drifts) {
    for (const auto& [dtype, head_dim] : std::vector<std::pair<DType, std::int64_t>>{
             {DType::kBF16, 64}, {DType::kBF16, 128}, {DType::kF16, 128}, {DType::kF16, 256}}) {
      conformance::Case c =
          conformance::custom_case(conformance::Shape{1, 2, 2, 1024, 1024, head_dim, head_dim},
                                   Layout::kBHSD, dtype, score_mod, "none", false);
      c.name = fmt::format("lazy_max_{}_{}_d{}", name, to_string(dtype), head_dim);
      result.push_back(c);
    }
  }
  // The reference fixed after a row's first tile (kStaticReference, softcap-like bounded
  // logits): every logit near the bottom of [-30, 30] (tanh near -0.96: about -41.7 in log2
  // units), far below the bound, where a reference raised to the bound - 64 (-20.7) once made P
  // about 2^-21 for every key; causal, so the first rows see one key and the diagonal tiles are
  // masked.
  for (const auto& [dtype, head_dim] : std::vector<std::pair<DType, std::int64_t>>{
           {DType::kBF16, 64}, {DType::kBF16, 128}, {DType::kBF16, 256}, {DType::kF32, 64}}) {
    conformance::Case c = conformance::custom_case(
        conformance::Shape{1, 2, 2, 1024, 1024, head_dim, head_dim}, Layout::kBHSD, dtype,
        "30 * tanh(score / 30 - 2)", "causal", false);
    c.name = fmt::format("static_reference_low_{}_d{}", to_string(dtype), head_dim);
    result.push_back(c);
  }
  return result;
}

class CudaConformance : public ::testing::TestWithParam<conformance::Case> {};

TEST_P(CudaConformance, ForwardMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  const conformance::Case& c = GetParam();
  const conformance::Outcome outcome = conformance::run_case(*device_engine(), c);
  ASSERT_EQ(outcome.status, conformance::Status::kPass)
      << c.name << ": " << conformance::to_string(outcome.status) << ": " << outcome.reason
      << " (max error " << outcome.max_error() << ", allowed " << outcome.allowed() << ")";
}

std::string case_name(const ::testing::TestParamInfo<conformance::Case>& info) {
  std::string name = info.param.name;
  std::replace_if(
      name.begin(), name.end(), [](char c) { return !std::isalnum(c); }, '_');
  return name;
}

INSTANTIATE_TEST_SUITE_P(Matrix, CudaConformance, ::testing::ValuesIn(forward_cases()), case_name);

// ---- golden cases -------------------------------------------------------------------------------

float round_to(DType dtype, float value) {
  if (dtype == DType::kBF16) return to_float(to_bfloat16(value));
  if (dtype == DType::kF16) return to_float(to_half(value));
  return value;
}

// Plain attention in the storage precision (fp32 math, P and O rounded to the dtype), on bhsd
// arrays: the implementation whose error sets the tolerance.
DeviceOutputs plain_forward(const GoldenCase& golden, const Problem& problem, DType dtype,
                            const std::map<std::string, HostTensor>& tensors) {
  const HostTensor q = golden.array("q").to(dtype), k = golden.array("k").to(dtype);
  const HostTensor v = golden.array("v").to(dtype);
  const std::int64_t B = golden.batch, H = golden.heads_q, Sq = golden.seq_len_q;
  const std::int64_t Skv = golden.seq_len_kv, D = golden.head_dim_qk, Dv = golden.head_dim_v;
  const std::int64_t group = H / golden.heads_kv;
  HostTensor out(DType::kF64, {B, H, Sq, Dv});
  HostTensor lse(DType::kF64, {B, H, Sq});
  Bindings bindings;
  bindings.params = problem.desc().params;
  for (const auto& [name, tensor] : tensors) bindings.tensors[name] = tensor.view();
  const auto scale = static_cast<float>(problem.scale());
  std::vector<float> scores(static_cast<std::size_t>(Skv));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t kv_head = (b * golden.heads_kv + h / group);
      for (std::int64_t i = 0; i < Sq; ++i) {
        float row_max = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j < Skv; ++j) {
          float dot = 0.0f;
          for (std::int64_t d = 0; d < D; ++d) {
            dot += static_cast<float>(q.at(((b * H + h) * Sq + i) * D + d)) *
                   static_cast<float>(k.at((kv_head * Skv + j) * D + d));
          }
          EvalPoint at{scale * dot, b, h, i, j, Sq, Skv};
          float score = static_cast<float>(evaluate(problem.score_mod(), at, bindings));
          if (evaluate(problem.mask_mod(), at, bindings) == 0.0) {
            score = -std::numeric_limits<float>::infinity();
          }
          scores[static_cast<std::size_t>(j)] = score;
          row_max = std::max(row_max, score);
        }
        float sum = 0.0f;
        for (float& score : scores) {
          score =
              row_max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(score - row_max);
          sum += score;
        }
        lse.set((b * H + h) * Sq + i,
                sum > 0.0f ? row_max + std::log(sum) : -std::numeric_limits<double>::infinity());
        for (std::int64_t d = 0; d < Dv; ++d) {
          float value = 0.0f;
          for (std::int64_t j = 0; j < Skv && sum > 0.0f; ++j) {
            value += round_to(dtype, scores[static_cast<std::size_t>(j)] / sum) *
                     static_cast<float>(v.at((kv_head * Skv + j) * Dv + d));
          }
          out.set(((b * H + h) * Sq + i) * Dv + d, round_to(dtype, value));
        }
      }
    }
  }
  return DeviceOutputs{std::move(out), std::move(lse)};
}

// One golden case's forward on the device against FlexAttention's float64 output.
void check_golden_forward(const GoldenParam& param) {
  const auto& [name, layout, dtype] = param;
  const GoldenCase golden = load_golden_case(name);
  ProblemDesc desc = golden.desc(layout, dtype, Direction::kForward);
  desc.device = Device::kCuda;
  const Problem problem(desc);
  std::map<std::string, HostTensor> tensors;
  for (const std::string& tensor : golden.tensors) tensors[tensor] = golden.array(tensor);

  const DeviceOutputs result =
      run_on_device(*device_engine(), problem, from_bhsd(golden.array("q").to(dtype), layout),
                    from_bhsd(golden.array("k").to(dtype), layout),
                    from_bhsd(golden.array("v").to(dtype), layout), tensors);
  const DeviceOutputs plain = plain_forward(golden, problem, dtype, tensors);

  const HostTensor expected_out = golden.array("out");
  const HostTensor expected_lse = golden.array("lse");
  const HostTensor out = to_bhsd(result.out, layout, golden.batch).to(DType::kF64);
  const HostTensor lse = lse_as_bhs(result.lse, layout, golden);
  const double out_floor = epsilon(dtype) * std::max(1.0, max_abs_value(expected_out));
  const double lse_floor = epsilon(DType::kF32) * std::max(1.0, max_abs_value(expected_lse));
  EXPECT_TRUE(within_tolerance(out, expected_out,
                               allowed_error(max_abs_error(plain.out, expected_out), out_floor)))
      << "out";
  EXPECT_TRUE(within_tolerance(lse, expected_lse,
                               allowed_error(max_abs_error(plain.lse, expected_lse), lse_floor)))
      << "lse";
}

class CudaGolden : public ::testing::TestWithParam<GoldenParam> {};

TEST_P(CudaGolden, ForwardMatchesFlexAttention) {
  FLEXATTN_REQUIRE_GOLDEN();
  SKIP_WITHOUT_DEVICE();
  check_golden_forward(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGolden, ::testing::ValuesIn(golden_params()), golden_name);

// The mma.sync kernel where sm_90 would get the wgmma one (FLEXATTN_CUDA_WGMMA=0), so both stay
// verified on the H200; other devices run the mma.sync kernel in CudaGolden already.
class CudaGoldenMmaSync : public ::testing::TestWithParam<GoldenParam> {
  const ScopedEnvironment mma_sync_{"FLEXATTN_CUDA_WGMMA", "0"};
};

TEST_P(CudaGoldenMmaSync, ForwardMatchesFlexAttention) {
  FLEXATTN_REQUIRE_GOLDEN();
  SKIP_WITHOUT_DEVICE();
  check_golden_forward(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGoldenMmaSync, ::testing::ValuesIn(golden_params()),
                         golden_name);

// ---- plans, caches, arguments -------------------------------------------------------------------

ProblemDesc small_desc(const std::string& score_mod) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = 4;
  desc.heads_kv = 2;
  desc.seq_len_q = 100;
  desc.seq_len_kv = 77;
  desc.head_dim_qk = 64;
  desc.dtype = DType::kBF16;
  desc.device = Device::kCuda;
  desc.params["cap"] = 0.0;
  desc.score_mod = ir::parse(score_mod, desc.scope());
  desc.mask_mod = ir::parse("q >= kv", desc.scope());
  return desc;
}

// ---- paged KV cache ------------------------------------------------------------------------------

// Three sequences in a pool of `pages` pages of `page_size` tokens, four page-table entries each:
// sequence 0's pages in order (`ordered`, 12 entries, with `lengths`), then moved (`moves`, pages
// copied from -> to) and scrambled (`scrambled`, `scrambled_lengths`), where sequence 1 uses a
// page id outside the pool and sequence 2's length passes the capacity.
struct PagedTables {
  std::int64_t page_size;
  std::int64_t pages;
  std::vector<int> ordered;
  std::vector<int> lengths;
  std::vector<std::pair<int, int>> moves;
  std::vector<int> scrambled;
  std::vector<int> scrambled_lengths;
};

// One decoding step (or a chunk of `tokens` new tokens) of three sequences against a paged cache
// (`tables`): the same pool and query, run with page tables that place sequence 0's pages in
// order and scrambled, give the same bits (the kernel's arithmetic depends on positions, not
// pages); a used page id outside the pool (sequence 1) and a length past the capacity
// (sequence 2) give NaN rows without reading past the pool, and leave sequence 0's rows alone.
// In bf16 on tensor cores and in fp32 on the fp32 units (the paged-cache kernels); 16 new
// tokens at GQA 4:1 make 64 packed rows, the tensor-core kernel's chunked-prefill blocks; from
// 128 new tokens sm_90 runs the wgmma forward over the cache.
void check_paged_cache_tables(DType dtype, std::int64_t tokens, std::int64_t heads_q,
                              const PagedTables& tables) {
  const std::shared_ptr<const Engine> owner = device_engine();  // outlives its memory and plan
  const Engine& engine = *owner;
  ProblemDesc desc;
  desc.batch = 3;
  desc.heads_q = heads_q;
  desc.heads_kv = 2;
  desc.seq_len_q = tokens;
  desc.head_dim_qk = 64;
  desc.dtype = dtype;
  desc.device = Device::kCuda;
  desc.kv_cache = KvCacheDesc{tables.pages, tables.page_size, 4};
  desc.score_mod = ir::parse("30 * tanh(score / 30)", desc.scope());
  desc.mask_mod = ir::parse("q - kv < 33", desc.scope());
  const Problem problem(desc);
  HostTensor q(dtype, problem.expected("q").shape);
  HostTensor k(dtype, problem.expected("k").shape);
  HostTensor v(dtype, problem.expected("v").shape);
  q.fill_normal(1);
  k.fill_normal(2);
  v.fill_normal(3);
  const DeviceMemory& memory = *engine.memory();
  DeviceTensor dq(memory, q), dk(memory, k), dv(memory, v);
  const std::unique_ptr<Plan> plan = engine.plan(problem);
  const std::string& description = plan->info().description;
  const bool wgmma =
      dtype != DType::kF32 && tokens >= 128 && description.find("(sm_90") != std::string::npos;
  EXPECT_NE(description.find(dtype == DType::kF32 ? "fp32 units"
                             : wgmma              ? "chunked prefill on the tensor-core (wgmma"
                                                  : "tensor cores"),
            std::string::npos)
      << description;
  const bool prefill = dtype != DType::kF32 && tokens * heads_q / desc.heads_kv >= 64;
  EXPECT_EQ(description.find("chunked prefill") != std::string::npos, prefill) << description;
  // One run on pools `k_pool` and `v_pool` with the given page table (3 x 4) and lengths.
  const auto run = [&](const DeviceTensor& k_pool, const DeviceTensor& v_pool,
                       const std::vector<int>& table, const std::vector<int>& lengths) {
    HostTensor page_table(DType::kI32, {3, 4});
    HostTensor cache_lens(DType::kI32, {3});
    for (std::int64_t i = 0; i < 12; ++i) page_table.set(i, table[static_cast<std::size_t>(i)]);
    for (std::int64_t i = 0; i < 3; ++i) cache_lens.set(i, lengths[static_cast<std::size_t>(i)]);
    DeviceTensor table_device(memory, page_table), lens_device(memory, cache_lens);
    const TensorView expected_out = problem.expected("o");
    const TensorView expected_lse = problem.expected("lse");
    DeviceTensor out(memory, HostTensor(expected_out.dtype, expected_out.shape), true);
    DeviceTensor lse(memory, HostTensor(expected_lse.dtype, expected_lse.shape), true);
    ForwardArgs args;
    args.q = dq.view();
    args.k = k_pool.view();
    args.v = v_pool.view();
    args.out = out.view();
    args.lse = lse.view();
    args.page_table = table_device.view();
    args.cache_lens = lens_device.view();
    plan->forward(args);
    return DeviceOutputs{out.download(), lse.download()};
  };
  // Sequences 1 and 2 are valid in the first run.
  const DeviceOutputs ordered = run(dk, dv, tables.ordered, tables.lengths);
  // The moves in the host pool, through a second pool on the device.
  HostTensor moved = k.to(dtype);
  HostTensor moved_v = v.to(dtype);
  const std::int64_t page_values = tables.page_size * desc.heads_kv * 64;
  for (const auto& [from, to] : tables.moves) {
    for (std::int64_t e = 0; e < page_values; ++e) {
      moved.set(to * page_values + e, k.at(from * page_values + e));
      moved_v.set(to * page_values + e, v.at(from * page_values + e));
    }
  }
  DeviceTensor dk_moved(memory, moved), dv_moved(memory, moved_v);
  const DeviceOutputs scrambled =
      run(dk_moved, dv_moved, tables.scrambled, tables.scrambled_lengths);
  const HostTensor& o = scrambled.out;
  const HostTensor& l = scrambled.lse;
  // o: (batch 3, tokens, heads, 64); lse: (3, heads, tokens).
  for (std::int64_t b = 0; b < 3; ++b) {
    for (std::int64_t t = 0; t < tokens; ++t) {
      for (std::int64_t h = 0; h < heads_q; ++h) {
        SCOPED_TRACE(fmt::format("sequence {} token {} head {}", b, t, h));
        const std::int64_t row = (b * heads_q + h) * tokens + t;
        const double lse_value = l.at(row);
        if (b == 0) {
          EXPECT_TRUE(std::isfinite(lse_value));
          EXPECT_EQ(lse_value, ordered.lse.at(row));
        } else {
          EXPECT_TRUE(std::isnan(lse_value));
          EXPECT_TRUE(std::isfinite(ordered.lse.at(row)));
        }
        for (std::int64_t d = 0; d < 64; ++d) {
          const std::int64_t at = ((b * tokens + t) * heads_q + h) * 64 + d;
          if (b == 0) {
            EXPECT_EQ(o.at(at), ordered.out.at(at)) << "column " << d;
          } else {
            EXPECT_TRUE(std::isnan(o.at(at))) << "column " << d;
          }
        }
      }
    }
  }
}

TEST(CudaPagedCache, PagesDoNotChangeBitsAndInvalidTablesGiveNanRows) {
  SKIP_WITHOUT_DEVICE();
  // Pages of 16 (capacity 64): sequence 0 holds 40 tokens in pages 0, 1, 2, then 5, 2, 7.
  const PagedTables small{16,
                          8,
                          {0, 1, 2, -1, 3, 4, -1, -1, 6, -1, -1, -1},
                          {40, 20, 16},
                          {{2, 7}, {1, 2}, {0, 5}},
                          {5, 2, 7, -1, 3, 99, -1, -1, 6, -1, -1, -1},
                          {40, 20, 70}};
  // Pages of 64 (capacity 256) for 130-token chunks: sequence 0 holds 160 tokens.
  const PagedTables large{64,
                          12,
                          {0, 1, 2, -1, 3, 4, 10, -1, 6, 8, 9, -1},
                          {160, 140, 130},
                          {{2, 7}, {1, 2}, {0, 5}},
                          {5, 2, 7, -1, 3, 99, 10, -1, 6, 8, 9, -1},
                          {160, 140, 300}};
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(to_string(dtype));
    check_paged_cache_tables(dtype, 1, 4, small);
    SCOPED_TRACE("chunked prefill: 16 new tokens, GQA 4:1");
    check_paged_cache_tables(dtype, 16, 8, small);
    SCOPED_TRACE("chunked prefill: 130 new tokens, GQA 2:1");
    check_paged_cache_tables(dtype, 130, 4, large);
  }
}

TEST(CudaPlan, ProvesTheModifierItLowered) {
  SKIP_WITHOUT_DEVICE();
  const Problem problem(small_desc("20 * tanh(score / 20)"));
  const std::unique_ptr<Plan> plan = device_engine()->plan(problem);
  EXPECT_EQ(plan->info().engine, "cuda");
  EXPECT_EQ(plan->info().lowered_hash, problem.modifier_hash());
  EXPECT_EQ(plan->info().signature, problem.signature());
}

// Which forward kernel serves a bf16 head-dim-128 problem: wgmma on sm_90 unless switched off,
// mma.sync elsewhere (the description names it).
TEST(CudaPlan, Sm90GetsTheWgmmaKernelUnlessSwitchedOff) {
  SKIP_WITHOUT_DEVICE();
  ProblemDesc desc = small_desc("score");
  desc.head_dim_qk = 128;
  const Problem problem(desc);
  const std::string description = device_engine()->plan(problem)->info().description;
  const bool sm90 = description.find("(sm_90") != std::string::npos;
  EXPECT_EQ(description.find("wgmma, sm_90a") != std::string::npos, sm90) << description;
  const std::string switched_off = [&] {
    const ScopedEnvironment mma_sync{"FLEXATTN_CUDA_WGMMA", "0"};
    return device_engine()->plan(problem)->info().description;
  }();
  EXPECT_NE(switched_off.find("mma.sync"), std::string::npos) << switched_off;
}

// A context keys its plans by the engine's plan settings: the plan made under
// FLEXATTN_CUDA_WGMMA=0 is not served once the variable is unset, nor the default plan under it;
// each comes back from the cache with its setting. On sm_90 the two plans run different kernels.
TEST(CudaPlan, ContextServesThePlanOfTheCurrentWgmmaSetting) {
  SKIP_WITHOUT_DEVICE();
  ProblemDesc desc = small_desc("score");
  desc.head_dim_qk = 128;
  const Problem problem(desc);
  ContextOptions options;
  options.policy.force = "cuda";
  options.log_level = LogLevel::kOff;
  Context context(options);
  const ScopedEnvironment unset{"FLEXATTN_CUDA_WGMMA", nullptr};
  const std::shared_ptr<const Plan> plain = context.select(problem);
  const std::string description = plain->info().description;
  const bool sm90 = description.find("(sm_90") != std::string::npos;
  EXPECT_EQ(description.find("wgmma, sm_90a") != std::string::npos, sm90) << description;
  {
    const ScopedEnvironment mma_sync{"FLEXATTN_CUDA_WGMMA", "0"};
    const std::shared_ptr<const Plan> switched = context.select(problem);
    EXPECT_NE(switched.get(), plain.get());
    EXPECT_NE(switched->info().description.find("mma.sync"), std::string::npos)
        << switched->info().description;
    EXPECT_EQ(context.select(problem).get(), switched.get());
  }
  EXPECT_EQ(context.select(problem).get(), plain.get());
  EXPECT_EQ(context.cached_plans(), 2u);
}

// Every plan in this test sees a fresh cache folder through FLEXATTN_CACHE_DIR.
class CudaKernelCache : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = fs::temp_directory_path() /
                 fmt::format("flexattn_cache_test_{}", static_cast<long>(::getpid()));
    fs::remove_all(directory_);
    fs::create_directories(directory_);
    ::setenv("FLEXATTN_CACHE_DIR", directory_.c_str(), 1);
  }
  void TearDown() override {
    ::unsetenv("FLEXATTN_CACHE_DIR");
    fs::remove_all(directory_);
  }
  // A fresh engine instance: an empty memory cache.
  static std::shared_ptr<const Engine> fresh_engine() {
    for (const auto& engine : builtin_engines()) {
      if (engine->name() == "cuda") return engine;
    }
    return nullptr;
  }
  std::vector<fs::path> entries() const {
    std::vector<fs::path> found;
    for (const auto& entry : fs::directory_iterator(directory_)) {
      if (entry.path().extension() == ".cubin") found.push_back(entry.path());
    }
    return found;
  }
  fs::path directory_;
};

TEST_F(CudaKernelCache, CompilesOnceThenHitsMemoryThenDisk) {
  SKIP_WITHOUT_DEVICE();
  const Problem problem(small_desc("score * 0.75 + 0.125"));
  const auto engine = fresh_engine();
  const std::string cold = engine->plan(problem)->info().description;
  EXPECT_NE(cold.find("compiled (NVRTC)"), std::string::npos) << cold;
  ASSERT_EQ(entries().size(), 1u);
  const std::string memory = engine->plan(problem)->info().description;
  EXPECT_NE(memory.find("memory cache"), std::string::npos) << memory;
  const std::string disk = fresh_engine()->plan(problem)->info().description;
  EXPECT_NE(disk.find("disk cache"), std::string::npos) << disk;
  ASSERT_EQ(entries().size(), 1u);  // no temporary file left behind
}

// A forward+backward plan compiles two modules at once (the forward's and the backward's, from
// one source), each its own cache entry; both come back from memory, then from disk.
TEST_F(CudaKernelCache, ForwardAndBackwardModulesAreCachedApart) {
  SKIP_WITHOUT_DEVICE();
  ProblemDesc desc = small_desc("score * 0.625 + 0.25");
  desc.direction = Direction::kForwardBackward;
  const Problem problem(std::move(desc));
  const auto engine = fresh_engine();
  // The origin is named once when both modules share it ("compiled (NVRTC) in 1.234 s").
  const std::string cold = engine->plan(problem)->info().description;
  EXPECT_NE(cold.find("compiled (NVRTC) in"), std::string::npos) << cold;
  ASSERT_EQ(entries().size(), 2u);
  const std::string memory = engine->plan(problem)->info().description;
  EXPECT_NE(memory.find("memory cache in"), std::string::npos) << memory;
  const std::string disk = fresh_engine()->plan(problem)->info().description;
  EXPECT_NE(disk.find("disk cache in"), std::string::npos) << disk;
  ASSERT_EQ(entries().size(), 2u);
}

TEST_F(CudaKernelCache, CorruptEntryIsRecompiled) {
  SKIP_WITHOUT_DEVICE();
  const Problem problem(small_desc("score * 0.5 - 0.25"));
  fresh_engine()->plan(problem);
  const std::vector<fs::path> files = entries();
  ASSERT_EQ(files.size(), 1u);
  {  // Flip one byte of the cubin (after the header).
    std::fstream file(files[0], std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-1, std::ios::end);
    const char last = static_cast<char>(file.get());
    file.seekp(-1, std::ios::end);
    file.put(static_cast<char>(last ^ 0x5a));
  }
  const std::string again = fresh_engine()->plan(problem)->info().description;
  EXPECT_NE(again.find("compiled (NVRTC)"), std::string::npos) << again;
  fs::resize_file(files[0], 10);  // truncated
  const std::string truncated = fresh_engine()->plan(problem)->info().description;
  EXPECT_NE(truncated.find("compiled (NVRTC)"), std::string::npos) << truncated;
  EXPECT_NE(fresh_engine()->plan(problem)->info().description.find("disk cache"),
            std::string::npos);
}

TEST(CudaArguments, MisalignedDataIsRefused) {
  SKIP_WITHOUT_DEVICE();
  const auto engine = device_engine();
  const Problem problem(small_desc("score"));
  const DeviceMemory& memory = *engine->memory();
  const std::unique_ptr<Plan> plan = engine->plan(problem);
  const auto bytes = [&](std::string_view which) {
    const TensorView view = problem.expected(which);
    return static_cast<std::size_t>(view.numel()) * size_of(view.dtype) + 16;
  };
  std::vector<void*> buffers;
  ForwardArgs args;
  for (auto [which, view] : {std::pair{"q", &args.q}, std::pair{"k", &args.k},
                             std::pair{"v", &args.v}, std::pair{"o", &args.out}}) {
    buffers.push_back(memory.allocate(bytes(which)));
    *view = problem.expected(which);
    view->data = buffers.back();
  }
  args.q.data = static_cast<char*>(args.q.data) + 2;  // element-aligned, not 16-byte aligned
  try {
    plan->forward(args);
    ADD_FAILURE() << "a misaligned q was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("aligned"), std::string::npos) << error.what();
  }
  for (void* buffer : buffers) memory.release(buffer);
}

// A dense [h, q, kv] bf16 bias is staged through shared memory by the wgmma forward (its
// default), which copies 16-byte chunks. A bias that starts 2 bytes past such a boundary (a view
// into a larger buffer) still works: the plan runs its forward without staging, with the same
// result as the aligned call, both within a few bf16 roundings of the reference. Three batches
// share the bias (the staged kernel numbers its blocks batch-fastest). Head dims 128, 64 (whose
// staged shape, 64-key tiles, differs from its default: the fallback takes the staged shape) and
// 256 (64-key tiles either way).
class CudaStagedArguments : public ::testing::TestWithParam<std::int64_t> {};
INSTANTIATE_TEST_SUITE_P(HeadDims, CudaStagedArguments, ::testing::Values(64, 128, 256));
TEST_P(CudaStagedArguments, MisalignedStagedTensorRunsWithoutStaging) {
  SKIP_WITHOUT_DEVICE();
  const auto engine = device_engine();
  ProblemDesc desc;
  desc.batch = 3;
  desc.heads_q = 2;
  desc.heads_kv = 2;
  desc.seq_len_q = 256;
  desc.seq_len_kv = 256;
  desc.head_dim_qk = GetParam();
  desc.dtype = DType::kBF16;
  desc.layout = Layout::kBHSD;
  desc.tensors["bias"] = TensorDecl{DType::kBF16, {2, 256, 256}};
  desc.score_mod = ir::parse("score + bias[h, q, kv]", desc.scope());
  const Problem on_cpu(desc);  // the reference runs on the host
  desc.device = Device::kCuda;
  const Problem problem(std::move(desc));
  const Inputs inputs = random_inputs(on_cpu, 11);
  const Outputs reference = run_engine(*builtin_engine("cpu_ref"), on_cpu, inputs);

  const std::unique_ptr<Plan> plan = engine->plan(problem);
  const std::string description = plan->info().description;
  if (description.find("wgmma") != std::string::npos) {
    EXPECT_NE(description.find("staged in shared memory"), std::string::npos) << description;
  }
  const DeviceMemory& memory = *engine->memory();
  const TensorView expected_out = problem.expected("o");
  const TensorView expected_lse = problem.expected("lse");
  DeviceTensor q(memory, inputs.q), k(memory, inputs.k), v(memory, inputs.v);
  DeviceTensor aligned_bias(memory, inputs.tensors.at("bias"));
  const HostTensor& bias = inputs.tensors.at("bias");
  void* buffer = memory.allocate(bias.bytes() + 16);
  char* shifted = static_cast<char*>(buffer) + 2;  // element-aligned, not 16-byte aligned
  memory.copy_to_device(shifted, bias.data(), bias.bytes());
  std::vector<HostTensor> results;
  for (void* bias_data : {aligned_bias.view().data, static_cast<void*>(shifted)}) {
    DeviceTensor out(memory, HostTensor(expected_out.dtype, expected_out.shape), true);
    DeviceTensor lse(memory, HostTensor(expected_lse.dtype, expected_lse.shape), true);
    ForwardArgs args;
    args.q = q.view();
    args.k = k.view();
    args.v = v.view();
    args.out = out.view();
    args.lse = lse.view();
    args.tensors["bias"] = aligned_bias.view();
    args.tensors["bias"].data = bias_data;
    plan->forward(args);
    results.push_back(out.download());
  }
  memory.release(buffer);
  const double allowed = 4.0 * std::ldexp(1.0, -8) * std::max(1.0, max_abs_value(reference.out));
  EXPECT_TRUE(within_tolerance(results[0], reference.out, allowed)) << "aligned";
  EXPECT_TRUE(within_tolerance(results[1], reference.out, allowed)) << "2 bytes past 16";
  EXPECT_TRUE(within_tolerance(results[1], results[0], allowed)) << "unstaged vs staged";
}

}  // namespace
}  // namespace flexattn::test
