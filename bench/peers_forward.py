# Times the peers on the same problems as bench_cuda_forward, in the same device call: PyTorch
# SDPA (flash and cuDNN backends) and FlexAttention (torch.compile'd, dynamo reset per variant),
# bf16 forward, medians of triton.testing.do_bench. Writes JSON to $OUT/peers_forward.json.
#   python3 peers_forward.py [--quick]
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

QUICK = "--quick" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
TOKENS = 32768  # batch x seq of the sweep, as bench_cuda_forward
torch._dynamo.config.cache_size_limit = 1024


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d * (0.5 if causal else 1.0)


def fresh_flex():
    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


rows = []


def timed(group, name, b, h, s, d, causal, fn):
    try:
        with torch.no_grad():
            fn()
            torch.cuda.synchronize()
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
        row = dict(group=group, name=name, B=b, H=h, S=s, D=d, causal=causal, ms=ms,
                   tflops=flops(b, h, s, d, causal) / ms / 1e9)
    except Exception as error:  # a peer that cannot run this shape is reported, not fatal
        row = dict(group=group, name=name, B=b, H=h, S=s, D=d, causal=causal,
                   error=str(error)[:200])
    rows.append(row)
    print(row, flush=True)


def measure(group, b, h, s, d, causal, variants, sdpa=True):
    q, k, v = [torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    if sdpa and "none" in variants:
        for backend, name in [(SDPBackend.FLASH_ATTENTION, "sdpa_flash"),
                              (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn")]:
            def run(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            timed(group, name, b, h, s, d, causal, run)
    mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s) if causal else None
    slopes = torch.exp2(-8.0 * torch.arange(1, h + 1, device="cuda") / h)
    bias = torch.randn(h, s, s, device="cuda", dtype=torch.bfloat16) if "bias" in variants else None
    mods = {
        "none": None,
        "softcap": lambda score, b_, h_, qi, ki: 30.0 * torch.tanh(score / 30.0),
        "alibi": lambda score, b_, h_, qi, ki: score + slopes[h_] * (ki - qi),
        "bias": lambda score, b_, h_, qi, ki: score + bias[h_, qi, ki],
    }
    for variant in variants:
        flex = fresh_flex()
        mod = mods[variant]
        timed(group, "flex_" + variant, b, h, s, d, causal,
              lambda flex=flex, mod=mod: flex(q, k, v, score_mod=mod, block_mask=mask))
    del q, k, v, bias


print({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
       "gpu": torch.cuda.get_device_name()}, flush=True)
for d in (128, 64):
    for causal in (False, True):
        measure("main", 4, 16, 4096, d, causal, ["none", "softcap", "alibi", "bias"])
if not QUICK:
    for s in (512, 1024, 2048, 4096, 8192, 16384):
        for causal in (False, True):
            measure("sweep", TOKENS // s, 16, s, 128, causal, ["none", "softcap"])
json.dump({"torch": torch.__version__, "rows": rows},
          open(os.path.join(OUT, "peers_forward.json"), "w"), indent=1)
