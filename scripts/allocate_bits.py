#!/usr/bin/env python3
"""Per-layer key/value bit widths for a bit budget, from a per-layer sensitivity scan.

The scan is a `tqkv eval --json` run of two specs per compressed layer l (every other layer
f16), on calibration text that is *not* the evaluation text:

    k<KS>v8+c+only<l>   keys at KS bits, values at 8: the KL that layer l's keys cause
    k8v<VS>+c+only<l>   values at VS bits, keys at 8: the KL that layer l's values cause

(`--scan-specs` prints that list; `--suffix +sink1+w7` scans with those options on, e.g.
attention sinks and a recent window, and appends them to the spec it prints.) The model of the allocation: KL is additive over layers and
over keys/values, and each term scales with the Lloyd-Max distortion D(b) of its width,

    KL(b_k, b_v) = sum_l  a_l D(b_k,l) / D(KS)  +  c_l D(b_v,l) / D(VS),

with a_l, c_l the scan's KLs. Every extra bit of a layer's keys or values costs the same
bytes (head_dim / 8), and each term is convex in its width, so adding one bit at a time where
it lowers KL the most is optimal. The budget is bits per element of the compressed layers'
slots, metadata (two fp16 norms per slot) included, as `tqkv eval` counts it.

    scripts/allocate_bits.py SCAN.json --budget 4.375 [--centre] [--tqkv build/release/tqkv]

prints the cache spec (k<K>v<V>+c+L<i>.<j>=k<K>v<V>...), its bits and its predicted KL.
"""
import argparse
import json
import re
import subprocess
import sys

KEY_SCAN, VALUE_SCAN = 4, 3  # widths the scan measures
MIN_BITS, MAX_BITS = 2, 8


def distortion(tqkv, dim):
    """Lloyd-Max MSE of the sphere-law codebook for 1..8 bits at this head_dim."""
    out = {}
    for b in range(1, 9):
        r = subprocess.run([tqkv, "codebook", "--bits", str(b), "--dim", str(dim), "--law", "sphere", "--json"],
                           check=True, capture_output=True, text=True)
        out[b] = json.loads(r.stdout)["mse"]
    return out


def scan_specs(layers, suffix=""):
    specs = []
    for l in layers:
        specs += [f"k{KEY_SCAN}v8+c+only{l}{suffix}", f"k8v{VALUE_SCAN}+c+only{l}{suffix}"]
    return ",".join(specs)


def load_scan(path, suffix=""):
    doc = json.load(open(path))
    rows = [r for run in doc["runs"] for r in run["rows"]]
    key, value = {}, {}
    for r in rows:
        m = re.fullmatch(r"k(\d)v(\d)\+c\+only(\d+)" + re.escape(suffix), r["format"])
        if not m:
            continue
        kb, vb, layer = int(m[1]), int(m[2]), int(m[3])
        if (kb, vb) == (KEY_SCAN, 8):
            key[layer] = max(r["kl_mean"], 1e-6)
        elif (kb, vb) == (8, VALUE_SCAN):
            value[layer] = max(r["kl_mean"], 1e-6)
    layers = sorted(set(key) & set(value))
    if not layers:
        sys.exit(f"{path}: no k{KEY_SCAN}v8+c+only<l>{suffix} / k8v{VALUE_SCAN}+c+only<l>{suffix} rows")
    return doc["head_dim"], layers, key, value


def allocate(layers, key, value, D, dim, budget):
    # Bytes of one slot: key codes + value codes + two fp16 norms.
    slot = lambda kb, vb: dim * (kb + vb) / 8 + 4
    bits = {l: [MIN_BITS, MIN_BITS] for l in layers}
    # K and V elements both count: 2 * dim per slot.
    cost = lambda: sum(slot(*bits[l]) for l in layers) * 8 / (2 * dim * len(layers))
    term = lambda l, side, b: (key[l] * D[b] / D[KEY_SCAN]) if side == 0 else (value[l] * D[b] / D[VALUE_SCAN])
    while True:
        best, gain = None, 0.0
        for l in layers:
            for side in (0, 1):
                b = bits[l][side]
                if b >= MAX_BITS:
                    continue
                g = term(l, side, b) - term(l, side, b + 1)
                if g > gain:
                    best, gain = (l, side), g
        if best is None:
            break
        bits[best[0]][best[1]] += 1
        if cost() > budget + 1e-9:
            bits[best[0]][best[1]] -= 1
            break
    kl = sum(term(l, 0, bits[l][0]) + term(l, 1, bits[l][1]) for l in layers)
    return bits, cost(), kl


def spec_string(bits, centre, options="+c"):
    groups = {}
    for l, (kb, vb) in bits.items():
        groups.setdefault((kb, vb), []).append(l)
    base = max(groups, key=lambda kv: len(groups[kv]))  # most common width: the base format
    spec = f"k{base[0]}v{base[1]}" + (options if centre else "")
    for kv, ls in sorted(groups.items()):
        if kv != base:
            spec += "+L" + ".".join(str(l) for l in sorted(ls)) + f"=k{kv[0]}v{kv[1]}"
    return spec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scan", nargs="?", help="tqkv eval --json output of the scan specs")
    ap.add_argument("--budget", type=float, default=4.375, help="bits per element (metadata included)")
    ap.add_argument("--tqkv", default="build/release/tqkv")
    ap.add_argument("--scan-specs", metavar="L0-L1", help="print the scan's specs for layers L0..L1 and exit")
    ap.add_argument("--suffix", default="", help="options every scan spec carries (e.g. +sink1+w7)")
    ap.add_argument("--options", default="+c", help="options after the base width in the printed spec (e.g. +s+skip0)")
    ap.add_argument("--assume", metavar="L,L,...=KL",
                    help="layers the scan lacks (e.g. the f16 boundary layers 0,1,28,29) with this KL for keys and values")
    args = ap.parse_args()
    if args.scan_specs:
        lo, hi = map(int, args.scan_specs.split("-"))
        print(scan_specs(range(lo, hi + 1), args.suffix))
        return
    if not args.scan:
        ap.error("a scan JSON is required")
    dim, layers, key, value = load_scan(args.scan, args.suffix)
    if args.assume:
        extra, kl = args.assume.split("=")
        for l in map(int, extra.split(",")):
            key[l] = value[l] = max(float(kl), 1e-6)
        layers = sorted(set(layers) | set(map(int, extra.split(","))))
    D = distortion(args.tqkv, dim)
    bits, b, kl = allocate(layers, key, value, D, dim, args.budget)
    print(spec_string(bits, True, args.options) + args.suffix)
    print(f"# {b:.4f} bits/element over {len(layers)} layers, predicted KL {kl:.4f} (additive model)", file=sys.stderr)
    for l in layers:
        print(f"#   L{l}: k{bits[l][0]}v{bits[l][1]}  (scan KL keys {key[l]:.4f}, values {value[l]:.4f})", file=sys.stderr)


if __name__ == "__main__":
    main()
