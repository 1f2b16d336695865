#!/usr/bin/env bash
# One command for the GPU machine: builds with CUDA, runs the CUDA kernel and op tests and the
# engine's CUDA-vs-CPU tests, then generates with --device cuda and --device cpu for a few
# cache specs and prints both answers and their timings side by side.
#   bash scripts/gpu_check.sh [BUILD_DIR]          (default build-gpu; needs the model:
#                                                   scripts/fetch_model.sh)
# Without Debian's libxxhash-dev / libcpp-httplib-dev (the GPU machine's image has neither), it
# unpacks .deps/libxxhash*.deb and .deps/libcpp-httplib*.deb (apt-get download them here and
# carry them) into /tmp/xx and points CMake at them.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${1:-build-gpu}"
# On the GPU machine a CUDA test that finds no device fails rather than skips (tests/common/require_cuda.h).
export TQKV_REQUIRE_CUDA=1
JOBS="${JOBS:-$(nproc)}"
EXTRA=()
# The same for cpp-httplib (src/serve), which the GPU machine's image lacks too.
if [[ ! -f /usr/include/httplib.h ]] && compgen -G ".deps/libcpp-httplib*.deb" >/dev/null; then
  mkdir -p /tmp/xx
  for d in .deps/libcpp-httplib*.deb; do dpkg -x "$d" /tmp/xx; done
  EXTRA+=(-DTQKV_HTTPLIB_INCLUDE=/tmp/xx/usr/include -DTQKV_HTTPLIB_LIB=/tmp/xx/usr/lib/x86_64-linux-gnu/libcpp-httplib.so)
  export LD_LIBRARY_PATH="/tmp/xx/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [[ ! -f /usr/include/xxhash.h ]] && compgen -G ".deps/libxxhash*.deb" >/dev/null; then
  mkdir -p /tmp/xx
  for d in .deps/libxxhash*.deb; do dpkg -x "$d" /tmp/xx; done
  LIB="$(find /tmp/xx -name 'libxxhash.so*' | sort | head -1)"
  [[ -e /tmp/xx/usr/lib/x86_64-linux-gnu/libxxhash.so ]] && LIB=/tmp/xx/usr/lib/x86_64-linux-gnu/libxxhash.so
  EXTRA+=(-DTQKV_XXHASH_LIB="$LIB" -DTQKV_XXHASH_INCLUDE=/tmp/xx/usr/include)
  export LD_LIBRARY_PATH="$(dirname "$LIB")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "== xxhash from .deps: $LIB"
fi
NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"

echo "== configure + build ($BUILD)"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTQKV_WERROR=ON -DTQKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DTQKV_BUILD_BENCH=OFF -DTQKV_CUDA_BENCH=OFF "${EXTRA[@]}" >/dev/null || exit 1
cmake --build "$BUILD" -j "$JOBS" --target tqkv_cuda_tests tqkv_cuda_engine_tests tqkv_cli || exit 1

status=0
echo "== nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== CUDA kernels and ops vs the CPU reference"
"$BUILD/tests/cuda/tqkv_cuda_tests" --gtest_brief=1 || status=1
echo "== the engine on the GPU vs the CPU"
"$BUILD/tests/engine/tqkv_cuda_engine_tests" || status=1

MODEL="models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ -f "$MODEL" ]]; then
  PROMPT="Tell me a short story about a robot who learns to paint."
  for spec in f16 turboquant_4bit_nc turboquant_k8v4 tq-4.375 tq-3.375; do
    echo "== tqkv generate --kv-cache-dtype $spec (greedy, 64 tokens)"
    for dev in cpu cuda; do
      out="$("$BUILD/tqkv" generate -m "$MODEL" -p "$PROMPT" -n 64 --kv-cache-dtype "$spec" --device "$dev" -q 2>&1)"
      rc=$?
      [[ $rc -ne 0 ]] && status=1
      printf -- '-- %s (exit %d)\n%s\n' "$dev" "$rc" "$out"
      printf '%s' "$out" | head -n -1 > "/tmp/tqkv_gen_${spec}_${dev}.txt"
    done
    if cmp -s "/tmp/tqkv_gen_${spec}_cpu.txt" "/tmp/tqkv_gen_${spec}_cuda.txt"; then
      echo "-- $spec: cpu and cuda answers identical"
    else
      echo "-- $spec: answers differ (bf16 weights on the GPU; the engine tests bound the logit KL)"
    fi
  done
  echo "== tqkv eval, ctx 512, 4096 tokens of Genesis, per device (PPL and KL vs that device's f32 cache)"
  if [[ -f data/kjv-genesis.txt ]]; then
    for dev in cuda cpu; do
      echo "-- $dev"
      "$BUILD/tqkv" eval -m "$MODEL" -f data/kjv-genesis.txt --ctx 512 --tokens 4096 \
        --formats "${EVAL_FORMATS:-f16,turboquant_4bit_nc,tq-4.375,tq-3.375}" --device "$dev" 2>/dev/null || status=1
    done
  else
    echo "(no data/kjv-genesis.txt: scripts/fetch_text.sh)"
  fi
else
  echo "(no model at $MODEL: scripts/fetch_model.sh; generate comparison skipped)"
fi
echo "== gpu_check: $([[ $status -eq 0 ]] && echo PASS || echo FAIL)"
exit $status
