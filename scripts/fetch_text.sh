#!/usr/bin/env bash
# Installs the evaluation text: the Book of Genesis (King James Version, public domain) from
# Debian's bible-kjv / bible-kjv-text packages, as plain prose, one verse per line with the
# chapter headings kept (~205 KB, ~52K SmolLM2 tokens), at data/kjv-genesis.txt (gitignored).
# Real human-written text that this project did not write; never generated.
# Idempotent: an existing non-empty file is left alone.
#
#   scripts/fetch_text.sh [DEST_DIR]       (default: <repo>/data)
#
# Needs: the Debian package bible-kjv (installed here with apt-get when missing and root).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/data}"
OUT="$DEST/kjv-genesis.txt"

if [ -s "$OUT" ]; then
  echo "fetch_text: $OUT present"
  exit 0
fi
if ! command -v bible >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y --no-install-recommends bible-kjv >/dev/null
  else
    echo "fetch_text: the 'bible' program is missing; run: sudo apt-get install bible-kjv" >&2
    exit 1
  fi
fi
mkdir -p "$DEST"
# -l with a huge width keeps each verse on one line; sed drops the verse numbers.
bible -l100000 "Gen1:1-50:26" | sed -E 's/^ +[0-9]+ //' > "$OUT.part"
if [ "$(wc -c < "$OUT.part")" -lt 150000 ]; then
  echo "fetch_text: extracted text is unexpectedly short" >&2
  rm -f "$OUT.part"
  exit 1
fi
mv "$OUT.part" "$OUT"
echo "fetch_text: installed $OUT ($(wc -c < "$OUT") bytes)"
