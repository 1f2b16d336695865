#!/usr/bin/env python3
"""Static instruction counts of the decode kernel's tile loop, from its SASS (the limit model
of docs/journal/RESULTS-journal.md, "Decode: a model of the limit").

    scripts/decode_sass.py [--nvcc nvcc] [--dims 64,128] [--formats a,b] [--keep DIR] [--define MACRO]

Compiles the decode kernel of the benchmark's formats (decode_kernel.cuh, sm_90) into one cubin,
disassembles it (cuobjdump -sass) and, per kernel, finds the tile loop (the backward branch
whose body holds the most HMMA, the conditional branch back), then prints per tile (the loop runs two tiles an iteration for
the ring-fed formats, one for bf16) the instructions a warp issues by class, and per cached
element (16 tokens x head_dim x {key, value}). Static counts: the rarely taken paths inside the
loop (a partial tile's masking, the rescale when a running max moves) are counted as if taken.
The "common path" column is the loop body as a full tile of a long sequence runs it (hot_path:
the block-16 copy, no masking, no rescale). cuobjdump: the CUDA toolkit's, or PyPI's
nvidia-cuda-cuobjdump (nvidia/cu13/bin/cuobjdump).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, key kind, value kind, tiles per loop iteration
FORMATS = [
    ("bf16", "K_BF16", "V_BF16", 1),
    ("fp8", "K_FP8", "V_FP8", 2),
    ("turboquant_k8v4", "K_FP8", "vuni(4)", 2),
    ("turboquant_4bit_nc", "kmse(4)", "vuni(4)", 2),
    ("turboquant_k3v4_nc", "kmse(3)", "vuni(4)", 2),
    ("turboquant_3bit_nc", "kmse(3)", "vuni(3)", 2),
    ("tq-k4v2", "kmse(4)", "vmse(2)", 2),
    ("tq-k3v2", "kmse(3)", "vmse(2)", 2),
    ("tq-k4v3", "kmse(4)", "vmse(3)", 2),
    ("tq-k4v4", "kmse(4)", "vmse(4)", 2),
    ("k5v3", "kmse(5)", "vmse(3)", 2),
    ("k6v3", "kmse(6)", "vmse(3)", 2),
    ("k6v5", "kmse(6)", "vmse(5)", 2),
    ("k6v6", "kmse(6)", "vmse(6)", 2),
]

CLASSES = [
    ("HMMA", re.compile(r"^HMMA")),
    ("LDS", re.compile(r"^LDS")),
    ("LDGSTS", re.compile(r"^LDGSTS|^LDGDEPBAR|^DEPBAR")),
    ("LDG", re.compile(r"^LDG")),
    ("SHFL/MOVM/VOTE", re.compile(r"^SHFL|^MOVM|^VOTE|^WARPSYNC|^BAR|^NOP")),
    ("MUFU", re.compile(r"^MUFU")),
    ("PRMT/LOP3/SHF", re.compile(r"^PRMT|^LOP3|^SHF|^SGXT|^BMSK|^IMAD\.SHL|^LEA")),
    ("FP32", re.compile(r"^F[A-Z]|^HADD2|^HMUL2|^HFMA2|^F2F|^F2FP")),
]


def compile_cubin(nvcc, dims, tmp, formats, defines=()):
    src = os.path.join(tmp, "decode_sass.cu")
    with open(src, "w") as f:
        f.write('#include "decode_kernel.cuh"\nnamespace tqkv::cuda::detail {\n')
        for d in dims:
            for _, kk, vk, _ in formats:
                f.write(f"template Kernel make_kernel<{d}, {kk}, {vk}>();\n")
        f.write("}\n")
    cubin = os.path.join(tmp, "decode.cubin")
    cmd = [nvcc, "-std=c++20", "-O3", "-arch=sm_90", "-cubin", "-o", cubin, "-I", os.path.join(ROOT, "include"),
           "-I", os.path.join(ROOT, "src", "cuda"), "-I", os.path.join(ROOT, "src")] + [f"-D{d}" for d in defines] + [src]
    subprocess.run(cmd, check=True)
    return cubin


def kernels(sass):
    cur, body = None, []
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if cur:
                yield cur, body
            cur, body = m.group(1), []
        elif cur:
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if m:
                body.append((int(m.group(1), 16), m.group(2).strip()))
    if cur:
        yield cur, body


def opcode(ins):
    ins = re.sub(r"^@!?U?P[T0-9]+\s+", "", ins)
    return ins.split()[0] if ins else ""


def tile_loop(body):
    best = None
    for i, (addr, ins) in enumerate(body):
        # The tile loop closes with a predicated branch back; the unconditional ones that jump
        # back are the divergence stubs' returns.
        if opcode(ins) != "BRA" or not ins.startswith("@"):
            continue
        m = re.search(r"0x([0-9a-f]+)", ins.split("BRA", 1)[1])
        if not m:
            continue
        tgt = int(m.group(1), 16)
        if tgt >= addr:
            continue
        loop = [(a, x) for a, x in body if tgt <= a <= addr]
        n_mma = sum(opcode(x).startswith("HMMA") for _, x in loop)
        if best is None or n_mma > best[0]:
            best = (n_mma, loop)
    return best[1] if best else []


def hot_path(loop):
    """The instructions of one trip through the loop body on the common path: the path from the
    loop's head to its closing branch that issues the most global loads (LDGSTS / LDG: the next
    tile's copy is issued) and, among those, has the fewest instructions (so the block-16 copy,
    not the general one; no partial-tile masking; no rescale of O when no running max moved).
    Branches that leave the loop's address range (divergence stubs) count as not taken."""
    n = len(loop)
    index = {a: i for i, (a, _) in enumerate(loop)}

    def successors(i):
        if i == n - 1:
            return [n]  # the closing branch
        ins = loop[i][1]
        op = opcode(ins)
        if op != "BRA":
            return [i + 1]  # BRA.DIV and the rest fall through
        m = re.search(r"0x([0-9a-f]+)", ins.split("BRA", 1)[1])
        tgt = index.get(int(m.group(1), 16)) if m else None
        taken = [tgt] if tgt is not None and tgt > i else []
        if ins.startswith("@!PT"):
            return [i + 1]
        if ins.startswith("@") and not ins.startswith("@PT "):
            return [i + 1] + taken
        return taken

    best = [None] * (n + 1)  # (global loads, -instructions) of the best path from i to the end
    best[n] = (0, 0)
    for i in range(n - 1, -1, -1):
        cands = [best[j] for j in successors(i) if best[j] is not None]
        if cands:
            op = opcode(loop[i][1])
            b = max(cands)
            best[i] = (b[0] + (1 if op.startswith("LDG") else 0), b[1] - 1)
    path, i = [], 0
    while 0 <= i < n and best[i] is not None:
        path.append(loop[i][1])
        i = max((j for j in successors(i) if best[j] is not None), key=lambda j: best[j], default=-1)
    return path


def demangle_args(name):
    """(d, key kind, value kind, variant VA of decode_kernel.cuh; 0 where the name has none)."""
    m = re.search(r"decode_kernelILi(\d+)ELi(\d+)ELi(\d+)E(?:Li(\d+)E)?", name)
    return tuple(int(x or 0) for x in m.groups()) if m else None


def kind_value(expr):
    cls = {"K_FP8": (1, 8), "K_F16": (2, 16), "K_BF16": (3, 16), "V_FP8": (2, 8), "V_F16": (3, 16), "V_BF16": (4, 16)}
    if expr in cls:
        c, b = cls[expr]
        return c * 32 + b
    m = re.match(r"(kmse|vmse|vuni)\((\d)\)", expr)
    c = {"kmse": 0, "vmse": 0, "vuni": 1}[m.group(1)]
    return c * 32 + int(m.group(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--keep", default="")
    ap.add_argument("--formats", default="", help="comma-separated subset of FORMATS' names")
    ap.add_argument("--cuobjdump", default="cuobjdump")
    ap.add_argument("--define", action="append", default=[],
                    help="a macro for the kernel's compile (to compare a variant of the tile loop)")
    args = ap.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    tmp = args.keep or tempfile.mkdtemp()
    os.makedirs(tmp, exist_ok=True)
    wanted = set(args.formats.split(",")) if args.formats else None
    if wanted and wanted - {f[0] for f in FORMATS}:
        sys.exit(f"unknown formats: {sorted(wanted - {f[0] for f in FORMATS})}")
    formats = [f for f in FORMATS if wanted is None or f[0] in wanted]
    cubin = compile_cubin(args.nvcc, dims, tmp, formats, args.define)
    sass = subprocess.run([args.cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    by_args = {}
    for name, body in kernels(sass):
        a = demangle_args(name)
        if a:
            by_args[a] = body
    heads = [c for c, _ in CLASSES] + ["other"]
    print("| d | format | instr/tile | common path | per element | " + " | ".join(heads) + " |")
    print("|---|---|---|---|---|" + "---|" * len(heads))
    for d in dims:
        for fname, kk, vk, per_iter in formats:
            key = (d, kind_value(kk), kind_value(vk))
            variants = sorted(a[3] for a in by_args if a[:3] == key)
            if not variants:
                print(f"| {d} | {fname} | not found |", file=sys.stderr)
            for va in variants:
                label = fname
                if len(variants) > 1:
                    label += " (" + variant_label(va, variants) + ")"
                print_row(d, label, by_args[key + (va,)], per_iter, heads)


def variant_label(va, variants):
    """The bits of decode_kernel.cuh's variant VA (kVaValueSmem = 1, kVaKey256 = 2) that differ
    among the kernels compiled for one format."""
    others = [v for v in variants if v != va]
    parts = []
    if any((v ^ va) & 1 for v in others):
        parts.append("values: shared-memory table" if va & 1 else "values: levels in registers")
    if any((v ^ va) & 2 for v in others):
        parts.append("keys: 256-byte entries" if va & 2 else "keys: 128-byte entries")
    return ", ".join(parts)


def print_row(d, label, body, per_iter, heads):
    loop = tile_loop(body)
    hot = len(hot_path(loop)) / per_iter
    loop = [x for _, x in loop]
    counts = dict.fromkeys(heads, 0)
    for ins in loop:
        op = opcode(ins)
        for c, rx in CLASSES:
            if rx.match(op):
                counts[c] += 1
                break
        else:
            counts["other"] += 1
    n = len(loop) / per_iter
    cells = " | ".join(f"{counts[h] / per_iter:.0f}" for h in heads)
    print(f"| {d} | {label} | {n:.0f} | {hot:.0f} | {n / (16 * d * 2):.3f} | {cells} |")


if __name__ == "__main__":
    main()
