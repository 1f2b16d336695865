#!/usr/bin/env bash
# Installs the evaluation text, the Book of Genesis (King James Version, public domain), and a
# separate calibration text, the Book of Exodus, from Debian's bible-kjv / bible-kjv-text
# packages, as plain prose, one verse per line with the chapter headings kept:
#   data/kjv-genesis.txt  (~205 KB, ~52K SmolLM2 tokens): perplexity, eval, passkey
#   data/kjv-exodus.txt   (~170 KB): scripts/allocate_bits.py's per-layer scan, so that bit
#                          allocations are never tuned on the text they are scored on
# Real human-written text that this project did not write; never generated. Both gitignored.
# Idempotent: an existing non-empty file is left alone.
#
#   scripts/fetch_text.sh [DEST_DIR]       (default: <repo>/data)
#
# Needs: the Debian package bible-kjv (installed here with apt-get when missing and root).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/data}"

# book FILE RANGE MIN_BYTES
book() {
  local out="$DEST/$1" range="$2" min="$3"
  if [ -s "$out" ]; then
    echo "fetch_text: $out present"
    return
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
  bible -l100000 "$range" | sed -E 's/^ +[0-9]+ //' > "$out.part"
  if [ "$(wc -c < "$out.part")" -lt "$min" ]; then
    echo "fetch_text: extracted text for $range is unexpectedly short" >&2
    rm -f "$out.part"
    exit 1
  fi
  mv "$out.part" "$out"
  echo "fetch_text: installed $out ($(wc -c < "$out") bytes)"
}

book kjv-genesis.txt "Gen1:1-50:26" 150000
book kjv-exodus.txt "Exo1:1-40:38" 120000
