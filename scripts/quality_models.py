#!/usr/bin/env python3
"""Quality study on several models (issue 13, item 5): the per-model table, JSON summary and
goal checks from the files of scripts/quality_models.sh, and the bits-vs-KL plot of all models.

    scripts/quality_models.py table build/quality/models/TAG [--model GGUF] [--text FILE]
        -> TAG/table.md and TAG/summary.json
    scripts/quality_models.py plot build/quality/models/TAG... --svg build/quality/quality_bits_kl.svg

Bits per element count the metadata (norms, scales) at the model's head_dim and are averaged
over every layer (`bits_all_layers`: vLLM's presets keep 2 first and 2 last layers in f16,
llama.cpp's q8_0 / q4_0 quantize every layer at 8.5 / 4.5 bits). KL: ours is KL(p_f32 || p)
against our f32 cache, llama.cpp's against its own f16 cache (its --kl-divergence-base run).
"""
import argparse
import hashlib
import json
import os
import sys

LLAMA_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def eval_files(d, ctx):
    """eval_<ctx>.json, then eval_<ctx>_<part>.json in name order (runs over other tokens or
    devices: a GPU run over 20K tokens beside a CPU run of the formats the GPU does not take)."""
    extra = sorted(f for f in os.listdir(d) if f.startswith(f"eval_{ctx}_") and f.endswith(".json"))
    return [f for f in [f"eval_{ctx}.json"] + extra if os.path.exists(os.path.join(d, f))]


def eval_rows(d, ctx):
    """Every row of every eval file of ctx, each with its run ("run": file name) and the
    perplexity of that run's f16 row (or f32's, where the run has no f16) as "ppl_ref": rows of
    different runs score different tokens, so each is compared within its own run."""
    rows = []
    for name in eval_files(d, ctx):
        doc = load_json(os.path.join(d, name))
        for run in (doc or {}).get("runs", []):
            by = {r["format"]: r for r in run.get("rows", [])}
            ref = by.get("f16") or by.get("f32")
            for r in run.get("rows", []):
                r = dict(r, engine="tqkv", ctx=run["ctx"], chunks=run["chunks"], run=name,
                         device=doc.get("device", "cpu"), ppl_ref=ref["ppl"] if ref else None,
                         ppl_ref_format=ref["format"] if ref else None)
                rows.append(r)
    return rows


def llama_rows(d, ctx, f16_bytes):
    doc = load_json(os.path.join(d, f"llamacpp_{ctx}.json"))
    rows = []
    for r in (doc or {}).get("rows", []):
        if r.get("ppl") is None:
            continue
        r = dict(r, device=doc.get("device", "cpu"))  # "device": where its llama-perplexity ran
        r["bits_all_layers"] = r["bits_per_element"]
        # the same layers and heads as our f16 cache, at the cache type's bits
        r["bytes_per_token"] = f16_bytes * r["bits_per_element"] / 16 if f16_bytes else None
        rows.append(r)
    return rows


def fmt_kl(r):
    if r.get("kl_mean") is None:
        return ""
    se = f" ± {r['kl_stderr']:.5f}" if r.get("kl_stderr") is not None else ""
    return f"{r['kl_mean']:.5f}{se}"


def ctx_table(ctx, ours, llama):
    out = []
    if not ours and not llama:
        return out
    head = ours[0] if ours else llama[0]
    scored = f", {head['scored_tokens']} scored" if "scored_tokens" in head else ""
    out.append(f"\nctx {ctx}: {head['chunks']} chunk{'s' if head['chunks'] > 1 else ''} of {ctx} tokens ({head['chunks'] * ctx} tokens of text{scored})"
               + (" — rows of other runs say their own scored tokens" if len({r["run"] for r in ours}) > 1 else "") + "\n")
    out.append("| format | bits/elem (compressed layers) | bits/elem, all layers | cache B/token | PPL | ΔPPL vs f16 | KL | top-1 | scored tokens (run) |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for r in ours:
        if r["format"] == "f32":
            continue
        ref = r.get("ppl_ref")
        d = f"{100 * (r['ppl'] / ref - 1):+.2f}%" if ref else ""
        if ref and r.get("ppl_ref_format") == "f32":
            d += " (vs f32)"
        out.append(f"| `{r['format']}` | {r['bits_per_element']:.4g} | {r['bits_all_layers']:.4g} | "
                   f"{r['bytes_per_token']:.0f} | {r['ppl']:.4f} | {d} | {fmt_kl(r)} | {r['top1']:.4f} | "
                   f"{r.get('scored_tokens', '')} ({r['run']}, {r['device']}) |")
    for r in llama:
        base = r.get("ppl_base")
        d = f"{100 * (r['ppl'] / base - 1):+.2f}% (vs its f16)" if base else ""
        bpt = f"{r['bytes_per_token']:.0f}" if r.get("bytes_per_token") else ""
        t1 = f"{r['top1']:.4f}" if r.get("top1") is not None else ""
        kl = fmt_kl(r)
        out.append(f"| {r['format']} | {r['bits_per_element']:.4g} | {r['bits_per_element']:.4g} | {bpt} | "
                   f"{r['ppl']:.4f} | {d} | {kl + ' (vs its f16)' if kl else ''} | {t1} | "
                   f"{r.get('chunks', 0)} chunk{'s' if r.get('chunks', 0) > 1 else ''} (llama.cpp, {r['device']}) |")
    return out


def passkey_table(pk):
    cells = pk["cells"]
    depths = sorted({c["depth"] for c in cells})
    out = ["\nPasskey retrieval (correct / trials per cell)\n",
           "| format | ctx | " + " | ".join(f"depth {x:g}" for x in depths) + " |",
           "|---|---|" + "---|" * len(depths)]
    keys = []
    for c in cells:
        if (c["format"], c["ctx"]) not in keys:
            keys.append((c["format"], c["ctx"]))
    for f, ctx in keys:
        by = {c["depth"]: c for c in cells if c["format"] == f and c["ctx"] == ctx}
        out.append(f"| `{f}` | {ctx} | " + " | ".join(
            f"{by[x]['correct']}/{by[x]['trials']}" if x in by else "" for x in depths) + " |")
    return out


def goals(rows, pk):
    """The goals of issue 13 item 6, checked on whatever contexts were measured."""
    res = []

    def within(t, preset):  # no more bits than the preset, both over the compressed layers and all layers
        return (t["bits_per_element"] <= preset["bits_per_element"] + 1e-9
                and t["bits_all_layers"] <= preset["bits_all_layers"] + 1e-9)

    for ctx in sorted({r["ctx"] for r in rows}):
        at = [r for r in rows if r["ctx"] == ctx]
        by = {}
        for r in at:
            by.setdefault(r["format"], r)
        t4, t3 = by.get("tq-4.375"), by.get("tq-3.375")

        def peer(fmt, t):  # the comparator from t's own run where that run has it (same tokens)
            same = [r for r in at if r["format"] == fmt and t is not None and r.get("run") == t.get("run")]
            return same[0] if same else by.get(fmt)
        nc4, nc3 = peer("turboquant_4bit_nc", t4), peer("turboquant_3bit_nc", t3)
        q4 = by.get("llama.cpp q4_0")
        if nc4 and t4:
            ok_bits = within(t4, nc4)
            ok_half = t4["kl_mean"] <= 0.5 * nc4["kl_mean"]
            ok_q4 = q4 is None or q4.get("kl_mean") is None or t4["kl_mean"] <= q4["kl_mean"]
            res.append({
                "ctx": ctx, "goal": "within turboquant_4bit_nc's bits: KL <= 1/2 of its and <= llama.cpp q4_0's",
                "format": "tq-4.375", "bits": t4["bits_per_element"], "budget": nc4["bits_per_element"],
                "bits_all": t4["bits_all_layers"], "budget_all": nc4["bits_all_layers"],
                "kl": t4["kl_mean"], "kl_turboquant_4bit_nc": nc4["kl_mean"],
                "kl_llama_q4_0": q4.get("kl_mean") if q4 else None,
                "met": bool(ok_bits and ok_half and ok_q4) if q4 is not None else None,
                "half_met": bool(ok_bits and ok_half)})
        if nc3 and t3 and t3.get("ppl_ref") and nc3.get("ppl_ref"):
            d = t3["ppl"] / t3["ppl_ref"] - 1
            res.append({
                "ctx": ctx, "goal": "within turboquant_3bit_nc's bits: PPL within +2% of f16",
                "format": "tq-3.375", "bits": t3["bits_per_element"], "budget": nc3["bits_per_element"],
                "bits_all": t3["bits_all_layers"], "budget_all": nc3["bits_all_layers"],
                "dppl": d, "dppl_turboquant_3bit_nc": nc3["ppl"] / nc3["ppl_ref"] - 1,
                "met": bool(within(t3, nc3) and d <= 0.02)})
    if pk:
        cells = pk["cells"]
        bits = {r["format"]: r["bits_all_layers"] for r in rows if r["engine"] == "tqkv"}
        ref = {(c["ctx"], c["depth"]): c["correct"] for c in cells if c["format"] == "f16"}
        for f in sorted({c["format"] for c in cells} - {"f16"}):
            if bits.get(f, 0) < 3.5:
                continue
            mine = [c for c in cells if c["format"] == f]
            res.append({
                "goal": "passkey equal to f16 at every depth (>= 3.5 bits)", "format": f, "bits": bits[f],
                "cells": {f"ctx {c['ctx']} depth {c['depth']:g}": f"{c['correct']}/{c['trials']} (f16 {ref.get((c['ctx'], c['depth']))})"
                          for c in mine},
                "met": all(c["correct"] >= ref.get((c["ctx"], c["depth"]), 0) for c in mine)})
    return res


def goal_lines(gs):
    out = ["\nGoals (issue 13 item 6)\n", "| goal | ctx | measured (bits: compressed layers / all layers) | met? |", "|---|---|---|---|"]
    for g in gs:
        if "kl" in g:
            q4 = f", q4_0 {g['kl_llama_q4_0']:.5f}" if g.get("kl_llama_q4_0") is not None else ", q4_0 not measured"
            m = (f"`tq-4.375` {g['bits']:.4g} / {g['bits_all']:.4g} bits (budget {g['budget']:.4g} / {g['budget_all']:.4g}): KL {g['kl']:.5f} vs "
                 f"`turboquant_4bit_nc` {g['kl_turboquant_4bit_nc']:.5f} "
                 f"({g['kl_turboquant_4bit_nc'] / max(g['kl'], 1e-12):.1f}× less){q4}")
        elif "dppl" in g:
            m = (f"`tq-3.375` {g['bits']:.4g} / {g['bits_all']:.4g} bits (budget {g['budget']:.4g} / {g['budget_all']:.4g}): {100 * g['dppl']:+.2f}% "
                 f"(`turboquant_3bit_nc` {100 * g['dppl_turboquant_3bit_nc']:+.2f}%)")
        else:
            m = f"`{g['format']}` ({g['bits']:.4g} bits): " + ", ".join(f"{k}: {v}" for k, v in g["cells"].items())
        met = "**yes**" if g["met"] else "no"
        if g["met"] is None:
            met = f"half of the preset's: {'yes' if g['half_met'] else 'no'}; q4_0: not measured"
        out.append(f"| {g['goal']} | {g.get('ctx', '')} | {m} | {met} |")
    return out


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def table(args):
    d = args.dir
    rows, md = [], []
    ctxs = sorted({int(f[len(p):-5]) for f in os.listdir(d) for p in ("eval_", "llamacpp_")
                   if f.startswith(p) and f[len(p):-5].isdigit()})
    for ctx in ctxs:
        ours = eval_rows(d, ctx)
        f16b = next((r["bytes_per_token"] for r in ours if r["format"] == "f16"), None)
        llama = llama_rows(d, ctx, f16b)
        rows += ours + llama
        md += ctx_table(ctx, ours, llama)
    pk = load_json(os.path.join(d, "passkey.json"))
    if pk:
        md += passkey_table(pk)
    gs = goals(rows, pk)
    md += goal_lines(gs)
    summary = {"model": args.model and os.path.basename(args.model),
               "text": args.text and os.path.basename(args.text),
               "text_sha256": sha256(args.text) if args.text else None,
               "kl_reference": {"tqkv": "f32 cache", "llama.cpp": "llama.cpp f16 cache"},
               "rows": rows, "passkey": pk["cells"] if pk else None, "goals": gs}
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(d, "table.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


def plot(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(args.dirs)
    cols = min(2, n)
    rws = (n + cols - 1) // cols
    fig, axes = plt.subplots(rws, cols, figsize=(6.4 * cols, 4.6 * rws), squeeze=False)
    for ax, d in zip(axes.flat, args.dirs):
        s = load_json(os.path.join(d, "summary.json"))
        if not s:
            print(f"{d}: no summary.json (run the table step)", file=sys.stderr)
            continue
        title = (s.get("model") or os.path.basename(d)).replace(".gguf", "")
        ax.set_title(f"{title}\n({s.get('text') or ''})", fontsize=9)
        ctxs = sorted({r["ctx"] for r in s["rows"]})
        for ctx in ctxs:
            fill = ctx == ctxs[0]  # filled: the shortest context, hollow: the longer one
            for engine, marker, color in (("tqkv", "o", "tab:blue"), ("llama.cpp", "s", "tab:red")):
                pts = [r for r in s["rows"] if r["ctx"] == ctx and r["engine"] == engine
                       and r.get("kl_mean") and r["kl_mean"] > 1e-5]
                if not pts:
                    continue
                xs = [r["bits_all_layers"] for r in pts]
                ys = [r["kl_mean"] for r in pts]
                ax.scatter(xs, ys, marker=marker, s=36, color=color if fill else "none", edgecolors=color,
                           label=f"{engine}, ctx {ctx}")
                for r, x, y in zip(pts, xs, ys):
                    ax.annotate(r["format"].replace("llama.cpp ", ""), (x, y), fontsize=6,
                                xytext=(3, 2 if fill else -7), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per element, all layers (metadata included, model's head_dim)")
        ax.set_ylabel("mean KL divergence (tqkv vs f32 cache, llama.cpp vs its f16)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.svg) or ".", exist_ok=True)  # the default folder is under build/
    fig.savefig(args.svg)
    print(f"wrote {args.svg}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("dir")
    t.add_argument("--model")
    t.add_argument("--text")
    t.set_defaults(fn=table)
    pl = sub.add_parser("plot")
    pl.add_argument("dirs", nargs="+")
    pl.add_argument("--svg", default="build/quality/quality_bits_kl.svg")
    pl.set_defaults(fn=plot)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
