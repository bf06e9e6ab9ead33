"""The PyTorch side: the custom ops flexattn::attention / flexattn::attention_backward (real and
fake implementations, autograd), and the plan cache that turns torch tensors into C++ views by
pointer and strides."""

from __future__ import annotations

from typing import Optional

import torch

from . import _flexattn as _ext

_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int32: "int32",
    torch.int64: "int64",
}
_LAYOUTS = ("bhsd", "bshd", "sbhd")

# Problem description -> selected plan (C++). The C++ Context caches plans as well; this cache
# skips building and validating the Problem on repeated calls.
_plans: dict = {}
# The forward's own key (without the output, which it allocates) -> (plan, output shape, LSE
# shape, LSE dtype, tensor names, device scratch bytes).
_forward_plans: dict = {}


def dtype_name(tensor: torch.Tensor, what: str) -> str:
    name = _DTYPES.get(tensor.dtype)
    if name is None or not tensor.is_floating_point():
        raise ValueError(f"{what} has dtype {tensor.dtype}; flexattn takes float32, float16, "
                         "bfloat16 or float64")
    return name


def parse_layout(layout: str) -> tuple[str, list, list]:
    """(name, cu_seqlens_q, cu_seqlens_kv) of a layout argument: "bhsd", "bshd", "sbhd", or
    "thd:<cu_seqlens_q>;<cu_seqlens_kv>" (comma-separated offsets; the op's constant argument)."""
    if not layout.startswith("thd:"):
        return layout, [], []
    q_text, kv_text = layout[4:].split(";")
    return "thd", [int(x) for x in q_text.split(",")], [int(x) for x in kv_text.split(",")]


def thd_layout(cu_seqlens_q, cu_seqlens_kv) -> str:
    def offsets(value, what):
        if value is None:
            raise ValueError(f"layout thd needs {what} (batch + 1 offsets starting at 0)")
        if isinstance(value, torch.Tensor):
            if value.dim() != 1 or value.is_floating_point():
                raise ValueError(f"{what} must be a 1-D integer tensor or a list of ints")
            value = value.tolist()
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise ValueError(f"{what} must hold ints")
        return ",".join(str(x) for x in value)

    q_text = offsets(cu_seqlens_q, "cu_seqlens_q")
    kv_text = q_text if cu_seqlens_kv is None else offsets(cu_seqlens_kv, "cu_seqlens_kv")
    return f"thd:{q_text};{kv_text}"


def dims(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """batch, heads, sequence lengths and head dims of q, k, v in `layout`."""
    name, cu_q, _ = parse_layout(layout)
    if name == "thd":  # sequence lengths come from the offsets (0: derived)
        return {"batch": max(len(cu_q) - 1, 1), "heads_q": q.shape[1], "heads_kv": k.shape[1],
                "seq_len_q": 0, "seq_len_kv": 0, "head_dim_qk": q.shape[2],
                "head_dim_v": v.shape[2]}
    if layout == "bhsd":
        (b, hq, sq, d), (_, hkv, skv, _), dv = q.shape, k.shape, v.shape[3]
    elif layout == "bshd":
        (b, sq, hq, d), (_, skv, hkv, _), dv = q.shape, k.shape, v.shape[3]
    else:  # sbhd
        (sq, b, hq, d), (skv, _, hkv, _), dv = q.shape, k.shape, v.shape[3]
    return {"batch": b, "heads_q": hq, "heads_kv": hkv, "seq_len_q": sq, "seq_len_kv": skv,
            "head_dim_qk": d, "head_dim_v": dv}


def out_shape(layout: str, q: torch.Tensor, v: torch.Tensor) -> tuple[list, list]:
    if layout.startswith("thd:"):
        return [q.shape[0], q.shape[1], v.shape[2]], [q.shape[1], q.shape[0]]
    d = dims(layout, q, v, v)
    b, h, s, dv = d["batch"], d["heads_q"], d["seq_len_q"], v.shape[3]
    shape = {"bhsd": [b, h, s, dv], "bshd": [b, s, h, dv], "sbhd": [s, b, h, dv]}[layout]
    return shape, [b, h, s]


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _is_dense(t: torch.Tensor) -> bool:
    """Whether the tensor's elements are distinct and cover one contiguous block (any order)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def usable(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when the engines can read it (last stride 1), else a contiguous copy."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return t.contiguous()
    return t


def view(t: torch.Tensor) -> tuple:
    strides = list(t.stride())
    if t.shape[-1] == 1:
        strides[-1] = 1  # a size-1 last axis has any stride
    return (t.data_ptr(), _DTYPES[t.dtype], list(t.shape), strides)


def _stream(t: torch.Tensor) -> int:
    if t.device.type == "cuda":
        if t.device.index not in (None, 0):
            raise ValueError(f"tensors are on {t.device}; flexattn's CUDA engines use device 0 "
                             "(set CUDA_VISIBLE_DEVICES to choose the GPU)")
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


def _names(tensor_names: str) -> list[str]:
    return tensor_names.split(",") if tensor_names else []


def select(q, k, v, out, tensors, names, score_mod, mask_mod, scale, layout, engine, backward,
           lse=None):
    """The plan for these views (from the cache when seen before). The key holds every shape,
    stride and dtype; a new forward plan checks the views (with `lse`) before it is cached, so a
    cached plan can take data pointers alone."""
    key = (score_mod, mask_mod, scale, layout, engine, backward, q.dtype, q.device.type,
           tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), tuple(v.shape), v.stride(),
           tuple(out.shape), out.stride(),
           tuple((n, t.dtype, tuple(t.shape)) for n, t in zip(names, tensors)))
    plan = _plans.get(key)
    if plan is not None:
        return plan
    problem = dims(layout, q, k, v)
    name, cu_q, cu_kv = parse_layout(layout)
    problem.update({
        "layout": name, "cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_kv, "dtype": _DTYPES[q.dtype], "scale": scale, "device": q.device.type,
        "backward": backward, "score_mod": score_mod, "mask_mod": mask_mod,
        "q_strides": view(q)[3], "k_strides": view(k)[3], "v_strides": view(v)[3],
        "o_strides": view(out)[3],
        "tensors": {n: (_DTYPES[t.dtype], list(t.shape)) for n, t in zip(names, tensors)},
    })
    plan = _ext.select(problem, engine)
    if lse is not None:
        plan.check_forward(view(q), view(k), view(v), view(out), view(lse),
                           {n: view(t) for n, t in zip(names, tensors)})
    _plans[key] = plan
    return plan


def _grad_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient for `t` with the strides the backward gives it."""
    if _is_dense(t) and t.stride(-1) == 1:
        return torch.empty_like(t)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _backward_input(t: torch.Tensor) -> torch.Tensor:
    """`t` when its gradient can share its strides (dense), else a contiguous copy."""
    if _is_dense(t) and t.stride(-1) == 1:
        return t
    return t.contiguous()


# ---- the computation (shared by the custom ops and the eager path) ---------------------------


def forward(query, key, value, tensors, tensor_names, score_mod, mask_mod, scale, layout, engine):
    """Output and LSE of the selected plan; views by pointer and strides, copies only where the
    engines cannot read a tensor as it is (docs/python.md)."""
    q, k, v = usable(query), usable(key), usable(value)
    if tensors:
        tensors = [t.contiguous() for t in tensors]
    # The output and LSE are allocated here, contiguous: their layout follows from the key.
    key_ = (score_mod, mask_mod, scale, layout, engine, q.dtype, q.device, q.shape, q.stride(),
            k.shape, k.stride(), v.shape, v.stride(), tensor_names,
            tuple((t.dtype, t.shape) for t in tensors) if tensors else ())
    entry = _forward_plans.get(key_)
    if entry is None:
        names = _names(tensor_names)
        shape, lse_shape = out_shape(layout, q, v)
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=lse_dtype(q), device=q.device)
        plan = select(q, k, v, out, tensors, names, score_mod, mask_mod, scale, layout, engine,
                      False, lse)
        workspace_bytes = plan.forward_workspace_bytes
        _forward_plans[key_] = (plan, shape, lse_shape, lse.dtype, names, workspace_bytes)
    else:
        plan, shape, lse_shape, dtype, names, workspace_bytes = entry
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=dtype, device=q.device)
    scratch = _workspace(workspace_bytes, q) if workspace_bytes else None
    plan.forward_pointers(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                          lse.data_ptr(), {n: t.data_ptr() for n, t in zip(names, tensors)},
                          _stream(q), _pointer(scratch), _size(scratch))
    del scratch  # after the call has enqueued its work
    return out, lse


def _workspace(bytes_: int, like: torch.Tensor):
    """A call's device scratch from PyTorch's caching allocator (None when it needs none). The
    caller holds it until the call has enqueued its work: the allocator then orders its reuse
    after that work on the current stream, the stream the call runs on."""
    if bytes_ == 0 or like.device.type != "cuda":
        return None
    return torch.empty(bytes_, dtype=torch.uint8, device=like.device)


def _pointer(scratch) -> int:
    return 0 if scratch is None else scratch.data_ptr()


def _size(scratch) -> int:
    return 0 if scratch is None else scratch.numel()


def backward(query, key, value, out, lse, grad_out, tensors, tensor_names, grad_names, score_mod,
             mask_mod, scale, layout, engine):
    """dq, dk, dv and the gradients of the tensors named in grad_names (in the tensors' dtype)."""
    q, k, v = (_backward_input(usable(t)) for t in (query, key, value))
    tensors = [t.contiguous() for t in tensors]
    names = _names(tensor_names)
    wanted = _names(grad_names)
    dout = grad_out.to(out.dtype)
    if dout.stride() != out.stride():
        dout = torch.empty_like(out).copy_(dout)
    dq, dk, dv = _grad_like(q), _grad_like(k), _grad_like(v)
    by_name = dict(zip(names, tensors))
    grads = {n: torch.empty(by_name[n].shape, dtype=lse_dtype(by_name[n]), device=q.device)
             for n in wanted}
    plan = select(q, k, v, out, tensors, names, score_mod, mask_mod, scale, layout, engine, True)
    scratch = _workspace(plan.backward_workspace_bytes, q)
    plan.backward(view(q), view(k), view(v), view(out), view(lse), view(dout), view(dq),
                  view(dk), view(dv), {n: view(t) for n, t in zip(names, tensors)},
                  {n: view(g) for n, g in grads.items()}, _stream(q), _pointer(scratch),
                  _size(scratch))
    del scratch  # after the call has enqueued its work
    return dq, dk, dv, [grads[n].to(by_name[n].dtype) for n in wanted]


def _wanted(tensor_names, tensors, tensor_needs) -> str:
    return ",".join(n for n, t, need in zip(_names(tensor_names), tensors, tensor_needs)
                    if need and t.is_floating_point())


# ---- a paged KV cache (forward only) --------------------------------------------------------

_cache_plans: dict = {}


def cache_shapes(layout: str, q: torch.Tensor, v: torch.Tensor) -> tuple[list, list]:
    """Output and LSE shapes of a KV cache problem: queries bshd (B, S, Hq, D) or thd (T, Hq, D),
    V a pool (pages, page_size, Hkv, Dv)."""
    if layout.startswith("thd:"):
        return [q.shape[0], q.shape[1], v.shape[3]], [q.shape[1], q.shape[0]]
    return [q.shape[0], q.shape[1], q.shape[2], v.shape[3]], [q.shape[0], q.shape[2], q.shape[1]]


def forward_kv_cache(query, key, value, page_table, cache_lens, tensors, tensor_names, score_mod,
                     mask_mod, scale, layout, engine):
    """Output and LSE of the selected plan for queries against the pools `key` and `value`
    (docs/python.md, "Paged KV cache"). The plan is cached by every shape, stride and dtype; the
    page table and lengths are checked at every call (Plan::forward)."""
    q, k, v = usable(query), usable(key), usable(value)
    for name, t in (("page_table", page_table), ("cache_lens", cache_lens)):
        if t.dtype == torch.int64 and t.numel() and (
                int(t.max()) > 2**31 - 1 or int(t.min()) < -2**31):
            raise ValueError(f"{name} holds values outside int32 (page ids and lengths are "
                             "int32)")
    page_table = page_table.to(device=q.device, dtype=torch.int32).contiguous()
    cache_lens = cache_lens.to(device=q.device, dtype=torch.int32).contiguous()
    tensors = [t.contiguous() for t in tensors] if tensors else []
    names = _names(tensor_names)
    key_ = (score_mod, mask_mod, scale, layout, engine, q.dtype, q.device, q.shape, q.stride(),
            k.shape, k.stride(), v.shape, v.stride(), tuple(page_table.shape), tensor_names,
            tuple((t.dtype, t.shape) for t in tensors))
    shape, lse_shape = cache_shapes(layout, q, v)
    plan = _cache_plans.get(key_)
    if plan is None:
        name, cu_q, _ = parse_layout(layout)
        thd = name == "thd"
        problem = {
            "batch": len(cu_q) - 1 if thd else q.shape[0], "heads_q": q.shape[-2],
            "heads_kv": k.shape[2], "seq_len_q": 0 if thd else q.shape[1], "seq_len_kv": 0,
            "head_dim_qk": q.shape[-1], "head_dim_v": v.shape[3], "layout": name,
            "cu_seqlens_q": cu_q, "cu_seqlens_kv": [],
            "kv_cache": (k.shape[0], k.shape[1], page_table.shape[-1]),
            "dtype": _DTYPES[q.dtype], "scale": scale, "device": q.device.type,
            "backward": False, "score_mod": score_mod, "mask_mod": mask_mod,
            "q_strides": view(q)[3], "k_strides": view(k)[3], "v_strides": view(v)[3],
            "tensors": {n: (_DTYPES[t.dtype], list(t.shape)) for n, t in zip(names, tensors)},
        }
        plan = _ext.select(problem, engine)
        if len(_cache_plans) >= 1024:
            _cache_plans.clear()
        _cache_plans[key_] = plan
    out = torch.empty(shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=lse_dtype(q), device=q.device)
    scratch = _workspace(plan.forward_workspace_bytes, q)
    plan.forward_pointers(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                          lse.data_ptr(), {n: t.data_ptr() for n, t in zip(names, tensors)},
                          _stream(q), _pointer(scratch), _size(scratch), page_table.data_ptr(),
                          cache_lens.data_ptr())
    del scratch  # after the call has enqueued its work
    return out, lse


# ---- the custom ops -------------------------------------------------------------------------


@torch.library.custom_op("flexattn::attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 tensors: list[torch.Tensor], tensor_names: str, score_mod: str, mask_mod: str,
                 scale: Optional[float], layout: str,
                 engine: str) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(query, key, value, tensors, tensor_names, score_mod, mask_mod, scale, layout,
                   engine)


@attention_op.register_fake
def _(query, key, value, tensors, tensor_names, score_mod, mask_mod, scale, layout, engine):
    shape, lse_shape = out_shape(layout, query, value)
    return (query.new_empty(shape),
            query.new_empty(lse_shape, dtype=lse_dtype(query)))


@torch.library.custom_op("flexattn::attention_backward", mutates_args=())
def attention_backward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                          tensors: list[torch.Tensor], tensor_names: str, grad_names: str,
                          score_mod: str, mask_mod: str, scale: Optional[float], layout: str,
                          engine: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                list[torch.Tensor]]:
    return backward(query, key, value, out, lse, grad_out, tensors, tensor_names, grad_names,
                    score_mod, mask_mod, scale, layout, engine)


@attention_backward_op.register_fake
def _(query, key, value, out, lse, grad_out, tensors, tensor_names, grad_names, score_mod,
      mask_mod, scale, layout, engine):
    by_name = dict(zip(_names(tensor_names), tensors))
    q, k, v = (usable(t) for t in (query, key, value))
    return (_grad_like(q), _grad_like(k), _grad_like(v),
            [by_name[n].new_empty(by_name[n].shape) for n in _names(grad_names)])


def _setup_context(ctx, inputs, output):
    query, key, value, tensors, tensor_names, score_mod, mask_mod, scale, layout, engine = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, *tensors)
    ctx.strings = (tensor_names, score_mod, mask_mod, scale, layout, engine)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, *tensors = ctx.saved_tensors
    tensor_names, score_mod, mask_mod, scale, layout, engine = ctx.strings
    names = _names(tensor_names)
    needs = ctx.needs_input_grad
    tensor_needs = needs[3] if isinstance(needs[3], (list, tuple)) else [needs[3]] * len(names)
    wanted = _wanted(tensor_names, tensors, tensor_needs)
    dq, dk, dv, grads = attention_backward_op(query, key, value, out, lse, grad_out, tensors,
                                              tensor_names, wanted, score_mod, mask_mod, scale,
                                              layout, engine)
    by_name = dict(zip(_names(wanted), grads))
    return dq, dk, dv, [by_name.get(n) for n in names], None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


# ---- the eager path --------------------------------------------------------------------------
# In plain eager mode (no torch.compile, no tracing or dispatch mode, plain tensors) the same
# computation runs through an autograd.Function, which skips the dispatcher's Python overhead of
# the custom op; everything else (compile, export, fake tensors, subclasses) takes the op.


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, tensor_names, score_mod, mask_mod, scale, layout,
                engine, *tensors):
        out, lse = forward(query, key, value, list(tensors), tensor_names, score_mod, mask_mod,
                           scale, layout, engine)
        ctx.save_for_backward(query, key, value, out, lse, *tensors)
        ctx.strings = (tensor_names, score_mod, mask_mod, scale, layout, engine)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse, *tensors = ctx.saved_tensors
        tensor_names, score_mod, mask_mod, scale, layout, engine = ctx.strings
        wanted = _wanted(tensor_names, tensors, ctx.needs_input_grad[9:])
        dq, dk, dv, grads = backward(query, key, value, out, lse, grad_out, tensors,
                                     tensor_names, wanted, score_mod, mask_mod, scale, layout,
                                     engine)
        by_name = dict(zip(_names(wanted), grads))
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None, None, None, None, None, None,
                *[by_name.get(n) for n in _names(tensor_names)])


def _plain(tensors) -> bool:
    return all(type(t) is torch.Tensor for t in tensors)


def attention(query, key, value, tensors, tensor_names, score_mod, mask_mod, scale, layout,
              engine):
    """(out, lse) through the eager path or the custom op (see above)."""
    if (not torch.compiler.is_compiling() and _plain((query, key, value, *tensors))
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._len_torch_function_stack()):
        if not (torch.is_grad_enabled() and (
                query.requires_grad or key.requires_grad or value.requires_grad
                or any(t.requires_grad for t in tensors))):
            return forward(query, key, value, tensors, tensor_names, score_mod, mask_mod, scale,
                           layout, engine)  # nothing to differentiate: no autograd node
        return _Attention.apply(query, key, value, tensor_names, score_mod, mask_mod, scale,
                                layout, engine, *tensors)
    return attention_op(query, key, value, tensors, tensor_names, score_mod, mask_mod, scale,
                        layout, engine)


@torch.library.custom_op("flexattn::attention_kv_cache", mutates_args=())
def attention_kv_cache_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          page_table: torch.Tensor, cache_lens: torch.Tensor,
                          tensors: list[torch.Tensor], tensor_names: str, score_mod: str,
                          mask_mod: str, scale: Optional[float], layout: str,
                          engine: str) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_kv_cache(query, key, value, page_table, cache_lens, tensors, tensor_names,
                            score_mod, mask_mod, scale, layout, engine)


@attention_kv_cache_op.register_fake
def _(query, key, value, page_table, cache_lens, tensors, tensor_names, score_mod, mask_mod,
      scale, layout, engine):
    shape, lse_shape = cache_shapes(layout, query, value)
    return query.new_empty(shape), query.new_empty(lse_shape, dtype=lse_dtype(query))


def attention_kv_cache(query, key, value, page_table, cache_lens, tensors, tensor_names,
                       score_mod, mask_mod, scale, layout, engine):
    """(out, lse) against a paged KV cache: forward only; eagerly, or through the custom op."""
    inputs = (query, key, value, *tensors)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        raise ValueError("a KV cache problem is forward only: call it under torch.no_grad() or "
                         "with tensors that do not require grad")
    if (not torch.compiler.is_compiling() and _plain((*inputs, page_table, cache_lens))
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._len_torch_function_stack()):
        return forward_kv_cache(query, key, value, page_table, cache_lens, tensors, tensor_names,
                                score_mod, mask_mod, scale, layout, engine)
    return attention_kv_cache_op(query, key, value, page_table, cache_lens, tensors,
                                 tensor_names, score_mod, mask_mod, scale, layout, engine)
