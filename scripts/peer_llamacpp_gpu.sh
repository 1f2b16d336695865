#!/usr/bin/env bash
# llama.cpp on the GPU machine, the peer of `tqkv bench decode --device cuda` (issue 12, item 9).
# Our script, not their code: the source is the llama-cpp-python sdist's vendor/llama.cpp, packed
# as a .tgz (top folder llama.cpp/), unpacked and built outside the repository.
#
#   scripts/peer_llamacpp_gpu.sh build SRC_TGZ [DIR]
#       unpack into DIR (default /tmp/llama) and build llama-batched-bench, llama-bench and
#       llama-perplexity (scripts/peer_llamacpp.sh run with LLAMA_ARGS="-ngl 99": the KL rows) with
#       CUDA for sm_90 only, shared libraries, JOBS (default 16) jobs. Flash attention kernels are
#       built for same-type K/V pairs only (GGML_CUDA_FA_ALL_QUANTS=OFF: f16, q8_0, q4_0 ... with
#       themselves), which is all the caches below need. Binaries land in DIR/build/bin.
#
#   scripts/peer_llamacpp_gpu.sh run MODEL CACHE NPP NPL OUT_JSONL [LOG]
#       one llama-batched-bench process: every layer on the GPU (-ngl 99), flash attention on,
#       K and V caches of type CACHE (f16, q8_0, q4_0), for each prompt length in NPP (comma list)
#       and each count of parallel sequences in NPL (comma list), NTG (default 64) decode steps.
#       Appends one JSON line per cell to OUT_JSONL (llama-batched-bench's own, with "cache" added).
#
# What llama-batched-bench measures per (npp, npl) cell (no -pps, so no prompt is shared): the
# cache is cleared; npl sequences are each prefilled with npp random tokens of their own (PP);
# then NTG steps each decode one token for every one of the npl sequences, at positions npp to
# npp + NTG - 1 (TG). speed_tg = npl * NTG / the TG steps' wall time (the first TG step
# included; the process warmed up once before the first cell). So speed_tg is decode tokens/s
# for a batch of npl sequences at depth npp, the quantity `tqkv bench decode --batch npl
# --depths npp` reports. The context is max(NPL) * (max(NPP) + NTG): llama.cpp splits it into
# max(NPL) per-sequence streams (its default non-unified cache), each max(NPP) + NTG long.
set -euo pipefail

build() {
  local tgz=$1 dir=${2:-/tmp/llama}
  mkdir -p "$dir"
  tar xzf "$tgz" -C "$dir"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$dir/llama.cpp" -B "$dir/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
    -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NCCL=OFF -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
  cmake --build "$dir/build" -j "${JOBS:-16}" --target llama-batched-bench llama-bench llama-perplexity
}

run() {
  local model=$1 cache=$2 npp=$3 npl=$4 out=$5 log=${6:-/dev/null}
  local bin=${LLAMA_BIN:-/tmp/llama/build/bin}/llama-batched-bench
  local ntg=${NTG:-64}
  local max_pp max_pl
  max_pp=$(tr , '\n' <<< "$npp" | sort -n | tail -1)
  max_pl=$(tr , '\n' <<< "$npl" | sort -n | tail -1)
  local ctx=$((max_pl * (max_pp + ntg)))
  echo "== llama-batched-bench cache $cache npp $npp npl $npl ntg $ntg ctx $ctx" >> "$log"
  "$bin" -m "$model" -ngl 99 -fa on -ctk "$cache" -ctv "$cache" -c "$ctx" -b 8192 -ub 2048 \
    -npp "$npp" -ntg "$ntg" -npl "$npl" --output-format jsonl 2>> "$log" |
    tee -a "$log" | grep '^{' | sed "s/^{/{\"cache\": \"$cache\", /" >> "$out"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build SRC_TGZ [DIR] | run MODEL CACHE NPP NPL OUT_JSONL [LOG]" >&2; exit 2 ;;
esac
