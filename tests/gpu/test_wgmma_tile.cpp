// The facts the wgmma kernels rest on (docs/engines.md, "wgmma building blocks"), checked on one
// tile. Two probe kernels (NVRTC, sm_90a), one warpgroup each:
//   qk: S = Q K^T, 64 x 64 x 64, A and B from shared memory, K-major, 128-byte swizzle;
//   pv: O = P V,   64 x 64 x 64, A (P) from registers in the m16n8k16 A layout, B (V, stored
//       keys x dims) from shared memory as a transposed (MN-major) operand.
// Both write the accumulator in the layout the kernels assume (per warp 16 rows; per 8-column slice
// rows group and group + 8, columns 2 quad_lane and + 1). Compared with a double-precision host
// product of the same bf16 inputs. Skipped without an sm_90 device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engines/cuda/driver.hpp"
#include "engines/cuda/kernel_cache.hpp"
#include "flexattn/flexattn.hpp"

namespace flexattn {
namespace {

constexpr int kTile = 64;

// The wgmma of one k-step: 32 fp32 accumulators, A as a descriptor ("l") or 4 registers ("r").
std::string wgmma_asm(bool a_in_registers) {
  std::string outputs;
  for (int i = 0; i < 32; ++i) outputs += fmt::format("{}%{}", i ? ", " : "", i);
  const std::string a = a_in_registers ? "{%32, %33, %34, %35}" : "%32";
  const int b = a_in_registers ? 36 : 33;
  const int scale = b + 1;
  const std::string immediates = a_in_registers ? "1, 1, 1" : "1, 1, 0, 0";
  std::string operands = "      : ";
  for (int i = 0; i < 32; ++i) operands += fmt::format("{}\"+f\"(d[{}])", i ? ", " : "", i);
  operands += a_in_registers ? "\n      : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), "
                             : "\n      : \"l\"(a_desc), ";
  operands += "\"l\"(b_desc), \"r\"(accumulate));\n";
  return fmt::format(
      "  asm volatile(\n"
      "      \"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{}, 0;\\n\"\n"
      "      \"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{{}}}, {}, %{}, p, {};\\n}}\\n\"\n"
      "{}",
      scale, outputs, a, b, immediates, operands);
}

// The probe kernels' source.
std::string probe_source() {
  std::string text = R"(
// 128-byte swizzle: 16-byte chunk c of a 128-byte row r sits at chunk c ^ (r % 8).
__device__ __forceinline__ void load_swizzled(unsigned short* tile, const unsigned short* source) {
  for (int i = threadIdx.x; i < 64 * 8; i += 128) {
    const int row = i / 8, chunk = i % 8;
    *reinterpret_cast<uint4*>(tile + row * 64 + ((chunk ^ (row % 8)) * 8)) =
        *reinterpret_cast<const uint4*>(source + row * 64 + chunk * 8);
  }
}
__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}
// Shared-memory matrix descriptor: address >> 4 (bits 0-13), leading byte offset >> 4 (16-29),
// stride byte offset >> 4 (32-45), swizzle 1 = 128 bytes (62-63).
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned leading,
                                                         unsigned stride) {
  return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>(leading >> 4) << 16) |
         (static_cast<unsigned long long>(stride >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void store_accumulators(float* out, const float (&d)[32]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad_lane = lane % 4;
  for (int j = 0; j < 8; ++j) {
    const int row = warp * 16 + group, column = j * 8 + 2 * quad_lane;
    out[row * 64 + column] = d[4 * j];
    out[row * 64 + column + 1] = d[4 * j + 1];
    out[(row + 8) * 64 + column] = d[4 * j + 2];
    out[(row + 8) * 64 + column + 1] = d[4 * j + 3];
  }
}

extern "C" __global__ void __launch_bounds__(128) probe_qk(const unsigned short* q,
                                                          const unsigned short* k, float* s) {
  __shared__ __align__(1024) unsigned short q_tile[64 * 64];
  __shared__ __align__(1024) unsigned short k_tile[64 * 64];
  load_swizzled(q_tile, q);
  load_swizzled(k_tile, k);
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  for (int step = 0; step < 4; ++step) {
    // K-major, 16 elements (32 bytes) further along the row per k-step; 8 rows x 128 bytes
    // between core-matrix groups.
    const unsigned long long a_desc = descriptor(shared_address(q_tile) + step * 32, 16, 1024);
    const unsigned long long b_desc = descriptor(shared_address(k_tile) + step * 32, 16, 1024);
    const int accumulate = step > 0 ? 1 : 0;
)";
  text += wgmma_asm(false);
  text += R"(  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  store_accumulators(s, d);
}

extern "C" __global__ void __launch_bounds__(128) probe_pv(const unsigned short* p,
                                                          const unsigned short* v, float* o) {
  __shared__ __align__(1024) unsigned short v_tile[64 * 64];
  load_swizzled(v_tile, v);
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad_lane = lane % 4;
  const int row = warp * 16 + group;
  // A (P) in the m16n8k16 A layout: rows row and row + 8, keys 16 step + 2 quad_lane (+1, +8);
  // all four k-steps loaded before the fence (wgmma reads registers written before it).
  unsigned fragments[4][4];
  for (int step = 0; step < 4; ++step) {
    const int key = step * 16 + 2 * quad_lane;
    fragments[step][0] = *reinterpret_cast<const unsigned*>(p + row * 64 + key);
    fragments[step][1] = *reinterpret_cast<const unsigned*>(p + (row + 8) * 64 + key);
    fragments[step][2] = *reinterpret_cast<const unsigned*>(p + row * 64 + key + 8);
    fragments[step][3] = *reinterpret_cast<const unsigned*>(p + (row + 8) * 64 + key + 8);
  }
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  for (int step = 0; step < 4; ++step) {
    const unsigned (&a)[4] = fragments[step];
    // B = V, keys x dims with the dims contiguous: MN-major (transposed); a k-step is 16 rows of
    // 128 bytes further; 8 rows x 128 bytes between core-matrix groups along the keys.
    const unsigned long long b_desc = descriptor(shared_address(v_tile) + step * 2048, 16, 1024);
    const int accumulate = step > 0 ? 1 : 0;
)";
  text += wgmma_asm(true);
  text += R"(  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  store_accumulators(o, d);
}
)";
  return text;
}

std::vector<std::uint16_t> random_bf16(std::uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> values(kTile * kTile);
  for (std::uint16_t& value : values) value = to_bfloat16(normal(generator)).bits;
  return values;
}

double value(const std::vector<std::uint16_t>& tile, int row, int column) {
  return to_float(BFloat16{tile[static_cast<std::size_t>(row * kTile + column)]});
}

// Runs probe `name` on (a, b) and returns its 64 x 64 fp32 output.
std::vector<float> run_probe(const std::shared_ptr<const cuda::Driver>& driver,
                             const std::vector<char>& cubin, const char* name,
                             const std::vector<std::uint16_t>& a,
                             const std::vector<std::uint16_t>& b) {
  const auto& api = driver->api();
  cuda::ContextScope scope(*driver);
  CUmodule module = nullptr;
  driver->check(api.module_load_data(&module, cubin.data()), "cuModuleLoadData");
  CUfunction function = nullptr;
  driver->check(api.module_get_function(&function, module, name), "cuModuleGetFunction");
  const std::size_t input_bytes = a.size() * sizeof(std::uint16_t);
  cuda::DeviceBuffer a_buffer(driver, input_bytes), b_buffer(driver, input_bytes);
  cuda::DeviceBuffer out_buffer(driver, kTile * kTile * sizeof(float));
  a_buffer.upload(a.data(), input_bytes);
  b_buffer.upload(b.data(), input_bytes);
  CUdeviceptr a_address = a_buffer.address(), b_address = b_buffer.address();
  CUdeviceptr out_address = out_buffer.address();
  void* arguments[] = {&a_address, &b_address, &out_address};
  driver->check(api.launch_kernel(function, 1, 1, 1, 128, 1, 1, 0, nullptr, arguments, nullptr),
                "cuLaunchKernel");
  driver->check(api.context_synchronize(), "cuCtxSynchronize");
  std::vector<float> out(kTile * kTile);
  driver->check(api.copy_device_to_host(out.data(), out_address, out.size() * sizeof(float)),
                "cuMemcpyDtoH");
  api.module_unload(module);
  return out;
}

// Largest |out - expected| relative to the largest |expected|; `transpose_b` multiplies by b^T.
double relative_error(const std::vector<float>& out, const std::vector<std::uint16_t>& a,
                      const std::vector<std::uint16_t>& b, bool transpose_b) {
  double worst = 0.0, largest = 0.0;
  for (int i = 0; i < kTile; ++i) {
    for (int j = 0; j < kTile; ++j) {
      double expected = 0.0;
      for (int k = 0; k < kTile; ++k) {
        expected += value(a, i, k) * (transpose_b ? value(b, j, k) : value(b, k, j));
      }
      worst = std::max(worst, std::abs(out[static_cast<std::size_t>(i * kTile + j)] - expected));
      largest = std::max(largest, std::abs(expected));
    }
  }
  return worst / largest;
}

// Needs no device: NVRTC accepts the probes for sm_90a (a wrong operand count or modifier fails
// here, before a run is spent).
TEST(WgmmaProbeSource, CompilesForSm90a) {
  std::vector<char> cubin;
  try {
    cubin = cuda::compile_to_cubin(probe_source(), "wgmma_probe.cu", 90, "a");
  } catch (const Error& error) {
    FAIL() << error.what();
  }
  EXPECT_FALSE(cubin.empty());
}

class WgmmaProbe : public ::testing::Test {
 protected:
  void SetUp() override {
    driver_ = cuda::Driver::open();
    if (!driver_->availability()) GTEST_SKIP() << driver_->availability().reason();
    if (driver_->compute_capability() != 90) GTEST_SKIP() << "wgmma needs an sm_90 device";
    cubin_ = cuda::compile_to_cubin(probe_source(), "wgmma_probe.cu", 90, "a");
  }
  std::shared_ptr<const cuda::Driver> driver_;
  std::vector<char> cubin_;
};

TEST_F(WgmmaProbe, QueryKeyProductFromSharedMemory) {
  const std::vector<std::uint16_t> q = random_bf16(1), k = random_bf16(2);
  const std::vector<float> s = run_probe(driver_, cubin_, "probe_qk", q, k);
  EXPECT_LT(relative_error(s, q, k, true), 1e-5);  // fp32 accumulation of 64 exact products
}

TEST_F(WgmmaProbe, ProbabilityValueProductWithRegisterA) {
  const std::vector<std::uint16_t> p = random_bf16(3), v = random_bf16(4);
  const std::vector<float> o = run_probe(driver_, cubin_, "probe_pv", p, v);
  EXPECT_LT(relative_error(o, p, v, false), 1e-5);
}

}  // namespace
}  // namespace flexattn
