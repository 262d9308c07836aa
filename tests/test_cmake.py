"""The C++ build's configure step: GoogleTest is needed only when the tests are asked for
(ROUNDPIPE_BUILD_TESTS=ON); by default they are built when GoogleTest is found, and a status line
says which happened."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# cmake and ninja come with requirements-dev.txt (into the environment running the tests).
BIN = os.path.dirname(sys.executable)
CMAKE = shutil.which("cmake", path=BIN) or shutil.which("cmake")
NINJA = shutil.which("ninja", path=BIN) or shutil.which("ninja")
# Hides every GoogleTest this machine has: the installed package and the sources.
NO_GTEST = ["-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON", "-DROUNDPIPE_GTEST_SOURCE_DIR=/nonexistent"]

pytestmark = pytest.mark.skipif(CMAKE is None or NINJA is None, reason="needs cmake and ninja")


def configure(tmp_path, *args):
    build = tmp_path / "build"
    result = subprocess.run([CMAKE, "-S", ROOT, "-B", str(build), "-G", "Ninja",
                             f"-DCMAKE_MAKE_PROGRAM={NINJA}", *args],
                            capture_output=True, text=True, timeout=300)
    return result, build


def test_plain_configure_without_googletest_builds_the_library_and_says_so(tmp_path):
    result, build = configure(tmp_path, *NO_GTEST)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RoundPipe: C++ tests not built: GoogleTest not found" in result.stdout
    assert not (build / "cpp_tests").exists()


def test_tests_asked_for_without_googletest_is_a_clear_error(tmp_path):
    result, _ = configure(tmp_path, "-DROUNDPIPE_BUILD_TESTS=ON", *NO_GTEST)
    assert result.returncode != 0
    assert "ROUNDPIPE_BUILD_TESTS=ON but GoogleTest not found" in result.stderr
    assert "-DROUNDPIPE_BUILD_TESTS=OFF" in result.stderr


def test_plain_configure_with_googletest_builds_the_tests(tmp_path):
    if not (os.path.exists("/usr/include/gtest/gtest.h")
            or os.path.exists("/usr/src/googletest/CMakeLists.txt")):
        pytest.skip("no GoogleTest on this machine")
    result, build = configure(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RoundPipe: GoogleTest found, building the C++ tests" in result.stdout
    assert (build / "cpp_tests" / "CTestTestfile.cmake").exists()
