#!/usr/bin/env bash
# Sets up what the demo (and, with --tests, the test suite) needs, idempotently:
#   - Debian packages: a C++ compiler, python3-venv; with --tests also GoogleTest (libgtest-dev);
#     any further arguments are more Debian packages to install;
#   - a virtual environment in .venv with requirements-dev.txt; with --peers also the benchmark
#     peers of requirements-peers.txt in .venv/peers, outside the environment (put it on
#     PYTHONPATH to use them: scripts/test.sh does);
#   - RoundPipe built by CMake (scikit-build-core) into build/py and installed into .venv; with
#     --tests the GoogleTest suite is built too (ctest --test-dir build/py runs it).
# Steps whose inputs did not change since the last successful run are skipped (the hashes of
# requirements-dev.txt and of the sources are kept in .venv), so a second run takes seconds.
# Source it or run it; it prints nothing but progress lines and fails loudly.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

tests=OFF
peers=OFF
packages=()
for arg in "$@"; do
  if [ "$arg" = --tests ]; then tests=ON
  elif [ "$arg" = --peers ]; then peers=ON
  else packages+=("$arg"); fi
done

need_apt=()
command -v g++ >/dev/null || need_apt+=(g++)
[ $tests = OFF ] || [ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
python3 -c "import ensurepip, venv" 2>/dev/null || need_apt+=(python3-venv)
for pkg in "${packages[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg"); done
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

# stamp NAME VALUE: true when .venv/.stamp-NAME holds VALUE (that step already done)
stamp() { [ -f ".venv/.stamp-$1" ] && [ "$(cat ".venv/.stamp-$1")" = "$2" ]; }

req=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
if stamp requirements "$req"; then
  echo "== Python packages: requirements-dev.txt unchanged, already installed"
else
  echo "== installing Python packages (requirements-dev.txt)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  # the peers an older setup installed into .venv itself go (they belong in .venv/peers)
  for pkg in $(grep -o '^[A-Za-z0-9_.-]*' requirements-peers.txt); do
    if .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1; then
      echo "== removing $pkg from .venv (a benchmark peer: --peers puts it in .venv/peers)"
      .venv/bin/python -m pip uninstall -q -y "$pkg"
    fi
  done
  echo "$req" > .venv/.stamp-requirements
fi

peer_req=$(sha256sum requirements-peers.txt | cut -d' ' -f1)
if [ $peers = ON ]; then
  if stamp peers "$peer_req"; then
    echo "== benchmark peers: requirements-peers.txt unchanged, already in .venv/peers"
  else
    echo "== installing the benchmark peers into .venv/peers (requirements-peers.txt)"
    rm -rf .venv/peers
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
      --target .venv/peers -r requirements-peers.txt
    # torchao's wheel ships its test suite as a top-level package named `test`, which on
    # PYTHONPATH would shadow the standard library's
    rm -rf .venv/peers/test
    echo "$peer_req" > .venv/.stamp-peers
  fi
fi

# everything the build reads; the suite built or not is part of the stamp
src=$(find CMakeLists.txt pyproject.toml cmake cpp bindings cpp_tests python -type f \
        ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum |
      cut -d' ' -f1)
if { stamp build "$src tests=$tests" || { [ $tests = OFF ] && stamp build "$src tests=ON"; }; } &&
   compgen -G ".venv/lib/python3*/site-packages/roundpipe/_C*" >/dev/null; then
  echo "== RoundPipe: sources unchanged, already built and installed"
else
  echo "== building and installing RoundPipe (build/py, GoogleTest suite $tests)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation \
    -Cbuild-dir=build/py -Ccmake.define.ROUNDPIPE_BUILD_TESTS=$tests .
  echo "$src tests=$tests" > .venv/.stamp-build
fi
