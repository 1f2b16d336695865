#!/usr/bin/env bash
# ctest driver of tests/serve/test_server.py: exit 77 (ctest: skipped) when python3 has no
# pytest or openai (scripts/install-deps.sh installs them); the tests skip themselves when the
# model is absent.
set -u
python3 -c "import pytest, openai" >/dev/null 2>&1 || { echo "pytest/openai not installed: skipped"; exit 77; }
exec python3 -m pytest -q -p no:cacheprovider "$(dirname "$0")/test_server.py" "$@"
