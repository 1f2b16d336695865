#!/usr/bin/env python3
"""Runs `tqkv bench attention --json` over the issue-3 grid and prints markdown tables.

Usage: scripts/cpu_attention_table.py TQKV_BINARY [--min-time S] [--layout slot|page] [--ctx 1024,4096,...]
Grid: context 1K/4K/8K/32K x batch 1/16 x (head_dim 128, 8 kv heads, GQA 4:1) and
(head_dim 64, 3 kv heads, GQA 3:1), every format, ratios against f16 measured in the same
process. Prints one table per (dim, batch); a cell is: seconds per step · million
tokens*heads per second · cache GB read per second · speed-up vs f16 in wall time (and in
process CPU time, steadier on a shared machine).
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
    a = ap.parse_args()
    ctxs = [int(c) for c in a.ctx.split(",")]
    for dim in [int(d) for d in a.dims.split(",")]:
        heads, gqa = (8, 4) if dim == 128 else (3, 3)
        for batch in [int(b) for b in a.batch.split(",")]:
            results = {}
            for ctx in ctxs:
                cmd = [a.tqkv, "bench", "attention", "--ctx", str(ctx), "--batch", str(batch), "--dim", str(dim),
                       "--gqa", str(gqa), "--kv-heads", str(heads), "--layout", a.layout, "--min-time", a.min_time,
                       "--threads", a.threads, "--json"]
                print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                results[ctx] = {r["format"]: r for r in json.loads(out)}
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


if __name__ == "__main__":
    main()
