#!/usr/bin/env bash
# Quality study on several models (issue 13, item 5; docs/journal/RESULTS-journal.md "Quality study
# on four models"): for one model and text, `tqkv eval` at ctx 512 and 4096 (every format in
# lockstep against one f32-cache reference, in one process per context), `tqkv passkey`, and
# llama.cpp's llama-perplexity --kl-divergence with f16/q8_0/q4_0 caches on the same GGUF and text
# (its KL is against its own f16 cache, ours against our f32 cache); then the table and the JSON
# summary (scripts/quality_models.py table).
#
#   scripts/quality_models.sh TAG MODEL TEXT [STEP...]
#     STEP: eval512 eval4096 passkey llama512 llama4096 table  (default: all, in that order;
#     eval<CTX> / llama<CTX> take any context, with TOKENS_<CTX> tokens)
#   e.g. scripts/quality_models.sh smollm2-135m models/SmolLM2-135M-Instruct.Q4_1.gguf build/study/kjv-genesis-exodus.txt
#
# Environment: TQKV (build/dev/tqkv), THREADS (2), TOKENS_512 / TOKENS_4096 (text tokens per
# context, floor(tokens/ctx) chunks; 20480 is the goal, the recorded runs say what they used),
# FORMATS, PK_FORMATS, PK_CTX (1024), PK_DEPTHS (0.1,0.5,0.9), PK_TRIALS (2),
# LLAMA_PERPLEXITY (/work/peer/build/bin/llama-perplexity, scripts/peer_llamacpp.sh build).
# Output: $OUT (default build/quality/models/TAG)/{eval_512,eval_4096,passkey,llamacpp_512,
# llamacpp_4096,summary}.json
# and table.md. The text of the study is Genesis+Exodus (cat data/kjv-genesis.txt
# data/kjv-exodus.txt) and, for the code model, scripts/code_text.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TAG=${1:?usage: quality_models.sh TAG MODEL TEXT [STEP...]}
MODEL=${2:?model}
TEXT=${3:?text}
shift 3
STEPS=${*:-eval512 eval4096 passkey llama512 llama4096 table}
TQKV=${TQKV:-build/dev/tqkv}
THREADS=${THREADS:-2}
TOKENS_512=${TOKENS_512:-20480}
TOKENS_4096=${TOKENS_4096:-20480}
FORMATS=${FORMATS:-f16,turboquant_k8v4,turboquant_4bit_nc,turboquant_3bit_nc,tq-4.375,tq-3.375,tq-2.5}
PK_FORMATS=${PK_FORMATS:-f16,turboquant_k8v4,turboquant_4bit_nc,tq-4.375,tq-3.375}
PK_CTX=${PK_CTX:-1024}
PK_DEPTHS=${PK_DEPTHS:-0.1,0.5,0.9}
PK_TRIALS=${PK_TRIALS:-2}
export LLAMA_PERPLEXITY=${LLAMA_PERPLEXITY:-/work/peer/build/bin/llama-perplexity}
OUT=${OUT:-build/quality/models/$TAG}
LOG=build/study/$TAG
mkdir -p "$OUT" "$LOG"
run() { echo "+ $*" >&2; nice -n 10 "$@"; }

for step in $STEPS; do
  case $step in
    eval[0-9]*)
      ctx=${step#eval}
      tokens=TOKENS_$ctx
      [ -n "${!tokens:-}" ] || eval "$tokens=20480"
      run "$TQKV" eval -m "$MODEL" -f "$TEXT" --ctx "$ctx" --tokens "${!tokens}" -t "$THREADS" \
        --formats "$FORMATS" --json "$OUT/eval_$ctx.json" > "$LOG/eval_$ctx.log" 2>&1 ;;
    passkey)
      run "$TQKV" passkey -m "$MODEL" -f "$TEXT" --ctx "$PK_CTX" --depths "$PK_DEPTHS" --trials "$PK_TRIALS" \
        -t "$THREADS" --formats "$PK_FORMATS" --json "$OUT/passkey.json" > "$LOG/passkey.log" 2>&1 ;;
    llama[0-9]*)
      ctx=${step#llama}
      tokens=TOKENS_$ctx
      [ -n "${!tokens:-}" ] || eval "$tokens=20480"
      MODEL=$MODEL TEXT=$TEXT THREADS=$THREADS LOGDIR=$LOG \
        scripts/peer_llamacpp.sh run "$ctx" "${!tokens}" "$OUT/llamacpp_$ctx.json" > "$LOG/llama_$ctx.log"
      rm -f "$LOG"/base_"$ctx"_*.kld ;;  # the saved f16 logits: n_vocab x 2 bytes per token
    table)
      python3 scripts/quality_models.py table "$OUT" --model "$MODEL" --text "$TEXT" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
