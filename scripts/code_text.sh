#!/usr/bin/env bash
# The source-code text of the quality study (docs/RESULTS.md, "Quality study on four models"):
# Python 3.11 standard-library sources as Debian ships them (package libpython3.11-stdlib
# 3.11.2-6+deb12u6): every .py file of the json and wsgiref packages (~105,000 characters), in
# C-locale sorted order, each preceded by a "# ==== <path> ====" line.
#
#   scripts/code_text.sh OUT.txt      (prints the sha256; warns if it differs from the recorded one)
set -euo pipefail
OUT=${1:?usage: code_text.sh OUT.txt}
LIB=${PYLIB:-/usr/lib/python3.11}
EXPECT=933dd16c00832560f616efff9d5e4d6062237b7680ee7029f2d6b5bdbe7edb87
: > "$OUT"
for f in $(cd "$LIB" && printf '%s\n' json/*.py wsgiref/*.py | LC_ALL=C sort); do
  printf '# ==== %s ====\n' "$f" >> "$OUT"
  cat "$LIB/$f" >> "$OUT"
done
sum=$(sha256sum "$OUT" | cut -d' ' -f1)
echo "$OUT: $(wc -c < "$OUT") bytes, sha256 $sum"
if [ "$sum" != "$EXPECT" ]; then
  echo "warning: sha256 differs from the recorded $EXPECT (another libpython3.11-stdlib version?)" >&2
fi
