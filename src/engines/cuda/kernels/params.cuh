// Arguments of the forward kernels. Included by the host (C++) and compiled into every kernel
// (NVRTC), so the two sides share one definition of the layout. Plain types only.
#pragma once

namespace flexattn_kernels {

// Limits of the argument block (it is passed by value, and stays far below the 4 KB limit).
constexpr int kMaxTensors = 8;  // extra tensors a modifier may read
constexpr int kMaxParams = 16;  // named scalar parameters

// An extra tensor: contiguous (the engine contract), so its strides are constants of the
// generated code and only the address is an argument.
struct TensorArg {
  const void* data;
};

// A Q/K/V/O view: element (b, position, head, d) is at
//   data + b * batch_stride + (token_offset(b) + position) * token_stride + head * head_stride + d
// where token_offset is cu_seqlens[b] for thd (and batch_stride is 0), and 0 otherwise.
struct SequenceView {
  void* data;
  long long batch_stride;
  long long token_stride;
  long long head_stride;
};

struct ForwardParams {
  SequenceView q, k, v, o;
  float* lse;  // null: not written. (b, h, q) at b * lse_batch_stride + h * lse_head_stride + token
  long long lse_batch_stride;
  long long lse_head_stride;
  const int* cu_seqlens_q;   // batch + 1 offsets for thd, else null
  const int* cu_seqlens_kv;
  int seq_len_q;   // the sequence lengths when cu_seqlens are null
  int seq_len_kv;
  int heads_per_kv;  // heads_q / heads_kv (GQA group size)
  float scale;       // softmax scale (the score the modifier sees is scale * dot)
  float scale_log2;  // scale * log2(e), for the identity modifier
  // Tile classification (see tile_plan.hpp): for the classified q block c, entries
  // tile_entries[tile_offsets[c] .. tile_offsets[c + 1]) list the kv tiles to visit in order,
  // each as kv_tile << 1 | mixed (mixed: the mask must be evaluated element by element).
  const int* tile_offsets;
  const int* tile_entries;
  int class_block_q;  // query rows per classified block (a multiple of the kernel's block)
  TensorArg tensors[kMaxTensors];
  float params[kMaxParams];
};

}  // namespace flexattn_kernels
