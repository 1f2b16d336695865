#!/usr/bin/env python3
"""What each part of a recipe costs a step (issue 44, item 1): `tqkv bench decode` over the recipe
and the specs that take its parts away one at a time, side by side with the f16 cache and the
uniform preset of its size, in one process per round (rounds alternate the order), on one device.

The parts of a recipe spec (recipes/*.json, e.g. SmolLM2's tq-4.375
`k5v4+c+skip0+L11.29=k3v2+...+sink1+wq6+fill4.375`): the per-layer pairs, key centring (`+c`),
the f16 sinks (`+sink<S>`) and the recent window (`+wq6+fill<B>` or `+w<N>`). The variants:

  recipe            the recipe as fitted
  -window           without the recent window (sinks kept)
  -sinks            without the sinks (window kept)
  -copies           neither: the compressed layers alone
  -copies-centring  and no centring
  uniform           the recipe's base pair on every layer (`k5v4+skip0`): the per-layer pairs' cost

Prints markdown tables: decode tokens/s per (batch, depth) and prefill tokens/s, each variant's
ratio to f16; attention's time in a decode step, and what each part adds to it (the variant with
it minus the one without).

  python3 scripts/cost_model.py --tqkv build/release/tqkv [--model M] [--recipe tq-4.375]
      [--device cpu|cuda] [--depths 1024,4096] [--batch 1,16] [-n 16] [--threads 2] [--rounds 2]
      [--prefill-chunk 0] [--json OUT] [--replay OUT]
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe_spec(model: str, name: str) -> str:
    base = os.path.basename(model)
    for f in sorted(os.listdir(os.path.join(ROOT, "recipes"))):
        if not f.endswith(".json"):
            continue
        with open(os.path.join(ROOT, "recipes", f), encoding="utf-8") as fh:
            d = json.load(fh)
        if d.get("model", {}).get("file") != base:
            continue
        for r in d.get("recipes", []):
            if r["name"] == name:
                return r["spec"]
    sys.exit(f"cost_model: no recipe {name} for {base} in recipes/")


def without(spec: str, *patterns: str) -> str:
    for p in patterns:
        spec = re.sub(r"\+" + p + r"(?=\+|$)", "", spec)
    return spec


def variants(spec: str) -> dict:
    window = (r"wq\d+", r"fill[\d.]+", r"w\d+")
    v = {"recipe": spec, "-window": without(spec, *window), "-sinks": without(spec, r"sink\d+")}
    v["-copies"] = without(spec, r"sink\d+", *window)
    v["-copies-centring"] = without(v["-copies"], "c", "s")
    base = spec.split("+")[0]
    v["uniform"] = base + "+skip0"
    return v


def bench(args, formats, order):
    cmd = [args.tqkv, "bench", "decode", "-m", args.model, "--device", args.device, "--json", "-n", str(args.n),
           "--depths", args.depths, "--batch", args.batch, "--prefill-chunk", str(args.prefill_chunk),
           "--formats", ",".join(formats[i] for i in order)]
    if args.device == "cpu":
        cmd += ["-t", str(args.threads)]
    else:
        cmd += ["--cuda-graphs", "on"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["rows"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tqkv", default=os.path.join(ROOT, "build/release/tqkv"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--recipe", default="tq-4.375")
    ap.add_argument("--preset", default="turboquant_4bit_nc", help="the uniform preset beside it")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--depths", default="1024,4096")
    ap.add_argument("--batch", default="1")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=0)
    ap.add_argument("--json", help="write every round's rows here")
    ap.add_argument("--replay", help="print the tables of an earlier --json instead of measuring")
    args = ap.parse_args()

    v = variants(recipe_spec(args.model, args.recipe))
    names = ["f16", args.preset] + list(v)
    specs = ["f16", args.preset] + list(v.values())
    rounds = []
    if args.replay:
        with open(args.replay, encoding="utf-8") as fh:
            rounds = json.load(fh)["rounds"]
    for r in range(0 if args.replay else args.rounds):
        order = list(range(len(specs))) if r % 2 == 0 else list(reversed(range(len(specs))))
        rows = bench(args, specs, order)
        rounds.append(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"names": names, "specs": specs, "rounds": rounds}, fh, indent=1)

    # Mean over rounds of value(row) per (spec, batch, depth); the bench labels rows by their spec.
    def mean(value):
        acc = {}
        for rows in rounds:
            for row in rows:
                acc.setdefault((row["format"], row["batch"], row["depth"]), []).append(value(row))
        return {k: sum(x) / len(x) for k, x in acc.items()}

    dec = mean(lambda row: row["decode_tokens_per_s"])
    pre = mean(lambda row: row["prefill_tokens_per_s"])
    # Attention's part of a decode step (µs): the bench's attention share of the step's time. The
    # parts are attention work; the whole step's time also carries the weights' products, whose
    # noise on a shared machine is larger than a part's cost.
    attn = mean(lambda row: row["attention_share"] * 1e6 * row["batch"] / row["decode_tokens_per_s"])
    cells = sorted({(b, d) for (_, b, d) in dec})
    print(f"{args.recipe} = `{v['recipe']}`; {args.device}, {args.rounds} rounds, -n {args.n}"
          + (f", {args.threads} threads" if args.device == "cpu" else "") + "\n")
    head = " | ".join(f"b{b} x {d}" for b, d in cells)
    print(f"| decode tokens/s (x f16) | {head} | prefill tokens/s at {cells[-1][1]} (x f16) |")
    print("|---" * (len(cells) + 2) + "|")
    for name, spec in zip(names, specs):
        out = []
        for b, d in cells:
            x, f = dec[(spec, b, d)], dec[("f16", b, d)]
            out.append(f"{x:,.1f} ({x / f:.2f})")
        b, d = cells[-1]
        p, pf = pre[(spec, b, d)], pre[("f16", b, d)]
        print(f"| {name} | " + " | ".join(out) + f" | {p:,.0f} ({p / pf:.2f}) |")
    print("\nAttention's time in a decode step, µs (the step's attention share x its time), and what a part adds "
          "(the variant with it minus the one without):\n")
    print("| attention µs / step | " + " | ".join(f"b{b} x {d}" for b, d in cells) + " |")
    print("|---" * (len(cells) + 1) + "|")
    for name, spec in zip(names, specs):
        print(f"| {name} | " + " | ".join(f"{attn[(spec, b, d)]:,.0f}" for b, d in cells) + " |")
    parts = [("recent window", "recipe", "-window"), ("sinks", "recipe", "-sinks"),
             ("copies (both)", "recipe", "-copies"), ("centring", "-copies", "-copies-centring"),
             ("per-layer pairs vs one pair", "-copies-centring", "uniform")]
    for label, a, b_ in parts:
        out = [f"{attn[(v[a], b, d)] - attn[(v[b_], b, d)]:+,.0f}" for b, d in cells]
        print(f"| + {label} | " + " | ".join(out) + " |")


if __name__ == "__main__":
    main()
