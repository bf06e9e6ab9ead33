// Decoding against a paged KV cache: a prompt of 8 tokens per sequence, then one token at a time.
// Each new token's K and V are appended to its sequence's pages (a page is taken from the free
// list when the last one is full); one plan per query count serves every step, since the lengths
// and the page table are arguments of the run, not of the problem.
#include <cstdio>
#include <vector>

#include "flexattn/flexattn.hpp"

int main() {
  using namespace flexattn;
  constexpr std::int64_t kBatch = 2, kHeadsQ = 8, kHeadsKv = 2, kDim = 64;
  constexpr std::int64_t kPageSize = 16, kPages = 64, kMaxPages = 16;  // capacity 256 tokens
  constexpr std::int64_t kPrompt = 8, kSteps = 40;

  const auto make_problem = [&](std::int64_t new_tokens) {
    ProblemDesc desc;  // queries in bshd: (batch, new tokens, heads, dim)
    desc.batch = kBatch, desc.heads_q = kHeadsQ, desc.heads_kv = kHeadsKv;
    desc.seq_len_q = new_tokens, desc.head_dim_qk = kDim;
    desc.kv_cache = KvCacheDesc{kPages, kPageSize, kMaxPages};
    desc.score_mod = ir::parse("30 * tanh(score / 30)");
    desc.mask_mod = ir::parse("q >= kv");  // positions in the sequence: the new tokens are last
    return Problem(desc);
  };
  const Problem prefill = make_problem(kPrompt), decode = make_problem(1);

  // The pools, the page table and the lengths live with the caller, like any other tensor.
  HostTensor k_pool(DType::kF32, prefill.expected("k").shape);  // (pages, page_size, heads, dim)
  HostTensor v_pool(DType::kF32, prefill.expected("v").shape);
  HostTensor page_table(DType::kI32, {kBatch, kMaxPages});
  HostTensor cache_lens(DType::kI32, {kBatch});
  std::vector<std::int64_t> free_pages;
  for (std::int64_t page = kPages - 1; page >= 0; --page) free_pages.push_back(page);

  // Appends `count` tokens of random K and V to every sequence (a model would write its own).
  std::uint64_t seed = 1;
  const auto append = [&](std::int64_t count) {
    HostTensor row(DType::kF32, {kHeadsKv * kDim});
    for (std::int64_t b = 0; b < kBatch; ++b) {
      for (std::int64_t t = 0; t < count; ++t) {
        const auto length = static_cast<std::int64_t>(cache_lens.at(b));
        if (length % kPageSize == 0) {  // the last page is full: take a free one
          page_table.set(b * kMaxPages + length / kPageSize,
                         static_cast<double>(free_pages.back()));
          free_pages.pop_back();
        }
        const auto page =
            static_cast<std::int64_t>(page_table.at(b * kMaxPages + length / kPageSize));
        const std::int64_t base = (page * kPageSize + length % kPageSize) * kHeadsKv * kDim;
        for (HostTensor* pool : {&k_pool, &v_pool}) {
          row.fill_normal(seed++);
          for (std::int64_t i = 0; i < kHeadsKv * kDim; ++i) pool->set(base + i, row.at(i));
        }
        cache_lens.set(b, static_cast<double>(length + 1));
      }
    }
  };

  Context context;
  const auto attend = [&](const Problem& problem, std::uint64_t query_seed) {
    HostTensor q(DType::kF32, problem.expected("q").shape),
        out(DType::kF32, problem.expected("o").shape);
    HostTensor lse(DType::kF32, problem.expected("lse").shape);
    q.fill_normal(query_seed);
    ForwardArgs args;
    args.q = q.view(), args.k = k_pool.view(), args.v = v_pool.view();
    args.out = out.view(), args.lse = lse.view();  // the LSE lets callers merge partial results
    args.page_table = page_table.view(), args.cache_lens = cache_lens.view();
    const auto plan = context.select(problem);  // the same plan at every step
    plan->forward(args);  // checks the lengths and every page the sequences use
    return std::pair{plan->info().engine, out.at(0)};
  };

  append(kPrompt);  // the prompt's keys and values, then attention over them
  auto [engine, first] = attend(prefill, 1000);
  std::printf("prefill of %lld tokens per sequence on %s: out[0] = %.6f\n",
              static_cast<long long>(kPrompt), engine.c_str(), first);
  double last = 0;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    append(1);
    last = attend(decode, 2000 + static_cast<std::uint64_t>(step)).second;
  }
  std::printf("%lld decoding steps: %lld tokens cached per sequence in %lld pages, out[0] = %.6f\n",
              static_cast<long long>(kSteps), static_cast<long long>(cache_lens.at(0)),
              static_cast<long long>(kPages - static_cast<std::int64_t>(free_pages.size())), last);
}
