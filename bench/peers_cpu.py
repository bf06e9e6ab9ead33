# PyTorch's CPU attention on the problem of flexattn_bench_cpu (docs/design.md section 6): fp32,
# batch 1, heads 8, seq 2048, head dim 64, softcap 30 (30 * tanh(score / 30)), without and with a
# causal mask, forward and forward+backward. Run it right after flexattn_bench_cpu in the same
# command so both see the same machine load (scripts/cpu-peers does both).
#
#   python3 bench/peers_cpu.py [--iters N] [--threads T] [--seq S] [--json out.json]
#
# Peers, each timed as the median of N calls after two warm-ups (time.perf_counter):
#   flex:  FlexAttention, torch.compile'd (CPU template of inductor), score_mod softcap, causal
#          through a block mask; the function flexattn computes.
#   eager: a plain PyTorch implementation of the same function (matmul, tanh, softmax with the
#          mask, matmul); it holds the whole score matrix.
#   sdpa:  scaled_dot_product_attention WITHOUT softcap (is_causal for the causal rows): not the
#          same function, shown as the rate of PyTorch's own fused CPU kernel.
# FLOPs: forward 4 B H S^2 D (halved under the causal mask), forward+backward 3.5x that.
import argparse
import json
import math
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("peers_cpu.py: PyTorch is not installed (pip install torch; not needed by CI)",
          file=sys.stderr)
    sys.exit(2)

SOFTCAP = 30.0


def softcap(score, b, h, q, kv):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def causal_mask(b, h, q, kv):
    return q >= kv


def eager_attention(q, k, v, causal):
    scale = 1.0 / math.sqrt(q.shape[-1])
    score = SOFTCAP * torch.tanh((q @ k.transpose(-1, -2)) * scale / SOFTCAP)
    if causal:
        s = q.shape[-2]
        keep = torch.ones(s, s, dtype=torch.bool).tril()
        score = score.masked_fill(~keep, float("-inf"))
    return torch.softmax(score, dim=-1) @ v


def median_seconds(fn, iters):
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    b, h, s, d = 1, args.heads, args.seq, args.dim
    generator = torch.Generator().manual_seed(0)
    base = [torch.randn(b, h, s, d, generator=generator) for _ in range(3)]
    dout = torch.randn(b, h, s, d, generator=generator)
    rows = []
    for causal in (False, True):
        block_mask = (create_block_mask(causal_mask, b, h, s, s, device="cpu") if causal else None)
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        peers = {
            "flex": lambda q, k, v: compiled(q, k, v, score_mod=softcap, block_mask=block_mask),
            "eager": lambda q, k, v: eager_attention(q, k, v, causal),
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        }
        for name, attention in peers.items():
            for backward in (False, True):
                q, k, v = [t.clone().requires_grad_(backward) for t in base]

                def run():
                    if backward:
                        q.grad = k.grad = v.grad = None
                        attention(q, k, v).backward(dout)
                    else:
                        with torch.no_grad():
                            attention(q, k, v)

                try:
                    start = time.perf_counter()
                    run()
                    first = time.perf_counter() - start
                    seconds = median_seconds(run, args.iters)
                except Exception as error:  # one peer failing does not stop the others
                    print(f"skip {name} {'fwd+bwd' if backward else 'fwd'} "
                          f"{'causal' if causal else 'dense'}: {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}", flush=True)
                    continue
                flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
                flops *= 3.5 if backward else 1.0
                row = {"peer": name, "pass": "fwdbwd" if backward else "fwd",
                       "causal": causal, "ms": seconds * 1e3,
                       "gflops": flops / seconds / 1e9, "first_call_s": first}
                rows.append(row)
                print(f"{name:<6} {row['pass']:<7} {'causal' if causal else 'dense':<7} "
                      f"{row['ms']:9.1f} ms {row['gflops']:7.1f} GFLOP/s "
                      f"(first call {first:.1f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "problem": {"B": b, "H": h, "S": s, "D": d, "softcap": SOFTCAP},
                       "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
