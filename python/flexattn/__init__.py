"""flexattn for PyTorch: attention with score modifiers and masks written as Python functions.

    import flexattn
    out = flexattn.attention(q, k, v, score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30),
                             mask_mod=lambda b, h, q, kv: q >= kv)

The modifiers are traced once into flexattn's IR; every engine (cuda, cudnn, cpu, cpu_ref) proves
it computes exactly that function before it runs. docs/python.md describes the API.
"""

from __future__ import annotations

from ._flexattn import Error, NoEngineError, __version__
from . import _flexattn as _ext
from ._trace import TraceError

__all__ = ["attention", "explain", "engines", "trace", "Error", "NoEngineError", "TraceError",
           "__version__"]


def engines() -> list[dict]:
    """Every engine of this build in preference order: name, device, available (and the reason
    when not), allowed by FLEXATTN_ENGINES (and the pattern that denies it)."""
    return _ext.engines()


def trace(score_mod=None, mask_mod=None, tensors=None) -> dict:
    """The IR text flexattn makes of score_mod/mask_mod and the tensors they read, by IR name."""
    from ._trace import trace as _trace

    result = _trace(score_mod, mask_mod, tensors)
    return {"score_mod": result.score_mod, "mask_mod": result.mask_mod,
            "tensors": {c.name: c.tensor for c in result.captured}}


def attention(query, key, value, score_mod=None, mask_mod=None, *, scale=None,
              enable_gqa=False, return_lse=False, engine="auto", layout="bhsd", tensors=None,
              cu_seqlens_q=None, cu_seqlens_kv=None, page_table=None, cache_lens=None):
    """Scaled-dot-product attention with a score modifier and a mask (torch tensors).

    Shaped like torch.nn.attention.flex_attention.flex_attention: query (B, Hq, Sq, D), key
    (B, Hkv, Skv, D), value (B, Hkv, Skv, Dv) in the default layout "bhsd" ("bshd" and "sbhd"
    too; "thd": packed sequences (T, H, D) with offsets cu_seqlens_q/cu_seqlens_kv).
    score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx) are Python
    functions (traced into the IR) or IR text; `tensors` names the tensors IR text reads.
    Returns the output (like query, with Dv) and, with return_lse, the log-sum-exp (B, Hq, Sq;
    thd: Hq, T).

    With page_table (int, (B, max_pages)) and cache_lens (int, (B,)), key and value are a paged
    KV cache, pools (pages, page_size, Hkv, D), and the queries (layout "bshd" or "thd") are the
    last tokens of each sequence, at positions cache_lens[b] - new tokens + i (q_idx); forward
    only (docs/python.md, "Paged KV cache").
    """
    from . import _api

    return _api.attention(query, key, value, score_mod, mask_mod, scale=scale,
                          enable_gqa=enable_gqa, return_lse=return_lse, engine=engine,
                          layout=layout, tensors=tensors, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_kv=cu_seqlens_kv, page_table=page_table,
                          cache_lens=cache_lens)


def explain(query, key, value, score_mod=None, mask_mod=None, *, scale=None, enable_gqa=False,
            engine="auto", layout="bhsd", tensors=None, backward=None, cu_seqlens_q=None,
            cu_seqlens_kv=None) -> "Explanation":
    """What flexattn makes of this call, like `flexattn explain`: the canonical modifiers, their
    hash and derivatives, and every engine's verdict (nothing runs). backward: None asks for
    gradients when an input requires grad."""
    from . import _api

    return _api.explain(query, key, value, score_mod, mask_mod, scale=scale,
                        enable_gqa=enable_gqa, engine=engine, layout=layout, tensors=tensors,
                        backward=backward, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv)


class Explanation(dict):
    """explain()'s answer: a dict (problem, score_mod, mask_mod, scale, modifier_hash,
    derivative_wrt_score, derivatives_wrt_tensors, engines, selected) that prints like the CLI."""

    def __str__(self) -> str:
        lines = [f"problem        {self['problem']}",
                 f"score_mod      {self['score_mod']}",
                 f"mask_mod       {self['mask_mod']}",
                 f"modifier hash  {self['modifier_hash']} (score_mod, mask_mod and scale "
                 f"{self['scale']})",
                 f"d score_mod / d score: {self['derivative_wrt_score']}"]
        for load, derivative in self["derivatives_wrt_tensors"]:
            lines.append(f"d score_mod / d {load}: {derivative}")
        lines.append("engines, in preference order (* = selected):")
        width = max((len(e["name"]) for e in self["engines"]), default=0)
        for e in self["engines"]:
            text = "supported" if e["supported"] else "no: " + e["reason"]
            if not e["allowed"]:
                text += "; " + e["policy"]
            mark = "*" if e["name"] == self["selected"] else " "
            lines.append(f"  {mark} {e['name']:<{width}}  {text}")
        if self["selected"] is None:
            lines.append("no engine can run this problem")
        return "\n".join(lines)
