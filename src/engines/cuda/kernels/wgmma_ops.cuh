// Hopper's warpgroup matrix products (wgmma, PTX ISA 8.0+, target sm_90a only) and what they
// rest on: shared-memory matrix descriptors, the async-proxy fence, commit and wait.
// docs/engines.md ("wgmma building blocks") has the facts; tests/gpu/test_wgmma_tile.cpp proves
// the descriptor, swizzle and accumulator layout on one tile.
//
// One wgmma is issued by a warpgroup (4 warps, 128 threads) for a 64 x N x 16 product. The
// accumulator of m64nNk16 is N / 2 floats per thread in the m16n8 C layout per warp (tile_ops.cuh):
// warp w of the group holds rows 16 w .. 16 w + 15; d[4 j .. 4 j + 3] is its 8-column slice j.
// A register A operand has the m16n8k16 A layout of the same rows.
//
// Only sm_90a compiles the instructions (`__CUDA_ARCH_FEAT_SM90_ALL`); elsewhere the functions
// trap, and the engine never launches them (tile_plan.cpp chooses wgmma only for sm_90).
#pragma once

#include "tile_ops.cuh"

namespace flexattn_kernels {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLEXATTN_WGMMA_AVAILABLE 1
#else
#define FLEXATTN_WGMMA_AVAILABLE 0
#endif

// Shared-memory matrix descriptor (PTX "matrix descriptor"): start address >> 4 (bits 0-13),
// leading-dimension byte offset >> 4 (16-29), stride-dimension byte offset >> 4 (32-45), layout
// 1 = 128-byte swizzle (62-63). For the SwizzledPanels layout (tile_ops.cuh):
//   K-major operands (Q, K: the reduced dim contiguous): leading unused (16), stride 1024 (8 rows
//   of 128 bytes); a k-step of 16 values is 32 bytes further, a new panel every 4 k-steps.
//   MN-major operands (V as B of P V: keys reduced, dims contiguous): leading = the panel size
//   (the next 64 dims), stride 1024 (8 keys); a k-step of 16 keys is 2048 bytes further.
__device__ __forceinline__ unsigned long long matrix_descriptor(unsigned address, unsigned leading,
                                                                unsigned stride) {
  return static_cast<unsigned long long>((address & 0x3FFFFu) >> 4) |
         (static_cast<unsigned long long>(leading >> 4) << 16) |
         (static_cast<unsigned long long>(stride >> 4) << 32) | (1ull << 62);
}
// The descriptor of the same layout `bytes` further on (bytes a multiple of 16, no carry out of
// the address field: shared memory is below 256 KB).
__device__ __forceinline__ unsigned long long advance_descriptor(unsigned long long descriptor,
                                                                 unsigned bytes) {
  return descriptor + (bytes >> 4);
}

// Writes of the generic proxy (ordinary stores, cp.async) to shared memory become visible to the
// async proxy that wgmma reads through; each writing thread runs it before the barrier.
__device__ __forceinline__ void fence_async_shared() {
#if FLEXATTN_WGMMA_AVAILABLE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Before a wgmma that reads registers (accumulators, register A) written by other instructions.
__device__ __forceinline__ void wgmma_fence() {
#if FLEXATTN_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if FLEXATTN_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most kPending committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if FLEXATTN_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Pins registers at this point of the instruction order: the compiler only orders register
// operands by their data dependences, so without this it could move the reads of accumulators
// above a wgmma_wait, or the writes of operands below a wgmma_fence. Call it on the
// accumulators after wgmma_wait and on every operand written before wgmma_fence.
template <int kCount>
__device__ __forceinline__ void fence_operands(float (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(values[i])::"memory");
}
template <int kCount>
__device__ __forceinline__ void fence_operands(unsigned (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(values[i])::"memory");
}

// ---- a producer warpgroup's hand-off (sm_90: mbarrier parity waits, setmaxnreg) ---------------
//
// A shared-memory mbarrier (8 bytes) counts arrivals; when `count` threads (as initialised) have
// arrived, its current phase completes and the next begins. A waiter names the phase by its
// parity: waiting for parity p returns once the phase with that parity has completed, and a
// fresh barrier counts as having completed the phase before phase 0 (parity 1).
__device__ __forceinline__ void barrier_init(unsigned barrier, unsigned count) {
#if FLEXATTN_WGMMA_AVAILABLE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(count) : "memory");
#endif
}
// Arrival with release semantics: this thread's earlier writes are visible to a thread whose
// wait sees the phase complete.
__device__ __forceinline__ void barrier_arrive(unsigned barrier) {
#if FLEXATTN_WGMMA_AVAILABLE
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(barrier)
      : "memory");
#endif
}
// Waits (acquire) until the phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(unsigned barrier, unsigned parity) {
#if FLEXATTN_WGMMA_AVAILABLE
  unsigned done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (done == 0);
#endif
}
// A warpgroup gives registers back to the block's pool, or takes them from it (every thread of
// the warpgroup runs the same one; counts are multiples of 8 in 24..256).
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
#if FLEXATTN_WGMMA_AVAILABLE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
#if FLEXATTN_WGMMA_AVAILABLE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

// Operand lists: the 16, 32, 64 or 128 accumulators as "%0, ..." placeholders and "+f" operands.
#define FLEXATTN_WGMMA_D16           \
  "%0, %1, %2, %3, %4, %5, %6, %7, " \
  "%8, %9, %10, %11, %12, %13, %14, %15"
#define FLEXATTN_WGMMA_D32                   \
  "%0, %1, %2, %3, %4, %5, %6, %7, "         \
  "%8, %9, %10, %11, %12, %13, %14, %15, "   \
  "%16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define FLEXATTN_WGMMA_D64                   \
  "%0, %1, %2, %3, %4, %5, %6, %7, "         \
  "%8, %9, %10, %11, %12, %13, %14, %15, "   \
  "%16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define FLEXATTN_WGMMA_D128                          \
  "%0, %1, %2, %3, %4, %5, %6, %7, "                 \
  "%8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, "         \
  "%24, %25, %26, %27, %28, %29, %30, %31, "         \
  "%32, %33, %34, %35, %36, %37, %38, %39, "         \
  "%40, %41, %42, %43, %44, %45, %46, %47, "         \
  "%48, %49, %50, %51, %52, %53, %54, %55, "         \
  "%56, %57, %58, %59, %60, %61, %62, %63, "         \
  "%64, %65, %66, %67, %68, %69, %70, %71, "         \
  "%72, %73, %74, %75, %76, %77, %78, %79, "         \
  "%80, %81, %82, %83, %84, %85, %86, %87, "         \
  "%88, %89, %90, %91, %92, %93, %94, %95, "         \
  "%96, %97, %98, %99, %100, %101, %102, %103, "     \
  "%104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, " \
  "%120, %121, %122, %123, %124, %125, %126, %127"
#define FLEXATTN_WGMMA_ACC8(i)                                                                \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FLEXATTN_WGMMA_ACC16 FLEXATTN_WGMMA_ACC8(0), FLEXATTN_WGMMA_ACC8(8)
#define FLEXATTN_WGMMA_ACC32 \
  FLEXATTN_WGMMA_ACC8(0), FLEXATTN_WGMMA_ACC8(8), FLEXATTN_WGMMA_ACC8(16), FLEXATTN_WGMMA_ACC8(24)
#define FLEXATTN_WGMMA_ACC64                                                                       \
  FLEXATTN_WGMMA_ACC32, FLEXATTN_WGMMA_ACC8(32), FLEXATTN_WGMMA_ACC8(40), FLEXATTN_WGMMA_ACC8(48), \
      FLEXATTN_WGMMA_ACC8(56)
#define FLEXATTN_WGMMA_ACC128                                                                      \
  FLEXATTN_WGMMA_ACC64, FLEXATTN_WGMMA_ACC8(64), FLEXATTN_WGMMA_ACC8(72), FLEXATTN_WGMMA_ACC8(80), \
      FLEXATTN_WGMMA_ACC8(88), FLEXATTN_WGMMA_ACC8(96), FLEXATTN_WGMMA_ACC8(104),                  \
      FLEXATTN_WGMMA_ACC8(112), FLEXATTN_WGMMA_ACC8(120)

// d (64 x N) = A B (+ d when accumulate != 0), A and B in shared memory (descriptors), both
// K-major: wgmma_ss_n<N>; A K-major and B MN-major: wgmma_ss_mn_n<N> (TRANSPOSE: the operands'
// transpose flags). A from registers (m16n8k16 A
// layout), B MN-major in shared memory: wgmma_rs_n<N>. ACC is the accumulator count (N / 2); A, B
// and SCALE name the operands that follow the accumulators.
#if FLEXATTN_WGMMA_AVAILABLE
#define FLEXATTN_WGMMA_SS(NAME, TRANSPOSE, TAG, TYPE, N, ACC, PLACEHOLDERS, OPERANDS, A, B, SCALE) \
  __device__ __forceinline__ void NAME##_n##N(TAG, float(&d)[ACC], unsigned long long a,           \
                                              unsigned long long b, int accumulate) {              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE                                         \
                 ", 0;\n"                                                                          \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" PLACEHOLDERS \
                 "}, " A ", " B ", p, 1, 1, " TRANSPOSE ";\n}\n"                                   \
                 : OPERANDS                                                                        \
                 : "l"(a), "l"(b), "r"(accumulate));                                               \
  }
#define FLEXATTN_WGMMA_RS(TAG, TYPE, N, ACC, PLACEHOLDERS, OPERANDS, A, B, SCALE)                  \
  __device__ __forceinline__ void wgmma_rs_n##N(TAG, float(&d)[ACC], const unsigned(&a)[4],        \
                                                unsigned long long b, int accumulate) {            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE                                         \
                 ", 0;\n"                                                                          \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" PLACEHOLDERS \
                 "}, {" A "}, " B ", p, 1, 1, 1;\n}\n"                                             \
                 : OPERANDS                                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));           \
  }
#else
#define FLEXATTN_WGMMA_SS(NAME, TRANSPOSE, TAG, TYPE, N, ACC, PLACEHOLDERS, OPERANDS, A, B, SCALE) \
  __device__ __forceinline__ void NAME##_n##N(TAG, float(&)[ACC], unsigned long long,              \
                                              unsigned long long, int) {                           \
    __trap();                                                                                      \
  }
#define FLEXATTN_WGMMA_RS(TAG, TYPE, N, ACC, PLACEHOLDERS, OPERANDS, A, B, SCALE)         \
  __device__ __forceinline__ void wgmma_rs_n##N(TAG, float(&)[ACC], const unsigned(&)[4], \
                                                unsigned long long, int) {                \
    __trap();                                                                             \
  }
#endif

FLEXATTN_WGMMA_SS(wgmma_ss, "0, 0", BFloat16Tag, "bf16", 32, 16, FLEXATTN_WGMMA_D16,
                  FLEXATTN_WGMMA_ACC16, "%16", "%17", "%18")
FLEXATTN_WGMMA_SS(wgmma_ss, "0, 0", HalfTag, "f16", 32, 16, FLEXATTN_WGMMA_D16,
                  FLEXATTN_WGMMA_ACC16, "%16", "%17", "%18")
FLEXATTN_WGMMA_SS(wgmma_ss_mn, "0, 1", BFloat16Tag, "bf16", 64, 32, FLEXATTN_WGMMA_D32,
                  FLEXATTN_WGMMA_ACC32, "%32", "%33", "%34")
FLEXATTN_WGMMA_SS(wgmma_ss_mn, "0, 1", HalfTag, "f16", 64, 32, FLEXATTN_WGMMA_D32,
                  FLEXATTN_WGMMA_ACC32, "%32", "%33", "%34")
FLEXATTN_WGMMA_SS(wgmma_ss_mn, "0, 1", BFloat16Tag, "bf16", 128, 64, FLEXATTN_WGMMA_D64,
                  FLEXATTN_WGMMA_ACC64, "%64", "%65", "%66")
FLEXATTN_WGMMA_SS(wgmma_ss_mn, "0, 1", HalfTag, "f16", 128, 64, FLEXATTN_WGMMA_D64,
                  FLEXATTN_WGMMA_ACC64, "%64", "%65", "%66")
FLEXATTN_WGMMA_SS(wgmma_ss, "0, 0", BFloat16Tag, "bf16", 64, 32, FLEXATTN_WGMMA_D32,
                  FLEXATTN_WGMMA_ACC32, "%32", "%33", "%34")
FLEXATTN_WGMMA_SS(wgmma_ss, "0, 0", HalfTag, "f16", 64, 32, FLEXATTN_WGMMA_D32,
                  FLEXATTN_WGMMA_ACC32, "%32", "%33", "%34")
FLEXATTN_WGMMA_SS(wgmma_ss, "0, 0", BFloat16Tag, "bf16", 128, 64, FLEXATTN_WGMMA_D64,
                  FLEXATTN_WGMMA_ACC64, "%64", "%65", "%66")
FLEXATTN_WGMMA_SS(wgmma_ss, "0, 0", HalfTag, "f16", 128, 64, FLEXATTN_WGMMA_D64,
                  FLEXATTN_WGMMA_ACC64, "%64", "%65", "%66")
FLEXATTN_WGMMA_RS(BFloat16Tag, "bf16", 64, 32, FLEXATTN_WGMMA_D32, FLEXATTN_WGMMA_ACC32,
                  "%32, %33, %34, %35", "%36", "%37")
FLEXATTN_WGMMA_RS(HalfTag, "f16", 64, 32, FLEXATTN_WGMMA_D32, FLEXATTN_WGMMA_ACC32,
                  "%32, %33, %34, %35", "%36", "%37")
FLEXATTN_WGMMA_RS(BFloat16Tag, "bf16", 128, 64, FLEXATTN_WGMMA_D64, FLEXATTN_WGMMA_ACC64,
                  "%64, %65, %66, %67", "%68", "%69")
FLEXATTN_WGMMA_RS(HalfTag, "f16", 128, 64, FLEXATTN_WGMMA_D64, FLEXATTN_WGMMA_ACC64,
                  "%64, %65, %66, %67", "%68", "%69")
// O += P V at head dim 256: 128 accumulators a thread.
FLEXATTN_WGMMA_RS(BFloat16Tag, "bf16", 256, 128, FLEXATTN_WGMMA_D128, FLEXATTN_WGMMA_ACC128,
                  "%128, %129, %130, %131", "%132", "%133")
FLEXATTN_WGMMA_RS(HalfTag, "f16", 256, 128, FLEXATTN_WGMMA_D128, FLEXATTN_WGMMA_ACC128,
                  "%128, %129, %130, %131", "%132", "%133")

#undef FLEXATTN_WGMMA_SS
#undef FLEXATTN_WGMMA_RS
#undef FLEXATTN_WGMMA_ACC128
#undef FLEXATTN_WGMMA_ACC64
#undef FLEXATTN_WGMMA_ACC32
#undef FLEXATTN_WGMMA_ACC16
#undef FLEXATTN_WGMMA_ACC8
#undef FLEXATTN_WGMMA_D128
#undef FLEXATTN_WGMMA_D64
#undef FLEXATTN_WGMMA_D32
#undef FLEXATTN_WGMMA_D16

// The N-generic entry points the kernels call: d (64 x N) from two descriptors, or from register A.
template <class Tag, int kCount>
__device__ __forceinline__ void wgmma_from_shared(Tag tag, float (&d)[kCount], unsigned long long a,
                                                  unsigned long long b, int accumulate) {
  static_assert(kCount == 16 || kCount == 32 || kCount == 64, "wgmma widths 32, 64 and 128");
  if constexpr (kCount == 16) {
    wgmma_ss_n32(tag, d, a, b, accumulate);
  } else if constexpr (kCount == 32) {
    wgmma_ss_n64(tag, d, a, b, accumulate);
  } else {
    wgmma_ss_n128(tag, d, a, b, accumulate);
  }
}
// d (64 x N) from an A in shared memory (K-major) and an MN-major B (as wgmma_from_registers').
template <class Tag, int kCount>
__device__ __forceinline__ void wgmma_from_shared_mn(Tag tag, float (&d)[kCount],
                                                     unsigned long long a, unsigned long long b,
                                                     int accumulate) {
  static_assert(kCount == 32 || kCount == 64, "wgmma widths 64 and 128");
  if constexpr (kCount == 32) {
    wgmma_ss_mn_n64(tag, d, a, b, accumulate);
  } else {
    wgmma_ss_mn_n128(tag, d, a, b, accumulate);
  }
}
template <class Tag, int kCount>
__device__ __forceinline__ void wgmma_from_registers(Tag tag, float (&d)[kCount],
                                                     const unsigned (&a)[4], unsigned long long b,
                                                     int accumulate) {
  static_assert(kCount == 32 || kCount == 64 || kCount == 128, "wgmma widths 64, 128 and 256");
  if constexpr (kCount == 32) {
    wgmma_rs_n64(tag, d, a, b, accumulate);
  } else if constexpr (kCount == 64) {
    wgmma_rs_n128(tag, d, a, b, accumulate);
  } else {
    wgmma_rs_n256(tag, d, a, b, accumulate);
  }
}

}  // namespace flexattn_kernels
