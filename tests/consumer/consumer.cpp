// Softcap + causal attention through an installed flexattn: selection picks an engine, and the
// result is compared with the float64 reference engine (cpu_ref) on the same inputs.
#include <cmath>
#include <cstdio>

#include "flexattn/flexattn.hpp"

int main() {
  using namespace flexattn;
  ProblemDesc desc;
  desc.batch = 1, desc.heads_q = 4, desc.seq_len_q = 100, desc.head_dim_qk = 32;
  desc.score_mod = ir::parse("30 * tanh(score / 30)");
  desc.mask_mod = ir::query() >= ir::key();
  const Problem problem(desc);
  const auto tensor = [&](const char* which) {
    return HostTensor(DType::kF32, problem.expected(which).shape);
  };
  HostTensor q = tensor("q"), k = tensor("k"), v = tensor("v"), out = tensor("o");
  q.fill_normal(1), k.fill_normal(2), v.fill_normal(3);
  ForwardArgs args;
  args.q = q.view(), args.k = k.view(), args.v = v.view(), args.out = out.view();
  Context context;
  const auto plan = context.select(problem);
  plan->forward(args);

  ProblemDesc reference_desc = desc;
  reference_desc.dtype = DType::kF64;
  const Problem reference_problem(reference_desc);
  HostTensor q64 = q.to(DType::kF64), k64 = k.to(DType::kF64), v64 = v.to(DType::kF64);
  HostTensor out64(DType::kF64, reference_problem.expected("o").shape);
  ForwardArgs reference;
  reference.q = q64.view(), reference.k = k64.view(), reference.v = v64.view();
  reference.out = out64.view();
  Context().select(reference_problem)->forward(reference);
  double worst = 0;
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    worst = std::fmax(worst, std::fabs(out.at(i) - out64.at(i)));
  }
  std::printf("flexattn %s via %s: max error %.3g\n", version(), plan->info().engine.c_str(),
              worst);
  return worst < 1e-4 ? 0 : 1;
}
