"""flexattn.attention against a paged KV cache (page_table, cache_lens): decoding and chunked
prefill compared with a float64 computation written here, the engines that read caches, the
errors, and torch.compile(fullgraph=True) over the custom op."""

import math

import pytest
import torch

import flexattn


def make_cache(lengths, heads_kv, dim, page_size, seed):
    """Pools holding each sequence's K and V in shuffled pages (unused slots NaN), the page
    table (unused entries -1) and the logical rows of each sequence."""
    g = torch.Generator().manual_seed(seed)
    max_pages = max(1, max(math.ceil(n / page_size) for n in lengths))
    used = sum(math.ceil(n / page_size) for n in lengths)
    pages = used + 2
    order = torch.randperm(pages, generator=g).tolist()
    k_pool = torch.full((pages, page_size, heads_kv, dim), float("nan"))
    v_pool = torch.full((pages, page_size, heads_kv, dim), float("nan"))
    table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    rows = []
    for b, n in enumerate(lengths):
        k = torch.randn(n, heads_kv, dim, generator=g)
        v = torch.randn(n, heads_kv, dim, generator=g)
        for s in range(n):
            if s % page_size == 0:
                table[b, s // page_size] = order.pop()
            page = int(table[b, s // page_size])
            k_pool[page, s % page_size] = k[s]
            v_pool[page, s % page_size] = v[s]
        rows.append((k, v))
    return k_pool, v_pool, table, torch.tensor(lengths, dtype=torch.int32), rows


def reference(q_rows, rows, length, score_mod, mask_mod, b, heads_q):
    """Out (new tokens, Hq, D) and LSE (Hq, new tokens) of one sequence in float64: query i is at
    position length - new + i."""
    new = q_rows.shape[0]
    k, v = rows
    group = heads_q // k.shape[1]
    out = torch.zeros(new, heads_q, v.shape[2], dtype=torch.float64)
    lse = torch.full((heads_q, new), -math.inf, dtype=torch.float64)
    for h in range(heads_q):
        for i in range(new):
            position = length - new + i
            scores = []
            for kv in range(length):
                if not mask_mod(b, h, position, kv):
                    continue
                s = (q_rows[i, h].double() @ k[kv, h // group].double()) / math.sqrt(k.shape[2])
                scores.append((kv, score_mod(s, b, h, position, kv)))
            if not scores:
                continue
            values = torch.stack([s for _, s in scores])
            weights = torch.softmax(values, 0)
            lse[h, i] = torch.logsumexp(values, 0)
            for (kv, _), w in zip(scores, weights):
                out[i, h] += w * v[kv, h // group].double()
    return out, lse


def softcap(score, b, h, q_idx, kv_idx):
    return 20 * torch.tanh(score / 20) + (kv_idx - q_idx) * 0.25 / (h + 1)


def causal_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)


def scalar_softcap(s, b, h, q, kv):
    return 20 * torch.tanh(s / 20) + (kv - q) * 0.25 / (h + 1)


def scalar_mask(b, h, q, kv):
    return q >= kv and q - kv < 40


@pytest.mark.parametrize("engine", ["cpu", "cpu_ref"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_the_float64_computation(engine, page_size):
    lengths, heads_q, heads_kv, dim = [1, 57, 0, 100], 4, 2, 16
    k_pool, v_pool, table, lens, rows = make_cache(lengths, heads_kv, dim, page_size, 3)
    q = torch.randn(len(lengths), 1, heads_q, dim, generator=torch.Generator().manual_seed(4))
    out, lse = flexattn.attention(q, k_pool, v_pool, softcap, causal_window, layout="bshd",
                                  enable_gqa=True, engine=engine, page_table=table,
                                  cache_lens=lens, return_lse=True)
    assert out.shape == (4, 1, heads_q, dim) and lse.shape == (4, heads_q, 1)
    for b, n in enumerate(lengths):
        expected_out, expected_lse = reference(q[b], rows[b], n, scalar_softcap, scalar_mask, b,
                                               heads_q)
        torch.testing.assert_close(out[b].double(), expected_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[b].double(), expected_lse, atol=2e-5, rtol=2e-5)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == -math.inf)  # the empty slot


def test_chunked_prefill_in_thd():
    lengths, new = [40, 9, 3], [5, 9, 1]
    k_pool, v_pool, table, lens, rows = make_cache(lengths, 2, 16, 8, 5)
    cu = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    q = torch.randn(15, 2, 16, generator=torch.Generator().manual_seed(6))
    out, lse = flexattn.attention(q, k_pool, v_pool, softcap, causal_window, layout="thd",
                                  cu_seqlens_q=cu, page_table=table, cache_lens=lens,
                                  return_lse=True)
    assert out.shape == (15, 2, 16) and lse.shape == (2, 15)
    for b, n in enumerate(lengths):
        first = int(cu[b])
        expected_out, expected_lse = reference(q[first:first + new[b]], rows[b], n,
                                               scalar_softcap, scalar_mask, b, 2)
        torch.testing.assert_close(out[first:first + new[b]].double(), expected_out, atol=2e-5,
                                   rtol=2e-5)
        torch.testing.assert_close(lse[:, first:first + new[b]].double(), expected_lse,
                                   atol=2e-5, rtol=2e-5)


def test_one_plan_serves_a_growing_cache():
    """The lengths are arguments of the call: decoding steps reuse the plan, and each step sees
    the tokens appended so far."""
    k_pool, v_pool, table, lens, rows = make_cache([64, 64], 1, 8, 16, 7)
    q = torch.randn(2, 1, 1, 8, generator=torch.Generator().manual_seed(8))
    for length in (1, 17, 64):
        lens = torch.tensor([length, 64], dtype=torch.int32)
        out = flexattn.attention(q, k_pool, v_pool, page_table=table, cache_lens=lens,
                                 layout="bshd", engine="cpu")
        expected, _ = reference(q[0], rows[0], length, lambda s, *_: s, lambda *_: True, 0, 1)
        torch.testing.assert_close(out[0].double(), expected, atol=2e-5, rtol=2e-5)


def test_bad_caches_are_refused():
    k_pool, v_pool, table, lens, _ = make_cache([10, 20], 2, 16, 16, 9)
    q = torch.randn(2, 1, 2, 16)
    with pytest.raises(ValueError, match="page_table.*outside the pool's pages"):
        bad = table.clone()
        bad[1, 1] = 99
        flexattn.attention(q, k_pool, v_pool, layout="bshd", page_table=bad, cache_lens=lens)
    with pytest.raises(ValueError, match=r"cache_lens\[0\] \(40\) must be 0 or in"):
        flexattn.attention(q, k_pool, v_pool, layout="bshd", page_table=table,
                           cache_lens=torch.tensor([40, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match="needs both page_table and cache_lens"):
        flexattn.attention(q, k_pool, v_pool, layout="bshd", page_table=table)
    with pytest.raises(ValueError, match="layout bshd or thd, not bhsd"):
        flexattn.attention(q, k_pool, v_pool, page_table=table, cache_lens=lens)
    with pytest.raises(ValueError, match="forward only"):
        flexattn.attention(q.requires_grad_(), k_pool, v_pool, layout="bshd", page_table=table,
                           cache_lens=lens)
    with pytest.raises(ValueError, match="page_table holds values outside int32"):
        wrapped = table.long()
        wrapped[0, 0] += 2**32  # would wrap to a valid page id
        flexattn.attention(q.detach(), k_pool, v_pool, layout="bshd", page_table=wrapped,
                           cache_lens=lens)
    with pytest.raises(ValueError, match="int32 or int64"):
        flexattn.attention(q.detach(), k_pool, v_pool, layout="bshd", page_table=table.float(),
                           cache_lens=lens)


def test_compiles_without_graph_breaks():
    k_pool, v_pool, table, lens, _ = make_cache([30, 7], 2, 16, 16, 10)
    q = torch.randn(2, 1, 4, 16)

    def step(q, k, v, table, lens):
        return flexattn.attention(q, k, v, softcap, causal_window, layout="bshd",
                                  enable_gqa=True, page_table=table, cache_lens=lens) * 2

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k_pool, v_pool, table, lens),
                               step(q, k_pool, v_pool, table, lens))
