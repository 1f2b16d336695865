#!/usr/bin/env bash
# One-time set-up: dependencies, the default model, the evaluation text, and a release build.
#   bash scripts/setup.sh
# Afterwards `./build/release/tqkv generate` runs the default model with a compressed cache.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/install-deps.sh
bash scripts/fetch_model.sh
bash scripts/fetch_text.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)"
echo "setup: done. Try: ./build/release/tqkv generate"
