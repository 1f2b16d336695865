#!/usr/bin/env bash
# The source-code text of the quality study (docs/journal/RESULTS-journal.md, "Quality study on four
# models"): Python 3.11 standard-library sources as Debian ships them (package libpython3.11-stdlib
# 3.11.2-6+deb12u6): every .py file of the json and wsgiref packages (~105,000 characters), in
# C-locale sorted order, each preceded by a "# ==== <path> ====" line.
# PKGS="email http" gives the same text of other packages (a calibration text disjoint from the
# evaluation's: the recipes of a code model fitted on code); only the default has a recorded sha256.
#
#   scripts/code_text.sh OUT.txt      (prints the sha256; warns if it differs from the recorded one)
set -euo pipefail
OUT=${1:?usage: code_text.sh OUT.txt}
LIB=${PYLIB:-/usr/lib/python3.11}
PKGS=${PKGS:-json wsgiref}
EXPECT=933dd16c00832560f616efff9d5e4d6062237b7680ee7029f2d6b5bdbe7edb87
: > "$OUT"
for f in $(cd "$LIB" && for p in $PKGS; do printf '%s\n' "$p"/*.py; done | LC_ALL=C sort); do
  printf '# ==== %s ====\n' "$f" >> "$OUT"
  cat "$LIB/$f" >> "$OUT"
done
sum=$(sha256sum "$OUT" | cut -d' ' -f1)
echo "$OUT: $(wc -c < "$OUT") bytes, sha256 $sum"
if [ "$PKGS" = "json wsgiref" ] && [ "$sum" != "$EXPECT" ]; then
  echo "warning: sha256 differs from the recorded $EXPECT (another libpython3.11-stdlib version?)" >&2
fi
