# Joins bench_cuda_forward's and peers_forward.py's JSON (same device call) into one table of
# TFLOP/s with ratios, and plots the sequence-length sweep.
#   python3 report.py ours.json peers.json table.md sweep.png
import json
import sys

ours_path, peers_path, table_path, plot_path = sys.argv[1:5]
ours = json.load(open(ours_path))["rows"]
peers = json.load(open(peers_path))["rows"]


def find(rows, group, name, s, d, causal, b=None):
    for row in rows:
        if (row["group"], row["name"], row["S"], row["D"], row["causal"]) == (group, name, s, d, causal) \
                and (b is None or row["B"] == b) and "tflops" in row:
            return row["tflops"]
    return None


def fmt(value):
    return "-" if value is None else f"{value:.0f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


# The targets: softcap against FlexAttention's softcap (1.5x); everything else against
# SDPA's flash backend (1.0x).
lines = ["| D | mask | modifier | cuda | SDPA flash | SDPA cuDNN | Flex (same modifier) | "
         "cuda / SDPA flash | cuda / Flex | plan cold s | plan warm ms |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
for d in (128, 64):
    for causal in (False, True):
        for variant in ("none", "softcap", "alibi", "bias"):
            mine = find(ours, "main", "cuda_" + variant, 4096, d, causal)
            flash = find(peers, "main", "sdpa_flash", 4096, d, causal)
            cudnn = find(peers, "main", "sdpa_cudnn", 4096, d, causal)
            flex = find(peers, "main", "flex_" + variant, 4096, d, causal)
            row = next((r for r in ours if r["group"] == "main" and r["name"] == "cuda_" + variant
                        and r["D"] == d and r["causal"] == causal), {})
            lines.append(
                f"| {d} | {'causal' if causal else 'none'} | {variant} | {fmt(mine)} | {fmt(flash)} | "
                f"{fmt(cudnn)} | {fmt(flex)} | {ratio(mine, flash)} | {ratio(mine, flex)} | "
                f"{row.get('plan_cold_s', 0):.2f} | {1000 * row.get('plan_warm_s', 0):.1f} |")
table = "\n".join(lines)
open(table_path, "w").write(table + "\n")
print(table)

sweep_lengths = sorted({r["S"] for r in ours if r["group"] == "sweep"})
if sweep_lengths:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    series = [("cuda_none", ours, "cuda (ours), no modifier", "-o"),
              ("cuda_softcap", ours, "cuda (ours), softcap 30", "-s"),
              ("sdpa_flash", peers, "SDPA flash, no modifier", "--o"),
              ("sdpa_cudnn", peers, "SDPA cuDNN, no modifier", "--^"),
              ("flex_none", peers, "FlexAttention, no modifier", ":o"),
              ("flex_softcap", peers, "FlexAttention, softcap 30", ":s")]
    for axis, causal in zip(axes, (False, True)):
        for name, rows, label, style in series:
            points = [(s, find(rows, "sweep", name, s, 128, causal)) for s in sweep_lengths]
            points = [(s, v) for s, v in points if v is not None]
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sweep_lengths, [str(s) for s in sweep_lengths])
        axis.set_xlabel("sequence length (batch x seq = 32768, 16 heads, head dim 128, bf16)")
        axis.set_title("causal" if causal else "no mask")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("forward TFLOP/s")
    axes[1].legend(fontsize=8)
    figure.suptitle("flexattn cuda engine vs peers, H200, forward")
    figure.tight_layout()
    figure.savefig(plot_path, dpi=110)
