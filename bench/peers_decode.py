# Times the peers of a decoding step, in the same run as `flexattn bench --page-size`: one new
# query token per sequence against a contiguous KV cache, PyTorch SDPA (cuDNN, flash and
# efficient backends, GQA through enable_gqa), FlexAttention (torch.compile'd, without a modifier
# and with softcap 30), and a device-to-device copy of the same K and V bytes (the bandwidth
# ceiling). Rates are K and V bytes read per second (TB/s), the copy's bytes read and written;
# medians of triton.testing.do_bench.
# With --device cpu: the same in fp32 on the CPU (SDPA's CPU kernel, FlexAttention compiled for
# the CPU, a copy of the same bytes), medians of --iters calls after two warm-ups
# (time.perf_counter), rates in GB/s; run it right after `flexattn bench --engine cpu` so both
# see the same machine load.
# Writes JSON to $OUT/peers_decode.json.
#   python3 peers_decode.py [--batch 64] [--heads-q 32] [--heads-kv 8] [--cache 8192] [--dim 128]
#                           [--device cuda|cpu] [--iters 10]
import argparse
import json
import os
import statistics
import sys
import time

OUT = os.environ.get("OUT", "/tmp")


def skip(what, error):
    reason = (str(error).splitlines() or [type(error).__name__])[0][:200]
    print(f"skip: {what}: {reason}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--cache", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--iters", type=int, default=10, help="timed calls on the CPU (median)")
    args = parser.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    gpu = args.device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    b, hq, hkv, s, d = args.batch, args.heads_q, args.heads_kv, args.cache, args.dim
    q = torch.randn(b, hq, 1, d, device=args.device, dtype=dtype)
    k = torch.randn(b, hkv, s, d, device=args.device, dtype=dtype)
    v = torch.randn(b, hkv, s, d, device=args.device, dtype=dtype)
    kv_bytes = 2 * k.numel() * k.element_size()
    rows = []

    def milliseconds(function):
        if gpu:
            import triton.testing
            return triton.testing.do_bench(function, warmup=25, rep=200)
        function()
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def record(name, function, moved=kv_bytes):
        try:
            function()
            if gpu:
                torch.cuda.synchronize()
            ms = milliseconds(function)
        except Exception as error:  # a backend this build or shape lacks: a skip line
            skip(name, error)
            return
        rate = moved / (ms * 1e-3) / 1e12
        rows.append({"name": name, "ms": ms, "tb_per_s": rate})
        if gpu:
            print(f"{name:24} {ms * 1e3:9.1f} us  {rate:6.2f} TB/s", flush=True)
        else:
            print(f"{name:24} {ms:9.3f} ms  {rate * 1e3:7.2f} GB/s", flush=True)

    backends = ((("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                 ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                 ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)) if gpu else
                (("sdpa_cpu", None),))
    for name, backend in backends:
        def sdpa(backend=backend):
            if backend is None:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        record(name, sdpa)

    compiled = torch.compile(flex_attention)

    def softcap(score, b_, h_, q_, kv_):
        return 30 * torch.tanh(score / 30)

    record("flex_none", lambda: compiled(q, k, v, enable_gqa=True))
    record("flex_softcap30", lambda: compiled(q, k, v, score_mod=softcap, enable_gqa=True))
    source = torch.cat([k, v])
    target = torch.empty_like(source)
    record("copy_d2d" if gpu else "copy", lambda: target.copy_(source),
           moved=2 * kv_bytes)  # read and written

    result = {"batch": b, "heads_q": hq, "heads_kv": hkv, "cache": s, "dim": d,
              "dtype": str(dtype).removeprefix("torch."), "kv_bytes": kv_bytes,
              "torch": torch.__version__,
              "device": (torch.cuda.get_device_name() if gpu
                         else f"cpu, {torch.get_num_threads()} threads"),
              "rows": rows}
    with open(os.path.join(OUT, "peers_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
