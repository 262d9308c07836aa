#!/usr/bin/env bash
# Sets up what the demo needs (scripts/setup.sh: no test suite; skipped when nothing changed) and
# runs the main job, examples/train_qwen3.py. Extra arguments go to it (try --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_qwen3.py "$@"
