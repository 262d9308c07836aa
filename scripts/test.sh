#!/usr/bin/env bash
# Sets everything up and runs every test: the GoogleTest suite natively (ctest) and under
# emulated CPUs (scripts/test_emulated.sh: AVX2-only, no-AVX and AArch64), the C++ install and
# a find_package consumer (scripts/test_install.sh), then pytest (with the benchmark peers of
# requirements-peers.txt on PYTHONPATH), then the Hugging Face tests on the lowest versions
# pyproject.toml declares (scripts/test_floors.sh, in .venv-floors).
# Exits non-zero if any test fails or if a runner ran no test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --tests --peers qemu-user g++-aarch64-linux-gnu

echo "== ctest (native)"
.venv/bin/ctest --test-dir build/py --output-on-failure --no-tests=error

bash scripts/test_emulated.sh
bash scripts/test_install.sh

echo "== pytest"
# the benchmark peers (requirements-peers.txt) for their benchmark's tests and as references,
# from outside the user's environment
PYTHONPATH=.venv/peers${PYTHONPATH:+:$PYTHONPATH} .venv/bin/python -m pytest tests

bash scripts/test_floors.sh  # the declared floors of torch, transformers, peft, accelerate, trl
