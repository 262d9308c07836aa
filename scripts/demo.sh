#!/usr/bin/env bash
# Sets everything up and runs the main job. Extra arguments go to the demo (try --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_tiny_llama.py "$@"
