"""CUDA tensors (bf16/fp16) against PyTorch FlexAttention on the GPU: forward, gradients, a short
training run's loss curve, CUDA-graph capture of forward+backward, streams. Skipped without a
CUDA device or without a flexattn CUDA engine that can run here."""

import pytest
import torch

import flexattn

from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def _cuda_engine_available():
    if not torch.cuda.is_available():
        return False
    return any(e["device"] == "cuda" and e["available"] for e in flexattn.engines())


pytestmark = pytest.mark.skipif(not _cuda_engine_available(),
                                reason="no CUDA device or no flexattn CUDA engine available")

_compiled_flex = None


def flex(q, k, v, score_mod=None, mask_mod=None, enable_gqa=False):
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                       device="cuda")
    return _compiled_flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                          enable_gqa=enable_gqa)


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make(shape, dtype, seed, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=dtype, generator=g).requires_grad_(grad)


def assert_close_relative(actual, expected, tolerance, name=""):
    error = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert error <= tolerance * max(scale, 1.0), f"{name}: max error {error} (scale {scale})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["softcap+causal", "alibi", "learned_bias", "document"])
def test_forward_and_gradients_match_flex_attention(dtype, case):
    b, h, s, d = 2, 8, 256, 64
    q, k, v = (make((b, h, s, d), dtype, seed, grad=True) for seed in (1, 2, 3))
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda")
    bias = make((h, s, s), dtype, 4, grad=True)
    docs = torch.repeat_interleave(torch.arange(4, device="cuda"),
                                   torch.tensor([40, 100, 16, 100], device="cuda"))
    mods = {
        "softcap+causal": (softcap, causal),
        "alibi": (lambda sc, b, h, qi, kv: sc + slopes[h] * (kv - qi), causal),
        "learned_bias": (lambda sc, b, h, qi, kv: sc + bias[h, qi, kv], None),
        "document": (None, lambda b, h, qi, kv: (docs[qi] == docs[kv]) & (qi >= kv)),
    }
    score_mod, mask_mod = mods[case]
    out = flexattn.attention(q, k, v, score_mod, mask_mod)
    expected = flex(q, k, v, score_mod, mask_mod)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert_close_relative(out, expected, tolerance, "out")
    grad_out = make(out.shape, dtype, 5)
    leaves = [q, k, v] + ([bias] if case == "learned_bias" else [])
    got = torch.autograd.grad(out, leaves, grad_out)
    want = torch.autograd.grad(expected, leaves, grad_out)
    for name, a, e in zip(["dq", "dk", "dv", "dbias"], got, want):
        assert_close_relative(a, e, 4 * tolerance, name)


def test_gqa_bf16():
    q = make((1, 8, 128, 128), torch.bfloat16, 1)
    k, v = (make((1, 2, 128, 128), torch.bfloat16, seed) for seed in (2, 3))
    out = flexattn.attention(q, k, v, softcap, causal, enable_gqa=True)
    assert_close_relative(out, flex(q, k, v, softcap, causal, enable_gqa=True), 2e-2)


class Block(torch.nn.Module):
    def __init__(self, attention, dim=128, heads=4, seq=128):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        self.bias = torch.nn.Parameter(torch.zeros(heads, seq, seq))
        self.heads, self.attention = heads, attention

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)

        def score_mod(score, b, h, q_idx, kv_idx):
            return 30 * torch.tanh(score / 30) + self.bias[h, q_idx, kv_idx]

        y = self.attention(q, k, v, score_mod)
        return self.out(y.transpose(1, 2).reshape(b, s, dim))


def train(attention, steps=30):
    torch.manual_seed(0)
    model = Block(attention).cuda().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(4, 128, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    target = torch.randn(4, 128, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    losses = []
    for _ in range(steps):
        loss = (model(x).float() - target.float()).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_training_loss_curve_matches_flex_attention():
    ours = train(lambda q, k, v, sm: flexattn.attention(q, k, v, sm))
    theirs = train(lambda q, k, v, sm: flex(q, k, v, sm))
    assert ours[-1] < ours[0]
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {a} vs {b}"


def test_cuda_graph_capture_forward_backward():
    q, k, v = (make((1, 4, 256, 64), torch.bfloat16, seed, grad=True) for seed in (1, 2, 3))
    bias = make((4, 256, 256), torch.bfloat16, 4, grad=True)

    def step():
        out = flexattn.attention(q, k, v, lambda s, b, h, qi, kv: s + bias[h, qi, kv], causal)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v, bias))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # plans, canaries and kernels before capture
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, e in zip(captured, eager):
        torch.testing.assert_close(a, e)


def test_runs_on_the_current_stream():
    q, k, v = (make((2, 4, 512, 64), torch.bfloat16, seed) for seed in (1, 2, 3))
    expected = flexattn.attention(q, k, v, softcap, causal)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = flexattn.attention(q, k, v, softcap, causal)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(out, expected)


def test_device_errors():
    q = make((1, 2, 16, 64), torch.bfloat16, 1)
    with pytest.raises(ValueError, match="one device"):
        flexattn.attention(q, q.cpu(), q.cpu())
    if torch.cuda.device_count() > 1:
        q1 = q.to("cuda:1")
        with pytest.raises(ValueError, match="device 0"):
            flexattn.attention(q1, q1, q1)
