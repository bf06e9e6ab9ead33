// Gemma-2 style attention (logit softcap 30, causal mask) through flexattn's engine selection.
#include <cstdio>

#include "flexattn/flexattn.hpp"

int main() {
  using namespace flexattn;
  ProblemDesc desc;  // layout bshd, fp32, on the CPU
  desc.batch = 1, desc.heads_q = 8, desc.seq_len_q = 256, desc.head_dim_qk = 64;
  desc.score_mod = 30.0 * ir::tanh(ir::score() / 30.0);  // or ir::parse("30 * tanh(score / 30)")
  desc.mask_mod = ir::query() >= ir::key();
  const Problem problem(desc);  // validated once; throws flexattn::Error with a clear message

  const auto tensor = [&](const char* which) {
    return HostTensor(DType::kF32, problem.expected(which).shape);
  };
  HostTensor q = tensor("q"), k = tensor("k"), v = tensor("v"), out = tensor("o");
  q.fill_normal(1), k.fill_normal(2), v.fill_normal(3);

  Context context;  // engines fastest first, filtered by FLEXATTN_ENGINES; caches plans
  const auto plan = context.select(problem);  // proven to implement exactly this modifier
  ForwardArgs args;
  args.q = q.view(), args.k = k.view(), args.v = v.view(), args.out = out.view();
  plan->forward(args);  // checks every view against the problem, then runs
  std::printf("%s: out[0] = %.6f\n", plan->info().engine.c_str(), out.at(0));
}
