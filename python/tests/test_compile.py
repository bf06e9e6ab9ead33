"""torch.compile(fullgraph=True) on the CPU: the custom op, its fake implementation and autograd,
with modifiers defined inside the compiled code and tensors read through closures and globals."""

import torch

import flexattn

GLOBAL_SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, requires_grad=True)


class Block(torch.nn.Module):
    """Attention with softcap, a learned bias and ALiBi, causal: modifiers defined in forward."""

    def __init__(self, heads=4, seq=32, dim=16):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.proj = torch.nn.Linear(dim, 3 * dim * heads)
        self.bias = torch.nn.Parameter(0.1 * torch.randn(heads, seq, seq, generator=g))
        self.heads, self.dim = heads, dim

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, self.heads, self.dim).unbind(2)

        def score_mod(score, b, h, q_idx, kv_idx):
            return (20 * torch.tanh(score / 20) + self.bias[h, q_idx, kv_idx]
                    + GLOBAL_SLOPES[h] * (kv_idx - q_idx))

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        out = flexattn.attention(q, k, v, score_mod, mask_mod, layout="bshd")
        return out.sum(dim=2)


def run(model, x):
    out = model(x)
    loss = (out ** 2).mean()
    params = [model.bias, model.proj.weight, GLOBAL_SLOPES]
    return out, torch.autograd.grad(loss, params + [x])


def test_fullgraph_matches_eager_forward_and_backward():
    # In float64 with its own seed: Inductor's code for the projection rounds differently from
    # eager's, and in float32 that difference, through attention and its backward, can come near
    # the tolerance on some inputs and machines; in float64 it stays orders below, while a wrong
    # op, modifier or gradient is off by far more.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block().double()
    x = torch.randn(2, 32, 16, dtype=torch.float64, requires_grad=True)
    eager_out, eager_grads = run(model, x)
    compiled = torch.compile(model, fullgraph=True)
    out, grads = run(compiled, x)
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads[0].abs().sum() > 0 and grads[2].abs().sum() > 0


def test_the_graph_holds_one_op_and_its_backward():
    torch._dynamo.reset()
    counts = {"graphs": 0, "ops": []}

    def backend(graph_module, example_inputs):
        counts["graphs"] += 1
        counts["ops"] += [str(n.target) for n in graph_module.graph.nodes
                          if n.op == "call_function"]
        return graph_module.forward

    def function(q, k, v, bias):
        return flexattn.attention(q, k, v, lambda s, b, h, qi, kv: s + bias[h, qi, kv])

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    bias = torch.randn(2, 8, 8)
    compiled = torch.compile(function, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, bias), function(q, k, v, bias))
    assert counts["graphs"] == 1
    assert any("flexattn.attention" in op for op in counts["ops"]), counts["ops"]


def test_ir_text_and_named_tensors_compile():
    torch._dynamo.reset()
    bias = torch.randn(2, 8, 8, requires_grad=True)

    def function(q, k, v):
        return flexattn.attention(q, k, v, "score + bias[h, q, kv]", "q >= kv",
                                  tensors={"bias": bias})

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    eager = function(q, k, v)
    (eager_grad,) = torch.autograd.grad(eager.sum(), bias)
    out = torch.compile(function, fullgraph=True)(q, k, v)
    (grad,) = torch.autograd.grad(out.sum(), bias)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(grad, eager_grad)


def test_opcheck_fake_schema_and_autograd():
    # torch.library.opcheck runs the op under the fake-tensor, schema and autograd checks:
    # GQA, Dv != D, seq_len_q != seq_len_kv, a captured tensor, fp64 and fp32, two layouts.
    from flexattn import _torch as ops

    g = torch.Generator().manual_seed(2)
    thd = "thd:0,1,3;0,2,5"  # two sequences: 1 and 2 queries, 2 and 3 keys
    shapes = {"bhsd": ((1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 6)),
              "bshd": ((1, 3, 4, 8), (1, 5, 2, 8), (1, 5, 2, 6)),
              thd: ((3, 4, 8), (5, 2, 8), (5, 2, 6))}
    for layout, dtype in (("bhsd", torch.float64), ("bshd", torch.float32),
                          (thd, torch.float64)):
        q, k, v = (torch.randn(*shape, generator=g).to(dtype).requires_grad_()
                   for shape in shapes[layout])
        bias = torch.randn(15, generator=g).to(dtype).requires_grad_()
        args = (q, k, v, [bias], "bias", "score + bias[q * 5 + kv]", "q + 2 >= kv", 0.5,
                layout, "auto")
        if layout == thd:
            args = args[:5] + ("score + bias[b * 5 + kv]",) + args[6:]
        torch.library.opcheck(ops.attention_op, args)
        out, lse = ops.attention_op(*args)
        grad_out = torch.randn(out.shape, generator=g).to(dtype)
        torch.library.opcheck(ops.attention_backward_op,
                              (q.detach(), k.detach(), v.detach(), out.detach(), lse, grad_out,
                               [bias.detach()], "bias", "bias", *args[5:]))


def test_fake_tensors_take_the_custom_op():
    # Outside torch.compile, fake tensors (shape propagation) reach the op's fake implementation.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 10, 8)
        v = torch.empty(2, 2, 12, 6)
        out, lse = flexattn.attention(q, torch.empty(2, 2, 12, 8), v, "30 * tanh(score / 30)",
                                      enable_gqa=True, return_lse=True)
        assert out.shape == (2, 4, 10, 6) and lse.shape == (2, 4, 10)
        assert lse.dtype == torch.float32


def test_tensor_computed_inside_the_compiled_code():
    torch._dynamo.reset()

    class RelativeBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(31, generator=torch.Generator()
                                                        .manual_seed(4)))

        def forward(self, q, k, v):
            bias = torch.tanh(self.table) * 2  # an intermediate the modifier reads
            return flexattn.attention(q, k, v, lambda s, b, h, qi, kv: s + bias[qi - kv + 15])

    model = RelativeBias()
    q = torch.randn(1, 2, 16, 8)
    eager = model(q, q, q)
    (eager_grad,) = torch.autograd.grad(eager.square().sum(), model.table)
    out = torch.compile(model, fullgraph=True)(q, q, q)
    (grad,) = torch.autograd.grad(out.square().sum(), model.table)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(grad, eager_grad)
