#!/usr/bin/env bash
# Builds and runs emu_test.cpp: the plugin's CUDA kernels on the CPU (emu.h) against serial
# references of vLLM's slot. Needs g++ with C++20 and the CUDA headers (CUDA_HOME, default
# /usr/local/cuda); no GPU, no nvcc.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
BIN="${BIN:-/tmp/tqkv_vllm_emu_test}"
g++ -std=c++20 -O2 -pthread -Wall -Wno-unknown-pragmas -Wno-attributes -I"$CUDA_HOME/include" -I"$HERE/../../csrc" \
  "$HERE/emu_test.cpp" -o "$BIN"
"$BIN"
