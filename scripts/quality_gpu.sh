#!/usr/bin/env bash
# The GPU half of the quality study (docs/journal/RESULTS-journal.md "Quality study on four
# models"): on a machine with CUDA and a CUDA build of tqkv, `tqkv eval --device cuda` at ctx 512
# and 4096 on Gemma-3-270m and Qwen2.5-Coder-0.5B (Genesis, and Qwen also on the code text), and
# `tqkv passkey --device cuda` on both, all at once on the one GPU (each process is small).
# Each eval writes its JSON after every chunk, so a run stopped at its limit still leaves the
# chunks it finished. A spec the CUDA cache does not take yet makes its eval fail: the eval is
# then rerun with that model's formats one by one, each against its own f32 reference (not
# after a stop at LIMIT).
#
#   scripts/quality_gpu.sh TQKV MODEL_DIR TEXT_DIR OUT_DIR
#     TEXT_DIR holds kjv-genesis-exodus.txt, kjv-exodus.txt and code.txt (scripts/quality_models.sh's texts)
#
# GEMMA_EXTRA: more formats for Gemma's evals. (Recipes are fitted on the CPU: `tqkv calibrate`'s
# key statistics read host memory, so it refuses --device cuda.)
#
# Environment: TOKENS (20480), FORMATS, PK_FORMATS, PK_CTX (1024), PK_DEPTHS (0.1,0.5,0.9),
# PK_TRIALS (2), LIMIT (seconds per process, 420). Output: OUT_DIR/<tag>_eval_<ctx>.json,
# <tag>_passkey.json and a log per process.
set -uo pipefail
TQKV=${1:?usage: quality_gpu.sh TQKV MODEL_DIR TEXT_DIR OUT_DIR}
MD=${2:?models}
TD=${3:?texts}
OUT=${4:?out}
TOKENS=${TOKENS:-20480}
FORMATS=${FORMATS:-f16,turboquant_k8v4,turboquant_4bit_nc,turboquant_3bit_nc,tq-4.375,tq-3.375,tq-2.5}
PK_FORMATS=${PK_FORMATS:-f16,turboquant_k8v4,turboquant_4bit_nc,tq-4.375,tq-3.375}
PK_CTX=${PK_CTX:-1024}
PK_DEPTHS=${PK_DEPTHS:-0.1,0.5,0.9}
PK_TRIALS=${PK_TRIALS:-2}
LIMIT=${LIMIT:-420}
G=$MD/gemma-3-270m-q4_k_m.gguf
Q=$MD/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
mkdir -p "$OUT"
GFORMATS=$FORMATS${GEMMA_EXTRA:+,$GEMMA_EXTRA}


ev() {  # tag model text ctx formats
  local tag=$1 model=$2 text=$3 ctx=$4 formats=$5 json="$OUT/$1_eval_$4.json" log="$OUT/$1_eval_$4.log"
  timeout "$LIMIT" "$TQKV" eval -m "$model" -f "$text" --ctx "$ctx" --tokens "$TOKENS" --device cuda \
    --formats "$formats" --json "$json" > "$log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || [ $rc -eq 124 ] && return  # done, or stopped at LIMIT with the chunks it finished
  echo "== all formats at once failed; one by one" >> "$log"
  for f in ${formats//,/ }; do
    timeout "$LIMIT" "$TQKV" eval -m "$model" -f "$text" --ctx "$ctx" --tokens "$TOKENS" --device cuda \
      --formats "$f" --json "$OUT/$1_eval_$4_$f.json" >> "$log" 2>&1 || echo "== $f failed" >> "$log"
  done
}
pk() {  # tag model formats
  timeout "$LIMIT" "$TQKV" passkey -m "$2" -f "$TD/kjv-genesis-exodus.txt" --ctx "$PK_CTX" --depths "$PK_DEPTHS" \
    --trials "$PK_TRIALS" --device cuda --formats "$3" --json "$OUT/$1_passkey.json" > "$OUT/$1_passkey.log" 2>&1
}

for ctx in 512 4096; do
  ev gemma-3-270m "$G" "$TD/kjv-genesis-exodus.txt" "$ctx" "$GFORMATS" &
  ev qwen2.5-coder-0.5b "$Q" "$TD/kjv-genesis-exodus.txt" "$ctx" "$FORMATS" &
  ev qwen2.5-coder-0.5b-code "$Q" "$TD/code.txt" "$ctx" "$FORMATS" &
done
pk gemma-3-270m "$G" "$PK_FORMATS" &
pk qwen2.5-coder-0.5b "$Q" "$PK_FORMATS" &
wait
