"""Shared helpers: the modifiers of the tests (flexattn's catalogue written as Python functions),
PyTorch FlexAttention on the CPU, and an eager float64 reference with autograd (FlexAttention has
no CPU backward)."""

import pytest
import torch

from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def flex(query, key, value, score_mod=None, mask_mod=None, scale=None, enable_gqa=False):
    """PyTorch FlexAttention (eager, CPU): output and LSE."""
    block_mask = None
    if mask_mod is not None:
        b, h, sq, _ = query.shape
        block_mask = create_block_mask(mask_mod, b, h, sq, key.shape[2], device="cpu")
    return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                          scale=scale, enable_gqa=enable_gqa, return_lse=True)


def reference(query, key, value, score_mod=None, mask_mod=None, scale=None):
    """Attention written out in PyTorch (the same score_mod/mask_mod on broadcast indices), for
    gradients: output and LSE, differentiable in everything."""
    b, hq, sq, d = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    if hkv != hq:
        key = key.repeat_interleave(hq // hkv, dim=1)
        value = value.repeat_interleave(hq // hkv, dim=1)
    scale = d ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-1, -2)) * scale
    bi = torch.arange(b)[:, None, None, None]
    hi = torch.arange(hq)[None, :, None, None]
    qi = torch.arange(sq)[None, None, :, None]
    ki = torch.arange(skv)[None, None, None, :]
    if score_mod is not None:
        scores = score_mod(scores, bi, hi, qi, ki)
    if mask_mod is not None:
        keep = torch.broadcast_to(mask_mod(bi, hi, qi, ki), scores.shape)
        scores = torch.where(keep, scores, -float("inf"))
    return torch.softmax(scores, dim=-1) @ value, torch.logsumexp(scores, dim=-1)


def inputs(b=2, hq=4, hkv=None, sq=48, skv=None, d=16, dv=None, dtype=torch.float64, seed=0,
           grad=False):
    generator = torch.Generator().manual_seed(seed)
    hkv, skv, dv = hkv or hq, skv or sq, dv or d

    def make(*shape):
        t = torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)
        return t.requires_grad_(grad)

    return make(b, hq, sq, d), make(b, hkv, skv, d), make(b, hkv, skv, dv)


@pytest.fixture
def seeded():
    torch.manual_seed(0)
