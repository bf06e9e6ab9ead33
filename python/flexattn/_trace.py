"""Tracing score_mod / mask_mod Python functions into flexattn's modifier IR.

The function is called once with proxy values (``Value``) standing for ``score``, ``b``, ``h``,
``q_idx`` and ``kv_idx``. Every operation on a proxy builds an IR node through the C++ builder
(which type-checks it); torch functions reach the proxies through ``__torch_function__``.
Tensors the function indexes with proxies (``bias[h, q_idx, kv_idx]``) become named tensor
loads; the trace records where each one was found (closure cell, global, attribute) so callers
can pass the same tensors as inputs. Anything the IR cannot express raises ``TraceError`` naming
the construct and the line of the user's code.
"""

from __future__ import annotations

import keyword
import linecache
import math
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from . import _flexattn as _ext

__all__ = ["TraceError", "Trace", "trace"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# Names the IR text reserves: leaves, functions and literals. A captured tensor is never named
# like one of these.
_RESERVED = {
    "score", "b", "h", "q", "kv", "Q_LEN", "KV_LEN", "inf", "nan", "true", "false",
    "where", "min", "max", "clamp", "abs", "exp", "exp2", "log", "log2", "sqrt", "rsqrt",
    "tanh", "sigmoid", "floor", "float", "int",
}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


class TraceError(ValueError):
    """A score_mod/mask_mod uses something flexattn's modifier IR cannot express."""


def _user_location() -> str:
    """'file:line: source' of the innermost frame outside flexattn and torch."""
    torch_dir = os.path.dirname(os.path.abspath(_torch().__file__)) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        inside = filename.startswith(_PACKAGE_DIR + os.sep) or filename.startswith(torch_dir)
        if not inside:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            return f"{where}: {line}" if line else where
        frame = frame.f_back
    return "<unknown location>"


def _fail(construct: str) -> "NoReturn":  # noqa: F821
    raise TraceError(f"cannot trace {construct} (at {_user_location()})")


# ---- values ---------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


class Value:
    """A traced value: an IR expression of type f32, i32 or bool."""

    __slots__ = ("expr", "tracer")

    def __init__(self, expr: Any, tracer: "_Tracer") -> None:
        self.expr = expr
        self.tracer = tracer

    @property
    def type(self) -> str:
        return self.expr.type

    def __repr__(self) -> str:
        return f"flexattn traced value {self.expr} ({self.expr.type})"

    # Python control flow and conversions need a concrete value: not expressible.
    def __bool__(self):
        _fail("Python control flow on a traced value (if/while/and/or/not/bool(); use "
              "torch.where, &, |, ~)")

    def __int__(self):
        _fail("int() of a traced value (a data-dependent Python number)")

    def __float__(self):
        _fail("float() of a traced value (a data-dependent Python number)")

    def __index__(self):
        _fail("a traced value used as a Python index or size (data-dependent)")

    def __iter__(self):
        _fail("iteration over a traced value")

    def __len__(self):
        _fail("len() of a traced value")

    def __getitem__(self, index):
        _fail("indexing a traced value (index captured tensors instead: bias[h, q_idx, kv_idx])")

    def __setitem__(self, index, value):
        _fail("item assignment on a traced value")

    def item(self):
        _fail(".item() of a traced value (data-dependent)")

    def tolist(self):
        _fail(".tolist() of a traced value (data-dependent)")

    __hash__ = None

    # Arithmetic.
    def __add__(self, other): return self.tracer.op("add", self, other, name="+")
    def __radd__(self, other): return self.tracer.op("add", other, self, name="+")
    def __sub__(self, other): return self.tracer.op("sub", self, other, name="-")
    def __rsub__(self, other): return self.tracer.op("sub", other, self, name="-")
    def __mul__(self, other): return self.tracer.op("mul", self, other, name="*")
    def __rmul__(self, other): return self.tracer.op("mul", other, self, name="*")
    def __truediv__(self, other): return self.tracer.true_divide(self, other)
    def __rtruediv__(self, other): return self.tracer.true_divide(other, self)
    def __floordiv__(self, other): return self.tracer.floor_divide(self, other)
    def __rfloordiv__(self, other): return self.tracer.floor_divide(other, self)
    def __mod__(self, other): return self.tracer.op("mod", self, other, name="%")
    def __rmod__(self, other): return self.tracer.op("mod", other, self, name="%")
    def __pow__(self, other): return self.tracer.power(self, other)
    def __rpow__(self, other): _fail("a number raised to a traced power (**)")
    def __neg__(self): return self.tracer.op("neg", self, name="unary -")
    def __pos__(self): return self
    def __abs__(self): return self.tracer.op("abs", self, name="abs")

    # Comparisons.
    def __lt__(self, other): return self.tracer.op("lt", self, other, name="<")
    def __le__(self, other): return self.tracer.op("le", self, other, name="<=")
    def __gt__(self, other): return self.tracer.op("gt", self, other, name=">")
    def __ge__(self, other): return self.tracer.op("ge", self, other, name=">=")
    def __eq__(self, other): return self.tracer.op("eq", self, other, name="==")
    def __ne__(self, other): return self.tracer.op("ne", self, other, name="!=")

    # Logic (bool values only: the IR has no bitwise integer operations).
    def __and__(self, other): return self.tracer.logic("and", self, other, name="&")
    def __rand__(self, other): return self.tracer.logic("and", other, self, name="&")
    def __or__(self, other): return self.tracer.logic("or", self, other, name="|")
    def __ror__(self, other): return self.tracer.logic("or", other, self, name="|")
    def __xor__(self, other): return self.tracer.logic("ne", self, other, name="^")
    def __rxor__(self, other): return self.tracer.logic("ne", other, self, name="^")
    def __invert__(self): return self.tracer.logic("not", self, name="~")

    # Tensor-style methods.
    def tanh(self): return self.tracer.op("tanh", self, name="tanh")
    def exp(self): return self.tracer.op("exp", self, name="exp")
    def exp2(self): return self.tracer.op("exp2", self, name="exp2")
    def log(self): return self.tracer.op("log", self, name="log")
    def log2(self): return self.tracer.op("log2", self, name="log2")
    def sqrt(self): return self.tracer.op("sqrt", self, name="sqrt")
    def rsqrt(self): return self.tracer.op("rsqrt", self, name="rsqrt")
    def sigmoid(self): return self.tracer.op("sigmoid", self, name="sigmoid")
    def abs(self): return self.tracer.op("abs", self, name="abs")
    def floor(self): return self.tracer.op("floor", self, name="floor")
    def neg(self): return self.tracer.op("neg", self, name="neg")
    def float(self): return self.tracer.to_type(self, "f32")
    def double(self): return self.tracer.to_type(self, "f32")
    def half(self): return self.tracer.to_type(self, "f32")
    def bfloat16(self): return self.tracer.to_type(self, "f32")
    def int(self): return self.tracer.to_type(self, "i32")
    def long(self): return self.tracer.to_type(self, "i32")
    def bool(self): return self.tracer.to_type(self, "bool")
    def to(self, *args, **kwargs): return self.tracer.to(self, *args, **kwargs)
    def type_as(self, other): return self.tracer.to_type(self, self.tracer.lift(other).type)
    def clamp(self, min=None, max=None): return self.tracer.clamp(self, min, max)
    clip = clamp
    def clamp_min(self, min): return self.tracer.clamp(self, min, None)
    def clamp_max(self, max): return self.tracer.clamp(self, None, max)
    def div(self, other, rounding_mode=None):
        if rounding_mode is None:
            return self.tracer.true_divide(self, other)
        if rounding_mode == "floor":
            return self.tracer.floor_divide(self, other)
        _fail(f"division with rounding_mode={rounding_mode!r}")
    def minimum(self, other): return self.tracer.op("min", self, other, name="minimum")
    def maximum(self, other): return self.tracer.op("max", self, other, name="maximum")
    def where(self, condition, other): return self.tracer.where(condition, self, other)
    def logical_and(self, other): return self.tracer.logic("and", self, other, name="logical_and")
    def logical_or(self, other): return self.tracer.logic("or", self, other, name="logical_or")
    def logical_not(self): return self.tracer.logic("not", self, name="logical_not")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocol probes (numpy's __array_ufunc__, ...)
            raise AttributeError(name)
        _fail(f"attribute or method '.{name}' of a traced value (not in flexattn's IR)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = None
        for arg in list(args) + list((kwargs or {}).values()):
            if isinstance(arg, (Value, TensorSlice)):
                tracer = arg.tracer
                break
            if isinstance(arg, (list, tuple)):
                for item in arg:
                    if isinstance(item, (Value, TensorSlice)):
                        tracer = item.tracer
        if tracer is None:
            return NotImplemented
        return tracer.torch_function(func, args, kwargs or {})


class TensorSlice:
    """A captured tensor indexed with fewer indices than its rank (bias[h] before [q, kv])."""

    __slots__ = ("tensor", "indices", "tracer")

    def __init__(self, tensor, indices, tracer) -> None:
        self.tensor = tensor
        self.indices = indices
        self.tracer = tracer

    def __getitem__(self, index):
        return self.tracer.index(self.tensor, self.indices, index)

    def __bool__(self):
        _fail("Python control flow on a partly indexed tensor")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        _fail(f"'.{name}' of a partly indexed tensor (index every dimension first)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return Value.__torch_function__(func, types, args, kwargs)


# ---- the tracer -----------------------------------------------------------------------------


@dataclass
class Captured:
    """A tensor a modifier reads: its IR name, the tensor, and where the function finds it."""

    name: str
    tensor: Any
    # ("closure", function index, cell index, attribute names...) or ("global", function index,
    # global name, attribute names...); None when it is reachable from neither.
    path: tuple | None


@dataclass
class Trace:
    score_mod: str  # IR text, "" for none
    mask_mod: str
    captured: list[Captured] = field(default_factory=list)


def _dtype_kind(tensor) -> str:
    torch = _torch()
    if tensor.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return "float"
    if tensor.dtype in (torch.int32, torch.int64):
        return "int"
    return ""


def _find_path(functions: list, tensor) -> tuple[tuple | None, str | None]:
    """Where `tensor` is reachable from the traced functions, and a name for it."""
    torch = _torch()
    for number, function in enumerate(functions):
        if function is None or not hasattr(function, "__code__"):
            continue
        code = function.__code__
        attributes = [name for name in code.co_names]
        roots = []
        for index, name in enumerate(code.co_freevars):
            try:
                roots.append((("closure", number, index), name,
                              function.__closure__[index].cell_contents))
            except ValueError:  # an empty cell
                continue
        for name in code.co_names:
            if name in function.__globals__:
                roots.append((("global", number, name), name, function.__globals__[name]))
        for path, name, value in roots:
            if value is tensor:
                return path, name
        # One attribute level (self.bias, module.slopes), and a second (self.attn.bias).
        for path, name, value in roots:
            if isinstance(value, (int, float, str, bool, torch.Tensor)) or value is None:
                continue
            for attribute in attributes:
                inner = getattr(value, attribute, None) if _safe_attr(value, attribute) else None
                if inner is tensor:
                    return path + (attribute,), attribute
                if inner is None or isinstance(inner, (int, float, str, bool, torch.Tensor)):
                    continue
                for second in attributes:
                    if _safe_attr(inner, second) and getattr(inner, second, None) is tensor:
                        return path + (attribute, second), second
    return None, None


def _safe_attr(value, name: str) -> bool:
    try:
        return hasattr(value, name) and not callable(getattr(value, name))
    except Exception:  # properties that raise
        return False


def fetch(functions: list, path: tuple):
    """The object at `path` (from Captured.path), read from the functions as they are now."""
    kind, number, key = path[0], path[1], path[2]
    function = functions[number]
    if kind == "closure":
        value = function.__closure__[key].cell_contents
    else:
        value = function.__globals__[key]
    for attribute in path[3:]:
        value = value.reshape(1) if attribute == "#flat" else getattr(value, attribute)
    return value


class _Tracer:
    def __init__(self, functions: list, tensor_names: dict | None = None) -> None:
        self.functions = functions
        self.captured: list[Captured] = []
        self.names: set[str] = set()
        self.registered: dict[int, Captured] = {}
        self.keep_alive: list = []  # ids in `registered` stay unique while tracing
        # Tensors given by name (IR text users): id -> name.
        self.given = {id(t): n for n, t in (tensor_names or {}).items()}

    # Leaves and literals.
    def leaf(self, name: str) -> Value:
        return Value(_ext.leaf(name), self)

    def lift(self, value) -> Value:
        torch = _torch()
        if isinstance(value, Value):
            return value
        if isinstance(value, TensorSlice):
            _fail(f"a tensor indexed in {len(value.indices)} of its {value.tensor.dim()} "
                  "dimensions used as a value")
        if isinstance(value, bool):
            return Value(_ext.literal_bool(value), self)
        if isinstance(value, int):
            if not _I32_MIN <= value <= _I32_MAX:
                _fail(f"the integer {value} (outside the IR's int32 range)")
            return Value(_ext.literal_i32(value), self)
        if isinstance(value, float):
            return Value(_ext.literal_f32(value), self)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                _fail(f"a captured tensor of shape {tuple(value.shape)} used without indices "
                      "(index it with b, h, q_idx, kv_idx)")
            return self.load(value.reshape(1) if value.dim() != 1 else value, [0], original=value)
        if hasattr(value, "dtype") and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            return self.lift(value.item())  # numpy scalars
        _fail(f"a value of type {type(value).__name__}")

    def checked(self, function: Callable, name: str):
        try:
            return function()
        except TraceError:
            raise
        except ValueError as error:
            raise TraceError(f"cannot trace {name}: {error} (at {_user_location()})") from None

    def op(self, op: str, *operands, name: str | None = None):
        values = [self.lift(v) for v in operands]
        label = f"'{name or op}' on {', '.join(v.type for v in values)}"
        return Value(self.checked(lambda: _ext.operation(op, [v.expr for v in values]), label),
                     self)

    def logic(self, op: str, *operands, name: str | None = None):
        values = [self.lift(v) for v in operands]
        if any(v.type != "bool" for v in values):
            _fail(f"'{name}' on {', '.join(v.type for v in values)} (the IR's logic takes bool; "
                  "there are no bitwise integer operations)")
        return self.op(op, *values, name=name)

    def to_type(self, value, target: str) -> Value:
        value = self.lift(value)
        if value.type == target:
            return value
        if target == "f32":
            if value.type == "bool":
                return self.where(value, 1.0, 0.0)
            return self.op("float", value, name="float")
        if target == "i32":
            if value.type == "bool":
                return self.where(value, 1, 0)
            return self.op("int", value, name="int")
        return self.op("ne", value, 0 if value.type == "i32" else 0.0, name="bool")

    def to(self, value, *args, **kwargs):
        torch = _torch()
        dtype = kwargs.get("dtype")
        for arg in args:
            if isinstance(arg, torch.dtype):
                dtype = arg
        if dtype is None:
            return value
        if dtype.is_floating_point:
            return self.to_type(value, "f32")
        if dtype == torch.bool:
            return self.to_type(value, "bool")
        if dtype in (torch.int32, torch.int64, torch.int16, torch.int8):
            return self.to_type(value, "i32")
        _fail(f".to({dtype})")

    def true_divide(self, a, b) -> Value:
        a, b = self.lift(a), self.lift(b)
        if a.type == "i32" and b.type == "i32":  # Python and torch: int / int is a float
            a = self.to_type(a, "f32")
        return self.op("div", a, b, name="/")

    def floor_divide(self, a, b) -> Value:
        a, b = self.lift(a), self.lift(b)
        if a.type == "i32" and b.type == "i32":
            return self.op("div", a, b, name="//")
        return self.op("floor", self.op("div", a, b, name="//"), name="//")

    def power(self, base, exponent) -> Value:
        base = self.lift(base)
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float)):
            _fail("** with a traced or non-numeric exponent")
        if exponent == 0.5:
            return self.op("sqrt", base, name="** 0.5")
        if exponent == -0.5:
            return self.op("rsqrt", base, name="** -0.5")
        if float(exponent).is_integer() and 1 <= exponent <= 8:
            result = base
            for _ in range(int(exponent) - 1):
                result = self.op("mul", result, base, name="**")
            return result
        _fail(f"** {exponent} (only 0.5, -0.5 and integers 1..8 are expressible)")

    def where(self, condition, a, b) -> Value:
        condition = self.lift(condition)
        if condition.type != "bool":
            _fail(f"torch.where with a {condition.type} condition (needs bool)")
        return self.op("where", condition, a, b, name="where")

    def clamp(self, value, low, high) -> Value:
        if low is None and high is None:
            _fail("clamp without bounds")
        if low is None:
            return self.op("min", value, high, name="clamp")
        if high is None:
            return self.op("max", value, low, name="clamp")
        return self.op("clamp", value, low, high, name="clamp")

    # Captured tensors.
    def tensor_name(self, tensor, path_name: str | None) -> str:
        base = self.given.get(id(tensor)) or path_name or "tensor"
        if not _IDENTIFIER.match(base) or base in _RESERVED or keyword.iskeyword(base):
            base = f"{base}_t" if _IDENTIFIER.match(base) else "tensor"
        name, number = base, 1
        while name in self.names:
            name = f"{base}{number}"
            number += 1
        return name

    def register(self, tensor, original=None) -> Captured:
        probe = original if original is not None else tensor
        if id(probe) in self.registered:
            return self.registered[id(probe)]
        kind = _dtype_kind(tensor)
        if not kind:
            _fail(f"a captured tensor of dtype {tensor.dtype} (flexattn loads float32, float16, "
                  "bfloat16, float64, int32 or int64 tensors; convert it outside the function)")
        path, path_name = _find_path(self.functions, probe)
        if original is not None and path is not None:
            path = path + ("#flat",)
        name = self.tensor_name(probe, path_name)
        self.names.add(name)
        captured = Captured(name, tensor, path)
        self.captured.append(captured)
        self.registered[id(probe)] = captured
        self.keep_alive.append(probe)
        return captured

    def load(self, tensor, indices, original=None) -> Value:
        captured = self.register(tensor, original)
        exprs = []
        for index in indices:
            if isinstance(index, (Value,)):
                if index.type != "i32":
                    _fail(f"a tensor index of type {index.type} (indices are int32: b, h, q_idx, "
                          "kv_idx and integer arithmetic on them)")
                exprs.append(index.expr)
            else:
                exprs.append(self.lift(index).expr)
        is_float = _dtype_kind(tensor) == "float"
        return Value(self.checked(lambda: _ext.load(captured.name, is_float, exprs),
                                  f"the load {captured.name}[...]"), self)

    def index(self, tensor, done: list, index) -> Value | TensorSlice:
        items = list(index) if isinstance(index, tuple) else [index]
        for item in items:
            if item is None or item is Ellipsis or isinstance(item, slice):
                _fail("slicing a captured tensor (index it with one integer value per dimension)")
            if isinstance(item, bool) or not isinstance(item, (Value, int)):
                if not (hasattr(item, "__index__") and not isinstance(item, Value)):
                    _fail(f"a tensor index of type {type(item).__name__}")
        indices = done + items
        if len(indices) > tensor.dim():
            _fail(f"{len(indices)} indices into a tensor of {tensor.dim()} dimensions")
        if len(indices) < tensor.dim():
            return TensorSlice(tensor, indices, self)
        return self.load(tensor, indices)

    def torch_function(self, func, args, kwargs):
        handler = _handlers().get(func)
        if handler is None:
            name = getattr(func, "__name__", None) or repr(func)
            qualname = getattr(func, "__qualname__", "") or ""
            if qualname.startswith(("TensorBase.", "_TensorBase.", "Tensor.")):
                spelled = f"Tensor.{name}"
            else:
                module = getattr(func, "__module__", None) or "torch"
                if module.startswith("torch._C") or module == "torch._VariableFunctions":
                    module = "torch"
                spelled = f"{module}.{name}"
            _fail(f"{spelled} (not in flexattn's IR)")
        return handler(self, *args, **kwargs)


def _handlers() -> dict:
    global _HANDLERS
    if _HANDLERS is not None:
        return _HANDLERS
    torch = _torch()
    T = torch.Tensor

    # Handlers take exactly the arguments they trace: an extra one (torch.add's alpha, an out=)
    # would change the meaning, so it is refused rather than ignored.
    def exact(function, spelling):
        def handler(tracer, *args, **kwargs):
            try:
                return function(tracer, *args, **kwargs)
            except TypeError:
                _fail(f"{spelling} with these arguments (flexattn traces {spelling}"
                      f"{function.__doc__ or ''})")
        return handler

    def unary(op):
        def function(tracer, x):
            """(x)"""
            return tracer.op(op, x, name=op)
        return exact(function, op)

    def binary(op, spelling):
        def function(tracer, a, b):
            """(a, b)"""
            return tracer.op(op, a, b, name=spelling)
        return exact(function, spelling)

    def logic(op, spelling):
        def function(tracer, *args):
            return tracer.logic(op, *args, name=spelling)
        return exact(function, spelling)

    def divide(tracer, a, b, *, rounding_mode=None):
        if rounding_mode is None:
            return tracer.true_divide(a, b)
        if rounding_mode == "floor":
            return tracer.floor_divide(a, b)
        _fail(f"division with rounding_mode={rounding_mode!r}")

    def clamp(tracer, x, min=None, max=None):
        return tracer.clamp(x, min, max)

    def full_like(tracer, x, value, *, dtype=None):
        literal = tracer.lift(value)
        return literal if dtype is None else tracer.to(literal, dtype)

    def like(value):
        def function(tracer, x, *, dtype=None):
            literal = tracer.to_type(tracer.lift(value), tracer.lift(x).type)
            return literal if dtype is None else tracer.to(literal, dtype)
        return function

    def minmax(op):
        def handler(tracer, a, b=None, *rest, **kw):
            if b is None or rest or kw:
                _fail(f"torch.{op} as a reduction (flexattn traces only element-wise {op}(a, b))")
            return tracer.op(op, a, b, name=op)
        return handler

    def getitem(tracer, tensor, index):
        if isinstance(tensor, (Value, TensorSlice)):
            return tensor[index]
        return tracer.index(tensor, [], index)

    def tensor_method(op):
        # Tensor.__add__(tensor, value) with a captured tensor on the left.
        return lambda tracer, a, b, **kw: tracer.op(op, a, b, name=op)

    handlers = {
        torch.tanh: unary("tanh"), T.tanh: unary("tanh"),
        torch.exp: unary("exp"), T.exp: unary("exp"),
        torch.exp2: unary("exp2"), T.exp2: unary("exp2"),
        torch.log: unary("log"), T.log: unary("log"),
        torch.log2: unary("log2"), T.log2: unary("log2"),
        torch.sqrt: unary("sqrt"), T.sqrt: unary("sqrt"),
        torch.rsqrt: unary("rsqrt"), T.rsqrt: unary("rsqrt"),
        torch.sigmoid: unary("sigmoid"), T.sigmoid: unary("sigmoid"),
        torch.abs: unary("abs"), T.abs: unary("abs"), T.__abs__: unary("abs"),
        torch.floor: unary("floor"), T.floor: unary("floor"),
        torch.neg: unary("neg"), T.neg: unary("neg"), T.__neg__: unary("neg"),
        torch.nn.functional.sigmoid: unary("sigmoid"), torch.nn.functional.tanh: unary("tanh"),
        torch.add: binary("add", "torch.add"), torch.sub: binary("sub", "torch.sub"),
        torch.mul: binary("mul", "torch.mul"),
        torch.div: exact(divide, "torch.div"), T.div: exact(divide, "Tensor.div"),
        torch.true_divide: exact(lambda t, a, b: t.true_divide(a, b), "torch.true_divide"),
        torch.floor_divide: exact(lambda t, a, b: t.floor_divide(a, b), "torch.floor_divide"),
        torch.remainder: binary("mod", "%"),
        torch.minimum: binary("min", "minimum"), torch.maximum: binary("max", "maximum"),
        torch.min: minmax("min"), torch.max: minmax("max"),
        torch.where: exact(lambda t, c, a, b: t.where(c, a, b), "torch.where"),
        torch.clamp: exact(clamp, "clamp"), torch.clip: exact(clamp, "clip"),
        T.clamp: exact(clamp, "clamp"),
        torch.eq: binary("eq", "=="), torch.ne: binary("ne", "!="),
        torch.lt: binary("lt", "<"), torch.le: binary("le", "<="),
        torch.gt: binary("gt", ">"), torch.ge: binary("ge", ">="),
        torch.logical_and: logic("and", "logical_and"),
        torch.logical_or: logic("or", "logical_or"),
        torch.logical_not: logic("not", "logical_not"),
        torch.logical_xor: logic("ne", "logical_xor"),
        torch.zeros_like: exact(like(0), "torch.zeros_like"),
        torch.ones_like: exact(like(1), "torch.ones_like"),
        torch.full_like: exact(full_like, "torch.full_like"),
        T.__getitem__: getitem,
        T.__add__: tensor_method("add"), T.__radd__: lambda t, a, b: t.op("add", b, a, name="+"),
        T.__sub__: tensor_method("sub"), T.__rsub__: lambda t, a, b: t.op("sub", b, a, name="-"),
        T.__mul__: tensor_method("mul"), T.__rmul__: lambda t, a, b: t.op("mul", b, a, name="*"),
        T.__truediv__: lambda t, a, b, **k: t.true_divide(a, b),
        T.__rtruediv__: lambda t, a, b, **k: t.true_divide(b, a),
        T.__lt__: binary("lt", "<"), T.__le__: binary("le", "<="),
        T.__gt__: binary("gt", ">"), T.__ge__: binary("ge", ">="),
        T.__eq__: binary("eq", "=="), T.__ne__: binary("ne", "!="),
    }
    _HANDLERS = handlers
    return handlers


_HANDLERS = None


def _result_text(tracer: _Tracer, result, kind: str) -> str:
    torch = _torch()
    if isinstance(result, torch.Tensor):
        _fail(f"a {kind} that returns a tensor not computed from its arguments")
    if result is None:
        _fail(f"a {kind} that returns None")
    value = tracer.lift(result)
    if kind == "score_mod":
        if value.type == "bool":
            raise TraceError("the score_mod returns a bool value; a score_mod returns the new "
                             "score (a mask belongs in mask_mod)")
        if value.type == "i32":
            value = tracer.to_type(value, "f32")
    elif value.type != "bool":
        raise TraceError(f"the mask_mod returns an {value.type} value; a mask_mod returns bool "
                         "(True keeps the score)")
    return str(value.expr)


def trace(score_mod: Callable | str | None, mask_mod: Callable | str | None,
          tensors: dict | None = None) -> Trace:
    """Traces the modifiers (functions, IR text or None) into IR text and captured tensors."""
    functions = [score_mod if callable(score_mod) else None,
                 mask_mod if callable(mask_mod) else None]
    tracer = _Tracer(functions, tensors)
    texts = []
    for number, (modifier, kind) in enumerate(((score_mod, "score_mod"), (mask_mod, "mask_mod"))):
        if modifier is None:
            texts.append("")
        elif isinstance(modifier, str):
            texts.append(modifier)
        elif callable(modifier):
            leaves = [tracer.leaf(n) for n in ("b", "h", "q", "kv")]
            if kind == "score_mod":
                leaves.insert(0, tracer.leaf("score"))
            result = modifier(*leaves)
            texts.append(_result_text(tracer, result, kind))
        else:
            raise TypeError(f"{kind} must be a function, IR text or None, not "
                            f"{type(modifier).__name__}")
    captured = tracer.captured
    # Tensors named for IR text.
    known = {c.name for c in captured}
    for name, tensor in (tensors or {}).items():
        if name not in known:
            if not _IDENTIFIER.match(name) or name in _RESERVED:
                raise ValueError(f"tensors: '{name}' is not a usable tensor name")
            if not _dtype_kind(tensor):
                raise ValueError(f"tensors: '{name}' has dtype {tensor.dtype}; flexattn loads "
                                 "float32, float16, bfloat16, float64, int32 or int64 tensors")
            captured.append(Captured(name, tensor, None))
    return Trace(texts[0], texts[1], captured)


# ---- the trace cache ------------------------------------------------------------------------
# An eager call traces its modifiers again only when something the trace could depend on has
# changed. The key holds each function's code, default arguments, and a signature of everything
# its code can reach by name: closure cells and the globals it names, one attribute level into
# objects (self.bias, config.cap), and the functions it calls, recursively. Numbers and strings
# enter the key by value (the trace bakes them into the IR); tensors by dtype, shape and which
# other reachable tensor they are (their values are read at run time, from the paths the trace
# recorded, so the cached IR reads the tensors the function holds now). Anything else (lists,
# dicts, numpy values, objects whose attributes the key does not follow) makes the call
# uncacheable: it is traced every time.

_MAX_DEPTH = 3
_CACHE_ENTRIES = 256
_trace_cache: dict = {}


class _Uncacheable(Exception):
    pass


def _signature(value, depth: int, tensors: dict, names: tuple):
    """A hashable stand-in for `value` as the trace sees it (see above). `tensors` numbers the
    distinct tensors met so far (which tensors are one changes the trace); `names` are the
    attribute names the code that reaches `value` uses."""
    kind = type(value)
    if kind is _ModuleType and value.__name__.split(".")[0] in _LIBRARIES:
        return value  # torch, math: the same for every call
    torch = _torch()
    if value is None or kind in (bool, int, str):
        return (kind, value)
    if kind is float:
        return (float, value.hex())  # tells -0.0 from 0.0, and NaN equals NaN
    if isinstance(value, torch.Tensor):
        ordinal = tensors.setdefault(id(value), len(tensors))
        return ("tensor", kind, ordinal, value.dtype, tuple(value.shape))
    if kind is tuple:
        return tuple(_signature(v, depth, tensors, names) for v in value)
    if depth >= _MAX_DEPTH:
        raise _Uncacheable
    if kind is _FunctionType:
        if _library(value):
            return ("callable", value)
        return _function_signature(value, depth + 1, tensors)
    if kind is _MethodType:
        function = value.__func__
        inner = (_function_signature(function, depth + 1, tensors)
                 if type(function) is _FunctionType and not _library(function)
                 else ("callable", function))
        method_names = getattr(getattr(function, "__code__", None), "co_names", ())
        return ("method", inner, _signature(value.__self__, depth + 1, tensors, method_names))
    if kind is _ModuleType:
        members = value.__dict__
        return ("module", value, tuple((name, _signature(members[name], depth + 1, tensors, names))
                                       for name in names if name in members))
    if isinstance(value, (_BuiltinType, type, torch.dtype, torch.device)) or _library(value):
        return ("callable", value)
    if (kind in _CONTAINERS or hasattr(kind, "__getitem__") or hasattr(value, "__array__")
            or (callable(value) and not isinstance(value, torch.nn.Module))):
        raise _Uncacheable  # indexing or calling could read values the key does not follow
    # An object the code reads attributes of (self.bias, self.cap): those attributes.
    attributes = []
    for name in names:
        try:
            inner = getattr(value, name)
        except AttributeError:
            continue
        except Exception:  # noqa: BLE001 (a property that raises: the trace does not read it)
            raise _Uncacheable from None
        attributes.append((name, _signature(inner, depth + 1, tensors, names)))
    return ("object", kind, tuple(attributes))


def _library(value) -> bool:
    """Functions and objects of torch, math and flexattn: the same for every call."""
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in _LIBRARIES


_LIBRARIES = ("torch", "math", "flexattn", "builtins")


_CONTAINERS = (list, dict, set, frozenset, bytearray)


def _function_signature(function, depth: int, tensors: dict):
    code = function.__code__
    names = code.co_names
    cells = ()
    if function.__closure__:
        try:
            cells = tuple(_signature(cell.cell_contents, depth, tensors, names)
                          for cell in function.__closure__)
        except ValueError:  # an empty cell
            raise _Uncacheable from None
    globals_ = function.__globals__
    reached = tuple((name, _signature(globals_[name], depth, tensors, names))
                    for name in names if name in globals_)
    defaults = _signature(function.__defaults__, depth, tensors, ())
    keyword_defaults = _signature(tuple(sorted((function.__kwdefaults__ or {}).items())), depth,
                                  tensors, ())
    return ("function", code, cells, reached, defaults, keyword_defaults)


_FunctionType = types.FunctionType
_MethodType = types.MethodType
_ModuleType = types.ModuleType
_BuiltinType = types.BuiltinFunctionType


def _modifier_signature(modifier, tensors: dict):
    if modifier is None or isinstance(modifier, str):
        return modifier
    if type(modifier) is not _FunctionType:
        raise _Uncacheable
    return _function_signature(modifier, 0, tensors)


def cached_trace(score_mod, mask_mod, tensors: dict | None = None):
    """(score_mod text, mask_mod text, names, tensors): trace() of the modifiers, from the cache
    when the key (above) matches a previous call; the tensors are read from the functions as
    they are now."""
    try:
        numbering: dict = {}
        key = (_modifier_signature(score_mod, numbering), _modifier_signature(mask_mod, numbering),
               tuple((name, _signature(t, 0, numbering, ())) for name, t in tensors.items())
               if tensors else ())
    except _Uncacheable:
        key = None
    entry = _trace_cache.get(key) if key is not None else None
    if entry is None:
        traced = trace(score_mod, mask_mod, tensors)
        names = [c.name for c in traced.captured]
        values = [c.tensor for c in traced.captured]
        given = {id(t): n for n, t in (tensors or {}).items()}
        sources = [c.path if c.path is not None else given.get(id(c.tensor))
                   for c in traced.captured]
        if key is not None and all(s is not None for s in sources):
            if len(_trace_cache) >= _CACHE_ENTRIES:
                _trace_cache.pop(next(iter(_trace_cache)))
            _trace_cache[key] = (traced.score_mod, traced.mask_mod, names, sources)
        return traced.score_mod, traced.mask_mod, names, values
    score_text, mask_text, names, sources = entry
    functions = [score_mod if callable(score_mod) else None,
                 mask_mod if callable(mask_mod) else None]
    values = [tensors[s] if isinstance(s, str) else fetch(functions, s) for s in sources]
    return score_text, mask_text, names, values
