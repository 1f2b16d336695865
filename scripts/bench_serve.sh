#!/usr/bin/env bash
# The serving comparison of docs/journal/RESULTS-journal.md (issue 14, item 8): the same workload
# (scripts/bench_serve.py) against `tqkv serve` with several caches and against llama-server
# with f16, q8_0 and q4_0 caches (flash attention on), same model, threads, context per
# sequence and parallel sequences. Loopback only; each server is started, measured and stopped.
#
#   scripts/bench_serve.sh OUT.jsonl [bench_serve.py options...]
# Environment: TQKV (binary, default build/dev/tqkv), LLAMA_SERVER (default
# /work/peer/build/bin/llama-server; skipped when absent), MODEL, THREADS (2), LLAMA_THREADS
# (THREADS), CTX (2048 per
# sequence), SEQS (32), TQKV_SPECS ("f16 turboquant_4bit_nc tq-4.375"), LLAMA_TYPES ("f16 q8_0 q4_0"),
# TQKV_ARGS (more `tqkv serve` options, e.g. "--device cuda").
#
# PRESET=memory-bound: the cache memory is what limits the server (issue 44's comparison):
# `--kv-cache-memory` KV_MEMORY bytes (default 1 GiB) for every tqkv cache, CTX 4096, 64
# sequences, and unless bench options are given 128 requests, 64 at once, prompts of 2,000-3,000
# tokens and 64-128 out — enough that f16 must preempt (its /metrics count is printed). E.g.
#   PRESET=memory-bound TQKV_ARGS="--device cuda" LLAMA_SERVER=none scripts/bench_serve.sh out.jsonl
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?usage: bench_serve.sh OUT.jsonl [bench options]}
shift
TQKV=${TQKV:-$ROOT/build/dev/tqkv}
LLAMA_SERVER=${LLAMA_SERVER:-/work/peer/build/bin/llama-server}
MODEL=${MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
# ggml's spinning thread barrier needs idle cores (docs/journal/RESULTS-journal.md, "Serving
# benchmark on the CPU").
LLAMA_THREADS=${LLAMA_THREADS:-$THREADS}
PRESET=${PRESET:-}
case "$PRESET" in
  "") ;;
  memory-bound)
    CTX=${CTX:-4096}
    SEQS=${SEQS:-64}
    TQKV_ARGS="${TQKV_ARGS:-} --kv-cache-memory ${KV_MEMORY:-1073741824}"
    [ $# -gt 0 ] || set -- -n 128 -c 64 --prompt 2000 3000 --long-frac 0 --output 64 128
    ;;
  *) echo "PRESET: memory-bound or nothing, not '$PRESET'" >&2; exit 2 ;;
esac
CTX=${CTX:-2048}
SEQS=${SEQS:-32}
PORT=${PORT:-18300}
TQKV_SPECS=${TQKV_SPECS:-"f16 turboquant_4bit_nc tq-4.375"}
LLAMA_TYPES=${LLAMA_TYPES:-"f16 q8_0 q4_0"}
read -r -a TQKV_EXTRA <<<"${TQKV_ARGS:-}"

wait_health() {
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "server did not come up" >&2
  return 1
}

bench() {  # label, then the server command
  local label=$1
  shift
  "$@" >"$OUT.$PORT.log" 2>&1 &
  local pid=$!
  wait_health
  echo "# $label: $* ; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  python3 "$ROOT/scripts/bench_serve.py" --url "http://127.0.0.1:$PORT" --label "$label" --json "$OUT" "${BENCH_ARGS[@]}" || true
  # Preemptions over the whole run (tqkv's /metrics; llama-server has none of that name).
  curl -sf "http://127.0.0.1:$PORT/metrics" 2>/dev/null | grep -E '^tqkv_preemptions_total' | sed "s/^/# $label: /" >&2 || true
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  PORT=$((PORT + 1))
}

BENCH_ARGS=("$@")
for spec in $TQKV_SPECS; do
  bench "tqkv $spec" "$TQKV" serve -m "$MODEL" --kv-cache-dtype "$spec" --port "$PORT" --ctx "$CTX" \
    --max-seqs "$SEQS" --threads "$THREADS" "${TQKV_EXTRA[@]}"
done
if [ -x "$LLAMA_SERVER" ]; then
  for t in $LLAMA_TYPES; do
    bench "llama-server $t" "$LLAMA_SERVER" -m "$MODEL" --port "$PORT" -c $((CTX * SEQS)) -np "$SEQS" \
      -t "$LLAMA_THREADS" -ctk "$t" -ctv "$t" -fa on --no-warmup
  done
fi
