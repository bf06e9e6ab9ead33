"""Bad inputs and untraceable modifiers give the documented exceptions with one-line messages."""

import math
import re

import pytest
import torch

import flexattn

q = torch.randn(1, 2, 16, 8)
BIAS = torch.randn(2, 16, 16)


def line_of(function, text):
    """The file:line of the line in `function` that holds `text`."""
    import inspect

    lines, start = inspect.getsourcelines(function)
    for offset, line in enumerate(lines):
        if text in line:
            return f"{function.__code__.co_filename}:{start + offset}"
    raise AssertionError(text)


def branch(s, b, h, q_idx, kv_idx):
    if s > 0:
        return s
    return -s


def python_and(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx and kv_idx > 2


def unsupported_op(s, b, h, q_idx, kv_idx):
    return torch.sin(s)


def bitwise(s, b, h, q_idx, kv_idx):
    return s + (q_idx & 3)


def slicing(s, b, h, q_idx, kv_idx):
    return s + BIAS[h, :, kv_idx].sum()


def data_dependent(s, b, h, q_idx, kv_idx):
    return s + BIAS[h, q_idx, kv_idx] * float(kv_idx)


def unsupported_method(s, b, h, q_idx, kv_idx):
    return s.sin()


def python_math(s, b, h, q_idx, kv_idx):
    return 30 * math.tanh(s / 30)


def partial_index(s, b, h, q_idx, kv_idx):
    return s + BIAS[h, q_idx]


def bool_tensor(s, b, h, q_idx, kv_idx):
    return s + BIAS.bool()[h, q_idx, kv_idx]


UNTRACEABLE = [
    (branch, None, "if s > 0", "Python control flow"),
    (None, python_and, "and kv_idx", "Python control flow"),
    (unsupported_op, None, "torch.sin", "torch.sin"),
    (bitwise, None, "q_idx & 3", "'&' on i32"),
    (slicing, None, "BIAS[h, :", "slicing a captured tensor"),
    (data_dependent, None, "float(kv_idx)", "float() of a traced value"),
    (unsupported_method, None, "s.sin()", "'.sin'"),
    (bool_tensor, None, "BIAS.bool()", "dtype torch.bool"),
    (python_math, None, "math.tanh", "float() of a traced value"),
    (partial_index, None, "BIAS[h, q_idx]", "indexed in 2 of its 3 dimensions"),
]


@pytest.mark.parametrize("score_mod,mask_mod,line,construct", UNTRACEABLE,
                         ids=[case[2] for case in UNTRACEABLE])
def test_untraceable_modifiers_name_the_construct_and_line(score_mod, mask_mod, line, construct):
    with pytest.raises(flexattn.TraceError) as error:
        flexattn.attention(q, q, q, score_mod, mask_mod)
    message = str(error.value)
    assert construct in message
    assert line_of(score_mod or mask_mod, line) in message, message
    assert "\n" not in message
    assert isinstance(error.value, ValueError)


def test_modifier_results_are_checked():
    with pytest.raises(flexattn.TraceError, match="mask_mod returns an i32"):
        flexattn.attention(q, q, q, None, lambda b, h, qi, kv: qi - kv)
    with pytest.raises(flexattn.TraceError, match="score_mod returns a bool"):
        flexattn.attention(q, q, q, lambda s, b, h, qi, kv: qi >= kv)


BAD_INPUTS = [
    (ValueError, "one dtype", (q, q, q.double()), {}),
    (ValueError, "dtype torch.int32", (q.int(), q.int(), q.int()), {}),
    (ValueError, "4 heads and key/value 2|2 heads and key/value 1", (q, q[:, :1], q[:, :1]), {}),
    (ValueError, "3 dimensions", (q[0], q, q), {}),
    (ValueError, "unknown layout", (q, q, q), {"layout": "hsbd"}),
    (ValueError, "unknown engine 'nope'", (q, q, q), {"engine": "nope"}),
    (ValueError, "unknown name 'nob'", (q, q, q, "score + nob[h]"), {}),
    (ValueError, "index 2 ranges over \\[20, 35\\]",
     (q, q, q, "score + bias[h, q, kv + 20]"), {"tensors": {"bias": BIAS}}),
    (ValueError, "head_dim|expected", (q, torch.randn(1, 2, 16, 4), q), {}),
    (TypeError, "query must be a torch.Tensor", (q.numpy(), q, q), {}),
]


@pytest.mark.parametrize("kind,pattern,args,kwargs", BAD_INPUTS,
                         ids=[case[1][:24] for case in BAD_INPUTS])
def test_bad_inputs(kind, pattern, args, kwargs):
    with pytest.raises(kind, match=pattern) as error:
        flexattn.attention(*args, **kwargs)
    assert "\n" not in str(error.value)


def test_device_mix():
    meta = torch.empty(1, 2, 16, 8, device="meta")
    with pytest.raises(ValueError, match="one device"):
        flexattn.attention(q, meta, meta)
    with pytest.raises(ValueError, match="flexattn runs on cpu and cuda"):
        flexattn.attention(meta, meta, meta)
    with pytest.raises(ValueError, match="the tensor 'bias' the modifiers read is on meta"):
        bias = torch.empty(2, 16, 16, device="meta")
        flexattn.attention(q, q, q, lambda s, b, h, qi, kv: s + bias[h, qi, kv])


def test_no_engine_error_carries_every_reason():
    with pytest.raises(flexattn.NoEngineError) as error:
        flexattn.attention(q, q, q, engine="cuda")
    assert "forced engine cuda cannot run this problem" in str(error.value)
    assert isinstance(error.value, flexattn.Error) and isinstance(error.value, RuntimeError)
    # float64 is the reference's alone
    with pytest.raises(flexattn.NoEngineError, match="forced engine cpu cannot run"):
        flexattn.attention(q.double(), q.double(), q.double(), engine="cpu")


def test_engines_list():
    names = [e["name"] for e in flexattn.engines()]
    assert "cpu" in names and "cpu_ref" in names
    entry = {e["name"]: e for e in flexattn.engines()}["cpu_ref"]
    assert entry["available"] and entry["device"] == "cpu"


def test_version_is_the_projects():
    cmake = open(__file__.rsplit("/python/", 1)[0] + "/CMakeLists.txt").read()
    assert re.search(r"project\(flexattn VERSION ([0-9.]+)", cmake).group(1) == \
        flexattn.__version__
