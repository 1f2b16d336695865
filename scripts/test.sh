#!/usr/bin/env bash
# Builds the release preset and runs the whole test suite (tests that need the real model
# or a GPU skip cleanly when it is absent; run scripts/setup.sh first to have the model). Where
# nanobind is installed the release preset also builds the Python module, and ctest runs
# tests/python (PythonPackage) and the install test (InstallConsumers).
#   bash scripts/test.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)"
ctest --preset release -j "$(nproc)"
