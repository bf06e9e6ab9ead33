// The cuda engine's generated translation units compile with NVRTC (no GPU needed): the
// modifiers of the shared cases for sm_90, the wgmma forward (pipelined with its producer
// warpgroup, with a staged tensor) and the backward for sm_90a. Skipped in builds without CUDA.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cctype>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/cuda_codegen_cases.hpp"

// The engine's internals (tile plan, NVRTC compilation) exist only in builds with the engine.
#if FLEXATTN_HAVE_CUDA
#include "engines/cuda/codegen.hpp"
#include "engines/cuda/kernel_cache.hpp"
#include "engines/cuda/repair.hpp"
#include "engines/cuda/source_proof.hpp"
#include "engines/cuda/tile_plan.hpp"
#endif

#if __has_include(<nvrtc.h>)
#include <cuda.h>
#include <dlfcn.h>
#include <nvrtc.h>
#define FLEXATTN_TEST_HAS_NVRTC 1
#endif

namespace flexattn {
namespace {

using namespace test;

#if FLEXATTN_HAVE_CUDA
// Two units the compile tests share: softcap 30 + causal in bf16 at head dim 128 (bshd), and
// ALiBi with slopes from the head index in fp16 at head dim 64 (thd).
GeneratedCase softcap_causal_bf16_d128() {
  return {"bf16_d128_softcap_causal",
          DType::kBF16,
          128,
          128,
          "30 * tanh(score / 30)",
          "q >= kv",
          {},
          {},
          Layout::kBSHD,
          {}};
}
GeneratedCase alibi_thd_f16_d64() {
  return {"f16_d64_alibi_thd",
          DType::kF16,
          64,
          64,
          "score + slopes[h] * (kv - q)",
          "",
          {{"slopes", TensorDecl{DType::kF32, {4}}}},
          {},
          Layout::kTHD,
          {}};
}

// NVRTC compiles `source` to a cubin (no GPU needed); a compile error is the test's failure.
void expect_compiles(const std::string& source, const std::string& name, int capability,
                     const std::string& suffix = "") {
  std::vector<char> cubin;
  try {
    cubin = cuda::compile_to_cubin(source, name, capability, suffix);
  } catch (const Error& error) {
    ADD_FAILURE() << error.what();
  }
  EXPECT_FALSE(cubin.empty());
}

// The wgmma translation units, forward and forward + backward, compile for sm_90a with NVRTC (no
// GPU) and hold the warpgroup instructions: the engine's module on an H200.
TEST(CudaForwardCompile, WgmmaTranslationUnitsCompileForSm90a) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  for (const auto& [c, backward] :
       {std::pair{softcap_causal_bf16_d128(), false}, std::pair{alibi_thd_f16_d64(), true}}) {
    SCOPED_TRACE(c.name);
    const Problem problem = backward ? make_backward_problem(c) : make_problem(c);
    const cuda::KernelSelection selection = cuda::choose_kernel(problem, kCapability);
    ASSERT_EQ(selection.choice.kind, cuda::KernelKind::kWgmma);
    const cuda::BindingSelection bindings = cuda::bind_modifier(problem);
    ASSERT_TRUE(bindings.reason.empty()) << bindings.reason;
    std::optional<cuda::BackwardCode> backward_code;
    if (backward) {
      const cuda::BackwardChoice choice = cuda::choose_backward_kernel(problem, kCapability).choice;
      EXPECT_TRUE(choice.wgmma);
      backward_code = cuda::backward_code(problem, choice);
    }
    const std::string source = cuda::generate_translation_unit(
        problem, bindings.bindings, selection.choice, backward_code ? &*backward_code : nullptr);
    EXPECT_NE(source.find("flexattn_kernels::forward_wgmma<FlexattnConfig"), std::string::npos);
    if (backward) {
      EXPECT_NE(source.find("flexattn_kernels::backward_dkdv_wgmma<FlexattnWgmmaConfig"),
                std::string::npos);
      EXPECT_NE(source.find("flexattn_kernels::backward_dq_wgmma<FlexattnWgmmaConfig"),
                std::string::npos);
    }
    expect_compiles(source, c.name + ".cu", kCapability, selection.choice.architecture_suffix());
  }
}

// The wgmma forward at the wide head dims (256, and MLA's 192/128): 64-key tiles, O += P V as
// one m64n256k16 per 16 keys at 256. Forward and backward in one module: the backward at these
// head dims is the wide wgmma kernels', compiled for sm_90a with the forward.
TEST(CudaForwardCompile, WideHeadDimWgmmaTranslationUnitsCompileForSm90a) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  const TensorDecl slopes{DType::kF32, {4}};
  for (const auto& [c, backward] :
       {std::pair{GeneratedCase{"wgmma_bf16_d256_softcap_causal",
                                DType::kBF16,
                                256,
                                256,
                                "30 * tanh(score / 30)",
                                "q >= kv",
                                {},
                                {},
                                Layout::kBSHD,
                                {}},
                  true},
        std::pair{GeneratedCase{"wgmma_f16_d256_alibi_thd",
                                DType::kF16,
                                256,
                                256,
                                "score + slopes[h] * (kv - q)",
                                "",
                                {{"slopes", slopes}},
                                {},
                                Layout::kTHD,
                                {}},
                  true},
        std::pair{
            GeneratedCase{
                "wgmma_bf16_d192_v128", DType::kBF16, 192, 128, "", "", {}, {}, Layout::kBSHD, {}},
            true}}) {
    SCOPED_TRACE(c.name);
    const Problem problem = backward ? make_backward_problem(c) : make_problem(c);
    const cuda::KernelSelection selection = cuda::choose_kernel(problem, kCapability);
    ASSERT_TRUE(selection.reason.empty()) << selection.reason;
    ASSERT_EQ(selection.choice.kind, cuda::KernelKind::kWgmma);
    EXPECT_EQ(selection.choice.block_n, 64);
    EXPECT_FALSE(selection.choice.pipelined);
    const cuda::BindingSelection bindings = cuda::bind_modifier(problem);
    ASSERT_TRUE(bindings.reason.empty()) << bindings.reason;
    std::optional<cuda::BackwardCode> backward_code;
    if (backward) {
      const cuda::BackwardChoice choice = cuda::choose_backward_kernel(problem, kCapability).choice;
      EXPECT_FALSE(choice.wgmma);
      EXPECT_TRUE(choice.wgmma_wide);
      EXPECT_EQ(choice.kind, cuda::KernelKind::kMma);
      backward_code = cuda::backward_code(problem, choice);
    }
    const std::string source = cuda::generate_translation_unit(
        problem, bindings.bindings, selection.choice, backward_code ? &*backward_code : nullptr);
    EXPECT_NE(source.find(fmt::format("flexattn_kernels::WgmmaConfig<{}, {}, {}, 64, 2, false, {}>",
                                      cuda::element_tag(c.dtype), c.head_dim_qk, c.head_dim_v,
                                      selection.choice.shared_bytes)),
              std::string::npos);
    EXPECT_NE(source.find("flexattn_kernels::forward_wgmma<FlexattnConfig"), std::string::npos);
    if (backward) {
      EXPECT_NE(source.find("flexattn_kernels::backward_dkdv_wgmma_wide<FlexattnWgmmaConfig"),
                std::string::npos);
      EXPECT_NE(source.find("flexattn_kernels::backward_dq_wgmma_wide<FlexattnWgmmaConfig"),
                std::string::npos);
    }
    expect_compiles(source, c.name + ".cu", kCapability, selection.choice.architecture_suffix());
  }
}

// The staged wgmma forward: two stages without pipelining and the bias tiles in the shared
// memory; the generated code reads the tile when the kernel passes one, and compiles for sm_90a.
TEST(CudaForwardCompile, StagedTensorCompilesForSm90a) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  for (const std::int64_t head_dim : {64, 128, 256}) {
    SCOPED_TRACE(head_dim);
    const Problem problem = staging_problem(
        "score + bias[h, q, kv]", TensorDecl{DType::kBF16, {4, 128, 128}}, Layout::kBSHD, head_dim);
    cuda::KernelChoice choice = cuda::choose_kernel(problem, kCapability).choice;
    ASSERT_EQ(choice.kind, cuda::KernelKind::kWgmma);
    choice.take_turns = choice.pipelined;
    ASSERT_EQ(cuda::stage_wgmma_tensor(choice), "");
    EXPECT_TRUE(choice.stage_tensor);
    EXPECT_FALSE(choice.pipelined);
    EXPECT_FALSE(choice.take_turns);
    EXPECT_EQ(choice.stages, 2);
    const int h = static_cast<int>(head_dim);
    const int n = head_dim == 128 ? 128 : 64;   // keys per tile
    const int blocks = head_dim == 64 ? 2 : 1;  // per multiprocessor
    EXPECT_EQ(choice.block_n, n);
    EXPECT_EQ(choice.min_blocks, blocks);
    EXPECT_EQ(choice.shared_bytes, 1024 + 128 * h * 2 + 2 * (n * 2 * h * 2 + 128 * n * 2));
    EXPECT_NE(choice.config_type().find(fmt::format(", false, 2, {}, true>", blocks)),
              std::string::npos)
        << choice.config_type();
    // The unstaged fallback: the same shape without the tile.
    const cuda::KernelChoice unstaged = cuda::without_staged_tensor(choice);
    EXPECT_FALSE(unstaged.stage_tensor);
    EXPECT_EQ(unstaged.block_n, n);
    EXPECT_EQ(unstaged.shared_bytes, 1024 + 128 * h * 2 + 2 * n * 2 * h * 2);
    EXPECT_NE(choice.describe().find("staged in shared memory"), std::string::npos);
    const std::string source = cuda::generate_translation_unit(
        problem, cuda::bind_modifier(problem).bindings, choice, nullptr);
    const std::string generated = source.substr(source.find("// ---- generated"));
    for (const char* fragment :
         {"staged != nullptr ? staged_bf16(*staged) : load_tensor_bf16(", "kStagedTensor = 0;",
          "kStagedRowStride = 128LL;", "staged_origin("}) {
      EXPECT_NE(generated.find(fragment), std::string::npos) << fragment << "\n" << generated;
    }
    expect_compiles(source, "staged.cu", kCapability, choice.architecture_suffix());
  }
  // The mma.sync kernel (no sm_90) never stages: its generated code has no staged read.
  const Problem plain =
      staging_problem("score + bias[h, q, kv]", TensorDecl{DType::kBF16, {4, 128, 128}});
  const cuda::KernelChoice mma_sync = cuda::choose_kernel(plain, 0).choice;
  ASSERT_EQ(mma_sync.kind, cuda::KernelKind::kMma);
  const std::string source = cuda::generate_translation_unit(
      plain, cuda::bind_modifier(plain).bindings, mma_sync, nullptr);
  EXPECT_EQ(source.find("staged_bf16(*staged"), std::string::npos);
  EXPECT_NE(source.find("kStagedTensor = -1;"), std::string::npos);
}

// The head-dim-128 wgmma forward compiles for sm_90a with its producer warpgroup and with the
// warpgroups taking turns, hands its registers over (setmaxnreg), launches with the producer's
// threads, and says so.
TEST(CudaForwardCompile, WgmmaProducerTakingTurnsCompilesForSm90a) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  const Problem problem = make_problem(softcap_causal_bf16_d128());
  cuda::KernelChoice choice = cuda::choose_kernel(problem, kCapability).choice;
  ASSERT_TRUE(choice.pipelined);
  ASSERT_TRUE(choice.producer);
  choice.take_turns = choice.turns_possible();
  EXPECT_NE(choice.describe().find("take turns"), std::string::npos) << choice.describe();
  const std::string source = cuda::generate_translation_unit(
      problem, cuda::bind_modifier(problem).bindings, choice, nullptr);
  EXPECT_NE(source.find("230464, true, 2, 1, false, true>"), std::string::npos);
  EXPECT_NE(source.find("__launch_bounds__(FlexattnConfig::kBlockThreads"), std::string::npos);
  expect_compiles(source, "turns.cu", kCapability, choice.architecture_suffix());
}

// The backward translation units compile for sm_90 (NVRTC, no GPU). These need the backward
// kernels (kernels/backward_mma.cuh and backward_simt.cuh): they fail until those templates exist.
TEST(CudaBackwardCompile, GeneratedBackwardTranslationUnitsCompile) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  const TensorDecl per_head{DType::kF32, {4}};
  const TensorDecl bias{DType::kF32, {4, 100, 77}};
  for (const GeneratedCase& c :
       {GeneratedCase{"bwd_bf16_d64_softcap_alibi_bias",
                      DType::kBF16,
                      64,
                      64,
                      "30 * tanh(score / 30) + slopes[h] * (kv - q) + bias[h, q, kv]",
                      "q >= kv",
                      {{"slopes", per_head}, {"bias", bias}},
                      {},
                      Layout::kBSHD,
                      {}},
        GeneratedCase{"bwd_fp32_d80_gate",
                      DType::kF32,
                      80,
                      80,
                      "score * gate[h]",
                      "",
                      {{"gate", per_head}},
                      {},
                      Layout::kBSHD,
                      {}},
        // Head dims above 128: a dV and a dK block per kv tile.
        GeneratedCase{"bwd_bf16_d256_softcap_bias",
                      DType::kBF16,
                      256,
                      256,
                      "30 * tanh(score / 30) + bias[h, q, kv]",
                      "q >= kv",
                      {{"bias", bias}},
                      {},
                      Layout::kBSHD,
                      {}},
        GeneratedCase{
            "bwd_fp16_d192_v128", DType::kF16, 192, 128, "score", "", {}, {}, Layout::kTHD, {}}}) {
    SCOPED_TRACE(c.name);
    const std::string source = cuda_engine()->generated_source(make_backward_problem(c));
    ASSERT_EQ(source.find("not supported"), std::string::npos) << source;
    expect_compiles(source, c.name + ".cu", kCapability);
  }
  // The wgmma backward at head dim 128, softcap and causal, for sm_90a.
  const Problem problem = make_backward_problem(softcap_causal_bf16_d128());
  const cuda::KernelSelection selection = cuda::choose_kernel(problem, kCapability);
  const cuda::BackwardCode code =
      cuda::backward_code(problem, cuda::choose_backward_kernel(problem, kCapability).choice);
  ASSERT_TRUE(code.choice.wgmma);
  const std::string source = cuda::generate_translation_unit(
      problem, cuda::bind_modifier(problem).bindings, selection.choice, &code);
  EXPECT_NE(source.find(code.choice.wgmma_config_type()), std::string::npos) << source;
  expect_compiles(source, "bwd_bf16_d128_softcap_wgmma.cu", kCapability, "a");
}

// The non-finite repair module the cudnn engine runs after its graphs (repair.hpp): forward and
// backward, every catalogue case of the shared list; its Modifier is proven equal to the request
// as the engine's own sources are (a changed function is refused), and it compiles for sm_90.
// A paged-cache problem (forward only) of make_problem's modifiers: `tokens` new tokens per
// sequence (bshd; one: decoding) or chunked prefill (thd, sequences of `tokens` + 4 and
// `second_tokens` new tokens), capacity `max_pages` pages of 16.
Problem make_cache_problem(const GeneratedCase& c, std::int64_t heads_q, std::int64_t heads_kv,
                           std::int64_t tokens = 1, std::int64_t second_tokens = 3,
                           std::int64_t max_pages = 32) {
  ProblemDesc desc;
  desc.batch = 2;
  desc.heads_q = heads_q;
  desc.heads_kv = heads_kv;
  desc.head_dim_qk = c.head_dim_qk;
  desc.head_dim_v = c.head_dim_v;
  desc.dtype = c.dtype;
  desc.layout = c.layout;
  desc.device = Device::kCuda;
  desc.tensors = c.tensors;
  desc.params = c.params;
  desc.seq_len_q = tokens;
  if (c.layout == Layout::kTHD) {
    desc.cu_seqlens_q = {0, tokens + 4, tokens + 4 + second_tokens};
    desc.seq_len_q = 0;
  }
  desc.kv_cache = KvCacheDesc{64, 16, max_pages};
  if (!c.score_mod.empty()) desc.score_mod = ir::parse(c.score_mod, desc.scope());
  if (!c.mask_mod.empty()) desc.mask_mod = ir::parse(c.mask_mod, desc.scope());
  return Problem(std::move(desc));
}

// The paged-cache module (kernels/decode.cuh): the decode kernel and its split combination. On
// tensor cores (bf16/fp16, head dims multiples of 8, 16-byte pool strides): 16 packed rows per
// block, 64 for chunked prefill (at least 64 packed rows per sequence and kv head, head dims up
// to 128); else on the fp32 units, rows per block from the GQA group and the new tokens, 16-byte
// loads where the head dim allows. On sm_90, chunked prefill with at least 128 new tokens in
// every sequence, wgmma head dims and (with a mask) a capacity the kernel's tile list holds takes
// the wgmma forward over the cache (forward_prefill_wgmma). The plan proof holds for its Modifier
// and NVRTC compiles it for sm_90 (sm_90a for wgmma). A cache problem is never given a training
// kernel.
TEST(CudaDecodeCompile, PagedCacheTranslationUnitsAreProvenAndCompile) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  const TensorDecl slopes{DType::kF32, {8}};
  struct DecodeCase {
    GeneratedCase c;
    std::int64_t heads_q, heads_kv;
    int rows;
    bool vector;
    bool tensor_cores;
    std::int64_t tokens = 1;
    bool wgmma = false;  // chunked prefill on the wgmma forward (rows: its 128 per block)
    std::int64_t second_tokens = 3;  // thd: the second sequence's new tokens
    std::int64_t max_pages = 32;
  };
  const std::vector<DecodeCase> cases = {
      {{"decode_bf16_d128_softcap_window", DType::kBF16, 128, 128, "30 * tanh(score / 30)",
        "q - kv < 256", {}, {}, Layout::kBSHD, {}},
       8, 2, 16, true, true},
      {{"decode_bf16_d64_alibi_head_thd", DType::kBF16, 64, 64,
        "score - exp2(-8.0 * (h + 1) / 8) * abs(q - kv)", "q >= kv", {}, {}, Layout::kTHD, {}},
       8, 1, 16, true, true},
      {{"decode_f32_d64_alibi_thd", DType::kF32, 64, 64, "score + slopes[h] * (kv - q)", "q >= kv",
        {{"slopes", slopes}}, {}, Layout::kTHD, {}},
       8, 8, 8, true, false},
      {{"decode_f16_d80_v72", DType::kF16, 80, 72, "", "", {}, {}, Layout::kBSHD, {}}, 2, 1, 16,
       true, true},
      {{"decode_bf16_d36", DType::kBF16, 36, 36, "", "q >= kv", {}, {}, Layout::kBSHD, {}}, 1, 1,
       1, false, false},
      {{"prefill_bf16_d128_softcap_causal", DType::kBF16, 128, 128, "30 * tanh(score / 30)",
        "q >= kv", {}, {}, Layout::kBSHD, {}},
       8, 2, 64, true, true, 16},
      {{"prefill_f16_d64_alibi_head_window_thd", DType::kF16, 64, 64,
        "score - exp2(-8.0 * (h + 1) / 8) * abs(q - kv)", "q >= kv && q - kv < 100", {}, {},
        Layout::kTHD, {}},
       4, 4, 64, true, true, 60},
      {{"prefill_bf16_d80_v72", DType::kBF16, 80, 72, "", "", {}, {}, Layout::kBSHD, {}}, 2, 1,
       64, true, true, 40},
      // Head dim 256 keeps 16 rows per block (64 spill there: kPrefillMaxDim in tile_plan.cpp).
      {{"prefill_bf16_d256", DType::kBF16, 256, 256, "", "q >= kv", {}, {}, Layout::kBSHD, {}}, 2,
       1, 16, true, true, 64},
      // From 128 new tokens in every sequence: the wgmma forward over the cache.
      {{"prefill_wgmma_bf16_d128_softcap_causal", DType::kBF16, 128, 128, "30 * tanh(score / 30)",
        "q >= kv", {}, {}, Layout::kBSHD, {}},
       8, 2, 128, true, true, 200, true},
      {{"prefill_wgmma_f16_d64_alibi_head_window_thd", DType::kF16, 64, 64,
        "score - exp2(-8.0 * (h + 1) / 8) * abs(q - kv)", "q >= kv && q - kv < 100", {}, {},
        Layout::kTHD, {}},
       4, 4, 128, true, true, 140, true, 128},
      {{"prefill_wgmma_bf16_d192_v128", DType::kBF16, 192, 128, "", "", {}, {}, Layout::kBSHD, {}},
       2, 1, 128, true, true, 128, true},
      {{"prefill_wgmma_bf16_d256_causal", DType::kBF16, 256, 256, "", "q >= kv", {}, {},
        Layout::kBSHD, {}},
       2, 1, 128, true, true, 300, true},
      // A mixed batch (a sequence decoding beside the chunk), a head dim wgmma lacks, and a masked
      // cache longer than the tile list holds keep the mma.sync kernel.
      {{"prefill_mixed_thd", DType::kBF16, 128, 128, "", "q >= kv", {}, {}, Layout::kTHD, {}}, 8,
       2, 64, true, true, 200, false, 1},
      {{"prefill_bf16_d80_long", DType::kBF16, 80, 80, "", "", {}, {}, Layout::kBSHD, {}}, 2, 1,
       64, true, true, 200},
      {{"prefill_bf16_d128_masked_long_cache", DType::kBF16, 128, 128, "", "q >= kv", {}, {},
        Layout::kBSHD, {}},
       2, 1, 64, true, true, 200, false, 3, 6200}};
  for (const DecodeCase& d : cases) {
    SCOPED_TRACE(d.c.name);
    const Problem problem = make_cache_problem(d.c, d.heads_q, d.heads_kv, d.tokens,
                                               d.second_tokens, d.max_pages);
    const cuda::KernelSelection selection = cuda::choose_kernel(problem, kCapability);
    ASSERT_TRUE(selection.reason.empty()) << selection.reason;
    ASSERT_EQ(selection.choice.kind, cuda::KernelKind::kDecode);
    EXPECT_EQ(selection.choice.block_m, d.rows);
    EXPECT_EQ(selection.choice.vector_loads, d.vector);
    EXPECT_EQ(selection.choice.tensor_cores, d.tensor_cores);
    EXPECT_EQ(selection.choice.paged_wgmma, d.wgmma);
    EXPECT_EQ(selection.choice.architecture_suffix(), d.wgmma ? "a" : "");
    // Without wgmma (another device, or FLEXATTN_CUDA_WGMMA=0) prefill keeps the mma.sync kernel.
    EXPECT_FALSE(cuda::choose_kernel(problem, 89).choice.paged_wgmma);
    EXPECT_FALSE(cuda::choose_kernel(problem, kCapability, false).choice.paged_wgmma);
    const cuda::BindingSelection bindings = cuda::bind_modifier(problem);
    ASSERT_TRUE(bindings.reason.empty()) << bindings.reason;
    const std::string source =
        cuda::generate_translation_unit(problem, bindings.bindings, selection.choice, nullptr);
    const char* kernel = d.wgmma          ? "forward_prefill_wgmma"
                         : d.tensor_cores ? "forward_decode_mma"
                                          : "forward_decode";
    EXPECT_NE(source.find(fmt::format("flexattn_kernels::{}<FlexattnConfig", kernel)),
              std::string::npos);
    const char* config_type = d.wgmma ? "using FlexattnConfig = flexattn_kernels::WgmmaConfig<"
                              : d.tensor_cores ? "DecodeMmaConfig<"
                                               : "DecodeConfig<";
    EXPECT_NE(source.find(config_type), std::string::npos);
    if (d.wgmma) {
      EXPECT_NE(source.find("void __launch_bounds__(FlexattnConfig::kBlockThreads, "
                            "FlexattnConfig::kMinBlocks)"),
                std::string::npos);
    }
    // 64-row blocks name their row count (the 16-row default keeps its type, and cache key).
    const std::size_t config = source.find("using FlexattnConfig = ");
    ASSERT_NE(config, std::string::npos);
    const std::string line = source.substr(config, source.find('\n', config) - config);
    EXPECT_EQ(line.ends_with(", 64>;"), !d.wgmma && d.rows == 64) << line;
    EXPECT_NE(source.find(fmt::format("void __launch_bounds__(flexattn_kernels::"
                                      "kDecodeCombineThreads) {}(",
                                      cuda::kDecodeCombineName)),
              std::string::npos);
    EXPECT_TRUE(cuda::prove_modifier_source(problem, bindings.bindings, source).proven);
    expect_compiles(source, d.c.name + ".cu", kCapability,
                    selection.choice.architecture_suffix());
  }
}

TEST(CudaRepairCompile, RepairTranslationUnitsAreProvenAndCompile) {
  SKIP_WITHOUT_CUDA_ENGINE();
  constexpr int kCapability = 90;
  const std::shared_ptr<const cuda::Driver> driver = cuda::Driver::open();
  std::vector<std::pair<GeneratedCase, bool>> repairs;
  for (const GeneratedCase& c : cases()) repairs.emplace_back(c, false);
  const TensorDecl slopes{DType::kF32, {4}};
  repairs.emplace_back(softcap_causal_bf16_d128(), true);
  repairs.emplace_back(GeneratedCase{"repair_bwd_f16_d192_v128_alibi_thd",
                                     DType::kF16,
                                     192,
                                     128,
                                     "score + slopes[h] * (kv - q)",
                                     "q >= kv",
                                     {{"slopes", slopes}},
                                     {},
                                     Layout::kTHD,
                                     {}},
                       true);
  for (const auto& [c, backward] : repairs) {
    SCOPED_TRACE(c.name + (backward ? " (backward)" : ""));
    const Problem problem = backward ? make_backward_problem(c) : make_problem(c);
    const cuda::RepairLowering lowering = cuda::make_non_finite_repair(problem, driver, false);
    ASSERT_TRUE(lowering.support) << lowering.support.reason();
    const cuda::BindingSelection bindings = cuda::bind_modifier(problem);
    std::optional<cuda::BackwardCode> code;
    if (backward) code = cuda::backward_code(problem, cuda::BackwardChoice{});
    const std::string source =
        cuda::generate_repair_translation_unit(problem, bindings.bindings, code ? &*code : nullptr);
    EXPECT_TRUE(cuda::prove_modifier_source(problem, bindings.bindings, source).proven);
    for (std::string_view name : {cuda::kRepairForwardName, cuda::kBackwardDeltaName,
                                  cuda::kRepairDqName, cuda::kRepairDkdvName}) {
      const bool wanted = name == cuda::kRepairForwardName || backward;
      EXPECT_EQ(source.find(fmt::format("void __launch_bounds__(flexattn_kernels::k{}Threads) {}(",
                                        name == cuda::kBackwardDeltaName ? "Delta" : "Repair",
                                        name)) != std::string::npos,
                wanted)
          << name;
    }
    expect_compiles(source, c.name + (backward ? "_bwd" : "") + "_repair.cu", kCapability);
  }
  // A changed function in the repair's Modifier: the proof refuses the source.
  const Problem softcap = make_backward_problem(repairs[repairs.size() - 2].first);
  const cuda::BindingSelection bindings = cuda::bind_modifier(softcap);
  const cuda::BackwardCode code = cuda::backward_code(softcap, cuda::BackwardChoice{});
  std::string source = cuda::generate_repair_translation_unit(softcap, bindings.bindings, &code);
  const std::size_t at = source.find("ir_tanh(", source.find("struct Modifier"));
  ASSERT_NE(at, std::string::npos);
  source.replace(at, 8, "ir_sigmoid(");
  EXPECT_FALSE(cuda::prove_modifier_source(softcap, bindings.bindings, source).proven);
  // What the repair cannot serve is refused with its reason (a problem on the CPU).
  ProblemDesc cpu = softcap.desc();
  cpu.device = Device::kCpu;
  const cuda::RepairLowering refused = cuda::make_non_finite_repair(Problem(cpu), driver, false);
  EXPECT_FALSE(refused.support);
  EXPECT_NE(refused.support.reason().find("not on the cuda device"), std::string::npos);
}
#endif

#if FLEXATTN_TEST_HAS_NVRTC
// The architecture the generated code is checked for (the H200 of the benchmarks).
constexpr const char* kArchitecture = "--gpu-architecture=sm_90";

// NVRTC as the engine opens it at run time (the library of the toolkit's major version).
template <class Function>
Function nvrtc_function(const char* name) {
  static void* const handle =
      dlopen(("libnvrtc.so." + std::to_string(CUDA_VERSION / 1000)).c_str(), RTLD_NOW);
  return handle == nullptr ? nullptr : reinterpret_cast<Function>(dlsym(handle, name));
}

// Compiles like the engine does (kernel_cache.cpp) and returns NVRTC's log on failure.
std::string compile_errors(const std::string& source, const std::string& name) {
  const auto create = nvrtc_function<decltype(&nvrtcCreateProgram)>("nvrtcCreateProgram");
  const auto compile = nvrtc_function<decltype(&nvrtcCompileProgram)>("nvrtcCompileProgram");
  const auto log_size = nvrtc_function<decltype(&nvrtcGetProgramLogSize)>("nvrtcGetProgramLogSize");
  const auto get_log = nvrtc_function<decltype(&nvrtcGetProgramLog)>("nvrtcGetProgramLog");
  const auto destroy = nvrtc_function<decltype(&nvrtcDestroyProgram)>("nvrtcDestroyProgram");
  if (!create || !compile || !log_size || !get_log || !destroy) return "NVRTC not loaded";
  nvrtcProgram program = nullptr;
  if (create(&program, source.c_str(), name.c_str(), 0, nullptr, nullptr) != NVRTC_SUCCESS) {
    return "nvrtcCreateProgram failed";
  }
  const char* options[] = {kArchitecture, "-std=c++17"};
  const nvrtcResult result = compile(program, 2, options);
  std::string log;
  std::size_t size = 0;
  log_size(program, &size);
  log.resize(size);
  if (size > 0) get_log(program, log.data());
  destroy(&program);
  return result == NVRTC_SUCCESS ? std::string() : log;
}

#if FLEXATTN_HAVE_CUDA
// The PTX NVRTC generates for `source` (for `architecture`, a virtual one such as compute_90a),
// with the macro `define` defined when not empty; empty on failure.
std::string ptx_of(const std::string& source, const char* architecture, const std::string& define) {
  const auto create = nvrtc_function<decltype(&nvrtcCreateProgram)>("nvrtcCreateProgram");
  const auto compile = nvrtc_function<decltype(&nvrtcCompileProgram)>("nvrtcCompileProgram");
  const auto ptx_size = nvrtc_function<decltype(&nvrtcGetPTXSize)>("nvrtcGetPTXSize");
  const auto get_ptx = nvrtc_function<decltype(&nvrtcGetPTX)>("nvrtcGetPTX");
  const auto destroy = nvrtc_function<decltype(&nvrtcDestroyProgram)>("nvrtcDestroyProgram");
  if (!create || !compile || !ptx_size || !get_ptx || !destroy) return {};
  nvrtcProgram program = nullptr;
  if (create(&program, source.c_str(), "module.cu", 0, nullptr, nullptr) != NVRTC_SUCCESS)
    return {};
  const std::string macro = "-D" + define;
  std::vector<const char*> options = {architecture, "-std=c++17"};
  if (!define.empty()) options.push_back(macro.c_str());
  std::string ptx;
  std::size_t size = 0;
  if (compile(program, static_cast<int>(options.size()), options.data()) == NVRTC_SUCCESS &&
      ptx_size(program, &size) == NVRTC_SUCCESS && size > 1) {
    ptx.resize(size);
    get_ptx(program, ptx.data());
    ptx.resize(size - 1);
  }
  destroy(&program);
  return ptx;
}

// Each kernel entry of a PTX module by name: its text from `.visible .entry` to the closing
// brace, with the labels' and local depots' function numbers (their order in the module) erased.
std::map<std::string, std::string> ptx_entries(const std::string& ptx) {
  const auto without_numbers = [](const std::string& text) {
    std::string result;
    result.reserve(text.size());
    for (std::size_t i = 0; i < text.size();) {
      bool numbered = false;
      for (const std::string_view prefix :
           {std::string_view("$L__BB"), std::string_view("__local_depot")}) {
        if (text.compare(i, prefix.size(), prefix) == 0) {
          result += prefix;
          i += prefix.size();
          while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
          numbered = true;
          break;
        }
      }
      if (!numbered) result += text[i++];
    }
    return result;
  };
  std::map<std::string, std::string> entries;
  const std::string marker = ".visible .entry ";
  for (std::size_t at = ptx.find(marker); at != std::string::npos;) {
    const std::size_t next = ptx.find(marker, at + marker.size());
    std::string text = ptx.substr(at, next == std::string::npos ? std::string::npos : next - at);
    const std::size_t end = text.rfind("\n}\n");
    if (end != std::string::npos) text.erase(end + 3);
    const std::size_t name_end = text.find('(');
    entries[text.substr(marker.size(), name_end - marker.size())] = without_numbers(text);
    at = next;
  }
  return entries;
}

// A unit with a backward compiles as two modules (the engine compiles them at once): with
// kForwardModuleDefine the forward's kernel alone, with kBackwardModuleDefine the backward's four,
// and each kernel's PTX is the one the whole unit gives it, so splitting changes no kernel. The
// wgmma kernels (sm_90a) and the mma.sync ones (sm_80).
TEST(CudaBackwardCompile, ForwardAndBackwardModulesHoldTheUnitsKernelsUnchanged) {
  SKIP_WITHOUT_CUDA_ENGINE();
  const std::vector<std::pair<GeneratedCase, int>> units = {{softcap_causal_bf16_d128(), 90},
                                                            {alibi_thd_f16_d64(), 80}};
  for (const auto& [c, capability] : units) {
    SCOPED_TRACE(c.name);
    const Problem problem = make_backward_problem(c);
    const cuda::KernelSelection selection = cuda::choose_kernel(problem, capability);
    ASSERT_TRUE(selection.reason.empty()) << selection.reason;
    const cuda::BindingSelection bindings = cuda::bind_modifier(problem);
    const cuda::BackwardCode backward =
        cuda::backward_code(problem, cuda::choose_backward_kernel(problem, capability).choice);
    const std::string source =
        cuda::generate_translation_unit(problem, bindings.bindings, selection.choice, &backward);
    const std::string architecture = fmt::format("--gpu-architecture=compute_{}{}", capability,
                                                 selection.choice.architecture_suffix());
    const auto whole = ptx_entries(ptx_of(source, architecture.c_str(), ""));
    const auto forward =
        ptx_entries(ptx_of(source, architecture.c_str(), std::string(cuda::kForwardModuleDefine)));
    const auto backward_module =
        ptx_entries(ptx_of(source, architecture.c_str(), std::string(cuda::kBackwardModuleDefine)));
    ASSERT_EQ(whole.size(), 5u);
    std::vector<std::string> forward_names;
    for (const auto& [name, text] : forward) forward_names.push_back(name);
    EXPECT_EQ(forward_names, std::vector<std::string>{std::string(cuda::kKernelName)});
    std::vector<std::string> backward_names;
    for (const auto& [name, text] : backward_module) backward_names.push_back(name);
    EXPECT_EQ(backward_names,
              (std::vector<std::string>{
                  std::string(cuda::kBackwardDeltaName), std::string(cuda::kBackwardDkdvName),
                  std::string(cuda::kBackwardDqName), std::string(cuda::kBackwardFinalizeName)}));
    for (const auto& [name, text] : whole) {
      const auto& module = name == cuda::kKernelName ? forward : backward_module;
      const auto found = module.find(name);
      ASSERT_NE(found, module.end()) << name;
      EXPECT_TRUE(found->second == text) << name << ": its PTX differs in its own module";
    }
  }
}
#endif

TEST(CudaCodegen, GeneratedSourcesCompileWithNvrtc) {
  SKIP_WITHOUT_CUDA_ENGINE();
  const auto engine = cuda_engine();
  for (const GeneratedCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::string source = engine->generated_source(make_problem(c));
    const std::string errors = compile_errors(source, c.name + ".cu");
    EXPECT_TRUE(errors.empty()) << errors << "\n"
                                << source.substr(source.find("// ---- generated"));
  }
}
#endif

}  // namespace
}  // namespace flexattn
