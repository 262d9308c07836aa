#!/usr/bin/env bash
# Sets up what the demo needs (scripts/setup.sh: no test suite; skipped when nothing changed) and
# runs the main job, examples/train_qwen3.py. Extra arguments go to it (try --help).
set -euo pipefail
# the command that ran this script, for the --resume command a --stop-after run prints
ROUNDPIPE_DEMO_LAUNCHER="bash $(printf '%q' "$0")"
export ROUNDPIPE_DEMO_LAUNCHER
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_qwen3.py "$@"
