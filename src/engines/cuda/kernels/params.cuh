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
  const int* cu_seqlens_q;  // batch + 1 offsets for thd, else null
  const int* cu_seqlens_kv;
  int seq_len_q;  // the sequence lengths when cu_seqlens are null
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
  // 1: the wgmma forward numbers its blocks with the batch fastest (forward_wgmma.cuh; the
  // engine sets it with a staged tensor); 0: (q block, head, batch) as launched.
  int batch_fastest;
  TensorArg tensors[kMaxTensors];
  float params[kMaxParams];
};

// ---- decoding against a paged KV cache (decode.cuh) -------------------------------------------

// fwd.k and fwd.v address the page pools (pages, page_size, heads_kv, dim): key `slot` of page
// `page` of kv head h is at page * batch_stride + slot * token_stride + h * head_stride. fwd's
// query-side fields (q, o, lse, cu_seqlens_q, seq_len_q) are those of the queries; seq_len_kv
// is the capacity.
struct DecodeParams {
  ForwardParams fwd;
  const int* page_table;  // (batch, max_pages) int32
  const int* cache_lens;  // (batch) int32
  int max_pages;
  int page_size;
  int pages;
  // Each sequence's keys in `splits` ranges of keys_per_split keys (a multiple of the kernel's
  // key tile: 32 on the fp32 units, 64 on tensor cores), one block each (blockIdx.x % splits);
  // with more than one, every block writes its rows' partial result (O normalised over its keys,
  // and their LSE) and the combine kernel merges them by LSE.
  int splits;
  int keys_per_split;
  int heads_q;
  int tokens_q;        // query tokens over all sequences (rows of the partial results)
  float* partial_o;    // splits > 1: (splits, heads_q, tokens_q, head_dim_v)
  float* partial_lse;  // splits > 1: (splits, heads_q, tokens_q)
  int page_shift;      // log2(page_size) where it is a power of two, else -1
};

// Chunked prefill on the wgmma forward (forward_prefill_wgmma): with a mask, the kv tiles a block
// visits are listed in shared memory, at most this many (the engine takes the kernel only for
// caches whose capacity fits; 768 x 2 bytes and the flag words fit beside the head-dim-128
// kernel's 225 KB).
constexpr int kPrefillListCapacity = 768;

// Launch geometry of the decode combine kernel: one block per (head, query token), grid
// (heads_q * tokens_q), its warps sharing the row's splits.
constexpr int kDecodeCombineThreads = 128;

// ---- backward -------------------------------------------------------------------------------

// Tensor gradients are summed in 64-bit fixed point (value * 2^32, rounded to nearest): integer
// addition is associative, so the atomics that scatter them give bit-identical results in any
// order. Range +-2^31, resolution 2^-32.
constexpr float kGradFixedScale = 4294967296.0f;          // 2^32
constexpr double kGradFixedInverse = 1.0 / 4294967296.0;  // 2^-32

// One element of a tensor gradient's accumulator: the fixed-point sum of its finite contributions,
// and which non-finite values reached it (kGradNan, kGradPlusInf, kGradMinusInf, OR-ed), so a NaN
// or inf contribution stays NaN or inf (docs/design.md, non-finite values).
struct GradAccumulator {
  unsigned long long fixed;
  unsigned long long flags;
};
constexpr unsigned kGradNan = 1;
constexpr unsigned kGradPlusInf = 2;
constexpr unsigned kGradMinusInf = 4;

// Launch geometry of the delta kernel: grid (ceil(seq_len_q / kDeltaRows), heads_q, batch).
constexpr int kDeltaRows = 32;
constexpr int kDeltaThreads = 128;
// Launch geometry of the non-finite repair kernels (repair.cuh): grid (ceil(rows /
// kRepairRows), heads, batch), kRepairThreads threads.
constexpr int kRepairRows = 16;
constexpr int kRepairThreads = 128;
// Launch geometry of the finalize kernel: grid (ceil(count / kFinalizeThreads)).
constexpr int kFinalizeThreads = 256;

struct BackwardParams {
  // q, k, v, o (o is read by the delta kernel), lse (read), the modifier's tensors and params,
  // lengths, scale, and the q-major tile list built for (block_q, block_kv) of the backward
  // kernels: tile_entries are kv tiles of block_kv keys, class_block_q == block_q.
  ForwardParams fwd;
  SequenceView dout;        // read; the layout of o
  SequenceView dq, dk, dv;  // written; the layouts of q, k, v
  float* delta;             // scratch: rowsum(dO * O) per (b, h, q), indexed like lse
  // Scratch: lse * log2(e) per (b, h, q), indexed like lse, +inf for an empty row (lse = -inf),
  // so that exp2(logit2 - lse2) is each row's probability, 0 in an empty row (the delta kernel
  // writes it).
  float* lse2;
  // The kv-major transpose of the tile list: for kv tile t, kv_tile_entries[kv_tile_offsets[t]
  // .. kv_tile_offsets[t + 1]) are the q blocks that visit it, ascending, each
  // q_block << 1 | mixed.
  const int* kv_tile_offsets;
  const int* kv_tile_entries;
  // Per tensor slot (as fwd.tensors): the fixed-point accumulator of its gradient (one long long
  // per element, zeroed before the launch), or null where no gradient is wanted.
  GradAccumulator* grad_fixed[kMaxTensors];
  // 1 when some grad_fixed slot is set: only then does the dQ kernel run the exact-delta pass and
  // the tensor-gradient scatter (a modifier with tensor loads whose gradients nobody asked for
  // costs what one without them does).
  int tensor_grads_wanted;
};

// Converts one fixed-point accumulator to the gradient tensor (fp32 or fp64, contiguous).
struct FinalizeParams {
  const GradAccumulator* fixed;
  void* out;
  long long count;
  int out_is_f64;  // 0: float, 1: double
};

}  // namespace flexattn_kernels
