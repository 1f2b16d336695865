#!/usr/bin/env bash
# ctest driver of the Python tests that need torch and transformers (test_torch_ops.py,
# test_transformers*.py, test_architectures.py): exit 77 (ctest: skipped, so it shows) when the
# python3 running it has neither; CI runs them in the venv of its Python step, where they must pass
# (TQKV_REQUIRE_TORCH=1). Arguments: the python executable.
set -u
py="${1:-python3}"
here="$(cd "$(dirname "$0")" && pwd)"
"$py" -c "import torch, transformers" >/dev/null 2>&1 || { echo "torch/transformers not installed: skipped"; exit 77; }
exec "$py" -m pytest -q -p no:cacheprovider "$here/test_torch_ops.py" "$here/test_transformers.py" \
  "$here/test_transformers_cuda.py" "$here/test_architectures.py"
