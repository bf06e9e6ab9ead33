// The cuda engine's kernel choices, on the CPU: which forward kernel (wgmma on sm_90 at head dims
// 64 and 128, mma.sync, the fp32 units) and which backward kernels serve a problem, with their
// tiles, threads and shared memory; which modifier tensor the wgmma forward stages; and the
// backward's kv-major tile list. Built only with the cuda engine.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "flexattn/flexattn.hpp"
#include "support/cuda_codegen_cases.hpp"

#if FLEXATTN_HAVE_CUDA
#include "engines/cuda/codegen.hpp"
#include "engines/cuda/tile_plan.hpp"

namespace flexattn {
namespace {

using namespace test;

// ---- backward kernel choice ------------------------------------------------------------------

TEST(CudaBackwardChoice, TensorCoresForSixteenBitStorage) {
  const cuda::BackwardSelection d64 = cuda::choose_backward_kernel(
      backward_problem_with(DType::kBF16, 64, 64));
  ASSERT_TRUE(d64.reason.empty()) << d64.reason;
  EXPECT_EQ(d64.choice.kind, cuda::KernelKind::kMma);
  EXPECT_EQ(d64.choice.block_q, 64);
  EXPECT_EQ(d64.choice.block_kv, 64);
  EXPECT_EQ(d64.choice.threads, 128);
  // kernels/backward_mma.cuh: 6 * 64 * (pqk + pv) bytes, plus 1024 for lse and delta (dK/dV).
  EXPECT_EQ(d64.choice.shared_dkdv, 6 * 64 * (64 + 64) + 1024);
  EXPECT_EQ(d64.choice.shared_dq, 6 * 64 * (64 + 64));

  const cuda::BackwardSelection d80 = cuda::choose_backward_kernel(
      backward_problem_with(DType::kF16, 80, 72));
  ASSERT_TRUE(d80.reason.empty()) << d80.reason;
  EXPECT_EQ(d80.choice.kind, cuda::KernelKind::kMma);
  EXPECT_EQ(d80.choice.padded_qk, 128);
  EXPECT_EQ(d80.choice.padded_v, 128);
  EXPECT_EQ(d80.choice.shared_dq, 6 * 64 * (128 + 128));
  EXPECT_NE(d80.choice.config_type().find("BackwardMmaConfig<flexattn_kernels::HalfTag, 80, 72, "
                                          "128, 128, "),
            std::string::npos)
      << d80.choice.config_type();
}

// Above 256 accumulator columns (padded qk + v) the dK/dV kernel runs two blocks per kv tile, one
// for dV and one for dK; the dQ kernel keeps one. Gemma's 256, MLA's 192/128, and 160 (padded to
// 192) all stay on tensor cores, also on sm_90 (wgmma holds 64 and 128 only).
TEST(CudaBackwardChoice, TensorCoresUpToHeadDim256WithDkAndDvInSeparateBlocks) {
  struct Expected {
    std::int64_t head_dim_qk, head_dim_v;
    int padded_qk, padded_v, parts;
  };
  for (const Expected& e : {Expected{256, 256, 256, 256, 2}, Expected{192, 128, 192, 128, 2},
                            Expected{160, 160, 192, 192, 2}, Expected{128, 128, 128, 128, 1},
                            Expected{192, 64, 192, 64, 1}, Expected{96, 96, 128, 128, 1}}) {
    SCOPED_TRACE(fmt::format("{}/{}", e.head_dim_qk, e.head_dim_v));
    for (const int capability : {80, 90}) {
      const cuda::BackwardSelection selection = cuda::choose_backward_kernel(
          backward_problem_with(DType::kBF16, e.head_dim_qk, e.head_dim_v), capability);
      ASSERT_TRUE(selection.reason.empty()) << selection.reason;
      const cuda::BackwardChoice& c = selection.choice;
      EXPECT_EQ(c.kind, cuda::KernelKind::kMma) << c.describe();
      if (c.wgmma) {
        EXPECT_EQ(capability, 90);
        EXPECT_EQ(e.head_dim_qk, 128);
        EXPECT_EQ(c.dkdv_parts, 1);
        continue;
      }
      if (c.wgmma_wide) {  // WideWgmmaOnSm90ForHeadDims256And192
        EXPECT_EQ(capability, 90);
        EXPECT_TRUE(e.head_dim_qk == 256 || (e.head_dim_qk == 192 && e.head_dim_v == 128));
        EXPECT_EQ(c.dkdv_parts, 1);
        EXPECT_LE(c.dkdv_shared_bytes(), 227 * 1024);
        continue;
      }
      EXPECT_EQ(c.padded_qk, e.padded_qk);
      EXPECT_EQ(c.padded_v, e.padded_v);
      EXPECT_EQ(c.dkdv_parts, e.parts);
      EXPECT_EQ(c.shared_dkdv, 6 * 64 * (e.padded_qk + e.padded_v) + 1024);
      EXPECT_EQ(c.config_type(),
                fmt::format("flexattn_kernels::BackwardMmaConfig<flexattn_kernels::BFloat16Tag, "
                            "{}, {}, {}, {}, {}, {}, {}>",
                            e.head_dim_qk, e.head_dim_v, e.padded_qk, e.padded_v, c.shared_dkdv,
                            c.shared_dq, e.parts));
      EXPECT_EQ(c.describe().find("separate blocks") != std::string::npos, e.parts == 2)
          << c.describe();
      // One block of each head's tiles fits the 227 KB of an sm_90 multiprocessor.
      EXPECT_LE(c.dkdv_shared_bytes(), 227 * 1024);
      EXPECT_LE(c.dq_shared_bytes(), 227 * 1024);
    }
  }
}

// On sm_90 both backward kernels run on wgmma for head dims 64/128: dK/dV over 128-key blocks
// (64-row q blocks), dQ over 128-row blocks (64-key tiles), 256 threads each.
TEST(CudaBackwardChoice, WgmmaOnSm90ForHeadDims64And128) {
  const cuda::BackwardSelection d128 =
      cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 128, 128), 90);
  ASSERT_TRUE(d128.reason.empty()) << d128.reason;
  const cuda::BackwardChoice& c = d128.choice;
  EXPECT_TRUE(c.wgmma);
  EXPECT_EQ(c.block_q, 64);
  EXPECT_EQ(c.block_kv, 64);
  EXPECT_EQ(c.dkdv_block_kv, 128);
  EXPECT_EQ(c.dq_block_q, 128);
  EXPECT_EQ(c.dkdv_threads, 256);
  EXPECT_EQ(c.dq_threads, 256);
  EXPECT_EQ(c.architecture_suffix(), "a");
  EXPECT_EQ(c.dkdv_template(), "backward_dkdv_wgmma");
  EXPECT_EQ(c.dq_template(), "backward_dq_wgmma");
  // kernels/backward_wgmma.cuh: 1024 + 128 rows resident (K, V or Q, dO) + 3 stages of 64 rows
  // of the other pair, + 3 x 512 for lse and delta (dK/dV).
  EXPECT_EQ(c.dkdv_shared_bytes(), 1024 + 128 * 256 * 2 + 3 * 64 * 256 * 2 + 3 * 512);
  EXPECT_EQ(c.dq_shared_bytes(), 1024 + 128 * 256 * 2 + 3 * 64 * 256 * 2);
  EXPECT_EQ(c.wgmma_config_type(),
            fmt::format("flexattn_kernels::BackwardWgmmaConfig<flexattn_kernels::BFloat16Tag, "
                        "128, 128, {}, {}>",
                        c.dkdv_shared_bytes(), c.dq_shared_bytes()));
  for (const cuda::BackwardSelection& other :
       {cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 128, 128), 80),
        cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 128, 128), 90, false),
        cuda::choose_backward_kernel(backward_problem_with(DType::kF16, 80, 72), 90),
        // The wgmma forward takes these; the wgmma backward does not (256: see below).
        cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 256, 256), 80),
        cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 256, 256), 90, false),
        cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 192, 128), 80),
        cuda::choose_backward_kernel(backward_problem_with(DType::kBF16, 160, 160), 90)}) {
    EXPECT_FALSE(other.choice.wgmma_wide);
    EXPECT_FALSE(other.choice.wgmma);
    EXPECT_EQ(other.choice.dkdv_block_kv, other.choice.block_kv);
    EXPECT_EQ(other.choice.dq_block_q, other.choice.block_q);
    EXPECT_EQ(other.choice.dkdv_shared_bytes(), other.choice.shared_dkdv);
    EXPECT_EQ(other.choice.dkdv_template(), "backward_dkdv_mma");
    EXPECT_EQ(other.choice.dq_template(), "backward_dq_mma");
  }
}

// Head dims 256 and 192/128 on sm_90: both kernels on wgmma with the warpgroups splitting the
// columns (64 keys per dK/dV block, one part; 64 rows per dQ block; 256 threads each); the module
// needs sm_90a.
TEST(CudaBackwardChoice, WideWgmmaOnSm90ForHeadDims256And192) {
  for (const auto& [dtype, qk, v] :
       {std::tuple{DType::kBF16, 256, 256}, std::tuple{DType::kF16, 256, 256},
        std::tuple{DType::kBF16, 192, 128}}) {
    SCOPED_TRACE(fmt::format("{} {}/{}", to_string(dtype), qk, v));
    const cuda::BackwardSelection d256 =
        cuda::choose_backward_kernel(backward_problem_with(dtype, qk, v), 90);
    ASSERT_TRUE(d256.reason.empty()) << d256.reason;
    const cuda::BackwardChoice& c = d256.choice;
    EXPECT_FALSE(c.wgmma);
    EXPECT_TRUE(c.wgmma_wide);
    EXPECT_EQ(c.kind, cuda::KernelKind::kMma);
    EXPECT_EQ(c.dkdv_parts, 1);
    EXPECT_EQ(c.dkdv_block_kv, 64);
    EXPECT_EQ(c.dq_block_q, 64);
    EXPECT_EQ(c.dkdv_threads, 256);
    EXPECT_EQ(c.dq_threads, 256);
    EXPECT_EQ(c.architecture_suffix(), "a");
    EXPECT_EQ(c.dkdv_template(), "backward_dkdv_wgmma_wide");
    EXPECT_EQ(c.dq_template(), "backward_dq_wgmma_wide");
    // kernels/backward_wgmma_wide.cuh: 1024 + K and V (dK/dV) or Q and dO (dQ) of 64 rows + 2
    // stages of the other pair + the exchange tiles (P^T and dS^T; dS) + 2 x 512 for lse and delta
    // (dK/dV) or the two warpgroups' row sums (dQ).
    const int dims = qk + v;
    EXPECT_EQ(c.dkdv_shared_bytes(),
              1024 + 64 * dims * 2 + 2 * 64 * dims * 2 + 2 * 64 * 64 * 2 + 2 * 512);
    EXPECT_EQ(c.dq_shared_bytes(),
              1024 + 64 * dims * 2 + 2 * 64 * dims * 2 + 64 * 64 * 2 + 2 * 512);
    EXPECT_LE(c.dkdv_shared_bytes(), 227 * 1024);
    EXPECT_LE(c.dq_shared_bytes(), 227 * 1024);
    EXPECT_EQ(
        c.wgmma_config_type(),
        fmt::format("flexattn_kernels::BackwardWgmmaWideConfig<{}, {}, {}, {}, {}>",
                    cuda::element_tag(dtype), qk, v, c.dkdv_shared_bytes(), c.dq_shared_bytes()));
  }
}

TEST(CudaBackwardChoice, FloatUnitsOtherwiseWithTheirReason) {
  struct Expected {
    DType dtype;
    std::int64_t head_dim_qk, head_dim_v;
    const char* why;
  };
  for (const Expected& e : {Expected{DType::kF32, 64, 64, "fp32 storage"},
                            Expected{DType::kBF16, 17, 17, "not multiples of 8"},
                            Expected{DType::kF16, 256, 100, "not multiples of 8"}}) {
    SCOPED_TRACE(e.why);
    const cuda::BackwardSelection selection =
        cuda::choose_backward_kernel(backward_problem_with(e.dtype, e.head_dim_qk, e.head_dim_v));
    ASSERT_TRUE(selection.reason.empty()) << selection.reason;
    EXPECT_EQ(selection.choice.kind, cuda::KernelKind::kSimt);
    EXPECT_NE(selection.choice.why.find(e.why), std::string::npos) << selection.choice.why;
    EXPECT_NE(selection.choice.describe().find(e.why), std::string::npos);
    EXPECT_EQ(selection.choice.block_q, 32);
    EXPECT_EQ(selection.choice.block_kv, 32);
    // kernels/backward_simt.cuh: 4 * (2 * 32 * (dqk + dv) + 2 * 32 + 2 * 32 * 33) bytes.
    const auto dims = static_cast<int>(e.head_dim_qk + e.head_dim_v);
    EXPECT_EQ(selection.choice.shared_dkdv, 4 * (2 * 32 * dims + 2 * 32 + 2 * 32 * 33));
    EXPECT_EQ(selection.choice.shared_dq, selection.choice.shared_dkdv);
  }

  // A query stride of 68 elements: rows are not 16-byte aligned.
  GeneratedCase strided{"strided", DType::kBF16, 64, 64, "", "", {}, {}, Layout::kBSHD, {}};
  ProblemDesc desc = make_backward_problem(strided).desc();
  desc.q_strides = std::vector<std::int64_t>{100 * 4 * 68, 4 * 68, 68, 1};
  const cuda::BackwardSelection selection = cuda::choose_backward_kernel(Problem(desc));
  ASSERT_TRUE(selection.reason.empty()) << selection.reason;
  EXPECT_EQ(selection.choice.kind, cuda::KernelKind::kSimt);
  EXPECT_NE(selection.choice.why.find("stride"), std::string::npos) << selection.choice.why;
}

TEST(CudaBackwardChoice, RefusesFloat64AndHeadDimsAbove256) {
  const cuda::BackwardSelection fp64 =
      cuda::choose_backward_kernel(backward_problem_with(DType::kF64, 64, 64));
  EXPECT_NE(fp64.reason.find("fp64"), std::string::npos) << fp64.reason;
  const cuda::BackwardSelection wide =
      cuda::choose_backward_kernel(backward_problem_with(DType::kF32, 64, 264));
  EXPECT_NE(wide.reason.find("264"), std::string::npos) << wide.reason;
  EXPECT_NE(wide.reason.find("256"), std::string::npos) << wide.reason;
}

// ---- the backward's tiles --------------------------------------------------------------------

// The kv-major list holds exactly the q-major list's pairs, each kv tile's query blocks in
// ascending order with their mixed bits, for masks with skipped, full and mixed tiles.
TEST(CudaBackwardTiles, TransposeMatchesTheQueryMajorList) {
  struct MaskCase {
    const char* mask;
    std::int64_t seq_len_q, seq_len_kv;
    int block_q, block_kv;
  };
  for (const MaskCase& m : {MaskCase{"q >= kv", 300, 300, 64, 64},
                            MaskCase{"q + (KV_LEN - Q_LEN) >= kv", 200, 333, 32, 32},
                            MaskCase{"q >= kv && q - kv < 80", 500, 500, 64, 64},
                            MaskCase{"", 70, 129, 32, 32}}) {
    SCOPED_TRACE(m.mask);
    GeneratedCase c{"tiles", DType::kBF16, 64, 64, "", m.mask, {}, {}, Layout::kBSHD, {}};
    ProblemDesc desc = make_backward_problem(c).desc();
    desc.seq_len_q = m.seq_len_q;
    desc.seq_len_kv = m.seq_len_kv;
    const Problem problem(desc);
    const cuda::TileList list = cuda::classify_tiles(problem, m.block_q, m.block_kv);
    const cuda::KvTileList transposed = cuda::transpose_tiles(list);
    ASSERT_EQ(transposed.offsets.size(), static_cast<std::size_t>(list.kv_tiles + 1));
    ASSERT_EQ(transposed.offsets.front(), 0);
    ASSERT_EQ(transposed.offsets.back(), static_cast<int>(list.entries.size()));
    for (std::int64_t tile = 0; tile < list.kv_tiles; ++tile) {
      std::vector<int> expected;  // brute force: every query block whose list names this tile
      for (std::int64_t block = 0; block < list.query_blocks; ++block) {
        for (int i = list.offsets[static_cast<std::size_t>(block)];
             i < list.offsets[static_cast<std::size_t>(block) + 1]; ++i) {
          const int entry = list.entries[static_cast<std::size_t>(i)];
          if ((entry >> 1) == tile) expected.push_back(static_cast<int>(block << 1) | (entry & 1));
        }
      }
      const std::vector<int> actual(
          transposed.entries.begin() + transposed.offsets[static_cast<std::size_t>(tile)],
          transposed.entries.begin() + transposed.offsets[static_cast<std::size_t>(tile) + 1]);
      EXPECT_EQ(actual, expected) << "kv tile " << tile;
    }
    if (std::string(m.mask) == "q >= kv") {
      // Causal, square tiles: kv tile t is visited by query blocks t.. (the diagonal mixed).
      const std::int64_t blocks = list.query_blocks;
      for (std::int64_t tile = 0; tile < list.kv_tiles; ++tile) {
        const int begin = transposed.offsets[static_cast<std::size_t>(tile)];
        EXPECT_EQ(transposed.offsets[static_cast<std::size_t>(tile) + 1] - begin, blocks - tile);
        EXPECT_EQ(transposed.entries[static_cast<std::size_t>(begin)],
                  static_cast<int>(tile << 1) | 1);
      }
    }
  }
}

// ---- forward kernel choice: wgmma on sm_90, mma.sync elsewhere ----------------------------------

TEST(CudaForwardChoice, WgmmaOnlyOnSm90ForSixteenBitHeadDims64And128) {
  const auto choose = [](DType dtype, std::int64_t qk, std::int64_t v, int capability,
                         bool allow = true) {
    GeneratedCase c{"choice", dtype, qk, v, "", "", {}, {}, Layout::kBSHD, {}};
    const cuda::KernelSelection selection = cuda::choose_kernel(make_problem(c), capability, allow);
    EXPECT_TRUE(selection.reason.empty()) << selection.reason;
    return selection.choice;
  };
  const cuda::KernelChoice d128 = choose(DType::kBF16, 128, 128, 90);
  EXPECT_EQ(d128.kind, cuda::KernelKind::kWgmma);
  EXPECT_EQ(d128.block_m, 128);
  EXPECT_EQ(d128.block_n, 128);
  EXPECT_TRUE(d128.producer);  // two computing warpgroups and the producer's
  EXPECT_EQ(d128.threads(), 384);
  EXPECT_EQ(d128.architecture_suffix(), "a");
  EXPECT_EQ(d128.kernel_template(), "forward_wgmma");
  // kernels/forward_wgmma.cuh: 1024 (alignment) + Q 128 rows + 3 stages of 128 keys of K and V +
  // the producer's 64 bytes of stage barriers.
  EXPECT_EQ(d128.shared_bytes, 1024 + 128 * 128 * 2 + 3 * 128 * (128 + 128) * 2 + 64);
  EXPECT_LE(d128.shared_bytes, 227 * 1024);  // what one block may have on sm_90
  EXPECT_EQ(d128.config_type(),
            fmt::format("flexattn_kernels::WgmmaConfig<flexattn_kernels::BFloat16Tag, 128, 128, "
                        "128, 3, true, {}, false, 2, 1, false, true>",
                        d128.shared_bytes));
  EXPECT_TRUE(d128.pipelined);
  // Head dim 64: the loop that waits for each product, two stages of 128 keys, two blocks per
  // multiprocessor (the largest shared-memory carveout).
  const cuda::KernelChoice d64 = choose(DType::kF16, 64, 64, 90);
  EXPECT_EQ(d64.kind, cuda::KernelKind::kWgmma);
  EXPECT_FALSE(d64.pipelined);
  EXPECT_EQ(d64.stages, 2);
  EXPECT_EQ(d64.block_n, 128);
  EXPECT_EQ(d64.min_blocks, 2);
  EXPECT_EQ(d64.shared_bytes, 1024 + 128 * 64 * 2 + 2 * 128 * (64 + 64) * 2);
  EXPECT_NE(d64.config_type().find(", false, 2, 2>"), std::string::npos) << d64.config_type();
  EXPECT_EQ(choose(DType::kBF16, 128, 64, 90).kind, cuda::KernelKind::kWgmma);
  // Elsewhere the portable kernels: another architecture or none known, head dims wgmma does not
  // hold unpadded, fp32 storage, or the switch off.
  for (const cuda::KernelChoice& other :
       {choose(DType::kBF16, 128, 128, 80), choose(DType::kBF16, 128, 128, 0),
        choose(DType::kBF16, 128, 128, 100), choose(DType::kBF16, 96, 96, 90),
        choose(DType::kBF16, 128, 128, 90, false)}) {
    EXPECT_EQ(other.kind, cuda::KernelKind::kMma);
    EXPECT_EQ(other.architecture_suffix(), "");
  }
  EXPECT_EQ(choose(DType::kF32, 128, 128, 90).kind, cuda::KernelKind::kSimt);
}

// Head dims above 128 (Gemma's 256, MLA's 192/128): 64-key tiles, two stages, each product
// waited for, one block per multiprocessor, no producer.
TEST(CudaForwardChoice, WgmmaForWideHeadDimsTakes64KeyTiles) {
  constexpr int kCapability = 90;
  const auto choose = [](DType dtype, std::int64_t qk, std::int64_t v, int capability) {
    GeneratedCase c{"wide", dtype, qk, v, "", "", {}, {}, Layout::kBSHD, {}};
    const cuda::KernelSelection selection = cuda::choose_kernel(make_problem(c), capability);
    EXPECT_TRUE(selection.reason.empty()) << selection.reason;
    return selection.choice;
  };
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    const cuda::KernelChoice d256 = choose(dtype, 256, 256, kCapability);
    EXPECT_EQ(d256.kind, cuda::KernelKind::kWgmma);
    EXPECT_EQ(d256.block_m, 128);
    EXPECT_EQ(d256.block_n, 64);
    EXPECT_EQ(d256.warps, 8);
    EXPECT_EQ(d256.threads(), 256);
    EXPECT_EQ(d256.stages, 2);
    EXPECT_FALSE(d256.pipelined);
    EXPECT_FALSE(d256.producer);
    EXPECT_FALSE(d256.turns_possible());
    EXPECT_EQ(d256.min_blocks, 1);
    EXPECT_EQ(d256.class_block_q, 128);
    EXPECT_EQ(d256.architecture_suffix(), "a");
    // 1024 (alignment) + Q 128 x 256 + 2 stages of 64 keys of K and V.
    EXPECT_EQ(d256.shared_bytes, 1024 + 128 * 256 * 2 + 2 * 64 * (256 + 256) * 2);
    EXPECT_LE(d256.shared_bytes, 227 * 1024);
    EXPECT_EQ(d256.config_type(),
              fmt::format("flexattn_kernels::WgmmaConfig<{}, 256, 256, 64, 2, false, {}>",
                          cuda::element_tag(dtype), d256.shared_bytes));
    EXPECT_NE(d256.describe().find("128x64 tiles"), std::string::npos) << d256.describe();
  }
  const cuda::KernelChoice mla = choose(DType::kBF16, 192, 128, kCapability);
  EXPECT_EQ(mla.kind, cuda::KernelKind::kWgmma);
  EXPECT_EQ(mla.block_n, 64);
  EXPECT_FALSE(mla.pipelined);
  EXPECT_EQ(mla.min_blocks, 1);
  EXPECT_EQ(mla.shared_bytes, 1024 + 128 * 192 * 2 + 2 * 64 * (192 + 128) * 2);
  EXPECT_EQ(choose(DType::kBF16, 256, 128, kCapability).kind, cuda::KernelKind::kWgmma);
  // A V width that is no wgmma of P V (192), padded head dims, and other architectures keep the
  // mma.sync kernel.
  for (const cuda::KernelChoice& other :
       {choose(DType::kBF16, 192, 192, kCapability), choose(DType::kBF16, 160, 160, kCapability),
        choose(DType::kBF16, 256, 256, 80), choose(DType::kBF16, 256, 256, 0)}) {
    EXPECT_EQ(other.kind, cuda::KernelKind::kMma);
  }
  // The staged tensor keeps the 64-key tiles and fits beside them (225 KB).
  cuda::KernelChoice staged =
      cuda::choose_kernel(
          staging_problem("score + bias[h, q, kv]", TensorDecl{DType::kBF16, {4, 128, 128}},
                          Layout::kBSHD, 256),
          kCapability)
          .choice;
  ASSERT_EQ(staged.kind, cuda::KernelKind::kWgmma);
  ASSERT_EQ(cuda::stage_wgmma_tensor(staged), "");
  EXPECT_TRUE(staged.stage_tensor);
  EXPECT_EQ(staged.block_n, 64);
  EXPECT_EQ(staged.min_blocks, 1);
  EXPECT_EQ(staged.shared_bytes, 1024 + 128 * 256 * 2 + 2 * (64 * 512 * 2 + 128 * 64 * 2));
  EXPECT_EQ(cuda::without_staged_tensor(staged).shared_bytes,
            1024 + 128 * 256 * 2 + 2 * 64 * 512 * 2);
}

// The head-dim-128 wgmma forward has a producer warpgroup: a third warpgroup of 128 threads
// (launched, not counted in `warps`) and 64 bytes of stage barriers; head dim 64 runs two blocks
// per multiprocessor without one.
TEST(CudaForwardChoice, WgmmaProducerAddsAWarpgroupAndItsBarriers) {
  constexpr int kCapability = 90;
  const Problem d128 = make_problem(GeneratedCase{"d128", DType::kBF16, 128, 128, "", "", {}, {},
                                                  Layout::kBSHD, {}});
  const cuda::KernelChoice c = cuda::choose_kernel(d128, kCapability).choice;
  EXPECT_TRUE(c.producer);
  EXPECT_TRUE(c.pipelined);
  EXPECT_TRUE(c.turns_possible());
  EXPECT_EQ(c.warps, 8);
  EXPECT_EQ(c.threads(), 384);
  EXPECT_EQ(c.min_blocks, 1);
  EXPECT_EQ(c.shared_bytes, 230464);  // 1024 + Q + 3 stages of K and V + 64 bytes of barriers
  EXPECT_NE(c.describe().find("producer warpgroup"), std::string::npos) << c.describe();
  const Problem d64 = make_problem(GeneratedCase{"d64", DType::kBF16, 64, 64, "", "", {}, {},
                                                 Layout::kBSHD, {}});
  const cuda::KernelChoice small = cuda::choose_kernel(d64, kCapability).choice;
  EXPECT_FALSE(small.producer);
  EXPECT_FALSE(small.pipelined);
  EXPECT_EQ(small.min_blocks, 2);
  EXPECT_EQ(small.threads(), 256);
}

// Which loads the wgmma forward can stage through shared memory.
TEST(CudaForwardChoice, StageableTensorsAreDenseQueryKeyTiles) {
  const TensorDecl hqk{DType::kBF16, {4, 128, 128}};
  EXPECT_EQ(cuda::stageable_tensor(staging_problem("score + bias[h, q, kv]", hqk)), "bias");
  EXPECT_EQ(cuda::stageable_tensor(staging_problem("score + bias[b, h, q, kv]",
                                                   TensorDecl{DType::kF16, {2, 4, 128, 128}})),
            "bias");
  EXPECT_EQ(cuda::stageable_tensor(staging_problem("score * bias[h, q, kv] + 1", hqk)), "bias");
  for (const auto& [score_mod, decl, layout] :
       {std::tuple{"score + bias[h, q, kv]", TensorDecl{DType::kF32, {4, 128, 128}},
                   Layout::kBSHD},                                            // 4-byte values
        std::tuple{"score + bias[h, kv, q]", hqk, Layout::kBSHD},             // transposed
        std::tuple{"score + bias[h, q, min(kv + 1, 127)]", hqk, Layout::kBSHD},  // shifted
        std::tuple{"score + bias[h, q, kv]", hqk, Layout::kTHD},              // varlen
        std::tuple{"score + bias[kv % 4, q, kv]", hqk, Layout::kBSHD}}) {     // varying head
    SCOPED_TRACE(score_mod);
    EXPECT_EQ(cuda::stageable_tensor(staging_problem(score_mod, decl, layout)), "");
  }
}

}  // namespace
}  // namespace flexattn
#endif
