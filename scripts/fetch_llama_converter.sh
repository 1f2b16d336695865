#!/usr/bin/env bash
# llama.cpp's own Hugging Face -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and
# the gguf-py it ships with), taken from the llama-cpp-python sdist on PyPI (pinned, sha256 checked)
# into build/llama-converter/. tests/python/test_architectures.py converts its tiny transformers
# models with it, so the engine is held to a GGUF that llama.cpp wrote, not one of ours.
# Needs pip; nothing is installed. Idempotent.
#   bash scripts/fetch_llama_converter.sh [DEST]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/build/llama-converter}"
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
[ -f "$DEST/convert_hf_to_gguf.py" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ] && exit 0

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation -d "$tmp" "llama-cpp-python==$VERSION"
sdist="$tmp/llama_cpp_python-$VERSION.tar.gz"
echo "$SHA256  $sdist" | sha256sum -c --quiet -
src="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$sdist" -C "$tmp" "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$src/LICENSE"
rm -rf "$DEST"
mkdir -p "$DEST"
cp -r "$tmp/$src/convert_hf_to_gguf.py" "$tmp/$src/conversion" "$tmp/$src/gguf-py" "$tmp/$src/LICENSE" "$DEST/"
echo "$VERSION" > "$DEST/VERSION"
echo "fetch_llama_converter: llama.cpp's converter (llama-cpp-python $VERSION) in $DEST"
