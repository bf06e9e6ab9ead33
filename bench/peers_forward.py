# Times the peers on the same problems as bench_cuda_forward, in the same run: PyTorch
# SDPA (flash and cuDNN backends) and FlexAttention (torch.compile'd, dynamo reset per variant),
# bf16, forward and forward+backward (the backward through .backward() on the output with a random
# gradient; q, k, v gradients, and the bias or ALiBi slopes gradient in the *_grad variants),
# medians of triton.testing.do_bench. FLOPs as FlashAttention counts them: forward 4 B H S^2 D
# (halved for causal), forward+backward 3.5x that.
#
# SDPA and FlexAttention run in two child processes: an earlier script that ran SDPA's backward
# before FlexAttention's in one process got FlexAttention at 5-25 TFLOP/s (an uncompiled
# fallback) for the rest of that process. A missing torch feature is a skip line, not a crash.
# Writes JSON to $OUT/peers_forward.json.
#   python3 peers_forward.py [--quick | --sweep | --dims [--head-dims 256,...]]
#                            [--pass fwd|fwdbwd|both]
# (--sweep: the forward sequence sweep alone, as bench_cuda_forward --sweep; --dims: the other
# head dims alone, as bench_cuda_forward --dims; --head-dims keeps only those q/k head dims.)
import argparse
import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", "/tmp")
TOKENS = 32768  # batch x seq of the sweep, as bench_cuda_forward
BACKWARD_FLOPS_RATIO = 2.5  # FlashAttention's count: fwd+bwd = 3.5x fwd
VARIANTS = ["none", "softcap", "alibi", "bias"]
# --dims, as bench_cuda_forward: (q/k, v) head dims (MLA: 192 with a 128-wide V).
OTHER_HEAD_DIMS = ((256, 256), (192, 128), (96, 96), (80, 80), (32, 32))
GRAD_VARIANTS = ["alibi_grad", "bias_grad"]  # full run, forward+backward, head dim 128


def skip(what, error=None):
    """One line saying what is not measured, and why."""
    reason = "" if error is None else (str(error).splitlines() or [type(error).__name__])[0][:200]
    print(f"skip: {what}" + (f": {reason}" if reason else ""), flush=True)


def dims_of(d):
    """(q/k head dim, v head dim) of a config's D: an int (both) or a pair."""
    return d if isinstance(d, tuple) else (d, d)


def inputs(torch, b, h, s, d, grad):
    """q, k (head dim q/k) and v (head dim v), bf16 N(0, 1) on the GPU."""
    d_qk, d_v = dims_of(d)
    return [torch.randn(b, h, s, width, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            for width in (d_qk, d_qk, d_v)]


def flops(b, h, s, d, causal, pass_):
    d_qk, d_v = dims_of(d)
    forward = 2 * b * h * s * s * (d_qk + d_v) * (0.5 if causal else 1.0)
    return forward * (1.0 + BACKWARD_FLOPS_RATIO if pass_ == "fwdbwd" else 1.0)


def configs(quick, passes, sweep_only=False, dims=False, only_dims=None):
    """(group, B, H, S, D, causal, pass, variants) as bench_cuda_forward times them (--dims:
    only the q/k head dims in only_dims, when given)."""
    result = []
    if sweep_only:
        return [c for c in configs(False, ["fwd"]) if c[0] == "sweep"]
    if dims:
        return [("dims", 4, 16, 4096, d, causal, pass_, ["none", "softcap"])
                for d in OTHER_HEAD_DIMS if not only_dims or d[0] in only_dims
                for causal in (False, True) for pass_ in passes]
    for d in (128, 64):
        for causal in (False, True):
            if "fwd" in passes:
                result.append(("main", 4, 16, 4096, d, causal, "fwd", VARIANTS))
            if "fwdbwd" in passes and (not quick or d == 128):
                extra = GRAD_VARIANTS if not quick and d == 128 else []
                result.append(("main", 4, 16, 4096, d, causal, "fwdbwd", VARIANTS + extra))
    if not quick and "fwd" in passes:
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for causal in (False, True):
                result.append(("sweep", TOKENS // s, 16, s, 128, causal, "fwd",
                               ["none", "softcap"]))
    return result


class Timer:
    """Medians of triton.testing.do_bench, or of CUDA events where triton is missing."""

    def __init__(self, torch):
        self.torch = torch
        try:
            from triton.testing import do_bench
            self.do_bench = do_bench
        except Exception as error:  # noqa: BLE001 (any import failure means: time it ourselves)
            skip("triton.testing.do_bench (timing with CUDA events instead)", error)
            self.do_bench = None

    def median_ms(self, fn, grads):
        if self.do_bench is not None:
            return self.do_bench(fn, warmup=50, rep=300, grad_to_none=grads or None,
                                 return_mode="median")
        torch = self.torch
        for _ in range(5):
            fn()
        times = []
        for _ in range(30):
            for tensor in grads:
                tensor.grad = None
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return sorted(times)[len(times) // 2]


def run_part(part, quick, passes, json_path, sweep_only=False, dims=False, only_dims=None):
    rows = []
    info = {}
    try:
        import torch
        info = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception as error:  # noqa: BLE001
        skip(f"{part} peers (torch with CUDA)", error)
        json.dump({"info": info, "rows": rows}, open(json_path, "w"), indent=1)
        return
    print(info, flush=True)
    timer = Timer(torch)

    def timed(group, name, b, h, s, d, causal, pass_, forward, grads):
        """forward() returns the (b, h, s, d) output; fwdbwd also runs its backward with a random
        gradient, clearing `grads` before each timed call."""
        row = dict(group=group, name=name, B=b, H=h, S=s, D=dims_of(d)[0], Dv=dims_of(d)[1],
                   causal=causal)
        row["pass"] = pass_
        try:
            if pass_ == "fwd":
                def fn():
                    with torch.no_grad():
                        return forward()
            else:
                dout = torch.randn(b, h, s, dims_of(d)[1], device="cuda", dtype=torch.bfloat16)

                def fn():
                    forward().backward(dout)
            start = time.time()
            fn()
            torch.cuda.synchronize()
            row["first_call_s"] = time.time() - start
            row["ms"] = timer.median_ms(fn, grads)
            row["tflops"] = flops(b, h, s, d, causal, pass_) / row["ms"] / 1e9
        except Exception as error:  # noqa: BLE001 (a peer that cannot run a shape is a row)
            row["error"] = str(error)[:200]
        rows.append(row)
        print(row, flush=True)

    if part == "sdpa":
        try:
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except Exception as error:  # noqa: BLE001
            skip("SDPA backends (torch.nn.attention)", error)
            backends = []
        else:
            backends = []
            for attribute, name in [("FLASH_ATTENTION", "sdpa_flash"),
                                    ("CUDNN_ATTENTION", "sdpa_cudnn")]:
                if hasattr(SDPBackend, attribute):
                    backends.append((getattr(SDPBackend, attribute), name))
                else:
                    skip(f"{name} (no SDPBackend.{attribute} in torch {torch.__version__})")
        for group, b, h, s, d, causal, pass_, variants in configs(quick, passes, sweep_only, dims,
                                                                  only_dims):
            if "none" not in variants:
                continue
            grad = pass_ == "fwdbwd"
            q, k, v = inputs(torch, b, h, s, d, grad)
            for backend, name in backends:
                def forward(backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                timed(group, name, b, h, s, d, causal, pass_, forward, [q, k, v] if grad else [])
            del q, k, v
    else:
        try:
            import torch._dynamo
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except Exception as error:  # noqa: BLE001
            skip("FlexAttention (torch.nn.attention.flex_attention)", error)
            flex_attention = None
        if flex_attention is not None:
            # Every variant compiles anew (dynamo reset); a failed compile must be an error row,
            # never a silently uncompiled (slow) run.
            for setting, value in [("cache_size_limit", 1024), ("recompile_limit", 1024),
                                   ("suppress_errors", False)]:
                if hasattr(torch._dynamo.config, setting):  # names differ between releases
                    setattr(torch._dynamo.config, setting, value)
        for group, b, h, s, d, causal, pass_, variants in configs(quick, passes, sweep_only, dims,
                                                                  only_dims):
            if flex_attention is None:
                break
            grad = pass_ == "fwdbwd"
            q, k, v = inputs(torch, b, h, s, d, grad)
            mask = None
            if causal:
                mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s)
            for variant in variants:
                learned = variant.endswith("_grad")
                base = variant[:-len("_grad")] if learned else variant
                slopes = torch.exp2(-8.0 * torch.arange(1, h + 1, device="cuda") / h)
                bias = (torch.randn(h, s, s, device="cuda", dtype=torch.bfloat16)
                        if base == "bias" else None)
                tensor = {"alibi": slopes, "bias": bias}.get(base)
                if learned:
                    tensor.requires_grad_(True)
                mods = {
                    "none": None,
                    "softcap": lambda score, b_, h_, qi, ki: 30.0 * torch.tanh(score / 30.0),
                    "alibi": lambda score, b_, h_, qi, ki: score + slopes[h_] * (ki - qi),
                    "bias": lambda score, b_, h_, qi, ki: score + bias[h_, qi, ki],
                }
                torch._dynamo.reset()
                flex = torch.compile(flex_attention, dynamic=False)
                mod = mods[base]
                grads = ([q, k, v] + ([tensor] if learned else [])) if grad else []
                timed(group, "flex_" + variant, b, h, s, d, causal, pass_,
                      lambda flex=flex, mod=mod: flex(q, k, v, score_mod=mod, block_mask=mask),
                      grads)
                del bias, tensor
            del q, k, v
    json.dump({"info": info, "rows": rows}, open(json_path, "w"), indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="the forward sequence sweep alone")
    parser.add_argument("--dims", action="store_true", help="head dims 256, 192/128, 96, 80, 32 alone")
    parser.add_argument("--head-dims", type=lambda text: [int(d) for d in text.split(",")],
                        help="with --dims: only these q/k head dims (e.g. 256 or 256,192)")
    parser.add_argument("--pass", dest="passes", choices=["fwd", "fwdbwd", "both"], default="both")
    parser.add_argument("--part", choices=["sdpa", "flex"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    passes = ["fwd", "fwdbwd"] if args.passes == "both" else [args.passes]
    if args.part is not None:
        run_part(args.part, args.quick, passes, args.json, args.sweep, args.dims, args.head_dims)
        return
    rows, info = [], {}
    for part in ("sdpa", "flex"):
        path = os.path.join(OUT, f"peers_{part}.json")
        if os.path.exists(path):
            os.remove(path)
        command = [sys.executable, os.path.abspath(__file__), "--part", part, "--json", path,
                   "--pass", args.passes] + (["--quick"] if args.quick else []) \
            + (["--sweep"] if args.sweep else []) + (["--dims"] if args.dims else []) \
            + (["--head-dims", ",".join(map(str, args.head_dims))] if args.head_dims else [])
        status = subprocess.call(command)
        if status != 0:
            skip(f"{part} peers", f"the child process exited with status {status}")
        try:
            with open(path) as file:
                data = json.load(file)
        except (OSError, ValueError) as error:
            skip(f"{part} peers (no results)", error)
            continue
        rows += data.get("rows", [])
        info.update(data.get("info", {}))
    with open(os.path.join(OUT, "peers_forward.json"), "w") as file:
        json.dump({"torch": info.get("torch"), "info": info, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
