// The tile vocabulary of the tensor-core kernels: asynchronous copies into shared memory, the
// swizzled shared-memory layout, ldmatrix, mma.sync m16n8k16 and quad/warp reductions.
//
// Fragment layouts of mma.sync.m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16 x 8, k-major):    b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C (16 x 8, fp32):       c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1)
#pragma once

#include "device_math.cuh"

namespace flexattn_kernels {

constexpr int kWarpSize = 32;
constexpr int kChunkBytes = 16;  // one cp.async / one ldmatrix row: 8 16-bit values
constexpr int kChunkElements = 8;
constexpr int kSwizzleRows = 8;  // rows whose chunks are permuted so ldmatrix is conflict-free

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  unsigned long long address;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(address) : "l"(pointer));
  return static_cast<unsigned>(address);
}

// A tile of `kRows` rows of `kChunksPerRow` 16-byte chunks in shared memory. Chunk c of row r
// lives at position c ^ (r % 8), so the 8 rows an ldmatrix reads hit 8 different bank groups.
template <int kChunksPerRow>
__device__ __forceinline__ unsigned swizzled_offset(int row, int chunk) {
  static_assert(kChunksPerRow % kSwizzleRows == 0, "rows must hold a multiple of 8 chunks");
  return static_cast<unsigned>((row * kChunksPerRow + (chunk ^ (row % kSwizzleRows))) *
                               kChunkBytes);
}

// Where one lane's ldmatrix row address falls in a swizzled tile, for every 16-column step.
// The lane reads row `row` (plus any multiple of 8 rows, which keeps the swizzle) and chunk
// 2 * step + half. As 2 * step ^ (row % 8) only takes 4 values per group of 8 chunks, 4 registers
// hold every address: the rest are immediate offsets, so the compiler need not keep one register
// per (step, tile) address.
template <int kChunksPerRow>
struct LaneOffsets {
  static constexpr int kGroupBytes = kSwizzleRows * kChunkBytes;  // 8 chunks
  unsigned offset[4];

  __device__ __forceinline__ LaneOffsets(int row, int half) {
#pragma unroll
    for (int pair = 0; pair < 4; ++pair) {
      offset[pair] =
          static_cast<unsigned>(row * kChunksPerRow * kChunkBytes +
                                (((2 * pair + half) ^ (row % kSwizzleRows)) * kChunkBytes));
    }
  }
  // Byte offset of chunk 2 * step + half of row `row + extra_rows` (extra_rows % 8 == 0).
  __device__ __forceinline__ unsigned at(int step, int extra_rows) const {
    return offset[step % 4] + (step / 4) * kGroupBytes + extra_rows * kChunksPerRow * kChunkBytes;
  }
};

// ---- named barriers ----------------------------------------------------------------------------

// Named barrier kBarrier (1..15; 0 is __syncthreads') for `threads` threads, a multiple of 32:
// wait there, or arrive without waiting.
template <int kBarrier>
__device__ __forceinline__ void named_barrier_sync(int threads) {
  asm volatile("bar.sync %0, %1;" ::"n"(kBarrier), "r"(threads) : "memory");
}
template <int kBarrier>
__device__ __forceinline__ void named_barrier_arrive(int threads) {
  asm volatile("bar.arrive %0, %1;" ::"n"(kBarrier), "r"(threads) : "memory");
}

// ---- asynchronous copies ---------------------------------------------------------------------

// Copies 16 bytes, or zero-fills the destination when `valid` is false (source not read).
__device__ __forceinline__ void copy_chunk_async(unsigned destination, const void* source,
                                                 bool valid) {
  const int source_bytes = valid ? kChunkBytes : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(source),
               "r"(source_bytes)
               : "memory");
}
__device__ __forceinline__ void commit_copies() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Shared-memory tile layouts: where chunk `chunk` of row `row` lives, and how far apart two rows
// that keep the same swizzle phase are (kRowBytes per row).
//   SwizzledRows: whole rows side by side (swizzled_offset), for ldmatrix.
//   SwizzledPanels: the row split into panels of 64 values (128 bytes) each holding all kRows
//     rows, chunk c of row r at c ^ (r % 8) within its 128-byte row: the 128-byte swizzle the
//     wgmma shared-memory descriptors read (panels 1024-byte aligned).
template <int kChunksPerRow>
struct SwizzledRows {
  static constexpr int kChunks = kChunksPerRow;
  static constexpr unsigned kRowBytes = kChunksPerRow * kChunkBytes;
  __device__ __forceinline__ static unsigned offset(int row, int chunk) {
    return swizzled_offset<kChunksPerRow>(row, chunk);
  }
};
// The dynamic shared memory from its first kAlignment-byte boundary (the 128-byte swizzle the
// wgmma descriptors read is a function of address bits 4-9, so tiles start on 1024-byte
// boundaries; the host adds kAlignment bytes of slack): its shared address and a pointer to it.
struct AlignedShared {
  unsigned address;
  unsigned char* pointer;
};
template <int kAlignment>
__device__ __forceinline__ AlignedShared aligned_shared_memory() {
  extern __shared__ __align__(128) unsigned char shared_memory[];
  const unsigned start = shared_address(shared_memory);
  const unsigned aligned = (start + kAlignment - 1) & ~static_cast<unsigned>(kAlignment - 1);
  return AlignedShared{aligned, shared_memory + (aligned - start)};
}

template <int kRows, int kChunksPerRow>
struct SwizzledPanels {
  static constexpr int kChunks = kChunksPerRow;
  static constexpr unsigned kRowBytes = kSwizzleRows * kChunkBytes;  // 128
  static constexpr unsigned kPanelBytes = kRows * kRowBytes;
  static_assert(kChunksPerRow % kSwizzleRows == 0, "panels hold 8 chunks per row");
  __device__ __forceinline__ static unsigned offset(int row, int chunk) {
    return static_cast<unsigned>((chunk / kSwizzleRows) * kPanelBytes + row * kRowBytes +
                                 ((chunk % kSwizzleRows) ^ (row % kSwizzleRows)) * kChunkBytes);
  }
};

// Loads the first kLoadedChunks chunks of rows [0, kRows) of a tile laid out as `Layout`. Rows at
// or past `rows_valid` and chunks at or past `real_chunks` are zero-filled instead of read.
template <int kRows, class Layout, int kLoadedChunks, int kThreads>
__device__ __forceinline__ void load_rows_async(unsigned tile, const unsigned short* source,
                                                long long row_stride, int rows_valid,
                                                int real_chunks, int thread) {
  constexpr int kChunks = kRows * kLoadedChunks;
  static_assert(kChunks % kThreads == 0, "every thread copies the same number of chunks");
  static_assert(kLoadedChunks <= Layout::kChunks, "a row holds the loaded chunks");
  if constexpr (kThreads % kLoadedChunks == 0 && (kThreads / kLoadedChunks) % kSwizzleRows == 0) {
    // The thread copies the same chunk of every kRowStep-th row: one source pointer advanced by
    // a stride, and destinations at immediate offsets (kRowStep is a multiple of the swizzle).
    constexpr int kRowStep = kThreads / kLoadedChunks;
    const int first_row = thread / kLoadedChunks;
    const int chunk = thread % kLoadedChunks;
    const bool chunk_valid = chunk < real_chunks;
    const unsigned destination = tile + Layout::offset(first_row, chunk);
    const unsigned short* row_source = source + first_row * row_stride + chunk * kChunkElements;
    const long long step_stride = kRowStep * row_stride;
#pragma unroll
    for (int step = 0; step < kRows / kRowStep; ++step) {
      const bool valid = chunk_valid && first_row + step * kRowStep < rows_valid;
      copy_chunk_async(destination + step * kRowStep * Layout::kRowBytes,
                       valid ? row_source : source, valid);
      row_source += step_stride;
    }
  } else {
#pragma unroll
    for (int step = 0; step < kChunks / kThreads; ++step) {
      const int index = step * kThreads + thread;
      const int row = index / kLoadedChunks;
      const int chunk = index % kLoadedChunks;
      const bool valid = row < rows_valid && chunk < real_chunks;
      const unsigned short* address =
          valid ? source + row * row_stride + chunk * kChunkElements : source;
      copy_chunk_async(tile + Layout::offset(row, chunk), address, valid);
    }
  }
}

// The same for the whole-row layout of the mma.sync kernels (kChunksPerRow chunks per row).
template <int kRows, int kChunksPerRow, int kLoadedChunks, int kThreads>
__device__ __forceinline__ void load_tile_async(unsigned tile, const unsigned short* source,
                                                long long row_stride, int rows_valid,
                                                int real_chunks, int thread) {
  load_rows_async<kRows, SwizzledRows<kChunksPerRow>, kLoadedChunks, kThreads>(
      tile, source, row_stride, rows_valid, real_chunks, thread);
}

// ---- tensor-core operations ------------------------------------------------------------------

__device__ __forceinline__ void load_matrix_x4(unsigned (&fragment)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(address));
}
__device__ __forceinline__ void load_matrix_x4_transposed(unsigned (&fragment)[4],
                                                          unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(address));
}

// accumulator (16 x 8) += a (16 x 16) * b (16 x 8), fp32 accumulation.
__device__ __forceinline__ void mma_16x8x16(BFloat16Tag, float (&accumulator)[4],
                                            const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(accumulator[0]), "+f"(accumulator[1]), "+f"(accumulator[2]), "+f"(accumulator[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16x8x16(HalfTag, float (&accumulator)[4],
                                            const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(accumulator[0]), "+f"(accumulator[1]), "+f"(accumulator[2]), "+f"(accumulator[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- reductions ------------------------------------------------------------------------------

// Over the 4 lanes of a quad (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_max(float value) {
  value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 1));
  return fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 2));
}
__device__ __forceinline__ float quad_sum(float value) {
  value += __shfl_xor_sync(0xffffffffu, value, 1);
  return value + __shfl_xor_sync(0xffffffffu, value, 2);
}
__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// 2^x with the hardware approximation (relative error about 2^-22); exp2(-inf) == 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float result;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(x));
  return result;
}

}  // namespace flexattn_kernels
