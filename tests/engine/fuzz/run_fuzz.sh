#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (libFuzzer + ASan + UBSan) and runs each from its
# committed corpus:
#
#   gguf     tests/engine/fuzz/fuzz_gguf.cpp    GGUF reader, dequantization, tokenizer   tests/engine/fuzz_corpus/
#   model    tests/engine/fuzz/fuzz_model.cpp   Model::load: config, RoPE, weights       tests/engine/fuzz_corpus_model/
#   request  tests/serve/fuzz/fuzz_request.cpp  the server's request parser (JSON body)  tests/serve/fuzz_corpus/
#
#   tests/engine/fuzz/run_fuzz.sh [SECONDS] [TARGET...]          run (default 60 s, every target)
#   tests/engine/fuzz/run_fuzz.sh --grow [SECONDS] [TARGET...]   run, then add what the run found
#
# SECONDS is the fuzzing time of the whole run, split between the targets (gguf 2/5, model and
# request 3/10 each; CI gives 15). New inputs a run finds go to build-fuzz/<target>/new (scratch);
# --grow then merges into the committed corpus only those that reach a branch of tqkv's code it
# does not (libFuzzer -merge=1, files named by their SHA-1), to be committed: the corpora grow,
# and stay small (the regression tests hold each under 200 files).
# A crash, leak, timeout or UB report stops the run, its input in build-fuzz/<target>/: fix the
# product code and add the input to the committed corpus, where the regression tests
# (Gguf.FuzzCorpusRegression, Model.FuzzCorpusRegression, RequestParser.FuzzCorpusRegression)
# replay it in every build.
#
# Needs: clang-14 and libclang-rt-14-dev (Debian).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
GROW=0
if [ "${1:-}" = "--grow" ]; then
  GROW=1
  shift
fi
TOTAL="${1:-60}"
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(gguf model request)
OUT="$ROOT/build-fuzz"
CXX="${CXX_FUZZ:-clang++}"
# -g1: line tables are enough for the sanitizers' reports, and compile faster than -g. Coverage
# is counted in tqkv's functions only (coverage.allow says why).
FLAGS=(-std=c++20 -O1 -g1 -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
       -fsanitize-coverage-allowlist="$ROOT/tests/engine/fuzz/coverage.allow"
       -I"$ROOT/include" -I"$ROOT/src" -I"$ROOT/tests")

GGUF=(src/engine/gguf/gguf.cpp src/engine/weights/dequant.cpp src/engine/gguf/tokenizer.cpp)
# Model::load and what it calls, onto the target's own device (fuzz_model.cpp says why).
MODEL=(src/engine/model/model.cpp src/engine/model/architecture.cpp src/engine/model/arch_llama.cpp
       src/engine/model/arch_gemma3.cpp src/engine/core/rope.cpp src/engine/core/batch.cpp src/engine/core/sampler.cpp
       src/engine/device/device.cpp src/engine/weights/expand_tensor.cpp src/cpu/thread_pool.cpp src/core/options.cpp)
declare -A SOURCES=(
  [gguf]="tests/engine/fuzz/fuzz_gguf.cpp ${GGUF[*]}"
  [model]="tests/engine/fuzz/fuzz_model.cpp ${GGUF[*]} ${MODEL[*]}"
  [request]="tests/serve/fuzz/fuzz_request.cpp src/serve/request_parser.cpp ${GGUF[*]}"
)
declare -A CORPUS=([gguf]=tests/engine/fuzz_corpus [model]=tests/engine/fuzz_corpus_model [request]=tests/serve/fuzz_corpus)
declare -A SHARE=([gguf]=40 [model]=30 [request]=30)  # percent of SECONDS
declare -A OPTIONS=([gguf]="-max_len=8192" [model]="-max_len=24576" [request]="-max_len=4096 -dict=$ROOT/tests/serve/fuzz/request.dict")

# Every source once, each to its object, as many at a time as there are cores.
mkdir -p "$OUT/obj"
declare -A WANT=()
for t in "${TARGETS[@]}"; do
  [ -n "${SOURCES[$t]:-}" ] || { echo "unknown target '$t' (gguf, model, request)" >&2; exit 2; }
  for s in ${SOURCES[$t]}; do WANT[$s]=1; done
done
obj() { echo "$OUT/obj/$(echo "$1" | tr / _).o"; }
jobs=0
for s in "${!WANT[@]}"; do
  "$CXX" "${FLAGS[@]}" -c "$ROOT/$s" -o "$(obj "$s")" &
  jobs=$((jobs + 1))
  if [ "$jobs" -ge "$(nproc)" ]; then wait -n; jobs=$((jobs - 1)); fi
done
while [ "$jobs" -gt 0 ]; do wait -n; jobs=$((jobs - 1)); done

share_sum=0
for t in "${TARGETS[@]}"; do share_sum=$((share_sum + SHARE[$t])); done
for t in "${TARGETS[@]}"; do
  objs=()
  for s in ${SOURCES[$t]}; do objs+=("$(obj "$s")"); done
  mkdir -p "$OUT/$t/new"
  "$CXX" -fsanitize=fuzzer,address,undefined "${objs[@]}" -lpthread -o "$OUT/$t/fuzz_$t"
  seconds=$(( TOTAL * SHARE[$t] / share_sum ))
  [ "$seconds" -ge 1 ] || seconds=1
  echo "=== fuzz_$t: $seconds s from ${CORPUS[$t]} ($(ls "$ROOT/${CORPUS[$t]}" | wc -l) files)"
  (cd "$OUT/$t" && ./"fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 ${OPTIONS[$t]} \
     -artifact_prefix="$OUT/$t/" new "$ROOT/${CORPUS[$t]}")
  if [ "$GROW" = 1 ]; then
    before=$(ls "$ROOT/${CORPUS[$t]}" | wc -l)
    # Edges, not hit counts (-use_counters=0): an input is added for a branch no other reaches.
    (cd "$OUT/$t" && ./"fuzz_$t" -merge=1 -use_counters=0 ${OPTIONS[$t]} "$ROOT/${CORPUS[$t]}" new 2>&1 | tail -1)
    echo "=== fuzz_$t: corpus $before -> $(ls "$ROOT/${CORPUS[$t]}" | wc -l) files"
  fi
done
