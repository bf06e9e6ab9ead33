"""The eager trace cache: a repeated call reuses the trace, and every change the trace depends on
(numbers in closures, globals, defaults and attributes; which tensors the function holds, and
which of them are one) gives the result of the changed function."""

import pytest
import torch

import flexattn
from flexattn import _trace
from conftest import inputs, reference

S, H = 24, 2
CAP = 30.0


@pytest.fixture
def traces(monkeypatch):
    """Counts the traces made (cache misses)."""
    calls = []
    original = _trace.trace

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(_trace, "trace", counting)
    monkeypatch.setattr(_trace, "_trace_cache", {})
    return calls


def check(score_mod, expected_mod, mask_mod=None):
    q, k, v = inputs(b=1, hq=H, sq=S, d=8)
    out = flexattn.attention(q, k, v, score_mod, mask_mod, engine="cpu_ref")
    want, _ = reference(q, k, v, expected_mod, mask_mod)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_a_repeated_call_traces_once(traces):
    bias = torch.randn(H, S, S, dtype=torch.float64)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    for _ in range(3):
        check(biased, biased)
    assert len(traces) == 1


def test_a_closure_number_that_changes_retraces(traces):
    cap = 30.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    check(softcap, softcap)
    cap = 0.5
    check(softcap, lambda s, b, h, q, kv: 0.5 * torch.tanh(s / 0.5))
    assert len(traces) == 2


def test_a_global_number_that_changes_retraces(traces):
    global CAP

    def softcap(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP)

    try:
        check(softcap, lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0))
        CAP = 0.25
        check(softcap, lambda s, b, h, q, kv: 0.25 * torch.tanh(s / 0.25))
    finally:
        CAP = 30.0


def test_a_helper_function_reading_a_changed_number_retraces(traces):
    scale = {"value": 2.0}  # a dict is not followed: every call is traced

    def double(score, b, h, q_idx, kv_idx):
        return score * scale["value"]

    check(double, lambda s, b, h, q, kv: s * 2.0)
    scale["value"] = 3.0
    check(double, lambda s, b, h, q, kv: s * 3.0)

    factor = 2.0

    def helper(x):
        return x * factor

    def via_helper(score, b, h, q_idx, kv_idx):
        return helper(score)

    check(via_helper, lambda s, b, h, q, kv: s * 2.0)
    factor = 5.0
    check(via_helper, lambda s, b, h, q, kv: s * 5.0)


def test_defaults_are_part_of_the_key(traces):
    def make(offset):
        def shifted(score, b, h, q_idx, kv_idx, offset=offset):
            return score + offset * (kv_idx - q_idx)
        return shifted

    check(make(0.5), lambda s, b, h, q, kv: s + 0.5 * (kv - q))
    check(make(-2.0), lambda s, b, h, q, kv: s - 2.0 * (kv - q))
    assert len(traces) == 2


def test_the_same_code_with_another_closure_reuses_the_trace_with_its_own_tensors(traces):
    def make(table):
        return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx, kv_idx]

    first, second = (torch.randn(H, S, S, dtype=torch.float64) for _ in range(2))
    check(make(first), lambda s, b, h, q, kv: s + first[h, q, kv])
    check(make(second), lambda s, b, h, q, kv: s + second[h, q, kv])
    assert len(traces) == 1


def test_a_replaced_tensor_is_read_where_the_function_finds_it(traces):
    table = torch.randn(H, S, S, dtype=torch.float64)

    def biased(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx, kv_idx]

    check(biased, lambda s, b, h, q, kv: s + table[h, q, kv])
    old = table
    table = torch.randn(H, S, S, dtype=torch.float64)
    check(biased, lambda s, b, h, q, kv: s + table[h, q, kv])
    assert not torch.equal(old, table)
    table = torch.randn(H, S, S + 1, dtype=torch.float64)[..., :S].contiguous()
    check(biased, lambda s, b, h, q, kv: s + table[h, q, kv])


def test_tensors_that_stop_being_one_retrace(traces):
    first = torch.randn(H, dtype=torch.float64)
    second = first

    def two(score, b, h, q_idx, kv_idx):
        return score + first[h] - 2 * second[h]

    check(two, lambda s, b, h, q, kv: s - first[h])
    second = torch.randn(H, dtype=torch.float64)
    check(two, lambda s, b, h, q, kv: s + first[h] - 2 * second[h])
    assert len(traces) == 2


def test_an_attribute_that_changes_retraces(traces):
    class Softcap:
        def __init__(self, cap):
            self.cap = cap

        def modifier(self):
            return lambda score, b, h, q_idx, kv_idx: self.cap * torch.tanh(score / self.cap)

    module = Softcap(4.0)
    function = module.modifier()
    check(function, lambda s, b, h, q, kv: 4.0 * torch.tanh(s / 4.0))
    module.cap = 0.5
    check(function, lambda s, b, h, q, kv: 0.5 * torch.tanh(s / 0.5))
    assert len(traces) == 2


def test_an_nn_module_parameter_reads_its_current_value(traces):
    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(H, S, S, dtype=torch.float64))

        def modifier(self):
            return lambda score, b, h, q_idx, kv_idx: score + self.bias[h, q_idx, kv_idx]

    module = Bias()
    function = module.modifier()
    with torch.no_grad():
        check(function, lambda s, b, h, q, kv: s)
        module.bias.copy_(torch.randn(H, S, S, dtype=torch.float64))
        check(function, lambda s, b, h, q, kv: s + module.bias[h, q, kv])
        module.bias = torch.nn.Parameter(torch.randn(H, S, S, dtype=torch.float64))
        check(function, lambda s, b, h, q, kv: s + module.bias[h, q, kv])
    assert len(traces) == 1


def test_uncacheable_captures_are_traced_every_call(traces):
    values = [1.5]

    def listed(score, b, h, q_idx, kv_idx):
        return score * values[0]

    check(listed, lambda s, b, h, q, kv: s * 1.5)
    values[0] = -1.0
    check(listed, lambda s, b, h, q, kv: -s)
    assert len(traces) == 2


def test_ir_text_with_named_tensors_reads_the_tensors_given(traces):
    q, k, v = inputs(b=1, hq=H, sq=S, d=8)
    for _ in range(2):
        slopes = torch.randn(H, dtype=torch.float64)
        out = flexattn.attention(q, k, v, "score + slopes[h] * float(kv - q)",
                                 tensors={"slopes": slopes}, engine="cpu_ref")
        want, _ = reference(q, k, v, lambda s, b, h, qi, kv: s + slopes[h] * (kv - qi))
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
