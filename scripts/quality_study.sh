#!/usr/bin/env bash
# Quality per bit on SmolLM2: the table of docs/RESULTS.md's SmolLM2 section and the grid of
# docs/journal/RESULTS-journal.md ("Quality per bit"), with their plot, into $OUT (default
# build/quality). Long: ~2 h on 2 cores (STUDY=... adds the ablation specs).
#
#   scripts/quality_study.sh            (TQKV=path/to/tqkv, THREADS=N, TOKENS=20480, OUT=DIR to override)
#
# Steps: tqkv eval at ctx 512 and 4096 over TOKENS tokens of data/kjv-genesis.txt (KL and
# top-1 against the f32 cache, every format in lockstep), tqkv passkey, llama.cpp's
# llama-perplexity --kl-divergence for f16/q8_0/q4_0 caches (scripts/peer_llamacpp.sh builds
# it from the llama-cpp-python sdist), then scripts/plot_quality.py for the table and plot.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TQKV=${TQKV:-build/release/tqkv}
THREADS=${THREADS:-0}
TOKENS=${TOKENS:-20480}
OUT=${OUT:-build/quality}
mkdir -p "$OUT"
BASE="f16,fp8,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,tq-k4v2,tq-k3v2,tq-k4v3,tq-k4v4"
STUDY=${STUDY:-tq-k4v4+c,tq-4.36+skip0,turboquant_4bit_nc+skip0}
# tq-4.375-b16 / tq-3.375-b16: the budgets over the compressed layers that the tables of record
# (2026-11-29) call tq-4.375 / tq-3.375; the names now hold the all-layer recipes.
NAMED=${NAMED:-tq-4.36,tq-3.36,tq-2.75,tq-4.25+w4,tq-4.25+w32,tq-3.12+w8,tq-3.12+w64,tq-4.375-b16,tq-3.375-b16,tq-2.5,tq-4.375,tq-3.375}
# The ladder from tq-3.12+w<N> to tq-3.375: a sink, the re-allocated slots, the 6-bit window.
A3=k3v2+c+L11=k2v2+L5.7.8.9.16.18.20.26=k4v2+L14.15.17.21.23.24=k4v3
LADDER=${LADDER:-tq-3.12+sink1+fill3.375,$A3+sink1+fill3.375,$A3+wq6+fill3.375}
F512=${F512:-$BASE,$STUDY,$NAMED,$LADDER}
F4K=${F4K:-$BASE,tq-k4v4+c,$NAMED,$LADDER}
FPK=${FPK:-f16,turboquant_4bit_nc,tq-4.36,tq-4.25+w32,tq-4.375-b16,tq-3.375-b16,tq-4.375,tq-3.375}

"$TQKV" eval --formats "$F512" --ctx 512 --tokens "$TOKENS" -t "$THREADS" --json "$OUT/eval_512.json"
"$TQKV" eval --formats "$F4K" --ctx 4096 --tokens "$TOKENS" -t "$THREADS" --json "$OUT/eval_4096.json"
"$TQKV" passkey --formats "$FPK" --ctx 1024 --depths 0.1,0.5,0.9 --trials 3 -t "$THREADS" --json "$OUT/passkey.json"
"$TQKV" passkey --formats "$FPK" --ctx 4096 --depths 0.1,0.5,0.9 --trials 3 -t "$THREADS" --json "$OUT/passkey_4096.json"
scripts/peer_llamacpp.sh build
THREADS=$(nproc) scripts/peer_llamacpp.sh run 512 "$TOKENS" "$OUT/llamacpp_512.json"
THREADS=$(nproc) scripts/peer_llamacpp.sh run 4096 "$TOKENS" "$OUT/llamacpp_4096.json"
python3 scripts/plot_quality.py "$OUT/eval_512.json" "$OUT/eval_4096.json" \
  --llamacpp "$OUT/llamacpp_512.json" "$OUT/llamacpp_4096.json" --passkey "$OUT/passkey.json" "$OUT/passkey_4096.json" \
  --png "$OUT/quality_per_bit.png" --markdown "$OUT/table.md"
echo "table: $OUT/table.md, plot: $OUT/quality_per_bit.png"
