#!/usr/bin/env bash
# vLLM's own Python files (its Triton TurboQuant store/decode kernels and what they import) from
# the vLLM wheel on PyPI, for tests that compare tqkv's kernels with vLLM's where vLLM is not
# installed (the GPU machine): unpacks every vllm/**/*.py of the wheel (no compiled library)
# into .peer/vllm-VERSION/ and packs them as .peer/vllm-VERSION-py.tgz (about 7 MB, to carry).
# Both are git-ignored; nothing of vLLM is committed.
#   bash scripts/fetch_vllm_kernels.sh [VERSION]        (default 0.26.0)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
V="${1:-0.26.0}"
PEER="$ROOT/.peer"
mkdir -p "$PEER/wheel"
WHEEL="$(ls "$PEER"/wheel/vllm-"$V"-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$WHEEL" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$PEER/wheel" "vllm==$V"
  WHEEL="$(ls "$PEER"/wheel/vllm-"$V"-*.whl | head -1)"
fi
rm -rf "$PEER/vllm-$V"
mkdir -p "$PEER/vllm-$V"
python3 - "$WHEEL" "$PEER/vllm-$V" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    z.extractall(dest, names)
print(f"{len(names)} Python files of {wheel.rsplit('/', 1)[-1]}")
PY
test -f "$PEER/vllm-$V/vllm/v1/attention/ops/triton_turboquant_store.py"
tar czf "$PEER/vllm-$V-py.tgz" -C "$PEER/vllm-$V" vllm
echo "fetch_vllm_kernels: $PEER/vllm-$V ($(du -sh "$PEER/vllm-$V" | cut -f1)), $PEER/vllm-$V-py.tgz ($(du -h "$PEER/vllm-$V-py.tgz" | cut -f1))"
