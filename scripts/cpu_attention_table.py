#!/usr/bin/env python3
"""Runs `tqkv bench attention --json` over the issue-3 grid and prints markdown tables.

Usage: scripts/cpu_attention_table.py TQKV_BINARY [--min-time S] [--layout slot|page] [--ctx 1024,4096,...]
       scripts/cpu_attention_table.py TQKV_BINARY --before OLD_BINARY [--rounds N] [--formats a,b] ...
Grid: context 1K/4K/8K/32K x batch 1/16 x (head_dim 128, 8 kv heads, GQA 4:1) and
(head_dim 64, 3 kv heads, GQA 3:1), every format, ratios against f16 measured in the same
process. Prints one table per (dim, batch); a cell is: seconds per step · million
tokens*heads per second · cache GB read per second · speed-up vs f16 in wall time (and in
process CPU time, steadier on a shared machine).

With --repeats N, every cell runs N times (the grid in order, N passes) and one compact table per
layout gives each format's median speed-up vs f16 over the passes (wall, then CPU time), with the
load average seen at each run.

With --before, the two binaries run alternately (which runs first swaps every round), --rounds times per cell, and one compact
table per layout gives each format's speed-up vs f16 before -> after: each binary's best
step of each format over the rounds against its own best f16 step (wall, then CPU time).
"""
import argparse
import json
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tqkv")
    ap.add_argument("--min-time", default="0.5")
    ap.add_argument("--layout", default="slot")
    ap.add_argument("--ctx", default="1024,4096,8192,32768")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--threads", default="0", help="attention threads (0: all)")
    ap.add_argument("--before", help="a second binary, run alternately (before/after table)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--formats", default="", help="formats (default: all)")
    ap.add_argument("--repeats", type=int, default=0, help="median table over this many passes")
    a = ap.parse_args()
    ctxs = [int(c) for c in a.ctx.split(",")]
    if a.before:
        return before_after(a, ctxs)
    if a.repeats:
        return median_table(a, ctxs)
    for dim in [int(d) for d in a.dims.split(",")]:
        heads, gqa = (8, 4) if dim == 128 else (3, 3)
        for batch in [int(b) for b in a.batch.split(",")]:
            results = {}
            for ctx in ctxs:
                results[ctx] = bench(a, a.tqkv, dim, heads, gqa, batch, ctx)
            formats = list(results[ctxs[0]].keys())
            print(f"\n#### head_dim {dim}, {heads} kv heads x GQA {gqa}, batch {batch}, {a.layout} layout\n")
            print("| format | " + " | ".join(f"ctx {c}" for c in ctxs) + " |")
            print("|---|" + "---|" * len(ctxs))
            for f in formats:
                cells = []
                for c in ctxs:
                    r = results[c][f]
                    cells.append(f"{r['seconds_per_step'] * 1e3:.3g} ms · {r['tokens_heads_per_s'] / 1e6:.1f} M · "
                                 f"{r['bytes_per_s'] / 1e9:.2f} GB/s · **{r['speedup_vs_f16']:.2f}x** "
                                 f"({r['cpu_speedup_vs_f16']:.2f}x cpu)")
                print(f"| {f} | " + " | ".join(cells) + " |")
            sys.stdout.flush()


def bench(a, binary, dim, heads, gqa, batch, ctx):
    cmd = [binary, "bench", "attention", "--ctx", str(ctx), "--batch", str(batch), "--dim", str(dim), "--gqa",
           str(gqa), "--kv-heads", str(heads), "--layout", a.layout, "--min-time", a.min_time, "--threads", a.threads,
           "--json"] + (["--formats", a.formats] if a.formats else [])
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {r["format"]: r for r in json.loads(out)}


def median_table(a, ctxs):
    import os
    import statistics
    cells = [(dim, batch, ctx) for dim in [int(d) for d in a.dims.split(",")] for batch in
             [int(b) for b in a.batch.split(",")] for ctx in ctxs]
    runs, loads, formats = {}, [], []  # (cell, format) -> [(wall ratio, cpu ratio)]
    for _ in range(a.repeats):
        for dim, batch, ctx in cells:
            heads, gqa = (8, 4) if dim == 128 else (3, 3)
            loads.append(os.getloadavg()[0])
            for f, r in bench(a, a.tqkv, dim, heads, gqa, batch, ctx).items():
                if f not in formats:
                    formats.append(f)
                runs.setdefault(((dim, batch, ctx), f), []).append((r["speedup_vs_f16"], r["cpu_speedup_vs_f16"]))
    names = [f"d{d} b{b} {c // 1024}K" for d, b, c in cells]
    print(f"\nMedian speed-up vs f16 over {a.repeats} passes, {a.layout} layout, wall (cpu); "
          f"load average (1 min) {min(loads):.1f}-{max(loads):.1f}\n")
    print("| format | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for f in formats:
        row = []
        for cell in cells:
            rs = runs.get((cell, f), [])
            if not rs:
                row.append("-")
                continue
            row.append(f"{statistics.median(r[0] for r in rs):.2f} ({statistics.median(r[1] for r in rs):.2f})")
        print(f"| {f} | " + " | ".join(row) + " |")


def before_after(a, ctxs):
    cells, ratios, times, formats = [], {}, {}, []
    for dim in [int(d) for d in a.dims.split(",")]:
        heads, gqa = (8, 4) if dim == 128 else (3, 3)
        for batch in [int(b) for b in a.batch.split(",")]:
            for ctx in ctxs:
                cell = f"d{dim} b{batch} {ctx // 1024}K"
                cells.append(cell)
                best = {}  # (binary, format) -> [wall, cpu]
                for rnd in range(a.rounds):
                    # Swap the order every round: the binary that runs second in a pair tends to
                    # find the caches and clocks warmer, so a fixed order biases the ratio.
                    order = (a.before, a.tqkv) if rnd % 2 == 0 else (a.tqkv, a.before)
                    for binary in order:
                        for f, r in bench(a, binary, dim, heads, gqa, batch, ctx).items():
                            b = best.setdefault((binary, f), [1e300, 1e300])
                            b[0] = min(b[0], r["seconds_per_step"])
                            b[1] = min(b[1], r["cpu_seconds_per_step"])
                            if f not in formats:
                                formats.append(f)
                for f in formats:
                    ratios[(cell, f)] = [(best[(b, "f16")][0] / best[(b, f)][0], best[(b, "f16")][1] / best[(b, f)][1])
                                         for b in (a.before, a.tqkv)]
                    times[(cell, f)] = [best[(b, f)][1] for b in (a.before, a.tqkv)]
    print(f"\n{a.layout} layout: speed-up vs f16, before -> after (wall; CPU time in brackets)\n")
    print("| format | " + " | ".join(cells) + " |")
    print("|---|" + "---|" * len(cells))
    for f in formats:
        row = []
        for c in cells:
            (bw, bc), (aw, ac) = ratios[(c, f)]
            row.append(f"{bw:.2f} → **{aw:.2f}** ({bc:.2f} → {ac:.2f})")
        print(f"| {f} | " + " | ".join(row) + " |")
    print(f"\n{a.layout} layout: best CPU time per step (ms, all threads), before -> after\n")
    print("| format | " + " | ".join(cells) + " |")
    print("|---|" + "---|" * len(cells))
    for f in formats:
        print(f"| {f} | " + " | ".join(f"{times[(c, f)][0] * 1e3:.3g} → {times[(c, f)][1] * 1e3:.3g}" for c in cells) + " |")


if __name__ == "__main__":
    main()
