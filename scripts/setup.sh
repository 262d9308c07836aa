#!/usr/bin/env bash
# Sets up everything the demo and the tests need, idempotently:
#   - Debian packages: a C++ compiler, GoogleTest (libgtest-dev), python3-venv;
#   - a virtual environment in .venv with requirements-dev.txt;
#   - RoundPipe built once by CMake (scikit-build-core) into build/py, with the GoogleTest suite,
#     and installed into .venv.
# Source it or run it; it prints nothing but progress lines and fails loudly.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need_apt=()
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
python3 -c "import ensurepip, venv" 2>/dev/null || need_apt+=(python3-venv)
for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg"); done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
echo "== installing Python packages (requirements-dev.txt)"
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt

echo "== building and installing RoundPipe (build/py)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation \
  -Cbuild-dir=build/py -Ccmake.define.ROUNDPIPE_BUILD_TESTS=ON .
