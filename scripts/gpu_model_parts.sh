#!/usr/bin/env bash
# A model file larger than what one remote-run call may carry (64 MiB with the tree), moved to the
# GPU machine in parts over calls made back to back (files under /tmp there survive while the
# machine stays warm).
#   Here:  bash scripts/gpu_model_parts.sh split MODEL [DIR]   parts of 60 MB in DIR (default .gl,
#                                                             git-ignored) and MODEL's sha256 beside them
#   There: bash scripts/gpu_model_parts.sh stage DIR          copies the parts carried in DIR to /tmp/parts
#          bash scripts/gpu_model_parts.sh join NAME DEST     joins /tmp/parts into DEST/NAME once every part
#                                                             is there and the sha256 matches (exit 3: not yet)
# Carry DIR's parts one per call (with DIR's .sha256 file in each), e.g. for SmolLM2 (98 MB):
#   call 1 carries .gl/<name>.aa and .gl/<name>.sha256, runs `stage .gl`, and starts the build
#   (scripts/gpu_build_bg.sh); call 2 carries .gl/<name>.ab and .gl/<name>.sha256, runs `stage .gl`
#   then `join <name> /tmp/src/models` and the tests.
set -euo pipefail
cmd=${1:?usage: gpu_model_parts.sh split MODEL [DIR] | stage DIR | join NAME DEST}
case "$cmd" in
  split)
    model=${2:?model file}
    dir=${3:-.gl}
    name=$(basename "$model")
    mkdir -p "$dir"
    rm -f "$dir/$name".??
    split -b 60M "$model" "$dir/$name."
    (cd "$(dirname "$model")" && sha256sum "$name") > "$dir/$name.sha256"
    ls -l "$dir/$name".* ;;
  stage)
    dir=${2:?dir of carried parts}
    mkdir -p /tmp/parts
    cp "$dir"/* /tmp/parts/
    ls -l /tmp/parts ;;
  join)
    name=${2:?model file name}
    dest=${3:?destination dir}
    sums=/tmp/parts/$name.sha256
    [ -f "$sums" ] || { echo "join: $sums not staged" >&2; exit 3; }
    mkdir -p "$dest"
    cat /tmp/parts/"$name".?? > "$dest/$name.partial"
    want=$(cut -d' ' -f1 "$sums")
    got=$(sha256sum "$dest/$name.partial" | cut -d' ' -f1)
    if [ "$want" != "$got" ]; then
      echo "join: sha256 $got != $want (parts staged: $(ls /tmp/parts | tr '\n' ' '))" >&2
      rm -f "$dest/$name.partial"
      exit 3
    fi
    mv "$dest/$name.partial" "$dest/$name"
    echo "join: $dest/$name ($want)" ;;
  *)
    echo "gpu_model_parts.sh: unknown command $cmd" >&2
    exit 2 ;;
esac
