#!/usr/bin/env bash
# Build llama.cpp's perplexity, server and bench tools from the PyPI sdist of llama-cpp-python
# (our script, not their code: everything lands in $PEER, default /work/peer, outside the
# repository: source in $PEER/src, build in $PEER/build) and run llama-perplexity with
# --kl-divergence for the f16, q8_0 and q4_0 KV caches on the same GGUF and text as `tqkv eval`.
#
#   scripts/peer_llamacpp.sh build
#   scripts/peer_llamacpp.sh run CTX TOKENS OUT_JSON   (e.g. 512 20480 /tmp/llamacpp_512.json)
#
# Environment: MODEL, TEXT, THREADS, LOGDIR (the logs and the base logits), LLAMA_PERPLEXITY (the
# binary), LLAMA_ARGS (more arguments for every pass, e.g. "-ngl 99" with a CUDA build from
# scripts/peer_llamacpp_gpu.sh build).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEER=${PEER:-/work/peer}
MODEL=${MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}
TEXT=${TEXT:-$ROOT/data/kjv-genesis.txt}
THREADS=${THREADS:-2}
mkdir -p "$PEER"

src_dir() { ls -d "$PEER"/src "$PEER"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1; }

build() {
  if [ -z "$(src_dir)" ]; then
    pip download --no-deps --no-binary :all: llama-cpp-python -d "$PEER"
    (cd "$PEER" && tar xzf llama_cpp_python-*.tar.gz)
    ln -s "$(ls -d "$PEER"/llama_cpp_python-*/vendor/llama.cpp | head -1)" "$PEER/src"
  fi
  local src; src=$(src_dir)
  cmake -S "$src" -B "$PEER/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DBUILD_SHARED_LIBS=OFF
  # llama-server first: scripts/bench_serve.sh waits for it
  nice -n 10 cmake --build "$PEER/build" -j2 --target llama-server
  nice -n 10 cmake --build "$PEER/build" -j2 --target llama-perplexity llama-bench
}

# llama-perplexity's text scoring: for each chunk of n_ctx tokens it scores
# the second half (first = n_ctx/2), like tqkv's perplexity.h.  KL needs the
# f32/f16 baseline logits saved first (--kl-divergence-base), so we use the
# f16 cache as the base (llama.cpp has no f32 KV cache type for flash attn).
run() {
  local ctx=$1 tokens=$2 out=$3
  local bin=${LLAMA_PERPLEXITY:-$PEER/build/bin/llama-perplexity}
  local chunks=$(( tokens / ctx ))
  local base="${LOGDIR:-$PEER}/base_${ctx}_${chunks}.kld"
  local fa="-fa on"
  local help; help=$("$bin" --help 2>&1 || true)
  grep -q -- "--flash-attn \[on" <<< "$help" || fa="-fa"
  local log="${LOGDIR:-$PEER}/llamacpp_${ctx}"
  # shellcheck disable=SC2086
  nice -n 10 "$bin" -m "$MODEL" -f "$TEXT" -c "$ctx" -b "$ctx" --chunks "$chunks" -t "$THREADS" ${LLAMA_ARGS:-} \
     $fa -ctk f16 -ctv f16 --kl-divergence-base "$base" > "${log}_base.log" 2>&1
  # the f16 row is the base run itself (KL 0 against itself): no second f16 pass
  for t in q8_0 q4_0; do
    # shellcheck disable=SC2086
    nice -n 10 "$bin" -m "$MODEL" -c "$ctx" -b "$ctx" --chunks "$chunks" -t "$THREADS" ${LLAMA_ARGS:-} \
      $fa -ctk "$t" -ctv "$t" --kl-divergence-base "$base" --kl-divergence > "${log}_${t}.log" 2>&1
  done
  python3 - "$ctx" "$chunks" "$out" "$log" <<'PY'
import json, re, sys
ctx, chunks, out, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
bits = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}
rows = []
for t, b in bits.items():
    s = open(f"{log}_{'base' if t == 'f16' else t}.log").read()
    def grab(pat):
        m = re.search(pat, s, re.M)
        return float(m.group(1)) if m else None
    if t == "f16":  # the base run: its own perplexity, KL 0 and top-1 1 by definition
        ppl = grab(r"Final estimate: PPL = ([0-9.]+)")
        rows.append({"format": "llama.cpp f16", "engine": "llama.cpp", "ctx": ctx, "chunks": chunks,
                     "bits_per_element": b, "ppl": ppl, "ppl_base": ppl,
                     "kl_mean": 0.0, "kl_stderr": 0.0, "top1": 1.0, "kl_reference": "llama.cpp f16 cache"})
        continue
    rows.append({
        "format": f"llama.cpp {t}", "engine": "llama.cpp", "ctx": ctx, "chunks": chunks,
        "bits_per_element": b,
        "ppl": grab(r"^Mean PPL\(Q\)\s*:\s*([0-9.]+)"),
        "ppl_base": grab(r"^Mean PPL\(base\)\s*:\s*([0-9.]+)"),
        "kl_mean": grab(r"^Mean\s+KLD:\s*([-0-9.eE]+)"),
        "kl_stderr": grab(r"^Mean\s+KLD:\s*[-0-9.eE]+\s*±\s*([0-9.eE]+)"),
        "top1": (lambda v: v / 100 if v is not None else None)(grab(r"^Same top p:\s*([0-9.]+)")),
        "kl_reference": "llama.cpp f16 cache",
    })
json.dump({"ctx": ctx, "rows": rows}, open(out, "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run CTX TOKENS OUT_JSON" >&2; exit 2 ;;
esac
