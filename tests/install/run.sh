#!/usr/bin/env bash
# Installs a build tree into a temporary prefix and builds what a user would against it:
# a C program with `cc prog.c $(pkg-config --cflags --libs tqkv)` and a CMake project with
# find_package(tqkv); runs both.
#   bash tests/install/run.sh BUILD_DIR [CC]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="$1"
cc="${2:-cc}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"

cmake --install "$build" --prefix "$prefix" --component dev >/dev/null
pc="$(find "$prefix" -name tqkv.pc)"
libdir="$(dirname "$(dirname "$pc")")"
for f in include/tqkv/tqkv.h include/tqkv/format.h; do test -f "$prefix/$f"; done
test -f "$libdir/libtqkv.a" && test -f "$libdir/libtqkv.so"

echo "== pkg-config: C program (shared, then static)"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
# shellcheck disable=SC2046
"$cc" "$here/prog.c" -o "$tmp/prog" $(pkg-config --cflags --libs tqkv) -lm
LD_LIBRARY_PATH="$libdir" "$tmp/prog"
# The static archive in place of -ltqkv, with the .pc file's Libs.private.
# shellcheck disable=SC2046
"$cc" "$here/prog.c" -o "$tmp/prog_static" $(pkg-config --cflags tqkv) \
  $(pkg-config --libs --static tqkv | sed "s|-ltqkv|$libdir/libtqkv.a|")
"$tmp/prog_static"

echo "== find_package(tqkv): C++ project"
cmake -S "$here/consumer" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$tmp/consumer" -j 2 >/dev/null
LD_LIBRARY_PATH="$libdir" "$tmp/consumer/consumer_shared"
"$tmp/consumer/consumer_static"
