#!/usr/bin/env bash
# One command on a GPU machine: bench/cuda/run_bench.sh [BUILD_DIR]
# Runs PyTorch's bf16 SDPA on the same shapes (if torch is importable), then tqkv's
# benchmark, which prints the table of docs/journal/RESULTS-journal.md ("CUDA (issue 5)").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-build-cuda}"
bin="$build/bench/cuda/tqkv_cuda_bench"
[ -x "$bin" ] || bin="$(find "$build" -name tqkv_cuda_bench -type f | head -1)"
sdpa="$(mktemp)"
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  python3 "$here/sdpa_bench.py" > "$sdpa"
fi
"$bin" --sdpa "$sdpa"
