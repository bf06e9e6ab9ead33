# Joins bench_cuda_forward's JSON (one file per engine: cuda, cudnn) and peers_forward.py's (same
# run) into one table of TFLOP/s with ratios, forward and forward+backward, lists what
# was skipped and why, and plots the sequence-length sweep (forward).
#   python3 report.py --ours cuda.json [cudnn.json ...] --peers peers.json --table table.md \
#       [--plot sweep.png]
import argparse
import json

OURS = [("cuda", "cuda"), ("cudnn", "cudnn")]  # (engine, column)
PEERS = [("sdpa_flash", "SDPA flash"), ("sdpa_cudnn", "SDPA cuDNN"), ("flex", "Flex")]
PASSES = [("fwd", "fwd"), ("fwdbwd", "fwd+bwd")]
VARIANTS = ["none", "softcap", "softcap_wide", "alibi", "bias"]  # softcap_wide: ours only
GRAD_VARIANTS = ["alibi_grad", "bias_grad"]  # forward+backward with the tensor's gradient


def load(path):
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError) as error:
        print(f"skip: {path}: {error}")
        return {"rows": []}


def head_dims(row):
    """(q/k, v) head dims of a row; rows without "Dv" have V as wide as Q and K."""
    return (row.get("D"), row.get("Dv", row.get("D")))


def find(rows, group, name, s, d, causal, pass_, b=None):
    """The timed row of the problem; d: the q/k head dim, or a (q/k, v) pair."""
    dims = d if isinstance(d, tuple) else (d, d)
    for row in rows:
        if (row.get("group"), row.get("name"), row.get("S"), head_dims(row), row.get("causal"),
                row.get("pass", "fwd")) == (group, name, s, dims, causal, pass_) \
                and (b is None or row.get("B") == b) and "tflops" in row:
            return row
    return None


def tflops(row):
    return None if row is None else row["tflops"]


def fmt(value):
    return "-" if value is None else f"{value:.0f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


def plan_times(rows):
    """Cold seconds and warm milliseconds of our plans ('-': not measured)."""
    def seconds(row, key, scale, digits):
        value = None if row is None else row.get(key)
        return "-" if value is None else f"{scale * value:.{digits}f}"
    cold = " / ".join(seconds(r, "plan_cold_s", 1, 2) for r in rows)
    warm = " / ".join(seconds(r, "plan_warm_s", 1000, 1) for r in rows)
    return cold, warm


def table(ours, peers):
    """The markdown table: each of ours against each peer, per pass, head dim, mask, modifier."""
    header = ["pass", "D", "mask", "modifier"] + [c for _, c in OURS] + [c for _, c in PEERS]
    header += [f"{o} / {p}" for _, o in OURS for _, p in PEERS]
    header += ["plan cold s (cuda / cudnn)", "plan warm ms (cuda / cudnn)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for pass_, pass_label in PASSES:
        for d in (128, 64):
            for causal in (False, True):
                for variant in VARIANTS + (GRAD_VARIANTS if pass_ == "fwdbwd" else []):
                    mine = [find(ours, "main", f"{engine}_{variant}", 4096, d, causal, pass_)
                            for engine, _ in OURS]
                    # SDPA has no modifiers: its plain attention is the bar for every row.
                    theirs = [find(peers, "main", name if name.startswith("sdpa") else
                                   f"{name}_{variant}", 4096, d, causal, pass_)
                              for name, _ in PEERS]
                    if all(r is None for r in mine) and theirs[-1] is None:
                        continue  # not measured in this run (--quick, or a variant not timed)
                    mine_t = [tflops(r) for r in mine]
                    theirs_t = [tflops(r) for r in theirs]
                    cells = [pass_label, str(d), "causal" if causal else "none", variant]
                    cells += [fmt(t) for t in mine_t + theirs_t]
                    cells += [ratio(m, t) for m in mine_t for t in theirs_t]
                    cells += list(plan_times(mine))
                    lines.append("| " + " | ".join(cells) + " |")
    return lines


def skipped(ours_files, peers):
    """One line per distinct reason something was not measured."""
    notes = []
    for data in ours_files:
        if data.get("skipped"):
            notes.append(f"- {data.get('engine', '?')}: not run: {data['skipped']}")
    seen = set()
    for data in ours_files:
        for row in data.get("rows", []):
            for field, verdict in (("skipped", "refused"), ("error", "error")):
                if field not in row:
                    continue
                key = (row.get("engine"), row.get("pass"), row.get("variant"), row[field])
                if key not in seen:
                    seen.add(key)
                    pass_label = dict(PASSES).get(row.get("pass"), row.get("pass"))
                    notes.append(f"- {row.get('engine')} {pass_label} {row.get('variant')}: "
                                 f"{verdict}: {row[field]}")
    for row in peers:
        if "error" not in row:
            continue
        key = (row.get("name"), row.get("pass", "fwd"), row["error"][:80])
        if key not in seen:
            seen.add(key)
            pass_label = dict(PASSES).get(row.get("pass", "fwd"))
            notes.append(f"- {row.get('name')} {pass_label} (D {row.get('D')}, S {row.get('S')}): "
                         f"error: {row['error'][:160]}")
    return notes


def sweep_table(ours, peers):
    """The sequence sweep's rows (forward, head dim 128) as a markdown table, or no lines."""
    lengths = sorted({r["S"] for r in ours + peers if r.get("group") == "sweep"})
    if not lengths:
        return []
    columns = [("cuda_none", ours), ("cuda_softcap", ours), ("sdpa_flash", peers),
               ("flex_none", peers), ("flex_softcap", peers)]
    lines = ["| S | B | mask | " + " | ".join(name for name, _ in columns)
             + " | cuda_none / sdpa_flash | cuda_softcap / flex_softcap |",
             "|---" * (len(columns) + 5) + "|"]
    for causal in (False, True):
        for s in lengths:
            values = [tflops(find(rows, "sweep", name, s, 128, causal, "fwd"))
                      for name, rows in columns]
            lines.append(f"| {s} | {32768 // s} | {'causal' if causal else 'none'} | "
                         + " | ".join(fmt(v) for v in values)
                         + f" | {ratio(values[0], values[2])} | {ratio(values[1], values[4])} |")
    return lines


def dims_table(ours, peers):
    """The other head dims (group dims: bench_cuda_forward --dims) as a markdown table."""
    dims = sorted({head_dims(r) for r in ours + peers if r.get("group") == "dims"}, reverse=True)
    if not dims:
        return []
    columns = [("cuda", ours, True), ("cudnn", ours, True), ("sdpa_flash", peers, False),
               ("sdpa_cudnn", peers, False), ("flex", peers, True)]
    lines = ["| pass | D | mask | modifier | " + " | ".join(c[0] for c in columns)
             + " | cuda / flex | cuda / sdpa_flash | cuda / sdpa_cudnn | cudnn / sdpa_cudnn |",
             "|---" * (len(columns) + 8) + "|"]
    for pass_, pass_label in PASSES:
        for d in dims:
            for causal in (False, True):
                for variant in ("none", "softcap"):
                    # SDPA has no modifiers: its plain attention is the bar for every row.
                    values = [tflops(find(rows, "dims", f"{name}_{variant}" if suffix else name,
                                          4096, d, causal, pass_))
                              for name, rows, suffix in columns]
                    if all(v is None for v in values):
                        continue
                    label = str(d[0]) if d[0] == d[1] else f"{d[0]}/{d[1]}"
                    lines.append(f"| {pass_label} | {label} | {'causal' if causal else 'none'} | "
                                 f"{variant} | " + " | ".join(fmt(v) for v in values)
                                 + f" | {ratio(values[0], values[4])} | "
                                 f"{ratio(values[0], values[2])} | {ratio(values[0], values[3])} | "
                                 f"{ratio(values[1], values[3])} |")
    return lines


def plot(ours, peers, path):
    sweep_lengths = sorted({r["S"] for r in ours + peers if r.get("group") == "sweep"})
    if not sweep_lengths:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        print(f"skip: plot {path}: {error}")
        return
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    series = [("cuda_none", ours, "cuda (ours), no modifier", "-o"),
              ("cuda_softcap", ours, "cuda (ours), softcap 30", "-s"),
              ("cudnn_none", ours, "cudnn (ours), no modifier", "-.o"),
              ("cudnn_softcap", ours, "cudnn (ours), softcap 30", "-.s"),
              ("sdpa_flash", peers, "SDPA flash, no modifier", "--o"),
              ("sdpa_cudnn", peers, "SDPA cuDNN, no modifier", "--^"),
              ("flex_none", peers, "FlexAttention, no modifier", ":o"),
              ("flex_softcap", peers, "FlexAttention, softcap 30", ":s")]
    for axis, causal in zip(axes, (False, True)):
        for name, rows, label, style in series:
            points = [(s, tflops(find(rows, "sweep", name, s, 128, causal, "fwd")))
                      for s in sweep_lengths]
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
    figure.suptitle("flexattn engines vs peers, H200, forward")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours", nargs="+", required=True, help="bench_cuda_forward JSON files")
    parser.add_argument("--peers", required=True, help="peers_forward.py JSON")
    parser.add_argument("--table", required=True, help="markdown table to write")
    parser.add_argument("--plot", help="PNG of the sequence sweep (when the run has one)")
    args = parser.parse_args()
    ours_files = [load(path) for path in args.ours]
    ours = [row for data in ours_files for row in data.get("rows", [])]
    peers = load(args.peers).get("rows", [])
    lines = table(ours, peers)
    dims = dims_table(ours, peers)
    if dims:
        lines += ["", "Other head dims (bf16, B 4, H 16, S 4096, TFLOP/s):", ""] + dims
    sweep = sweep_table(ours, peers)
    if sweep:
        lines += ["", "Sequence sweep (forward, D 128, batch x seq = 32768, TFLOP/s):", ""] + sweep
    notes = skipped(ours_files, peers)
    if notes:
        lines += ["", "Not measured:"] + notes
    text = "\n".join(lines)
    with open(args.table, "w") as file:
        file.write(text + "\n")
    print(text)
    if args.plot:
        plot(ours, peers, args.plot)


if __name__ == "__main__":
    main()
