"""Forward (output and LSE) against PyTorch FlexAttention in float64 on the CPU."""

import pytest
import torch

import flexattn
from conftest import flex, inputs, reference

S = 48
H = 4
generator = torch.Generator().manual_seed(1)
BIAS = torch.randn(H, S, S, generator=generator, dtype=torch.float64)
SLOPES = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)], dtype=torch.float64)
DOCS = torch.tensor([0] * 10 + [1] * 17 + [2] * 5 + [3] * 16)
TABLE = torch.randn(2 * S - 1, generator=generator, dtype=torch.float64)


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def softcap_small(score, b, h, q_idx, kv_idx):
    return 2.0 * torch.tanh(score / 2.0)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def learned_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx, kv_idx]


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + TABLE[q_idx - kv_idx + S - 1]


def gate(score, b, h, q_idx, kv_idx):
    return score * torch.sigmoid(BIAS[h, q_idx, kv_idx])


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 8)


def document(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 12) | (q_idx >= kv_idx)


def clamp_abs(score, b, h, q_idx, kv_idx):
    return torch.clamp(score, -1.0, 1.0) + torch.abs(score) * 0.5 - torch.exp(-torch.abs(score))


def where_mod(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx + kv_idx) % 3 == 0, score * 2, score - (h + b) / 4)


CASES = [
    ("softcap", softcap, None),
    ("softcap_small+causal", softcap_small, causal),
    ("alibi", alibi, None),
    ("alibi+causal", alibi, causal),
    ("learned_bias", learned_bias, None),
    ("relative_bias", relative_bias, None),
    ("gate", gate, None),
    ("causal", None, causal),
    ("sliding_window", None, sliding_window),
    ("document", None, document),
    ("prefix_lm", softcap_small, prefix_lm),
    ("clamp_abs", clamp_abs, None),
    ("where", where_mod, None),
]


@pytest.mark.parametrize("name,score_mod,mask_mod", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("engine", ["auto", "cpu_ref"])
def test_matches_flex_attention_fp64(name, score_mod, mask_mod, engine):
    q, k, v = inputs(hq=H, sq=S)
    out, lse = flexattn.attention(q, k, v, score_mod, mask_mod, return_lse=True, engine=engine)
    expected_out, expected_lse = flex(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-10)


def test_the_modifier_matters():
    # The comparison above can fail: softcap_small changes the output beyond its tolerance.
    q, k, v = inputs(hq=H, sq=S)
    out = flexattn.attention(q, k, v, softcap_small)
    plain, _ = flex(q, k, v)
    assert (out - plain).abs().max() > 1e-3


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.float16, 2e-3),
                                             (torch.bfloat16, 2e-2)])
def test_cpu_engine_dtypes(dtype, tolerance):
    q, k, v = inputs(hq=H, sq=S, dtype=dtype)
    bias = BIAS.to(dtype)
    score_mod = lambda s, b, h, qi, kv: 30 * torch.tanh(s / 30) + bias[h, qi, kv]  # noqa: E731
    out, lse = flexattn.attention(q, k, v, score_mod, causal, return_lse=True, engine="cpu")
    assert out.dtype == dtype and lse.dtype == torch.float32
    expected_out, expected_lse = flex(q.double(), k.double(), v.double(),
                                      lambda s, b, h, qi, kv: 30 * torch.tanh(s / 30)
                                      + bias.double()[h, qi, kv], causal)
    torch.testing.assert_close(out.double(), expected_out, rtol=0, atol=tolerance * 4)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=0, atol=tolerance * 4)


def test_gqa_scale_and_lengths():
    q, k, v = inputs(hq=8, hkv=2, sq=40, skv=56, d=16, dv=24)
    out, lse = flexattn.attention(q, k, v, softcap, causal, scale=0.3, enable_gqa=True,
                                  return_lse=True)
    expected_out, expected_lse = flex(q, k, v, softcap, causal, scale=0.3, enable_gqa=True)
    assert out.shape == (2, 8, 40, 24)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_layouts(layout):
    q, k, v = inputs(hq=H, sq=S)
    order = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}[layout]
    # Contiguous tensors in the layout's own order.
    ql, kl, vl = (t.permute(*order).contiguous() for t in (q, k, v))
    out = flexattn.attention(ql, kl, vl, alibi, causal, layout=layout)
    expected, _ = flex(q, k, v, alibi, causal)
    torch.testing.assert_close(out, expected.permute(*order), rtol=1e-10, atol=1e-10)


def test_strided_views_without_copies():
    # bhsd views of bshd storage, and a head-dim slice of a wider tensor: strides pass as they are.
    q, k, v = inputs(hq=H, sq=S)
    wide = torch.zeros(2, S, H, 40, dtype=torch.float64)
    wide[..., 3:19] = q.transpose(1, 2)
    q_view = wide[..., 3:19].transpose(1, 2)
    k_view = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_view.is_contiguous() and not k_view.is_contiguous()
    out = flexattn.attention(q_view, k_view, v, learned_bias, sliding_window)
    expected, _ = flex(q, k, v, learned_bias, sliding_window)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_ir_text_with_named_tensors():
    q, k, v = inputs(hq=H, sq=S)
    out = flexattn.attention(q, k, v, "score + bias[h, q, kv]", "doc[q] == doc[kv] && q >= kv",
                             tensors={"bias": BIAS, "doc": DOCS})
    expected, _ = flex(q, k, v, learned_bias, document)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_trace_gives_ir_text():
    traced = flexattn.trace(alibi, document)
    assert traced["score_mod"] == "score + SLOPES[h] * (kv - q)"
    assert traced["mask_mod"] == "DOCS[q] == DOCS[kv] && q >= kv"
    assert traced["tensors"]["SLOPES"] is SLOPES and traced["tensors"]["DOCS"] is DOCS
    # Python's int / int is a float division; // is a floor division.
    assert flexattn.trace(lambda s, b, h, q, kv: s + q / 2)["score_mod"] == "score + float(q) / 2"
    assert flexattn.trace(lambda s, b, h, q, kv: s + q // 2)["score_mod"] == "score + q / 2"
    nested = flexattn.trace(lambda s, b, h, q, kv: s + BIAS[h][q][kv])["score_mod"]
    assert nested == "score + BIAS[h, q, kv]"


def test_explain_and_engines():
    names = [e["name"] for e in flexattn.engines()]
    assert names[-2:] == ["cpu", "cpu_ref"]
    q, k, v = inputs(hq=H, sq=S)
    explanation = flexattn.explain(q, k, v, softcap, causal)
    assert explanation["score_mod"] == "tanh(score / 30) * 30"
    assert explanation["mask_mod"] == "q >= kv"
    assert explanation["selected"] == "cpu_ref"  # fp64 is the reference's alone
    assert "d score_mod / d score" in str(explanation)
    explanation = flexattn.explain(q.float(), k.float(), v.float(), learned_bias)
    assert explanation["selected"] == "cpu"
    assert explanation["derivatives_wrt_tensors"][0][0] == "BIAS[h, q, kv]"


@pytest.mark.parametrize("offsets_kv", [None, [0, 9, 30, 36]])
def test_thd_packed_sequences(offsets_kv):
    # Three sequences packed along the token axis; b is the sequence, q and kv count from its start.
    offsets_q = [0, 7, 20, 33]
    offsets = offsets_kv or offsets_q
    g = torch.Generator().manual_seed(11)
    q = torch.randn(offsets_q[-1], 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(offsets[-1], 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(offsets[-1], 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, requires_grad=True)
    score_mod = lambda s, b, h, qi, kv: s + slopes[h] * (kv - qi) - b  # noqa: E731
    out, lse = flexattn.attention(q, k, v, score_mod, causal, layout="thd", enable_gqa=True,
                                  cu_seqlens_q=offsets_q, cu_seqlens_kv=offsets_kv,
                                  return_lse=True)
    assert out.shape == (33, 4, 8) and lse.shape == (4, 33)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, slopes), grad_out)
    # The reference: each sequence alone in bhsd (b fixed to the sequence's number).
    outs, lses = [], []
    for number in range(3):
        rows = slice(offsets_q[number], offsets_q[number + 1])
        keys = slice(offsets[number], offsets[number + 1])
        one = [t[None].transpose(1, 2) for t in (q[rows], k[keys], v[keys])]
        shifted = lambda s, b, h, qi, kv, n=number: score_mod(s, b + n, h, qi, kv)  # noqa: E731
        o, l = reference(*one, shifted, causal)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    expected, expected_lse = torch.cat(outs), torch.cat(lses, dim=1)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-10)
    want = torch.autograd.grad(expected, (q, k, v, slopes), grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_thd_needs_offsets():
    q = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="layout thd needs cu_seqlens_q"):
        flexattn.attention(q, q, q, layout="thd")
    with pytest.raises(ValueError, match=r"argument q: expected fp32\[9, 2, 8\]"):
        flexattn.attention(q, q, q, layout="thd", cu_seqlens_q=[0, 4, 9])  # 9 != 10 tokens
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        flexattn.attention(q, q, q, layout="thd", cu_seqlens_q=[1, 4, 10])
    with pytest.raises(ValueError, match="belong to layout thd"):
        flexattn.attention(q[None], q[None], q[None], cu_seqlens_q=[0, 10])
