#!/usr/bin/env bash
# The vLLM plugin (vllm_plugin/, tqkv-vllm) on the GPU machine, in one call (about 6 minutes):
#   1. unpacks vLLM's Python files (.peer/vllm-VERSION-py.tgz, made here by
#      scripts/fetch_vllm_kernels.sh and carried: the GPU machine has no vLLM and no network);
#   2. builds the plugin's CUDA extension for sm_90 against the machine's torch (pip, no build
#      isolation, into /tmp/tqkv_vllm_site);
#   3. runs vllm_plugin/tests/test_vs_vllm_gpu.py: the store byte for byte against vLLM's Triton
#      store, decode / CUDA-graph replay / continuation chunks within tolerance of vLLM's kernels,
#      every preset at head dims 64, 128, 256;
#   4. times decode: tqkv vs vLLM's Triton TurboQuant decode vs bf16 FlashAttention, batch 1/16/64 x
#      8K/32K (vllm_plugin/bench/bench_decode.py);
#   5. where a full vLLM is installed (not on the bare machine: scripts/stage_vllm_wheels.sh), vLLM
#      end to end with and without the plugin (vllm_plugin/tests/e2e_greedy.py).
# Each step writes its own log under $OUT (default build-vllm/out) and a line to $OUT/summary.txt;
# a failing step does not stop the later ones (the bench needs the build only).
#   bash scripts/gpu_vllm_check.sh                 (carry: .peer/vllm-0.26.0-py.tgz)
# Environment: VLLM_VERSION (0.26.0), TESTS_TIMEOUT (270 s), BENCH_TIMEOUT (200 s), BENCH_ARGS; most of
# the tests' time is Triton compiling vLLM's kernels (about 45 variants).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
V="${VLLM_VERSION:-0.26.0}"
OUT="${OUT:-$ROOT/build-vllm/out}"
PY="${PYTHON:-python3}"
PEER=/tmp/vllm-peer-$V
SITE=/tmp/tqkv_vllm_site
mkdir -p "$OUT"
: > "$OUT/summary.txt"
note() { echo "$*" | tee -a "$OUT/summary.txt"; }
t0=$(date +%s)
since() { echo "$(( $(date +%s) - t0 )) s"; }

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" || true
  "$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed"
  nproc
} > "$OUT/env.txt" 2>&1
note "env: $(tr '\n' ' ' < "$OUT/env.txt")"

# 1. vLLM's files.
if [ -f "$PEER/vllm/v1/attention/ops/triton_turboquant_store.py" ] ||
   { mkdir -p "$PEER" && tar xzf ".peer/vllm-$V-py.tgz" -C "$PEER"; }; then
  note "peer: vLLM $V Python files in $PEER ($(since))"
else
  note "peer: FAILED (carry .peer/vllm-$V-py.tgz, made by scripts/fetch_vllm_kernels.sh $V)"
fi

# vLLM's Python files without its distribution: importlib.metadata.version("vllm") would raise
# (an ImportError), and vllm/triton_utils/importing.py then disables Triton and hands vLLM's
# kernels a placeholder module. The files' own version, as metadata, lets them find Triton.
mkdir -p "$PEER/vllm-$V.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$V" > "$PEER/vllm-$V.dist-info/METADATA"

# 2. The extension.
start=$(date +%s)
if MAX_JOBS="$(nproc)" TQKV_VLLM_CUDA_ARCH=90 "$PY" -m pip install -q --no-build-isolation --no-deps --upgrade \
     --target "$SITE" ./vllm_plugin > "$OUT/build.log" 2>&1 &&
   PYTHONPATH="$SITE" "$PY" -c "import tqkv_vllm.ops as o; print('max splits', o.MAX_SPLITS)" >> "$OUT/build.log" 2>&1; then
  note "build: ok in $(( $(date +%s) - start )) s"
  BUILT=1
else
  note "build: FAILED after $(( $(date +%s) - start )) s (build.log)"
  tail -40 "$OUT/build.log"
  BUILT=0
fi
export PYTHONPATH="$SITE:$ROOT/vllm_plugin/tests${PYTHONPATH:+:$PYTHONPATH}"
export TQKV_VLLM_PEER="$PEER"

# 3. Against vLLM's kernels.
if [ "$BUILT" = 1 ]; then
  TQKV_REQUIRE_CUDA=1 timeout "${TESTS_TIMEOUT:-270}" "$PY" -m pytest -q -p no:cacheprovider -rfEs \
    --junitxml="$OUT/tests.xml" vllm_plugin/tests/test_vs_vllm_gpu.py > "$OUT/tests.log" 2>&1
  rc=$?
  note "tests: rc $rc, $(tail -1 "$OUT/tests.log") ($(since))"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 | tee -a "$OUT/summary.txt"
fi

# 4. Speed.
if [ "$BUILT" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-200}" "$PY" vllm_plugin/bench/bench_decode.py --out "$OUT/bench.md" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  note "bench: rc $? ($(since))"
  tail -30 "$OUT/bench.log"
fi
# 5. End to end, only where a full vLLM is installed (scripts/stage_vllm_wheels.sh stages one).
if [ "$BUILT" = 1 ] && "$PY" -c "import vllm._C_stable_libtorch" > /dev/null 2>&1; then
  PYTHONPATH="$SITE" timeout "${E2E_TIMEOUT:-900}" "$PY" vllm_plugin/tests/e2e_greedy.py ${E2E_ARGS:-} \
    > "$OUT/e2e.log" 2>&1
  note "e2e: rc $? ($(since)); $(grep -c '"ok": true' "$OUT/e2e.log") runs equal"
else
  note "e2e: skipped (no full vLLM installed here)"
fi
echo "== summary"
cat "$OUT/summary.txt"
