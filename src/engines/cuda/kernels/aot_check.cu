// Ahead-of-time compile check of the kernel templates (built by nvcc for sm_90, never run): an
// identity and a softcap modifier instantiated with the tile configurations the engine uses,
// forward and backward, so a type error in a template fails the build even where no GPU and no
// NVRTC run happens.
#include "backward_common.cuh"
#include "backward_mma.cuh"
#include "backward_simt.cuh"
#include "backward_wgmma.cuh"
#include "backward_wgmma_wide.cuh"
#include "decode.cuh"
#include "forward_mma.cuh"
#include "forward_simt.cuh"
#include "forward_wgmma.cuh"
#include "repair.cuh"

using flexattn_kernels::BackwardParams;
using flexattn_kernels::BackwardSimtConfig;
using flexattn_kernels::BFloat16Tag;
using flexattn_kernels::Coordinates;
using flexattn_kernels::FinalizeParams;
using flexattn_kernels::Float32Tag;
using flexattn_kernels::ForwardParams;
using flexattn_kernels::HalfTag;
using flexattn_kernels::MmaConfig;
using flexattn_kernels::SimtConfig;
using flexattn_kernels::WgmmaConfig;

namespace flexattn_aot {

struct IdentityModifier {
  static constexpr bool kIdentityScore = true;
  static constexpr bool kHasMask = false;
  struct Invariants {};
  __device__ static Invariants prepare(const ForwardParams&, const Coordinates&) { return {}; }
  __device__ static float score_mod(const Invariants&, const ForwardParams&, const Coordinates&,
                                    float score, int, int) {
    return score;
  }
  __device__ static float score_mod_log2(const Invariants&, const ForwardParams& p,
                                         const Coordinates&, float dot, int, int,
                                         const flexattn_kernels::StagedElement*) {
    return dot * p.scale_log2;
  }
  static constexpr float kForwardToLog2 = 1.0f;
  __device__ static float score_mod_forward(const Invariants& invariants, const ForwardParams& p,
                                            const Coordinates& at, float dot, int q, int kv,
                                            const flexattn_kernels::StagedElement* staged) {
    return score_mod_log2(invariants, p, at, dot, q, kv, staged);
  }
  static constexpr bool kSmallTanh = false;
  static constexpr int kStagedTensor = -1;
  static constexpr bool kStaticReference = false;  // (the generated softcap modules take it)
  static constexpr float kStaticReferenceLog2 = 0.0f;
  __device__ static bool mask_mod(const Invariants&, const ForwardParams&, const Coordinates&, int,
                                  int) {
    return true;
  }

  static constexpr bool kIdentityDerivative = true;
  static constexpr bool kBoundedDerivative = true;
  static constexpr bool kHasTensorGrads = false;
  static constexpr int kLocalGradSlots = 1;
  __device__ static float score_grad(const Invariants&, const ForwardParams&, const Coordinates&,
                                     float, int, int) {
    return 1.0f;
  }
  __device__ static float score_grad_from_dot(const Invariants&, const ForwardParams&,
                                              const Coordinates&, float, int, int) {
    return 1.0f;
  }
  __device__ static void tensor_grads(const Invariants&, const BackwardParams&, const Coordinates&,
                                      float, int, int, float,
                                      flexattn_kernels::GradSum (&)[kLocalGradSlots]) {}
  __device__ static void flush_tensor_grads(const Invariants&, const BackwardParams&,
                                            const Coordinates&,
                                            flexattn_kernels::GradSum (&)[kLocalGradSlots]) {}
};

// A modifier with every code path of the element pipeline live (score_mod, mask, and in the
// backward both kinds of tensor gradient): cap * tanh(score / cap) + head_bias[h] +
// position_bias[kv], causal.
struct CausalSoftcapModifier {
  static constexpr bool kIdentityScore = false;
  static constexpr bool kHasMask = true;
  struct Invariants {
    float cap;
    float head_bias;  // tensors[0][h]: depends only on (b, h)
  };
  __device__ static Invariants prepare(const ForwardParams& p, const Coordinates& at) {
    return Invariants{p.params[0], flexattn_kernels::load_tensor_f32(
                                       static_cast<const float*>(p.tensors[0].data), at.head)};
  }
  __device__ static float score_mod(const Invariants& invariants, const ForwardParams& p,
                                    const Coordinates&, float score, int, int kv) {
    using flexattn_kernels::ir_tanh;
    return invariants.cap * ir_tanh(score / invariants.cap) + invariants.head_bias +
           flexattn_kernels::load_tensor_f32(static_cast<const float*>(p.tensors[1].data), kv);
  }
  __device__ static float score_mod_log2(const Invariants& invariants, const ForwardParams& p,
                                         const Coordinates& at, float dot, int q, int kv,
                                         const flexattn_kernels::StagedElement*) {
    return score_mod(invariants, p, at, dot * p.scale, q, kv) * flexattn_kernels::kLog2e;
  }
  // With small-tanh functions (log2 units) the forward's logit is in log2 units too.
  static constexpr float kForwardToLog2 = 1.0f;
  __device__ static float score_mod_forward(const Invariants& invariants, const ForwardParams& p,
                                            const Coordinates& at, float dot, int q, int kv,
                                            const flexattn_kernels::StagedElement* staged) {
    return score_mod_log2(invariants, p, at, dot, q, kv, staged);
  }
  // The small-tanh variants (as the generated code has them for tanh(score / cap)).
  static constexpr bool kSmallTanh = true;
  __device__ static bool tanh_args_small(const Invariants& invariants, const ForwardParams& p,
                                         float bound) {
    return fabsf((bound * fabsf(p.scale)) / invariants.cap) < flexattn_kernels::kTanhSmallLimit;
  }
  __device__ static float score_mod_log2_small(const Invariants& invariants, const ForwardParams& p,
                                               const Coordinates&, float dot, int, int kv,
                                               const flexattn_kernels::StagedElement*) {
    return (invariants.cap * flexattn_kernels::ir_tanh_small(dot * p.scale / invariants.cap) +
            invariants.head_bias +
            flexattn_kernels::load_tensor_f32(static_cast<const float*>(p.tensors[1].data), kv)) *
           flexattn_kernels::kLog2e;
  }
  static constexpr int kStagedTensor = -1;
  static constexpr bool kStaticReference = false;  // (the generated softcap modules take it)
  static constexpr float kStaticReferenceLog2 = 0.0f;
  __device__ static bool mask_mod(const Invariants&, const ForwardParams&, const Coordinates&,
                                  int q, int kv) {
    return q >= kv;
  }

  static constexpr bool kIdentityDerivative = false;
  static constexpr bool kBoundedDerivative = true;  // 1 - tanh^2 lies in [0, 1]
  static constexpr bool kHasTensorGrads = true;
  static constexpr int kLocalGradSlots = 1;  // head_bias
  // d(cap * tanh(score / cap)) / d score = 1 - tanh^2(score / cap).
  __device__ static float score_grad(const Invariants& invariants, const ForwardParams&,
                                     const Coordinates&, float score, int, int) {
    const float t = flexattn_kernels::ir_tanh(score / invariants.cap);
    return 1.0f - t * t;
  }
  __device__ static float score_grad_from_dot(const Invariants& invariants, const ForwardParams& p,
                                              const Coordinates& at, float dot, int q, int kv) {
    return score_grad(invariants, p, at, dot * p.scale, q, kv);
  }
  __device__ static float score_grad_from_dot_small(const Invariants& invariants,
                                                    const ForwardParams& p, const Coordinates&,
                                                    float dot, int, int) {
    const float t = flexattn_kernels::ir_tanh_small(dot * p.scale / invariants.cap);
    return 1.0f - t * t;
  }
  // Both biases enter with derivative 1: head_bias through the per-thread slot, position_bias
  // (indexed by kv) straight into its accumulator.
  __device__ static void tensor_grads(const Invariants&, const BackwardParams& p,
                                      const Coordinates&, float, int, int kv, float dlogit,
                                      flexattn_kernels::GradSum (&local)[kLocalGradSlots]) {
    if (p.grad_fixed[0] != nullptr) local[0] += flexattn_kernels::to_fixed(dlogit);
    if (p.grad_fixed[1] != nullptr) {
      flexattn_kernels::add_fixed(p.grad_fixed[1] + kv, flexattn_kernels::to_fixed(dlogit));
    }
  }
  __device__ static void flush_tensor_grads(const Invariants&, const BackwardParams& p,
                                            const Coordinates& at,
                                            flexattn_kernels::GradSum (&local)[kLocalGradSlots]) {
    if (p.grad_fixed[0] == nullptr) return;
    const flexattn_kernels::GradSum sum = flexattn_kernels::warp_sum_fixed(local[0]);
    if (threadIdx.x % flexattn_kernels::kWarpSize == 0) {
      flexattn_kernels::add_fixed(p.grad_fixed[0] + at.head, sum);
    }
  }
};

}  // namespace flexattn_aot

using flexattn_aot::CausalSoftcapModifier;
using flexattn_aot::IdentityModifier;

#define FLEXATTN_AOT_MMA(name, modifier, ...)                                      \
  extern "C" __global__ void __launch_bounds__(MmaConfig<__VA_ARGS__>::kThreads,   \
                                               MmaConfig<__VA_ARGS__>::kMinBlocks) \
      name(const ForwardParams params) {                                           \
    flexattn_kernels::forward_mma<MmaConfig<__VA_ARGS__>, modifier>(params);       \
  }
#define FLEXATTN_AOT_SIMT(name, modifier, ...)                                    \
  extern "C" __global__ void __launch_bounds__(SimtConfig<__VA_ARGS__>::kThreads) \
      name(const ForwardParams params) {                                          \
    flexattn_kernels::forward_simt<SimtConfig<__VA_ARGS__>, modifier>(params);    \
  }

#define FLEXATTN_AOT_WGMMA(name, modifier, ...)                                         \
  extern "C" __global__ void __launch_bounds__(WgmmaConfig<__VA_ARGS__>::kBlockThreads, \
                                               WgmmaConfig<__VA_ARGS__>::kMinBlocks)    \
      name(const ForwardParams params) {                                                \
    flexattn_kernels::forward_wgmma<WgmmaConfig<__VA_ARGS__>, modifier>(params);        \
  }

FLEXATTN_AOT_MMA(aot_bf16_d128, IdentityModifier, BFloat16Tag, 128, 128, 128, 128, 2, 4, 64, 2, 2)
FLEXATTN_AOT_MMA(aot_bf16_d128_softcap, CausalSoftcapModifier, BFloat16Tag, 128, 128, 128, 128, 2,
                 4, 64, 2, 2)
FLEXATTN_AOT_MMA(aot_bf16_d64, IdentityModifier, BFloat16Tag, 64, 64, 64, 64, 2, 4, 64, 2, 2)
FLEXATTN_AOT_MMA(aot_f16_d80_v72, CausalSoftcapModifier, HalfTag, 80, 72, 128, 128, 2, 4, 64, 2, 2)
FLEXATTN_AOT_MMA(aot_bf16_d256, IdentityModifier, BFloat16Tag, 256, 256, 256, 256, 1, 4, 64, 2, 1)
// wgmma (sm_90a): shared bytes = 1024 + Q + the stages of K and V (tile_plan.cpp); pipelined
// with 3 stages at head dim 128, not with 2 at head dim 64 (both loops compiled here).
FLEXATTN_AOT_WGMMA(aot_wgmma_bf16_d128, IdentityModifier, BFloat16Tag, 128, 128, 128, 3, true,
                   1024 + 128 * 256 + 3 * 2 * 128 * 256)
FLEXATTN_AOT_WGMMA(aot_wgmma_f16_d64_softcap, CausalSoftcapModifier, HalfTag, 64, 64, 128, 2, false,
                   1024 + 128 * 128 + 2 * 2 * 128 * 128)
FLEXATTN_AOT_WGMMA(aot_wgmma_bf16_d128_v64, CausalSoftcapModifier, BFloat16Tag, 128, 64, 128, 3,
                   true, 1024 + 128 * 256 + 3 * 128 * (256 + 128))
FLEXATTN_AOT_WGMMA(aot_wgmma_bf16_d128_turns, CausalSoftcapModifier, BFloat16Tag, 128, 128, 128, 3,
                   true, 1024 + 128 * 256 + 3 * 2 * 128 * 256, true)
// The head-dim-128 default: a producer warpgroup copies the stages (+ 64 bytes of barriers).
FLEXATTN_AOT_WGMMA(aot_wgmma_bf16_d128_producer, CausalSoftcapModifier, BFloat16Tag, 128, 128, 128,
                   3, true, 1024 + 128 * 256 + 3 * 2 * 128 * 256 + 64, true, 2, 1, false, true)
FLEXATTN_AOT_WGMMA(aot_wgmma_bf16_d64_unpipelined, IdentityModifier, BFloat16Tag, 64, 64, 128, 2,
                   false, 1024 + 128 * 128 + 2 * 2 * 128 * 128)
// Wide head dims: 64-key tiles, 2 stages, each product waited for.
FLEXATTN_AOT_WGMMA(aot_wgmma_bf16_d256_softcap, CausalSoftcapModifier, BFloat16Tag, 256, 256, 64, 2,
                   false, 1024 + 128 * 512 + 2 * 2 * 64 * 512)
FLEXATTN_AOT_WGMMA(aot_wgmma_f16_d256, IdentityModifier, HalfTag, 256, 256, 64, 2, false,
                   1024 + 128 * 512 + 2 * 2 * 64 * 512)
FLEXATTN_AOT_WGMMA(aot_wgmma_bf16_d192_v128_softcap, CausalSoftcapModifier, BFloat16Tag, 192, 128,
                   64, 2, false, 1024 + 128 * 384 + 2 * 64 * (384 + 256))
FLEXATTN_AOT_SIMT(aot_f32_d64, IdentityModifier, Float32Tag, 64, 64)
FLEXATTN_AOT_SIMT(aot_f32_d80_softcap, CausalSoftcapModifier, Float32Tag, 80, 40)
FLEXATTN_AOT_SIMT(aot_bf16_d17, CausalSoftcapModifier, BFloat16Tag, 17, 17)

// ---- backward -------------------------------------------------------------------------------

#define FLEXATTN_AOT_BACKWARD_DELTA(name, tag, head_dim_v)                      \
  extern "C" __global__ void __launch_bounds__(flexattn_kernels::kDeltaThreads) \
      name(const BackwardParams params) {                                       \
    flexattn_kernels::backward_delta<tag, head_dim_v>(params);                  \
  }
// The simt dK/dV and dQ kernels of one configuration: name##_dkdv, name##_dq.
#define FLEXATTN_AOT_BACKWARD_SIMT(name, modifier, tag, head_dim_qk, head_dim_v)                 \
  using name##_config =                                                                          \
      BackwardSimtConfig<tag, head_dim_qk, head_dim_v,                                           \
                         flexattn_kernels::backward_simt_shared_bytes(head_dim_qk, head_dim_v),  \
                         flexattn_kernels::backward_simt_shared_bytes(head_dim_qk, head_dim_v)>; \
  static_assert(name##_config::kSharedBytesDkdv <= kMaxSharedBytes,                              \
                "the dK/dV kernel's shared memory fits a multiprocessor");                       \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads)                          \
      name##_dkdv(const BackwardParams params) {                                                 \
    flexattn_kernels::backward_dkdv_simt<name##_config, modifier>(params);                       \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads)                          \
      name##_dq(const BackwardParams params) {                                                   \
    flexattn_kernels::backward_dq_simt<name##_config, modifier>(params);                         \
  }

// The most dynamic shared memory one block of sm_90 may use (227 KB).
constexpr int kMaxSharedBytes = 227 * 1024;

extern "C" __global__ void __launch_bounds__(flexattn_kernels::kFinalizeThreads)
    aot_backward_finalize(const FinalizeParams params) {
  flexattn_kernels::backward_finalize(params);
}

FLEXATTN_AOT_BACKWARD_DELTA(aot_backward_delta_f32_v64, Float32Tag, 64)
FLEXATTN_AOT_BACKWARD_DELTA(aot_backward_delta_f32_v40, Float32Tag, 40)
FLEXATTN_AOT_BACKWARD_DELTA(aot_backward_delta_bf16_v17, BFloat16Tag, 17)
FLEXATTN_AOT_BACKWARD_DELTA(aot_backward_delta_f32_v256, Float32Tag, 256)

FLEXATTN_AOT_BACKWARD_SIMT(aot_backward_f32_d64, IdentityModifier, Float32Tag, 64, 64)
FLEXATTN_AOT_BACKWARD_SIMT(aot_backward_f32_d80_softcap, CausalSoftcapModifier, Float32Tag, 80, 40)
FLEXATTN_AOT_BACKWARD_SIMT(aot_backward_bf16_d17, CausalSoftcapModifier, BFloat16Tag, 17, 17)
FLEXATTN_AOT_BACKWARD_SIMT(aot_backward_f32_d256, IdentityModifier, Float32Tag, 256, 256)

// Tensor-core backward (backward_mma.cuh): instantiations go here.
#define FLEXATTN_AOT_BACKWARD_MMA(name, modifier, tag, qk, v, padded_qk, padded_v)    \
  using name##_config = flexattn_kernels::BackwardMmaConfig<                          \
      tag, qk, v, padded_qk, padded_v, 6 * 64 * ((padded_qk) + (padded_v)) + 1024,    \
      6 * 64 * ((padded_qk) + (padded_v)), ((padded_qk) + (padded_v) > 256 ? 2 : 1)>; \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads, 1)            \
      name##_dkdv(const BackwardParams params) {                                      \
    flexattn_kernels::backward_dkdv_mma<name##_config, modifier>(params);             \
  }                                                                                   \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads, 1)            \
      name##_dq(const BackwardParams params) {                                        \
    flexattn_kernels::backward_dq_mma<name##_config, modifier>(params);               \
  }

FLEXATTN_AOT_BACKWARD_MMA(aot_backward_bf16_d128, IdentityModifier, BFloat16Tag, 128, 128, 128, 128)
FLEXATTN_AOT_BACKWARD_MMA(aot_backward_bf16_d128_softcap, CausalSoftcapModifier, BFloat16Tag, 128,
                          128, 128, 128)
FLEXATTN_AOT_BACKWARD_MMA(aot_backward_f16_d80_v72, CausalSoftcapModifier, HalfTag, 80, 72, 128,
                          128)
FLEXATTN_AOT_BACKWARD_MMA(aot_backward_bf16_d256_softcap, CausalSoftcapModifier, BFloat16Tag, 256,
                          256, 256, 256)
FLEXATTN_AOT_BACKWARD_MMA(aot_backward_bf16_d192_v128, IdentityModifier, BFloat16Tag, 192, 128, 192,
                          128)
FLEXATTN_AOT_BACKWARD_MMA(aot_backward_bf16_d64, IdentityModifier, BFloat16Tag, 64, 64, 64, 64)

// wgmma dK/dV and dQ (backward_wgmma.cuh, sm_90a): dK/dV shared bytes = 1024 + K and V of 128
// keys + 3 stages of Q and dO (64 rows) + 3 stages of lse2 and delta; dQ = 1024 + Q and dO of
// 128 rows + 3 stages of K and V (64 keys) (tile_plan.cpp).
#define FLEXATTN_AOT_BACKWARD_WGMMA(name, modifier, tag, qk, v)                        \
  using name##_config = flexattn_kernels::BackwardWgmmaConfig<                         \
      tag, qk, v, 1024 + 128 * ((qk) + (v)) * 2 + 3 * 64 * ((qk) + (v)) * 2 + 3 * 512, \
      1024 + 128 * ((qk) + (v)) * 2 + 3 * 64 * ((qk) + (v)) * 2>;                      \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads, 1)             \
      name##_dkdv(const BackwardParams params) {                                       \
    flexattn_kernels::backward_dkdv_wgmma<name##_config, modifier>(params);            \
  }                                                                                    \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads, 1)             \
      name##_dq(const BackwardParams params) {                                         \
    flexattn_kernels::backward_dq_wgmma<name##_config, modifier>(params);              \
  }

FLEXATTN_AOT_BACKWARD_WGMMA(aot_backward_wgmma_bf16_d128, IdentityModifier, BFloat16Tag, 128, 128)
FLEXATTN_AOT_BACKWARD_WGMMA(aot_backward_wgmma_bf16_d128_softcap, CausalSoftcapModifier,
                            BFloat16Tag, 128, 128)
FLEXATTN_AOT_BACKWARD_WGMMA(aot_backward_wgmma_f16_d64, CausalSoftcapModifier, HalfTag, 64, 64)

// The wide wgmma kernels (head dims 256 and 192/128): dK/dV shared bytes = 1024 + K and V of 64
// keys + 2 stages of Q and dO (64 rows) + the P^T and dS^T tiles (64 x 64) + 2 stages of lse2 and
// delta; dQ = 1024 + Q and dO of 64 rows + 2 stages of K and V + the dS tile + two warpgroups' row
// sums.
#define FLEXATTN_AOT_BACKWARD_WIDE(name, modifier, tag, qk, v)                   \
  using name##_config = flexattn_kernels::BackwardWgmmaWideConfig<               \
      tag, qk, v, 1024 + 3 * 64 * ((qk) + (v)) * 2 + 2 * 64 * 64 * 2 + 2 * 512,  \
      1024 + 3 * 64 * ((qk) + (v)) * 2 + 64 * 64 * 2 + 2 * 512>;                 \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads, 1)       \
      name##_dkdv(const BackwardParams params) {                                 \
    flexattn_kernels::backward_dkdv_wgmma_wide<name##_config, modifier>(params); \
  }                                                                              \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads, 1)       \
      name##_dq(const BackwardParams params) {                                   \
    flexattn_kernels::backward_dq_wgmma_wide<name##_config, modifier>(params);   \
  }

FLEXATTN_AOT_BACKWARD_WIDE(aot_backward_wide_bf16_d256_softcap, CausalSoftcapModifier, BFloat16Tag,
                           256, 256)
FLEXATTN_AOT_BACKWARD_WIDE(aot_backward_wide_f16_d256, IdentityModifier, HalfTag, 256, 256)
FLEXATTN_AOT_BACKWARD_WIDE(aot_backward_wide_bf16_d192_v128, IdentityModifier, BFloat16Tag, 192,
                           128)
FLEXATTN_AOT_BACKWARD_WIDE(aot_backward_wide_f16_d192_v128_softcap, CausalSoftcapModifier, HalfTag,
                           192, 128)

// The non-finite repair kernels (repair.cuh) that run after the cudnn engine's graphs.
#define FLEXATTN_AOT_REPAIR(name, modifier, tag, qk, v)                                        \
  extern "C" __global__ void __launch_bounds__(flexattn_kernels::kRepairThreads)               \
      name##_forward(const ForwardParams params) {                                             \
    flexattn_kernels::repair_forward<tag, modifier, qk, v>(params);                            \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(flexattn_kernels::kRepairThreads)               \
      name##_dq(const BackwardParams params) {                                                 \
    flexattn_kernels::repair_dq<tag, modifier, qk, v>(params);                                 \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(flexattn_kernels::kRepairThreads)               \
      name##_dkdv(const BackwardParams params) {                                               \
    flexattn_kernels::repair_dkdv<tag, modifier, qk, v>(params);                               \
  }

FLEXATTN_AOT_REPAIR(aot_repair_bf16_d128_softcap, CausalSoftcapModifier, BFloat16Tag, 128, 128)
FLEXATTN_AOT_REPAIR(aot_repair_f16_d192_v128, IdentityModifier, HalfTag, 192, 128)

// The paged-cache decoding kernel and its combine (decode.cuh): GQA groups of 4 and 8 rows,
// vector and element loads, a head dim that is no multiple of 32.
#define FLEXATTN_AOT_DECODE(name, modifier, tag, qk, v, rows, vector)                            \
  using name##_config = flexattn_kernels::DecodeConfig<tag, qk, v, rows, vector>;              \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads)                        \
      name(const flexattn_kernels::DecodeParams params) {                                      \
    flexattn_kernels::forward_decode<name##_config, modifier>(params);                         \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(flexattn_kernels::kDecodeCombineThreads)        \
      name##_combine(const flexattn_kernels::DecodeParams params) {                            \
    flexattn_kernels::decode_combine<tag, v>(params);                                          \
  }

FLEXATTN_AOT_DECODE(aot_decode_bf16_d128_softcap, CausalSoftcapModifier, BFloat16Tag, 128, 128, 4,
                    true)
FLEXATTN_AOT_DECODE(aot_decode_f32_d64, IdentityModifier, Float32Tag, 64, 64, 8, true)
FLEXATTN_AOT_DECODE(aot_decode_f16_d80_v72, CausalSoftcapModifier, HalfTag, 80, 72, 2, false)
FLEXATTN_AOT_DECODE(aot_decode_bf16_d256, IdentityModifier, BFloat16Tag, 256, 256, 8, true)

// Its tensor-core variant (DecodeMmaConfig): the stage counts decode_choice picks (head dim 128:
// 3; 64: 4; 256: 2), padded head dims (80/72 padded to 128).
#define FLEXATTN_AOT_DECODE_MMA(name, modifier, tag, qk, v, padded_qk, padded_v, stages)         \
  using name##_config =                                                                        \
      flexattn_kernels::DecodeMmaConfig<tag, qk, v, padded_qk, padded_v, stages>;             \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads)                        \
      name(const flexattn_kernels::DecodeParams params) {                                      \
    flexattn_kernels::forward_decode_mma<name##_config, modifier>(params);                     \
  }

FLEXATTN_AOT_DECODE_MMA(aot_decode_mma_bf16_d128_softcap, CausalSoftcapModifier, BFloat16Tag, 128,
                        128, 128, 128, 3)
FLEXATTN_AOT_DECODE_MMA(aot_decode_mma_f16_d64, IdentityModifier, HalfTag, 64, 64, 64, 64, 4)
FLEXATTN_AOT_DECODE_MMA(aot_decode_mma_bf16_d80_v72, CausalSoftcapModifier, BFloat16Tag, 80, 72,
                        128, 128, 3)
FLEXATTN_AOT_DECODE_MMA(aot_decode_mma_bf16_d256, IdentityModifier, BFloat16Tag, 256, 256, 256,
                        256, 2)

// Chunked prefill on the same kernel (64 rows per block, a warp's 16 rows against whole tiles):
// the stage counts decode_choice picks (head dim 128: 2; 64: 4).
#define FLEXATTN_AOT_PREFILL_MMA(name, modifier, tag, qk, v, padded_qk, padded_v, stages)        \
  using name##_config =                                                                        \
      flexattn_kernels::DecodeMmaConfig<tag, qk, v, padded_qk, padded_v, stages, 64>;         \
  extern "C" __global__ void __launch_bounds__(name##_config::kThreads)                        \
      name(const flexattn_kernels::DecodeParams params) {                                      \
    flexattn_kernels::forward_decode_mma<name##_config, modifier>(params);                     \
  }

FLEXATTN_AOT_PREFILL_MMA(aot_prefill_mma_bf16_d128_softcap, CausalSoftcapModifier, BFloat16Tag,
                         128, 128, 128, 128, 2)
FLEXATTN_AOT_PREFILL_MMA(aot_prefill_mma_f16_d64, IdentityModifier, HalfTag, 64, 64, 64, 64, 4)

// Chunked prefill on sm_90 on the wgmma forward over the paged cache: the shapes wgmma_choice
// picks (head dim 128 with its producer and turns; 64 two blocks per multiprocessor; 256).
#define FLEXATTN_AOT_PREFILL_WGMMA(name, modifier, ...)                                      \
  extern "C" __global__ void __launch_bounds__(WgmmaConfig<__VA_ARGS__>::kBlockThreads,     \
                                               WgmmaConfig<__VA_ARGS__>::kMinBlocks)        \
      name(const flexattn_kernels::DecodeParams params) {                                   \
    flexattn_kernels::forward_prefill_wgmma<WgmmaConfig<__VA_ARGS__>, modifier>(params);    \
  }

FLEXATTN_AOT_PREFILL_WGMMA(aot_prefill_wgmma_bf16_d128_softcap, CausalSoftcapModifier,
                           BFloat16Tag, 128, 128, 128, 3, true,
                           1024 + 128 * 256 + 3 * 2 * 128 * 256 + 64, true, 2, 1, false, true)
FLEXATTN_AOT_PREFILL_WGMMA(aot_prefill_wgmma_bf16_d128, IdentityModifier, BFloat16Tag, 128, 128,
                           128, 3, true, 1024 + 128 * 256 + 3 * 2 * 128 * 256 + 64, true, 2, 1,
                           false, true)
FLEXATTN_AOT_PREFILL_WGMMA(aot_prefill_wgmma_f16_d64_softcap, CausalSoftcapModifier, HalfTag, 64,
                           64, 128, 2, false, 1024 + 128 * 128 + 2 * 2 * 128 * 128, false, 2, 2)
FLEXATTN_AOT_PREFILL_WGMMA(aot_prefill_wgmma_bf16_d256_softcap, CausalSoftcapModifier,
                           BFloat16Tag, 256, 256, 64, 2, false, 1024 + 128 * 512 + 2 * 2 * 64 * 512)
