#!/usr/bin/env bash
# Issue 12 items 9-10 on the GPU machine: `tqkv bench decode --device cuda` and llama.cpp's
# llama-batched-bench (scripts/peer_llamacpp_gpu.sh) over one batch x context grid, same GPU,
# same GGUF, one session. Run from the root of our source tree (built or to be built there).
#
#   scripts/gpu_decode_vs_llamacpp.sh build LLAMA_TGZ
#       build tqkv_cli (build-gpu/, normal priority) and llama.cpp (/tmp/llama, nice 19) at once;
#       /tmp/tqkv.done and /tmp/llama.done hold each build's exit status when it ends.
#       Without Debian's libxxhash-dev / libcpp-httplib-dev, unpack .deps/*.deb into /tmp/xx first.
#   scripts/gpu_decode_vs_llamacpp.sh bench MODEL OUT END_EPOCH_S
#       the cells in priority order until END_EPOCH_S (a cell that would not finish is skipped and
#       named in OUT/events.txt): ours as soon as tqkv is built (while llama.cpp still compiles,
#       at nice 19), llama.cpp's as soon as it is built, then a recheck of two of our cells with
#       the compilers gone. OUT/tqkv.json (concatenated --json documents), OUT/llama.jsonl.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
X=/tmp/xx/usr
export LD_LIBRARY_PATH=$X/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

build() {
  local tgz=$1 t0
  t0=$(date +%s)
  (nice -n 19 bash "$ROOT/scripts/peer_llamacpp_gpu.sh" build "$tgz" /tmp/llama > /tmp/llama_build.log 2>&1
   echo "$? $(( $(date +%s) - t0 ))s" > /tmp/llama.done) &
  (cd "$ROOT" && cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTQKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
     -DTQKV_BUILD_BENCH=OFF -DTQKV_CUDA_BENCH=OFF -DTQKV_BUILD_PYTHON=OFF \
     -DTQKV_XXHASH_LIB=$X/lib/x86_64-linux-gnu/libxxhash.so -DTQKV_XXHASH_INCLUDE=$X/include \
     -DTQKV_HTTPLIB_INCLUDE=$X/include -DTQKV_HTTPLIB_LIB=$X/lib/x86_64-linux-gnu/libcpp-httplib.so &&
   cmake --build build-gpu -j 16 --target tqkv_cli > /tmp/tqkv_build.log 2>&1
   echo "$? $(( $(date +%s) - t0 ))s" > /tmp/tqkv.done) > /tmp/tqkv_cfg.log 2>&1 &
  wait
}

bench() {
  local model=$1 out=$2 end=$3
  local ev=$out/events.txt tq=$ROOT/build-gpu/tqkv
  left() { echo $((end - $(date +%s))); }
  note() { echo "$(date -u +%T) $*" >> "$ev"; }
  built() { [[ -f /tmp/$1.done ]] && [[ $(cut -d' ' -f1 /tmp/$1.done) == 0 ]]; }
  # our cells: NEED_S FORMAT BATCHES DEPTHS
  tq_cell() {
    local need=$1 f=$2 b=$3 d=$4
    if (( $(left) < need )); then note "SKIP tqkv $f batch $b depths $d (needs ~${need}s, $(left)s left)"; return; fi
    note "tqkv $f batch $b depths $d (compilers running: $([[ -f /tmp/llama.done ]] && echo no || echo yes))"
    (cd "$ROOT" && timeout $(( $(left) - 3 )) "$tq" bench decode -m "$model" --device cuda --cuda-graphs on -n 64 \
       --formats "$f" --batch "$b" --depths "$d" --json >> "$out/tqkv.json" 2>> "$out/tqkv.log") || note "  exit $?"
  }
  ll_cell() {
    local need=$1 c=$2 pl=$3 pp=$4
    if (( $(left) < need )); then note "SKIP llama $c npl $pl npp $pp (needs ~${need}s, $(left)s left)"; return; fi
    note "llama $c npl $pl npp $pp"
    timeout $(( $(left) - 3 )) bash "$ROOT/scripts/peer_llamacpp_gpu.sh" run "$model" "$c" "$pp" "$pl" \
      "$out/llama.jsonl" "$out/llama.log" || note "  exit $?"
  }
  local tq_jobs=(
    "25 f16 1,16,64 1024,8192" "25 tq-4.375 1,16,64 1024,8192"
    "25 turboquant_4bit_nc 1,16,64 1024,8192" "25 tq-3.375 1,16,64 1024,8192"
    "40 f16 1,16 32768" "40 tq-4.375 1,16 32768"
    "70 f16 256 1024,8192" "70 tq-4.375 256 1024,8192"
    "40 turboquant_4bit_nc 1,16 32768" "40 tq-3.375 1,16 32768"
    "70 turboquant_4bit_nc 256 1024,8192" "70 tq-3.375 256 1024,8192")
  local ll_jobs=(
    "20 f16 1,16,64 1024,8192" "20 q4_0 1,16,64 1024,8192" "20 q8_0 1,16,64 1024,8192"
    "RECHECK"
    "25 q4_0 1,16 32768" "25 f16 1,16 32768" "25 q8_0 1,16 32768"
    "40 q4_0 256 1024,8192" "40 f16 256 1024,8192" "40 q8_0 256 1024,8192")
  local ti=0 li=0
  until [[ -f /tmp/tqkv.done ]] || (( $(left) < 30 )); do sleep 2; done
  note "tqkv build: $(cat /tmp/tqkv.done 2>/dev/null || echo unfinished)"
  built tqkv || ti=${#tq_jobs[@]}
  while (( $(left) > 15 )); do
    if built llama && (( li < ${#ll_jobs[@]} )); then
      local j=${ll_jobs[li]}; li=$((li + 1))
      if [[ $j == RECHECK ]]; then  # two of our cells again, no compiler beside them
        built tqkv && tq_cell 20 f16,tq-4.375 16 8192
      else
        ll_cell $j
      fi
    elif (( ti < ${#tq_jobs[@]} )); then
      local cell=(${tq_jobs[ti]})
      # while llama.cpp compiles, keep ~80 s for its first grid and the recheck
      if [[ ! -f /tmp/llama.done ]] && (( $(left) < cell[0] + 80 )); then sleep 2; continue; fi
      tq_cell "${cell[@]}"; ti=$((ti + 1))
    elif [[ -f /tmp/llama.done ]]; then
      break
    else
      sleep 2
    fi
  done
  note "llama build: $(cat /tmp/llama.done 2>/dev/null || echo unfinished)"
  for ((; ti < ${#tq_jobs[@]}; ti++)); do note "SKIP tqkv ${tq_jobs[ti]} (time)"; done
  for ((; li < ${#ll_jobs[@]}; li++)); do note "SKIP llama ${ll_jobs[li]} (time)"; done
}

case "${1:-}" in
  build) shift; build "$@" ;;
  bench) shift; bench "$@" ;;
  *) echo "usage: $0 build LLAMA_TGZ | bench MODEL OUT END_EPOCH_S" >&2; exit 2 ;;
esac
