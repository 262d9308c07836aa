#!/usr/bin/env bash
# Sets everything up and runs every test: the GoogleTest suite (ctest) and pytest.
# Exits non-zero if any test fails or if either runner ran no test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh

echo "== ctest (native)"
.venv/bin/ctest --test-dir build/py --output-on-failure --no-tests=error

echo "== pytest"
.venv/bin/python -m pytest tests
