#!/usr/bin/env bash
# Stages a full vLLM for the end-to-end check on the GPU machine (no vLLM, no network; each call
# carries at most 64 MiB of ignored files): resolves vLLM VERSION's dependencies for the GPU
# machine's Python, leaves out what its image has (torch 2.11 and the CUDA libraries under it,
# triton, numpy, transformers and their dependencies — the list SKIP), downloads the rest as wheels
# into .whl/vllm-VERSION/ and cuts them into .whl/vllm-VERSION-parts/part-NNN of < 64 MiB each.
#   bash scripts/stage_vllm_wheels.sh [VERSION] [PYTHON_VERSION]     (defaults 0.26.0, 3.11)
# Then, one call per part (carry .whl/vllm-VERSION-parts/part-NNN), on the GPU machine:
#   mkdir -p /tmp/parts && cp .whl/vllm-VERSION-parts/part-* /tmp/parts/
# and in a last call: cat /tmp/parts/part-* | tar x -C /tmp/wheels &&
#   pip install --no-index --find-links /tmp/wheels --no-deps /tmp/wheels/*.whl && bash the e2e test.
# At 0.26.0 / Python 3.11 (2026-12-07) this is about 1.5 GB of wheels: ~25 parts and as many
# calls, more than one session's GPU time; the sizes are printed at the end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
V="${1:-0.26.0}"
PYV="${2:-3.11}"
DIR="$ROOT/.whl/vllm-$V"
PARTS="$ROOT/.whl/vllm-$V-parts"
SKIP='^(torch|torchaudio|torchvision|triton|nvidia-.*|cuda-.*|numpy|transformers|tokenizers|huggingface-hub|safetensors|filelock|fsspec|jinja2|markupsafe|mpmath|networkx|sympy|packaging|pyyaml|regex|requests|certifi|charset-normalizer|idna|urllib3|tqdm|typing-extensions|setuptools|hf-xet)=='
mkdir -p "$DIR" "$PARTS"
command -v uv > /dev/null || python3 -m pip install -q uv
echo "vllm==$V" > "$DIR/in.txt"
uv pip compile -q --python-version "$PYV" --python-platform x86_64-manylinux_2_28 "$DIR/in.txt" -o "$DIR/all.txt"
grep -E '^[A-Za-z0-9]' "$DIR/all.txt" | sed 's/ .*//' | grep -viE "$SKIP" > "$DIR/need.txt"
echo "== $(wc -l < "$DIR/need.txt") wheels to stage (of $(grep -cE '^[A-Za-z0-9]' "$DIR/all.txt") in vLLM $V's closure)"
# This machine's own tags (x86_64 glibc Linux); a Python other than PYV here needs --python-version.
py_here="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
[ "$py_here" = "$PYV" ] && TAGS=() || TAGS=(--python-version "$PYV")
python3 -m pip download -q --no-deps --only-binary=:all: "${TAGS[@]}" -d "$DIR" -r "$DIR/need.txt"
rm -f "$PARTS"/part-*
tar cf - -C "$DIR" $(cd "$DIR" && ls *.whl) | split -b 63m -d -a 3 - "$PARTS/part-"
du -sh "$DIR"/*.whl | sort -h | tail -8
echo "== total $(du -ch "$DIR"/*.whl | tail -1 | cut -f1) in $(ls "$DIR"/*.whl | wc -l) wheels; $(ls "$PARTS" | wc -l) parts of < 64 MiB in $PARTS"
