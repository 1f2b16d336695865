#!/usr/bin/env bash
# Installs everything tqkv needs to build, test and run on a Debian 12 machine (as root, or
# through sudo): compilers and libraries from Debian, the evaluation text package, and the
# Python packages of the reference tests. Idempotent and quiet.
set -euo pipefail

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

PACKAGES=(
  build-essential cmake pkg-config unzip ca-certificates
  clang libclang-rt-14-dev                  # libFuzzer target for the GGUF reader
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libboost-dev libopenblas-dev
  libxxhash-dev                             # XXH3: the weights hash of recipe files
  libcpp-httplib-dev                        # the HTTP front end of tqkv serve
  python3 python3-pip python3-dev python3-venv  # python3-dev: Python.h for the tqkv module
  bible-kjv bible-kjv-text                  # real evaluation text (scripts/fetch_text.sh)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The NumPy reference forward pass (tests/integration/reference_forward.py) and the tokenizer
# references (tests/integration/reference_tokenize.py: Hugging Face tokenizers, sentencepiece).
PY_PACKAGES=(numpy gguf tokenizers sentencepiece protobuf)
if ! python3 -c "import numpy, gguf, tokenizers, sentencepiece, google.protobuf" >/dev/null 2>&1; then
  echo "install-deps: pip install ${PY_PACKAGES[*]}"
  python3 -m pip install --quiet "${PY_PACKAGES[@]}" ||
    python3 -m pip install --quiet --break-system-packages "${PY_PACKAGES[@]}"
fi

# The server tests drive `tqkv serve` with the official OpenAI client (tests/serve/test_server.py).
if ! python3 -c "import openai, pytest" >/dev/null 2>&1; then
  echo "install-deps: pip install openai pytest"
  python3 -m pip install --quiet openai pytest || python3 -m pip install --quiet --break-system-packages openai pytest
fi

# The Python package (pyproject.toml, python/): nanobind for the in-tree module the release
# preset builds (TQKV_BUILD_PYTHON=AUTO), scikit-build-core for `pip install .`.
if ! python3 -c "import nanobind, scikit_build_core" >/dev/null 2>&1; then
  echo "install-deps: pip install nanobind scikit-build-core"
  python3 -m pip install --quiet "nanobind>=2.2" "scikit-build-core>=0.10" ||
    python3 -m pip install --quiet --break-system-packages "nanobind>=2.2" "scikit-build-core>=0.10"
fi
