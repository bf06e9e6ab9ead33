// Paged KV cache problems (docs/design.md section 2, "Paged KV cache"): validation of the
// geometry and of the page table and lengths, the engine gate, the plan canary, and the results
// of the engines that read caches (cpu_ref, cpu), which must equal bit for bit (1) the same
// problem with every sequence in one contiguous page and (2) the equivalent dense ragged (thd)
// problem whose modifiers shift `q` to the bottom right by hand. The pools hold NaN in every slot
// no sequence uses, so a read outside a sequence's pages poisons its rows.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flexattn/context.hpp"
#include "flexattn/error.hpp"
#include "support/test_support.hpp"

namespace flexattn {
namespace {

constexpr std::int64_t kCapacity = 256;
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

const Engine& cpu_ref() {
  static const std::shared_ptr<const Engine> engine = test::builtin_engine("cpu_ref");
  return *engine;
}

template <typename Body>
std::string error_of(const Body& body) {
  try {
    body();
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected flexattn::Error";
  return {};
}

// Sequences of a batch: their query counts and cache lengths (bshd: equal query counts).
struct Geometry {
  Layout layout = Layout::kBSHD;
  std::vector<std::int64_t> q_lens, cache_lens;
  std::int64_t heads_q = 4, heads_kv = 2, dim = 16;
  std::int64_t batch() const { return static_cast<std::int64_t>(q_lens.size()); }
};

std::vector<std::int64_t> offsets(const std::vector<std::int64_t>& lengths) {
  std::vector<std::int64_t> result{0};
  for (std::int64_t length : lengths) result.push_back(result.back() + length);
  return result;
}

// A modifier written for the cache (positions are logical) and the same function written for
// the dense ragged problem, where `q` counts from the first new query.
struct Modifier {
  std::string name, score_mod, mask_mod, dense_score_mod, dense_mask_mod;
  bool document_ids = false;  // declares doc (int32, (batch, capacity))
};

const std::vector<Modifier>& modifiers() {
  const std::string shifted = "(q + (KV_LEN - Q_LEN))";
  static const std::vector<Modifier> list = {
      {"softcap_causal", "30 * tanh(score / 30)", "q >= kv", "30 * tanh(score / 30)",
       shifted + " >= kv"},
      {"alibi_slopes_from_head", "score + exp2(-8.0 * (h + 1) / 4) * (kv - q)", "",
       "score + exp2(-8.0 * (h + 1) / 4) * (kv - " + shifted + ")", ""},
      {"sliding_window", "", "q >= kv && q - kv < 48", "",
       shifted + " >= kv && " + shifted + " - kv < 48"},
      {"document_mask", "", "doc[b, q] == doc[b, kv] && q >= kv", "",
       "doc[b, clamp(" + shifted + ", 0, " + std::to_string(kCapacity - 1) +
           ")] == doc[b, kv] && " + shifted + " >= kv",
       true},
  };
  return list;
}

void apply(const Modifier& modifier, bool dense, std::int64_t batch, ProblemDesc& desc) {
  if (modifier.document_ids) desc.tensors["doc"] = {DType::kI32, {batch, kCapacity}};
  const ir::Scope scope = desc.scope();
  const std::string& score = dense ? modifier.dense_score_mod : modifier.score_mod;
  const std::string& mask = dense ? modifier.dense_mask_mod : modifier.mask_mod;
  if (!score.empty()) desc.score_mod = ir::parse(score, scope);
  if (!mask.empty()) desc.mask_mod = ir::parse(mask, scope);
}

ProblemDesc cache_desc(const Geometry& g, std::int64_t page_size, std::int64_t pages) {
  ProblemDesc desc;
  desc.batch = g.batch();
  desc.heads_q = g.heads_q;
  desc.heads_kv = g.heads_kv;
  desc.head_dim_qk = g.dim;
  desc.layout = g.layout;
  desc.dtype = DType::kF32;
  if (g.layout == Layout::kTHD) {
    desc.seq_len_q = 0;  // the longest sequence
    desc.cu_seqlens_q = offsets(g.q_lens);
  } else {
    desc.seq_len_q = g.q_lens.front();
  }
  desc.kv_cache = KvCacheDesc{pages, page_size, kCapacity / page_size};
  return desc;
}

// The data of one batch: queries as (tokens, heads_q, dim) (bshd's memory order too), the logical
// K and V of each sequence (cache_len, heads_kv, dim), document ids.
struct Data {
  HostTensor q;
  std::vector<std::vector<double>> k, v;
  HostTensor doc;
};

Data random_data(const Geometry& g, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal;
  Data data;
  const std::int64_t tokens = offsets(g.q_lens).back();
  data.q = HostTensor(DType::kF32, {tokens, g.heads_q, g.dim});
  data.q.fill_normal(seed);
  for (std::int64_t length : g.cache_lens) {
    for (auto* rows : {&data.k, &data.v}) {
      rows->emplace_back(static_cast<std::size_t>(length * g.heads_kv * g.dim));
      // Rounded through fp32, the storage both problems read.
      for (double& value : rows->back()) value = static_cast<float>(normal(random));
    }
  }
  data.doc = HostTensor(DType::kI32, {g.batch(), kCapacity});
  for (std::int64_t i = 0; i < data.doc.numel(); ++i) {
    data.doc.set(i, static_cast<double>((i % kCapacity) / 37));  // documents of 37 tokens
  }
  return data;
}

struct Result {
  HostTensor out, lse;
};

// Runs the cache problem with `page_size`: each sequence's pages are spread over the pool in a
// random order, two pages no sequence uses are added, and every unused slot holds NaN.
Result run_paged(const Engine& engine, const Geometry& g, const Modifier& modifier,
                 const Data& data, std::int64_t page_size, std::uint64_t seed) {
  const std::int64_t max_pages = kCapacity / page_size;
  std::int64_t used = 0;
  for (std::int64_t length : g.cache_lens) used += (length + page_size - 1) / page_size;
  const std::int64_t pages = used + 2;
  std::vector<std::int32_t> order(static_cast<std::size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 random(seed);
  std::shuffle(order.begin(), order.end(), random);

  ProblemDesc desc = cache_desc(g, page_size, pages);
  apply(modifier, false, g.batch(), desc);
  const Problem problem(desc);
  HostTensor k_pool(DType::kF32, problem.expected("k").shape);
  HostTensor v_pool(DType::kF32, problem.expected("v").shape);
  for (HostTensor* pool : {&k_pool, &v_pool}) {
    for (std::int64_t i = 0; i < pool->numel(); ++i) pool->set(i, kNan);
  }
  HostTensor page_table(DType::kI32, {g.batch(), max_pages});
  HostTensor cache_lens(DType::kI32, {g.batch()});
  const std::int64_t row = g.heads_kv * g.dim;  // one token of a pool page
  std::size_t next = 0;
  for (std::int64_t b = 0; b < g.batch(); ++b) {
    const std::int64_t length = g.cache_lens[static_cast<std::size_t>(b)];
    cache_lens.set(b, static_cast<double>(length));
    for (std::int64_t j = 0; j < max_pages; ++j) page_table.set(b * max_pages + j, -1);  // unread
    for (std::int64_t s = 0; s < length; ++s) {
      if (s % page_size == 0) page_table.set(b * max_pages + s / page_size, order[next++]);
      const auto page = static_cast<std::int64_t>(page_table.at(b * max_pages + s / page_size));
      const std::int64_t base = (page * page_size + s % page_size) * row;
      for (std::int64_t i = 0; i < row; ++i) {
        k_pool.set(base + i,
                   data.k[static_cast<std::size_t>(b)][static_cast<std::size_t>(s * row + i)]);
        v_pool.set(base + i,
                   data.v[static_cast<std::size_t>(b)][static_cast<std::size_t>(s * row + i)]);
      }
    }
  }
  HostTensor q(DType::kF32, problem.expected("q").shape);
  std::memcpy(q.data(), data.q.data(), q.bytes());
  Result result{HostTensor(DType::kF32, problem.expected("o").shape),
                HostTensor(DType::kF32, problem.expected("lse").shape)};
  ForwardArgs args;
  args.q = q.view();
  args.k = k_pool.view();
  args.v = v_pool.view();
  args.out = result.out.view();
  args.lse = result.lse.view();
  args.page_table = page_table.view();
  args.cache_lens = cache_lens.view();
  if (modifier.document_ids) args.tensors["doc"] = data.doc.view();
  engine.plan(problem)->forward(args);
  return result;
}

// The same function as a dense ragged problem: K and V of each sequence packed one after
// another, the modifiers shifted by hand. Its LSE is (heads_q, tokens); returned as the cache
// problem's layout has it.
Result run_dense(const Engine& engine, const Geometry& g, const Modifier& modifier,
                 const Data& data) {
  ProblemDesc desc;
  desc.batch = g.batch();
  desc.heads_q = g.heads_q;
  desc.heads_kv = g.heads_kv;
  desc.head_dim_qk = g.dim;
  desc.layout = Layout::kTHD;
  desc.dtype = DType::kF32;
  desc.seq_len_q = 0;  // the longest sequences
  desc.cu_seqlens_q = offsets(g.q_lens);
  desc.cu_seqlens_kv = offsets(g.cache_lens);
  apply(modifier, true, g.batch(), desc);
  const Problem problem(desc);
  HostTensor k(DType::kF32, problem.expected("k").shape);
  HostTensor v(DType::kF32, problem.expected("v").shape);
  std::int64_t at = 0;
  for (std::size_t b = 0; b < g.q_lens.size(); ++b) {
    for (std::size_t i = 0; i < data.k[b].size(); ++i, ++at) {
      k.set(at, data.k[b][i]);
      v.set(at, data.v[b][i]);
    }
  }
  Result dense{HostTensor(DType::kF32, problem.expected("o").shape),
               HostTensor(DType::kF32, problem.expected("lse").shape)};
  ForwardArgs args;
  args.q = data.q.view();
  args.k = k.view();
  args.v = v.view();
  args.out = dense.out.view();
  args.lse = dense.lse.view();
  if (modifier.document_ids) args.tensors["doc"] = data.doc.view();
  engine.plan(problem)->forward(args);
  if (g.layout == Layout::kTHD) return dense;
  // bshd's LSE is (batch, heads_q, seq_len_q).
  const std::int64_t seq = g.q_lens.front(), tokens = g.batch() * seq;
  Result result{std::move(dense.out), HostTensor(DType::kF32, {g.batch(), g.heads_q, seq})};
  for (std::int64_t b = 0; b < g.batch(); ++b) {
    for (std::int64_t h = 0; h < g.heads_q; ++h) {
      for (std::int64_t i = 0; i < seq; ++i) {
        result.lse.set((b * g.heads_q + h) * seq + i, dense.lse.at(h * tokens + b * seq + i));
      }
    }
  }
  return result;
}

// Same bits in the same memory order (bshd's output and thd's share it; shapes may differ).
bool bit_identical(const HostTensor& a, const HostTensor& b) {
  return a.dtype() == b.dtype() && a.bytes() == b.bytes() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// Rows of a sequence whose cache is empty are 0 with LSE -inf; every other row is finite.
void expect_finite_except_empty(const Geometry& g, const Result& result, const std::string& what) {
  for (std::int64_t i = 0; i < result.out.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(result.out.at(i))) << what << ": out element " << i;
  }
  std::int64_t empty = 0;
  for (std::int64_t i = 0; i < result.lse.numel(); ++i) {
    if (std::isinf(result.lse.at(i)) && result.lse.at(i) < 0) ++empty;
  }
  std::int64_t expected_empty = 0;
  for (std::size_t b = 0; b < g.q_lens.size(); ++b) {
    if (g.cache_lens[b] == 0) expected_empty += g.q_lens[b] * g.heads_q;
  }
  EXPECT_EQ(empty, expected_empty) << what << ": rows with LSE -inf";
}

Geometry decode_batch(Layout layout, std::int64_t heads_q, std::int64_t heads_kv) {
  Geometry g;
  g.layout = layout;
  g.heads_q = heads_q;
  g.heads_kv = heads_kv;
  if (layout == Layout::kTHD) {  // decode, chunked prefill and an empty slot in one batch
    g.q_lens = {1, 9, 3, 0, 2};
    g.cache_lens = {1, 200, 3, 17, 0};
  } else {  // two new tokens each; an empty slot; a full cache
    g.q_lens = {2, 2, 2, 2};
    g.cache_lens = {2, 0, 131, kCapacity};
  }
  return g;
}

const Engine& cpu() {
  static const std::shared_ptr<const Engine> engine = test::builtin_engine("cpu");
  return *engine;
}

// On each engine that reads a cache, cpu_ref (float64) and cpu (float32 tiles).
TEST(KvCache, PagedEqualsContiguousAndTheDenseProblemBitForBit) {
  for (const Engine* engine : {&cpu_ref(), &cpu()})
    for (const Layout layout : {Layout::kBSHD, Layout::kTHD}) {
      for (const auto& [heads_q, heads_kv] : {std::pair{4, 4}, std::pair{4, 2}, std::pair{8, 1}}) {
        const Geometry g = decode_batch(layout, heads_q, heads_kv);
        const Data data = random_data(g, 11 + static_cast<std::uint64_t>(heads_kv));
        for (const Modifier& modifier : modifiers()) {
          const std::string what = fmt::format("{}: {} {} heads {}/{}", engine->name(),
                                               to_string(layout), modifier.name, heads_q, heads_kv);
          const Result contiguous = run_paged(*engine, g, modifier, data, kCapacity, 1);
          expect_finite_except_empty(g, contiguous, what);
          const Result dense = run_dense(*engine, g, modifier, data);
          EXPECT_TRUE(bit_identical(contiguous.out, dense.out)) << what << ": out, dense";
          EXPECT_TRUE(bit_identical(contiguous.lse, dense.lse)) << what << ": lse, dense";
          for (const std::int64_t page_size : {1, 16, 64}) {
            const Result paged = run_paged(*engine, g, modifier, data, page_size, 7);
            EXPECT_TRUE(bit_identical(paged.out, contiguous.out))
                << what << ": out, page size " << page_size;
            EXPECT_TRUE(bit_identical(paged.lse, contiguous.lse))
                << what << ": lse, page size " << page_size;
          }
        }
      }
    }
}

// A decoding step on cpu packs a GQA group's query heads into the lanes of one task; every lane
// must compute exactly what it computes head by head: the same cache with its K and V heads
// repeated for every query head (no groups, so nothing packed) gives the same bits.
TEST(KvCache, GqaGroupsPackedIntoLanesEqualHeadByHeadBitForBit) {
  for (const Layout layout : {Layout::kBSHD, Layout::kTHD}) {
    const Geometry grouped = decode_batch(layout, 8, 2);
    Geometry per_head = grouped;
    per_head.heads_kv = 8;
    const Data data = random_data(grouped, 21);
    Data repeated = random_data(per_head, 21);
    for (std::size_t b = 0; b < grouped.cache_lens.size(); ++b) {
      for (std::int64_t s = 0; s < grouped.cache_lens[b]; ++s) {
        for (std::int64_t h = 0; h < 8; ++h) {
          for (std::int64_t d = 0; d < grouped.dim; ++d) {
            const auto from = static_cast<std::size_t>((s * 2 + h / 4) * grouped.dim + d);
            const auto to = static_cast<std::size_t>((s * 8 + h) * grouped.dim + d);
            repeated.k[b][to] = data.k[b][from];
            repeated.v[b][to] = data.v[b][from];
          }
        }
      }
    }
    for (const Modifier& modifier : modifiers()) {
      const Result packed = run_paged(cpu(), grouped, modifier, data, 16, 2);
      const Result head_by_head = run_paged(cpu(), per_head, modifier, repeated, 16, 2);
      EXPECT_TRUE(bit_identical(packed.out, head_by_head.out))
          << to_string(layout) << " " << modifier.name;
      EXPECT_TRUE(bit_identical(packed.lse, head_by_head.lse))
          << to_string(layout) << " " << modifier.name;
    }
  }
}

// The modifiers see positions, not rows: a causal cache problem differs from the same rows with
// the mask aligned to the top left (the mutation an engine that forgot the offset would compute).
TEST(KvCache, QueriesSitAtTheEndOfTheCache) {
  Geometry g;
  g.q_lens = {3};
  g.cache_lens = {40};
  const Data data = random_data(g, 5);
  Modifier top_left = modifiers().front();
  top_left.dense_mask_mod = "q >= kv";
  const Result cache = run_paged(cpu_ref(), g, modifiers().front(), data, 16, 3);
  const Result aligned_top_left = run_dense(cpu_ref(), g, top_left, data);
  const Result aligned = run_dense(cpu_ref(), g, modifiers().front(), data);
  EXPECT_TRUE(bit_identical(cache.out, aligned.out));
  EXPECT_FALSE(bit_identical(cache.out, aligned_top_left.out));
  // KV_LEN is the cache length: a mask that keeps only the last key of the cache.
  Modifier last_key{"last_key", "", "kv == KV_LEN - 1", "", "kv == KV_LEN - 1"};
  const Result last = run_paged(cpu_ref(), g, last_key, data, 16, 3);
  for (std::int64_t i = 0; i < g.dim; ++i) {  // row 0, head 0: V of token 39, head 0
    EXPECT_EQ(last.out.at(i),
              static_cast<float>(data.v[0][static_cast<std::size_t>(39 * 2 * 16 + i)]));
  }
}

// ---- validation -------------------------------------------------------------------------------

ProblemDesc valid_desc() {
  Geometry g;
  g.q_lens = {2, 2};
  g.cache_lens = {10, 20};
  return cache_desc(g, 16, 8);
}

TEST(KvCache, ProblemRefusesWhatACacheCannotBe) {
  const auto refused = [](const std::function<void(ProblemDesc&)>& change) {
    ProblemDesc desc = valid_desc();
    change(desc);
    return error_of([&] { Problem problem(desc); });
  };
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.layout = Layout::kSBHD;
            }).find("a KV cache takes queries in layout bshd or thd, not sbhd"),
            std::string::npos);
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.direction = Direction::kForwardBackward;
            }).find("forward only"),
            std::string::npos);
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.layout = Layout::kTHD;
              d.seq_len_q = 0;
              d.cu_seqlens_q = d.cu_seqlens_kv = {0, 2, 4};
            }).find("takes no cu_seqlens_kv"),
            std::string::npos);
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.kv_cache->page_size = 0;
            }).find("kv_cache.page_size (0) must be positive"),
            std::string::npos);
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.kv_cache->pages = -1;
            }).find("kv_cache.pages (-1) must be positive"),
            std::string::npos);
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.kv_cache->max_pages = std::int64_t{1} << 40;
              d.kv_cache->page_size = std::int64_t{1} << 40;
            }).find("past the modifiers' i32 indices"),
            std::string::npos);
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.seq_len_q = kCapacity + 1;
            }).find("257 query tokens does not fit the KV cache's capacity"),
            std::string::npos);
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.seq_len_kv = 100;
            }).find("seq_len_kv (100) must be 0 or the KV cache's capacity"),
            std::string::npos);
  EXPECT_NE(refused([](ProblemDesc& d) {
              d.k_strides = std::vector<std::int64_t>{32, 16, 1};
            }).find("k_strides has 3 entries; a KV cache pool needs 4"),
            std::string::npos);
  EXPECT_NE(
      refused([](ProblemDesc& d) { d.kv_cache->pages = std::int64_t{1} << 40; }).find("pages"),
      std::string::npos);
  // The pools' shapes, the capacity and the cache in the signature.
  const Problem problem(valid_desc());
  EXPECT_EQ(problem.seq_len_kv(), kCapacity);
  EXPECT_EQ(problem.expected("k").shape, (std::vector<std::int64_t>{8, 16, 2, 16}));
  EXPECT_EQ(problem.expected("page_table").shape, (std::vector<std::int64_t>{2, 16}));
  ProblemDesc other = valid_desc();
  other.kv_cache = KvCacheDesc{16, 8, 32};  // the same capacity in smaller pages
  EXPECT_NE(Problem(other).signature(), problem.signature());
}

struct CacheArguments {
  HostTensor q, k, v, out, page_table, cache_lens;
  ForwardArgs args() {
    ForwardArgs result;
    result.q = q.view(), result.k = k.view(), result.v = v.view(), result.out = out.view();
    result.page_table = page_table.view(), result.cache_lens = cache_lens.view();
    return result;
  }
};

CacheArguments valid_arguments(const Problem& problem) {
  CacheArguments a{HostTensor(DType::kF32, problem.expected("q").shape),
                   HostTensor(DType::kF32, problem.expected("k").shape),
                   HostTensor(DType::kF32, problem.expected("v").shape),
                   HostTensor(DType::kF32, problem.expected("o").shape),
                   HostTensor(DType::kI32, problem.expected("page_table").shape),
                   HostTensor(DType::kI32, problem.expected("cache_lens").shape)};
  a.cache_lens.set(0, 10);  // page 3
  a.cache_lens.set(1, 20);  // pages 5, 0
  a.page_table.set(0, 3);
  a.page_table.set(16, 5);
  a.page_table.set(17, 0);
  for (std::int64_t j = 2; j < 16; ++j) a.page_table.set(16 + j, 99);  // unread
  return a;
}

TEST(KvCache, PageTablesAndLengthsAreChecked) {
  const Problem problem(valid_desc());
  const auto plan = cpu_ref().plan(problem);
  CacheArguments valid = valid_arguments(problem);
  plan->forward(valid.args());  // unread entries may hold anything

  const auto refused = [&](const std::function<void(CacheArguments&)>& change) {
    CacheArguments a = valid_arguments(problem);
    change(a);
    return error_of([&] { plan->forward(a.args()); });
  };
  EXPECT_NE(refused([](CacheArguments& a) {
              a.page_table.set(17, 8);
            }).find("page_table[1, 1] (8) is outside the pool's pages [0, 8)"),
            std::string::npos);
  EXPECT_NE(refused([](CacheArguments& a) {
              a.page_table.set(0, -1);
            }).find("page_table[0, 0] (-1) is outside"),
            std::string::npos);
  EXPECT_NE(refused([](CacheArguments& a) {
              a.cache_lens.set(1, kCapacity + 1);
            }).find("cache_lens[1] (257) must be 0 or in [2, 256]"),
            std::string::npos);
  EXPECT_NE(refused([](CacheArguments& a) {
              a.cache_lens.set(0, 1);
            }).find("cache_lens[0] (1) must be 0 or in [2, 256]"),
            std::string::npos);
  EXPECT_NE(refused([](CacheArguments& a) { a.cache_lens.set(0, -3); }).find("cache_lens[0] (-3)"),
            std::string::npos);
  EXPECT_NE(refused([](CacheArguments& a) {
              a.cache_lens = HostTensor(DType::kI64, {2});
            }).find("argument cache_lens: expected"),
            std::string::npos);
  EXPECT_NE(refused([](CacheArguments& a) {
              a.page_table = HostTensor();
            }).find("argument page_table: missing"),
            std::string::npos);
  // A cache length of 0 is an empty slot: its rows are 0, whatever its page table holds.
  CacheArguments empty = valid_arguments(problem);
  empty.cache_lens.set(0, 0);
  empty.page_table.set(0, -7);
  empty.out.set(0, 5);
  plan->forward(empty.args());
  EXPECT_EQ(empty.out.at(0), 0.0);

  // A problem without a cache takes no page table.
  ProblemDesc plain = valid_desc();
  plain.kv_cache.reset();
  plain.seq_len_kv = 4;
  const Problem plain_problem(plain);
  CacheArguments a{HostTensor(DType::kF32, plain_problem.expected("q").shape),
                   HostTensor(DType::kF32, plain_problem.expected("k").shape),
                   HostTensor(DType::kF32, plain_problem.expected("v").shape),
                   HostTensor(DType::kF32, plain_problem.expected("o").shape),
                   HostTensor(DType::kI32, {2, 16}),
                   HostTensor(DType::kI32, {2})};
  EXPECT_NE(error_of([&] {
              cpu_ref().plan(plain_problem)->forward(a.args());
            }).find("the problem has no KV cache"),
            std::string::npos);
}

// ---- the engine gate --------------------------------------------------------------------------

// An engine whose lowering accepts everything and whose plan reads K as dense rows: the gate
// alone must keep it from a cache problem.
class DenseOnlyEngine final : public Engine {
 public:
  std::string_view name() const override { return "dense_only"; }
  Support available() const override { return Support::yes(); }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    static_cast<void>(problem);
    static_cast<void>(stage);
    Lowered lowered;
    lowered.support = Support::yes();
    return lowered;
  }
};

TEST(KvCache, EnginesThatReadNoCacheAreRefusedBeforeLowering) {
  const Problem problem(valid_desc());
  const DenseOnlyEngine dense_only;
  const Support verdict = dense_only.supports(problem);
  EXPECT_FALSE(verdict.ok());
  EXPECT_EQ(verdict.reason(),
            "reads no paged KV cache (K and V as page pools through a page table)");
  EXPECT_NE(error_of([&] {
              static_cast<void>(dense_only.plan(problem));
            }).find("dense_only: reads no paged KV cache"),
            std::string::npos);
  // Of the built-in engines, cpu_ref and cpu read caches; the others say they do not.
  Context context;
  for (const Verdict& v : context.explain(problem)) {
    if (v.engine == "cpu_ref" || v.engine == "cpu") {
      EXPECT_TRUE(v.support.ok()) << v.engine;
    } else {
      EXPECT_FALSE(v.support.ok()) << v.engine;  // (or unavailable: no GPU)
    }
  }
}

// ---- the plan canary ---------------------------------------------------------------------------

// cpu's plan run on altered cache arguments: what an engine that reads the cache wrongly computes.
enum class CacheFault {
  kNone,
  kPagesInOrder,   // page j of every sequence taken as pool page j: the page table ignored
  kWholeCapacity,  // every sequence taken as full: lengths ignored, queries at the capacity's end
};

class FaultyCachePlan final : public Plan {
 public:
  FaultyCachePlan(std::unique_ptr<Plan> inner, CacheFault fault, std::string name)
      : Plan(renamed(inner->info(), std::move(name))), inner_(std::move(inner)), fault_(fault) {}
  const Problem& problem() const override { return inner_->problem(); }

 protected:
  void run_forward(const ForwardArgs& args) const override {
    const Problem& p = problem();
    HostTensor table(DType::kI32, p.expected("page_table").shape);
    HostTensor lengths(DType::kI32, p.expected("cache_lens").shape);
    std::memcpy(table.data(), args.page_table.data, table.bytes());
    std::memcpy(lengths.data(), args.cache_lens.data, lengths.bytes());
    const std::int64_t max_pages = p.kv_cache()->max_pages, pages = p.kv_cache()->pages;
    for (std::int64_t b = 0; b < p.batch(); ++b) {
      for (std::int64_t j = 0; fault_ == CacheFault::kPagesInOrder && j < max_pages; ++j) {
        table.set(b * max_pages + j, static_cast<double>(j % pages));
      }
      if (fault_ == CacheFault::kWholeCapacity) lengths.set(b, static_cast<double>(p.seq_len_kv()));
    }
    ForwardArgs altered = args;
    altered.page_table = table.view();
    altered.cache_lens = lengths.view();
    inner_->forward(altered);
  }
  void run_backward(const BackwardArgs& args) const override { inner_->backward(args); }

 private:
  static PlanInfo renamed(PlanInfo info, std::string name) {
    info.engine = std::move(name);
    return info;
  }
  std::unique_ptr<Plan> inner_;
  CacheFault fault_;
};

class FaultyCacheEngine final : public Engine {
 public:
  FaultyCacheEngine(CacheFault fault, std::string name) : fault_(fault), name_(std::move(name)) {}
  std::string_view name() const override { return name_; }
  Support available() const override { return Support::yes(); }
  bool reads_kv_cache() const override { return true; }

 protected:
  Lowered lower(const Problem& problem, Stage stage) const override {
    Lowered lowered;
    lowered.support = cpu().supports(problem);
    if (lowered.support && stage == Stage::kBuild) {
      lowered.plan = std::make_unique<FaultyCachePlan>(cpu().plan(problem), fault_, name_);
    }
    return lowered;
  }

 private:
  CacheFault fault_;
  std::string name_;
};

// The canary runs a cache plan on a cache of its own (scrambled, shared pages; lengths from the
// query count to the capacity) and compares it with cpu_ref: the faithful plan passes, each
// faulty one is refused with the canary's reason.
TEST(KvCache, TheCanaryChecksCachePlans) {
  for (const Layout layout : {Layout::kBSHD, Layout::kTHD}) {
    Geometry g = decode_batch(layout, 4, 2);
    ProblemDesc desc = cache_desc(g, 16, 23);
    apply(modifiers()[1], false, g.batch(), desc);  // ALiBi, slopes from the head index
    desc.mask_mod = ir::parse("q >= kv && q - kv < 100");
    const Problem problem(desc);
    for (const auto& [fault, name] :
         {std::pair{CacheFault::kNone, "cpu_faithful"},
          std::pair{CacheFault::kPagesInOrder, "cpu_pages_in_order"},
          std::pair{CacheFault::kWholeCapacity, "cpu_whole_capacity"}}) {
      ContextOptions options;
      options.policy.force = name;
      options.log_level = LogLevel::kOff;
      options.canary = true;
      options.extra_engines = {std::make_shared<FaultyCacheEngine>(fault, name)};
      Context context(options);
      if (fault == CacheFault::kNone) {
        EXPECT_EQ(context.select(problem)->info().engine, name);
        EXPECT_EQ(context.canary_runs(), 1u);
        continue;
      }
      const std::string reason = error_of([&] { static_cast<void>(context.select(problem)); });
      EXPECT_NE(reason.find(fmt::format("canary: engine {} computed", name)), std::string::npos)
          << to_string(layout) << " " << name << ": " << reason;
    }
  }
}

}  // namespace
}  // namespace flexattn
