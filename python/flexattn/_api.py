"""flexattn.attention and flexattn.explain over torch tensors: input checks, tracing, the op."""

from __future__ import annotations

import sys
import types

import torch

from . import _dynamo_compat
from . import _flexattn as _ext
from . import _torch as ops
from ._trace import TraceError, cached_trace, trace

_LAYOUTS = ("bhsd", "bshd", "sbhd", "thd")


# Arguments _check_inputs has accepted, by everything it looks at (a repeated call skips it).
_accepted: set = set()


def _check_inputs(query, key, value, layout, enable_gqa, engine, scale):
    try:
        memo = (type(query), type(key), type(value), layout, enable_gqa, engine, type(scale),
                query.dtype, key.dtype, value.dtype, query.device, key.device, value.device,
                query.shape, key.shape, value.shape)
        if memo in _accepted:
            return
    except (AttributeError, TypeError):  # not tensors, or unhashable arguments: checked below
        memo = None
    _check_inputs_now(query, key, value, layout, enable_gqa, engine, scale)
    if memo is not None:
        if len(_accepted) >= 1024:
            _accepted.clear()
        _accepted.add(memo)


def _check_arguments(query, key, value, engine, scale):
    """What every call checks of its tensors (already tensors) and options."""
    if not isinstance(engine, str):
        raise TypeError(f"engine must be a string ('auto' or an engine name), not "
                        f"{type(engine).__name__}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number or None, not {type(scale).__name__}")
    ops.dtype_name(query, "query")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key and value must have one dtype; got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query, key and value must be on one device; got {query.device}, "
                         f"{key.device}, {value.device}")
    if query.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors on {query.device}: flexattn runs on cpu and cuda")


def _check_inputs_now(query, key, value, layout, enable_gqa, engine, scale):
    if layout not in _LAYOUTS:
        raise ValueError(f"unknown layout '{layout}': one of {', '.join(_LAYOUTS)}")
    rank = 3 if layout == "thd" else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} has {t.dim()} dimensions {tuple(t.shape)}; layout {layout} "
                             f"needs {rank}")
    _check_arguments(query, key, value, engine, scale)
    d = ops.dims(layout, query, key, value)
    if d["heads_q"] != d["heads_kv"] and not enable_gqa:
        raise ValueError(f"query has {d['heads_q']} heads and key/value {d['heads_kv']}; pass "
                         "enable_gqa=True for grouped-query attention")
    if value.shape[:rank - 1] != key.shape[:rank - 1]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ outside "
                         "the head dimension")


def _captured(query, score_mod, mask_mod, tensors):
    """(score_mod text, mask_mod text, names, tensors)."""
    if torch.compiler.is_compiling():
        return _captured_compiling(score_mod, mask_mod, tensors)
    if not tensors and not callable(score_mod) and not callable(mask_mod):
        if not isinstance(score_mod or "", str) or not isinstance(mask_mod or "", str):
            trace(score_mod, mask_mod)  # raises the TypeError naming the argument
        return score_mod or "", mask_mod or "", [], []
    score_text, mask_text, names, values = cached_trace(score_mod, mask_mod, tensors)
    for name, t in zip(names, values):
        if t.device != query.device:
            raise ValueError(f"the tensor '{name}' the modifiers read is on {t.device}, query on "
                             f"{query.device}")
    return score_text, mask_text, names, values


# Under torch.compile (Dynamo), the trace runs once, at compile time, as a constant
# (assume_constant_result): Dynamo hands it each function's code, module and closure cells (the
# parts it can pass for functions defined inside the compiled code too), the trace rebuilds the
# functions from them, and returns the IR text with where each tensor it reads lives. The
# tensors are then read from those places in traced code, so they are graph inputs.


def _parts(function):
    if not callable(function):
        return function, None, 0, []
    if not isinstance(function, types.FunctionType):
        raise TraceError(f"under torch.compile, a modifier must be a Python function (def or "
                         f"lambda) or IR text, not {type(function).__name__}")
    code, module, cells = _function_parts(function)
    return code, module, len(cells), list(cells)


def _function_parts(function):
    """A Python function's code, module name and closure cells' contents."""
    cells = [cell.cell_contents for cell in function.__closure__ or ()]
    return function.__code__, function.__module__, cells


def _captured_compiling(score_mod, mask_mod, tensors):
    score_code, score_module, score_count, score_cells = _parts(score_mod)
    mask_code, mask_module, mask_count, mask_cells = _parts(mask_mod)
    given = dict(tensors or {})
    score_text, mask_text, names, paths = _constant_trace(
        score_code, score_module, score_count, mask_code, mask_module, mask_count,
        tuple(given), *score_cells, *mask_cells, *given.values())
    cells = [score_cells, mask_cells]
    modules = [score_module, mask_module]
    values = []
    for name, path in zip(names, paths):
        if path is None:
            values.append(given[name])
            continue
        kind, number, key = path[0], path[1], path[2]
        value = cells[number][key] if kind == "closure" else getattr(
            sys.modules[modules[number]], key)
        for attribute in path[3:]:
            value = value.reshape(1) if attribute == "#flat" else getattr(value, attribute)
        values.append(value)
    return score_text, mask_text, list(names), values


def _rebuild(code, module, cells):
    if not isinstance(code, types.CodeType):
        return code  # IR text or None
    closure = tuple(types.CellType(cell) for cell in cells) if cells else None
    return types.FunctionType(code, sys.modules[module].__dict__, code.co_name, None, closure)


def _constant_trace(score_code, score_module, score_count, mask_code, mask_module, mask_count,
                    tensor_names, *values):
    score_mod = _rebuild(score_code, score_module, values[:score_count])
    count = score_count + mask_count
    mask_mod = _rebuild(mask_code, mask_module, values[score_count:count])
    tensors = dict(zip(tensor_names, values[count:]))
    traced = trace(score_mod, mask_mod, tensors)
    for c in traced.captured:
        if c.path is None and not (tensors and c.name in tensors):
            raise TraceError(f"under torch.compile, the tensor '{c.name}' the modifiers read "
                             "must be reachable from the function (a closure variable, a global "
                             "or an attribute of one), or passed in tensors=")
    return (traced.score_mod, traced.mask_mod, tuple(c.name for c in traced.captured),
            tuple(c.path for c in traced.captured))


_constant_trace = torch._dynamo.assume_constant_result(_constant_trace)

# Dynamo before PyTorch 2.14 cannot read a closure of a function defined inside the compiled code
# (nor, before 2.12, pass an object to _constant_trace): _dynamo_compat answers those two calls.
if _dynamo_compat.needed(torch.__version__):
    _dynamo_compat.install(_function_parts, _constant_trace)


def _layout_argument(layout, cu_seqlens_q, cu_seqlens_kv) -> str:
    if layout == "thd":
        return ops.thd_layout(cu_seqlens_q, cu_seqlens_kv)
    if cu_seqlens_q is not None or cu_seqlens_kv is not None:
        raise ValueError(f"cu_seqlens_q/cu_seqlens_kv belong to layout thd, not {layout}")
    return layout


def _check_cache_inputs(query, key, value, page_table, cache_lens, layout, enable_gqa, engine,
                        scale, cu_seqlens_kv):
    if page_table is None or cache_lens is None:
        raise ValueError("a paged KV cache needs both page_table and cache_lens")
    if layout not in ("bshd", "thd"):
        raise ValueError(f"a KV cache takes queries in layout bshd or thd, not {layout}")
    if cu_seqlens_kv is not None:
        raise ValueError("a KV cache takes no cu_seqlens_kv: cache_lens give the lengths")
    for name, t, rank in (("query", query, 3 if layout == "thd" else 4), ("key", key, 4),
                          ("value", value, 4), ("page_table", page_table, 2),
                          ("cache_lens", cache_lens, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} has {t.dim()} dimensions {tuple(t.shape)}; a KV cache "
                             f"needs {rank}" + (" (pages, page_size, heads_kv, head_dim)"
                                                if name in ("key", "value") else ""))
    for name, t in (("page_table", page_table), ("cache_lens", cache_lens)):
        if t.dtype not in (torch.int32, torch.int64) or t.device != query.device:
            raise ValueError(f"{name} must be an int32 or int64 tensor on {query.device}; got "
                             f"{t.dtype} on {t.device}")
    _check_arguments(query, key, value, engine, scale)
    if query.shape[-2] != key.shape[2] and not enable_gqa:
        raise ValueError(f"query has {query.shape[-2]} heads and key/value {key.shape[2]}; pass "
                         "enable_gqa=True for grouped-query attention")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ outside "
                         "the head dimension")


def attention(query, key, value, score_mod=None, mask_mod=None, *, scale=None, enable_gqa=False,
              return_lse=False, engine="auto", layout="bhsd", tensors=None, cu_seqlens_q=None,
              cu_seqlens_kv=None, page_table=None, cache_lens=None):
    if page_table is not None or cache_lens is not None:
        _check_cache_inputs(query, key, value, page_table, cache_lens, layout, enable_gqa, engine,
                            scale, cu_seqlens_kv)
        layout = ops.thd_layout(cu_seqlens_q, None) if layout == "thd" else _layout_argument(
            layout, cu_seqlens_q, None)
        score_text, mask_text, names, values = _captured(query, score_mod, mask_mod, tensors)
        out, lse = ops.attention_kv_cache(query, key, value, page_table, cache_lens, values,
                                          ",".join(names), score_text, mask_text,
                                          None if scale is None else float(scale), layout,
                                          engine)
        return (out, lse) if return_lse else out
    _check_inputs(query, key, value, layout, enable_gqa, engine, scale)
    layout = _layout_argument(layout, cu_seqlens_q, cu_seqlens_kv)
    score_text, mask_text, names, values = _captured(query, score_mod, mask_mod, tensors)
    out, lse = ops.attention(query, key, value, values, ",".join(names), score_text, mask_text,
                             None if scale is None else float(scale), layout, engine)
    return (out, lse) if return_lse else out


def explain(query, key, value, score_mod=None, mask_mod=None, *, scale=None, enable_gqa=False,
            engine="auto", layout="bhsd", tensors=None, backward=None, cu_seqlens_q=None,
            cu_seqlens_kv=None):
    from . import Explanation

    _check_inputs(query, key, value, layout, enable_gqa, engine, scale)
    layout = _layout_argument(layout, cu_seqlens_q, cu_seqlens_kv)
    score_text, mask_text, names, values = _captured(query, score_mod, mask_mod, tensors)
    if backward is None:
        backward = torch.is_grad_enabled() and any(
            t.requires_grad for t in [query, key, value, *values])
    q, k, v = (ops.usable(t) for t in (query, key, value))
    shape, _ = ops.out_shape(layout, q, v)
    problem = ops.dims(layout, q, k, v)
    name, cu_q, cu_kv = ops.parse_layout(layout)
    problem.update({
        "layout": name, "cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_kv,
        "dtype": ops.dtype_name(q, "query"),
        "scale": None if scale is None else float(scale), "device": q.device.type,
        "backward": bool(backward), "score_mod": score_text, "mask_mod": mask_text,
        "q_strides": ops.view(q)[3], "k_strides": ops.view(k)[3], "v_strides": ops.view(v)[3],
        "tensors": {n: (ops.dtype_name(t, f"tensor '{n}'") if t.is_floating_point()
                        else ops._DTYPES.get(t.dtype, str(t.dtype)), list(t.shape))
                    for n, t in zip(names, values)},
    })
    return Explanation(_ext.explain(problem, engine))
