#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's source page
(docs/journal/RESULTS-journal.md, "The newest position folded in").

    ncu --set full --warp-sampling-interval 0 --kernel-name regex:K --launch-count N -o rep CMD
    ncu -i rep.ncu-rep --page source --csv --print-source sass > k.csv
    scripts/ncu_stalls.py k.csv [--top 20]

For each profiled kernel in the export: its SASS size, warp instructions executed, the warp-state
samples by stall reason, and the instructions that hold the most samples (with their two main
reasons). Samples are per warp: warps parked at a barrier count as much as the one they wait for,
so read the reasons, not the shares, as the critical path.
"""
import argparse
import collections
import csv


def kernels(path):
    out, cur = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                cur = {"name": row[1], "rows": []}
                out.append(cur)
            elif row[0] == "Address":
                cur["hdr"] = {n: i for i, n in enumerate(row)}
            elif cur is not None:
                cur["rows"].append(row)
    return out


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    for k in kernels(a.csv):
        h, rows = k["hdr"], k["rows"]
        samples = [num(r[h["Warp Stall Sampling (All Samples)"]]) for r in rows]
        total = sum(samples)
        if total == 0:
            continue
        executed = sum(num(r[h["Instructions Executed"]]) for r in rows)
        reasons = [n for n in h if n.startswith("stall_") and "Not Issued" not in n]
        by = collections.Counter({n[6:]: sum(num(r[h[n]]) for r in rows) for n in reasons})
        print(f"== {k['name'][:110]}")
        print(f"   {len(rows)} SASS instructions, {executed:.0f} warp instructions executed, {total:.0f} samples")
        print("   " + ", ".join(f"{n} {100 * v / total:.0f}%" for n, v in by.most_common(8)))
        for i in sorted(sorted(range(len(rows)), key=lambda i: -samples[i])[: a.top]):
            r = rows[i]
            two = sorted(((num(r[h[n]]), n[6:]) for n in reasons), reverse=True)[:2]
            print(f"   {i:5d} {100 * samples[i] / total:5.1f}%  {r[h['Source']].strip()[:60]:60s} "
                  + " ".join(f"{n}:{v:.0f}" for v, n in two))


if __name__ == "__main__":
    main()
