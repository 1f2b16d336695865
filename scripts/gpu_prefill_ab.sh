#!/usr/bin/env bash
# Prefill on the GPU, path against path, in one session (docs/journal/RESULTS-journal.md, "Prefill
# attention on tensor cores"): the tensor-core tiled kernel (the default), the same without
# splitting a CTA's keys (unsplit) and with CTAs of 8 warps (warps8), the rows (every query a row of
# the decode kernel), the scalar tiled kernel, and for caches with copies their rows instead of the
# parts through the tiled kernel. One `tqkv bench decode --json` process per mode and chunk size;
# then Markdown tables of prefill tokens/s per history range. Run from a tree built for the GPU
# (scripts/gpu_build_bg.sh leaves tqkv under /tmp/b).
#
#   scripts/gpu_prefill_ab.sh MODEL OUT [FORMATS] [DEPTHS]
#     FORMATS default f16,turboquant_4bit_nc,tq-4.375; DEPTHS default 1024,4096,8192,16384.
#     TQKV: the binary (default: the first tqkv under /tmp/b, else build-gpu/tqkv).
#     MODES: the paths to run (default "tensor-cores unsplit warps8 rows scalar-tiled").
#   scripts/gpu_prefill_ab.sh --table OUT     the tables again from OUT's JSON files
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

table() {
  python3 - "$1" <<'PY'
import json, pathlib, sys
cells = {}  # (chunk, format, mode) -> [(range, tokens/s)]
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    mode, chunk = f.stem.rsplit(".", 1)
    rows = json.loads(f.read_text())["rows"]
    depths = sorted({r["depth"] for r in rows})
    for r in rows[len(depths):]:  # the first format's first pass is the process's warm-up
        i = depths.index(r["depth"])
        cells.setdefault((chunk, r["format"], mode), []).append(
            (f"({depths[i - 1] if i else 0}, {r['depth']}]", r["prefill_tokens_per_s"]))
for chunk, title in (("512", "chunks of 512"), ("0", "one forward per depth step")):
    keys = sorted(k for k in cells if k[0] == chunk)
    if not keys:
        continue
    print(f"\n### prefill tokens/s, {title}\n")
    print("| format | path | " + " | ".join(r for r, _ in cells[keys[0]]) + " |")
    print("|---|---|" + "---|" * len(cells[keys[0]]))
    for k in keys:
        print(f"| {k[1]} | {k[2]} | " + " | ".join(f"{t / 1000:.1f}K" for _, t in cells[k]) + " |")
PY
}

if [ "${1:-}" = --table ]; then
  table "$2"
  exit
fi
model=$1 out=$2 formats=${3:-f16,turboquant_4bit_nc,tq-4.375} depths=${4:-1024,4096,8192,16384}
tq=${TQKV:-$(find /tmp/b -name tqkv -type f -perm -u+x 2>/dev/null | head -1)}
tq=${tq:-$ROOT/build-gpu/tqkv}
mkdir -p "$out"
modes=("tensor-cores:TQKV_PREFILL_PATH=auto"
       "unsplit:TQKV_PREFILL_PATH=auto TQKV_PREFILL_SPLITS=1"
       "warps8:TQKV_PREFILL_PATH=auto TQKV_PREFILL_WARPS=8"
       "rows:TQKV_PREFILL_PATH=rows"
       "scalar-tiled:TQKV_PREFILL_PATH=tiled TQKV_PREFILL_KERNEL=scalar")
want=" ${MODES:-tensor-cores unsplit warps8 rows scalar-tiled} "
for m in "${modes[@]}"; do
  name=${m%%:*} envs=${m#*:}
  [[ "$want" == *" $name "* ]] || continue
  for chunk in 512 0; do
    d=$depths
    [ "$chunk" = 0 ] && d="${depths%%,*},${depths##*,}"
    echo "== $name, --prefill-chunk $chunk: $envs" >&2
    # The first format twice: its first pass warms the process up (workspaces, cuBLAS, plans).
    env $envs timeout 600 "$tq" bench decode -m "$model" --device cuda --cuda-graphs on --batch 1 -n 4 \
      --formats "${formats%%,*},$formats" --prefill-chunk "$chunk" --depths "$d" --json > "$out/$name.$chunk.json"
  done
done
table "$out"
