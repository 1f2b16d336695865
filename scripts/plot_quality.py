#!/usr/bin/env python3
"""Quality per bit (issue 6): the table and the plot from `tqkv eval --json` plus the
llama.cpp numbers of scripts/peer_llamacpp.sh.

    scripts/plot_quality.py EVAL_JSON... [--llamacpp JSON ...] [--passkey JSON...]
                            [--png build/quality/quality_per_bit.png] [--markdown OUT.md]

x: bits per element of the compressed layers, metadata included (llama.cpp: its cache type's
bits, every layer); y: mean KL divergence against the reference cache (ours: f32; llama.cpp:
its f16 cache, which is what its --kl-divergence-base run stores), log scale.
"""
import argparse
import json
import math
import os


def load_rows(path):
    d = json.load(open(path))
    rows = []
    for run in d["runs"]:
        for r in run.get("rows", []):
            r = dict(r)
            r.setdefault("ctx", run["ctx"])
            r["engine"] = "tqkv"
            r["chunks"] = run["chunks"]
            rows.append(r)
    return d, rows


def load_llama(paths):
    rows = []
    for p in paths:
        try:
            d = json.load(open(p))
        except (OSError, ValueError):
            continue
        for r in d["rows"]:
            if r.get("ppl") is None:
                continue
            r = dict(r)
            r["bits_all_layers"] = r["bits_per_element"]
            rows.append(r)
    return rows


def markdown(ours, llama, passkey):
    out = []
    ctxs = sorted({r["ctx"] for r in ours} | {r["ctx"] for r in llama})
    for ctx in ctxs:
        rs = [r for r in ours if r["ctx"] == ctx]
        ls = [r for r in llama if r["ctx"] == ctx]
        f16 = next((r["ppl"] for r in rs if r["format"] == "f16"), None)
        chunks = rs[0]["chunks"] if rs else (ls[0]["chunks"] if ls else 0)
        scored = rs[0]["scored_tokens"] if rs else 0
        out.append(f"\n#### Context {ctx}: {chunks} chunks of {ctx} tokens ({chunks * ctx} tokens of text, "
                   f"{scored} scored)\n")
        out.append("| format | bits/elem | bits/elem, all layers | cache B/token | PPL | ΔPPL vs f16 | KL | top-1 |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in rs:
            d = f"{100 * (r['ppl'] / f16 - 1):+.2f}%" if f16 else ""
            out.append(f"| `{r['format']}` | {r['bits_per_element']:.4g} | {r['bits_all_layers']:.4g} | "
                       f"{r['bytes_per_token']:.0f} | {r['ppl']:.4f} | {d} | {r['kl_mean']:.5f} ± {r['kl_stderr']:.5f} | "
                       f"{r['top1']:.4f} |")
        for r in ls:
            base = r.get("ppl_base")
            d = f"{100 * (r['ppl'] / base - 1):+.2f}% (vs its f16)" if base else ""
            bpt = 2 * 30 * 3 * 64 * r["bits_per_element"] / 8
            kl = r["kl_mean"] if r["kl_mean"] is not None else float("nan")
            t1 = r["top1"] if r["top1"] is not None else float("nan")
            kse = f" ± {r['kl_stderr']:.5f}" if r.get("kl_stderr") is not None else ""
            out.append(f"| {r['format']} | {r['bits_per_element']:.4g} | {r['bits_per_element']:.4g} | {bpt:.0f} | "
                       f"{r['ppl']:.4f} | {d} | {kl:.5f}{kse} (vs its f16) | {t1:.4f} |")
    if passkey:
        cells = passkey["cells"]
        out.append("\n#### Passkey retrieval (correct / trials per cell)\n")
        depths = sorted({c["depth"] for c in cells})
        out.append("| format | ctx | " + " | ".join(f"depth {d:g}" for d in depths) + " |")
        out.append("|---|---|" + "---|" * len(depths))
        keys = []
        for c in cells:
            k = (c["format"], c["ctx"])
            if k not in keys:
                keys.append(k)
        for f, ctx in keys:
            row = [f"`{f}`", str(ctx)]
            for d in depths:
                c = next((c for c in cells if c["format"] == f and c["ctx"] == ctx and c["depth"] == d), None)
                row.append(f"{c['correct']}/{c['trials']}" if c else "")
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def short_label(fmt):
    """Plot label: a spec's per-layer lists (L<i>.<j>=k<K>v<V>) shortened to one 'L..'."""
    if len(fmt) <= 28:
        return fmt
    import re
    rest = re.sub(r"\+L[\d.]+=k\d+v\d+", "", fmt)
    return rest.replace("+", "+L..+", 1) if rest != fmt else fmt


def plot(ours, llama, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(9, 6))
    markers = {512: "o", 4096: "s"}
    for ctx in sorted({r["ctx"] for r in ours}):
        rs = [r for r in ours if r["ctx"] == ctx and r["format"] not in ("f32", "f16") and r["kl_mean"] > 0]
        ax.scatter([r["bits_per_element"] for r in rs], [r["kl_mean"] for r in rs], marker=markers.get(ctx, "^"),
                   color="tab:blue" if ctx == 512 else "tab:green", label=f"tqkv, ctx {ctx}", zorder=3)
        for i, r in enumerate(sorted(rs, key=lambda r: (r["bits_per_element"], r["kl_mean"]))):
            ax.annotate(f"{short_label(r['format'])} ({ctx})", (r["bits_per_element"], r["kl_mean"]), fontsize=6,
                        xytext=(5, -2), textcoords="offset points")
    for ctx in sorted({r["ctx"] for r in llama}):
        ls = [r for r in llama if r["ctx"] == ctx and r["kl_mean"] and r["kl_mean"] > 0]
        ax.scatter([r["bits_per_element"] for r in ls], [r["kl_mean"] for r in ls], marker=markers.get(ctx, "^"),
                   color="tab:red", label=f"llama.cpp, ctx {ctx} (KL vs its f16)", zorder=3)
        for r in ls:
            ax.annotate(r["format"], (r["bits_per_element"], r["kl_mean"]), fontsize=6, color="tab:red",
                        xytext=(3, -8), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xticks([2.5, 3, 3.5, 4, 4.5, 5, 6, 8])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("bits per element (compressed layers, metadata included)")
    ax.set_ylabel("mean KL divergence vs uncompressed cache (nats/token)")
    ax.set_title("SmolLM2-135M-Instruct, KJV Genesis: quality per bit of KV-cache formats (f16: KL ~1e-6, off the plot)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)  # the default folder is under build/
    fig.savefig(png, dpi=130)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("eval_json", nargs="+")
    ap.add_argument("--llamacpp", nargs="*", default=[])
    ap.add_argument("--passkey", nargs="*", default=[])
    ap.add_argument("--png", default="build/quality/quality_per_bit.png")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    ours, seen = [], set()
    for p in a.eval_json:  # several runs of one ctx merge; a (format, ctx) keeps its first row
        for r in load_rows(p)[1]:
            if (r["format"], r["ctx"]) not in seen:
                seen.add((r["format"], r["ctx"]))
                ours.append(r)
    llama = load_llama(a.llamacpp)
    pk = None
    for p in a.passkey:
        try:
            cells = json.load(open(p))["cells"]
        except (OSError, ValueError, KeyError):
            continue
        pk = pk or {"cells": []}
        pk["cells"] += cells
    md = markdown(ours, llama, pk)
    if a.markdown:
        open(a.markdown, "w").write(md)
    print(md)
    plot(ours, llama, a.png)


if __name__ == "__main__":
    main()
