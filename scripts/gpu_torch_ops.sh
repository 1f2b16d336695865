#!/usr/bin/env bash
# The torch ops on the GPU machine: builds the package with the CUDA ops through pip (no build
# isolation: the machine's own nanobind, scikit-build-core and torch) into BUILD/site, and runs
# tests/python/test_torch_ops.py against it, the CUDA tests included.
#   bash scripts/gpu_torch_ops.sh [BUILD_DIR]        (default build-torch-ops; kept for rebuilds)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${1:-build-torch-ops}"
[[ "$BUILD" == /* ]] || BUILD="$ROOT/$BUILD"
PY="${PYTHON:-python3}"
# The CUDA tests fail rather than skip without a device, torch or the CUDA ops (tests/python/conftest.py).
export TQKV_REQUIRE_CUDA=1
"$PY" -c "import torch, nanobind; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(), 'nanobind', nanobind.__version__)"
echo "== pip install (CUDA ops, sm_90)"
start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install -q --no-build-isolation --no-deps --upgrade \
  --target "$BUILD/site" -C build-dir="$BUILD/skb" -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 . || exit 1
echo "== built in $(( $(date +%s) - start )) s"
export PYTHONPATH="$BUILD/site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import tqkv.torch as tq; print('tqkv CUDA ops:', tq.has_cuda)"
echo "== pytest tests/python/test_torch_ops.py"
cd tests/python && "$PY" -m pytest -q -p no:cacheprovider -rs test_torch_ops.py
