#!/usr/bin/env bash
# The device-machine runs behind docs/journal/RESULTS-journal.md's "fused prefill rows" serving
# measurement (issue 14 item 9's GPU goal), in two calls because the model travels in two carries of
# < 64 MiB:
#   stage 1 (carry build-NAME with src.tgz = `git archive HEAD | gzip`, .deps/p1, .deps/*.deb):
#     unpack into /tmp/gs/src, build tqkv_cuda_engine_tests and tqkv_cli, run CudaCacheLayer.*;
#   stage 2 (carry .deps/p2, right after stage 1 while the machine is warm): assemble the model,
#     serve the same-KV-memory workload at C = 32 and 64 for f16 and for tq-4.375 with the fused
#     launch over prefill rows (TQKV_FUSED_MAX_ROWS=FM_AFTER) and without (256), then prefill
#     tokens/s of both, then (time permitting) both specs with --token-budget 2048.
#   bash scripts/gpu_serve_fused_rows.sh 1 build-NAME/src.tgz ; bash scripts/gpu_serve_fused_rows.sh 2
# Results go to $OUT.
set -uo pipefail
STAGE=${1:?stage 1 or 2}
T0=$SECONDS
R=$PWD
X=/tmp/xx/usr
export LD_LIBRARY_PATH=$X/lib/x86_64-linux-gnu
# CudaCacheLayer.* fail rather than skip without a device (tests/common/require_cuda.h).
export TQKV_REQUIRE_CUDA=1
if [ "$STAGE" = 1 ]; then
  TGZ=${2:?give the src.tgz of the branch}
  mkdir -p /tmp/gs/src /tmp/gs/m && cp .deps/p1/mpart_aa /tmp/gs/m/ && tar xzf "$TGZ" -C /tmp/gs/src
  mkdir -p /tmp/xx; for d in .deps/*.deb; do dpkg -x "$d" /tmp/xx; done
  cd /tmp/gs/src
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTQKV_WERROR=ON -DTQKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DTQKV_BUILD_BENCH=OFF -DTQKV_CUDA_BENCH=OFF -DTQKV_BUILD_PYTHON=OFF \
    -DTQKV_XXHASH_LIB=$X/lib/x86_64-linux-gnu/libxxhash.so -DTQKV_XXHASH_INCLUDE=$X/include \
    -DTQKV_HTTPLIB_INCLUDE=$X/include -DTQKV_HTTPLIB_LIB=$X/lib/x86_64-linux-gnu/libcpp-httplib.so >"$OUT/cfg.log" 2>&1 ||
    { tail -20 "$OUT/cfg.log"; exit 1; }
  cmake --build build-gpu -j 16 --target tqkv_cuda_engine_tests tqkv_cli >"$OUT/build.log" 2>&1 ||
    { grep -E "error" -A5 "$OUT/build.log" | head -40; exit 1; }
  echo "build done at $((SECONDS - T0)) s"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
  timeout 150 build-gpu/tests/engine/tqkv_cuda_engine_tests --gtest_filter='CudaCacheLayer.*' >"$OUT/cachelayer.log" 2>&1
  echo "tests rc=$?"
  grep -v "^\[ skip" "$OUT/cachelayer.log" | grep -E "^\[|Failure|Expected|Which|diff" | tail -60
  echo "total $((SECONDS - T0)) s"
  exit 0
fi
cd /tmp/gs/src
mkdir -p models
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/gs/m/mpart_aa "$R/.deps/p2/mpart_ab" >$M
sha256sum $M | cut -c1-16
B=$PWD/build-gpu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
FM_AFTER=${FM_AFTER:-1000000}
serve() {  # file, specs, then env assignments
  local f=$1 specs=$2
  shift 2
  env "$@" TQKV=$B/tqkv TQKV_ARGS="--device cuda --kv-cache-memory 1509949440 ${EXTRA:-}" CTX=8192 SEQS=64 THREADS=8 \
    TQKV_SPECS="$specs" LLAMA_SERVER=/nonexistent timeout "${TO:-120}" bash scripts/bench_serve.sh "$OUT/$f" -n 64 \
    --prompt 1024 4096 --long-prompt 6000 7500 --long-frac 0.25 --output 256 512 -c 32 64 >"$OUT/$f.log" 2>&1
  echo "$f rc=$? at $((SECONDS - T0)) s"
  grep -h "preemptions" "$OUT/$f.log"
  grep -v "^#" "$OUT/$f.log" | tail -n 6
}
echo "== serve"
serve s_f16.jsonl f16 X=1
serve s_tq_after.jsonl tq-4.375 TQKV_FUSED_MAX_ROWS="$FM_AFTER"
serve s_tq_before.jsonl tq-4.375 TQKV_FUSED_MAX_ROWS=256
echo "== prefill bench"
for fm in 256 "$FM_AFTER"; do
  TQKV_FUSED_MAX_ROWS=$fm timeout 60 "$B/tqkv" bench decode -m $M --device cuda --cuda-graphs on --batch 1 -n 4 \
    --formats f16,tq-4.375 --prefill-chunk 512 --depths 1024,4096,8192 --json >"$OUT/pf_$fm.json" 2>"$OUT/pf_$fm.err"
  echo "fm=$fm rc=$? at $((SECONDS - T0)) s"
done
if [ $((SECONDS - T0)) -lt "${BUDGET_BY:-150}" ]; then
  EXTRA="--token-budget 2048" serve s_b2048.jsonl "f16 tq-4.375" TQKV_FUSED_MAX_ROWS="$FM_AFTER"
fi
echo "total $((SECONDS - T0)) s"
