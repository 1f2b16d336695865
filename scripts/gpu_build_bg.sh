#!/usr/bin/env bash
# For the GPU machine reached through a remote-run tool whose calls each start in a fresh copy of
# the tree and end with their processes: snapshots the tree to /tmp/src, unpacks the -dev packages
# the machine's image lacks (.deb files in DEBS, default .deps: apt-get download libxxhash-dev
# libxxhash0 libcpp-httplib-dev libcpp-httplib0.11 here and carry them), configures /tmp/b with
# CUDA for sm_90 and starts the build detached (setsid: it survives the call). A later call waits
# for /tmp/build.rc (the build's exit status); the log is /tmp/build.log. The GPU-only
# executables then lie under /tmp/b (tqkv, tqkv_cuda_tests, tqkv_cuda_engine_tests,
# tqkv_products_bench, tqkv_cuda_bench); run them with LD_LIBRARY_PATH=/tmp/xx/usr/lib/x86_64-linux-gnu, and the
# tests with TQKV_REQUIRE_CUDA=1 (a test that finds no device then fails rather than skips).
# Models: copy them to /tmp/src/models (the engine tests look there). BENCH=ON adds the benchmarks
# (tqkv_cuda_bench ...) to what may be built.
#   bash scripts/gpu_build_bg.sh [TARGET...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEBS="${DEBS:-.deps}"
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(tqkv_cli tqkv_cuda_tests tqkv_cuda_engine_tests tqkv_products_bench)
mkdir -p /tmp/src /tmp/xx
tar --exclude=./.deps --exclude='./build*' --exclude=./models -cf - . | (cd /tmp/src && tar xf -)
for d in "$DEBS"/*.deb; do [ -e "$d" ] && dpkg -x "$d" /tmp/xx; done
L=/tmp/xx/usr/lib/x86_64-linux-gnu
[ -e $L/libxxhash.so ] || ln -sf "$(ls $L/libxxhash.so.* | head -1)" $L/libxxhash.so
rm -f /tmp/build.rc
cmake -S /tmp/src -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DTQKV_WERROR=ON -DTQKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DTQKV_BUILD_BENCH=${BENCH:-OFF} -DTQKV_BUILD_PYTHON=OFF -DTQKV_XXHASH_LIB=$L/libxxhash.so -DTQKV_XXHASH_INCLUDE=/tmp/xx/usr/include \
  -DTQKV_HTTPLIB_INCLUDE=/tmp/xx/usr/include -DTQKV_HTTPLIB_LIB=$L/libcpp-httplib.so > /tmp/configure.log 2>&1 ||
  { tail -30 /tmp/configure.log; exit 1; }
setsid nohup bash -c "cmake --build /tmp/b -j$(nproc) --target ${TARGETS[*]} > /tmp/build.log 2>&1; echo \$? > /tmp/build.rc" \
  > /dev/null 2>&1 < /dev/null &
echo "gpu_build_bg: building ${TARGETS[*]} in /tmp/b (log /tmp/build.log, status /tmp/build.rc)"
