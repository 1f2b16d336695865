#!/usr/bin/env bash
# The vLLM plugin against the real vLLM on a machine without a GPU: a virtual environment with
# vLLM from PyPI (its CUDA torch wheel installs and imports without a device; about 7.5 GB),
# the plugin built into it (nvcc needed: the extension is part of what is checked), then
# vllm_plugin/tests/test_plugin.py: the entry point, registration through vLLM's own plugin
# loader (idempotent, TQKV_VLLM kill switch, VLLM_PLUGINS allow-list), the version check, every
# abstract method of vLLM's AttentionBackend / AttentionImpl implemented, slot sizes = vLLM's;
# and the kernels themselves on the CPU (vllm_plugin/tests/emu: every CUDA thread a std::thread):
# against serial references of vLLM's slot (emu/run.sh), and against vLLM's own Triton kernels run
# by Triton's interpreter on the same tensors (emu/vs_vllm.py), and the backend subclass against
# vLLM's own impl over the steps of a serving run (emu/backend_vs_vllm.py); about 12 minutes,
# EMU=0 skips them.
#   bash scripts/vllm_cpu_check.sh [VLLM_VERSION]     (default 0.26.0; VENV=build-vllm/venv)
# The environment is kept for reruns; uv is used where it is installed, else pip.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
V="${1:-0.26.0}"
VENV="${VENV:-$ROOT/build-vllm/venv}"
export PIP_NO_CACHE_DIR=1
if command -v uv > /dev/null; then
  [ -x "$VENV/bin/python" ] || uv venv -q -p 3.11 "$VENV"
  PIP=(env VIRTUAL_ENV="$VENV" uv pip)
else
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip)
fi
have="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)"
if [ "$have" != "$V" ]; then
  echo "== installing vllm==$V into $VENV"
  "${PIP[@]}" install -q "vllm==$V" pytest
fi
echo "== building tqkv-vllm (CUDA extension for sm_90; MAX_JOBS=${MAX_JOBS:=2})"
MAX_JOBS=$MAX_JOBS "${PIP[@]}" install -q --no-build-isolation --reinstall-package tqkv-vllm ./vllm_plugin 2>/dev/null ||
  MAX_JOBS=$MAX_JOBS "${PIP[@]}" install -q --no-build-isolation --force-reinstall --no-deps ./vllm_plugin
"$VENV/bin/python" -c "import vllm, torch, tqkv_vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'tqkv-vllm', tqkv_vllm.__version__, 'cuda device:', torch.cuda.is_available())" 2>&1 | grep -v "^INFO\|^WARNING"
echo "== pytest vllm_plugin/tests/test_plugin.py"
cd /tmp && "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$ROOT/vllm_plugin/tests/test_plugin.py"
if [ "${EMU:-1}" != 0 ]; then
  echo "== the kernels on the CPU against serial references (vllm_plugin/tests/emu/run.sh)"
  bash "$ROOT/vllm_plugin/tests/emu/run.sh"
  echo "== the kernels on the CPU against vLLM's Triton kernels in Triton's interpreter (emu/vs_vllm.py)"
  "$VENV/bin/python" "$ROOT/vllm_plugin/tests/emu/vs_vllm.py" 2>&1 | grep -vE "^INFO|RuntimeWarning|^  (output|return)"
  echo "== the backend subclass against vLLM's impl, step by step (emu/backend_vs_vllm.py)"
  "$VENV/bin/python" "$ROOT/vllm_plugin/tests/emu/backend_vs_vllm.py" 2>&1 |
    grep -vE "^INFO|RuntimeWarning|^  (output|return)|^W[0-9]{4} "
fi
