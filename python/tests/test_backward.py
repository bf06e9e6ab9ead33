"""Gradients (query, key, value and captured tensors) against attention written out in PyTorch in
float64 (PyTorch FlexAttention has no CPU backward), gradcheck, and the cpu engine's fp32
gradients."""

import pytest
import torch

import flexattn
from conftest import inputs, reference

S, H = 32, 4


def make_tensors(dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(H, S, S, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    slopes = torch.rand(H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    gate = torch.randn(H, S, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    docs = torch.tensor([0] * 9 + [1] * 14 + [2] * 9)
    return bias, slopes, gate, docs


def cases(bias, slopes, gate, docs):
    return {
        "softcap+causal": (lambda s, b, h, q, kv: 30 * torch.tanh(s / 30),
                           lambda b, h, q, kv: q >= kv),
        "softcap_small": (lambda s, b, h, q, kv: 1.5 * torch.tanh(s / 1.5), None),
        "alibi+sliding": (lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
                          lambda b, h, q, kv: (q >= kv) & (q - kv < 6)),
        "learned_bias+document": (lambda s, b, h, q, kv: s + bias[h, q, kv],
                                  lambda b, h, q, kv: docs[q] == docs[kv]),
        "gate": (lambda s, b, h, q, kv: s * torch.sigmoid(gate[h, kv]) + bias[h, q, kv], None),
    }


NAMES = ["softcap+causal", "softcap_small", "alibi+sliding", "learned_bias+document", "gate"]


@pytest.mark.parametrize("name", NAMES)
def test_gradients_fp64(name):
    bias, slopes, gate, docs = make_tensors()
    score_mod, mask_mod = cases(bias, slopes, gate, docs)[name]
    q, k, v = inputs(b=2, hq=H, sq=S, grad=True)
    leaves = [q, k, v, bias, slopes, gate]
    out, lse = flexattn.attention(q, k, v, score_mod, mask_mod, return_lse=True)
    expected_out, expected_lse = reference(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    want = torch.autograd.grad(expected_out, leaves, grad_out, allow_unused=True)
    used = 0
    for leaf_name, a, b in zip(["dq", "dk", "dv", "dbias", "dslopes", "dgate"], got, want):
        assert (a is None) == (b is None), leaf_name
        if a is not None:
            used += 1
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=leaf_name)
    assert used >= 3


def test_gradcheck_learned_bias_and_slopes():
    g = torch.Generator().manual_seed(3)
    q, k, v = inputs(b=1, hq=2, sq=6, d=4, grad=True)
    bias = torch.randn(2, 6, 6, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(2, generator=g, dtype=torch.float64, requires_grad=True)

    def function(q, k, v, bias, slopes):
        return flexattn.attention(
            q, k, v, lambda s, b, h, qi, kv: 4 * torch.tanh(s / 4) + bias[h, qi, kv]
            + slopes[h] * (kv - qi), lambda b, h, qi, kv: qi >= kv)

    assert torch.autograd.gradcheck(function, (q, k, v, bias, slopes))


def test_gqa_gradients():
    q, k, v = inputs(b=1, hq=4, hkv=2, sq=20, skv=28, grad=True)
    # 0.125: exact in float32, where PyTorch computes int tensor * Python float
    mod = lambda s, b, h, qi, kv: s - 0.125 * (h + 1) * (qi - kv).abs()  # noqa: E731
    out = flexattn.attention(q, k, v, mod, enable_gqa=True)
    expected, _ = reference(q, k, v, mod)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(expected, (q, k, v), grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_strided_and_expanded_inputs_get_dense_gradients():
    q, k, v = inputs(b=1, hq=4, sq=16, grad=True)
    # key repeated over heads with a zero stride, query as a transposed view
    k1 = k[:, :1].detach().requires_grad_()
    k_expanded = k1.expand(1, 4, 16, 16)
    q_t = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    out = flexattn.attention(q_t, k_expanded, v)
    expected, _ = reference(q_t, k_expanded, v)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q_t, k1, v), grad_out)
    want = torch.autograd.grad(expected, (q_t, k1, v), grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_cpu_engine_fp32_gradients():
    bias, slopes, gate, docs = make_tensors(torch.float32)
    q, k, v = inputs(b=1, hq=H, sq=S, dtype=torch.float32, grad=True)
    score_mod = lambda s, b, h, qi, kv: 30 * torch.tanh(s / 30) + bias[h, qi, kv]  # noqa: E731
    causal = lambda b, h, qi, kv: qi >= kv  # noqa: E731
    out = flexattn.attention(q, k, v, score_mod, causal, engine="cpu")
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    assert got[3].dtype == torch.float32
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    q64, k64, v64, bias64 = leaves64
    expected, _ = reference(q64, k64, v64,
                            lambda s, b, h, qi, kv: 30 * torch.tanh(s / 30) + bias64[h, qi, kv],
                            causal)
    want = torch.autograd.grad(expected, leaves64, grad_out.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_lse_is_not_differentiable():
    q, k, v = inputs(b=1, hq=2, sq=8, grad=True)
    out, lse = flexattn.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_integer_and_frozen_tensors_get_no_gradient():
    bias, slopes, gate, docs = make_tensors()
    bias.requires_grad_(False)
    q, k, v = inputs(b=1, hq=H, sq=S, grad=True)
    out = flexattn.attention(q, k, v, lambda s, b, h, qi, kv: s + bias[h, qi, kv]
                             + slopes[h] * docs[kv])
    out.sum().backward()
    assert bias.grad is None and slopes.grad is not None and q.grad is not None


def test_second_order_gradients_are_refused():
    q, k, v = inputs(b=1, hq=2, sq=8, grad=True)
    out = flexattn.attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()
