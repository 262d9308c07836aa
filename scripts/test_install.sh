#!/usr/bin/env bash
# Proves the C++ library installs and is consumable without Python: configures the project with
# neither tests nor the Python module, installs it into a temporary prefix, then builds and runs
# the separate consumer project examples/cpp, which knows the library only through
# find_package(RoundPipe): every installed header compiled on its own, the example trainer and a
# check against torch.optim.Adam values.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CMAKE=${CMAKE:-.venv/bin/cmake}
CTEST=${CTEST:-.venv/bin/ctest}
for shared in OFF ON; do
  prefix=$(mktemp -d)
  echo "== C++ library (BUILD_SHARED_LIBS=$shared): configure, build, install into a temporary prefix"
  $CMAKE -S . -B build/install-$shared -G Ninja -DROUNDPIPE_BUILD_TESTS=OFF -DROUNDPIPE_BUILD_PYTHON=OFF \
    -DBUILD_SHARED_LIBS=$shared -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
  $CMAKE --build build/install-$shared -j2 >/dev/null
  $CMAKE --install build/install-$shared >/dev/null
  find "$prefix" -type f -o -type l | sed "s|$prefix|  <prefix>|" | sort | grep -v "include/roundpipe/"

  echo "== consumer project examples/cpp: find_package(RoundPipe), build, run"
  rm -rf build/consumer
  $CMAKE -S examples/cpp -B build/consumer -G Ninja -DCMAKE_PREFIX_PATH="$prefix" |
    grep "installed RoundPipe headers"  # the check that every installed header compiles alone
  $CMAKE --build build/consumer -j2 >/dev/null
  $CTEST --test-dir build/consumer --output-on-failure --no-tests=error -V |
    grep -E "^[0-9]+: [^T]|tests passed|Test +#"
  rm -rf "$prefix"
done
