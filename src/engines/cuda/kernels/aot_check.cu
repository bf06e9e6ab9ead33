// Ahead-of-time compile check of the kernel templates (built by nvcc for sm_90, never run): the
// identity modifier instantiated with the tile configurations the engine uses, so a type error
// in a template fails the build even where no GPU and no NVRTC run happens.
#include "forward_mma.cuh"
#include "forward_simt.cuh"

using flexattn_kernels::BFloat16Tag;
using flexattn_kernels::Coordinates;
using flexattn_kernels::Float32Tag;
using flexattn_kernels::ForwardParams;
using flexattn_kernels::HalfTag;
using flexattn_kernels::MmaConfig;
using flexattn_kernels::SimtConfig;

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
  __device__ static bool mask_mod(const Invariants&, const ForwardParams&, const Coordinates&,
                                  int, int) {
    return true;
  }
};

// A modifier with every code path of the element pipeline live (score_mod and mask).
struct CausalSoftcapModifier {
  static constexpr bool kIdentityScore = false;
  static constexpr bool kHasMask = true;
  struct Invariants {
    float cap;
  };
  __device__ static Invariants prepare(const ForwardParams& p, const Coordinates&) {
    return Invariants{p.params[0]};
  }
  __device__ static float score_mod(const Invariants& invariants, const ForwardParams&,
                                    const Coordinates&, float score, int, int) {
    return invariants.cap * tanhf(score / invariants.cap);
  }
  __device__ static bool mask_mod(const Invariants&, const ForwardParams&, const Coordinates&,
                                  int q, int kv) {
    return q >= kv;
  }
};

}  // namespace flexattn_aot

using flexattn_aot::CausalSoftcapModifier;
using flexattn_aot::IdentityModifier;

#define FLEXATTN_AOT_MMA(name, modifier, ...)                                                 \
  extern "C" __global__ void __launch_bounds__(MmaConfig<__VA_ARGS__>::kThreads,             \
                                               MmaConfig<__VA_ARGS__>::kMinBlocks)            \
      name(const ForwardParams params) {                                                      \
    flexattn_kernels::forward_mma<MmaConfig<__VA_ARGS__>, modifier>(params);                  \
  }
#define FLEXATTN_AOT_SIMT(name, modifier, ...)                                                \
  extern "C" __global__ void __launch_bounds__(SimtConfig<__VA_ARGS__>::kThreads)            \
      name(const ForwardParams params) {                                                      \
    flexattn_kernels::forward_simt<SimtConfig<__VA_ARGS__>, modifier>(params);                \
  }

FLEXATTN_AOT_MMA(aot_bf16_d128, IdentityModifier, BFloat16Tag, 128, 128, 128, 128, 2, 4, 64, 2, 2)
FLEXATTN_AOT_MMA(aot_bf16_d128_softcap, CausalSoftcapModifier, BFloat16Tag, 128, 128, 128, 128,
                 2, 4, 64, 2, 2)
FLEXATTN_AOT_MMA(aot_bf16_d64, IdentityModifier, BFloat16Tag, 64, 64, 64, 64, 2, 4, 64, 2, 2)
FLEXATTN_AOT_MMA(aot_f16_d80_v72, CausalSoftcapModifier, HalfTag, 80, 72, 128, 128, 2, 4, 64, 2,
                 2)
FLEXATTN_AOT_MMA(aot_bf16_d256, IdentityModifier, BFloat16Tag, 256, 256, 256, 256, 1, 4, 64, 2,
                 1)
FLEXATTN_AOT_SIMT(aot_f32_d64, IdentityModifier, Float32Tag, 64, 64)
FLEXATTN_AOT_SIMT(aot_f32_d80_softcap, CausalSoftcapModifier, Float32Tag, 80, 40)
FLEXATTN_AOT_SIMT(aot_bf16_d17, CausalSoftcapModifier, BFloat16Tag, 17, 17)
