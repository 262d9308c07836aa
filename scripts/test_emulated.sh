#!/usr/bin/env bash
# Proves the runtime dispatch on CPUs this machine is not: runs the GoogleTest suite
#   - of the native x86-64 build under qemu-x86_64 -cpu Haswell (AVX2, no AVX-512): must pick avx2;
#   - of the same build under qemu-x86_64 -cpu qemu64 (no AVX at all): must pick scalar;
#   - of an AArch64 cross build (g++-aarch64-linux-gnu) under qemu-aarch64: must pick neon.
# ROUNDPIPE_EXPECT_ISA makes the suite fail unless the dispatcher chose that ISA, and
# ROUNDPIPE_TEST_QUICK=1 drops the multi-million-element sizes (every kernel and flag still run).
# Needs qemu-user, g++-aarch64-linux-gnu and libgtest-dev (scripts/test.sh installs them) and the
# native build in build/py (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$(uname -m)" != x86_64 ]; then
  echo "== emulated runs skipped: they are set up for an x86-64 host"
  exit 0
fi
export ROUNDPIPE_TEST_QUICK=1
# fork() of a multi-threaded program crashes qemu-user itself (7.2: "qemu_plugin_vcpu_init_hook:
# assertion failed" in the child); those tests are about the pool, not the ISA, and run natively.
NOT_EMULATED="Threads.ForkDuringAStepLeavesTheChildUsable:Threads.ExitDuringAStepEndsTheProcessNormally"
native=build/py/cpp_tests/roundpipe_tests

run() {  # run LABEL EXPECTED_ISA COMMAND...
  local label=$1 expect=$2
  shift 2
  echo "== GoogleTest under $label (expects ISA $expect)"
  local start=$SECONDS
  # qemu warns about every host CPU feature TCG cannot emulate; those lines are noise here.
  ROUNDPIPE_EXPECT_ISA=$expect "$@" --gtest_brief=1 --gtest_filter="-$NOT_EMULATED" \
    2> >(grep -v "TCG doesn't support" >&2)
  echo "== $label: passed in $((SECONDS - start)) s"
}

run "qemu-x86_64 -cpu Haswell" avx2 qemu-x86_64 -cpu Haswell "$native"
run "qemu-x86_64 -cpu qemu64" scalar qemu-x86_64 -cpu qemu64 "$native"

echo "== cross-building for AArch64 (build/aarch64)"
.venv/bin/cmake -S . -B build/aarch64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DROUNDPIPE_BUILD_PYTHON=OFF -DROUNDPIPE_BUILD_TESTS=ON >/dev/null
.venv/bin/cmake --build build/aarch64 -j2 >/dev/null
run "qemu-aarch64" neon qemu-aarch64 -L /usr/aarch64-linux-gnu build/aarch64/cpp_tests/roundpipe_tests
