"""python -m flexattn.bench: flexattn against PyTorch's SDPA and FlexAttention on the same
tensors, and the Python layer's overhead per call.

    python -m flexattn.bench [--device cpu|cuda] [--dtype fp32|bf16|fp16] [--batch 1] [--heads 8]
                             [--seq 1024] [--head-dim 64] [--no-flex]

Timing: medians of --repeat calls after warm-up (CUDA: events around each call). The overhead is
the time of flexattn.attention on a one-row problem minus the time of its cached plan's forward
on the same views (the C++ call alone), for a traced Python score_mod and for IR text.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flexattn
from flexattn import _torch as ops

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _median_seconds(function, repeat: int, device: str) -> float:
    for _ in range(3):
        function()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            function()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def overhead(repeat: int = 2000, rounds: int = 5) -> dict:
    """Microseconds per call the Python layer adds on a cached plan (CPU, one query row): the
    fastest of `rounds` rounds of `repeat` calls each, for a traced score_mod/mask_mod and for IR
    text, without autograd, and for a traced one whose query requires grad (forward only)."""
    q = torch.randn(1, 1, 1, 8)
    q_grad = q.clone().requires_grad_(True)
    out, lse = torch.empty_like(q), torch.empty(1, 1, 1)
    text = flexattn.trace(_softcap, _causal)
    flexattn.attention(q, q, q, _softcap, _causal)  # builds and caches the plan
    plan = ops.select(q, q, q, out, [], [], text["score_mod"], text["mask_mod"], None, "bhsd",
                      "auto", False)
    views = [ops.view(t) for t in (q, q, q, out, lse)]

    def per_call(function) -> float:
        best = float("inf")
        for _ in range(rounds):
            for _ in range(100):
                function()
            begin = time.perf_counter()
            for _ in range(repeat):
                function()
            best = min(best, (time.perf_counter() - begin) / repeat * 1e6)
        return best

    with torch.no_grad():
        plan_us = per_call(lambda: plan.forward(*views, {}, 0))
        traced_us = per_call(lambda: flexattn.attention(q, q, q, _softcap, _causal))
        text_us = per_call(lambda: flexattn.attention(q, q, q, text["score_mod"],
                                                      text["mask_mod"]))
    autograd_us = per_call(lambda: flexattn.attention(q_grad, q, q, _softcap, _causal))
    return {"plan_forward_us": plan_us, "traced_overhead_us": traced_us - plan_us,
            "ir_text_overhead_us": text_us - plan_us,
            "traced_autograd_overhead_us": autograd_us - plan_us}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flexattn.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(_DTYPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    args = parser.parse_args(argv)
    device = args.device
    dtype = _DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    flops = 4 * args.batch * args.heads * args.seq * args.seq * args.head_dim
    print(f"device {device}, {dtype}, batch {args.batch}, heads {args.heads}, seq {args.seq}, "
          f"head_dim {args.head_dim}; forward, median of {args.repeat}")
    rows = []
    with torch.no_grad():
        rows.append(("flexattn softcap", _median_seconds(
            lambda: flexattn.attention(q, k, v, _softcap), args.repeat, device), 1.0))
        rows.append(("flexattn softcap+causal", _median_seconds(
            lambda: flexattn.attention(q, k, v, _softcap, _causal), args.repeat, device), 0.5))
        rows.append(("SDPA (no modifier)", _median_seconds(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), args.repeat,
            device), 1.0))
        if not args.no_flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            compiled = torch.compile(flex_attention)
            mask = create_block_mask(_causal, None, None, args.seq, args.seq, device=device)
            rows.append(("FlexAttention compiled softcap", _median_seconds(
                lambda: compiled(q, k, v, score_mod=_softcap), args.repeat, device), 1.0))
            rows.append(("FlexAttention compiled softcap+causal", _median_seconds(
                lambda: compiled(q, k, v, score_mod=_softcap, block_mask=mask), args.repeat,
                device), 0.5))
    unit, scale = ("TFLOP/s", 1e12) if device == "cuda" else ("GFLOP/s", 1e9)
    for name, seconds, kept in rows:
        print(f"  {name:<40} {seconds * 1e3:9.3f} ms  {flops * kept / seconds / scale:8.1f} {unit}")
    cost = overhead()
    print(f"Python layer per call on a cached plan (CPU, one row): plan.forward "
          f"{cost['plan_forward_us']:.1f} us; overhead {cost['traced_overhead_us']:.1f} us with "
          f"a traced score_mod/mask_mod, {cost['ir_text_overhead_us']:.1f} us with IR text, "
          f"{cost['traced_autograd_overhead_us']:.1f} us traced with a query that requires grad")


if __name__ == "__main__":
    main()
