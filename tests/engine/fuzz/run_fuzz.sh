#!/usr/bin/env bash
# Builds the GGUF fuzzer with clang (libFuzzer + ASan + UBSan) and runs it from the seed /
# regression corpus for a while. New inputs it finds interesting go to a scratch corpus;
# crashing inputs are written to build-fuzz/ and must be copied into
# tests/engine/fuzz_corpus/ once fixed, so the regression test (Gguf.FuzzCorpusRegression)
# replays them in every build.
#
#   tests/engine/fuzz/run_fuzz.sh [SECONDS]     (default 60)
#
# Needs: clang-14 and libclang-rt-14-dev (Debian).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
SECONDS_TO_RUN="${1:-60}"
OUT="$ROOT/build-fuzz"
mkdir -p "$OUT/corpus"
CXX="${CXX_FUZZ:-clang++}"
"$CXX" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$ROOT/include" -I"$ROOT/src" \
  "$ROOT/tests/engine/fuzz/fuzz_gguf.cpp" "$ROOT/src/engine/gguf/gguf.cpp" "$ROOT/src/engine/weights/dequant.cpp" \
  "$ROOT/src/engine/gguf/tokenizer.cpp" -o "$OUT/fuzz_gguf"
cd "$OUT"
./fuzz_gguf -max_total_time="$SECONDS_TO_RUN" -max_len=8192 -rss_limit_mb=2048 -timeout=10 \
  corpus "$ROOT/tests/engine/fuzz_corpus"
