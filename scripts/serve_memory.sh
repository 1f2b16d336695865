#!/usr/bin/env bash
# The resident memory of `tqkv serve` on the CPU under many short requests: the server starts
# with room for SEQS sequences of CTX tokens, serves REQUESTS requests (prompts of 32-96 tokens,
# 16-32 out, all at once) and this prints its peak and current resident memory (VmHWM, VmRSS)
# beside the model file's size. With the paged cache the peak follows the tokens held, not
# SEQS x CTX.
#
#   scripts/serve_memory.sh [SPEC...]        (default: f16 tq-4.375)
# Environment: TQKV (binary, default build/release/tqkv), MODEL, CTX (8192), SEQS (64),
# REQUESTS (64), THREADS (2), PORT (18400).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TQKV=${TQKV:-$ROOT/build/release/tqkv}
MODEL=${MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
CTX=${CTX:-8192}
SEQS=${SEQS:-64}
REQUESTS=${REQUESTS:-64}
THREADS=${THREADS:-2}
PORT=${PORT:-18400}
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(f16 tq-4.375)

kib() { awk -v k="$2" '$1 == k":" {print $2}' "/proc/$1/status"; }

printf '%-12s %10s %10s %10s\n' cache peak_MiB now_MiB model_MiB
for spec in "${specs[@]}"; do
  "$TQKV" serve -m "$MODEL" --kv-cache-dtype "$spec" --port "$PORT" --ctx "$CTX" --max-seqs "$SEQS" \
    --threads "$THREADS" >"/tmp/serve_memory.$PORT.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break; sleep 0.2; done
  python3 "$ROOT/scripts/bench_serve.py" --url "http://127.0.0.1:$PORT" --label "$spec" -n "$REQUESTS" \
    -c "$REQUESTS" --prompt 32 96 --long-frac 0 --output 16 32 --warmup 0 >/dev/null
  printf '%-12s %10.1f %10.1f %10.1f\n' "$spec" "$(echo "$(kib $pid VmHWM) / 1024" | bc -l)" \
    "$(echo "$(kib $pid VmRSS) / 1024" | bc -l)" "$(echo "$(stat -c %s "$MODEL") / 1048576" | bc -l)"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  PORT=$((PORT + 1))
done
